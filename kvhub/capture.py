"""Run a transformers causal LM over token ids and collect its per-layer K (RoPE stripped) and V.

The model's body (no LM head) runs with a plain ``DynamicCache()`` (no config), so sliding-window
layers keep every token; keys are read from the cache after the forward pass, which is exactly what
the model caches (post k_norm for Qwen3, post RoPE), and the RoPE is stripped with the model's own
rotary module in fp32 (see :mod:`kvhub.rope`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConfigError, NonFiniteError
from .rope import Rotary, check_supported, strip_rope


@dataclass
class CapturedKV:
    """Per-layer blocks of one batch.  keys[l], values[l]: (N, H_kv*D) fp32, N = kept tokens."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        return self.keys[0].shape[0]


def token_mask(attention_mask: torch.Tensor, *, stride: int = 1, skip_first: int = 0) -> torch.Tensor:
    """Which positions are kept: real tokens, every ``stride``-th, from position ``skip_first`` on.

    attention_mask: (B, T) with 1 for real tokens (right padding) -> (B, T) bool.
    """
    if stride < 1:
        raise ConfigError(f"token stride must be >= 1, got {stride}")
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    keep = (positions % stride == 0) & (positions >= skip_first)  # (T,)
    return attention_mask.bool() & keep


@torch.no_grad()
def run_model(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """Forward the model body over (B, T) ids (right padding) and return its full-length DynamicCache."""
    from transformers import DynamicCache

    check_supported(model.config)
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device)
    position_ids = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
    cache = DynamicCache()  # no config: sliding-window layers keep the whole context
    model.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=True
    )
    return cache


@torch.no_grad()
def capture(
    model,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    stride: int = 1,
    skip_first: int = 0,
    rotary: Rotary | None = None,
) -> CapturedKV:
    """K (RoPE stripped) and V of every layer at the kept positions (see :func:`token_mask`).

    input_ids: (B, T) long, right-padded; returns blocks (N, H_kv*D) fp32 on the model's device.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache = run_model(model, input_ids, attention_mask)
    rotary = rotary or Rotary.from_model(model)
    device = cache.layers[0].keys.device
    keep = token_mask(attention_mask.to(device), stride=stride, skip_first=skip_first)  # (B, T)
    position_ids = torch.arange(input_ids.shape[1], device=device).expand_as(keep)
    keys, values = [], []
    for index, layer in enumerate(cache.layers):
        cos, sin = rotary.cos_sin(position_ids, index)
        raw = strip_rope(layer.keys.float(), cos, sin)  # (B, H, T, D)
        keys.append(_flatten_kept(raw, keep))
        values.append(_flatten_kept(layer.values.float(), keep))
        if not (torch.isfinite(keys[-1]).all() and torch.isfinite(values[-1]).all()):
            raise NonFiniteError(
                f"layer {index} of {model.config.model_type} produced NaN/Inf keys or values; "
                "run the model in bfloat16 or float32 instead of float16"
            )
    return CapturedKV(keys=keys, values=values)


def _flatten_kept(states: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) states and (B, T) mask -> (N, H*D) rows of the kept tokens."""
    batch, heads, tokens, dim = states.shape
    rows = states.transpose(1, 2).reshape(batch, tokens, heads * dim)  # (B, T, H*D)
    return rows[keep]
