"""The store commands through the real ``kvhub`` group (CliRunner), on SQLite and PostgreSQL."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.errors import AmbiguousError, ConfigError, NotFoundError, StoreError
from kvhub.store import migrate

PAIR = "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct"


@pytest.fixture
def kvhub_cli(db_url, tmp_path, monkeypatch):
    """``kvhub_cli(*args)`` -> click Result, run against ``db_url`` with KVHUB_HOME in tmp_path."""
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVHUB_DB_URL", raising=False)
    monkeypatch.delenv("KVHUB_ARTIFACTS", raising=False)
    from kvhub.cli.console import console

    monkeypatch.setattr(console, "_width", 200)  # a wide terminal: table cells unwrapped
    runner = CliRunner()

    def run(*args: str, expect: int = 0):
        result = runner.invoke(main, [*map(str, args), "--db", db_url], catch_exceptions=False)
        assert result.exit_code == expect, result.output
        return result

    return run


def test_a_version_through_its_whole_life(kvhub_cli, artifact_factory, tmp_path):
    first, second = artifact_factory(seed=1), artifact_factory(seed=2)
    imported = json.loads(kvhub_cli("import", first, "--json").stdout)
    assert imported["version"] == 1 and imported["aliases"] == ["latest"]
    assert "registered" in kvhub_cli("import", second).stderr

    table = kvhub_cli("list").stdout
    assert f"{PAIR}:legal-docs@v1".lower() in table.lower() and "latest" in table
    listed = json.loads(kvhub_cli("list", "--json", "--min-metric", "heldout_r2_k_mean=0.5").stdout)
    assert [v["version"] for v in listed] == [1, 2] and {m["name"]: m["value"] for m in listed[0]["metrics"]}[
        "heldout_r2_k_mean"
    ] == 0.89

    kvhub_cli("tag", f"{PAIR}@v1", "production")
    shown = json.loads(kvhub_cli("show", PAIR, "--json").stdout)
    assert shown["version"] == 1 and shown["aliases"] == ["production"]
    assert shown["lineage"]["imported_from"] == str(first.resolve())
    assert shown["source_model"]["name"] == "Qwen/Tiny-Coder-0.5B-Instruct" and shown["metrics"]
    human = kvhub_cli("show", f"{PAIR}@v1", "--verify", "--layers")
    assert "selected layers" in human.stdout and "metrics" in human.stdout and "verified" in human.stderr

    refused = kvhub_cli("rm", f"{PAIR}@v1", expect=StoreError.exit_code)
    assert "production" in refused.stderr and "--force" in refused.stderr
    kvhub_cli("untag", PAIR, "production")
    kvhub_cli("rm", f"{PAIR}@v1")
    assert [v["version"] for v in json.loads(kvhub_cli("list", "--json").stdout)] == [2]

    kvhub_cli("export", f"{PAIR}@latest", tmp_path / "out")
    assert (tmp_path / "out" / "mapper.safetensors").is_file()
    report = json.loads(kvhub_cli("gc", "--dry-run", "--json").stdout)
    assert report["artifacts"] == [] and report["dry_run"] is True


def test_errors_exit_with_their_codes_and_say_what_to_do(kvhub_cli, artifact_factory):
    missing = kvhub_cli("show", PAIR, expect=NotFoundError.exit_code)
    assert "error:" in missing.stderr and "kvhub fit" in missing.stderr
    kvhub_cli("import", artifact_factory(seed=1))
    kvhub_cli("import", artifact_factory(seed=2, calibration="chat"))
    ambiguous = kvhub_cli("show", PAIR, expect=AmbiguousError.exit_code)
    assert "chat, legal-docs" in ambiguous.stderr
    kvhub_cli("list", "--min-metric", "r2", expect=ConfigError.exit_code)
    kvhub_cli("tag", f"{PAIR}:chat", "latest", expect=ConfigError.exit_code)
    kvhub_cli("show", "not-a-reference", expect=ConfigError.exit_code)


def test_db_commands_create_upgrade_and_report(kvhub_cli, db_url):
    migrate.upgrade(db_url, revision="0001_initial_schema")
    behind = json.loads(kvhub_cli("db", "current", "--json").stdout)
    assert behind["current"] == "0001_initial_schema" and behind["up_to_date"] is False
    refused = kvhub_cli("list", expect=StoreError.exit_code)
    assert "run `kvhub db upgrade`" in refused.stderr
    assert "upgraded" in kvhub_cli("db", "upgrade").stderr
    assert kvhub_cli("db", "current").stdout.strip() == f"{migrate.head_revision()} (head)"
    assert "already at" in kvhub_cli("db", "upgrade").stderr


def test_every_db_option_is_the_shared_one():
    import click

    from kvhub.cli.options import DB_HELP

    def commands(group, path=()):
        for name, command in group.commands.items():
            yield (*path, name), command
            if isinstance(command, click.Group):
                yield from commands(command, (*path, name))

    with_db = {
        " ".join(path): [p for p in command.params if "--db" in p.opts]
        for path, command in commands(main)
        if any("--db" in p.opts for p in command.params)
    }
    assert {"list", "show", "tag", "push", "pull", "fit", "db upgrade", "eval", "bench", "report", "serve"} <= set(
        with_db
    )
    for name, [option] in with_db.items():
        assert (option.help, option.metavar, option.default) == (DB_HELP, "URL", None), name
