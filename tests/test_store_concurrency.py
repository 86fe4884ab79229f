"""Many processes at once, and processes killed mid-registration, on SQLite and PostgreSQL.

Workers are plain ``python -c`` processes that import kvhub.store only (no torch) and register
artifact directories the test built beforehand.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvhub.store import open_store

ROOT = Path(__file__).resolve().parents[1]
WORKERS = 16

_REGISTER = """
import json, os, sys, time
from kvhub.store import open_store
url, artifacts, artifact, ready, go = sys.argv[1:6]
store = open_store(url, artifacts_dir=artifacts)
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.002)
version = store.register(artifact, lineage={"worker": os.getpid()})
print(json.dumps({"id": version.id, "version": version.version}))
"""

# Crash points: the worker SIGKILLs itself at a precise moment of the registration protocol.
_CRASH = """
import os, signal, sys
from kvhub.store import open_store, store as store_module
from kvhub.store import artifacts as artifacts_module
url, artifacts, artifact, point = sys.argv[1:5]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if point == "mid-copy":            # half of the tensor file written into .tmp
    def copy(source, destination):
        destination.parent.mkdir(parents=True, exist_ok=True)
        data = open(source, "rb").read()
        with open(destination, "wb") as handle:
            handle.write(data[: len(data) // 2])
        if source.name == "mapper.safetensors":
            die()
        return artifacts_module.hashlib.sha256(data).hexdigest()
    artifacts_module.copy_hashing = copy
elif point == "before-commit":     # artifact in place, row inserted, transaction not committed
    original = store_module.insert_version
    def insert(*args):
        original(*args)
        die()
    store_module.insert_version = insert
elif point == "after-commit":      # row committed, register() never returns
    store_module.Store.get = lambda self, version_id: die()
open_store(url, artifacts_dir=artifacts).register(artifact)
"""

_LOOP = """
import sys
from kvhub.store import open_store
url, artifacts, *paths = sys.argv[1:]
store = open_store(url, artifacts_dir=artifacts)
print("ready", flush=True)
for path in paths:
    store.register(path)
"""


def _python(code: str, *args, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _assert_consistent(store) -> list:
    """Every version row's artifact is complete and verifies byte for byte."""
    versions = store.versions()
    for version in versions:
        store.verify(version)
    return versions


def _assert_clean_after_gc(store) -> None:
    report = store.gc()
    assert report.missing == []
    referenced = {v.artifact_location for v in _assert_consistent(store)}
    stored = {f"sha256/{p.parent.name}/{p.name}" for p in (store.artifacts_dir / "sha256").glob("*/*")}
    assert stored == referenced
    assert list((store.artifacts_dir / ".tmp").iterdir()) == []


def test_concurrent_registrations_get_consecutive_versions(db_url, tmp_path, artifact_factory):
    artifacts = tmp_path / "store-artifacts"
    with open_store(db_url, artifacts_dir=artifacts):
        pass  # create the schema once; the race under test is registration
    inputs = [artifact_factory(seed=seed) for seed in range(WORKERS)]
    go = tmp_path / "go"
    ready = [tmp_path / f"ready-{i}" for i in range(WORKERS)]
    workers = [_python(_REGISTER, db_url, artifacts, inputs[i], ready[i], go) for i in range(WORKERS)]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready):
        assert time.monotonic() < deadline and all(w.poll() is None for w in workers), "a worker died early"
        time.sleep(0.01)
    started = time.monotonic()
    go.touch()
    results = [w.communicate(timeout=120) for w in workers]
    elapsed = time.monotonic() - started
    for worker, (out, err) in zip(workers, results):
        assert worker.returncode == 0 and err == "", err
    numbers = sorted(json.loads(out)["version"] for out, _ in results)
    assert numbers == list(range(1, WORKERS + 1))
    with open_store(db_url, artifacts_dir=artifacts) as store:
        versions = _assert_consistent(store)
        assert sorted(v.version for v in versions) == numbers
        assert len({v.artifact_sha256 for v in versions}) == WORKERS
        assert store.resolve("tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct@latest").version == WORKERS
        assert {tuple(v.aliases) for v in versions if v.version < WORKERS} == {()}
    print(f"\n{WORKERS} concurrent registrations on {db_url.split(':')[0]}: {elapsed:.2f} s after the start signal")


def test_concurrent_first_opens_create_the_schema_once(db_url, tmp_path, artifact_factory):
    artifact = artifact_factory(seed=1)
    go = tmp_path / "go"
    go.touch()
    workers = [_python(_REGISTER, db_url, tmp_path / "a", artifact, tmp_path / f"r{i}", go) for i in range(4)]
    results = [w.communicate(timeout=120) for w in workers]
    assert [w.returncode for w in workers] == [0] * 4, [err for _, err in results]
    assert {json.loads(out)["version"] for out, _ in results} == {1}  # the same artifact: one version


@pytest.mark.parametrize("point, rows", [("mid-copy", 0), ("before-commit", 0), ("after-commit", 1)])
def test_a_writer_killed_at_each_step_leaves_no_dangling_row(db_url, tmp_path, artifact_factory, point, rows):
    artifacts = tmp_path / "store-artifacts"
    with open_store(db_url, artifacts_dir=artifacts) as store:
        kept = store.register(artifact_factory(seed=100))
        worker = _python(_CRASH, db_url, artifacts, artifact_factory(seed=1), point)
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == -signal.SIGKILL, err
        versions = _assert_consistent(store)
        assert len(versions) == 1 + rows
        leftovers = list((store.artifacts_dir / ".tmp").iterdir())
        assert bool(leftovers) == (point == "mid-copy")
        orphans = store.gc(dry_run=True).artifacts
        assert len(orphans) == (point == "before-commit")
        _assert_clean_after_gc(store)
        store.verify(kept)


def test_writers_killed_at_random_moments_leave_a_consistent_store(db_url, tmp_path, artifact_factory):
    artifacts = tmp_path / "store-artifacts"
    rounds = int(os.environ.get("KVHUB_KILL_ROUNDS", "3"))
    rng = random.Random(1234)
    inputs = [artifact_factory(seed=seed, padding_mb=4) for seed in range(6)]
    with open_store(db_url, artifacts_dir=artifacts) as store:
        for _ in range(rounds):
            worker = _python(_LOOP, db_url, artifacts, *inputs)
            assert worker.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.25))
            worker.kill()
            worker.communicate(timeout=60)
            _assert_consistent(store)
            _assert_clean_after_gc(store)
        registered = len(store.versions())
    print(f"\n{rounds} kills at random moments: {registered} of {len(inputs)} artifacts registered, store consistent")
