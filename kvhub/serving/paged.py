"""Engine-independent pieces of the connector: the load plan and reading K/V out of paged blocks.

Load plan (consumer), for a prompt of n tokens of which vLLM already holds ``computed`` (its own exact
prefix cache), a stored source prefix of s tokens, block size b and exact suffix r >= 1:

    end = floor(min(s, n - r) / b) * b        mapped tokens are [computed, end)
    load = end - computed if end > computed else 0

so vLLM computes at least the last r prompt tokens itself, over the mapped ones (kvhub's exact_suffix).

Paged layout: an attention backend stores a token's K/V in a block in its own order (vLLM's CPU
backend keeps keys transposed per head, and its layout depends on the ISA).  Instead of hard-coding
each, :func:`probe_layout` writes coded tokens into a one-block scratch tensor with the backend's own
writer and reads back where every (token, head, dim) element of keys and values landed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvhub.errors import UnsupportedModelError


def load_plan(
    *, prompt_tokens: int, computed_tokens: int, stored_tokens: int, block_size: int, exact_suffix: int
) -> tuple[int, int]:
    """(start, end) of the tokens to map (module docstring); start == end means nothing to load."""
    end = min(stored_tokens, prompt_tokens - max(exact_suffix, 1)) // block_size * block_size
    start = computed_tokens
    return (start, end) if end > start else (start, start)


@dataclass(frozen=True)
class PagedLayout:
    """Flat offsets, inside one block, of key and value element (token offset, head, dim): (b, H, D) each."""

    key_index: torch.Tensor
    value_index: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.key_index.shape[0]

    def gather(self, kv_layer: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the tokens at ``slots`` (N,) = block_id * b + offset: (H, N, D) each, copies."""
        flat = kv_layer.view(-1)
        block_numel = kv_layer[0].numel()
        blocks, offsets = slots // self.block_size, slots % self.block_size
        base = (blocks * block_numel)[:, None, None]  # (N, 1, 1)
        keys = flat[base + self.key_index.to(kv_layer.device)[offsets]]  # (N, H, D)
        values = flat[base + self.value_index.to(kv_layer.device)[offsets]]
        return keys.transpose(0, 1).clone(), values.transpose(0, 1).clone()


Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def probe_layout(writer: Writer, block: torch.Tensor, *, block_size: int, heads: int, head_dim: int) -> PagedLayout:
    """Find where ``writer(key, value, cache, slot_mapping)`` puts each element of a block.

    block: a zeroed (1, ...) tensor shaped like one block of the layer's cache (same dtype and device).
    Codes are small integers (token + 1, head + 1, dim // 16 + 1, dim % 16 + 1), exact even in bf16.
    """
    if not block.dtype.is_floating_point or block_size > 255 or heads > 255:
        raise UnsupportedModelError(
            f"cannot read a {block.dtype} paged KV cache with block size {block_size} and {heads} KV heads; "
            "run the producer with a float16/bfloat16/float32 KV cache and a block size below 256"
        )
    token = torch.arange(block_size).view(-1, 1, 1).expand(block_size, heads, head_dim)  # (b, H, D)
    head = torch.arange(heads).view(1, -1, 1).expand_as(token)
    dim = torch.arange(head_dim).view(1, 1, -1).expand_as(token)
    codes = [token + 1, head + 1, dim // 16 + 1, dim % 16 + 1]
    slots = torch.arange(block_size, device=block.device)
    found = []
    for side in ("key", "value"):
        reads = []
        for code in codes:
            block.zero_()
            coded = code.to(block.dtype).to(block.device).contiguous()
            zero = torch.zeros_like(coded)
            writer(coded, zero, block, slots) if side == "key" else writer(zero, coded, block, slots)
            reads.append(block.reshape(-1).float().round().long().cpu())
        where = (reads[0] > 0).nonzero().squeeze(1)
        if where.numel() != block_size * heads * head_dim:
            raise UnsupportedModelError(
                f"the attention backend wrote {where.numel()} {side} elements for {block_size * heads * head_dim}; "
                "kvhub cannot read this paged KV layout"
            )
        t, h = reads[0][where] - 1, reads[1][where] - 1
        d = (reads[2][where] - 1) * 16 + reads[3][where] - 1
        index = torch.full((block_size, heads, head_dim), -1, dtype=torch.long)
        index[t, h, d] = where
        if (index < 0).any():
            raise UnsupportedModelError(f"the attention backend's {side} layout is not a one-to-one scatter")
        found.append(index)
    block.zero_()
    return PagedLayout(key_index=found[0], value_index=found[1])


def layer_layout(layer, kv_layer: torch.Tensor, *, block_size: int) -> PagedLayout:
    """The layout of a vLLM attention ``layer``'s paged cache ``kv_layer``, probed with its backend's own
    ``do_kv_cache_update``; UnsupportedModelError for a cache that is not laid out blocks first."""
    heads, head_dim = layer.num_kv_heads, layer.head_size
    if kv_layer[0].numel() != 2 * block_size * heads * head_dim:
        raise UnsupportedModelError(
            f"the paged KV cache {tuple(kv_layer.shape)} is not laid out blocks first (one block = "
            f"K and V of {block_size} tokens); kvhub cannot read this attention backend"
        )

    def writer(k, v, cache, slots):
        layer.impl.do_kv_cache_update(layer, k, v, cache, slots)

    scratch = kv_layer.new_zeros((1, *kv_layer.shape[1:]))
    return probe_layout(writer, scratch, block_size=block_size, heads=heads, head_dim=head_dim)
