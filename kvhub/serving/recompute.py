"""Selective exact recompute: the target recomputes a few context tokens itself over the mapped cache.

A mapped cache keeps the gist of a context but loses the attention addressing that retrieval needs
(mapped keys): a number or a name stated once is not found again.  Making the right few percent of
the tokens exact brings it back (docs/benchmarks.md, section "facts").  At handoff the context is
c_0 .. c_{n-2} (the last prompt token is the target's); the recompute set is

    R = [0, p)  U  S  U  [n-1-r, n-1)        (exact prefix, selected spans, exact suffix)

and the target computes K/V for every t in R in ONE forward pass of the |R| tokens at their true
positions, with the mask

    t attends to mapped position j   iff  j < t and j not in R
    t attends to recomputed t'       iff  t' <= t

so each recomputed token sees the exact versions of the earlier recomputed tokens and the mapped
rest, causally; the results overwrite the mapped K/V at R.  With R = every token this is exactly the
target's own prefill; with R = prefix U suffix it is what ``exact_prefix``/``exact_suffix`` did.

S is chosen under a budget of ``round(exact_budget * (n-1))`` tokens (:func:`budget_tokens`) by one signal
available at handoff time:

- ``source``:    the source model's attention from the last ``queries`` context tokens onto the
                 context (it has read the whole prompt, question included);
- ``target``:    the target's attention from its exact suffix over the mapped cache (one extra pass
                 of the last ``queries`` tokens);
- ``deviation``: |mapped - exact| K/V at the target's first layer (which needs one layer's pass), a
                 CacheBlend-style signal of where the map is worst;
- ``random``:    random spans, the control for the signal.

The attention selectors score token t from P[i, t], query i's attention on t averaged over layers
and heads (:class:`kvhub.core.capture.AttentionMass`), with ``score=``:

- ``max`` (default): max over the queries of P[i, t] / sum_{s eligible} P[i, s], i.e. the share of
  its selectable attention that the query most drawn to t gives it.  A fact that one query looks up
  ranks high even when the other queries (a question being echoed, chat-template tokens) spread
  their attention over the nearby text;
- ``sum``: sum_i (i + 1) P[i, t] ((i+1)-scaled attention, 1 = uniform), which those spreading
  queries dominate.  On passkey items at 1k tokens the answer's tokens fell inside an 8% selection
  by the target's attention (16 queries) for 28/30 items with ``max`` and 26/30 with ``sum``; in
  chats, 30/30 against 26/30 (``benchmarks/selection_coverage.py``; docs/benchmarks.md, section 4).

Tokens are grouped into spans (sentences / lines, at most ``max_span`` tokens) and whole spans are
taken in order of their best token: a fact sentence is recomputed whole, not its most-attended digit
alone.

Inside vLLM the same choice is made by :func:`kvhub.serving.engine_pass.recompute_request`, over the
engine's own layers and with the signals the engine has (``source`` as the producer stored it, ``target``, ``random``): both take the budget
from :func:`budget_tokens` and choose by :func:`choose_spans`, so a change to the selection is made here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvhub.core.capture import AttentionMass, cache_kwargs
from kvhub.errors import ConfigError, UnsupportedModelError
from kvhub.serving.spec import SCORES, SELECTORS, Recompute  # noqa: F401 - re-exported

_SPAN_END = re.compile(r"(\n|[.!?;:]\s*$)")


# ---- choosing the tokens ------------------------------------------------------------------------
def span_ids(token_texts: list[str], *, max_span: int) -> torch.Tensor:
    """(T,) span index per token: a span ends after a token holding a newline or ending a sentence,
    or when it reaches ``max_span`` tokens."""
    ids, span, length = [], 0, 0
    for text in token_texts:
        ids.append(span)
        length += 1
        if _SPAN_END.search(text) or length >= max_span:
            span, length = span + 1, 0
    return torch.tensor(ids, dtype=torch.long)


def budget_tokens(spec: Recompute, context_tokens: int) -> int:
    """How many tokens the selection may take: ``round(exact_budget * context_tokens)``, where the context is
    the prompt less its last token (n - 1), in kvhub.handoff and inside vLLM alike."""
    return round(spec.exact_budget * context_tokens)


def choose_spans(
    spec: Recompute,
    ids: torch.Tensor,
    budget: int,
    *,
    eligible: torch.Tensor,
    scores: Callable[[], torch.Tensor],
    tokenizer=None,
) -> torch.Tensor:
    """S: the positions (sorted, long) of whole spans of ``ids`` (T,) taken by ``scores()`` (T,) under
    ``budget`` tokens among the ``eligible`` (T,) ones (:func:`select_spans`).  ``scores`` runs only when
    there is something to choose (its pass costs a forward)."""
    if budget <= 0 or not bool(eligible.any()):
        return torch.empty(0, dtype=torch.long)
    return select_spans(scores(), spans_of(spec, ids, tokenizer), budget, eligible=eligible)


def select_spans(
    scores: torch.Tensor, spans: torch.Tensor, budget_tokens: int, *, eligible: torch.Tensor
) -> torch.Tensor:
    """Positions (sorted, long) of whole spans taken by descending best eligible score while they fit
    ``budget_tokens``.  scores, spans, eligible: (T,); ineligible tokens are never taken."""
    if budget_tokens <= 0 or not bool(eligible.any()):
        return torch.empty(0, dtype=torch.long)
    scores = torch.where(eligible, scores.float(), torch.full_like(scores.float(), -math.inf))
    count = int(spans.max()) + 1
    best = torch.full((count,), -math.inf).scatter_reduce(0, spans, scores, "amax")
    sizes = torch.bincount(spans[eligible], minlength=count).tolist()  # eligible members per span
    order, best_list = torch.argsort(best, descending=True).tolist(), best.tolist()
    chosen, used = [], 0
    for span in order:  # plain Python over the spans: a few operators per selection, not a few per span
        if best_list[span] == -math.inf:
            break
        if used + sizes[span] <= budget_tokens:
            chosen.append(span)
            used += sizes[span]
        if used >= budget_tokens:
            break
    if not chosen:
        return torch.empty(0, dtype=torch.long)
    taken = torch.zeros(count, dtype=torch.bool)
    taken[chosen] = True
    return torch.nonzero(taken[spans] & eligible).flatten()  # sorted


@torch.no_grad()
def query_attention(model, context: torch.Tensor, cache, *, queries: int) -> torch.Tensor:
    """(Q, T) attention P[i, t] of each of the last Q = ``queries`` tokens of ``context`` (1, T) on every
    context token, averaged over layers and heads, from ``model`` continuing ``cache`` (which holds
    context[:, :T - Q]); the cache grows to T."""
    tokens = context.shape[1]
    start = tokens - queries
    device = next(model.parameters()).device
    positions = torch.arange(start, tokens, device=device).unsqueeze(0)
    with AttentionMass(model, per_query=True) as mass:
        model.base_model(
            input_ids=context[:, start:].to(device),
            position_ids=positions,
            use_cache=True,
            **cache_kwargs(model.base_model, cache),
        )
    return (mass.by_query[0] / mass.terms).float().cpu()  # (Q, T)


def attention_scores(attention: torch.Tensor, eligible: torch.Tensor, *, score: str) -> torch.Tensor:
    """(T,) score per token from the (Q, T) attention of the last Q tokens (:func:`query_attention`, whose
    query i is token T - Q + i) and the (T,) bool tokens that may be selected (module docstring)."""
    queries, tokens = attention.shape
    if score == "sum":
        scale = torch.arange(tokens - queries + 1, tokens + 1, dtype=torch.float32)  # i + 1
        return scale @ attention.float()
    selectable = attention.float() * eligible.float()[None, :]
    return (selectable / selectable.sum(1, keepdim=True).clamp_min(1e-30)).amax(0)


@torch.no_grad()
def first_layers_kv(model, context: torch.Tensor, layers: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The target's exact (K, V) of its first ``layers`` layers over ``context`` (1, T): the model body stopped
    after layer ``layers - 1`` (a forward hook ends the pass), so it costs layers / L of a prefill."""
    from transformers import DynamicCache

    class _Stop(Exception):
        pass

    def stop(module, args, output):
        raise _Stop

    cache = DynamicCache()
    device = next(model.parameters()).device
    handle = model.base_model.layers[layers - 1].register_forward_hook(stop)
    try:
        positions = torch.arange(context.shape[1], device=device).unsqueeze(0)
        model.base_model(
            input_ids=context.to(device),
            position_ids=positions,
            use_cache=True,
            **cache_kwargs(model.base_model, cache),
        )
    except _Stop:
        pass
    finally:
        handle.remove()
    return [(layer.keys, layer.values) for layer in cache.layers[:layers]]


def deviation_scores(mapped_cache, exact_keys: torch.Tensor, exact_values: torch.Tensor) -> torch.Tensor:
    """(T,) relative squared error of the mapped layer-0 K and V against the exact ones, summed."""

    def rel(mapped, exact):
        mapped, exact = mapped[0].float(), exact[0].float().to(mapped.device)  # (H, T, D)
        error = (mapped - exact).pow(2).sum((0, 2))
        return error / exact.pow(2).sum((0, 2)).clamp_min(1e-12)

    layer = mapped_cache.layers[0]
    return (rel(layer.keys, exact_keys) + rel(layer.values, exact_values)).cpu()


# ---- recomputing them ------------------------------------------------------------------------------
@torch.no_grad()
def recompute_positions(target_model, cache, context: torch.Tensor, positions: torch.Tensor, *, last=None):
    """Overwrite ``cache`` (a target cache of the T = context.shape[1] tokens) at ``positions`` (sorted,
    unique, long) with the target's K/V computed over the rest of the cache, in one pass (module docstring).
    context: (B, T); every row recomputes the same positions.

    Each layer writes its exact K/V at R into the cache *before* its attention runs, so the module
    docstring's mask is plain causality in position space: a query at position p sees every cache
    position j <= p (mapped where j is not in R, this pass's exact K/V where it is), and no (R, T + R)
    mask over appended copies is built.

    ``last``: (B, 1) ids of the prompt's last token (position T), computed in the same pass over the
    recomputed cache: returns (logits (B, V) of that token, [(keys, values) (B, H, 1, D) per layer]) and
    leaves ``cache`` at T positions (what :func:`kvhub.serving.handoff.generate_from` hands to generate);
    without it, returns None.
    """
    if positions.numel() == 0 and last is None:
        return None
    if any(getattr(layer, "sliding_window", None) for layer in cache.layers):
        raise ConfigError(
            "selective recompute needs full-attention cache layers; this target has sliding-window "
            "layers: use exact_budget=0 (map only) for it"
        )
    device = next(target_model.parameters()).device
    tokens, count = context.shape[1], positions.numel()
    positions = positions.to(device)
    ids = context[:, positions.cpu()].to(device)
    query_positions = positions
    if last is not None:
        ids = torch.cat([ids, last.to(device)], dim=1)
        query_positions = torch.cat([positions, torch.tensor([tokens], device=device)])
    keys_at = torch.arange(tokens + (last is not None), device=device)
    dtype = target_model.dtype
    mask = torch.zeros(len(query_positions), len(keys_at), dtype=dtype, device=device)
    mask.masked_fill_(keys_at[None, :] > query_positions[:, None], torch.finfo(dtype).min)
    stash: list = []
    cache.update = _writing_update(cache, positions, count, stash)  # this pass only (removed below)
    try:
        model = target_model if last is not None else target_model.base_model
        extra = {"logits_to_keep": 1} if last is not None else {}
        output = model(
            input_ids=ids,
            position_ids=query_positions.unsqueeze(0),
            attention_mask=mask[None, None],
            use_cache=True,
            **cache_kwargs(model, cache),
            **extra,
        )
    finally:
        del cache.update
    return (output.logits[:, -1], stash) if last is not None else None


def _writing_update(cache, positions: torch.Tensor, count: int, stash: list):
    """A ``cache.update`` for :func:`recompute_positions`' pass: the first ``count`` new rows go into the
    cache at ``positions`` in place; the rest (the last prompt token) is kept in ``stash`` and attended to
    without entering the cache.  Returns what attention reads: the cache, plus that token."""

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        layer = cache.layers[layer_idx]
        extra = key_states.shape[2] - count
        keys, last_keys = key_states.split([count, extra], dim=2)
        values, last_values = value_states.split([count, extra], dim=2)
        layer.keys.index_copy_(2, positions, keys.to(layer.keys.dtype))
        layer.values.index_copy_(2, positions, values.to(layer.values.dtype))
        if not extra:
            return layer.keys, layer.values
        stash.append((last_keys.to(layer.keys.dtype), last_values.to(layer.values.dtype)))
        return torch.cat([layer.keys, stash[-1][0]], dim=2), torch.cat([layer.values, stash[-1][1]], dim=2)

    return update


# ---- the whole step ------------------------------------------------------------------------------
@torch.no_grad()
def recompute_set(
    spec: Recompute,
    *,
    context: torch.Tensor,
    mapped_cache,
    source_model,
    target_model,
    source_cache,
    tokenizer=None,
    source_attention: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sorted positions R = prefix U selected spans U suffix of ``context`` (B, T) to recompute.

    ``mapped_cache``: the target cache mapped from the source (before any recompute);
    ``source_cache``: the source's cache of (at least) the whole context, left untouched;
    ``source_attention``: for select=source, the (Q, T) attention of the context's last Q tokens that the
    source's own prefill collected (:class:`kvhub.core.last_queries.LastQueryAttention`), so no second
    source pass runs; None: that pass runs.  Selection (exact_budget > 0) needs batch 1.
    """
    tokens = context.shape[1]
    prefix = torch.arange(0, spec.exact_prefix)
    suffix = torch.arange(tokens - spec.exact_suffix, tokens)
    eligible = torch.ones(tokens, dtype=torch.bool)
    eligible[prefix], eligible[suffix] = False, False
    budget = budget_tokens(spec, tokens)
    if budget > 0 and bool(eligible.any()) and context.shape[0] != 1:
        raise ConfigError(
            "selective recompute (exact_budget > 0) chooses tokens per sequence: pass one sequence at a time (batch 1)"
        )
    queries = selection_queries(spec, tokens)

    def source() -> torch.Tensor:  # what the source's prefill collected, or its last Q tokens run again
        if source_attention is not None:
            if tuple(source_attention.shape) != (queries, tokens):
                raise ConfigError(
                    f"source_attention has shape {tuple(source_attention.shape)}; select=source with queries="
                    f"{spec.queries} over {tokens} context tokens needs ({queries}, {tokens}): collect it over the "
                    "context (the prompt less its last token) with LastQueryAttention(source_model, queries=...)"
                )
            return source_attention
        return query_attention(source_model, context, cropped(source_cache, tokens - queries), queries=queries)

    signals = Signals(
        ids=context[0],
        source=source,
        target=lambda: query_attention(target_model, context, cropped(mapped_cache, tokens - queries), queries=queries),
        deviation=lambda: deviation_scores(mapped_cache, *first_layers_kv(target_model, context)[0]),
    )
    selected = choose_spans(
        spec,
        context[0],
        budget,
        eligible=eligible,
        tokenizer=tokenizer,
        scores=lambda: selection_scores(spec, signals, eligible),
    )
    return torch.unique(torch.cat([prefix, selected, suffix]))


@dataclass
class Signals:
    """What one side has to score T context tokens with: the library handoff has them all, the serving engine
    (kvhub.serving.engine_pass) the target's pass and the source attention the producer stored.  ``ids`` (T,):
    the context (the random control's seed); ``source`` / ``target``: callables returning the (Q, T) attention of
    that model's last Q context tokens (query i is token T - Q + i); ``deviation``: a callable returning (T,)
    scores.  A callable runs only when its selector is chosen; None: this side does not have it, and
    ``unavailable`` says what to use instead."""

    ids: torch.Tensor
    source: Callable[[], torch.Tensor] | None = None
    target: Callable[[], torch.Tensor] | None = None
    deviation: Callable[[], torch.Tensor] | None = None
    unavailable: str = ""


def selection_scores(spec: Recompute, signals: Signals, eligible: torch.Tensor) -> torch.Tensor:
    """(T,) the score of each context position under ``spec.select`` from what ``signals`` holds (source / target
    attention reduced by ``spec.score``, deviation of the mapped first layer, or the seeded random control):
    the one selector dispatch, for the library (:func:`recompute_set`) and inside the engine.  ``eligible``
    (T,): the tokens the selection may take.  UnsupportedModelError when the side lacks the signal."""
    if spec.select == "random":
        return random_scores(signals.ids)
    signal = getattr(signals, spec.select)
    if signal is None:
        raise UnsupportedModelError(f"select={spec.select!r} needs what this side does not have; {signals.unavailable}")
    if spec.select == "deviation":
        return signal()
    return attention_scores(signal().float().cpu(), eligible, score=spec.score)


def selection_queries(spec: Recompute, context_tokens: int) -> int:
    """How many last context tokens the attention selectors score with: ``spec.queries``, at most T - 1."""
    return max(1, min(spec.queries, context_tokens - 1))


def random_scores(ids: torch.Tensor) -> torch.Tensor:
    """(T,) uniform scores drawn from a generator seeded by the token ids (T,): same context, same draw."""
    generator = torch.Generator().manual_seed(int(ids.sum()) * 1_000_003 + ids.numel())
    return torch.rand(ids.numel(), generator=generator)


def spans_of(spec: Recompute, ids: torch.Tensor, tokenizer=None) -> torch.Tensor:
    """(T,) span index of each token of ``ids`` (T,): sentences / lines when ``spec.spans`` is "sentence" and
    a tokenizer is given (:func:`span_ids`), else 16-token windows ("sentence" without one) or single tokens."""
    if spec.spans == "sentence" and tokenizer is not None:
        return span_ids(token_texts(tokenizer, ids), max_span=spec.max_span)
    return torch.arange(ids.numel()) // (1 if spec.spans == "token" else 16)


def token_texts(tokenizer, ids: torch.Tensor) -> list[str]:
    """Each token of ``ids`` (T,) decoded on its own (what :func:`span_ids` reads)."""
    return tokenizer.batch_decode([[int(i)] for i in ids.tolist()])


def cropped(cache, tokens: int):
    """A new DynamicCache holding the first ``tokens`` positions of ``cache`` (``cache`` itself is untouched:
    extending the copy concatenates into new tensors)."""
    from transformers import DynamicCache

    if cache.get_seq_length() < tokens:
        raise ConfigError(
            f"the source cache holds {cache.get_seq_length()} positions, fewer than the {tokens} to map; "
            "pass the source model's cache of the whole context (or source_cache=None)"
        )
    out = DynamicCache()
    for index, layer in enumerate(cache.layers):
        out.update(layer.keys[:, :, :tokens], layer.values[:, :, :tokens], index)
    return out
