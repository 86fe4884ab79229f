"""Series and versions in the store (ux-2 items): U8 (one calibration text
per series, `kvhub fit --name`), U12 (`latest` is the highest version, an older Hub tag pulled later
fills its own number), U13 (`show` keeps the newest value per metric), U20 (`kvhub list` before any
store), U21/U22 (advice the commands accept, removed series gone), U24 (`--min-metric` names and task
scoping), U25 (`kvhub diff`), U31 (one number format), and reliability-2 R16 (a read-only store)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.cli.output import format_number
from kvhub.errors import AmbiguousError, ConfigError, NotFoundError, StoreError
from kvhub.store import open_store
from tests.fixtures_store import make_store_artifact
from tests.fixtures_fit import tiny_fit_args

PAIR = "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """KVHUB_HOME in tmp_path with no store yet; the default location of every command below."""
    monkeypatch.setenv("KVHUB_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVHUB_DB_URL", raising=False)
    monkeypatch.delenv("KVHUB_ARTIFACTS", raising=False)
    from kvhub.cli.console import console

    monkeypatch.setattr(console, "_width", 200)
    return tmp_path / "home"


def cli(*args, expect: int = 0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == expect, result.output
    return result


def artifact(tmp_path: Path, seed: int, *, calibration: str = "legal-docs", text: str | None = None) -> Path:
    """A fixture artifact; ``text`` sets its calibration text's sha256 (``corpus_hash``)."""
    path = make_store_artifact(tmp_path / f"in-{seed}-{calibration}", seed=seed, calibration=calibration)
    if text is not None:
        metadata = json.loads((path / "mapper.json").read_text())
        metadata["calibration"].update(corpus_hash=text * 64, content_hash=f"{text}-{seed}")
        (path / "mapper.json").write_text(json.dumps(metadata))
    return path


# ---- U12: latest ------------------------------------------------------------------------------------
def test_an_older_hub_tag_pulled_last_keeps_its_number_and_never_becomes_latest(home, tmp_path):
    with open_store() as store:
        for seed, hub_number in ((2, 2), (3, 3), (1, 1)):  # pull @v2, pull main (v3), pull @v1
            store.register(artifact(tmp_path, seed), preferred_version=hub_number)
        numbers = {v.version: v.aliases for v in store.versions()}
        assert numbers == {1: (), 2: (), 3: ("latest",)}
        assert store.resolve(PAIR).version == 3  # the default load: the newest model
        store.remove(f"{PAIR}@v3")
        assert store.resolve(PAIR).version == 2
        fitted = store.register(artifact(tmp_path, 4))  # a fit still takes a number never used: v4
        assert fitted.version == 4 and store.resolve(PAIR).version == 4
        held = store.register(artifact(tmp_path, 5), preferred_version=2)  # v2 is held: the next one
        assert held.version == 5 and "latest" in held.aliases


# ---- U8: one calibration text per series -------------------------------------------------------------
def test_other_text_under_a_used_name_is_refused_and_names_the_option(home, tmp_path):
    with open_store() as store:
        store.register(artifact(tmp_path, 1, text="a"))
        assert store.register(artifact(tmp_path, 2, text="a")).version == 2  # same text, other samples
        with pytest.raises(ConfigError, match="--name") as refused:
            store.register(artifact(tmp_path, 3, text="b"))
        assert "another text" in str(refused.value)
        with pytest.raises(ConfigError, match="--name"):
            store.check_calibration_text(
                source="Qwen/Tiny-Coder-0.5B-Instruct",
                target="Qwen/Tiny-Coder-1.5B-Instruct",
                calibration="legal-docs",
                text_sha256="b" * 64,
            )
        assert store.register(artifact(tmp_path, 4, calibration="legal-b", text="b")).calibration == "legal-b"
        assert [v.version for v in store.versions(calibration="legal-docs")] == [1, 2]
        assert not list((store.artifacts_dir / ".tmp").iterdir())  # refused before anything was copied
    listed = cli("list", "--format", "tsv").stdout
    assert "a" * 64 in listed and "b" * 64 in listed  # the text's sha256 is listed


def test_fit_name_names_the_series_and_other_text_under_it_is_refused(
    home, tmp_path, tiny_model_dirs, text_corpus, monkeypatch
):
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    src, dst = tiny_model_dirs
    other = tmp_path / "other"
    other.mkdir()
    for i in range(40):
        (other / f"o{i:03d}.txt").write_text(f"o{i:03d} " * (25 + 3 * (i % 5)), encoding="utf-8")
    base = tiny_fit_args(src, dst, samples=8, seq_len=16, lambda_="1e-6")
    cli(*base, "--calib", text_corpus, "--name", "notes")
    assert [v["calibration"] for v in json.loads(cli("list", "--json").stdout)] == ["notes"]
    refused = cli(*base, "--calib", other, "--name", "notes", expect=ConfigError.exit_code)
    assert "--name" in refused.stderr and "another text" in refused.stderr
    assert len(json.loads(cli("list", "--json").stdout)) == 1
    cli(*base, "--calib", other, "--name", "bad:name", expect=ConfigError.exit_code)


# ---- U13 / U25 / U31: show, diff, numbers -----------------------------------------------------------
def test_show_has_the_newest_value_per_metric_and_history_on_request(home, tmp_path):
    with open_store() as store:
        version = store.register(artifact(tmp_path, 1))
        for value in (0.5, 0.6, 0.75):  # three reruns of one evaluation
            store.add_metrics(
                version,
                [
                    {"name": "retention", "value": value, "task": "hellaswag", "split": "eval"},
                    {"name": "n_items", "value": 256.0, "task": "hellaswag", "split": "eval"},
                ],
            )
    table = cli("show", PAIR).stdout
    assert table.count("retention") == 1 and "0.750" in table and "0.500" not in table
    assert cli("show", PAIR, "--history").stdout.count("retention") == 3
    shown = json.loads(cli("show", PAIR, "--json").stdout)
    assert [m["value"] for m in shown["metrics"] if m["name"] == "retention"] == [0.75]
    assert "metric.n_items.hellaswag\t256\n" in cli("show", PAIR, "--format", "tsv").stdout


def test_diff_compares_two_versions_side_by_side(home, tmp_path):
    with open_store() as store:
        store.register(artifact(tmp_path, 1))
        second = store.register(artifact(tmp_path, 2))
        store.add_metrics(second, [{"name": "heldout_r2_k_mean", "value": 0.95}])
    rows = {r["field"]: r for r in json.loads(cli("diff", f"{PAIR}@v1", f"{PAIR}@v2", "--json").stdout)["rows"]}
    assert rows["heldout_r2_k_mean"]["delta"] == pytest.approx(0.06) and rows["heldout_r2_k_mean"]["changed"]
    assert not rows["k"]["changed"] and rows["tensors sha256"]["changed"]
    table = cli("diff", f"{PAIR}@v1", f"{PAIR}@v2", "--layers").stdout
    assert "layer 0 sources" in table and "r2_k (heldout) layer 2" in table and "0.060" in table


def test_one_number_format():
    assert [format_number(v) for v in (1.0, 0.98553, 256.0, 12, 5e-4, None)] == [
        "1.000",
        "0.986",
        "256",
        "12",
        "5.00e-04",
        "",
    ]
    assert format_number(0.98553, exact=True) == "0.98553" and format_number(256.0, exact=True) == "256"


# ---- U20 / U21 / U22 / U24: listing and advice -------------------------------------------------------
def test_list_before_any_store_is_an_empty_listing(home, tmp_path):
    assert cli("list").exit_code == 0
    assert json.loads(cli("list", "--json").stdout) == []
    assert not home.exists()  # listing created nothing
    typo = tmp_path / "typo.db"
    assert "no kvhub store" in cli("list", "--db", typo, expect=NotFoundError.exit_code).stderr


def test_advice_is_what_the_commands_accept_and_removed_series_are_gone(home, tmp_path):
    with open_store() as store:
        store.register(artifact(tmp_path, 1))
        store.register(artifact(tmp_path, 2, calibration="chat"))
        store.register(artifact(tmp_path, 3, calibration="notes"))
    missing = cli("rm", f"{PAIR}:legal-docs@v9", expect=NotFoundError.exit_code).stderr
    assert "@latest" in missing and "leave the version out" not in missing
    cli("rm", f"{PAIR}:notes@latest")  # the advice works
    ambiguous = cli("show", PAIR, expect=AmbiguousError.exit_code).stderr
    assert "(chat, legal-docs)" in ambiguous and f"{PAIR}:chat" in ambiguous and "calib='" not in ambiguous
    assert "--calib" not in ambiguous  # show has no --calib (ux-3 U3-12)
    cli("rm", f"{PAIR}:chat@latest")
    assert json.loads(cli("show", PAIR, "--json").stdout)["calibration"] == "legal-docs"


def test_min_metric_names_known_metrics_and_scopes_to_a_task(home, tmp_path):
    with open_store() as store:
        first, second = store.register(artifact(tmp_path, 1)), store.register(artifact(tmp_path, 2))
        store.add_metrics(
            first,
            [
                {"name": "retention", "value": 0.95, "task": "hellaswag"},
                {"name": "retention", "value": 0.2, "task": "facts-1024"},
            ],
        )
        store.add_metrics(
            second,
            [
                {"name": "retention", "value": 0.5, "task": "hellaswag"},
                {"name": "retention", "value": 0.99, "task": "facts-1024"},
            ],
        )
    unknown = cli("list", "--min-metric", "r2=0.9", expect=ConfigError.exit_code).stderr
    assert "'r2'" in unknown and "heldout_r2_k_mean" in unknown and "retention" in unknown
    assert "facts-1024" in cli("list", "--min-metric", "retention@arc=0.9", expect=ConfigError.exit_code).stderr
    scoped = json.loads(cli("list", "--min-metric", "retention@hellaswag=0.9", "--json").stdout)
    assert [v["version"] for v in scoped] == [1]
    assert [v["version"] for v in json.loads(cli("list", "--min-metric", "retention=0.9", "--json").stdout)] == [1, 2]


# ---- R16: a read-only store -------------------------------------------------------------------------
def _two_versions(tmp_path) -> Path:
    db = tmp_path / "ro" / "kvhub.db"
    with open_store(db) as store:
        store.register(artifact(tmp_path, 1))
        store.register(artifact(tmp_path, 2))
    return db


def test_a_store_kvhub_may_not_write_is_read_read_only(home, tmp_path, monkeypatch):
    """Tests run as root, where chmod denies nothing: the permission check is what is replaced, and the
    connection SQLite then opens (mode=ro) refuses writes for root too."""
    import sqlalchemy

    import kvhub
    from kvhub.store import engine

    db = _two_versions(tmp_path)
    monkeypatch.setattr(engine, "_writable", lambda path: False)
    assert [v["version"] for v in json.loads(cli("list", "--db", db, "--json").stdout)] == [1, 2]
    assert "verified" in cli("show", f"{PAIR}@v1", "--verify", "--db", db).stderr
    assert kvhub.load("tiny-coder-0.5b-instruct", "tiny-coder-1.5b-instruct", db=db).ref.endswith("@v2")
    refused = cli("tag", f"{PAIR}@v1", "production", "--db", db, expect=StoreError.exit_code).stderr
    assert "read-only" in refused and "Traceback" not in refused
    with open_store(db) as store:
        assert store.read_only
        with pytest.raises(StoreError, match="read-only"):
            store.register(artifact(tmp_path, 3))
        with store._engine.connect() as connection, pytest.raises(sqlalchemy.exc.OperationalError, match="readonly"):
            connection.exec_driver_sql("DELETE FROM aliases")


@pytest.mark.skipif(
    os.geteuid() == 0,
    reason="root ignores file permissions; the test above covers the read-only "
    "connection through a replaced permission check",
)
def test_a_chmod_read_only_store_lists_shows_and_loads(home, tmp_path):
    import kvhub

    db = _two_versions(tmp_path)
    folders = [db.parent] + [p for p in db.parent.rglob("*") if p.is_dir()]
    for path in [db] + folders:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        assert len(json.loads(cli("list", "--db", db, "--json").stdout)) == 2
        cli("show", f"{PAIR}@v1", "--verify", "--db", db)
        assert kvhub.load("tiny-coder-0.5b-instruct", "tiny-coder-1.5b-instruct", db=db).ref.endswith("@v2")
        assert "read-only" in cli("rm", f"{PAIR}@v1", "--db", db, expect=StoreError.exit_code).stderr
    finally:
        for path in [db] + folders:
            path.chmod(path.stat().st_mode | 0o200)


def test_every_store_command_answers_in_json_with_the_full_ref(home, tmp_path):
    """U15: --format json / --json on tag, untag, export, import, rm, gc and db current, each naming the
    version by its full reference (planted bug: a command without the switch exits 2 'no such option')."""
    make_store_artifact(tmp_path / "a")
    imported = json.loads(cli("import", tmp_path / "a", "--format", "json").stdout)
    ref = imported["ref"]
    assert json.loads(cli("tag", ref, "production", "--json").stdout) == {"ref": ref, "alias": "production"}
    assert json.loads(cli("untag", ref, "production", "--json").stdout)["ref"] == ref
    assert json.loads(cli("export", ref, tmp_path / "out", "--json").stdout)["ref"] == ref
    assert json.loads(cli("rm", ref, "--json").stdout)["ref"] == ref
    assert "artifacts" in json.loads(cli("gc", "--dry-run", "--format", "json").stdout)
    assert "head" in json.loads(cli("db", "current", "--json").stdout)


def test_a_list_with_no_match_says_which_filter_left_nothing(home, tmp_path):
    """`kvhub list` that matches nothing says why in the store's terms: a threshold no version reaches names the
    threshold and how many versions it was checked against; only an empty store gets the first-run advice.

    Planted bugs caught: first-run advice (`fit one with kvhub fit`) for a store full of versions below a
    --min-metric (ux-4 U4-14); the count taken from the whole store instead of the versions the other filters
    kept; the threshold's task dropped from the message."""
    assert "fit one with `kvhub fit`" in cli("list").stderr  # a fresh install
    with open_store() as store:
        first = store.register(artifact(tmp_path, 1))
        store.register(artifact(tmp_path, 2))
        store.register(artifact(tmp_path, 3, calibration="chat"))
        store.add_metrics(first, [{"name": "retention", "value": 1.0, "task": "hellaswag"}])
    high = cli("list", "--min-metric", "retention@hellaswag=1.5", "--calib", "legal-docs")
    assert high.stdout == ""
    assert "none of the 2 versions has retention@hellaswag >= 1.5" in high.stderr, high.stderr
    assert "kvhub fit" not in high.stderr
    nothing = cli("list", "--calib", "no-such-set").stderr
    assert "none of the 3 versions in the store matches --calib no-such-set" in nothing, nothing
