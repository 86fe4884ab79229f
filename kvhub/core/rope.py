"""Rotary position embeddings: strip them from cached keys and apply another model's.

Every supported model caches keys *after* RoPE:  k_cached = k_raw * cos + rotate_half(k_raw) * sin,
over the first ``rot`` dims of each head (``rot < head_dim`` for partial rotary, e.g. GPT-NeoX), where
``cos``/``sin`` come from the model's own rotary module and already carry ``attention_scaling`` (YaRN,
LongRoPE), i.e. cos = a*cos(theta), sin = a*sin(theta).  The rotation is then ``a * R(theta)`` and its
inverse is ``R(theta)^T / a^2``:

    k_raw = (k_cached * cos - rotate_half(k_cached) * sin) / (cos^2 + sin^2)

(``cos^2 + sin^2 = a^2`` element-wise, so no separate scaling factor is needed).  All of it in fp32.

cos/sin are computed by the model's own rotary module class (found next to the model class in
transformers), built from the config alone so a Mapper can re-rotate without the model in memory.
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

from kvhub.core.layer_kinds import check_attention_layers
from kvhub.errors import UnsupportedModelError

# model_type -> family.  These cache post-RoPE keys of shape (B, H_kv, T, D) per layer.
SUPPORTED_MODEL_TYPES = {
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "llama": "llama",
    "mistral": "mistral",
    "gpt_neox": "gpt_neox",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}


def check_supported(config) -> None:
    """Raise UnsupportedModelError unless ``config.model_type`` is one kvhub can map; a model with layers
    that cache no per-token K/V (linear attention, Mamba, convolution) is refused naming that layer type."""
    check_attention_layers(config, name=getattr(config, "_name_or_path", None) or None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        raise UnsupportedModelError(
            f"kvhub cannot map model_type {model_type!r}; supported architectures: {supported}. "
            "Open an issue with the model id if you need another one."
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim (the convention of every supported model)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def strip_rope(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Invert RoPE on cached keys.

    keys: (B, H, T, D) fp32, or (L, B, H, T, D) for L layers sharing cos/sin (see Rotary.layer_groups);
    cos, sin: (B, T, rot) fp32 with rot <= D (B may be 1: every row at the same positions).
    Returns a new fp32 tensor of keys' shape.
    """
    rot = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, rot)
    k_rot, k_pass = keys[..., :rot], keys[..., rot:]
    raw = (k_rot * cos - rotate_half(k_rot) * sin) / (cos * cos + sin * sin)
    return torch.cat((raw, k_pass), dim=-1)


def apply_rope(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE: k * cos + rotate_half(k) * sin over the first ``rot`` dims.  Shapes as strip_rope
    (a leading layers dim included)."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    k_rot, k_pass = keys[..., :rot], keys[..., rot:]
    return torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), dim=-1)


def _rotary_class(config) -> type[nn.Module]:
    from transformers import AutoModel

    model_class = AutoModel._model_mapping[type(config)]
    module = sys.modules[model_class.__module__]
    candidates = [
        obj
        for name, obj in vars(module).items()
        if name.endswith("RotaryEmbedding") and inspect.isclass(obj) and issubclass(obj, nn.Module)
    ]
    if len(candidates) != 1:
        raise UnsupportedModelError(
            f"cannot find the rotary embedding of model_type {config.model_type!r} "
            f"(found {[c.__name__ for c in candidates]})"
        )
    return candidates[0]


class Rotary:
    """cos/sin for one model, from its own rotary module class, in fp32.

    ``Rotary.from_config(cfg).cos_sin(position_ids, layer_idx)`` -> (cos, sin), each (B, T, rot).
    """

    def __init__(self, module: nn.Module, layer_types: list[str] | None):
        self.module = module  # never cast: a model's own module stays as the model uses it
        self.layer_types = layer_types
        self._takes_layer_type = "layer_type" in inspect.signature(module.forward).parameters

    @classmethod
    def from_config(cls, config, *, device: torch.device | str | None = None) -> "Rotary":
        check_supported(config)
        module = _rotary_class(config)(config=config)
        return cls(module.to(device) if device is not None else module, getattr(config, "layer_types", None))

    @classmethod
    def from_model(cls, model) -> "Rotary":
        check_supported(model.config)
        module = getattr(model.base_model, "rotary_emb", None)
        if module is None:
            return cls.from_config(model.config, device=next(model.parameters()).device)
        return cls(module, getattr(model.config, "layer_types", None))

    def _layer_type(self, layer_idx: int) -> str | None:
        """What cos/sin depend on besides the positions: the layer's type when the module takes one."""
        return self.layer_types[layer_idx] if self._takes_layer_type and self.layer_types is not None else None

    def layer_groups(self, layers: list[int]) -> list[list[int]]:
        """``layers`` split into groups whose cos/sin are identical at any positions (one group per layer
        type for per-layer-type rotary such as Gemma 3's local/global layers, else a single group), each
        in the given order, groups in order of first appearance."""
        groups: dict[str | None, list[int]] = {}
        for layer in layers:
            groups.setdefault(self._layer_type(layer), []).append(layer)
        return list(groups.values())

    @torch.no_grad()
    def cos_sin(self, position_ids: torch.Tensor, layer_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids: (B, T) long -> cos, sin: (B, T, rot) fp32 on position_ids' device."""
        device = position_ids.device
        if next(self.module.buffers()).device != device:
            self.module.to(device)
        x = torch.zeros(1, dtype=torch.float32, device=device)
        layer_type = self._layer_type(layer_idx)
        if layer_type is not None:
            cos, sin = self.module(x, position_ids, layer_type)
        else:
            cos, sin = self.module(x, position_ids)
        return cos.float(), sin.float()
