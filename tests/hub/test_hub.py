"""push / pull / search / load-with-fallback against the local Hub server, through the real
huggingface_hub client and the real ``kvhub`` CLI (click's CliRunner, one subprocess run)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvhub.store import open_store
from tests.fixtures_hub import ALICE_TOKEN, BOB_TOKEN, DST_ID, SRC_ID, make_artifact, push_two_versions, register, run

pytestmark = pytest.mark.hub


def publications(db: str, ref: str) -> list[dict]:
    with open_store(db) as store:
        return store.publications(ref)


def commits(server, repo_id: str) -> int:
    return len(server.repo(repo_id)["commits"])


def test_push_tags_records_and_second_push_is_a_noop(hub_env, db):
    server = hub_env.server
    v1 = register(db, hub_env.tmp / "a1", seed=1, images=True)
    result = run("push", v1.ref, "--repo", "alice/kvmap", "--db", db, "--format", "json")  # U15: one switch
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert (out["tag"], out["card"], out["already_published"]) == ("v1", "written", False)
    repo = server.repo("alice/kvmap")
    assert repo["tags"]["v1"] == repo["branches"]["main"] == out["commit_sha"]
    assert set(repo["commits"][out["commit_sha"]]["tree"]) == {
        ".gitattributes",
        "mapper.json",
        "mapper.safetensors",
        "README.md",
        "heatmap.png",
    }
    with open_store(db) as store:
        artifact = store.artifact_path(v1)
    assert server.file("alice/kvmap", "v1", "mapper.safetensors") == (artifact / "mapper.safetensors").read_bytes()
    card = server.file("alice/kvmap", "v1", "README.md").decode()
    assert "library_name: kvhub" in card and "![heatmap.png](heatmap.png)" in card
    [pub] = publications(db, v1.ref)
    assert (pub["repo_id"], pub["revision"], pub["commit_sha"]) == ("alice/kvmap", "v1", out["commit_sha"])
    assert pub["published_at"]

    before = len(server.requests)
    again = run("push", v1.ref, "--repo", "alice/kvmap", "--db", db)
    assert again.exit_code == 0 and "already published" in again.stdout
    assert len(server.requests) == before  # decided from the store record, no Hub traffic
    assert len(publications(db, v1.ref)) == 1


def test_every_version_stays_reachable_at_its_tag(hub_env, db):
    server = hub_env.server
    v1, v2 = push_two_versions(hub_env, db)
    repo = server.repo("alice/kvmap")
    assert repo["branches"]["main"] == repo["tags"]["v2"] != repo["tags"]["v1"]
    for version, tag in ((v1, "v1"), (v2, "v2")):
        remote = json.loads(server.file("alice/kvmap", tag, "mapper.json"))
        assert remote["tensors"]["sha256"] == version.tensors_sha256
        assert f"({tag})" in server.file("alice/kvmap", tag, "README.md").decode()  # each tag has its own card


def test_pull_at_tag_and_main_registers_with_provenance_idempotently(hub_env, db):
    v1, v2 = push_two_versions(hub_env, db)
    other = str(hub_env.tmp / "other.db")

    first = run("pull", "alice/kvmap@v1", "--db", other, "--format", "json")  # U15: one switch
    assert first.exit_code == 0, first.stderr
    info = json.loads(first.stdout)
    repo = hub_env.server.repo("alice/kvmap")
    assert (info["revision"], info["commit_sha"], info["already_registered"]) == ("v1", repo["tags"]["v1"], False)
    with open_store(other) as store:
        pulled = store.resolve(info["ref"])
        assert pulled.tensors_sha256 == v1.tensors_sha256
        assert pulled.lineage == {"hub": {"repo_id": "alice/kvmap", "revision": "v1", "commit_sha": repo["tags"]["v1"]}}
        assert [(p["repo_id"], p["revision"]) for p in store.publications(pulled)] == [("alice/kvmap", "v1")]

    again = run("pull", "alice/kvmap@v1", "--db", other, "--json")
    assert json.loads(again.stdout)["already_registered"] is True
    main_pull = json.loads(run("pull", "alice/kvmap", "--db", other, "--json").stdout)
    assert main_pull["revision"] == "v2"  # main's head carries tag v2: recorded as the stable name
    with open_store(other) as store:
        shas = sorted(v.tensors_sha256 for v in store.versions())
        assert shas == sorted([v1.tensors_sha256, v2.tensors_sha256])  # two versions, no duplicates


def test_pulled_mapper_can_be_aliased_loaded_and_pushed_elsewhere(hub_env, db):
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    other = str(hub_env.tmp / "other.db")
    ref = json.loads(run("pull", "alice/kvmap@v1", "--db", other, "--json").stdout)["ref"]
    with open_store(other) as store:
        store.tag(ref, "production")
        mapper_dir = store.artifact_path(f"{SRC_ID}:{DST_ID}:legal-docs@production")
    assert (mapper_dir / "mapper.safetensors").is_file()
    same_repo = run("push", ref, "--repo", "alice/kvmap", "--db", other)
    assert same_repo.exit_code == 0 and "already published as alice/kvmap@v1" in same_repo.stdout
    elsewhere = run("push", ref, "--repo", "alice/kvmap-mirror", "--db", other, "--json")
    assert elsewhere.exit_code == 0, elsewhere.stderr
    assert json.loads(elsewhere.stdout)["tag"] == "v1"
    mirror = json.loads(hub_env.server.file("alice/kvmap-mirror", "v1", "mapper.json"))
    assert mirror["tensors"]["sha256"] == v1.tensors_sha256


def test_search_lists_mappers_for_a_pair_from_card_metadata(hub_env, db, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich renders the table this wide
    register(db, hub_env.tmp / "a1", seed=1)
    register(db, hub_env.tmp / "c1", seed=3, calibration="code")
    register(db, hub_env.tmp / "r1", seed=4, src=DST_ID, dst=SRC_ID)  # the reverse pair
    for ref, repo in (
        (f"{SRC_ID}:{DST_ID}:legal-docs@v1", "alice/kv-legal"),
        (f"{SRC_ID}:{DST_ID}:code@v1", "alice/kv-code"),
        (f"{DST_ID}:{SRC_ID}:legal-docs@v1", "alice/kv-reverse"),
    ):
        assert run("push", ref, "--repo", repo, "--db", db).exit_code == 0, repo
    found = json.loads(run("search", "--src", SRC_ID, "--dst", DST_ID, "--json").stdout)
    assert sorted(m["repo_id"] for m in found) == ["alice/kv-code", "alice/kv-legal"]
    assert {m["calibration"] for m in found} == {"code", "legal-docs"}
    legal = json.loads(run("search", "--src", SRC_ID, "--dst", DST_ID, "--calib", "legal-docs", "--json").stdout)
    assert [(m["repo_id"], m["version"], m["k"]) for m in legal] == [("alice/kv-legal", "v1", 1)]
    assert legal[0]["metrics"]["heldout_r2_k_mean"] == pytest.approx(0.89)
    table = run("search", "--dst", SRC_ID)
    assert "alice/kv-reverse" in table.stdout and "alice/kv-legal" not in table.stdout
    assert "no kvhub mappers" in run("search", "--author", "bob").stderr


def test_load_falls_back_to_the_hub_then_uses_the_store(hub_env, db, monkeypatch):
    import kvhub

    v1 = register(db, hub_env.tmp / "a1", seed=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    fresh = str(hub_env.tmp / "fresh.db")
    mapper = kvhub.load(SRC_ID, DST_ID, calib="legal-docs", hub_repo="alice/kvmap@v1", db=fresh)
    expected = make_artifact(hub_env.tmp / "again", seed=1)
    with open_store(fresh) as store:
        assert [v.tensors_sha256 for v in store.versions()] == [v1.tensors_sha256]
    assert torch.equal(mapper.tensors["k.0.weight"], kvhub.Mapper.load(expected).tensors["k.0.weight"])
    before = len(hub_env.server.requests)
    kvhub.load(SRC_ID, DST_ID, hub_repo="alice/kvmap@v1", db=fresh)
    assert len(hub_env.server.requests) == before  # second load: straight from the store

    namespaced = str(hub_env.tmp / "ns.db")
    with pytest.raises(kvhub.errors.NotFoundError):
        kvhub.load(SRC_ID, DST_ID, db=namespaced)  # no hub_repo, no namespaces: the local miss stands
    monkeypatch.setenv("KVHUB_HUB_NAMESPACES", "bob, alice")
    by_short_names = kvhub.load(
        "tiny-coder-0.5b-instruct", "tiny-coder-1.5b-instruct", calib="legal-docs", db=namespaced
    )
    assert by_short_names.metadata["tensors"]["sha256"] == v1.tensors_sha256
    with pytest.raises(kvhub.errors.NotFoundError, match="bob, alice"):
        kvhub.load(SRC_ID, DST_ID, calib="code", db=str(hub_env.tmp / "ns2.db"))
    with pytest.raises(kvhub.errors.NotFoundError, match="v7"):
        kvhub.load(SRC_ID, DST_ID, version=7, db=str(hub_env.tmp / "ns3.db"))
    with pytest.raises(kvhub.errors.IncompatibleError, match="calibrated on 'legal-docs'"):
        kvhub.load(SRC_ID, DST_ID, calib="code", hub_repo="alice/kvmap", db=str(hub_env.tmp / "ns4.db"))
    with open_store(str(hub_env.tmp / "ns4.db")) as store:
        assert store.versions() == []  # checked before registering


def test_offline_uses_the_cache_and_a_miss_says_so(hub_env, db, go_offline, monkeypatch):
    import kvhub

    v1 = register(db, hub_env.tmp / "a1", seed=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    assert run("pull", "alice/kvmap", "--db", str(hub_env.tmp / "warm.db")).exit_code == 0  # fills the HF cache
    go_offline()
    before = len(hub_env.server.requests)
    monkeypatch.setenv("KVHUB_HUB_NAMESPACES", "alice")
    mapper = kvhub.load(SRC_ID, DST_ID, db=str(hub_env.tmp / "cold.db"))
    assert mapper.metadata["tensors"]["sha256"] == v1.tensors_sha256
    pulled = run("pull", "alice/kvmap", "--db", str(hub_env.tmp / "cold2.db"))
    assert pulled.exit_code == 0, pulled.stderr
    assert len(hub_env.server.requests) == before  # nothing left the machine

    miss = run("pull", "alice/never-pulled", "--db", db)
    assert miss.exit_code == 14 and "HF_HUB_OFFLINE=1" in miss.stderr and "not in the local cache" in miss.stderr
    assert run("push", v1.ref, "--repo", "alice/other", "--db", db).exit_code == 14
    assert run("search", "--src", SRC_ID).exit_code == 14
    with pytest.raises(kvhub.errors.NotFoundError, match="local Hugging Face cache"):
        kvhub.load(SRC_ID, DST_ID, calib="code", db=str(hub_env.tmp / "cold3.db"))


def test_private_repo_needs_the_owners_token_and_tokens_never_leak(hub_env, db, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)  # every log record of kvhub and huggingface_hub
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    pushed = run("-v", "push", v1.ref, "--repo", "alice/secret", "--private", "--db", db)
    assert pushed.exit_code == 0, pushed.stderr
    assert hub_env.server.repo("alice/secret")["private"] is True
    assert all(auth for method, path, auth in hub_env.server.requests if "secret" in path)
    other = str(hub_env.tmp / "other.db")

    monkeypatch.delenv("HF_TOKEN")
    anonymous = run("pull", "alice/secret@v1", "--db", other)
    assert anonymous.exit_code == 11 and "HF_TOKEN" in anonymous.stderr and "private" in anonymous.stderr
    assert run("search", "--src", SRC_ID, "--json").stdout.strip() == "[]"  # hidden from listings too

    monkeypatch.setenv("HF_TOKEN", BOB_TOKEN)
    bob = run("-v", "pull", "alice/secret@v1", "--db", other)
    assert bob.exit_code == 12 and "not found" in bob.stderr
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 11  # bob may not write there

    monkeypatch.setenv("HF_TOKEN", "hf_revokedTOKEN000000000000000000")
    rejected = run("-v", "pull", "alice/secret@v1", "--db", other)
    assert rejected.exit_code == 11 and "rejected the token" in rejected.stderr

    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN")  # `hf auth login` instead: the token file (patched to a temp path)
    Path(constants.HF_TOKEN_PATH).parent.mkdir(parents=True, exist_ok=True)
    Path(constants.HF_TOKEN_PATH).write_text(ALICE_TOKEN)
    alice = run("-v", "pull", "alice/secret@v1", "--db", other)
    assert alice.exit_code == 0, alice.stderr
    assert run("search", "--src", SRC_ID, "--json").stdout.count('"repo_id": "alice/secret"') == 1
    for result in (pushed, anonymous, bob, rejected, alice):
        for secret in (ALICE_TOKEN, BOB_TOKEN, "hf_revokedTOKEN000000000000000000"):
            assert secret not in result.stdout + result.stderr
    assert caplog.records and not any(t in caplog.text for t in (ALICE_TOKEN, BOB_TOKEN, "hf_revokedTOKEN"))


def test_missing_repo_and_revision_have_distinct_exit_codes(hub_env, db):
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    assert run("push", v1.ref, "--repo", "alice/kvmap", "--db", db).exit_code == 0
    no_repo = run("pull", "alice/nothing-here", "--db", db)
    assert no_repo.exit_code == 12 and "alice/nothing-here" in no_repo.stderr
    no_rev = run("pull", "alice/kvmap@v9", "--db", db)
    assert no_rev.exit_code == 13 and "'v9'" in no_rev.stderr and "it has tags v1 and branches main" in no_rev.stderr
    not_a_mapper = hub_env.server.state.create_repo("alice/plain", "alice", False)
    assert not_a_mapper and run("pull", "alice/plain", "--db", db).exit_code == 12
    assert run("pull", "not a repo", "--db", db).exit_code == 2


def test_push_to_a_branch_leaves_main_alone(hub_env, db):
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    result = json.loads(run("push", v1.ref, "--repo", "alice/kvmap", "--branch", "dev", "--db", db, "--json").stdout)
    repo = hub_env.server.repo("alice/kvmap")
    assert repo["branches"]["dev"] == repo["tags"]["v1"] == result["commit_sha"]
    assert "mapper.json" not in repo["commits"][repo["branches"]["main"]]["tree"]


def test_cli_subprocess_reads_hf_endpoint_at_import(hub_env, db):
    """The installed path: a fresh interpreter where huggingface_hub itself reads HF_ENDPOINT at import."""
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    code = "from kvhub.cli.main import main; main()"
    push = subprocess.run(
        [sys.executable, "-c", code, "push", v1.ref, "--repo", "alice/sub", "--db", db, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert push.returncode == 0, push.stderr
    assert hub_env.server.repo("alice/sub")["tags"]["v1"] == json.loads(push.stdout)["commit_sha"]
    assert ALICE_TOKEN not in push.stdout + push.stderr


def test_unreachable_hub_is_a_hub_error_not_a_miss(hub_env, db, monkeypatch):
    import socket

    with socket.socket() as probe:  # a port nothing listens on: connections are refused at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    v1 = register(db, hub_env.tmp / "a1", seed=1)
    pulled = run("pull", "alice/kvmap", "--db", db)
    assert pulled.exit_code == 10 and f"cannot reach http://127.0.0.1:{port}" in pulled.stderr
    pushed = run("push", v1.ref, "--repo", "alice/kvmap", "--db", db)
    assert pushed.exit_code == 10 and "connection to" in pushed.stderr and "not recorded as published" in pushed.stderr
