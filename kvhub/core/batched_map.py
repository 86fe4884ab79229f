"""Dense ridge maps of every target layer at once: a few kernels per transfer, whatever the depth.

For the M entries of ``mapper.layers`` (target layers m_i reading source layers S_i = (l_1..l_k), one k for all):

    R   = RoPE-stripped source rows, slot s = source layer order[s]      (B, T, L, Hs*Ds)
    X_i = [R[:, :, s(l_1)] | ... | R[:, :, s(l_k)]] over the kept tokens  (N, k*Hs*Ds)    N = B * keep
    Y   = baddbmm(b, X, W)                                              (M, N, Ht*Dt)   W (M, k*Hs*Ds, Ht*Dt)

for K and for V, then the target RoPE re-applied to all M layers' keys in one call: what
:meth:`kvhub.core.mapper.Mapper._linear` computes layer by layer, as one GEMM per chunk of layers (fp32
accumulation inside the GEMM, one rounding: at least as accurate in bf16 as the loop's summed block products).
:meth:`~kvhub.core.mapper.Mapper.map_layers` dispatches here when :func:`stacked_maps` gives a Stack, and
runs its per-layer loop otherwise.  This module is the Mapper's helper: it reads the mapper's cast weights
(``_weight``), rotary modules (``_rotary_for``) and keeps its stacks in ``mapper._stacks``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhub.artifact import map_prefix, tensor_name
from kvhub.core.rope import apply_rope, strip_rope
from kvhub.core.staging import finite as _finite, stack_on as _stack_on

_ENABLED = True  # private switch: False forces Mapper.map_layers' per-layer loop (tests compare the two)


@dataclass(frozen=True)
class Stack:
    """Every map of a mapper stacked in one compute dtype on its device.  ``order``: the staged source layers
    (slot s holds layer order[s]); ``index`` (M, k) long: the slots entry i reads, in its ``sources`` order;
    ``weight`` {"k", "v"}: (M, k*Hs*Ds, Ht*Dt); ``bias`` {"k", "v"}: (M, 1, Ht*Dt)."""

    order: list[int]
    index: torch.Tensor
    weight: dict[str, torch.Tensor]
    bias: dict[str, torch.Tensor]


def stacked_maps(mapper, compute: torch.dtype, kept: list[int]) -> Stack | None:
    """The Stack of ``mapper``'s maps in ``compute`` (built at first use per device, compute dtype and deshrink
    setting), or None where the per-layer loop runs instead.  The loop keeps: maps that are not one dense
    (in, out) weight (low rank, head-local: no single GEMM without multiplying them out), target layers of
    several rotary groups or kept lengths (Gemma 3's local/global layers, sliding-window ``out`` tensors),
    which the loop takes group by group.  Maps of different k (a fit picks k per layer) are padded.  The
    caller rules out kinds that add a term to the linear map (kvhub.core.mapper.RESIDUALS)."""
    if not _ENABLED or len(set(kept)) != 1:
        return None
    targets = [layer["target"] for layer in mapper.layers]
    if len(mapper._rotary_for("target", mapper.device).layer_groups(targets)) != 1:
        return None
    key = (mapper.device, compute, mapper.deshrink)
    if key not in mapper._stacks:
        mapper._stacks[key] = _build(mapper, compute)
    return mapper._stacks[key]


def _build(mapper, compute: torch.dtype) -> Stack | None:
    """Stack the maps (None unless every one is a dense 2-D weight), read through ``mapper._weight`` so the
    deshrink setting and the cast apply exactly as in the loop."""
    names = {
        kind: [tensor_name(map_prefix(kind, layer["target"]), "weight") for layer in mapper.layers] for kind in "kv"
    }
    if not all(name in mapper.tensors and mapper.tensors[name].dim() == 2 for kind in "kv" for name in names[kind]):
        return None
    needed = sorted({l for layer in mapper.layers for l in layer["sources"]})
    order = [l for group in mapper._rotary_for("source", mapper.device).layer_groups(needed) for l in group]
    slot = {l: s for s, l in enumerate(order)}
    # a fit picks k per layer: maps reading fewer sources are padded to the most with zero weight blocks (their
    # slot: the layer's first source), which add exact zeros to the GEMM
    width = max(len(layer["sources"]) for layer in mapper.layers)
    index = torch.tensor(
        [[slot[l] for l in layer["sources"]] + [slot[layer["sources"][0]]] * (width - len(layer["sources"]))
         for layer in mapper.layers], device=mapper.device,
    )  # fmt: skip
    weight, bias = {}, {}
    for kind in "kv":
        weight[kind] = _stacked(mapper, names[kind], compute)  # (M, k*Hs*Ds, Ht*Dt)
        biases = [tensor_name(map_prefix(kind, layer["target"]), "bias") for layer in mapper.layers]
        bias[kind] = _stacked(mapper, biases, compute).unsqueeze(1)  # (M, 1, Ht*Dt)
    return Stack(order, index, weight, bias)


def _stacked(mapper, names: list[str], dtype: torch.dtype) -> torch.Tensor:
    """torch.stack of mapper._weight(name, dtype) over ``names``: (M, *shape), rows past a shorter weight's zero
    (a map of fewer source layers).  The mapper's cast cache then holds views of the stack, so the stack costs
    no second copy of the weights the loop reads."""
    weights = [mapper._weight(name, dtype) for name in names]
    rows = max(w.shape[0] for w in weights)
    stack = torch.zeros(len(names), rows, *weights[0].shape[1:], dtype=dtype, device=weights[0].device)
    for i, (name, weight) in enumerate(zip(names, weights)):
        stack[i, : weight.shape[0]].copy_(weight)
        mapper._cast[(name, dtype)] = stack[i, : weight.shape[0]]
    return stack


def _chunks(items: list, per_item: int, limit: int) -> list[list]:
    """``items`` in consecutive chunks of at most limit // per_item (at least one) each."""
    step = max(1, limit // max(per_item, 1))
    return [items[start : start + step] for start in range(0, len(items), step)]


def _stage(mapper, order: list[int], source_keys, source_values, position_ids, compute: torch.dtype, limit: int):
    """The rows every map reads: (rows_k, rows_v), each (B, T, L, Hs*Ds) in ``compute`` with slot s = source layer
    order[s], keys RoPE-stripped in fp32 per group of shared cos/sin in chunks of at most ``limit`` elements
    (as Mapper._source_rows); and finite (L,) bool: are layer order[s]'s keys and values finite."""
    rotary = mapper._rotary_for("source", mapper.device)
    batch, heads, tokens, dim = source_keys[order[0]].shape
    rows_k = torch.empty(batch, tokens, len(order), heads, dim, dtype=compute, device=mapper.device)
    rows_v = torch.empty_like(rows_k)
    finite, start = [], 0
    for group in rotary.layer_groups(order):  # the groups in order: their concatenation is ``order``
        cos, sin = rotary.cos_sin(position_ids, group[0])  # (B, T, rot)
        for chunk in _chunks(group, source_keys[group[0]].numel(), limit):
            keys = _stack_on([source_keys[l] for l in chunk], mapper.device)  # (G, B, Hs, T, Ds)
            values = _stack_on([source_values[l] for l in chunk], mapper.device)
            finite.append(_finite(keys) & _finite(values))  # (G,)
            stop = start + len(chunk)
            # (G, B, Hs, T, Ds) -> (B, T, G, Hs, Ds): token-major, so a map's k source rows sit side by side
            rows_k[:, :, start:stop].copy_(strip_rope(keys.float(), cos, sin).permute(1, 3, 0, 2, 4))
            rows_v[:, :, start:stop].copy_(values.permute(1, 3, 0, 2, 4))
            start = stop
    return rows_k.flatten(3), rows_v.flatten(3), torch.cat(finite)


def _affine(rows: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Y = X @ W + b for G maps at once: rows (B, keep, L, w), index (G, k) slots, weight (G, k*w, out), bias
    (G, 1, out) -> a new (G, B*keep, out) tensor in the rows' dtype."""
    batch, keep, _, width = rows.shape
    maps, k = index.shape
    picked = rows.index_select(2, index.flatten())  # (B, keep, G*k, w)
    x = picked.view(batch * keep, maps, k * width).transpose(0, 1)  # (G, N, k*w): [x_l1 | ... | x_lk], no copy
    return torch.baddbmm(bias, x, weight)


def _heads(y: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """(G, B*keep, H*D) -> a (G, B, H, keep, D) view."""
    maps, rows, width = y.shape
    return y.view(maps, batch, rows // batch, heads, width // heads).transpose(2, 3)


def map_stacked(stack: Stack, mapper, source_keys, source_values, position_ids, dtype: torch.dtype, out, limit: int):
    """Mapper.map_layers for a Stack (same arguments; ``limit``: the most elements of one chunk's temporaries).
    Returns (mapped, finite, checked, mapped_finite): one (keys, values) pair per entry of mapper.layers (views
    of one (M, B, Ht, keep, Dt) tensor each without ``out``, else ``out`` written in place); the source layers'
    finiteness (L,) and those layers; the mapped pairs' finiteness (M,) in ``dtype``."""
    compute = stack.weight["k"].dtype
    rows_k, rows_v, finite = _stage(mapper, stack.order, source_keys, source_values, position_ids, compute, limit)
    batch, tokens, _, width = rows_k.shape
    keep = tokens if out is None else out[0][0].shape[-2]
    rows_k, rows_v = rows_k[:, tokens - keep :], rows_v[:, tokens - keep :]  # (B, keep, L, Hs*Ds)
    heads, head_dim = mapper.target["num_kv_heads"], mapper.target["head_dim"]
    cos, sin = mapper._rotary_for("target", mapper.device).cos_sin(
        position_ids[:, tokens - keep :], mapper.layers[0]["target"]
    )  # (B, keep, rot)

    def empty(maps: int) -> torch.Tensor:
        return torch.empty(maps, batch, heads, keep, head_dim, dtype=dtype, device=mapper.device)

    everything = len(mapper.layers)
    keys_all, values_all = (empty(everything), empty(everything)) if out is None else (None, None)
    mapped_finite = []
    per_map = batch * keep * max(stack.index.shape[1] * width, heads * head_dim)
    for chunk in _chunks(list(range(everything)), per_map, limit):
        maps = slice(chunk[0], chunk[-1] + 1)
        # without out: straight into the result; with out: the chunk's own tensors, then one foreach copy
        keys, values = (keys_all[maps], values_all[maps]) if out is None else (empty(len(chunk)), empty(len(chunk)))
        y = _affine(rows_k, stack.index[maps], stack.weight["k"][maps], stack.bias["k"][maps])
        keys.copy_(apply_rope(_heads(y, batch, heads).float(), cos, sin))  # RoPE in fp32
        y = _affine(rows_v, stack.index[maps], stack.weight["v"][maps], stack.bias["v"][maps])
        values.copy_(_heads(y, batch, heads))
        mapped_finite.append(_finite(keys) & _finite(values))  # (G,)
        if out is not None:
            torch._foreach_copy_([pair[0] for pair in out[maps]], list(keys.unbind(0)))
            torch._foreach_copy_([pair[1] for pair in out[maps]], list(values.unbind(0)))
    mapped = out if out is not None else list(zip(keys_all.unbind(0), values_all.unbind(0)))
    return mapped, finite, stack.order, torch.cat(mapped_finite)
