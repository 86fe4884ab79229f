"""Scoring by generation: what a model writes after each of several caches, all of them in one batch, and how
much of a reference answer it recovers.

Teacher-forced likelihood can be fooled (a cache that carries no information can still make the reference
likelier); what the model writes cannot be forced.  :func:`greedy_rows` continues each cache greedily, every row
through the same decode steps (one read of the weights per step for all rows: a cache is left-padded to the
longest one and its padding masked out, and each row keeps its own positions, so a drop cache with fewer
entries than positions continues at its true position).  :func:`rouge_l` is the token-level ROUGE-L F1 of a
generation against the reference: 1 when the model writes the reference, 0 when it shares no token in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhub.core.capture import cache_kwargs


@dataclass
class Row:
    """A cache to continue: it holds the context before ``first_id`` (:func:`greedy_rows`), whose position is
    ``start`` (None: the cache's length; a drop cache's true length where it holds fewer entries)."""

    cache: object
    start: int | None = None


def eos_ids(model) -> set[int]:
    """The end-of-sequence ids greedy decoding suppresses (as ``generate(min_new_tokens=n)`` does for the
    reference), from the model's generation config and config."""
    ids: set[int] = set()
    for config in (getattr(model, "generation_config", None), model.config):
        value = getattr(config, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else list(value))
    return ids


@torch.no_grad()
def greedy_rows(model, rows: list[Row], first_id: int, tokens: int) -> list[list[int]]:
    """``tokens`` greedy ids after ``first_id`` under each row's cache, end-of-sequence suppressed, all rows
    batched per step.  The caches are read, never changed (the batch holds padded copies)."""
    from transformers import DynamicCache

    if not rows or tokens <= 0:
        return [[] for _ in rows]
    device = next(model.parameters()).device
    lengths = [row.cache.get_seq_length() for row in rows]
    longest = max(lengths)
    cache = DynamicCache()
    template = next((row.cache for row, length in zip(rows, lengths) if length), None)
    for index in range(len(template.layers) if template is not None else 0):
        keys, values = [], []
        like = template.layers[index]
        for row, length in zip(rows, lengths):
            if not length:  # an empty cache (a drop cache of no position): padding only
                keys.append(like.keys.new_zeros((1, like.keys.shape[1], longest, like.keys.shape[3])))
                values.append(like.values.new_zeros((1, like.values.shape[1], longest, like.values.shape[3])))
                continue
            layer, pad = row.cache.layers[index], longest - length
            keys.append(torch.nn.functional.pad(layer.keys, (0, 0, pad, 0)))
            values.append(torch.nn.functional.pad(layer.values, (0, 0, pad, 0)))
        cache.update(torch.cat(keys), torch.cat(values), index)
    held = torch.zeros(len(rows), longest, dtype=torch.bool, device=device)
    for i, length in enumerate(lengths):
        held[i, longest - length :] = True
    position = torch.tensor(
        [length if row.start is None else row.start for row, length in zip(rows, lengths)], device=device
    )
    suppressed = torch.tensor(sorted(eos_ids(model)), dtype=torch.long, device=device)
    dtype = model.dtype
    current = torch.full((len(rows), 1), first_id, dtype=torch.long, device=device)
    written: list[torch.Tensor] = []
    for step in range(tokens):
        held = torch.cat([held, torch.ones(len(rows), 1, dtype=torch.bool, device=device)], dim=1)
        mask = torch.zeros(held.shape, dtype=dtype, device=device).masked_fill(~held, torch.finfo(dtype).min)
        logits = (
            model(
                input_ids=current,
                position_ids=(position + step)[:, None],
                attention_mask=mask[:, None, None, :],
                use_cache=True,
                **cache_kwargs(model, cache),
            )
            .logits[:, -1]
            .float()
        )
        if suppressed.numel():
            logits[:, suppressed] = float("-inf")
        current = logits.argmax(-1, keepdim=True)
        written.append(current[:, 0])
    return torch.stack(written, dim=1).tolist()


def rouge_l(candidate: list, reference: list) -> float:
    """Token-level ROUGE-L F1: the longest common subsequence of the two, as a share of each, their harmonic
    mean (0 when either is empty or they share nothing)."""
    if not candidate or not reference:
        return 0.0
    previous = [0] * (len(reference) + 1)
    for token in candidate:
        current = [0]
        for j, other in enumerate(reference):
            current.append(previous[j] + 1 if token == other else max(previous[j + 1], current[j]))
        previous = current
    common = previous[-1]
    if not common:
        return 0.0
    precision, recall = common / len(candidate), common / len(reference)
    return 2 * precision * recall / (precision + recall)
