"""The ``drop`` baseline: the no-fit alternative a handoff must beat (SpecPrefill-style token dropping).

A handoff maps every context token and lets the target recompute a set R of them exactly
(:mod:`kvhub.serving.recompute`).  The alternative that needs no mapper keeps R and drops the rest: the
target prefills only the tokens at R, at their true positions, attending causally among themselves,

    cache = target(context[R], position_ids = R)          (|R| entries, positions R)

and the prompt's last token continues at position T = len(context), as it would over a full cache.  With
the same R as the handoff this costs the target the same compute as the recompute pass, so the two differ
only in what the other T - |R| positions hold: the map's approximation, or nothing.

A later turn can add tokens of the context again (:func:`add_context_tokens`): they are prefilled at their
true positions, each attending to the cached entries at earlier positions only, so a re-selection at turn
2 is as causal as a first one.  Every drop cache records the position of each entry
(:func:`entry_positions`), which that mask needs.
"""

from __future__ import annotations

import torch

from kvhub.core.capture import cache_kwargs

_POSITIONS = "kvhub_positions"  # attribute of a drop cache: (N,) long, the true position of each entry


@torch.no_grad()
def drop_cache(target_model, context: torch.Tensor, positions: torch.Tensor):
    """A target DynamicCache of only ``context[:, positions]`` at their true positions.

    context: (1, T) ids; positions: (R,) sorted, unique, long.  The caller continues the prompt at
    position T (``start=T`` in :func:`kvhub.eval.longctx.answer_score`).
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    setattr(cache, _POSITIONS, torch.empty(0, dtype=torch.long))
    if positions.numel():
        extend(target_model, cache, context[:, positions.cpu()], positions)
    return cache


def entry_positions(cache) -> torch.Tensor:
    """(N,) the true position of each of the cache's N entries (a drop cache records them; any other cache
    holds positions 0..N-1)."""
    recorded = getattr(cache, _POSITIONS, None)
    return recorded if recorded is not None else torch.arange(cache.get_seq_length())


@torch.no_grad()
def extend(target_model, cache, ids: torch.Tensor, positions: torch.Tensor) -> None:
    """Prefill ``ids`` (1, R) at ``positions`` (R,) over ``cache``: token i attends to the cached entries at
    positions below its own and to the new tokens before it (module docstring); the cache grows by R."""
    device = next(target_model.parameters()).device
    cached = entry_positions(cache).to(device)
    positions = positions.to(device)
    to_cache = cached[None, :] < positions[:, None]  # (R, N)
    to_new = torch.ones(len(positions), len(positions), dtype=torch.bool, device=device).tril()  # (R, R)
    allowed = torch.cat([to_cache, to_new], dim=1)  # (R, N + R)
    dtype = target_model.dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    target_model.base_model(
        input_ids=ids.to(device),
        position_ids=positions[None],
        attention_mask=mask[None, None],
        use_cache=True,
        **cache_kwargs(target_model.base_model, cache),
    )
    setattr(cache, _POSITIONS, torch.cat([cached.cpu(), positions.cpu()]))


def add_context_tokens(target_model, cache, context: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Prefill the tokens of ``context`` (1, T) at ``positions`` the cache does not hold yet (a re-selection at a
    later turn); returns the positions added (sorted, long)."""
    held = entry_positions(cache)
    new = positions[~torch.isin(positions, held)]
    if new.numel():
        extend(target_model, cache, context[:, new.cpu()], new)
    return new
