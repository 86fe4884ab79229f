"""Staging cache tensors for the Mapper: moving them to its device (host -> CUDA through pinned memory),
the finiteness check, and the (G, B, H, T, D) -> (G, B, T, H*D) row layout."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` (itself when already there); host -> CUDA through pinned memory, non-blocking."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def stack_on(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """torch.stack(tensors) (G, *shape) on ``device`` as a new tensor, the inputs untouched.  Host tensors
    bound for CUDA are stacked into pinned memory and copied with non_blocking=True: the host does not wait,
    and the caching host allocator keeps the pinned block until the copy has run."""
    dtype = tensors[0].dtype if len({t.dtype for t in tensors}) == 1 else torch.float32
    if device.type == "cuda" and all(t.device.type == "cpu" for t in tensors):
        staged = torch.empty((len(tensors), *tensors[0].shape), dtype=dtype, pin_memory=True)
        torch.stack([t.to(dtype) for t in tensors], out=staged)
        return staged.to(device, non_blocking=True)
    return torch.stack([t.to(device=device, dtype=dtype) for t in tensors])


def finite(x: torch.Tensor) -> torch.Tensor:
    """(G, ...) -> (G,) bool on x's device: no NaN or Inf in x[g].  One pass: max |x| propagates both."""
    return torch.linalg.vector_norm(x.flatten(1), float("inf"), dim=1).isfinite()


def rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(G, B, H, T, D) -> (G, B, T, H*D) in ``dtype``: one copy (transpose and cast together)."""
    g, b, h, t, d = x.shape
    out = torch.empty(g, b, t, h, d, dtype=dtype, device=x.device)
    return out.copy_(x.transpose(2, 3)).view(g, b, t, h * d)  # (G, B, T, H*D)


def hand_over(cache, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Give an empty plain layer ``index`` of a transformers ``DynamicCache`` the mapped ``keys`` and ``values``
    (B, H, T, D) as they are: what ``cache.update`` leaves there, without its concatenation onto empty tensors
    (a copy of the whole mapped cache and four operators per layer).  Any other layer, or a transformers whose
    DynamicLayer keeps more state than this, goes through ``update``."""
    from transformers.cache_utils import DynamicLayer

    layer = cache.layers[index] if index < len(cache.layers) else None
    if type(layer) is DynamicLayer and not layer.is_initialized and set(vars(layer)) <= _PLAIN_LAYER_STATE:
        layer.keys, layer.values, layer.device, layer.is_initialized = keys, values, keys.device, True
        if layer.get_seq_length() == keys.shape[-2]:
            return
        layer.keys, layer.values, layer.is_initialized = None, None, False  # not what update leaves: use it
    cache.update(keys, values, index)


# The attributes of transformers' DynamicLayer after lazy initialization (5.16-5.25): hand_over sets them all.
_PLAIN_LAYER_STATE = {"keys", "values", "device", "is_initialized", "dtype"}
