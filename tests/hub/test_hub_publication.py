"""What a publication carries (issue 22, ux-2): a mapper fitted from local folders is known by
the Hub ids given at push everywhere (U2, U3); every stored evaluation reaches the card, which a push
with --card replace or --figures refreshes (U9, U10, U11, U32); the publisher's licence (U19); --token
(U18); the PEFT keywords of the Python API (U7); why a fresh repo starts at v3 (U35); and
reliability-2 R20 (offline pull of a tag cached through main, one line per Hub warning, a 500's next step)."""

from __future__ import annotations

import io
import json
import logging

import pytest

import kvhub
from kvhub.api import Mapper
from kvhub.errors import ArtifactError, ConfigError
from kvhub.hub.card import read_front_matter
from kvhub.store import open_store
from tests.fixtures_hub import ALICE_TOKEN, make_artifact, run

pytestmark = pytest.mark.hub
LOCAL_SRC, LOCAL_DST = "/home/ann/work/fam/src", "/home/ann/work/fam/dst"
HUB_SRC, HUB_DST = "acme/tiny-src", "acme/tiny-dst"
SERIES = f"{HUB_SRC}:{HUB_DST}:corpus"


def local_artifact(directory, *, seed: int):
    """A mapper as `kvhub fit` leaves it when fitted from local folders: paths in model ids, tokenizer id
    and calibration sources."""
    base = Mapper.load(
        make_artifact(
            directory.parent / f"{directory.name}-base", seed=seed, src=LOCAL_SRC, dst=LOCAL_DST, calibration="corpus"
        )
    )
    metadata = dict(base.metadata)
    metadata["calibration"] = dict(
        metadata["calibration"],
        tokenizer_id=LOCAL_SRC,
        licence="unknown (user text)",
        sources=["path:/home/ann/work/corpus (40 documents)"],
    )
    metadata["metrics"] = dict(metadata["metrics"], train_tokens=288, heldout_tokens=72)
    return Mapper(dict(base.tensors), metadata).save(directory)


def register_local(db: str, directory, *, seed: int = 1):
    with open_store(db) as store:
        return store.register(local_artifact(directory, seed=seed))


def published_text(server, repo_id: str) -> str:
    """Every file of every commit of ``repo_id`` on the server, as text."""
    repo = server.repo(repo_id)
    return "\n".join(
        server.state.blob(oid).decode("utf-8", "replace")
        for commit in repo["commits"].values()
        for oid in commit["tree"].values()
    )


def card_at(hub_env, repo_id: str, revision: str):
    from huggingface_hub import ModelCard

    return ModelCard(hub_env.server.file(repo_id, revision, "README.md").decode())


def test_hub_ids_given_at_push_are_the_identity_everywhere(hub_env, db, monkeypatch):
    version = register_local(db, hub_env.tmp / "m")
    pushed = run("push", version.ref, "--repo", "alice/kvmap-tiny", "--base-model", f"{HUB_SRC},{HUB_DST}", "--db", db)
    assert pushed.exit_code == 0, pushed.stderr
    text = published_text(hub_env.server, "alice/kvmap-tiny")
    assert "/home/ann" not in text and "path:corpus (40 documents)" in text  # U3: no local path published
    card = card_at(hub_env, "alice/kvmap-tiny", "v1")
    assert f"# {HUB_SRC} → {HUB_DST} KV-cache mapper (v1)" in card.text and f"| source | `{HUB_SRC}` |" in card.text
    assert card.data.kvhub["source"]["model_id"] == HUB_SRC and card.data.base_model == [HUB_SRC, HUB_DST]
    remote = json.loads(hub_env.server.file("alice/kvmap-tiny", "v1", "mapper.json"))
    assert (remote["source"]["model_id"], remote["calibration"]["tokenizer_id"]) == (HUB_SRC, HUB_SRC)

    found = json.loads(run("search", "--src", HUB_SRC, "--format", "json").stdout)  # U2: search by Hub id
    assert [(m["repo_id"], m["source"], m["target"]) for m in found] == [("alice/kvmap-tiny", HUB_SRC, HUB_DST)]
    fresh = str(hub_env.tmp / "fresh.db")
    assert run("pull", "alice/kvmap-tiny", "--db", fresh).exit_code == 0
    listed = json.loads(run("list", "--src", HUB_SRC, "--db", fresh, "--format", "json").stdout)
    assert [row["ref"] for row in listed] == [f"{SERIES}@v1"]
    mapper = kvhub.load(HUB_SRC, HUB_DST, hub_repo="alice/kvmap-tiny", db=str(hub_env.tmp / "fresh2.db"))
    assert mapper.ref == f"{SERIES}@v1" and mapper.metadata["tensors"]["sha256"] == version.tensors_sha256
    monkeypatch.setenv("KVHUB_HUB_NAMESPACES", "alice")
    assert kvhub.load("tiny-src", "tiny-dst", db=str(hub_env.tmp / "fresh3.db")).ref == f"{SERIES}@v1"


def test_every_stored_evaluation_reaches_a_refreshed_card(hub_env, db, tmp_path):
    version = register_local(db, hub_env.tmp / "m")
    base = ["--repo", "alice/kvmap-evals", "--base-model", f"{HUB_SRC},{HUB_DST}", "--db", db]
    assert run("push", version.ref, *base).exit_code == 0
    first_tag = hub_env.server.repo("alice/kvmap-evals")["tags"]["v1"]
    with open_store(db) as store:  # evaluations stored after the push (kvhub eval's rows)
        store.add_metrics(
            version,
            [
                {"name": "acc_own", "value": 0.5, "task": "hellaswag", "split": "eval", "n": 8},
                {"name": "retention", "value": 0.9, "task": "hellaswag", "split": "eval", "n": 8},
                {"name": "retention_ci_low", "value": 0.7, "task": "hellaswag", "split": "eval", "n": 8},
                {"name": "retention_ci_high", "value": 1.0, "task": "hellaswag", "split": "eval", "n": 8},
                {"name": "ppl_mapped", "value": 31.5, "task": "ppl:lambada/64", "split": "eval", "n": 4},
                {"name": "ppl_no_context", "value": 88.0, "task": "ppl:lambada/64", "split": "eval", "n": 4},
                {"name": "ppl_mapped", "value": 12.25, "task": "ppl:calibration:corpus/24", "split": "eval", "n": 3},
                {"name": "acc_control", "value": 0.0, "task": "facts@exact_suffix=16", "split": "eval", "n": 2},
            ],
        )
    assert "already published" in run("push", version.ref, *base).stdout  # plain re-push: nothing to do
    figures = tmp_path / "report"
    figures.mkdir()
    (figures / "r2_heatmap.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(32))
    (figures / "report.md").write_text("not a figure")
    refreshed = run("push", version.ref, *base, "--card", "replace", "--figures", str(figures), "--json")
    assert refreshed.exit_code == 0, refreshed.stderr
    out = json.loads(refreshed.stdout)
    assert (out["card"], out["already_published"], out["tag"]) == ("replaced", True, "v1")
    repo = hub_env.server.repo("alice/kvmap-evals")
    assert repo["tags"]["v1"] == first_tag and repo["branches"]["main"] == out["commit_sha"]  # the tag stays
    assert set(repo["commits"][out["commit_sha"]]["tree"]) >= {"r2_heatmap.png", "README.md", "mapper.json"}
    assert "report.md" not in repo["commits"][out["commit_sha"]]["tree"]

    card = card_at(hub_env, "alice/kvmap-evals", "main")
    index = {(r.dataset_type, r.dataset_split, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert index == {
        ("Rowan/hellaswag", "validation", "acc_own"): 0.5,
        ("Rowan/hellaswag", "validation", "retention"): 0.9,
        ("EleutherAI/lambada_openai", "test", "ppl_mapped"): 31.5,
        ("EleutherAI/lambada_openai", "test", "ppl_no_context"): 88.0,
    }  # U10, U32: Hub ids, splits
    for row in (
        "| hellaswag | mapped | retention (mapped / own accuracy) | 0.900 | [0.700, 1.000] | 8 |",
        "| ppl:calibration:corpus/24 | mapped | perplexity, mapped cache | 12.250 |",
        "| facts | exact_suffix=16 | accuracy, control map (no information) | 0.000 |",
        "| ppl:lambada/64 | - | perplexity, no context | 88 |",
        "Fitted on 288 train tokens, checked on 72 held-out tokens",
        "![r2_heatmap.png](r2_heatmap.png)",
    ):
        assert row in card.text, row
    assert "| train_tokens |" not in card.text  # counts are no results (U32)
    again = run("push", version.ref, *base, "--card", "replace", "--json")
    assert json.loads(again.stdout)["card"] == "unchanged" and "up to date" in again.stderr

    v2 = register_local(db, hub_env.tmp / "m2", seed=2)
    assert run("push", v2.ref, *base).exit_code == 0
    stale = run("push", version.ref, *base, "--card", "replace")
    assert stale.exit_code == 15 and "holds other weights" in stale.stderr  # main describes v2 now
    own = run("push", version.ref, *base, "--card", "replace", "--revision", "card-v1", "--json")
    assert own.exit_code == 0, own.stderr
    assert hub_env.server.repo("alice/kvmap-evals")["branches"]["card-v1"] == json.loads(own.stdout)["commit_sha"]


def test_licence_is_the_publishers_choice(hub_env, db):
    version = register_local(db, hub_env.tmp / "m")
    base = ["--base-model", f"{HUB_SRC},{HUB_DST}", "--db", db]
    bad = run("push", version.ref, "--repo", "alice/kv-lic", *base, "--license", "other")
    assert bad.exit_code == 2 and "licence name" in bad.stderr and "alice/kv-lic" not in hub_env.server.state.repos
    ok = run(
        "push",
        version.ref,
        "--repo",
        "alice/kv-lic",
        *base,
        "--license",
        "other",
        "--license-name",
        "acme-research",
        "--license-link",
        "https://acme.example/licence",
    )
    assert ok.exit_code == 0, ok.stderr
    meta = read_front_matter(hub_env.server.file("alice/kv-lic", "v1", "README.md").decode())
    assert (meta["license"], meta["license_name"], meta["license_link"]) == (
        "other",
        "acme-research",
        "https://acme.example/licence",
    )
    mapper = Mapper.from_pretrained(version.ref, db=db)
    result = mapper.push_to_hub(
        "alice/kv-lic2", db=db, base_model=(HUB_SRC, HUB_DST), license="apache-2.0", commit_message="first mapper"
    )
    assert (
        read_front_matter(hub_env.server.file("alice/kv-lic2", "v1", "README.md").decode())["license"] == "apache-2.0"
    )
    assert hub_env.server.repo("alice/kv-lic2")["commits"][result.commit_sha]["title"] == "first mapper"


def test_token_option_on_push_pull_and_search(hub_env, db, monkeypatch):
    version = register_local(db, hub_env.tmp / "m")
    monkeypatch.delenv("HF_TOKEN")
    base = ["--base-model", f"{HUB_SRC},{HUB_DST}", "--db", db]
    assert run("push", version.ref, "--repo", "alice/kv-tok", "--private", *base).exit_code == 11  # no token
    pushed = run("push", version.ref, "--repo", "alice/kv-tok", "--private", *base, "--token", ALICE_TOKEN)
    assert pushed.exit_code == 0, pushed.stderr
    assert ALICE_TOKEN not in pushed.stdout + pushed.stderr
    assert json.loads(run("search", "--author", "alice", "--format", "json").stdout) == []  # private
    found = run("search", "--author", "alice", "--format", "json", "--token", ALICE_TOKEN)
    assert [m["repo_id"] for m in json.loads(found.stdout)] == ["alice/kv-tok"]
    pulled = run("pull", "alice/kv-tok", "--db", str(hub_env.tmp / "p.db"), "--token", ALICE_TOKEN)
    assert pulled.exit_code == 0, pulled.stderr


def test_python_api_takes_the_peft_keywords(hub_env, db, go_offline, tmp_path):
    import torch

    version = register_local(db, hub_env.tmp / "m")
    mapper = Mapper.from_pretrained(version.ref, db=db)
    with pytest.raises(ConfigError, match="repo_id") as refused:
        mapper.save_pretrained(tmp_path / "s", push_to_hub=True)
    assert "--" not in str(refused.value)
    mapper.save_pretrained(
        tmp_path / "s",
        push_to_hub=True,
        repo_id="alice/kv-py",
        base_model=(HUB_SRC, HUB_DST),
        db=db,
        revision="dev",
        commit_message="from python",
    )
    repo = hub_env.server.repo("alice/kv-py")
    assert repo["commits"][repo["branches"]["dev"]]["title"] == "from python" and "v1" in repo["tags"]
    mapper.save_pretrained(tmp_path / "s")  # an artifact directory is replaced
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="todo.txt") as refused:
        mapper.save_pretrained(tmp_path / "notes")
    assert "--" not in str(refused.value) and (tmp_path / "notes" / "todo.txt").read_text() == "mine"

    cache = tmp_path / "hf-cache-2"
    loaded = Mapper.from_pretrained(
        "alice/kv-py", revision="v1", cache_dir=cache, db=str(tmp_path / "a.db"), torch_dtype=torch.bfloat16
    )
    assert loaded.dtype == torch.bfloat16 and any(cache.glob("models--alice--kv-py"))
    by_ids = kvhub.load(
        HUB_SRC,
        HUB_DST,
        hub_repo="alice/kv-py",
        revision="v1",
        token=ALICE_TOKEN,
        cache_dir=cache,
        db=str(tmp_path / "b.db"),
    )
    assert by_ids.metadata["tensors"]["sha256"] == version.tensors_sha256
    with pytest.raises(ConfigError, match="torch_dtype"):
        kvhub.load(HUB_SRC, HUB_DST, db=str(tmp_path / "b.db"), dtype="float32", torch_dtype="bfloat16")
    go_offline()
    offline = Mapper.from_pretrained(
        "alice/kv-py@v1", local_files_only=True, cache_dir=cache, db=str(tmp_path / "c.db")
    )
    assert offline.metadata["tensors"]["sha256"] == version.tensors_sha256


def test_create_pr_opens_a_pull_request_and_tags_nothing(hub_env, db):
    version = register_local(db, hub_env.tmp / "m")
    result = Mapper.from_pretrained(version.ref, db=db).push_to_hub(
        "alice/kv-pr", db=db, base_model=(HUB_SRC, HUB_DST), create_pr=True
    )
    assert result.pull_request.endswith("/discussions/1")
    repo = hub_env.server.repo("alice/kv-pr")
    assert repo["tags"] == {} and result.commit_sha in repo["pull_requests"].values()
    with open_store(db) as store:
        assert store.publications(version) == []  # published once merged and pushed again


def test_a_fresh_repository_says_why_it_starts_at_v3(hub_env, db):
    versions = [register_local(db, hub_env.tmp / f"m{seed}", seed=seed) for seed in (1, 2, 3)]
    pushed = run("push", versions[2].ref, "--repo", "alice/kv-v3", "--base-model", f"{HUB_SRC},{HUB_DST}", "--db", db)
    assert pushed.exit_code == 0 and "starts at v3" in pushed.stderr and "store's version number" in pushed.stderr


def test_offline_pull_of_a_tag_cached_through_main(hub_env, db, go_offline):
    version = register_local(db, hub_env.tmp / "m")
    assert (
        run("push", version.ref, "--repo", "alice/kv-off", "--base-model", f"{HUB_SRC},{HUB_DST}", "--db", db).exit_code
        == 0
    )
    assert run("pull", "alice/kv-off", "--db", str(hub_env.tmp / "warm.db")).exit_code == 0  # main, which is v1
    go_offline()
    pulled = run("pull", "alice/kv-off@v1", "--db", str(hub_env.tmp / "cold.db"), "--json")
    assert pulled.exit_code == 0, pulled.stderr
    assert json.loads(pulled.stdout)["ref"] == f"{SERIES}@v1"


def test_a_hub_warning_is_printed_once_and_a_500_names_the_next_step(hub_env, db, monkeypatch, no_backoff_sleep):
    from kvhub.hub.client import hub_settings

    ours, theirs = io.StringIO(), io.StringIO()
    hub_logger = logging.getLogger("huggingface_hub")
    monkeypatch.setattr(hub_logger, "handlers", [logging.StreamHandler(theirs)])  # what its import adds
    root_handler = logging.StreamHandler(ours)
    logging.getLogger().addHandler(root_handler)  # what the CLI's basicConfig adds
    try:
        hub_settings()
        logging.getLogger("huggingface_hub.file_download").warning("Trying to resume download...")
    finally:
        logging.getLogger().removeHandler(root_handler)
    assert ours.getvalue().count("Trying to resume") == 1 and theirs.getvalue() == ""

    version = register_local(db, hub_env.tmp / "m")
    assert (
        run("push", version.ref, "--repo", "alice/kv-500", "--base-model", f"{HUB_SRC},{HUB_DST}", "--db", db).exit_code
        == 0
    )
    hub_env.server.add_fault("500", "GET", "/api/models/alice/kv-500", times=100)
    failed = run("pull", "alice/kv-500", "--db", str(hub_env.tmp / "p.db"))
    assert failed.exit_code == 10 and "retry in a few minutes" in failed.stderr


def test_a_series_next_version_and_a_refresh_keep_the_ids_and_licence_published(hub_env, db):
    """v1 pushed with --base-model and --license: v2 of the same series, pushed to the same repository with
    neither, is published under v1's Hub ids and licence (a note names where they came from); a card
    refresh of v1 keeps its licence; an explicit --license still wins; another repository inherits nothing.

    Planted bugs caught: the next version refused for local paths although the repository records the
    ids (ux-4 U4-3); its card, or v1's refreshed card, without the licence; the licence read from another
    repository's publication; the inherited choice made without a word; --license losing to the record."""
    v1 = register_local(db, hub_env.tmp / "m1", seed=1)
    v2 = register_local(db, hub_env.tmp / "m2", seed=2)
    v3 = register_local(db, hub_env.tmp / "m3", seed=3)
    first = run(
        "push",
        v1.ref,
        "--repo",
        "alice/kv-series",
        "--base-model",
        f"{HUB_SRC},{HUB_DST}",
        "--db",
        db,
        "--license",
        "apache-2.0",
    )
    assert first.exit_code == 0, first.stderr

    second = run("push", v2.ref, "--repo", "alice/kv-series", "--db", db)
    assert second.exit_code == 0, second.stderr
    assert "Hub ids acme/tiny-src, acme/tiny-dst and the licence apache-2.0 of alice/kv-series@v1" in second.stderr
    assert "names no licence" not in second.stderr
    remote = json.loads(hub_env.server.file("alice/kv-series", "v2", "mapper.json"))
    assert (remote["source"]["model_id"], remote["target"]["model_id"]) == (HUB_SRC, HUB_DST)
    assert (
        read_front_matter(hub_env.server.file("alice/kv-series", "v2", "README.md").decode())["license"] == "apache-2.0"
    )

    refreshed = run(
        "push", v2.ref, "--repo", "alice/kv-series", "--db", db, "--card", "replace", "--revision", "v2-card"
    )
    assert refreshed.exit_code == 0, refreshed.stderr
    card = read_front_matter(hub_env.server.file("alice/kv-series", "v2-card", "README.md").decode())
    assert card["license"] == "apache-2.0"

    third = run("push", v3.ref, "--repo", "alice/kv-series", "--db", db, "--license", "mit")
    assert third.exit_code == 0, third.stderr
    assert read_front_matter(hub_env.server.file("alice/kv-series", "v3", "README.md").decode())["license"] == "mit"

    elsewhere = run("push", v3.ref, "--repo", "alice/kv-other", "--db", db)
    assert elsewhere.exit_code == 2 and "--base-model SRC_ID,DST_ID" in elsewhere.stderr
