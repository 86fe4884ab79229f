"""The selective exact recompute inside a serving engine, run with the engine's own model.

:mod:`kvhub.serving.recompute` defines the pass in transformers: after the map, the target computes the
K/V of a set R of context positions (exact prefix, selected spans) in ONE pass of the |R| tokens at their
true positions, where

    t attends to cached position j    iff  j < t and j not in R
    t attends to recomputed t'        iff  t' <= t

This module runs the same pass with a vLLM model: its decoder layers run unchanged (norms, qkv
projection, q/k norms, rotary embedding, output projection, MLP), and only each layer's attention
module is swapped, for the duration of the pass, with :func:`masked_attention` over a contiguous copy of
that layer's cached K/V (read from the engine's paged blocks) into which the pass's own K/V are placed
at their positions.  Placing them and then masking ``j <= t`` is the rule above: a recomputed j holds
its fresh K/V, any other j < t the cached one.  Positions at or past the cache's length are appended
(they must follow it without a gap): that is how the selection pass runs the prompt's tail after the
mapped cache and reads its attention.

Engine-independent (no vLLM import): the model is any module whose body has ``layers`` (each
``layer(positions, hidden, residual) -> (hidden, residual)`` with ``layer.self_attn.attn(q, k, v)``,
vLLM's convention for Llama, Qwen2/3, Mistral) and ``embed_input_ids`` or ``embed_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvhub.errors import UnsupportedModelError

ContextKV = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # layer -> cached K, V: (H_kv, L, D) each


@dataclass
class PassResult:
    """fresh[i] = (K, V) of layer i for the pass's tokens, (N, H_kv, D) each, as the engine writes them;
    attention: (Q, L) attention of the last Q pass tokens on the L cached positions, averaged over
    layers and heads (None unless asked); seconds: wall time of the pass, of which attention_seconds in
    the attention itself (the rest: the layers' projections, norms, MLPs, and reading the cache)."""

    fresh: list[tuple[torch.Tensor, torch.Tensor]]
    attention: torch.Tensor | None
    seconds: float = 0.0  # the whole pass
    attention_seconds: float = 0.0  # of which in masked_attention (K/V placed, scores, softmax, output)


QUERY_CHUNK = 128  # queries per fused attention call; each call reads the keys up to its last query's position


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    cached_keys: torch.Tensor,
    cached_values: torch.Tensor,
    *,
    scale: float,
    attention_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of the pass's N tokens over the cache with their own K/V placed at ``positions``.

    query (N, H_q, D); key, value (N, H_kv, D); positions (N,) sorted, unique; cached_keys / cached_values
    (H_kv, L, D).  Positions >= L extend the cache and must cover [L, max + 1).  Returns the output
    (N, H_q, D) in the query's dtype and, with ``attention_rows`` = Q > 0, the probabilities (H_q, Q, S) of the
    last Q queries over the S = max(L, max + 1) positions, float32 (else None).

    In the model's dtype (bf16 where the engine serves it): one copy of the layer's K/V with the pass's own
    placed in it, the query heads of each K/V head batched against it (no copy per query head), and the output
    from the fused ``scaled_dot_product_attention`` with the boolean mask ``j <= t``, over chunks of
    :data:`QUERY_CHUNK` sorted queries, each against the keys up to its last query's position only (the
    positions are sorted, so the keys past it are masked for the whole chunk): no float32 score matrix is
    materialised.  The probability rows, when asked, are computed explicitly for those Q queries alone
    (benchmarks/engine_pass_attention.py measures this against the formulas it replaced).
    """
    heads_kv, length, dim = cached_keys.shape
    total = max(length, int(positions.max()) + 1)
    appended = positions[positions >= length]
    if appended.numel() != total - length:
        raise ValueError(f"positions past the cache's {length} must extend it without a gap")
    dtype, count, heads_q = query.dtype, query.shape[0], query.shape[1]
    keys = cached_keys.new_empty((heads_kv, total, dim), dtype=dtype)
    values = torch.empty_like(keys)
    keys[:, :length], values[:, :length] = cached_keys, cached_values
    keys[:, positions], values[:, positions] = key.transpose(0, 1).to(dtype), value.transpose(0, 1).to(dtype)
    group = heads_q // heads_kv  # query head h reads K/V head h // group
    grouped = query.transpose(0, 1).reshape(heads_kv, group, count, dim)
    out = torch.empty_like(grouped)
    index = torch.arange(total, device=positions.device)
    for start in range(0, count, QUERY_CHUNK):
        stop = min(count, start + QUERY_CHUNK)
        limit = int(positions[stop - 1]) + 1
        allowed = index[None, :limit] <= positions[start:stop, None]  # (c, limit), the same for every head
        chunk = grouped[:, :, start:stop].reshape(1, heads_kv, group * (stop - start), dim)
        done = F.scaled_dot_product_attention(
            chunk, keys[None, :, :limit], values[None, :, :limit], attn_mask=allowed.repeat(group, 1), scale=scale
        )
        out[:, :, start:stop] = done[0].view(heads_kv, group, stop - start, dim)
    out = out.view(heads_q, count, dim).transpose(0, 1)
    if not attention_rows:
        return out, None
    last = grouped[:, :, count - attention_rows :].reshape(heads_kv, group * attention_rows, dim)
    scores = (last @ keys.transpose(1, 2)).float().view(heads_kv, group, attention_rows, total) * scale
    allowed = index[None, :] <= positions[count - attention_rows :, None]  # (Q, S)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return out, probs.view(heads_q, attention_rows, total)


class EnginePass:
    """Runs :func:`masked_attention` passes through an engine model's decoder layers (module docstring)."""

    def __init__(self, model: torch.nn.Module):
        body = getattr(model, "model", model)
        layers = getattr(body, "layers", None)
        embed = getattr(body, "embed_input_ids", None) or getattr(body, "embed_tokens", None)
        if layers is None or embed is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no decoder layers / token embedding where "
                "kvhub looks (model.layers, model.embed_input_ids); the recompute cannot run it"
            )
        start, end = getattr(body, "start_layer", 0), getattr(body, "end_layer", len(layers))
        if (start, end) != (0, len(layers)):
            raise UnsupportedModelError(
                "the recompute runs every decoder layer in one process: pipeline parallelism is not supported"
            )
        self.layers = list(layers)
        self.embed = embed
        for index, layer in enumerate(self.layers):
            attn = getattr(getattr(layer, "self_attn", None), "attn", None)
            if attn is None or not hasattr(attn, "num_heads"):
                raise UnsupportedModelError(
                    f"decoder layer {index} ({type(layer).__name__}) has no self_attn.attn; "
                    "the recompute supports Llama/Qwen2/Qwen3/Mistral-style layers"
                )
            impl = getattr(attn, "impl", None)
            window = getattr(impl, "sliding_window", None)
            if (
                window not in (None, (-1, -1), -1)
                or getattr(impl, "logits_soft_cap", None)
                or getattr(impl, "alibi_slopes", None) is not None
            ):
                raise UnsupportedModelError(
                    f"attention layer {index} uses a sliding window, soft cap or ALiBi; the "
                    "recompute's masked pass is plain causal attention: use exact_budget=0"
                )

    @torch.no_grad()
    def run(
        self, token_ids: torch.Tensor, positions: torch.Tensor, cached: ContextKV, *, attention_rows: int = 0
    ) -> PassResult:
        """One pass of ``token_ids`` (N,) at ``positions`` (N,, sorted) over ``cached(layer)``; with
        ``attention_rows`` = Q > 0 also the attention of the last Q tokens on the cached positions."""
        fresh: list[tuple[torch.Tensor, torch.Tensor]] = []
        attention = [None]
        timing = [0.0]  # seconds inside masked_attention
        began = time.perf_counter()

        def attend(index: int, attn):
            scale = float(getattr(getattr(attn, "impl", None), "scale", None) or attn.head_size**-0.5)

            def forward(query, key, value, *args, **kwargs):
                n = query.shape[0]
                q = query.view(n, attn.num_heads, attn.head_size)
                k = key.view(n, attn.num_kv_heads, attn.head_size)
                v = value.view(n, attn.num_kv_heads, attn.head_size)
                keys, values = cached(index)
                started = time.perf_counter()
                out, probs = masked_attention(
                    q, k, v, positions, keys, values, scale=scale, attention_rows=attention_rows
                )
                timing[0] += time.perf_counter() - started
                fresh.append((k.clone(), v.clone()))
                if probs is not None:
                    rows = probs[:, :, : keys.shape[1]].mean(0)  # (Q, L): heads averaged
                    attention[0] = rows if attention[0] is None else attention[0] + rows
                return out.reshape(n, -1)

            return forward

        hidden, residual = self.embed(token_ids), None
        with ExitStack() as stack:
            for index, layer in enumerate(self.layers):
                stack.enter_context(_swapped_forward(layer.self_attn.attn, attend(index, layer.self_attn.attn)))
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual)
        mean = None if attention[0] is None else attention[0] / len(self.layers)
        return PassResult(fresh, mean, seconds=time.perf_counter() - began, attention_seconds=timing[0])


@contextmanager
def _swapped_forward(module: torch.nn.Module, forward):
    """``module.forward`` is ``forward`` inside the block (an instance attribute; the class is untouched)."""
    module.forward = forward
    try:
        yield
    finally:
        del module.forward


@dataclass
class Recomputed:
    """What :func:`recompute_request` decided and computed: ``positions`` (R,) sorted, of which ``prefix``
    exact-prefix and ``selected`` chosen tokens; fresh[i] = (K, V) of layer i at those positions; ``exact``
    the context positions the large model computes itself for this request (:func:`exact_positions`);
    ``profile``: where its time went (the selection pass, the recompute pass, the attention inside both)."""

    positions: torch.Tensor
    prefix: int
    selected: int
    fresh: list[tuple[torch.Tensor, torch.Tensor]]
    exact: torch.Tensor
    profile: dict[str, float] = field(default_factory=dict)  # seconds: select_pass_s, recompute_pass_s, attention_s


def exact_positions(recomputed: torch.Tensor, *, end: int, tokens: int) -> torch.Tensor:
    """The context positions of an n-token prompt (``tokens`` = n) that the large model computes itself when
    its cache holds [0, end): the ``recomputed`` ones (R,) and the tail [end, n - 1) the engine prefills (its
    last prompt token is the model's next input, not context).  Sorted, long, on the CPU: the type and meaning
    of :func:`kvhub.serving.handoff.prepare_cache_counted`'s positions, so a report counts what was computed on
    either path.  [0, start), the engine's own cached prefix, is neither mapped nor computed here."""
    return torch.unique(torch.cat([recomputed.cpu().long(), torch.arange(end, max(end, tokens - 1))]))


def load_counts(recomputed: torch.Tensor, exact: torch.Tensor, *, tokens: int) -> dict:
    """A load's report for an n-token prompt (``tokens`` = n), counted from the positions themselves:
    ``recomputed_tokens`` by the masked pass (R), ``exact_tokens`` by the large model in all (:func:`exact_positions`)
    and ``exact_fraction``, their share of the n - 1 context positions, as kvhub.handoff's reports count them."""
    return {
        "recomputed_tokens": int(recomputed.numel()),
        "exact_tokens": int(exact.numel()),
        "exact_fraction": exact.numel() / max(1, tokens - 1),
    }


def prompt_attention(engine: EnginePass, prompt_ids: list[int], cached: ContextKV, *, queries: int) -> torch.Tensor:
    """(Q, S) attention of the last Q = min(``queries``, S) tokens of an S-token prompt on its S positions,
    averaged over layers and heads, float32 on the CPU: the producer's signal for the consumer's
    ``select=source`` (what :func:`kvhub.serving.recompute.query_attention` reads from the source in the
    library).  ``cached(layer)``: the prompt's K/V as the producer just computed them; the pass re-runs the
    last Q tokens over them, which put their own (equal) K/V back at their positions, so each row is the
    attention the prefill computed."""
    tokens = len(prompt_ids)
    count = max(1, min(queries, tokens))
    device = cached(0)[0].device
    ids = torch.tensor(prompt_ids[tokens - count :], dtype=torch.long, device=device)
    positions = torch.arange(tokens - count, tokens, device=device)
    attention = engine.run(ids, positions, cached, attention_rows=count).attention
    if attention is None:  # a model with no layers
        raise UnsupportedModelError("the source attention pass returned no attention rows")
    return attention.float().cpu()


def stale_source_attention(attention: torch.Tensor | None, *, prompt_tokens: int, spec) -> str:
    """Why the stored source attention cannot choose for this prompt ("" when it can): none stored, or the
    stored prompt ends more than ``exact_suffix`` tokens before this one, so its last tokens (the queries)
    are an earlier turn's, not this prompt's question."""
    if attention is None:
        return "no source attention stored with the KV"
    behind = prompt_tokens - attention.shape[1]
    if behind > spec.exact_suffix:
        return f"the stored prompt ends {behind} tokens before this one: its attention is an earlier turn's"
    return ""


def recompute_request(
    engine: EnginePass,
    spec,
    *,
    prompt_ids: list[int],
    start: int,
    end: int,
    cached: ContextKV,
    tokenizer=None,
    source_attention: torch.Tensor | None = None,
) -> Recomputed:
    """The recompute of one request whose cache holds [0, end) (mapped from ``start`` on, the engine's own
    before it); the engine computes [end, n) itself afterwards.

    R = the first ``exact_prefix`` positions in [start, end) plus whole spans chosen in [start, end) under
    ``round(exact_budget * (n - 1))`` tokens, less what the block rounding of ``end`` added to the tail the
    engine computes beyond ``exact_suffix``: by ``select="target"``, the attention of the prompt's last
    ``queries`` tokens, run after the mapped cache in a selection pass of [end, n) (the tail the engine
    computes next; it is not written), or ``select="random"`` (the control for the signal).  The result
    says which positions were recomputed, and which the large model computes in all (``exact``), as counted.
    """
    from kvhub.serving.recompute import Signals, budget_tokens, choose_spans, selection_scores

    tokens = len(prompt_ids)
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    prefix = torch.arange(start, max(start, min(spec.exact_prefix, end)))
    eligible = torch.zeros(end, dtype=torch.bool)
    eligible[start:end] = True
    eligible[prefix] = False
    # the engine computes [end, n): what block rounding adds beyond exact_suffix comes out of the budget, so
    # that prefix + budget + suffix bound what the large model computes, as in kvhub.handoff
    rounding = max(0, tokens - end - max(spec.exact_suffix, 1))
    budget = max(0, budget_tokens(spec, tokens - 1) - rounding)

    def target_attention() -> torch.Tensor:  # the selection pass: the tail [end, n) after the mapped cache
        device = cached(0)[0].device
        queries = min(spec.queries, tokens - end)
        tail = torch.arange(end, tokens, device=device)
        selection = engine.run(ids[end:].to(device), tail, cached, attention_rows=queries)
        profile["select_pass_s"] = selection.seconds
        profile["attention_s"] = profile.get("attention_s", 0.0) + selection.attention_seconds
        return selection.attention

    stored = None
    if source_attention is not None:
        stored = source_attention[-min(spec.queries, source_attention.shape[0]) :, :end]
    signals = Signals(
        ids=ids[:end],
        source=None if stored is None else lambda: stored,
        target=target_attention,
        unavailable="inside vLLM use select=target, select=source with the small model's attention stored by the "
        "producer, or random (the control)",
    )
    profile: dict[str, float] = {}
    selected = choose_spans(
        spec,
        ids[:end],
        budget,
        eligible=eligible,
        scores=lambda: selection_scores(spec, signals, eligible),
        tokenizer=tokenizer,
    )
    positions = torch.unique(torch.cat([prefix, selected]))
    fresh = []
    if positions.numel():
        device = cached(0)[0].device
        done = engine.run(ids[positions].to(device), positions.to(device), cached)
        fresh = done.fresh
        profile["recompute_pass_s"] = done.seconds
        profile["attention_s"] = profile.get("attention_s", 0.0) + done.attention_seconds
    return Recomputed(
        positions,
        prefix=prefix.numel(),
        selected=positions.numel() - prefix.numel(),
        fresh=fresh,
        exact=exact_positions(positions, end=end, tokens=tokens),
        profile={name: round(value, 4) for name, value in profile.items()},
    )
