"""Every command that takes --format tsv prints its JSON document's fields as a header and one row (R3-11
of docs/reviews/reliability-3.md: tag, import and gc --dry-run printed nothing on stdout)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.store import open_store
from tests.fixtures_hub import db, hub_env, hub_server, run  # noqa: F401  (fixtures)
from tests.fixtures_store import make_store_artifact

VERSION_FIELDS = None  # import answers with the whole version document: checked against its --json keys


def _ref(store_db):
    with open_store(store_db) as store:
        return store.versions()[0].ref


# command line (REF, DB and TMP filled in), the header's fields, the field whose cell is checked and its value
STORE_COMMANDS = [
    pytest.param(["tag", "REF", "prod"], ["alias", "ref"], ("alias", "prod"), id="tag"),
    pytest.param(
        ["untag", "REF", "latest-but-one"],
        ["ref", "removed_alias"],
        ("removed_alias", "latest-but-one"),
        id="untag",
    ),
    pytest.param(["rm", "REF", "--force"], ["bytes", "ref", "removed"], ("removed", "true"), id="rm"),
    pytest.param(
        ["gc", "--dry-run"],
        ["artifacts", "bytes", "dry_run", "hub_cache", "hub_cache_skipped", "missing", "spools", "temporaries"],
        ("dry_run", "true"),
        id="gc-dry-run",
    ),
    pytest.param(["export", "REF", "TMP/out"], ["directory", "ref"], ("directory", "TMP/out"), id="export"),
    pytest.param(["import", "TMP/artifact"], VERSION_FIELDS, ("already_registered", "true"), id="import"),
    pytest.param(
        ["db", "current"],
        ["current", "head", "newer_than_kvhub", "up_to_date", "url"],
        ("up_to_date", "true"),
        id="db-current",
    ),
]


@pytest.mark.parametrize("command, fields, cell", STORE_COMMANDS)
def test_store_commands_print_tsv(tmp_path, command, fields, cell):
    store_db = tmp_path / "store" / "kvhub.db"
    artifact = make_store_artifact(tmp_path / "artifact", seed=1)
    with open_store(store_db) as store:
        store.tag(store.register(artifact), "latest-but-one")
    ref = _ref(store_db)

    def filled(args):
        return [a.replace("TMP", str(tmp_path)) if a != "REF" else ref for a in args]

    if fields is VERSION_FIELDS:
        as_json = CliRunner().invoke(main, [*filled(command), "--db", str(store_db), "--json"])
        fields = sorted(json.loads(as_json.stdout))
    result = CliRunner().invoke(
        main, [*filled(command), "--db", str(store_db), "--format", "tsv"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert header.split("\t") == fields and len(rows) == 1
    values = dict(zip(fields, rows[0].split("\t"), strict=True))
    assert values[cell[0]] == filled([cell[1]])[0]
    if "ref" in values:
        assert values["ref"] == ref


def test_push_and_pull_print_tsv(hub_env, db):  # noqa: F811
    with open_store(db) as store:
        ref = store.register(make_store_artifact(hub_env.tmp / "artifact", seed=1)).ref
    for args, cell in (
        (["push", ref, "--repo", "alice/kvmap-tsv"], ("tag", "v1")),
        (["pull", "alice/kvmap-tsv@v1"], ("already_registered", "true")),
    ):
        result = run(*args, "--db", db, "--format", "tsv")
        assert result.exit_code == 0, result.output
        header, *rows = result.stdout.splitlines()
        assert len(rows) == 1 and "ref" in header.split("\t")
        values = dict(zip(header.split("\t"), rows[0].split("\t"), strict=True))
        assert values[cell[0]] == cell[1] and values["ref"] == ref
