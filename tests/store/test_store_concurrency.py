"""Many processes at once, and processes killed mid-registration, on SQLite and PostgreSQL.

Workers are separate processes forked from a fork server that imported kvhub.store once (never
torch), so 16 of them start in well under a second even on 2 cores.  They register artifact
directories the test built beforehand.  Each worker sends stderr to a file the test reads back.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest

from kvhub.store import open_store

WORKERS = 16
PAIR = "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct"


@pytest.fixture(scope="module")
def processes():
    """A multiprocessing context whose children start from a fork server with kvhub.store imported."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["kvhub.store", __name__])
    return context


def _stderr_to(path: Path) -> None:
    handle = open(path, "w")
    os.dup2(handle.fileno(), 2)
    sys.stderr = handle


# ---- worker bodies (run in the children) -------------------------------------------------------------
def _register_when_told(url, artifacts, artifact, stderr_path, ready, go, results) -> None:
    _stderr_to(stderr_path)
    try:
        store = open_store(url, artifacts_dir=artifacts)
        ready.put(os.getpid())
        go.wait()
        version = store.register(artifact, lineage={"worker": os.getpid()})
        results.put(("ok", version.version))
    except BaseException:  # noqa: BLE001 - the worker reports every failure to the test
        results.put(("error", traceback.format_exc()))


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _register_and_crash(url, artifacts, artifact, point, stderr_path) -> None:
    """SIGKILL this process at a precise step of the registration protocol."""
    import hashlib

    from kvhub.store import artifacts as artifacts_module
    from kvhub.store import store as store_module

    _stderr_to(stderr_path)
    if point == "mid-copy":  # half of the tensor file written under .tmp

        def copy(source, destination, **options):
            destination.parent.mkdir(parents=True, exist_ok=True)
            data = source.read_bytes()
            destination.write_bytes(data[: len(data) // 2])
            if source.name == "mapper.safetensors":
                _die()
            return hashlib.sha256(data).hexdigest()

        artifacts_module.copy_hashing = copy
    elif point == "before-commit":  # artifact in place, row inserted, transaction open
        insert = store_module.insert_version
        store_module.insert_version = lambda *args: (insert(*args), _die())
    elif point == "after-commit":  # row committed; register() never returns
        store_module.Store.get = lambda self, version_id: _die()
    open_store(url, artifacts_dir=artifacts).register(artifact)


def _register_until_killed(url, artifacts, paths, ready) -> None:
    """Register ``paths``, then keep re-registering them (each pass copies and checks again)."""
    store = open_store(url, artifacts_dir=artifacts)
    ready.put(os.getpid())
    while True:
        for path in paths:
            store.register(path)


# ---- checks ----------------------------------------------------------------------------------------
def _assert_consistent(store) -> list:
    """Every version row's artifact is complete and verifies byte for byte."""
    versions = store.versions()
    for version in versions:
        store.verify(version)
    return versions


def _assert_clean_after_gc(store):
    """gc, then nothing unreferenced is left and every referenced artifact still verifies."""
    report = store.gc()
    assert report.missing == []
    referenced = {v.artifact_location for v in _assert_consistent(store)}
    stored = {f"sha256/{p.parent.name}/{p.name}" for p in (store.artifacts_dir / "sha256").glob("*/*")}
    assert stored == referenced
    assert list((store.artifacts_dir / ".tmp").iterdir()) == []
    return report


# ---- tests -----------------------------------------------------------------------------------------
def test_concurrent_registrations_get_consecutive_versions(db_url, tmp_path, artifact_factory, processes):
    artifacts = tmp_path / "store-artifacts"
    with open_store(db_url, artifacts_dir=artifacts):
        pass  # create the schema once; the race under test is registration
    inputs = [artifact_factory(seed=seed) for seed in range(WORKERS)]
    ready, results, go = processes.Queue(), processes.Queue(), processes.Event()
    stderr = [tmp_path / f"stderr-{i}" for i in range(WORKERS)]
    workers = [
        processes.Process(
            target=_register_when_told, args=(db_url, artifacts, inputs[i], stderr[i], ready, go, results)
        )
        for i in range(WORKERS)
    ]
    for worker in workers:
        worker.start()
    pids = {ready.get(timeout=120) for _ in workers}
    started = time.monotonic()
    go.set()
    outcomes = [results.get(timeout=120) for _ in workers]
    elapsed = time.monotonic() - started
    for worker in workers:
        worker.join(timeout=60)
    assert len(pids) == WORKERS and [w.exitcode for w in workers] == [0] * WORKERS
    assert [kind for kind, _ in outcomes] == ["ok"] * WORKERS, outcomes
    assert [path.read_text() for path in stderr] == [""] * WORKERS  # nothing surfaced to the user
    numbers = sorted(number for _, number in outcomes)
    assert numbers == list(range(1, WORKERS + 1))
    with open_store(db_url, artifacts_dir=artifacts) as store:
        versions = _assert_consistent(store)
        assert sorted(v.version for v in versions) == numbers
        assert len({v.artifact_sha256 for v in versions}) == WORKERS
        assert store.resolve(f"{PAIR}@latest").version == WORKERS
        assert {v.aliases for v in versions if v.version < WORKERS} == {()}
    print(f"\n{WORKERS} concurrent registrations on {db_url.split(':')[0]}: {elapsed:.2f} s after the start signal")


def test_concurrent_first_opens_create_the_schema_once(db_url, tmp_path, artifact_factory, processes):
    artifact = artifact_factory(seed=1)
    ready, results, go = processes.Queue(), processes.Queue(), processes.Event()
    go.set()
    workers = [
        processes.Process(
            target=_register_when_told, args=(db_url, tmp_path / "a", artifact, tmp_path / f"e{i}", ready, go, results)
        )
        for i in range(4)
    ]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    assert outcomes == [("ok", 1)] * 4  # one schema, and the same artifact is one version


@pytest.mark.parametrize("point, rows", [("mid-copy", 0), ("before-commit", 0), ("after-commit", 1)])
def test_a_writer_killed_at_each_step_leaves_no_dangling_row(
    db_url, tmp_path, artifact_factory, processes, point, rows
):
    artifacts = tmp_path / "store-artifacts"
    with open_store(db_url, artifacts_dir=artifacts) as store:
        kept = store.register(artifact_factory(seed=100))
        worker = processes.Process(
            target=_register_and_crash, args=(db_url, artifacts, artifact_factory(seed=1), point, tmp_path / "err")
        )
        worker.start()
        worker.join(timeout=120)
        assert worker.exitcode == -signal.SIGKILL, (tmp_path / "err").read_text()
        assert len(_assert_consistent(store)) == 1 + rows
        assert bool(list((store.artifacts_dir / ".tmp").iterdir())) == (point == "mid-copy")
        assert len(store.gc(dry_run=True).artifacts) == (point == "before-commit")
        _assert_clean_after_gc(store)
        store.verify(kept)


def test_writers_killed_at_random_moments_leave_a_consistent_store(db_url, tmp_path, artifact_factory, processes):
    artifacts = tmp_path / "store-artifacts"
    rounds = int(os.environ.get("KVHUB_KILL_ROUNDS", "4"))
    rng, cleaned = random.Random(1234), 0
    with open_store(db_url, artifacts_dir=artifacts) as store:
        for round_ in range(rounds):
            inputs = [artifact_factory(seed=1000 * round_ + i, padding_mb=2) for i in range(4)]
            ready = processes.Queue()
            worker = processes.Process(target=_register_until_killed, args=(db_url, artifacts, inputs, ready))
            worker.start()
            ready.get(timeout=60)
            time.sleep(rng.uniform(0.0, 0.1))
            worker.kill()
            worker.join(timeout=60)
            _assert_consistent(store)
            report = _assert_clean_after_gc(store)
            cleaned += len(report.artifacts) + len(report.temporaries)
        registered = len(store.versions())
    print(
        f"\n{rounds} kills at random moments: {registered} of {4 * rounds} artifacts registered, "
        f"{cleaned} leftovers collected, store consistent after each"
    )
