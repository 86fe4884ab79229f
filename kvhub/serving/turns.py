"""Turns after an escalation: re-select and recompute context spans for the new question.

At the escalation the target recomputes the set R1 of context positions chosen from the turn-1 question
(:mod:`kvhub.serving.recompute`); everything else of the context stays mapped.  A later turn may ask about
a fact R1 missed.  Because a handoff keeps every context token (mapped, not dropped), the target can make
more of them exact then: the source's attention from the last ``queries`` tokens of the conversation so
far (new turn included) scores the context positions 0..C-1 not yet exact, whole spans are chosen under the
same budget ``exact_budget * C``, and the target recomputes them over its cache
(:func:`kvhub.serving.recompute.recompute_positions`: each attends to the cache's earlier positions).

The tokens after the context (the turns the target itself read and wrote) are exact already and stay as
they are: they were computed over the turn-1 cache, as a serving engine computed them.
"""

from __future__ import annotations

import torch

from kvhub.serving.recompute import (
    attention_scores,
    budget_tokens,
    choose_spans,
    cropped,
    query_attention,
    recompute_positions,
)
from kvhub.serving.spec import Recompute


@torch.no_grad()
def next_turn_positions(
    spec: Recompute,
    *,
    ids: torch.Tensor,
    context_tokens: int,
    held: torch.Tensor,
    source_model,
    source_cache,
    tokenizer=None,
) -> torch.Tensor:
    """Context positions (sorted, long, CPU) to recompute for a new turn.

    ids: (1, N) the conversation so far minus the prompt's last token (N > context_tokens);
    held: positions of the context already exact (never chosen again);
    source_cache: the source's cache of at least ids[:, :N - queries] (left untouched).
    """
    tokens = ids.shape[1]
    eligible = torch.ones(context_tokens, dtype=torch.bool)
    eligible[held.cpu()] = False

    def scores() -> torch.Tensor:
        queries = max(1, min(spec.queries, tokens - context_tokens))
        attention = query_attention(source_model, ids, cropped(source_cache, tokens - queries), queries=queries)
        return attention_scores(attention[:, :context_tokens], eligible, score=spec.score)

    return choose_spans(
        spec,
        ids[0, :context_tokens].cpu(),
        budget_tokens(spec, context_tokens),
        eligible=eligible,
        scores=scores,
        tokenizer=tokenizer,
    )


@torch.no_grad()
def reselect_turn(
    target_model,
    cache,
    conversation: torch.Tensor,
    spec: Recompute,
    *,
    context_tokens: int,
    held: torch.Tensor,
    source_model,
    source_cache,
    tokenizer=None,
) -> torch.Tensor:
    """Make the context spans a new turn points at exact in the target's ``cache`` (module docstring).

    conversation: (1, N) ids the cache covers (the escalated context, then the turns since); held: the
    context positions already exact; source_cache: the source's cache of at least conversation[:, :N - queries].
    Returns the positions recomputed (sorted, long, CPU); the caller adds them to ``held``.
    """
    positions = next_turn_positions(
        spec,
        ids=conversation,
        context_tokens=context_tokens,
        held=held,
        source_model=source_model,
        source_cache=source_cache,
        tokenizer=tokenizer,
    )
    recompute_positions(target_model, cache, conversation, positions)
    return positions
