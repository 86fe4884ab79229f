"""Run a transformers causal LM over token ids and collect its per-layer K (RoPE stripped) and V.

The model's body (no LM head) runs with a plain ``DynamicCache()`` (no config), so sliding-window
layers keep every token; keys are read from the cache after the forward pass, which is exactly what
the model caches (post k_norm for Qwen3, post RoPE), and the RoPE is stripped with the model's own
rotary module in fp32 (see :mod:`kvhub.core.rope`).

Attention weights of the tokens (for attention-weighted fits), from the attention probabilities
A_lh[i, t] of query i on key t in layer l, head h of one unpadded sequence of T tokens:

    raw_t = mean over l, h and queries i >= t of (i + 1) * A_lh[i, t]
          = sum_{l,h} sum_{i >= t} (i + 1) A_lh[i, t] / (L * H * (T - t))
    w_t   = min(raw_t, cap) / mean over kept tokens s of min(raw_s, cap)

(i + 1) * A[i, t] is the ratio to uniform attention over the i + 1 keys query i sees, so uniform
attention gives raw = w = 1.  The cap applies before normalisation (it tames attention sinks): the
largest normalised weight is cap / mean(min(raw, cap)), which exceeds cap when that mean is below 1.
Sliding-window layers count every query i >= t, with A = 0 outside the window.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache

import torch

from kvhub.errors import ConfigError, NonFiniteError, UnsupportedModelError
from kvhub.core.rope import Rotary, check_supported, strip_rope


@dataclass
class CapturedKV:
    """Per-layer blocks of one batch.  keys[l], values[l]: (N, H_kv*D) fp32, N = kept tokens.

    weights: (N,) fp32 attention weights of the rows (see the module docstring), or None.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    weights: torch.Tensor | None = None

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


def cache_kwargs(model, cache) -> dict:
    """``{keyword: cache}`` for ``model(...)`` / ``model.generate(...)`` on the installed transformers.

    transformers renamed the cache argument from ``past_key_values`` to ``cache`` after 5.19; an older
    version silently ignores an unknown ``cache=`` and returns a cache with no layers, so every call
    site that hands a cache to a model goes through here.
    """
    return {_cache_keyword(type(model)): cache}


@lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    if "cache" in parameters:
        return "cache"
    if "past_key_values" in parameters:
        return "past_key_values"
    import transformers  # a forward that takes only **kwargs: go by the release that renamed it

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "cache" if (major, minor) >= (5, 20) else "past_key_values"


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
    body = model.base_model
    body(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **cache_kwargs(body, cache),
    )
    if not cache.layers:
        raise UnsupportedModelError(
            f"{model.config.model_type} left its cache empty: transformers {_transformers_version()} did not "
            "take the cache it was given; install a transformers version kvhub supports (see pyproject.toml)"
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
    attention_weights: bool = False,
    weight_cap: float = 10.0,
) -> CapturedKV:
    """K (RoPE stripped) and V of every layer at the kept positions (see :func:`token_mask`).

    input_ids: (B, T) long, right-padded; returns blocks (N, H_kv*D) fp32 on the model's device.
    ``attention_weights``: the same forward also yields the rows' attention weights (module
    docstring; unpadded ids only), running eager attention.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_weights:
        _require_unpadded(attention_mask)
    with AttentionMass(model) if attention_weights else nullcontext() as mass:
        cache = run_model(model, input_ids, attention_mask)
    rotary = rotary or Rotary.from_model(model)
    device = cache.layers[0].keys.device
    keep = token_mask(attention_mask.to(device), stride=stride, skip_first=skip_first)  # (B, T)
    weights = mass.weights(keep, cap=weight_cap)[keep] if attention_weights else None  # (N,)
    position_ids = torch.arange(input_ids.shape[1], device=device).expand_as(keep)
    keys, values = [], []
    for index, layer in enumerate(cache.layers):
        k_rows, v_rows = layer_rows(layer.keys, layer.values, keep, rotary, position_ids, index)
        keys.append(k_rows)
        values.append(v_rows)
        if not (torch.isfinite(keys[-1]).all() and torch.isfinite(values[-1]).all()):
            raise NonFiniteError(
                f"layer {index} of {model.config.model_type} produced NaN/Inf keys or values; "
                "run the model in bfloat16 or float32 instead of float16"
            )
    return CapturedKV(keys=keys, values=values, weights=weights)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def layer_rows(keys, values, keep, rotary: Rotary, position_ids, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cached (B, H, T, D) keys and values -> its kept (N, H*D) fp32 rows, RoPE stripped from
    the keys with layer ``index``'s rotation at ``position_ids`` (B, T)."""
    cos, sin = rotary.cos_sin(position_ids, index)
    return _flatten_kept(strip_rope(keys.float(), cos, sin), keep), _flatten_kept(values.float(), keep)


def _flatten_kept(states: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) states and (B, T) mask -> (N, H*D) rows of the kept tokens."""
    batch, heads, tokens, dim = states.shape
    rows = states.transpose(1, 2).reshape(batch, tokens, heads * dim)  # (B, T, H*D)
    return rows[keep]


# ---- attention weights ----------------------------------------------------------------------------
@torch.no_grad()
def token_attention_weights(
    model, input_ids: torch.Tensor, *, cap: float = 10.0, stride: int = 1, skip_first: int = 0
) -> torch.Tensor:
    """Attention weights w_t (module docstring) of (B, T) unpadded ids, from one eager forward.

    Returns (B, T) fp32 on the model's device: w_t at the positions :func:`token_mask` keeps, 0 elsewhere.
    """
    with AttentionMass(model) as mass:
        run_model(model, input_ids)
    keep = token_mask(torch.ones_like(input_ids, device=mass.total.device), stride=stride, skip_first=skip_first)
    return mass.weights(keep, cap=cap)


class AttentionMass:
    """While entered: eager attention, and every attention module of ``model`` adds its
    sum_h sum_{i >= t} (i + 1) A_h[i, t] to ``total`` (B, T) fp32; ``terms`` counts the (layer, head) pairs.
    With ``per_query=True`` it also adds sum_h A_h[i, t] to ``by_query`` (B, Tq, T) fp32, per query i of
    the pass (what :mod:`kvhub.serving.recompute` scores a few last tokens with).

    Each layer's (B, H, Tq, T) probabilities are reduced in a forward hook as the layer runs, so only
    one layer's matrix is alive at a time.  The previous attention implementation is restored on exit.
    """

    def __init__(self, model, *, per_query: bool = False):
        self.model = model
        self.total: torch.Tensor | None = None
        self.by_query: torch.Tensor | None = None
        self.per_query = per_query
        self.terms = 0
        self._handles = []
        self._previous = None

    def __enter__(self) -> "AttentionMass":
        attention_class, index = _attention_output(self.model)
        self._previous = self.model.config._attn_implementation
        self.model.set_attn_implementation("eager")
        try:
            for module in self.model.modules():
                if isinstance(module, attention_class):
                    self._handles.append(module.register_forward_hook(self._hook(index)))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.model.set_attn_implementation(self._previous)

    def _hook(self, index: int):
        def reduce(module, args, output):
            probs = output[index]  # (B, H, Tq, Tk)
            if probs is None:
                raise UnsupportedModelError(
                    f"{type(module).__name__} returned no attention probabilities under eager attention; "
                    "use weighting='uniform' for this model"
                )
            queries, keys = probs.shape[-2:]
            scale = torch.arange(keys - queries + 1, keys + 1, device=probs.device, dtype=torch.float32)  # i + 1
            per_query = probs.sum(1, dtype=torch.float32)  # (B, Tq, Tk), summed over heads
            mass = scale @ per_query  # (B, Tk): sum_i (i + 1) A[i, t]
            self.total = mass if self.total is None else self.total + mass.to(self.total.device)
            if self.per_query:
                self.by_query = (
                    per_query if self.by_query is None else self.by_query + per_query.to(self.by_query.device)
                )
            self.terms += probs.shape[1]

        return reduce

    def weights(self, keep: torch.Tensor, *, cap: float) -> torch.Tensor:
        """(B, T) bool kept positions -> (B, T) fp32 weights, mean 1 over each row's kept positions, 0 elsewhere."""
        if self.total is None:
            raise UnsupportedModelError(f"no attention module of {type(self.model).__name__} ran in the forward pass")
        if cap <= 0:
            raise ConfigError(f"the attention weight cap must be positive, got {cap}")
        tokens = self.total.shape[1]
        queries = torch.arange(tokens, 0, -1, device=self.total.device, dtype=torch.float32)  # T - t see key t
        raw = self.total / (self.terms * queries)  # (B, T)
        kept = raw.clamp(max=cap) * keep.to(raw.device)
        mean = kept.sum(1, keepdim=True) / keep.sum(1, keepdim=True).to(raw.device).clamp_min(1)  # (B, 1)
        return kept / mean.clamp_min(1e-30)


def _attention_output(model) -> tuple[type, int]:
    """The attention module class of ``model`` and the index of the probabilities in its output tuple."""
    spec = getattr(model, "_can_record_outputs", None) or {}
    spec = spec.get("attentions")
    if isinstance(spec, type):
        return spec, 1
    if spec is not None and isinstance(getattr(spec, "target_class", None), type):
        return spec.target_class, spec.index
    raise UnsupportedModelError(
        f"cannot find the attention modules of {type(model).__name__}; use weighting='uniform' for this model"
    )


def _require_unpadded(attention_mask: torch.Tensor) -> None:
    if not bool(attention_mask.bool().all()):
        raise ConfigError("attention weights need unpadded sequences (an attention mask of all ones)")
