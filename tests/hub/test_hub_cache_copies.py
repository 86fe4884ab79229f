"""A pulled mapper is on disk once if you ask (ux-3 U3-17): `kvhub gc --hub-cache` drops the Hugging Face
cache's copies of mappers the store holds, and only those."""

from __future__ import annotations

import json

import pytest

from kvhub.store import open_store
from tests.fixtures_hub import register, run

pytestmark = pytest.mark.hub


def snapshots(cache) -> list:
    return sorted(cache.glob("models--*/snapshots/*"))


def test_gc_drops_the_cached_copies_of_pulled_mappers(hub_env, db):
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    other = str(hub_env.tmp / "other.db")
    pulled = run("pull", "alice/kvmap", "--db", other, "--format", "json")
    assert pulled.exit_code == 0, pulled.stderr
    assert snapshots(hub_env.cache)  # the pull's download

    dry = run("gc", "--hub-cache", "--dry-run", "--db", other, "--format", "json")
    assert dry.exit_code == 0, dry.stderr
    [copy] = json.loads(dry.stdout)["hub_cache"]
    assert copy["repo_id"] == "alice/kvmap" and copy["bytes"] > 0 and snapshots(hub_env.cache)

    done = run("gc", "--hub-cache", "--db", other)
    assert done.exit_code == 0 and "copies of pulled mappers" in done.stderr
    assert not snapshots(hub_env.cache)
    with open_store(other) as store:  # the store's copy is whole
        version = store.resolve(json.loads(pulled.stdout)["ref"])
        assert (store.artifact_path(version) / "mapper.safetensors").is_file()


def test_a_copy_the_store_does_not_hold_stays(hub_env, db):
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    assert run("pull", "alice/kvmap", "--db", str(hub_env.tmp / "other.db")).exit_code == 0
    empty = str(hub_env.tmp / "empty.db")
    with open_store(empty):
        pass
    result = run("gc", "--hub-cache", "--db", empty, "--format", "json")
    assert result.exit_code == 0 and json.loads(result.stdout)["hub_cache"] == []
    assert snapshots(hub_env.cache)
