"""The Mapper's refusals of what it is handed: a source cache it cannot read, an ``out`` it cannot write into.
Each names what it got, what it expected, and how to build the right one."""

from __future__ import annotations

import torch

from kvhub.core.layer_kinds import check_cache_layers
from kvhub.errors import IncompatibleError


def check_source_cache(cache, src: dict) -> tuple[int, int]:
    """Refuse a source cache this mapper cannot read (``src``: mapper.json's source block); return its
    (batch, tokens)."""
    check_cache_layers(cache)  # a hybrid model's state layers: refused by their type, never mapped around
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) != src["num_layers"]:
        got = "no .layers" if layers is None else f"{len(layers)} layers"
        raise IncompatibleError(
            f"source cache has {got}, but this mapper expects {src['num_layers']} layers of "
            f"{src['model_id']}; pass the cache of that model"
        )
    keys = layers[0].keys
    if keys is None or keys.dim() != 4 or 0 in (keys.shape[0], keys.shape[2]):
        raise IncompatibleError(
            "source cache is empty (no sequences or no tokens); run the source model over the context first"
        )
    batch, _, tokens, _ = keys.shape
    for index, layer in enumerate(layers):
        if not (layer.keys.is_floating_point() and layer.values.is_floating_point()):
            raise IncompatibleError(
                f"source cache layer {index} holds {layer.keys.dtype} keys and "
                f"{layer.values.dtype} values; a model's cache is floating point"
            )
        shape = tuple(layer.keys.shape)
        expected = (batch, src["num_kv_heads"], tokens, src["head_dim"])
        if shape != expected or tuple(layer.values.shape) != expected:
            raise IncompatibleError(
                f"source cache layer {index} has keys {shape}, values {tuple(layer.values.shape)}; "
                f"expected {expected} (batch, kv_heads, tokens, head_dim) of {src['model_id']}. "
                "Sliding-window layers must hold the whole context: build the source cache without "
                "a sliding window (DynamicCache() with no config) for contexts longer than the window."
            )
    return batch, tokens


def check_out(
    out, *, target: dict, layers: list[dict], device: torch.device, batch: int, tokens: int, dtype: torch.dtype | None
) -> torch.dtype:
    """Refuse an ``out`` :meth:`Mapper.map_layers` cannot write into (``target``: mapper.json's target block,
    ``layers``: its layers); return the dtype its tensors hold."""
    heads, head_dim = target["num_kv_heads"], target["head_dim"]
    if len(out) != len(layers):
        raise IncompatibleError(
            f"out holds {len(out)} (keys, values) pairs; this mapper writes "
            f"{len(layers)}, one per target layer in the order of mapper.layers"
        )
    dtypes = {t.dtype for pair in out for t in pair}
    for i, pair in enumerate(out):
        shapes = [tuple(t.shape) for t in pair]
        ok = (
            len(pair) == 2
            and shapes[0] == shapes[1]
            and len(shapes[0]) == 4
            and shapes[0][:2] == (batch, heads)
            and shapes[0][3] == head_dim
            and 1 <= shapes[0][2] <= tokens
        )
        if not ok:
            raise IncompatibleError(
                f"out[{i}] (target layer {layers[i]['target']}) holds {shapes}; expected keys and values "
                f"of shape {(batch, heads, 't', head_dim)} with 1 <= t <= {tokens} (they receive the last t tokens)"
            )
        if any(t.device != device or not t.is_floating_point() for t in pair):
            raise IncompatibleError(
                f"out[{i}] holds {pair[0].dtype} tensors on {pair[0].device}; they must be "
                f"floating point on the mapper's device {device} (Mapper.to moves it)"
            )
    if len(dtypes) != 1 or (dtype is not None and dtype not in dtypes):
        raise IncompatibleError(
            f"out holds {sorted(map(str, dtypes))} tensors but dtype={dtype} was asked; "
            "out's tensors must share one dtype, and dtype must be None or that one"
        )
    return dtypes.pop()
