"""Models whose cache is not one K/V tensor per layer.

Hybrids (linear attention, Mamba, convolution layers: tiny random models of the real transformers
architectures) are refused by layer type at every surface: ``kvhub plan`` / ``kvhub fit`` before a weight
loads, ``load_model``, capture (the library fit), ``Mapper.transfer`` of their cache, ``handoff`` and
``kvhub serve``.  Sliding-window models (Gemma 2, Gemma 3, Mistral) are mapped: greedy generation through a
self-map equals the model's own.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from kvhub.cli.main import main
from kvhub.core.capture import cache_kwargs
from kvhub.core.layer_kinds import check_attention_layers, check_cache_layers, layer_types, unmappable_layers
from kvhub.errors import UnsupportedModelError
from kvhub.serving.handoff import handoff
from tests.tinymodels import make_model
from tests.vllm_standin import vllm_modules  # noqa: F401  (fixture: vLLM, or its stand-in where none is installed)
from tests.fixtures_fit import fit_tiny, token_ids as _ids

TINY = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=4,
    intermediate_size=128,
    vocab_size=128,
    max_position_embeddings=256,
)
MAMBA = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)
LINEAR = dict(
    head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16
)
# model_type -> (config overrides, the layer type the refusal names, the indices of those layers)
HYBRIDS = {
    "qwen3_next": (
        {
            **LINEAR,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "full_attention_interval": 2,
        },
        "linear_attention",
        [0, 2],
    ),
    "qwen3_5_text": (LINEAR, "linear_attention", [0, 1, 2]),
    "falcon_h1": (
        {
            "head_dim": 16,
            "mamba_d_ssm": 64,
            **{k: v for k, v in MAMBA.items() if k != "mamba_d_head"},
            "mamba_d_head": 16,
        },
        "hybrid",
        [0, 1, 2, 3],
    ),
    "jamba": (
        {
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "num_experts": 2,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "mamba_d_state": 8,
            "mamba_expand": 2,
            "mamba_dt_rank": 8,
        },
        "linear_attention",
        [0, 2],
    ),
    "bamba": ({"attn_layer_indices": [1, 3], **MAMBA}, "linear_attention", [0, 2]),
    "granitemoehybrid": (
        {
            "layer_types": ["mamba", "attention", "mamba", "attention"],
            **MAMBA,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
        },
        "linear_attention",
        [0, 2],
    ),
    "lfm2": (
        {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "block_ff_dim": 128},
        "conv",
        [0, 2],
    ),
}


def _config(model_type: str):
    overrides, _, _ = HYBRIDS[model_type]
    return AutoConfig.for_model(model_type, **TINY, **overrides)


def _model(model_type: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(model_type)).eval()


@pytest.fixture(scope="module")
def attention_mapper():
    """A self-map of a tiny attention-only model with the hybrids' depth (4 layers)."""
    model = make_model("qwen3", head_dim=16, num_hidden_layers=4)
    mapper = fit_tiny(
        model, model, train=(8, 16), heldout=(4, 16), source_id="tiny/q", target_id="tiny/q", top_k=1, ridge_lambda=1e-6
    )
    return model, mapper


# ---- the refusal names the layer type, from the config object and from config.json ---------------------
@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_a_hybrid_config_is_refused_naming_its_layer_type(model_type):
    _, kind, indices = HYBRIDS[model_type]
    config = _config(model_type)
    assert unmappable_layers(config) == {kind: indices}
    for given in (config, json.loads(config.to_json_string())):  # the object, and config.json as kvhub plan reads it
        with pytest.raises(UnsupportedModelError, match=f"{model_type}\\) has .*layers \\({len(indices)} of 4") as info:
            check_attention_layers(given, name="tiny/hybrid")
        assert "tiny/hybrid" in str(info.value) and "attention" in str(info.value)


@pytest.mark.parametrize(
    "config, kind, indices",
    [
        (
            {"model_type": "qwen3_next", "num_hidden_layers": 8, "full_attention_interval": 4},
            "linear_attention",
            [0, 1, 2, 4, 5, 6],
        ),
        (
            {"model_type": "jamba", "num_hidden_layers": 4, "attn_layer_period": 4, "attn_layer_offset": 2},
            "mamba",
            [0, 1, 3],
        ),
        ({"model_type": "bamba", "num_hidden_layers": 3, "attn_layer_indices": [1]}, "mamba", [0, 2]),
        ({"model_type": "bamba", "num_hidden_layers": 2}, "mamba", [0, 1]),
        ({"model_type": "nemotron_h", "num_hidden_layers": 4, "hybrid_override_pattern": "M*M-"}, "mamba", [0, 2]),
        ({"model_type": "lfm2", "num_hidden_layers": 3, "full_attn_idxs": [2]}, "conv", [0, 1]),
        (
            {
                "model_type": "recurrent_gemma",
                "num_hidden_layers": 3,
                "block_types": ["recurrent", "recurrent", "attention"],
            },
            "recurrent",
            [0, 1],
        ),
        ({"model_type": "falcon_h1", "num_hidden_layers": 2}, "hybrid", [0, 1]),
        ({"model_type": "mamba2", "num_hidden_layers": 2}, "mamba", [0, 1]),
        (
            {
                "model_type": "qwen3_5",
                "text_config": {
                    "model_type": "qwen3_5_text",
                    "num_hidden_layers": 2,
                    "layer_types": ["linear_attention", "full_attention"],
                },
            },
            "linear_attention",
            [0],
        ),
    ],
)
def test_hybrid_config_json_fields_are_read(config, kind, indices):
    """The fields hybrids' config.json files state their layers in (no transformers config object)."""
    assert unmappable_layers(config).get(kind) == indices


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "qwen2", "num_hidden_layers": 3},
        {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 8},
        {"model_type": "gemma3_text", "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
        {"model_type": "qwen2", "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
    ],
)
def test_attention_only_configs_pass(config):
    check_attention_layers(config)
    assert set(layer_types(config)) <= {"full_attention", "sliding_attention"}


# ---- every surface refuses, at its first step -------------------------------------------------------
def _hybrid_dir(tmp_path, model_type: str = "qwen3_next", *, weights: bool = False):
    """A model directory: config.json only (what the refusals read), or with weights."""
    path = tmp_path / model_type
    if weights:
        _model(model_type).save_pretrained(path)
    else:
        path.mkdir()
        _config(model_type).to_json_file(path / "config.json")
    return path


@pytest.mark.parametrize(
    "command",
    [
        ["plan"],
        ["fit", "--calib", "legal-docs", "--no-register", "--out", "OUT"],
        ["fit", "--calib", "legal-docs", "--no-register", "--out", "OUT", "--ignore-plan"],
    ],
)
def test_plan_and_fit_refuse_a_hybrid_before_any_weight_loads(tmp_path, command):
    """The directories hold only config.json: a refusal after loading weights would fail differently."""
    hybrid = _hybrid_dir(tmp_path)
    args = [part.replace("OUT", str(tmp_path / "out")) for part in command]
    result = CliRunner().invoke(main, [*args[:1], "--src", str(hybrid), "--dst", str(hybrid), *args[1:]])
    assert result.exit_code == 2, result.output
    assert "linear_attention layers" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_load_model_refuses_a_hybrid_directory_before_its_weights(tmp_path):
    from kvhub.models.loading import load_model

    with pytest.raises(UnsupportedModelError, match="conv layers"):
        load_model(_hybrid_dir(tmp_path, "lfm2"))


@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1"])
def test_the_library_fit_refuses_a_hybrid_model(model_type):
    model = _model(model_type)
    with pytest.raises(UnsupportedModelError, match=f"{HYBRIDS[model_type][1]} layers"):
        fit_tiny(model, model, train=(2, 8), heldout=(2, 8), source_id="t/h", target_id="t/h", top_k=1, batch_size=2)


@pytest.mark.parametrize(
    "model_type, layer_class",
    [("qwen3_next", "LinearAttentionLayer"), ("falcon_h1", "LinearAttentionAndFullAttentionLayer")],
)
def test_transfer_refuses_a_hybrid_cache_by_its_layer_class(attention_mapper, model_type, layer_class):
    """Falcon-H1's layers hold keys and values of the mapper's geometry too: only the layer's class tells that
    they also carry a Mamba state (a map of the K/V alone would be a silently wrong cache)."""
    _, mapper = attention_mapper
    model = _model(model_type)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(_ids(1, 10, 2), use_cache=True, **cache_kwargs(model, cache))
    with pytest.raises(UnsupportedModelError, match=f"source cache layer 0 is a {layer_class}"):
        mapper.transfer(cache)
    with pytest.raises(UnsupportedModelError, match=layer_class):
        check_cache_layers(cache)


def test_handoff_refuses_a_hybrid_model_naming_its_layer_type(attention_mapper):
    model, mapper = attention_mapper
    hybrid = _model("qwen3_next")
    for source, target in ((model, hybrid), (hybrid, model)):
        with pytest.raises(UnsupportedModelError, match="qwen3_next\\)? has linear_attention layers"):
            handoff(mapper, source, target, _ids(1, 12, 3), max_new_tokens=2, do_sample=False)


def test_serve_refuses_a_hybrid_model_directory(tmp_path):
    from kvhub.serving.engine_limits import check_served_model

    with pytest.raises(UnsupportedModelError, match="hybrid layers"):
        check_served_model(_hybrid_dir(tmp_path, "falcon_h1"))
    check_served_model("Qwen/not-a-local-path")  # a Hub id: the engine's connector checks it at start


def test_kvhub_serve_refuses_a_hybrid_large_model(tmp_path, artifact_factory):
    from kvhub.store import open_store

    db = str(tmp_path / "kvhub.db")
    with open_store(db) as store:
        store.register(artifact_factory())
    result = CliRunner().invoke(
        main,
        [
            "serve",
            "tiny-coder-0.5b-instruct:tiny-coder-1.5b-instruct",
            "--db",
            db,
            "--large-model",
            str(_hybrid_dir(tmp_path)),
            "--vllm",
            "/bin/true",
            "--kvstore-dir",
            str(tmp_path / "kv"),
            "--dry-run",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "qwen3_next) has linear_attention layers" in result.output and not (tmp_path / "kv").exists()


def test_the_connector_refuses_a_hybrid_engine(vllm_modules, tmp_path):
    from types import SimpleNamespace

    from kvhub.serving.vllm_connector import KVHubConnector
    from tests.vllm_standin import KVConnectorRole, vllm_config

    config = vllm_config(role="kv_producer", extra={"kvstore_dir": str(tmp_path / "kv")})
    config.model_config.hf_config = _config("granitemoehybrid")
    with pytest.raises(UnsupportedModelError, match="granitemoehybrid\\) has linear_attention layers"):
        KVHubConnector(config, KVConnectorRole.SCHEDULER)
    assert not (tmp_path / "kv").exists()
    config.model_config.hf_config = SimpleNamespace(model_type="qwen2", num_hidden_layers=2)
    KVHubConnector(config, KVConnectorRole.SCHEDULER)  # attention-only: starts


# ---- sliding windows are mapped -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("gemma2", {"sliding_window": 8, "head_dim": 16, "num_hidden_layers": 4}),
        (
            "gemma3_text",
            {
                "sliding_window": 8,
                "head_dim": 16,
                "num_hidden_layers": 4,
                "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            },
        ),
        ("mistral", {"sliding_window": 8, "head_dim": 16}),
    ],
)
def test_sliding_window_models_map_and_hand_off_exactly_through_a_self_map(model_type, overrides):
    """Known answer: a self-map fitted on noiseless data is the identity, so the default handoff (prefix and
    suffix recomputed, the selective budget dropped for windowed targets) generates the model's own tokens
    past the window, and the mapped sliding layers hold only their window."""
    model = make_model(model_type, **overrides)
    mapper = fit_tiny(
        model, model, train=(16, 32), heldout=(4, 32), source_id="t/s", target_id="t/s", top_k=1, ridge_lambda=1e-9
    )
    assert mapper.windowed_target()
    ids = _ids(1, 30, 3)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(handoff(mapper, model, model, ids, max_new_tokens=8, do_sample=False), want)
    from kvhub.core.capture import run_model

    cache = mapper.transfer(run_model(model, ids[:, :-1]))
    held = {
        layer.keys.shape[-2]
        for layer, kind in zip(cache.layers, layer_types(model.config))
        if kind == "sliding_attention"
    }
    assert held == {7}  # the window minus one, of 29 mapped positions
