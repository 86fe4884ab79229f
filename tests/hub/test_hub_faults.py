"""Faults between kvhub and the Hub: server errors and dropped connections during the commit, corrupted
downloads, conflicting tags and series, and a model card edited by hand on the Hub."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import HfApi

from kvhub.store import open_store
from tests.fixtures_hub import ALICE_TOKEN, register, run

pytestmark = pytest.mark.hub


def kvhub_commits(server, repo_id: str) -> list[dict]:
    return [c for c in server.repo(repo_id)["commits"].values() if c["title"].startswith("kvhub ")]


@pytest.mark.parametrize("kind, message", [("500", "failed on its side (500"), ("drop", "connection to")])
def test_failed_commit_records_nothing_and_a_retry_succeeds(hub_env, db, no_backoff_sleep, kind, message):
    server = hub_env.server
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    fault = server.add_fault(kind, "POST", "/commit/", times=100)  # outlasts the client's own 5 retries
    failed = run("push", v1.ref, "--repo", "alice/kvmap", "--db", db)
    assert failed.exit_code == 10
    assert message in failed.stderr and "not recorded as published" in failed.stderr
    assert fault.hits == 6  # the first try + huggingface_hub's 5 retries
    with open_store(db) as store:
        assert store.publications(v1) == []
    repo = server.repo("alice/kvmap")
    assert repo["tags"] == {} and kvhub_commits(server, "alice/kvmap") == []

    server.clear_faults()
    retried = run("push", v1.ref, "--repo", "alice/kvmap", "--db", db, "--json")
    assert retried.exit_code == 0, retried.stderr
    assert server.repo("alice/kvmap")["tags"]["v1"] == json.loads(retried.stdout)["commit_sha"]
    with open_store(db) as store:
        assert [p["revision"] for p in store.publications(v1)] == ["v1"]


def test_a_transient_500_is_retried_by_the_client_without_a_duplicate_commit(hub_env, db, no_backoff_sleep):
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    fault = hub_env.server.add_fault("500", "POST", "/commit/", times=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    assert fault.hits == 1 and len(kvhub_commits(hub_env.server, "alice/kvmap")) == 1


def test_commit_landed_but_tag_failed_retry_tags_without_a_new_commit(hub_env, db):
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    hub_env.server.add_fault("500", "POST", "/tag/", times=1)  # create_tag is not retried by the client
    failed = run("push", v1.ref, "--repo", "alice/kvmap", "--db", db)
    assert failed.exit_code == 10
    with open_store(db) as store:
        assert store.publications(v1) == []
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    repo = hub_env.server.repo("alice/kvmap")
    [commit] = kvhub_commits(hub_env.server, "alice/kvmap")
    assert repo["tags"]["v1"] == repo["branches"]["main"] and commit["title"].startswith("kvhub v1")


def test_corrupted_download_is_refused_and_leaves_nothing_behind(hub_env, db):
    server = hub_env.server
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    other = str(hub_env.tmp / "other.db")
    fault = server.add_fault("corrupt", "GET", "mapper.safetensors", times=1)
    bad = run("pull", "alice/kvmap@v1", "--db", other)
    assert fault.hits == 1
    assert bad.exit_code == 5 and "sha256" in bad.stderr
    with open_store(other) as store:
        assert store.versions() == []
        assert not any(p.is_file() for p in store.artifacts_dir.rglob("*") if p.name != ".lock")
    commit = server.repo("alice/kvmap")["tags"]["v1"]
    assert not list(hub_env.cache.glob(f"models--alice--kvmap/snapshots/{commit}"))
    assert not list(hub_env.cache.glob("models--alice--kvmap/blobs/*"))

    good = run("pull", "alice/kvmap@v1", "--db", other, "--json")  # downloads afresh instead of reusing bad bytes
    assert good.exit_code == 0, good.stderr
    with open_store(other) as store:
        assert [v.tensors_sha256 for v in store.versions()] == [v1.tensors_sha256]


def test_a_full_hugging_face_cache_is_refused_in_one_line(hub_env, db, monkeypatch):
    """Planted bug caught: huggingface_hub's `OSError: [Errno 28] No space left on device` from the download into
    HF_HUB_CACHE as a traceback."""
    import errno
    import os

    import huggingface_hub

    v1 = register(db, hub_env.tmp / "a1", seed=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0

    def full(*args, cache_dir=None, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(cache_dir, "blobs", "x.incomplete"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", full)
    other = str(hub_env.tmp / "other.db")
    refused = run("pull", "alice/kvmap@v1", "--db", other)
    assert refused.exit_code == 9, refused.stderr
    assert "Traceback" not in refused.output and "no space left on" in refused.stderr
    assert "HF_HUB_CACHE" in refused.stderr and "nothing was registered" in refused.stderr
    with open_store(other) as store:
        assert store.versions() == []


def test_hand_edited_card_is_kept_by_later_pushes_unless_replaced(hub_env, db):
    server = hub_env.server
    versions = [register(db, hub_env.tmp / f"a{i}", seed=i) for i in (1, 2, 3)]
    assert run("push", versions[0].ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    generated_v1 = server.file("alice/kvmap", "v1", "README.md")
    edited = generated_v1.decode().replace("It is an approximation", "Tested by ACME. It is an approximation")
    HfApi(endpoint=hub_env.endpoint, token=ALICE_TOKEN).upload_file(
        path_or_fileobj=edited.encode(), path_in_repo="README.md", repo_id="alice/kvmap", commit_message="edit card"
    )

    second = run("push", versions[1].ref, "--repo", "alice/kvmap", "--db", db, "--json")
    assert second.exit_code == 0, second.stderr
    assert json.loads(second.stdout)["card"] == "kept" and "edited on the Hub" in second.stderr
    assert server.file("alice/kvmap", "main", "README.md").decode() == edited
    assert server.file("alice/kvmap", "v2", "README.md").decode() == edited
    v2_json = json.loads(server.file("alice/kvmap", "v2", "mapper.json"))
    assert v2_json["tensors"]["sha256"] == versions[1].tensors_sha256
    assert server.file("alice/kvmap", "v1", "README.md") == generated_v1  # the old tag keeps its card

    third = run("push", versions[2].ref, "--repo", "alice/kvmap", "--card", "replace", "--db", db, "--json")
    assert json.loads(third.stdout)["card"] == "replaced"
    assert "(v3)" in server.file("alice/kvmap", "main", "README.md").decode()


def test_conflicting_tag_series_and_visibility_are_refused(hub_env, db):
    server = hub_env.server
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    elsewhere = str(hub_env.tmp / "elsewhere.db")
    theirs = register(elsewhere, hub_env.tmp / "b1", seed=9)  # another store's own v1 of the same series
    tag_clash = run("push", theirs.ref, "--repo", "alice/kvmap", "--db", elsewhere)
    assert tag_clash.exit_code == 15 and "tag v1" in tag_clash.stderr
    other_series = register(db, hub_env.tmp / "c1", seed=1, calibration="code")
    series_clash = run("push", other_series.ref, "--repo", "alice/kvmap", "--db", db)
    assert series_clash.exit_code == 15 and "repository of its own" in series_clash.stderr
    public = run("push", other_series.ref, "--repo", "alice/kvmap", "--private", "--db", db)
    assert public.exit_code == 15 and "public" in public.stderr
    assert list(server.repo("alice/kvmap")["tags"]) == ["v1"]
    with open_store(elsewhere) as store:
        assert store.publications(theirs) == []

    # the same weights already tagged on the Hub (e.g. pushed from another machine): recorded, no upload
    mirror = str(hub_env.tmp / "mirror.db")
    same = register(mirror, hub_env.tmp / "m1", seed=1)
    commits_before = len(server.repo("alice/kvmap")["commits"])
    adopted = run("push", same.ref, "--repo", "alice/kvmap", "--db", mirror, "--json")
    assert json.loads(adopted.stdout)["already_published"] is True
    assert len(server.repo("alice/kvmap")["commits"]) == commits_before
    with open_store(mirror) as store:
        assert [p["revision"] for p in store.publications(same)] == ["v1"]


def test_push_refuses_a_damaged_artifact_in_the_store(hub_env, db):
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    with open_store(db) as store:
        tensors = store.artifact_path(v1) / "mapper.safetensors"
    tensors.chmod(0o644)
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    result = run("push", v1.ref, "--repo", "alice/kvmap", "--db", db)
    assert result.exit_code == 5 and "sha256" in result.stderr
    assert "alice/kvmap" not in hub_env.server.state.repos
