"""The Mapper: per-target-layer affine maps from a source model's KV cache to a target model's.

For target layer m with selected source layers S_m = (l_1..l_k):

    X   = [K~_{l_1} | ... | K~_{l_k}]        (B, T, k*Hs*Ds)   K~ = source keys with RoPE stripped
    K~_m = X @ Wk_m + bk_m                   (B, T, Ht*Dt)     then target RoPE re-applied
    V_m  = [V_{l_1} | ... | V_{l_k}] @ Wv_m + bv_m

Weights are stored as (in_features, out_features) so that y = x @ W + b; a map kind may add a term to it
(:data:`RESIDUALS`; ``mlp``: y = x @ W + b + r(x), kvhub.core.mlp).  Transfer reads the maps de-shrunk by
default (kvhub.core.deshrink): y = mean + (y - mean) / sqrt(R^2_m), the stored tensors unchanged.

Artifact directory (kvhub.artifact owns the format, see docs/artifact-format.md):
    mapper.safetensors   k.{m}.weight, k.{m}.bias, v.{m}.weight, v.{m}.bias  (fp32; or factors when compressed)
    mapper.json          metadata incl. fingerprints, selected layers, lambda, k, R^2, sha256 of the tensors
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from kvhub.artifact import (  # noqa: F401  (re-exported: the artifact format is part of the Mapper's API)
    FORMAT_VERSION,
    METADATA_FILE,
    TENSORS_FILE,
    format_version_of,
    read_artifact,
    read_metadata,
    tensor_path,
    verify_tensors,
    write_artifact,
)
from kvhub.artifact import map_prefix, tensor_name
from kvhub.artifact.kinds import kind_of
from kvhub.artifact.metadata import shown
from kvhub.dtypes import check_device, parse_dtype  # parse_dtype is re-exported too
from kvhub.errors import IncompatibleError, NonFiniteError
from kvhub.core.batched_map import map_stacked, stacked_maps
from kvhub.core.deshrink import DESHRINK, DESHRINK_DEFAULT, deshrink_setting  # noqa: F401  (part of the Mapper's API)
from kvhub.core.fingerprint import config_from_fingerprint
from kvhub.core.mlp import residual_term
from kvhub.core.rope import Rotary, apply_rope, strip_rope
from kvhub.core.staging import (
    finite as _finite,
    hand_over as _hand_over,
    rows as _rows,
    stack_on as _stack_on,
    to_device as _to_device,
)
from kvhub.core.mapper_checks import check_out, check_source_cache

RESIDUALS = {"mlp": residual_term}  # map kind (kvhub.artifact.kinds) -> the term it adds to the linear map


# Elements of one stacked block of layers (G, B, H, T, D): bounds the fp32 RoPE temporaries (a few of these
# at 4 bytes each) while keeping the number of kernel launches per transfer independent of the depth at
# the context lengths where launches matter.
_CHUNK_ELEMENTS = 1 << 26


def _chunks(items: list[int], per_item: int) -> list[list[int]]:
    """``items`` in consecutive chunks of at most _CHUNK_ELEMENTS // per_item (at least one) each."""
    step = max(1, _CHUNK_ELEMENTS // max(per_item, 1))
    return [items[start : start + step] for start in range(0, len(items), step)]


def _inputs(rows: dict[int, torch.Tensor], sources: list[int], keep: int) -> list[torch.Tensor]:
    """The column blocks of X = [rows_l1 | ... | rows_lk] over the last ``keep`` tokens: k views (B, keep, Hs*Ds)."""
    return [rows[l][:, rows[l].shape[1] - keep :] for l in sources]


def _write(y: torch.Tensor, into: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``y`` copied into ``into`` in place, or into a new contiguous tensor of ``dtype``: one copy either way."""
    if into is None:
        into = torch.empty(y.shape, dtype=dtype, device=y.device)
    return into.copy_(y)


def _summed(products) -> torch.Tensor:
    """Sum of the k per-source-block GEMM products, accumulated in fp32 when they are bf16/fp16: one GEMM
    over the concatenated blocks would accumulate in fp32 too, and k roundings to bf16 would add error."""
    total = None
    for product in products:
        if total is None:
            total = product.float() if product.dtype in (torch.bfloat16, torch.float16) else product
        else:
            total.add_(product)
    return total


class Mapper:
    """Weights + metadata: the math of a mapper.  Build with :func:`kvhub.fitting.fit` or :meth:`load`; apply
    with :meth:`transfer`; keep with :meth:`save`.  ``ref`` names the store version it is
    (``SRC:DST:CALIB@v3``), None for a mapper no store holds.  The public ``kvhub.Mapper``
    (:class:`kvhub.api.Mapper`) is this class with the Hub-style face: ``from_pretrained``,
    ``save_pretrained`` and ``push_to_hub``, which need the store and the Hub, stages above this one."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        metadata: dict,
        *,
        dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype | None = None,
        deshrink: str | None = None,
    ):
        """dtype: of the caches ``transfer`` returns (default: the target's at fit time).
        compute_dtype: of the mapping matmuls (default: the output dtype; bf16 GEMMs are ~2x faster than
        fp32 on CPUs with avx512_bf16 and far faster on GPUs, and the cache is stored in that dtype anyway).
        RoPE is always stripped and re-applied in fp32.
        deshrink: how transfer reads the maps (:data:`DESHRINK`; None: :data:`DESHRINK_DEFAULT` where the
        tensors allow it, see :func:`deshrink_setting`); ``self.deshrink`` is what applies.
        """
        self.tensors = tensors
        self.metadata = metadata
        self.kind = kind_of(metadata)
        self.ref: str | None = None  # the store version this is (SRC:DST:CALIB@vN), set by whoever resolved it
        self.dtype = dtype or parse_dtype(metadata.get("target", {}).get("dtype")) or torch.float32
        self.compute_dtype = compute_dtype
        self._cast: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._rotary: dict[str, Rotary] = {}
        self._configs: dict = {}
        self._windowed: bool | None = None
        self.deshrink = deshrink_setting(deshrink, tensors, metadata.get("layers", []))
        self._scaled: dict[str, torch.Tensor] | None = None  # the tensors deshrink rescales (_deshrunk_tensors)
        self._stacks: dict = {}  # (device, compute dtype, deshrink) -> kvhub.core.batched_map.Stack or None

    # ---- metadata views -------------------------------------------------------------------------
    @property
    def source(self) -> dict:
        """Source model fingerprint."""
        return self.metadata["source"]

    @property
    def target(self) -> dict:
        """Target model fingerprint."""
        return self.metadata["target"]

    @property
    def layers(self) -> list[dict]:
        """One dict per target layer: target, sources, lambda_k, lambda_v, r2_k, r2_v."""
        return self.metadata["layers"]

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def __repr__(self) -> str:
        name = self.ref or f"{self.source['model_id']} -> {self.target['model_id']}, not in a store"
        return (
            f"Mapper({name}, {len(self.layers)} target layers, k={shown(self.metadata.get('k'))}, "
            f"{self.num_parameters():,} params)"
        )

    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.tensors.values())

    def format_version(self) -> int:
        """The artifact format version these tensors need (kvhub.artifact.format_version_of): 1 for dense
        maps (readable by every kvhub), 2 with low-rank or head-local maps, 3 with target_mean tensors."""
        return format_version_of({name: tuple(t.shape) for name, t in self.tensors.items()})

    def to(self, device=None, dtype: torch.dtype | None = None) -> "Mapper":
        """Move weights (in place) and/or set the output cache dtype; returns self."""
        if device is not None:
            self.tensors = {name: t.to(device) for name, t in self.tensors.items()}
            self._cast.clear()
            self._stacks.clear()
            self._scaled = None
        if dtype is not None:
            self.dtype = dtype
        return self

    def deshrunk(self, kinds: str = "kv") -> "Mapper":
        """A copy of this mapper (the same tensors) that transfers with ``deshrink=kinds``: "kv" (keys and
        values), "v" (values only) or "off" (the maps as fitted).  See :data:`DESHRINK`."""
        copy = type(self)(
            self.tensors, self.metadata, dtype=self.dtype, compute_dtype=self.compute_dtype, deshrink=kinds
        )
        copy.ref = self.ref
        return copy

    def _deshrunk_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors ``deshrink`` rescales, by name: weights x s and bias s b + (1 - s) mean per target layer
        and kind, s = 1/sqrt(max(R^2, 0.25)) (:data:`DESHRINK`); a layer without held-out R^2 is kept.
        Computed once per device; the stored tensors are never changed (save writes the maps as fitted)."""
        if self._scaled is None:
            self._scaled = {}
            for layer in self.layers:
                for kind in self.deshrink if self.deshrink != "off" else "":
                    r2 = layer.get(f"r2_{kind}")
                    if r2 is None:
                        continue
                    prefix = map_prefix(kind, layer["target"])
                    scale = 1 / math.sqrt(max(r2, 0.25))
                    dense = tensor_name(prefix, "weight")
                    last = dense if dense in self.tensors else tensor_name(prefix, "weight_b")
                    bias, mean = tensor_name(prefix, "bias"), self.tensors[tensor_name(prefix, "target_mean")]
                    self._scaled[last] = self.tensors[last] * scale
                    self._scaled[bias] = scale * self.tensors[bias] + (1 - scale) * mean
                    for name in (tensor_name(prefix, p) for p in self.kind.output_parts(self.kind_settings())):
                        self._scaled[name] = self.tensors[name] * scale
        return self._scaled

    # ---- transfer ----------------------------------------------------------------------------
    def windowed_target(self) -> bool:
        """True when the target has sliding-window layers (its cache keeps only the last tokens there)."""
        if self._windowed is None:  # asked on every handoff: build the probe cache once
            from transformers import DynamicCache

            layers = DynamicCache(config=self._config("target")).layers
            self._windowed = any(getattr(layer, "sliding_window", None) for layer in layers)
        return self._windowed

    def _config(self, side: str):
        if side not in self._configs:
            self._configs[side] = config_from_fingerprint(self.metadata[side])
        return self._configs[side]

    def _rotary_for(self, side: str, device: torch.device) -> Rotary:
        key = f"{side}@{device}"
        if key not in self._rotary:
            self._rotary[key] = Rotary.from_config(self._config(side), device=device)
        return self._rotary[key]

    @torch.no_grad()
    def map_layers(
        self,
        source_keys: list[torch.Tensor],
        source_values: list[torch.Tensor],
        position_ids: torch.Tensor,
        *,
        dtype: torch.dtype | None = None,
        out: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Map per-layer source K/V (B, Hs, T, Ds) to target K/V (B, Ht, T, Dt), one pair per entry of
        ``self.layers`` (mapper.json order).  Source keys carry the source RoPE at ``position_ids`` (B, T) or
        (1, T); the result carries the target's.  The source tensors are only read (any device and float
        dtype; host tensors go to a CUDA mapper through pinned memory without blocking the host).

        Without ``out``: new contiguous tensors in ``dtype`` (default self.dtype), owned by the caller.
        With ``out`` (one (keys, values) pair per entry of self.layers, each (B, Ht, t, Dt) with 1 <= t <= T,
        on the mapper's device): the last t tokens are written into those tensors in place, in their own
        dtype (``dtype`` must then be None or theirs), and ``out`` is returned.  On NonFiniteError the
        contents of ``out`` are unspecified.

        Host synchronisation: the finiteness checks of the source layers and of the mapped output at the
        end (NonFiniteError for either; the rotary modules of dynamic/longrope RoPE in transformers add
        their own).
        """
        batch, _, tokens, _ = source_keys[0].shape
        if out is not None:
            dtype = check_out(
                out, target=self.target, layers=self.layers, device=self.device, batch=batch, tokens=tokens, dtype=dtype
            )
        dtype = dtype or self.dtype
        position_ids = _to_device(position_ids, self.device)
        compute = self.compute_dtype or dtype
        kept = [tokens] * len(self.layers) if out is None else [keys.shape[-2] for keys, _ in out]
        # dense ridge maps of one k and one target RoPE run batched; residual, low-rank, head-local or mixed maps
        # loop: they do not stack into one GEMM (batched_map.stacked_maps)
        stack = None if self.kind.name in RESIDUALS else stacked_maps(self, compute, kept)
        if stack is not None:
            mapped, finite, checked, mapped_finite = map_stacked(
                stack, self, source_keys, source_values, position_ids, dtype, out, _CHUNK_ELEMENTS
            )
        else:
            rows_k, rows_v, finite, checked = self._source_rows(source_keys, source_values, position_ids, compute)
            result = self._target_layers(rows_k, rows_v, position_ids, kept, dtype, out)
            mapped = result if out is None else out
            mapped_finite = torch.cat([_finite(k.reshape(1, -1)) & _finite(v.reshape(1, -1)) for k, v in mapped])
        if not bool(finite.all()):  # the host synchronisation
            bad = min(checked[i] for i in (~finite).nonzero().flatten().tolist())
            raise NonFiniteError(
                f"source cache layer {bad} contains NaN or Inf; the source model's forward pass is broken "
                "(try float32 or bfloat16 instead of float16)"
            )
        if not bool(mapped_finite.all()):
            bad = self.layers[int((~mapped_finite).nonzero()[0])]["target"]
            raise NonFiniteError(
                f"the mapped K/V of target layer {bad} hold NaN or Inf although the source cache is finite: the "
                f"map's output overflows {dtype} (a damaged mapper, or values too large for it); map to float32 "
                "or bfloat16, or check the mapper with `kvhub show --verify`"
            )
        return mapped

    def _source_rows(self, source_keys, source_values, position_ids, compute: torch.dtype):
        """The rows every map reads: {l: (B, T, Hs*Ds)} of RoPE-stripped keys and of values in ``compute``,
        for the source layers any map selects; plus (finite, checked): a device bool per checked layer (are
        its keys and values finite) and those layers.  Layers sharing cos/sin are stripped together (fp32),
        in chunks of at most _CHUNK_ELEMENTS elements."""
        rotary = self._rotary_for("source", self.device)
        needed = sorted({l for layer in self.layers for l in layer["sources"]})
        rows_k, rows_v, finite, checked = {}, {}, [], []
        for group in rotary.layer_groups(needed):
            cos, sin = rotary.cos_sin(position_ids, group[0])  # (B, T, rot)
            for chunk in _chunks(group, source_keys[group[0]].numel()):
                keys = _stack_on([source_keys[l] for l in chunk], self.device)  # (G, B, Hs, T, Ds)
                values = _stack_on([source_values[l] for l in chunk], self.device)
                finite.append(_finite(keys) & _finite(values))  # (G,)
                checked += chunk
                keys, values = _rows(strip_rope(keys.float(), cos, sin), compute), _rows(values, compute)
                for i, l in enumerate(chunk):
                    rows_k[l], rows_v[l] = keys[i], values[i]
        return rows_k, rows_v, torch.cat(finite), checked

    def _target_layers(self, rows_k, rows_v, position_ids, kept: list[int], dtype: torch.dtype, out) -> list:
        """Every map applied to the last kept[i] tokens of its source rows, target RoPE re-applied: one
        (keys, values) per entry of self.layers (see map_layers for ``out``)."""
        rotary = self._rotary_for("target", self.device)
        heads, head_dim = self.target["num_kv_heads"], self.target["head_dim"]
        batch, tokens, _ = next(iter(rows_k.values())).shape
        targets = [layer["target"] for layer in self.layers]
        result: list = [None] * len(self.layers)
        for group in rotary.layer_groups(targets):
            entries = [i for i, m in enumerate(targets) if m in group]
            for keep in sorted({kept[i] for i in entries}):
                cos, sin = rotary.cos_sin(position_ids[:, tokens - keep :], group[0])  # (B, keep, rot)
                same = [i for i in entries if kept[i] == keep]
                for chunk in _chunks(same, batch * heads * keep * head_dim):
                    self._map_chunk(chunk, rows_k, rows_v, keep, (cos, sin), dtype, out, result)
        return result

    def _map_chunk(self, chunk: list[int], rows_k, rows_v, keep: int, cos_sin, dtype, out, result: list) -> None:
        """Fill result[i] for the entries ``chunk`` of self.layers, whose target layers share ``cos_sin``:
        each map through Mapper._affine, then one RoPE application over the chunk's stacked keys."""
        heads, head_dim = self.target["num_kv_heads"], self.target["head_dim"]
        batch = next(iter(rows_k.values())).shape[0]
        staged = torch.empty(len(chunk), batch, heads, keep, head_dim, device=self.device)  # fp32 (G, B, Ht, keep, Dt)
        values = {}
        for j, i in enumerate(chunk):
            layer = self.layers[i]
            yk = self._affine(_inputs(rows_k, layer["sources"], keep), "k", layer["target"])  # (B, keep, Ht*Dt)
            staged[j].copy_(yk.view(batch, keep, heads, head_dim).transpose(1, 2))
            yv = self._affine(_inputs(rows_v, layer["sources"], keep), "v", layer["target"])
            values[i] = _write(
                yv.view(batch, keep, heads, head_dim).transpose(1, 2), None if out is None else out[i][1], dtype
            )
        keys = apply_rope(staged, *cos_sin)
        if out is None:
            keys = keys.to(dtype)
        for j, i in enumerate(chunk):
            result[i] = (keys[j] if out is None else out[i][0].copy_(keys[j]), values[i])

    def kind_settings(self) -> dict:
        """The settings block of this mapper's kind in mapper.json (empty for ridge)."""
        return self.metadata.get(self.kind.block) or {} if self.kind.block else {}

    def _affine(self, parts: list[torch.Tensor], kind: str, m: int) -> torch.Tensor:
        """The map of target layer m's keys or values (``kind`` k or v): :meth:`_linear`, plus the term of this
        mapper's kind (:data:`RESIDUALS`) in fp32, cast back.  A new (..., out) tensor in the parts' dtype."""
        y = self._linear(parts, kind, m)
        term = RESIDUALS.get(self.kind.name)
        if term is None:
            return y
        r = term(parts, map_prefix(kind, m), self.kind_settings(), lambda name: self._weight(name, parts[0].dtype))
        return (y.float() + r.view_as(y)).to(y.dtype)

    def _linear(self, parts: list[torch.Tensor], kind: str, m: int) -> torch.Tensor:
        """y = X @ W + b for X = [x_1 | ... | x_k], given as its column blocks x_j (..., Hs*Ds) (one per source
        layer, never concatenated: X @ W = sum_j x_j @ W_j over W's row blocks): each product in their dtype
        (fp32 accumulation inside the GEMM), the k products summed in fp32 (:func:`_summed`).  Every stored map structure: ``weight`` (in, out), or low rank
        ``weight_a`` (in, r) @ ``weight_b`` (r, out); stacked over head groups (a leading groups dim) for
        head-local maps, group g reading its heads of every source layer (docs/artifact-format.md).
        Returns a new (..., out) tensor."""
        prefix = map_prefix(kind, m)
        dense = tensor_name(prefix, "weight")
        bias = self._weight(tensor_name(prefix, "bias"), parts[0].dtype)
        factors = (
            [dense] if dense in self.tensors else [tensor_name(prefix, "weight_a"), tensor_name(prefix, "weight_b")]
        )
        first, *rest = [self._weight(f, parts[0].dtype) for f in factors]
        dtype = parts[0].dtype
        rows = [x.reshape(-1, x.shape[-1]) for x in parts]  # k x (N, Hs*Ds)
        if first.dim() == 2:
            blocks = first.split(rows[0].shape[1])  # k x (Hs*Ds, out or r)
            y = _summed(x @ block for x, block in zip(rows, blocks))
            y = torch.addmm(bias, y.to(dtype), rest[0]) if rest else y.add_(bias).to(dtype)
            return y.view(*parts[0].shape[:-1], -1)
        groups = first.shape[0]
        blocks = first.split(rows[0].shape[1] // groups, dim=1)  # k x (groups, Hs*Ds / groups, out/groups or r)
        # (N, Hs*Ds) -> (groups, N, Hs*Ds / groups): group g's heads of source layer j
        grouped = [x.view(x.shape[0], groups, -1).transpose(0, 1) for x in rows]
        y = _summed(torch.bmm(x, block) for x, block in zip(grouped, blocks))
        if rest:
            y = torch.bmm(y.to(dtype), rest[0])  # (groups, N, out / groups)
        return y.transpose(0, 1).reshape(*parts[0].shape[:-1], -1).add_(bias).to(dtype)

    def _weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        key = (name, dtype)
        if key not in self._cast:
            self._cast[key] = self._deshrunk_tensors().get(name, self.tensors[name]).to(dtype)
        return self._cast[key]

    @torch.no_grad()
    def transfer(
        self, source_cache, *, position_ids: torch.Tensor | None = None, dtype: torch.dtype | None = None, out=None
    ):
        """Map a source-model cache to a target-model ``DynamicCache``.

        source_cache: a transformers cache of the source model, every layer (B, Hs, T, Ds).
        position_ids: (B, T) positions of the cached tokens; default 0..T-1 (no left padding).
        Returns a new ``DynamicCache(config=target_config)`` on the mapper's device in ``dtype`` (default
        ``self.dtype``: the target's dtype at fit time, or Mapper.load's), sliding-window layers included.
        out: a ``DynamicCache`` of the target already holding every layer at T tokens for this batch (e.g. an
        earlier transfer's result): its tensors are overwritten in place, in their dtype, and it is returned.
        The caller keeps the last prompt token for the target (see :func:`kvhub.serving.handoff.handoff`).
        """
        from transformers import DynamicCache

        batch, tokens = check_source_cache(source_cache, self.source)
        if position_ids is None:
            position_ids = torch.arange(tokens, device=self.device).expand(batch, tokens)
        elif tuple(position_ids.shape) != (batch, tokens):
            raise IncompatibleError(f"position_ids has shape {tuple(position_ids.shape)}; expected {(batch, tokens)}")
        keys, values = [layer.keys for layer in source_cache.layers], [layer.values for layer in source_cache.layers]
        if out is not None:
            self.map_layers(keys, values, position_ids, dtype=parse_dtype(dtype), out=self._out_layers(out, tokens))
            return out
        mapped = self.map_layers(keys, values, position_ids, dtype=parse_dtype(dtype))
        cache = DynamicCache(config=self._config("target"))
        # each map to its own target layer, whatever the order of mapper.json's `layers` (they cover each once)
        for layer, (keys, values) in sorted(zip(self.layers, mapped), key=lambda pair: pair[0]["target"]):
            _hand_over(cache, layer["target"], keys, values)
        return cache

    def _out_layers(self, cache, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (keys, values) tensors of ``cache`` that map_layers(out=...) overwrites, in self.layers order;
        refused unless every layer holds what a DynamicCache holds after T tokens (a sliding-window layer:
        the last min(T, window - 1))."""
        from transformers import DynamicCache

        expected = self.target["num_layers"]
        layers = getattr(cache, "layers", [])
        if not isinstance(cache, DynamicCache) or len(layers) != expected:
            raise IncompatibleError(
                f"out must be a DynamicCache of the target's {expected} layers, got {type(cache).__name__} with "
                f"{len(layers)}; pass an earlier transfer()'s result for the same batch size and length"
            )
        for m, layer in enumerate(layers):
            held = None if layer.keys is None or layer.keys.dim() != 4 else layer.keys.shape[-2]
            window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
            if layer.get_seq_length() != tokens or held != (tokens if window is None else min(tokens, window - 1)):
                raise IncompatibleError(
                    f"out layer {m} has seen {layer.get_seq_length()} tokens and holds {held}; a {tokens}-token source "
                    "cache needs a target cache of the same length (e.g. an earlier transfer()'s result), or no out"
                )
        return [(layers[layer["target"]].keys, layers[layer["target"]].values) for layer in self.layers]

    # ---- persistence -------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the artifact directory atomically (kvhub.artifact.write_artifact); returns its path.
        Tensors are stored in fp32."""
        tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in self.tensors.items()}
        self.metadata = write_artifact(directory, tensors, self.metadata, overwrite=overwrite)
        return Path(directory)

    @classmethod
    def load(
        cls, directory: str | os.PathLike, *, device=None, dtype=None, compute_dtype=None, deshrink: str | None = None
    ) -> "Mapper":
        """Load an artifact directory after every check of the format (kvhub.artifact.read_artifact:
        mapper.json fields, tensor names and shapes, sha256, finite weights).  See __init__ for dtypes and
        ``deshrink``."""
        from safetensors.torch import load_file

        metadata = read_artifact(directory)
        check_device(device)  # before safetensors' own error for a missing CUDA (which names neither)
        tensors = load_file(str(tensor_path(directory, metadata)), device=str(device) if device is not None else "cpu")
        return cls(
            tensors, metadata, dtype=parse_dtype(dtype), compute_dtype=parse_dtype(compute_dtype), deshrink=deshrink
        )
