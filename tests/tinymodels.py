"""Tiny transformers models built from configs, and 'exact families' of them.

An exact family is a (source, target) pair whose caches are related by an exact linear map while the
target's depth and KV geometry differ from the source's:
- extra target layers whose attention and MLP outputs are zero (so the residual stream is unchanged)
  but whose K/V projections copy the next source layer's, so their K/V equal that layer's K/V;
- every KV head duplicated ``kv_repeat`` times (attention heads keep reading the same values);
- head_dim doubled: source dim j goes to target dim 2j and j + D/2 to 2j + D (same rope_theta, so
  every source rotation pair lands on a target pair of the same frequency), other dims zero, and q
  scaled by sqrt(2) to keep the softmax scale 1/sqrt(D).
The target then computes exactly the source's function, so greedy generation must agree.
"""

from __future__ import annotations

import math

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvhub.core.control import control_mapper  # noqa: F401  (the no-information control; tests import it from here too)

BASE = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=3,
    intermediate_size=128,
    vocab_size=128,
    max_position_embeddings=512,
    initializer_range=0.2,
    tie_word_embeddings=False,
)

ROPE_VARIANTS = {
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "llama3": dict(
        model_type="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral-sliding": dict(model_type="mistral", sliding_window=8, head_dim=16),
    "gpt_neox-partial": dict(
        model_type="gpt_neox",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
    "yarn": dict(
        model_type="qwen2",
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


def make_config(model_type: str = "qwen2", **overrides):
    params = {**BASE, **overrides}
    if model_type == "gpt_neox":
        params["num_key_value_heads"] = params["num_attention_heads"]
        params.pop("num_key_value_heads")
    return AutoConfig.for_model(model_type, **params)


def make_model(model_type: str = "qwen2", *, seed: int = 0, **overrides):
    """A randomly initialised fp32 causal LM in eval mode."""
    torch.manual_seed(seed)
    config = make_config(model_type, **overrides)
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).eval()


def variant_model(name: str, *, seed: int = 0):
    spec = dict(ROPE_VARIANTS[name])
    return make_model(spec.pop("model_type"), seed=seed, **spec)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _dim_index(head_dim: int) -> torch.Tensor:
    """Target position of each source dim when head_dim doubles (rotation pairs keep their frequency)."""
    half = head_dim // 2
    j = torch.arange(half)
    return torch.cat([2 * j, 2 * j + head_dim])  # target head_dim = 2 * head_dim


def _expand_rows(weight: torch.Tensor, heads: int, head_dim: int, repeat: int, double: bool) -> torch.Tensor:
    """Rows of a q/k/v projection (heads*D, ...) -> (heads*repeat*D', ...), D' = 2D if double."""
    rest = weight.shape[1:]
    per_head = weight.reshape(heads, head_dim, *rest).repeat_interleave(repeat, dim=0)  # (H*r, D, ...)
    if not double:
        return per_head.reshape(-1, *rest)
    out = torch.zeros(per_head.shape[0], 2 * head_dim, *rest, dtype=weight.dtype)
    out[:, _dim_index(head_dim)] = per_head
    return out.reshape(-1, *rest)


def _expand_o_proj(weight: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """o_proj (hidden, H*D) -> (hidden, H*2D) with zero columns for padded dims."""
    hidden = weight.shape[0]
    per_head = weight.reshape(hidden, heads, head_dim)
    out = torch.zeros(hidden, heads, 2 * head_dim, dtype=weight.dtype)
    out[:, :, _dim_index(head_dim)] = per_head
    return out.reshape(hidden, -1)


def exact_family_target(
    source, *, insert_before: tuple[int, ...] = (1,), kv_repeat: int = 2, double_head_dim: bool = True
):
    """Build a qwen2/llama target whose K/V are an exact linear function of ``source``'s.

    Returns (target, layer_map) where layer_map[m] is the source layer whose K/V target layer m carries.
    """
    cfg = source.config
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg)
    layer_map = []
    for l in range(cfg.num_hidden_layers):
        layer_map += [l] * (1 + insert_before.count(l))  # a zero layer copying l, then l itself
    new_head_dim = head_dim * (2 if double_head_dim else 1)
    tcfg = AutoConfig.for_model(
        cfg.model_type,
        **{
            **{k: v for k, v in cfg.to_dict().items() if k in BASE or k in ("rope_parameters", "attention_bias")},
            "num_hidden_layers": len(layer_map),
            "num_key_value_heads": kv_heads * kv_repeat,
            "head_dim": new_head_dim,
        },
    )
    tcfg._attn_implementation = "eager"
    target = AutoModelForCausalLM.from_config(tcfg).eval()
    state = source.state_dict()
    new = {}
    for key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        new[key] = state[key]
    zero_layers = set()
    for m, l in enumerate(layer_map):
        if m + 1 < len(layer_map) and layer_map[m + 1] == l:
            zero_layers.add(m)
        _copy_layer(state, new, l, m, heads, kv_heads, head_dim, kv_repeat, double_head_dim, zero=m in zero_layers)
    missing = set(target.state_dict()) - set(new)
    if missing:
        raise RuntimeError(f"unmapped target weights: {sorted(missing)}")
    target.load_state_dict(new)
    return target, layer_map


def _copy_layer(state, new, l, m, heads, kv_heads, head_dim, repeat, double, *, zero: bool) -> None:
    src, dst = f"model.layers.{l}.", f"model.layers.{m}."
    scale = math.sqrt(2.0) if double else 1.0
    for name in (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ):
        new[dst + name] = state[src + name].clone()
    for proj, proj_heads, proj_repeat, factor in (
        ("q", heads, 1, scale),
        ("k", kv_heads, repeat, 1.0),
        ("v", kv_heads, repeat, 1.0),
    ):
        for part in ("weight", "bias"):
            key = f"self_attn.{proj}_proj.{part}"
            if src + key in state:
                new[dst + key] = _expand_rows(state[src + key], proj_heads, head_dim, proj_repeat, double) * factor
    o_proj = state[src + "self_attn.o_proj.weight"]
    new[dst + "self_attn.o_proj.weight"] = _expand_o_proj(o_proj, heads, head_dim) if double else o_proj.clone()
    if zero:
        new[dst + "self_attn.o_proj.weight"].zero_()
        new[dst + "mlp.down_proj.weight"].zero_()
