"""A store whose database is writable but whose artifact directory is not (a read-only mount of it): the commands
that write artifacts are refused as read-only before they write, ``rm`` removes the version and leaves its
artifact for ``kvhub gc``, and ``gc --dry-run`` still answers.

The always-run case makes opening the lock file for writing fail with EROFS (what a read-only mount does);
the real case bind-mounts the artifact directory read-only (root only; skipped where mounting is not
permitted)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import types

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.errors import StoreError
from kvhub.store import artifacts as artifact_module
from kvhub.store import open_store
from tests.fixtures_store import make_store_artifact


def cli(*args, expect: int):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == expect, result.output
    assert "Traceback" not in result.output
    return result


@pytest.fixture
def store(tmp_path):
    """(db, the registered version's ref, another artifact to import, the artifact directory)."""
    db = tmp_path / "store" / "kvhub.db"
    with open_store(db) as opened:
        version = opened.register(make_store_artifact(tmp_path / "a1", seed=1))
        root = opened.artifacts_dir
    return db, version.ref, make_store_artifact(tmp_path / "a2", seed=2), root


def _lock_not_writable(monkeypatch, root) -> None:
    """Opening the store's lock file for writing fails as on a read-only mount; reading it works."""

    def open_(path, flags, *args):
        if os.fspath(path) == os.fspath(root / artifact_module.LOCK_FILE) and flags & (os.O_RDWR | os.O_WRONLY):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return os.open(path, flags, *args)

    proxy = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os) if not name.startswith("__")})
    proxy.open = open_
    monkeypatch.setattr(artifact_module, "os", proxy)


@pytest.fixture
def read_only_mount(store):
    """The store's artifact directory bind-mounted read-only over itself, unmounted afterwards."""
    root = store[3]
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root and mount(8)")
    steps = [["mount", "--bind", str(root), str(root)], ["mount", "-o", "remount,bind,ro", str(root)]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            subprocess.run(["umount", str(root)], capture_output=True)
            pytest.skip(f"a read-only bind mount is not permitted here: {done.stderr.strip()}")
    try:
        yield store
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def _check_the_commands(db, ref, other, caplog) -> None:
    refused = cli("import", other, "--db", db, expect=StoreError.exit_code)
    assert "is read-only" in refused.output and "OSError" not in refused.output
    assert "would remove" in cli("gc", "--dry-run", "--db", db, expect=0).output
    assert "is read-only" in cli("gc", "--db", db, expect=StoreError.exit_code).output
    with caplog.at_level("WARNING", logger="kvhub"):
        assert "removed" in cli("rm", ref, "--db", db, expect=0).output
    assert "left for `kvhub gc`" in caplog.text and "is read-only" in caplog.text
    with open_store(db) as opened:
        assert opened.versions() == []  # the removal happened, and said so


def test_a_read_only_artifact_directory_is_refused_as_read_only(store, monkeypatch, caplog):
    """Planted bugs caught: the lock opened read-only for every command (28b06e8), so import, gc and rm went on
    and ended in `OSError: [Errno 30] Read-only file system` at their first write; rm then reported a failure
    for a removal that had happened."""
    db, ref, other, root = store
    _lock_not_writable(monkeypatch, root)
    _check_the_commands(db, ref, other, caplog)


def test_a_read_only_mount_of_the_artifact_directory(read_only_mount, caplog):
    db, ref, other, _ = read_only_mount
    _check_the_commands(db, ref, other, caplog)
