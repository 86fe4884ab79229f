"""The Mapper: per-target-layer affine maps from a source model's KV cache to a target model's.

For target layer m with selected source layers S_m = (l_1..l_k):

    X   = [K~_{l_1} | ... | K~_{l_k}]        (B, T, k*Hs*Ds)   K~ = source keys with RoPE stripped
    K~_m = X @ Wk_m + bk_m                   (B, T, Ht*Dt)     then target RoPE re-applied
    V_m  = [V_{l_1} | ... | V_{l_k}] @ Wv_m + bv_m

Weights are stored as (in_features, out_features) so that y = x @ W + b.

Artifact directory (kvhub.artifact owns the format, see docs/artifact-format.md):
    mapper.safetensors   k.{m}.weight, k.{m}.bias, v.{m}.weight, v.{m}.bias  (fp32; or factors when compressed)
    mapper.json          metadata incl. fingerprints, selected layers, lambda, k, R^2, sha256 of the tensors
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .artifact import (  # noqa: F401  (re-exported: the artifact format is part of the Mapper's API)
    FORMAT_VERSION, METADATA_FILE, TENSORS_FILE, format_version_of, read_artifact, read_metadata, tensor_path,
    verify_tensors, write_artifact,
)
from .errors import IncompatibleError, NonFiniteError
from .fingerprint import config_from_fingerprint
from .rope import Rotary, apply_rope, strip_rope


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """'bf16'/'bfloat16'/torch.bfloat16 -> torch.bfloat16; None stays None."""
    if isinstance(name, torch.dtype) and not name.is_floating_point:
        from .errors import ConfigError

        raise ConfigError(f"dtype {name} is not a floating-point type; use one of float32, bfloat16, float16")
    if name is None or isinstance(name, torch.dtype):
        return name
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
    key = aliases.get(name, name).replace("torch.", "")
    if key not in _DTYPES:
        from .errors import ConfigError

        raise ConfigError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16")
    return _DTYPES[key]


class Mapper:
    """Weights + metadata.  Build with :func:`kvhub.fit`, :meth:`from_pretrained` or :meth:`load`; apply with
    :meth:`transfer`; keep with :meth:`save_pretrained` / :meth:`push_to_hub`.  ``ref`` names the store
    version it is (``SRC:DST:CALIB@v3``), None for a mapper no store holds."""

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict, *, dtype: torch.dtype | None = None,
                 compute_dtype: torch.dtype | None = None):
        """dtype: of the caches ``transfer`` returns (default: the target's at fit time).
        compute_dtype: of the mapping matmuls (default: the output dtype; bf16 GEMMs are ~2x faster than
        fp32 on CPUs with avx512_bf16 and far faster on GPUs, and the cache is stored in that dtype anyway).
        RoPE is always stripped and re-applied in fp32.
        """
        self.tensors = tensors
        self.metadata = metadata
        self.ref: str | None = None  # the store version this is (SRC:DST:CALIB@vN), set by whoever resolved it
        self.dtype = dtype or parse_dtype(metadata.get("target", {}).get("dtype")) or torch.float32
        self.compute_dtype = compute_dtype
        self._cast: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._rotary: dict[str, Rotary] = {}
        self._configs: dict = {}

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
        k = self.metadata.get("k")
        return (f"Mapper({name}, {len(self.layers)} target layers, k={'auto' if k is None else k}, "
                f"{self.num_parameters():,} params)")

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
        if dtype is not None:
            self.dtype = dtype
        return self

    # ---- transfer ----------------------------------------------------------------------------
    def windowed_target(self) -> bool:
        """True when the target has sliding-window layers (its cache keeps only the last tokens there)."""
        from transformers import DynamicCache

        return any(getattr(layer, "sliding_window", None) for layer in DynamicCache(config=self._config("target")).layers)

    def _config(self, side: str):
        if side not in self._configs:
            self._configs[side] = config_from_fingerprint(self.metadata[side])
        return self._configs[side]

    def _rotary_for(self, side: str, device: torch.device) -> Rotary:
        key = f"{side}@{device}"
        if key not in self._rotary:
            self._rotary[key] = Rotary.from_config(self._config(side), device=device)
        return self._rotary[key]

    def _check_cache(self, cache) -> tuple[int, int]:
        src = self.source
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) != src["num_layers"]:
            got = "no .layers" if layers is None else f"{len(layers)} layers"
            raise IncompatibleError(
                f"source cache has {got}, but this mapper expects {src['num_layers']} layers of "
                f"{src['model_id']}; pass the cache of that model"
            )
        keys = layers[0].keys
        if keys is None or keys.dim() != 4 or 0 in (keys.shape[0], keys.shape[2]):
            raise IncompatibleError("source cache is empty (no sequences or no tokens); run the source model over "
                                    "the context first")
        batch, _, tokens, _ = keys.shape
        for index, layer in enumerate(layers):
            if not (layer.keys.is_floating_point() and layer.values.is_floating_point()):
                raise IncompatibleError(f"source cache layer {index} holds {layer.keys.dtype} keys and "
                                        f"{layer.values.dtype} values; a model's cache is floating point")
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

    @torch.no_grad()
    def map_layers(
        self, source_keys: list[torch.Tensor], source_values: list[torch.Tensor], position_ids: torch.Tensor,
        *, dtype: torch.dtype | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Map per-layer source K/V (B, Hs, T, Ds) to target K/V (B, Ht, T, Dt) in ``dtype`` (default self.dtype).

        source keys carry the source RoPE at ``position_ids`` (B, T); the result carries the target's.
        """
        device, dtype = self.device, dtype or self.dtype
        compute = self.compute_dtype or dtype
        batch, _, tokens, _ = source_keys[0].shape
        position_ids = position_ids.to(device)
        src_rot, dst_rot = self._rotary_for("source", device), self._rotary_for("target", device)
        needed = sorted({l for layer in self.layers for l in layer["sources"]})
        raw_k, raw_v = {}, {}
        for l in needed:
            k = source_keys[l].to(device=device, dtype=torch.float32)
            v = source_values[l].to(device=device, dtype=torch.float32)
            if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
                raise NonFiniteError(
                    f"source cache layer {l} contains NaN or Inf; the source model's forward pass is broken "
                    "(try float32 or bfloat16 instead of float16)"
                )
            cos, sin = src_rot.cos_sin(position_ids, l)
            raw_k[l] = strip_rope(k, cos, sin).transpose(1, 2).reshape(batch, tokens, -1).to(compute)  # (B, T, Hs*Ds)
            raw_v[l] = v.transpose(1, 2).reshape(batch, tokens, -1).to(compute)
        heads, head_dim = self.target["num_kv_heads"], self.target["head_dim"]
        out = []
        for layer in self.layers:
            m = layer["target"]
            xk = torch.cat([raw_k[l] for l in layer["sources"]], dim=-1)  # (B, T, k*Hs*Ds)
            xv = torch.cat([raw_v[l] for l in layer["sources"]], dim=-1)
            yk = self._affine(xk, "k", m).view(batch, tokens, heads, head_dim).transpose(1, 2)  # (B, Ht, T, Dt)
            yv = self._affine(xv, "v", m).view(batch, tokens, heads, head_dim).transpose(1, 2)
            cos, sin = dst_rot.cos_sin(position_ids, m)
            yk = apply_rope(yk.float(), cos, sin)
            out.append((yk.to(dtype).contiguous(), yv.to(dtype).contiguous()))
        return out

    def _affine(self, x: torch.Tensor, kind: str, m: int) -> torch.Tensor:
        """x @ W + b in x's dtype (fp32 accumulation inside the GEMM), for every stored map structure:
        ``weight`` (in, out), or low rank ``weight_a`` (in, r) @ ``weight_b`` (r, out); stacked over
        head groups (a leading groups dim) for head-local maps (docs/artifact-format.md)."""
        name = f"{kind}.{m}"
        bias = self._weight(f"{name}.bias", x.dtype)
        factors = [f"{name}.weight"] if f"{name}.weight" in self.tensors else [f"{name}.weight_a", f"{name}.weight_b"]
        weights = [self._weight(f, x.dtype) for f in factors]
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        if weights[0].dim() == 2:
            for weight in weights[:-1]:
                rows = rows @ weight
            return torch.addmm(bias, rows, weights[-1]).view(*x.shape[:-1], -1)
        groups = weights[0].shape[0]
        sources = x.shape[-1] // (self.source["num_kv_heads"] * self.source["head_dim"])
        # (N, k * Hs*Ds) -> (groups, N, k * Hs*Ds / groups): group i takes its heads of every source layer
        rows = rows.view(rows.shape[0], sources, groups, -1).permute(2, 0, 1, 3).reshape(groups, rows.shape[0], -1)
        for weight in weights:
            rows = torch.bmm(rows, weight)  # (groups, N, out / groups)
        return (rows.transpose(0, 1).reshape(*x.shape[:-1], -1) + bias)

    def _weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        key = (name, dtype)
        if key not in self._cast:
            self._cast[key] = self.tensors[name].to(dtype)
        return self._cast[key]

    @torch.no_grad()
    def transfer(self, source_cache, *, position_ids: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        """Map a source-model cache to a new target-model ``DynamicCache``.

        source_cache: a transformers cache of the source model, every layer (B, Hs, T, Ds).
        position_ids: (B, T) positions of the cached tokens; default 0..T-1 (no left padding).
        Returns a ``DynamicCache(config=target_config)`` on the mapper's device in ``dtype`` (default
        ``self.dtype``: the target's dtype at fit time, or Mapper.load's), sliding-window layers included.  The caller keeps the last prompt token for the target
        (see :func:`kvhub.handoff.handoff`).
        """
        from transformers import DynamicCache

        batch, tokens = self._check_cache(source_cache)
        if position_ids is None:
            position_ids = torch.arange(tokens).expand(batch, tokens)
        elif tuple(position_ids.shape) != (batch, tokens):
            raise IncompatibleError(f"position_ids has shape {tuple(position_ids.shape)}; expected {(batch, tokens)}")
        mapped = self.map_layers(
            [layer.keys for layer in source_cache.layers], [layer.values for layer in source_cache.layers], position_ids,
            dtype=parse_dtype(dtype),
        )
        cache = DynamicCache(config=self._config("target"))
        # each map to its own target layer, whatever the order of mapper.json's `layers` (they cover each once)
        for layer, (keys, values) in sorted(zip(self.layers, mapped), key=lambda pair: pair[0]["target"]):
            cache.update(keys, values, layer["target"])
        return cache

    # ---- persistence -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name: str | os.PathLike, *, db=None, token: str | None = None, device=None, dtype=None,
                        compute_dtype=None) -> "Mapper":
        """The mapper ``name`` designates, verified, with ``ref`` set:

        * an artifact directory (``"./mapper"``): read as it is (``ref`` is the store version holding the
          same tensors, if any);
        * a store reference (``"SRC:DST:CALIB@production"``, any selector): that version;
        * a Hub repository (``"acme/kvmap-qwen-legal@v3"``, revision optional): pulled, verified and
          registered in the store (``kvhub pull``), then loaded from there.

        db: store URL or SQLite path; token: Hub token (default: huggingface_hub's).  See __init__ for dtypes.
        """
        from .api import from_pretrained  # resolution needs the store and the Hub; the math core does not

        return from_pretrained(name, db=db, token=token, device=device, dtype=dtype, compute_dtype=compute_dtype)

    def save_pretrained(self, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the artifact directory (mapper.json + mapper.safetensors), readable by
        :meth:`from_pretrained` and ``kvhub import``; the same as :meth:`save`."""
        return self.save(directory, overwrite=overwrite)

    def push_to_hub(self, repo_id: str, *, private: bool = False, branch: str | None = None, token: str | None = None,
                    db=None, base_model: tuple[str, str] | None = None):
        """Publish this mapper to the Hub repository ``repo_id``: registered in the store first (as the
        version holding its tensors if there is one), then one commit with its model card, tagged ``vN``
        (``kvhub push``).  base_model: the Hub ids (source, target) when the models were local paths.
        Returns a kvhub.hub.PushResult (tag, commit, url)."""
        from .api import push_to_hub

        return push_to_hub(self, repo_id, private=private, branch=branch, token=token, db=db, base_model=base_model)

    def save(self, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the artifact directory atomically (kvhub.artifact.write_artifact); returns its path.
        Tensors are stored in fp32."""
        tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in self.tensors.items()}
        self.metadata = write_artifact(directory, tensors, self.metadata, overwrite=overwrite)
        return Path(directory)

    @classmethod
    def load(cls, directory: str | os.PathLike, *, device=None, dtype=None, compute_dtype=None) -> "Mapper":
        """Load an artifact directory after every check of the format (kvhub.artifact.read_artifact:
        mapper.json fields, tensor names and shapes, sha256, finite weights).  See __init__ for dtypes."""
        from safetensors.torch import load_file

        metadata = read_artifact(directory)
        tensors = load_file(str(tensor_path(directory, metadata)), device=str(device) if device is not None else "cpu")
        return cls(tensors, metadata, dtype=parse_dtype(dtype), compute_dtype=parse_dtype(compute_dtype))
