"""RoPE strip/apply: round trips for every supported rope type, and agreement with the models."""

import pytest
import torch

from kvhub.core.capture import run_model
from kvhub.errors import UnsupportedModelError
from kvhub.core.rope import Rotary, apply_rope, check_supported, strip_rope
from tests.tinymodels import ROPE_VARIANTS, make_config, variant_model
from tests.tolerances import assert_close


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_strip_apply_round_trip_fp32_exact(variant):
    model = variant_model(variant)
    rotary = Rotary.from_model(model)
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    keys = torch.randn(2, heads, 300, dim, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(300).expand(2, 300)
    cos, sin = rotary.cos_sin(positions)
    assert cos.dtype == torch.float32
    back = strip_rope(apply_rope(keys, cos, sin), cos, sin)
    assert_close(back, keys, terms=4)  # apply then strip: two 2-term rotations (and a yarn scale) in fp32


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_stripped_cache_equals_raw_projection(variant):
    """Keys read back from the model's cache, stripped, equal the pre-RoPE keys the model computed."""
    model = variant_model(variant)
    captured = {}
    layer = model.base_model.layers[0]
    attn = layer.self_attn if hasattr(layer, "self_attn") else layer.attention
    proj = getattr(attn, "k_proj", None) or attn.query_key_value  # gpt_neox: fused, per head [q | k | v]
    norm = getattr(attn, "k_norm", None)
    proj.register_forward_hook(lambda mod, inp, out: captured.setdefault("k", out))
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = run_model(model, ids)
    heads, dim = cache.layers[0].keys.shape[1], cache.layers[0].keys.shape[3]
    out = captured["k"]
    if out.shape[-1] == 3 * heads * dim:
        out = out.view(1, 40, heads, 3 * dim)[..., dim : 2 * dim]
    raw = out.reshape(1, 40, heads, dim)
    raw = (norm(raw) if norm is not None else raw).transpose(1, 2)
    cos, sin = Rotary.from_model(model).cos_sin(torch.arange(40)[None])
    # the model's own rotation against kvhub's, each two terms in fp32 (the cos/sin tables may round differently)
    assert_close(strip_rope(cache.layers[0].keys.float(), cos, sin), raw.float(), terms=4)


def test_yarn_cos_sin_carry_attention_scaling():
    rotary = Rotary.from_model(variant_model("yarn"))
    cos, sin = rotary.cos_sin(torch.arange(10)[None])
    scale = (cos * cos + sin * sin).sqrt()
    assert float(scale.min()) > 1.0 + 1e-3  # yarn's attention factor > 1: strip must divide by its square


def test_partial_rotary_leaves_tail_untouched():
    rotary = Rotary.from_model(variant_model("gpt_neox-partial"))
    cos, sin = rotary.cos_sin(torch.arange(5)[None])
    keys = torch.randn(1, 4, 5, 16, generator=torch.Generator().manual_seed(1))
    assert cos.shape[-1] == 4
    torch.testing.assert_close(apply_rope(keys, cos, sin)[..., 4:], keys[..., 4:])


def test_unsupported_architecture_lists_supported():
    config = make_config("qwen2")
    config.model_type = "gpt2"  # attention-only, not supported (a mamba is refused by its layers: test_hybrid_models)
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2'; supported architectures: .*qwen2"):
        check_supported(config)
