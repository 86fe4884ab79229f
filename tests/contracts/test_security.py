"""Security fixes of issue 11, each reproducing an attack that worked before (docs/artifact-format.md,
threat model): symbolic links copied and published, paths from the database or mapper.json leaving the
store or the artifact, tokens in `-v` output; and the store/API behaviours that ended in tracebacks or
wrong advice (a commit reported as a failure, a newer database, the public functions turning into modules).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvhub.errors import ArtifactError, InvalidArtifactError, StoreError
from kvhub.core.mapper import Mapper
from kvhub.store import open_store
from tests.fixtures_store import make_store_artifact

SECRET = "TOP-SECRET-CONTENT-12345"


def cli(*args: str):
    from click.testing import CliRunner

    from kvhub.cli.main import main

    return CliRunner().invoke(main, list(args))


def _stored_dir(db: str, ref: str) -> Path:
    with open_store(db) as store:
        return store.artifacts_dir / store.resolve(ref).artifact_location


# ---- symbolic links ---------------------------------------------------------------------------------
def test_import_refuses_a_figure_that_links_to_a_secret(tmp_path):
    artifact = make_store_artifact(tmp_path / "m", seed=1)
    (tmp_path / "secret.txt").write_text(SECRET)
    (artifact / "leak.png").symlink_to(tmp_path / "secret.txt")
    db = str(tmp_path / "store" / "kvhub.db")
    result = cli("import", str(artifact), "--db", db)
    assert result.exit_code == 5 and "leak.png is a symbolic link" in result.output
    stored = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert not any(SECRET in p.read_text(errors="replace") for p in stored)


@pytest.mark.hub
def test_push_publishes_only_the_formats_files_and_never_a_planted_link(hub_env, db):
    server = hub_env.server
    artifact = make_store_artifact(hub_env.tmp / "m", seed=2)
    (artifact / "heatmap.png").write_bytes(b"\x89PNG\r\n\x1a\nfigure")
    (artifact / "notes.txt").write_text("local notes")  # kept by the store, not a file the format publishes
    assert cli("import", str(artifact), "--db", db).exit_code == 0
    ref = "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct@v1"
    assert cli("push", ref, "--repo", "alice/kv-ok", "--db", db).exit_code == 0
    tree = server.repo("alice/kv-ok")["commits"][server.repo("alice/kv-ok")["branches"]["main"]]["tree"]
    assert sorted(tree) == [".gitattributes", "README.md", "heatmap.png", "mapper.json", "mapper.safetensors"]
    # a link planted in the stored copy (by an older kvhub, or by hand) stops the push: nothing leaves
    stored = _stored_dir(db, ref)
    (hub_env.tmp / "secret.txt").write_text(SECRET)
    stored.chmod(0o755)
    (stored / "leak.png").symlink_to(hub_env.tmp / "secret.txt")
    result = cli("push", ref, "--repo", "alice/kv-leak", "--db", db)
    assert result.exit_code == 5 and "symbolic link" in result.output
    assert "alice/kv-leak" not in server.state.repos


def test_save_never_replaces_a_symlink_unless_asked_and_never_follows_it(tmp_path):
    mapper = Mapper.load(make_store_artifact(tmp_path / "m", seed=3))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing-here")
    with pytest.raises(ArtifactError, match="already exists"):
        mapper.save(tmp_path / "dangling")
    (tmp_path / "link").symlink_to(elsewhere)
    mapper.save(tmp_path / "link", overwrite=True)
    assert not (tmp_path / "link").is_symlink() and (tmp_path / "link" / "mapper.json").is_file()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]


def test_mapper_json_cannot_point_the_tensor_file_outside_the_artifact(tmp_path):
    artifact = make_store_artifact(tmp_path / "m", seed=4)
    (tmp_path / "outside.safetensors").write_bytes((artifact / "mapper.safetensors").read_bytes())
    (artifact / "mapper.safetensors").unlink()
    metadata = json.loads((artifact / "mapper.json").read_text())
    for name in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        metadata["tensors"]["file"] = name
        (artifact / "mapper.json").write_text(json.dumps(metadata))
        with pytest.raises(InvalidArtifactError, match="plain file name"):
            Mapper.load(artifact)


# ---- paths from the database --------------------------------------------------------------------------
@pytest.mark.parametrize("tamper", ["../../../victim", "ABSOLUTE", "sha256/ab/../../../../victim", "LINK"])
def test_rm_with_a_tampered_row_never_deletes_outside_the_store(tmp_path, tamper):
    db = str(tmp_path / "store" / "kvhub.db")
    assert cli("import", str(make_store_artifact(tmp_path / "m", seed=5)), "--db", db).exit_code == 0
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("precious")
    ref = "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct@v1"
    stored = _stored_dir(db, ref)
    location = {"ABSOLUTE": str(victim)}.get(tamper, tamper)
    if tamper == "LINK":  # a well-formed location whose directory was replaced by a link
        location = stored.relative_to(stored.parents[2]).as_posix()
        stored.parent.chmod(0o755)
        os.rename(stored, tmp_path / "moved")
        stored.symlink_to(victim)
    with sqlite3.connect(db) as connection:  # what anyone who can write a shared database can do
        connection.execute("UPDATE mapper_versions SET artifact_location = ?", (location,))
    shown = cli("show", ref, "--db", db)
    assert shown.exit_code == 9 and "Nothing was read or deleted" in shown.output
    with pytest.raises(StoreError):
        import kvhub

        kvhub.load("tiny-coder-0.5b-instruct", "tiny-coder-1.5b-instruct", db=db)
    removed = cli("rm", ref, "--db", db)
    assert removed.exit_code == 0, removed.output
    assert (victim / "precious.txt").read_text() == "precious"
    assert cli("gc", "--db", db).exit_code == 0 and (victim / "precious.txt").is_file()


def test_rm_that_committed_does_not_wait_for_a_stalled_registration(tmp_path):
    """An import stalled between copying and committing holds the writers' lock; rm removes the row at
    once and leaves the artifact to gc instead of failing after 120 s."""
    db = str(tmp_path / "store" / "kvhub.db")
    assert cli("import", str(make_store_artifact(tmp_path / "m", seed=6)), "--db", db).exit_code == 0
    ref = "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct@v1"
    held, release = threading.Event(), threading.Event()

    def stalled_writer():
        with open_store(db) as store, store._artifacts.writing():
            held.set()
            release.wait(30)

    writer = threading.Thread(target=stalled_writer)
    writer.start()
    try:
        held.wait(10)
        started = time.monotonic()
        result = cli("rm", ref, "--db", db)
        assert result.exit_code == 0 and time.monotonic() - started < 20
    finally:
        release.set()
        writer.join()
    assert json.loads(cli("list", "--db", db, "--json").stdout) == []
    collected = json.loads(cli("gc", "--db", db, "--json").stdout)
    assert len(collected["artifacts"]) == 1


def test_db_upgrade_of_a_newer_database_says_upgrade_kvhub(tmp_path):
    db = str(tmp_path / "kvhub.db")
    assert cli("db", "upgrade", "--db", db).exit_code == 0  # creates it (list never creates a store)
    with sqlite3.connect(db) as connection:
        connection.execute("UPDATE kvhub_alembic_version SET version_num = '0099_from_the_future'")
    upgraded = cli("db", "upgrade", "--db", db)
    assert upgraded.exit_code == 9 and "upgrade kvhub" in upgraded.output.lower()
    assert "newer than this kvhub" in cli("db", "current", "--db", db).output
    assert "upgrade kvhub" in cli("list", "--db", db).output.lower()


# ---- store limits before the copy (both databases) ------------------------------------------------------
def test_a_field_longer_than_its_column_is_refused_before_anything_is_copied(store, artifact_factory):
    artifact = artifact_factory(seed=7, metrics={"m" * 200: 0.5})
    with pytest.raises(InvalidArtifactError, match=r"`metrics\.m+` is 200 characters long") as refused:
        store.register(artifact)
    assert refused.value.field.startswith("metrics.")
    assert store.gc(dry_run=True).artifacts == [] and store.versions() == []
    with pytest.raises(Exception, match="at most 128"):
        store.register(artifact_factory(seed=8))
        store.add_metrics(store.versions()[0], [{"name": "x" * 129, "value": 1.0}])


# ---- logging and the public API (fresh interpreters: both depend on what was imported before) -----------
def _python(code: str, tmp_path: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={
            **os.environ,
            "KVHUB_HOME": str(tmp_path / "home"),
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        },
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_verbose_logs_debug_for_kvhub_only_never_http_headers(tmp_path):
    """httpcore logs raw response headers at DEBUG (a server may echo the token there); -v must not enable it."""
    code = (
        "import logging\nfrom kvhub.cli.main import main\n"
        "try:\n    main(['-v', 'list'])\nexcept SystemExit:\n    pass\n"
        "print(logging.getLogger('httpcore.http11').isEnabledFor(logging.DEBUG),"
        " logging.getLogger('huggingface_hub').isEnabledFor(logging.DEBUG),"
        " logging.getLogger('kvhub.store').isEnabledFor(logging.DEBUG))"
    )
    assert _python(code, tmp_path) == "False False True"


def test_fit_and_handoff_stay_functions_whatever_was_imported(tmp_path):
    code = (
        "import inspect\nfrom kvhub import fit\nimport kvhub, kvhub.fitting.fit, kvhub.serving.handoff\n"
        "from kvhub import handoff\n"
        "print(all(inspect.isfunction(f) for f in (fit, handoff, kvhub.fit, kvhub.handoff)))"
    )
    assert _python(code, tmp_path) == "True"


def test_the_store_and_the_hub_check_artifacts_without_torch(tmp_path):
    """kvhub.artifact (the format's one owner) is what the store and the Hub code run; none loads torch."""
    code = (
        "import sys\nimport kvhub.artifact, kvhub.store, kvhub.hub\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    assert _python(code, tmp_path) == "[]"


def test_the_cli_starts_without_torch(tmp_path):
    """Every command's module is imported to build the CLI; none may load torch or transformers at import
    (kvhub list / show / tag stay fast); they load on the first command that needs them."""
    code = "import sys\nimport kvhub.cli.main\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    assert _python(code, tmp_path) == "[]"


def test_a_token_logged_by_any_library_is_masked(monkeypatch, capsys):
    """R14: huggingface_hub (or a server it quotes) logging a token: the stderr line is masked."""
    import logging
    import sys

    from kvhub.hub.client import SecretFilter, install_secret_filter

    token = "hf_" + "A1b2C3d4" * 4
    monkeypatch.setenv("HF_TOKEN", token)
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(handler)
    try:
        install_secret_filter()
        assert any(isinstance(f, SecretFilter) for f in handler.filters)
        logging.getLogger("huggingface_hub.file_download").warning("server said: invalid token Bearer %s", token)
        logging.getLogger("py.warnings").warning("retrying with %s", token)  # where captured warnings go
        err = capsys.readouterr().err
        assert token not in err and "***" in err
        assert "server said" in err and "retrying" in err
    finally:
        logging.getLogger().removeHandler(handler)
        logging.captureWarnings(False)
