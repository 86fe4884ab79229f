"""What each decoder layer of a config caches, and the refusal of layers kvhub cannot map.

kvhub maps one thing: per-token attention keys and values, (B, H_kv, T, D) per layer.  Full-attention and
sliding-window layers cache exactly that (a sliding layer keeps the last tokens of the same rows).  Other
layers keep something else:

- ``linear_attention`` (Qwen3-Next / Qwen3.5 gated DeltaNet, and transformers' name for the Mamba layers of
  Jamba, Bamba, Granite 4 hybrids and Nemotron-H): one recurrent state per sequence;
- ``hybrid`` (Falcon-H1): a Mamba state beside the attention cache in every layer;
- ``conv`` (LFM2): a short-convolution state;
- ``mamba`` / ``recurrent`` / ``xlstm``: pure recurrent models, no attention cache at all.

Such a state at token n depends on every earlier token's hidden state at that layer, so the target can only
get it from its own prefill of the whole prompt: "map the attention layers, recompute the rest" costs the
full prefill it was meant to save.  kvhub refuses these models where it first sees their config, naming the
layer type (:func:`check_attention_layers`).  Torch-free: it reads configs (a transformers config object or a
config.json dict), so ``kvhub plan`` and ``kvhub serve`` refuse before any model loads.
"""

from __future__ import annotations

from kvhub.errors import UnsupportedModelError

MAPPABLE = frozenset({"full_attention", "sliding_attention"})

WHAT_IT_CACHES = {  # layer type -> what it keeps instead of per-token K/V (the refusal says it)
    "linear_attention": "a recurrent state (linear attention / state-space), not one key and value per token",
    "hybrid": "a Mamba state beside its attention cache",
    "conv": "a convolution state, not one key and value per token",
    "mamba": "a state-space (Mamba) state, not one key and value per token",
    "recurrent": "a recurrent state, not one key and value per token",
    "xlstm": "a recurrent (xLSTM) state, not one key and value per token",
    "rwkv": "a recurrent (RWKV) state, not one key and value per token",
    "mlp": "no cache (feed-forward only), so its layer numbers are not attention layers",
    "moe": "no cache (feed-forward only), so its layer numbers are not attention layers",
}
_ALIASES = {
    "attention": "full_attention",
    "global": "full_attention",
    "full": "full_attention",
    "local": "sliding_attention",
    "sliding": "sliding_attention",
    "linear": "linear_attention",
}
_RECURRENT_MODEL_TYPES = {
    "mamba": "mamba",
    "mamba2": "mamba",
    "falcon_mamba": "mamba",
    "xlstm": "xlstm",
    "rwkv": "rwkv",
}
_PATTERN = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}  # Nemotron-H hybrid_override_pattern


def _field(config, key: str):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def text_config(config):
    """The decoder's part of a (possibly multimodal) config: ``text_config`` when it has one."""
    inner = _field(config, "text_config")
    return inner if inner else config


def layer_types(config) -> list[str]:
    """One type per decoder layer (transformers' names: ``full_attention``, ``sliding_attention``,
    ``linear_attention``, ``hybrid``, ``conv``, ...), from whichever field the config states them in;
    every layer ``sliding_attention`` when it states none but a sliding window (Mistral), else ``full_attention``."""
    config = text_config(config)
    layers = _field(config, "num_hidden_layers")
    layers = layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else 0
    model_type = str(_field(config, "model_type") or "")
    if model_type in _RECURRENT_MODEL_TYPES:
        return [_RECURRENT_MODEL_TYPES[model_type]] * max(layers, 1)
    if model_type.startswith("falcon_h1"):  # Mamba and attention side by side in every layer
        return ["hybrid"] * max(layers, 1)
    stated = _stated_types(config, layers)
    if stated:
        return [_ALIASES.get(str(kind).lower(), str(kind).lower()) for kind in stated]
    window = _field(config, "sliding_window")  # Mistral: one window for every layer, no layer_types
    if isinstance(window, int) and window > 0 and _field(config, "use_sliding_window") is not False:
        return ["sliding_attention"] * layers
    return ["full_attention"] * layers


def _stated_types(config, layers: int) -> list | None:
    """The per-layer types a config states, under any of the fields transformers' hybrids have used."""
    for key in ("layer_types", "layers_block_type"):
        value = _field(config, key)
        if isinstance(value, (list, tuple)) and value:
            return list(value)
    pattern = _field(config, "hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        return [_PATTERN.get(char, char) for char in pattern]
    block_types = _field(config, "block_types")  # RecurrentGemma: a cycle of "recurrent" / "attention"
    if isinstance(block_types, (list, tuple)) and block_types and layers:
        return [block_types[i % len(block_types)] for i in range(layers)]
    indices = _field(config, "attn_layer_indices")  # Bamba: none given means every layer is Mamba
    if _field(config, "model_type") == "bamba" and indices is None:
        indices = []
    if isinstance(indices, (list, tuple)) and layers:
        return ["full_attention" if i in indices else "mamba" for i in range(layers)]
    attention = _field(config, "full_attn_idxs")  # LFM2's config.json without layer_types
    if isinstance(attention, (list, tuple)) and layers:
        return ["full_attention" if i in attention else "conv" for i in range(layers)]
    period, offset = _field(config, "attn_layer_period"), _field(config, "attn_layer_offset")  # Jamba
    if isinstance(period, int) and isinstance(offset, int) and period > 0 and layers:
        return ["full_attention" if i % period == offset else "mamba" for i in range(layers)]
    interval = _field(config, "full_attention_interval")  # Qwen3-Next's config.json without layer_types
    if isinstance(interval, int) and interval > 0 and layers:
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    return None


def unmappable_layers(config) -> dict[str, list[int]]:
    """Layer type -> the indices of the layers of that type whose cache kvhub cannot map (empty: none)."""
    out: dict[str, list[int]] = {}
    for index, kind in enumerate(layer_types(config)):
        if kind not in MAPPABLE:
            out.setdefault(kind, []).append(index)
    return out


def check_attention_layers(config, *, name: str | None = None) -> None:
    """Raise UnsupportedModelError naming the layer type(s) unless every decoder layer of ``config`` caches
    per-token attention K/V (full or sliding-window attention: the module docstring says why)."""
    refused = unmappable_layers(config)
    if not refused:
        return
    inner = text_config(config)
    model_type = str(_field(inner, "model_type") or _field(config, "model_type") or "this model")
    who = f"{name} ({model_type})" if name else model_type
    total = len(layer_types(config))
    parts = [
        f"{kind} layers ({_count(indices, total)}), which cache {WHAT_IT_CACHES.get(kind, 'no per-token K/V')}"
        for kind, indices in refused.items()
    ]
    raise UnsupportedModelError(
        f"{who} has {'; and '.join(parts)}. kvhub maps per-token attention caches only (full or sliding-window "
        "attention layers in every layer): such a state at the last token depends on every earlier token, so "
        "only the target's own prefill of the whole prompt can produce it, and a mapped cache for the "
        "attention layers alone would save nothing. Use an attention-only pair of the family (e.g. Qwen3 or "
        "Qwen2.5 instead of Qwen3-Next / Qwen3.5 hybrids)"
    )


def _count(indices: list[int], total: int) -> str:
    shown = ", ".join(str(i) for i in indices[:8]) + (", ..." if len(indices) > 8 else "")
    return f"{len(indices)} of {total}: {shown}"


def check_cache_layers(cache, *, what: str = "source cache") -> None:
    """Raise UnsupportedModelError naming the layer class when a transformers cache holds a layer that keeps a
    linear-attention / state-space state (transformers' ``LinearAttention*`` layers, Falcon-H1's state beside
    its K/V included): its keys, where it has them, are not the whole of what that layer caches."""
    for index, layer in enumerate(getattr(cache, "layers", None) or []):
        if any(base.__name__.startswith("LinearAttention") for base in type(layer).__mro__):
            raise UnsupportedModelError(
                f"{what} layer {index} is a {type(layer).__name__}: it holds a linear-attention / state-space state, "
                "not only per-token keys and values; kvhub maps caches of attention-only models (full or "
                "sliding-window attention), and this model's state can only come from its own prefill"
            )
