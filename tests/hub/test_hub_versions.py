"""What a version tag and ``main`` hold follows the version pushed (ux-3 U3-4, U3-5): another version's
figures are neither kept on the branch by a push nor pulled as this version's, and weights published
under one tag are not tagged again under another number (which would move ``main`` back to them)."""

from __future__ import annotations

import json

import pytest

from kvhub.store import open_store
from tests.fixtures_hub import make_artifact, register, run

pytestmark = pytest.mark.hub


def tree(server, repo_id: str, revision: str) -> set[str]:
    repo = server.repo(repo_id)
    commit = repo["tags"].get(revision) or repo["branches"][revision]
    return set(repo["commits"][commit]["tree"])


def pulled_files(db: str, ref: str) -> set[str]:
    with open_store(db) as store:
        return {p.name for p in store.artifact_path(store.resolve(ref)).iterdir()}


def test_a_push_drops_the_older_versions_figures(hub_env, db):
    v1 = register(db, hub_env.tmp / "a1", seed=1, images=True)
    v2 = register(db, hub_env.tmp / "a2", seed=2)
    for version in (v1, v2):
        assert run("push", version.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    assert "heatmap.png" in tree(hub_env.server, "alice/kvmap", "v1")  # v1 keeps its own
    assert "heatmap.png" not in tree(hub_env.server, "alice/kvmap", "v2")
    other = str(hub_env.tmp / "other.db")
    pulled = run("pull", "alice/kvmap@v2", "--db", other, "--format", "json")
    assert pulled.exit_code == 0, pulled.stderr
    assert not any(name.endswith(".png") for name in pulled_files(other, json.loads(pulled.stdout)["ref"]))


def test_a_pull_takes_only_the_figures_the_card_shows(hub_env, db):
    from huggingface_hub import HfApi

    v1 = register(db, hub_env.tmp / "a1", seed=1, images=True)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    # an older kvhub left another version's figure on the branch
    HfApi(endpoint=hub_env.endpoint).upload_file(
        path_or_fileobj=b"\x89PNG\r\n\x1a\nstale", path_in_repo="old.png", repo_id="alice/kvmap"
    )
    other = str(hub_env.tmp / "other.db")
    pulled = run("pull", "alice/kvmap", "--db", other, "--format", "json")
    assert pulled.exit_code == 0, pulled.stderr
    files = pulled_files(other, json.loads(pulled.stdout)["ref"])
    assert "heatmap.png" in files and "old.png" not in files


def test_the_same_weights_under_another_number_are_not_tagged_again(hub_env, db):
    server = hub_env.server
    register(db, hub_env.tmp / "a1", seed=1)
    v2 = register(db, hub_env.tmp / "a2", seed=2)
    assert run("push", v2.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    main_before = server.repo("alice/kvmap")["branches"]["main"]
    # the same weights, imported into another store, are its v1
    other = str(hub_env.tmp / "other.db")
    with open_store(other) as store:
        imported = store.register(make_artifact(hub_env.tmp / "b2", seed=2))
    assert imported.version == 1
    again = run("push", imported.ref, "--repo", "alice/kvmap", "--db", other, "--format", "json")
    assert again.exit_code == 0, again.stderr
    out = json.loads(again.stdout)
    assert (out["tag"], out["already_published"]) == ("v2", True)
    repo = server.repo("alice/kvmap")
    assert set(repo["tags"]) == {"v2"} and repo["branches"]["main"] == main_before
    with open_store(other) as store:
        assert [p["revision"] for p in store.publications(imported)] == ["v2"]
    text = run("push", imported.ref, "--repo", "alice/kvmap", "--db", other)
    assert "already published as alice/kvmap@v2" in text.stdout


def test_weights_published_under_another_tag_win_over_a_taken_number(hub_env, db):
    """A store whose v1 holds the Hub's v2 (downloaded and imported) pushes to a repository that has v1 and v2:
    the weights are found under v2 before the numbers are compared, so the push is "already published as
    ...@v2", recorded, and the Hub is untouched; other weights under a taken number are still refused.

    Planted bugs caught: the tag-number check first (ux-4 U4-12: rc 15, "already has a tag v1 holding other
    weights" for weights that are there as v2); a new tag or a moved main for weights published already."""
    server = hub_env.server
    for seed in (1, 2):
        version = register(db, hub_env.tmp / f"a{seed}", seed=seed)
        assert run("push", version.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    before = json.dumps(server.repo("alice/kvmap"), sort_keys=True, default=str)
    other = str(hub_env.tmp / "other.db")
    with open_store(other) as store:
        imported = store.register(make_artifact(hub_env.tmp / "b2", seed=2))
    assert imported.version == 1
    again = run("push", imported.ref, "--repo", "alice/kvmap", "--db", other, "--format", "json")
    assert again.exit_code == 0, again.stderr
    out = json.loads(again.stdout)
    assert (out["tag"], out["already_published"]) == ("v2", True)
    assert json.dumps(server.repo("alice/kvmap"), sort_keys=True, default=str) == before
    with open_store(other) as store:
        assert [p["revision"] for p in store.publications(imported)] == ["v2"]
    third = str(hub_env.tmp / "third.db")
    with open_store(third) as store:
        stranger = store.register(make_artifact(hub_env.tmp / "c3", seed=3))
    refused = run("push", stranger.ref, "--repo", "alice/kvmap", "--db", third)
    assert refused.exit_code == 15 and "already has a tag v1 holding other weights" in refused.stderr
