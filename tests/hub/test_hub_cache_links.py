"""`kvhub gc --hub-cache` deletes only inside the Hugging Face cache, and reads a cached mapper.json only
through the cache's own links (a snapshot entry linking to a blob of its repository).

Whoever can write into a shared HF_HUB_CACHE can plant links in a cached snapshot: a file linked to
another user's file, a snapshot directory linked elsewhere, a mapper.json or a blob linked outside the
cache.  Such a revision is skipped whole, named with the planted path, on the dry run and the real run,
and the files outside survive.  Two revisions are cached, so huggingface_hub would delete the dropped one's
blobs one by one (the case where it unlinked whatever a link pointed to).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.fixtures_hub import push_two_versions, run

pytestmark = pytest.mark.hub

REPO = "models--alice--kvmap"


def _cached_v1_and_v2(hub_env, db) -> tuple[str, Path]:
    """(a store holding v1, v1's snapshot): v1 pulled into that store, v2 into another one."""
    push_two_versions(hub_env, db)
    held = str(hub_env.tmp / "held.db")
    for ref, store in (("alice/kvmap@v1", held), ("alice/kvmap@v2", str(hub_env.tmp / "other.db"))):
        pulled = run("pull", ref, "--db", store)
        assert pulled.exit_code == 0, pulled.stderr
    repo = hub_env.cache / REPO
    return held, repo / "snapshots" / (repo / "refs" / "v1").read_text().strip()


def _link_a_file(snapshot: Path, outside: Path) -> tuple[Path, list[Path]]:
    victim = outside / "victim.txt"
    victim.write_text("keep")
    (snapshot / "figure.png").symlink_to(victim)
    return snapshot / "figure.png", [victim]


def _link_the_snapshot(snapshot: Path, outside: Path) -> tuple[Path, list[Path]]:
    """The snapshot directory replaced by a link to a directory elsewhere holding the same (real) files."""
    moved = outside / "snapshot"
    moved.mkdir()
    for entry in snapshot.iterdir():
        shutil.copyfile(entry.resolve(), moved / entry.name)
    shutil.rmtree(snapshot)
    snapshot.symlink_to(moved, target_is_directory=True)
    return snapshot, sorted(moved.iterdir())


def _link_mapper_json(snapshot: Path, outside: Path) -> tuple[Path, list[Path]]:
    """mapper.json linked to an outside copy of itself: held by the store if it were read."""
    copy = outside / "mapper.json"
    shutil.copyfile((snapshot / "mapper.json").resolve(), copy)
    (snapshot / "mapper.json").unlink()
    (snapshot / "mapper.json").symlink_to(copy)
    return snapshot / "mapper.json", [copy]


def _link_the_blob(snapshot: Path, outside: Path) -> tuple[Path, list[Path]]:
    """The blob mapper.json links to, replaced by a link to an outside copy."""
    blob = (snapshot / "mapper.json").resolve()
    copy = outside / "blob.json"
    shutil.copyfile(blob, copy)
    blob.unlink()
    blob.symlink_to(copy)
    return snapshot / "mapper.json", [copy]


PLANTED = [
    pytest.param(_link_a_file, id="snapshot-file-linked-outside"),
    pytest.param(_link_the_snapshot, id="snapshot-directory-linked-outside"),
    pytest.param(_link_mapper_json, id="mapper-json-linked-outside"),
    pytest.param(_link_the_blob, id="blob-linked-outside"),
]


@pytest.mark.parametrize("plant", PLANTED)
def test_gc_hub_cache_deletes_nothing_through_a_planted_link(hub_env, db, plant):
    """A revision with a link out of the cache is skipped whole, named, and what lies outside survives.

    Planted bugs caught: deleting a link's target instead of the link (huggingface_hub's delete_revisions
    handed a revision with a foreign link); reading a mapper.json through a link to anywhere (the revision
    then counts as a held copy); checking the snapshot's files but not the snapshot directory or the blob
    they link to; a skip that does not name the planted path; a dry run that lists what the real run refuses."""
    held, snapshot = _cached_v1_and_v2(hub_env, db)
    outside = hub_env.tmp / "outside"
    outside.mkdir()
    planted, survivors = plant(snapshot, outside)
    before = {path: path.read_bytes() for path in survivors}

    dry = run("gc", "--hub-cache", "--dry-run", "--db", held, "--format", "json")
    assert dry.exit_code == 0, dry.stderr
    record = json.loads(dry.stdout)
    assert record["hub_cache"] == []
    [skipped] = record["hub_cache_skipped"]
    assert skipped["repo_id"] == "alice/kvmap" and skipped["path"] == str(planted)
    assert "nothing of it was read or deleted" in skipped["reason"]

    done = run("gc", "--hub-cache", "--db", held)
    assert done.exit_code == 0, done.stderr
    assert "removed 0 copies of pulled mappers" in done.stderr
    assert str(planted) in done.stderr and "warning:" in done.stderr
    assert {path: path.read_bytes() for path in survivors} == before  # nothing outside was touched
    assert os.path.lexists(snapshot)  # the revision was skipped, not half-deleted
    assert len(list((hub_env.cache / REPO / "snapshots").iterdir())) == 2


def test_gc_hub_cache_still_drops_a_plain_revision_beside_another(hub_env, db):
    """The control: the same two cached revisions without a planted link; v1's goes, v2's and its blobs stay.

    Planted bugs caught: a check so strict it refuses the cache's own layout (links into the repository's
    blobs/); deleting the other revision's blobs."""
    held, snapshot = _cached_v1_and_v2(hub_env, db)
    done = run("gc", "--hub-cache", "--db", held, "--format", "json")
    assert done.exit_code == 0, done.stderr
    record = json.loads(done.stdout)
    assert [c["repo_id"] for c in record["hub_cache"]] == ["alice/kvmap"] and record["hub_cache_skipped"] == []
    assert not os.path.lexists(snapshot)
    [left] = (hub_env.cache / REPO / "snapshots").iterdir()
    assert all(entry.resolve().is_file() for entry in left.iterdir())  # v2's blobs are whole


def test_a_link_planted_after_the_listing_stops_the_deletion(hub_env, db):
    """gc lists, then deletes: a link planted in between is found by the second check, and nothing goes.

    Planted bugs caught: checking the revisions only when listing them (the deletion rescans the cache)."""
    from kvhub.errors import HubError
    from kvhub.hub.cache import drop_copies, stored_copies
    from kvhub.store import open_store

    held, snapshot = _cached_v1_and_v2(hub_env, db)
    with open_store(held) as store:
        found = stored_copies(store, cache_dir=str(hub_env.cache))
    assert [c.repo_id for c in found.copies] == ["alice/kvmap"] and found.skipped == []
    outside = hub_env.tmp / "outside"
    outside.mkdir()
    planted, [victim] = _link_a_file(snapshot, outside)
    with pytest.raises(HubError, match=f"{planted} links to {victim}.*nothing was deleted"):
        drop_copies(found.copies, cache_dir=str(hub_env.cache))
    assert victim.read_text() == "keep" and os.path.lexists(planted)


def test_a_failed_pull_purges_only_the_repositorys_own_blobs(tmp_path):
    """A download that fails verification is purged: its own blobs go, a file a planted link points to stays,
    even in a folder named blobs elsewhere, and a snapshot that is a link is unlinked, not emptied.

    Planted bugs caught: deleting a link's target whenever its folder is named ``blobs``; emptying the
    directory a linked snapshot points to."""
    from kvhub.hub.pull import _purge_cached_snapshot

    repo = tmp_path / "hf-cache" / REPO
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("own blob")
    snapshot = repo / "snapshots" / ("c0ffee" * 6 + "abcd")
    snapshot.mkdir(parents=True)
    (snapshot / "mapper.json").symlink_to("../../blobs/abc")
    foreign = tmp_path / "elsewhere" / "blobs"
    foreign.mkdir(parents=True)
    (foreign / "victim").write_text("keep")
    (snapshot / "figure.png").symlink_to(foreign / "victim")
    _purge_cached_snapshot(snapshot)
    assert not os.path.lexists(snapshot) and not (repo / "blobs" / "abc").exists()
    assert (foreign / "victim").read_text() == "keep"

    linked = repo / "snapshots" / ("beef" * 10)
    linked.symlink_to(foreign, target_is_directory=True)
    _purge_cached_snapshot(linked)
    assert not os.path.lexists(linked) and (foreign / "victim").read_text() == "keep"
