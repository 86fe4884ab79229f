"""What the Hub shows and keeps: the card's model-index from the store's evaluations (read back with
huggingface_hub.ModelCard.load), license, datasets and base_model as Hub ids; pulls that keep the Hub's
version numbers."""

from __future__ import annotations

import json

import pytest

from kvhub.hub.card import base_models, model_card, read_front_matter
from kvhub.errors import ConfigError
from kvhub.core.mapper import Mapper, read_metadata
from kvhub.store import open_store
from tests.fixtures_hub import DST_ID, SRC_ID, make_artifact, push_two_versions, run

pytestmark = pytest.mark.hub
SERIES = f"{SRC_ID}:{DST_ID}:legal-docs"
EVALS = [
    ("retention", 0.93),
    ("acc_own", 0.6),
    ("acc_mapped", 0.56),
    ("acc_source", 0.4),
    ("gap_closed", 0.8),
    ("retention_ci_low", 0.9),
]


def _artifact(directory, *, seed: int, source: str = SRC_ID, target: str = DST_ID):
    """A small artifact whose calibration set has a licence and a Hub dataset source."""
    base = Mapper.load(make_artifact(directory.parent / f"{directory.name}-base", seed=seed))
    metadata = dict(base.metadata)
    metadata["source"] = dict(metadata["source"], model_id=source)
    metadata["target"] = dict(metadata["target"], model_id=target)
    metadata["calibration"] = dict(
        metadata["calibration"],
        licence="CC-BY-SA-4.0",
        sources=["hf:acme/legal-corpus:-:train {text}", "stdlib email/*.py"],
    )
    return Mapper(dict(base.tensors), metadata).save(directory)


def test_card_model_index_from_stored_evaluations_reads_back_with_modelcard_load(hub_env, db):
    from huggingface_hub import ModelCard, hf_hub_download

    with open_store(db) as store:
        version = store.register(_artifact(hub_env.tmp / "a", seed=1))
        variant = "hellaswag@exact_prefix=4,exact_suffix=16"
        store.add_metrics(
            version,
            [{"name": name, "value": value, "task": variant, "split": "eval", "n": 200} for name, value in EVALS],
        )
        store.add_metrics(
            version, [{"name": "retention", "value": 0.7, "task": "hellaswag", "split": "eval", "n": 200}]
        )
        store.add_metrics(
            version, [{"name": "speedup", "value": 12.5, "task": "bench:cpu:bfloat16:2048", "split": "bench", "n": 5}]
        )
    assert run("push", version.ref, "--repo", "alice/kvmap-card", "--db", db).exit_code == 0

    readme = hf_hub_download(
        "alice/kvmap-card", "README.md", revision="v1", endpoint=hub_env.endpoint, cache_dir=hub_env.cache
    )
    card = ModelCard.load(readme)
    assert card.data.license == "cc-by-sa-4.0" and card.data.datasets == ["acme/legal-corpus"]
    assert card.data.base_model == [SRC_ID, DST_ID]
    evals = {
        (r.dataset_type, r.metric_type, r.metric_config): r
        for r in card.data.eval_results
        if r.task_type == "kv-cache-transfer"
    }
    variant = "exact_prefix=4,exact_suffix=16"
    assert set(evals) == {("Rowan/hellaswag", name, variant) for name in ("retention", "acc_mapped", "gap_closed")} | {
        ("Rowan/hellaswag", "retention", "mapped"),
        ("Rowan/hellaswag", "acc_own", None),
        ("Rowan/hellaswag", "acc_source", None),
    }  # own and source once: the variant does not change them
    assert {r.dataset_split for r in evals.values()} == {"validation"}
    retention = evals[("Rowan/hellaswag", "retention", "exact_prefix=4,exact_suffix=16")]
    assert retention.metric_value == 0.93 and retention.metric_args == {
        "variant": "exact_prefix=4,exact_suffix=16",
        "n": 200,
    }
    assert "| cpu | bfloat16 | 2048 | map alone |" in card.text and "12.5" in card.text  # bench results in the body


def test_base_model_is_always_a_hub_id(tmp_path, hub_env, db):
    local = _artifact(
        tmp_path / "local", seed=2, source="/data/models/my-finetune-small", target="/data/models/my-finetune-large"
    )
    with pytest.raises(ConfigError, match=r"base_model=\(SRC_ID, DST_ID\)") as refused:
        base_models(read_metadata(local))
    assert "--" not in str(refused.value)  # a Python error names no CLI option
    known = read_metadata(
        _artifact(
            tmp_path / "known",
            seed=3,
            source="/root/.cache/kvhub/models/Qwen2.5-Coder-0.5B-Instruct",
            target="/srv/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        )
    )
    assert base_models(known) == ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct")
    with pytest.raises(ConfigError, match="not a Hub model id"):
        base_models(known, ("./here", "acme/large"))

    with open_store(db) as store:
        ref = store.register(local).ref
    refused = run("push", ref, "--repo", "alice/kv-local", "--db", db)
    assert refused.exit_code == ConfigError.exit_code and "--base-model SRC_ID,DST_ID" in refused.stderr
    assert "alice/kv-local" not in hub_env.server.state.repos  # refused before any Hub traffic
    pushed = run("push", ref, "--repo", "alice/kv-local", "--db", db, "--base-model", "acme/small,acme/large")
    assert pushed.exit_code == 0, pushed.stderr
    meta = read_front_matter(hub_env.server.file("alice/kv-local", "v1", "README.md").decode())
    assert meta["base_model"] == ["acme/small", "acme/large"]
    card = read_front_matter(model_card(known, repo_id="a/b", version_tag="v1"))
    assert card["base_model"] == ["Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct"]


def test_pull_keeps_the_hub_version_number_or_aliases_it(hub_env, db):
    v1, v2 = push_two_versions(hub_env, db)
    other = str(hub_env.tmp / "other.db")
    with open_store(other) as store:  # the store's own v1 of the series: the Hub's v1 must go elsewhere
        store.register(make_artifact(hub_env.tmp / "own", seed=5))

    first = json.loads(run("pull", "alice/kvmap@v2", "--db", other, "--json").stdout)
    assert (first["version"], first["alias"], first["ref"]) == (2, None, f"{SERIES}@v2")  # v2 was free
    second = json.loads(run("pull", "alice/kvmap@v1", "--db", other, "--json").stdout)
    assert (second["version"], second["alias"]) == (3, "hub-v1")  # v1 is taken here: the next number
    with open_store(other) as store:
        assert store.resolve(f"{SERIES}@v2").tensors_sha256 == v2.tensors_sha256
        hub_v1 = store.resolve(f"{SERIES}@hub-v1")
        assert hub_v1.tensors_sha256 == v1.tensors_sha256
        assert hub_v1.lineage["hub"] == {
            "repo_id": "alice/kvmap",
            "revision": "v1",
            "commit_sha": hub_env.server.repo("alice/kvmap")["tags"]["v1"],
        }
    human = run("pull", "alice/kvmap@v1", "--db", other)
    assert "already in the store" in human.stdout and "@hub-v1" in human.stdout


def test_licence_and_datasets_in_hub_terms(tmp_path):
    metadata = read_metadata(_artifact(tmp_path / "m", seed=4))
    psf = dict(
        metadata,
        calibration=dict(
            metadata["calibration"], licence="PSF-2.0 (Python documentation)", sources=["stdlib email/*.py"]
        ),
    )
    meta = read_front_matter(model_card(psf, repo_id="a/b", version_tag="v1"))
    assert "license" not in meta  # no Hub licence id: the publisher names one (license=, --license)
    assert "datasets" not in meta and "licence of the calibration text: PSF-2.0" in model_card(
        psf, repo_id="a/b", version_tag="v1"
    )


def _cache_config(cache, repo_id: str, config: dict) -> None:
    """``config`` as ``repo_id``'s config.json in a Hugging Face cache laid out as huggingface_hub leaves it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps(config))


def test_base_model_ids_are_checked_against_the_fingerprints(tmp_path, hub_env, db):
    """--base-model ids whose config kvhub can read offline (a shipped config, the Hugging Face cache) must
    have the mapper's layer count, KV heads, head dim and model type: the README's Qwen ids given for a
    2-layer tiny mapper are refused before any Hub traffic, naming both; ids whose cached config is the
    fingerprint's pass silently; ids with no config offline pass with a one-line note.

    Planted bugs caught: --base-model taken on trust (ux-4 U4-4: a tiny mapper published as Qwen 0.5B ->
    1.5B); only the source checked; a mismatch message naming one side; an unverifiable id refused, or
    accepted without a word; the check made after the upload."""
    local = _artifact(tmp_path / "local", seed=2, source="/data/models/small", target="/data/models/large")
    metadata = read_metadata(local)
    with open_store(db) as store:
        ref = store.register(local).ref

    real = "Qwen/Qwen2.5-Coder-0.5B-Instruct,Qwen/Qwen2.5-Coder-1.5B-Instruct"  # shipped: 24 layers, 2 x 64
    wrong = run("push", ref, "--repo", "alice/kv-checked", "--db", db, "--base-model", real)
    assert wrong.exit_code == ConfigError.exit_code
    message = " ".join(wrong.stderr.split())
    assert "source base model Qwen/Qwen2.5-Coder-0.5B-Instruct is not the model this mapper was fitted on" in message
    assert "24 layers, 2 KV heads of dim 64 (qwen2)" in message and "/data/models/small has" in message
    assert "--base-model SRC_ID,DST_ID" in message and "alice/kv-checked" not in hub_env.server.state.repos

    _cache_config(hub_env.cache, "acme/small", metadata["source"]["config"])
    _cache_config(hub_env.cache, "acme/large", dict(metadata["target"]["config"], num_hidden_layers=99))
    target_wrong = run("push", ref, "--repo", "alice/kv-checked", "--db", db, "--base-model", "acme/small,acme/large")
    assert target_wrong.exit_code == ConfigError.exit_code and "target base model acme/large" in target_wrong.stderr

    _cache_config(hub_env.cache, "acme/large2", metadata["target"]["config"])
    checked = run("push", ref, "--repo", "alice/kv-checked", "--db", db, "--base-model", "acme/small,acme/large2")
    assert checked.exit_code == 0, checked.stderr
    assert "could not check" not in checked.stderr

    unknown = run("push", ref, "--repo", "alice/kv-unchecked", "--db", db, "--base-model", "acme/small,acme/nowhere")
    assert unknown.exit_code == 0, unknown.stderr
    notes = [line for line in unknown.stderr.splitlines() if "could not check" in line]
    assert len(notes) == 1 and "acme/nowhere" in notes[0] and "acme/small" not in notes[0]


def test_loading_your_own_published_mapper_by_its_hub_ids_is_the_same_version(tmp_path, hub_env, db):
    """The publisher's store already holds the tensors it pushed under local paths; loading them back by
    the Hub ids they were published under (kvhub.load, from_pretrained, a second repository with other ids)
    returns that version, with the publications recorded on it, and makes no second series.

    Planted bugs caught: a pull matching identical tensors only under its own names (ux-4 U4-13: `kvhub list` showed
    three rows with the same tensors and text, metrics split across them)."""
    import kvhub
    from kvhub.api import Mapper as ApiMapper

    local = _artifact(tmp_path / "local", seed=6, source="/data/models/small", target="/data/models/large")
    with open_store(db) as store:
        ref = store.register(local).ref
    for repo, ids in (("alice/kv-own", "acme/small,acme/large"), ("alice/kv-own-2", "tiny/src,tiny/dst")):
        pushed = run("push", ref, "--repo", repo, "--db", db, "--base-model", ids)
        assert pushed.exit_code == 0, pushed.stderr

    loaded = kvhub.load("acme/small", "acme/large", hub_repo="alice/kv-own", db=db)
    assert loaded.ref == ref
    assert ApiMapper.from_pretrained("alice/kv-own-2@v1", db=db).ref == ref
    pulled = run("pull", "alice/kv-own@v1", "--db", db)
    assert pulled.exit_code == 0 and "already in the store" in pulled.stdout
    with open_store(db) as store:
        assert [v.ref for v in store.versions()] == [ref]
        assert {p["repo_id"] for p in store.publications(ref)} == {"alice/kv-own", "alice/kv-own-2"}


def test_pulling_a_mapper_that_names_local_paths_warns(tmp_path, hub_env, db, caplog):
    """An export uploaded by hand (`hf upload`) names the publisher's local paths, which `kvhub push` never
    publishes: the pull says so, naming them (ux-4 U4-24)."""
    import logging

    from huggingface_hub import HfApi

    local = _artifact(tmp_path / "local", seed=7, source="/home/ann/models/small", target="/home/ann/models/large")
    HfApi(endpoint=hub_env.endpoint).create_repo("alice/manual")
    HfApi(endpoint=hub_env.endpoint).upload_folder(repo_id="alice/manual", folder_path=str(local))
    with caplog.at_level(logging.WARNING, logger="kvhub"):
        pulled = run("pull", "alice/manual", "--db", str(tmp_path / "other.db"))
    assert pulled.exit_code == 0, pulled.stderr
    said = " ".join(caplog.text.split())
    assert "/home/ann/models/small" in said and "not published by `kvhub push`" in said
