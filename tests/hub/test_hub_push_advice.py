"""What a push and a pull say and need around a publication (ux-3 U3-15, U3-16, U3-19): a published
version needs its Hub ids only once, a refresh links to where the new card is and names --revision when
it cannot go on the branch, a token given with --token is named as the one rejected, and a card without a
licence is pointed out."""

from __future__ import annotations

import json

import pytest

from kvhub.errors import HubAuthError, HubConflictError
from kvhub.store import open_store
from tests.fixtures_hub import make_artifact, run

pytestmark = pytest.mark.hub
LOCAL_SRC, LOCAL_DST = "/home/ann/work/fam/src", "/home/ann/work/fam/dst"
BASES = "acme/tiny-src,acme/tiny-dst"


def register_local(db: str, directory, *, seed: int):
    with open_store(db) as store:
        return store.register(make_artifact(directory, seed=seed, src=LOCAL_SRC, dst=LOCAL_DST, calibration="notes"))


def test_a_published_version_needs_its_hub_ids_once(hub_env, db):
    v1 = register_local(db, hub_env.tmp / "a1", seed=1)
    first = run("push", v1.ref, "--repo", "alice/kvmap", "--base-model", BASES, "--db", db)
    assert first.exit_code == 0, first.stderr
    again = run("push", v1.ref, "--repo", "alice/kvmap", "--db", db)
    assert again.exit_code == 0 and "already published" in again.stdout, again.stderr
    with open_store(db) as store:  # something new for the card to show
        store.add_metrics(v1, [{"name": "acc_own", "value": 0.5, "task": "hellaswag", "split": "eval", "n": 4}])
    refreshed = run("push", v1.ref, "--repo", "alice/kvmap", "--card", "replace", "--db", db, "--format", "json")
    assert refreshed.exit_code == 0, refreshed.stderr
    out = json.loads(refreshed.stdout)
    card = hub_env.server.file("alice/kvmap", "main", "README.md").decode()
    assert "acme/tiny-src" in card and LOCAL_SRC not in card
    assert out["card"] == "replaced" and out["url"].endswith("/tree/main")  # where the refreshed card is


def test_other_ids_on_a_re_push_are_said_to_change_nothing(hub_env, db):
    v1 = register_local(db, hub_env.tmp / "a1", seed=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--base-model", BASES, "--db", db).exit_code == 0
    again = run("push", v1.ref, "--repo", "alice/kvmap", "--base-model", "x/a,x/b", "--db", db)
    assert again.exit_code == 0 and "--base-model" in again.stderr


def test_refreshing_an_older_version_names_revision(hub_env, db):
    versions = [register_local(db, hub_env.tmp / f"a{seed}", seed=seed) for seed in (1, 2)]
    for version in versions:
        assert run("push", version.ref, "--repo", "alice/kvmap", "--base-model", BASES, "--db", db).exit_code == 0
    refused = run("push", versions[0].ref, "--repo", "alice/kvmap", "--card", "replace", "--db", db)
    assert refused.exit_code == HubConflictError.exit_code
    assert "--revision NEW-BRANCH" in refused.stderr


def test_a_rejected_token_option_is_named(hub_env, db, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    v1 = register_local(db, hub_env.tmp / "a1", seed=1)
    result = run(
        "push", v1.ref, "--repo", "alice/kvmap", "--base-model", BASES, "--token", "hf_wrongTOKEN0123456789", "--db", db
    )
    assert result.exit_code == HubAuthError.exit_code, result.output
    assert "--token" in result.stderr and "HF_TOKEN" not in result.stderr
    assert "hf_wrongTOKEN0123456789" not in result.stderr


def test_a_card_without_a_licence_is_pointed_out(hub_env, db):
    v1 = register_local(db, hub_env.tmp / "a1", seed=1)
    result = run("push", v1.ref, "--repo", "alice/kvmap", "--base-model", BASES, "--db", db)
    assert result.exit_code == 0, result.stderr
    assert "names no licence" in result.stderr and "--license" in result.stderr
    v2 = register_local(db, hub_env.tmp / "a2", seed=2)
    licensed = run(
        "push", v2.ref, "--repo", "alice/kvmap", "--base-model", BASES, "--license", "apache-2.0", "--db", db
    )
    assert licensed.exit_code == 0 and "licence" not in licensed.stderr
