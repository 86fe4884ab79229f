"""`kvhub gc` on a read-only store (R3-13 of docs/reviews/reliability-3.md): --dry-run only reads, so it
answers; a real gc would delete artifacts and stays refused.

Tests run as root, where chmod denies nothing: the permission check is replaced (as in tests/store/test_store_series.py)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.errors import StoreError
from kvhub.store import open_store
from tests.fixtures_store import make_store_artifact


@pytest.fixture
def read_only_db(tmp_path, monkeypatch):
    """A store holding one version and one unreferenced artifact (a removed version's), then read-only."""
    from kvhub.store import engine

    db = tmp_path / "ro" / "kvhub.db"
    with open_store(db) as store:
        kept = store.register(make_store_artifact(tmp_path / "a1", seed=1))
        removed = store.register(make_store_artifact(tmp_path / "a2", seed=2))
        store.tag(kept, "production")
        artifact = store.artifact_path(removed)
        shutil.copytree(artifact, tmp_path / "saved")
        store.remove(removed.ref)
    shutil.copytree(tmp_path / "saved", artifact)  # back, unreferenced: what gc would delete
    monkeypatch.setattr(engine, "_writable", lambda path: False)
    return db


# arguments, exit code, text in the output, JSON fields when --json
GC_ON_A_READ_ONLY_STORE = [
    pytest.param(["--dry-run"], 0, "would remove 1 unreferenced artifacts", id="gc-dry-run-answers"),
    pytest.param(["--dry-run", "--json"], 0, '"dry_run": true', id="gc-dry-run-json"),
    pytest.param([], StoreError.exit_code, "read-only", id="gc-still-refused"),
]


@pytest.mark.parametrize("args, exit_code, text", GC_ON_A_READ_ONLY_STORE)
def test_gc_on_a_read_only_store(read_only_db, args, exit_code, text):
    result = CliRunner().invoke(main, ["gc", *args, "--db", str(read_only_db)], catch_exceptions=False)
    assert result.exit_code == exit_code, result.output
    assert text in result.output and "Traceback" not in result.output
    if "--json" in args:
        assert len(json.loads(result.stdout)["artifacts"]) == 1
    with open_store(read_only_db) as store:  # nothing was deleted either way
        assert store.gc(dry_run=True).artifacts
