"""A full file system under the store or an export destination: one line naming the folder and the fix,
and `kvhub gc` still runs (R3-10 of docs/reviews/reliability-3.md).

The real case mounts a 1 MiB tmpfs (root only; skipped where mounting is not permitted) and fills it;
the always-run case makes the writes fail with ENOSPC / SQLite's "disk I/O error" instead."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.errors import StoreError
from kvhub.store import open_store
from tests.fixtures_store import make_store_artifact

PAIR = "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct:legal-docs"
NO_SPACE = "no space left on"
DEBRIS_BYTES = 200 << 10  # a killed write's leftover in .tmp: what gc frees


def cli(*args, expect: int = 0) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == expect, result.output
    assert "Traceback" not in result.output
    return result.output


def _fill(folder: Path) -> None:
    """Write until the file system holding ``folder`` has no block left."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\1" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs under tmp_path, unmounted afterwards; skips where mounting is not permitted."""
    mount_point = tmp_path / "full"
    mount_point.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture
def full_store(tiny_tmpfs, tmp_path) -> Path:
    """A store with one version (@v1) and 200 KB of leftovers on a tmpfs that is then filled up."""
    db = tiny_tmpfs / "store" / "kvhub.db"
    with open_store(db) as store:
        store.register(make_store_artifact(tmp_path / "a1", seed=1))
        leftover = store.artifacts_dir / ".tmp" / "killed-import"
    leftover.parent.mkdir(exist_ok=True)
    leftover.write_bytes(bytes(DEBRIS_BYTES))
    _fill(tiny_tmpfs)
    return db


# command, its arguments after the command name, exit code, text on stderr
STORE_ON_A_FULL_DISK = [
    pytest.param("tag", [f"{PAIR}@v1", "prod"], StoreError.exit_code, NO_SPACE, id="tag"),
    pytest.param("rm", [f"{PAIR}@v1"], StoreError.exit_code, NO_SPACE, id="rm"),
    pytest.param("import", ["{artifact}"], StoreError.exit_code, NO_SPACE, id="import"),
    pytest.param("list", [], 0, "", id="list-reads"),
    pytest.param("gc", ["--dry-run"], 0, "would remove 0 unreferenced artifacts and 1 leftovers", id="gc-dry-run"),
]


@pytest.mark.parametrize("command, args, exit_code, text", STORE_ON_A_FULL_DISK)
def test_a_store_on_a_full_tmpfs_says_no_space(full_store, tmp_path, command, args, exit_code, text):
    args = [str(make_store_artifact(tmp_path / "a2", seed=2)) if a == "{artifact}" else a for a in args]
    output = cli(command, *args, "--db", full_store, expect=exit_code)
    assert text in output
    if text == NO_SPACE:
        assert str(full_store.parent) in output and "kvhub gc" in output
        assert "check the URL" not in output


def test_gc_frees_a_full_tmpfs_and_writes_work_again(full_store):
    assert "removed 0 unreferenced artifacts and 1 leftovers" in cli("gc", "--db", full_store)
    assert "prod ->" in cli("tag", f"{PAIR}@v1", "prod", "--db", full_store)


def test_export_to_a_full_tmpfs_names_the_folder(tiny_tmpfs, tmp_path):
    db = tmp_path / "store" / "kvhub.db"
    with open_store(db) as store:
        store.register(make_store_artifact(tmp_path / "a1", seed=1, padding_mb=2))
    output = cli("export", f"{PAIR}@v1", tiny_tmpfs / "out", "--db", db, expect=StoreError.exit_code)
    assert f"{NO_SPACE} {tiny_tmpfs}" in output and "export to another directory" in output
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == []  # no half-written copy left behind


# ---- always run: the failing writes simulated ---------------------------------------------------
@pytest.fixture
def disk_reported_full(monkeypatch):
    """statvfs says no block is free (what a full file system reports)."""
    real = os.statvfs

    class Full:
        def __init__(self, path):
            stats = real(path)
            self.f_frsize, self.f_bavail = stats.f_frsize, 0

    monkeypatch.setattr(os, "statvfs", Full)


def test_export_enospc_is_a_store_error(tmp_path, monkeypatch):
    from kvhub.store import artifact_io

    db = tmp_path / "store" / "kvhub.db"
    with open_store(db) as store:
        store.register(make_store_artifact(tmp_path / "a1", seed=1))

    def no_space(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(artifact_io, "copy_hashing", no_space)
    output = cli("export", f"{PAIR}@v1", tmp_path / "dest" / "out", "--db", db, expect=StoreError.exit_code)
    assert f"{NO_SPACE} {tmp_path / 'dest'}" in output and "nothing was exported" in output
    assert list((tmp_path / "dest").iterdir()) == []


@pytest.mark.parametrize(
    "command, args, exit_code, text",
    [
        pytest.param("tag", [f"{PAIR}@v1", "prod"], StoreError.exit_code, NO_SPACE, id="tag-simulated"),
        pytest.param("gc", [], 0, "removed 0 unreferenced artifacts", id="gc-simulated"),
    ],
)
def test_sqlite_disk_io_error_on_a_full_disk(tmp_path, monkeypatch, disk_reported_full, command, args, exit_code, text):
    """SQLite cannot grow its -shm file on a full disk and says "disk I/O error": the store reopens
    read-only, writes say where space ran out, gc runs."""
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from kvhub.store import store as store_module
    from kvhub.store.engine import out_of_space_folder

    db = tmp_path / "store" / "kvhub.db"
    with open_store(db) as store:
        store.register(make_store_artifact(tmp_path / "a1", seed=1))
    real = store_module.ensure_schema

    def ensure_schema(engine, url):
        if out_of_space_folder(engine) is None:
            raise OperationalError("PRAGMA journal_mode=WAL", {}, sqlite3.OperationalError("disk I/O error"))
        return real(engine, url)

    monkeypatch.setattr(store_module, "ensure_schema", ensure_schema)
    output = cli(command, *args, "--db", db, expect=exit_code)
    assert text in output
    if text == NO_SPACE:
        assert str(db.parent) in output and "kvhub gc" in output
