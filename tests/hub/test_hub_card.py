"""The model card and the checks a pulled artifact must pass (no server needed)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvhub.hub.card import card_is_pristine, model_card, read_front_matter
from kvhub.errors import ConfigError, FormatVersionError, IncompatibleError, IntegrityError
from kvhub.hub import parse_repo_ref, verify_artifact
from kvhub.core.mapper import read_metadata
from tests.fixtures_hub import DST_ID, SRC_ID, make_artifact

pytestmark = pytest.mark.hub


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return make_artifact(tmp_path_factory.mktemp("card") / "a", seed=1, images=True)


def test_front_matter_follows_hub_conventions(artifact):
    metadata = read_metadata(artifact)
    card = model_card(metadata, repo_id="acme/kvmap", version_tag="v3")
    meta = read_front_matter(card)
    assert meta["library_name"] == "kvhub"
    assert meta["base_model"] == [SRC_ID, DST_ID] and meta["base_model_relation"] == "adapter"
    assert meta["tags"] == ["kvhub", "kv-cache", "qwen2"]
    assert "datasets" not in meta and "license" not in meta  # not known for this artifact
    assert "model-index" not in meta  # the Hub needs a dataset id there; the local calibration set has none
    block = meta["kvhub"]
    assert block["metrics"]["heldout_r2_k_mean"] == 0.89  # what `kvhub search` shows
    assert block["version"] == "v3" and block["tensors_sha256"] == metadata["tensors"]["sha256"]
    assert block["calibration"] == {"name": "legal-docs", "version": 1, "content_hash": "legal-docs-hash"}
    assert block["source"]["config_hash"] == metadata["source"]["config_hash"]


def test_front_matter_carries_license_dataset_and_evaluation_when_known(artifact):
    metadata = read_metadata(artifact)
    metadata = {
        **metadata,
        "license": "apache-2.0",
        "evaluation": {"hellaswag": {"acc": 0.41}},
        "calibration": {**metadata["calibration"], "hub_dataset": "acme/legal-corpus"},
    }
    meta = read_front_matter(model_card(metadata, repo_id="acme/kvmap", version_tag="v1"))
    assert meta["license"] == "apache-2.0" and meta["datasets"] == ["acme/legal-corpus"]
    [result] = meta["model-index"][0]["results"]
    assert result["dataset"] == {"name": "hellaswag", "type": "Rowan/hellaswag", "split": "validation"}
    assert [{k: m[k] for k in ("type", "value")} for m in result["metrics"]] == [{"type": "acc", "value": 0.41}]


def test_body_documents_validity_calibration_fit_and_usage(artifact):
    metadata = read_metadata(artifact)
    body = model_card(metadata, repo_id="acme/kvmap", version_tag="v3", images=["heatmap.png"])
    for needle in (
        f"| source | `{SRC_ID}` | 0123abc",
        f"| target | `{DST_ID}`",
        metadata["calibration"]["content_hash"],
        "k = 1",
        "lambda = 0.1",
        "| 2 | 0 | 0.880 | 0.780 |",
        "| heldout_r2_k_mean | 0.890 |",
        'Mapper.from_pretrained("acme/kvmap", revision="v3")',
        "mapper.transfer(source_cache)",
        f"Written by kvhub {metadata['kvhub_version']}",
        metadata["tensors"]["sha256"],
        "![heatmap.png](heatmap.png)",
    ):
        assert needle in body, needle
    assert "## Figures" not in model_card(metadata, repo_id="acme/kvmap", version_tag="v3")


def test_card_is_deterministic_and_hand_edits_are_detected(artifact):
    metadata = read_metadata(artifact)
    card = model_card(metadata, repo_id="acme/kvmap", version_tag="v3")
    assert card == model_card(json.loads(json.dumps(metadata)), repo_id="acme/kvmap", version_tag="v3")
    assert card_is_pristine(card)
    assert not card_is_pristine(card.replace("approximation", "approximation (verified)"))
    assert not card_is_pristine("---\nlibrary_name: other\n---\n# A card someone wrote\n")


def test_verify_artifact_accepts_a_good_one_and_checks_names(artifact):
    assert verify_artifact(artifact, source="tiny-coder-0.5b-instruct", target=DST_ID)["k"] == 1
    with pytest.raises(IncompatibleError, match="not the source"):
        verify_artifact(artifact, source="someone/else")


def _rewrite_json(directory, change) -> None:
    path = directory / "mapper.json"
    metadata = json.loads(path.read_text())
    change(metadata)
    path.write_text(json.dumps(metadata))


@pytest.mark.parametrize(
    "damage, error, match",
    [
        (
            lambda d: (d / "mapper.safetensors").write_bytes(b"x" + (d / "mapper.safetensors").read_bytes()[1:]),
            IntegrityError,
            "sha256",
        ),
        (lambda d: _rewrite_json(d, lambda m: m.update(format_version=99)), FormatVersionError, "upgrade"),
        (
            lambda d: _rewrite_json(d, lambda m: m["target"]["config"].update(num_hidden_layers=30)),
            IntegrityError,
            "config_hash",
        ),
        (
            lambda d: _rewrite_json(d, lambda m: m["source"].update(num_kv_heads=4)),
            IntegrityError,
            "source.num_kv_heads` is 4, but the recorded config says 2",
        ),
        (
            lambda d: _rewrite_json(d, lambda m: m["layers"][0].update(sources=[5])),
            IntegrityError,
            r"layers\[0\].sources` must be ascending distinct source layers in 0..1",
        ),
    ],
)
def test_verify_artifact_refuses_damage(tmp_path, damage, error, match):
    directory = make_artifact(tmp_path / "a", seed=2)
    damage(directory)
    with pytest.raises(error, match=match):
        verify_artifact(directory)


def test_parse_repo_ref():
    assert parse_repo_ref("acme/kvmap") == ("acme/kvmap", None)
    assert parse_repo_ref("acme/kvmap@v3") == ("acme/kvmap", "v3")
    for bad in ("kvmap", "a/b/c", "", "acme/kv map", "./kvmap", "../kvmap", "-acme/kvmap", "acme/kv..map"):
        with pytest.raises(ConfigError, match="OWNER/NAME"):
            parse_repo_ref(bad)


def test_hub_version_tags_round_trip():
    from kvhub.hub.push import tag_number, version_tag

    assert [tag_number(t) for t in ("v3", "v12", "main", "v3a", "V3", "3")] == [3, 12, None, None, None, None]
    assert tag_number(version_tag(SimpleNamespace(version=7))) == 7


def test_error_text_is_redacted_of_tokens(monkeypatch):
    from kvhub.hub.client import _redact

    monkeypatch.setenv("HF_TOKEN", "sekrit-from-env")
    text = "401 for Bearer sekrit-from-env and passed-token and hf_abcdefghijklmnopqrstuvwxyz123"
    assert _redact(text, "passed-token") == "401 for Bearer *** and *** and hf_***"
    assert _redact(text, None) == "401 for Bearer *** and passed-token and hf_***"
