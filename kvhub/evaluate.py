"""Quality and speed of a mapper on real models.

Continuation metrics on held-out text: each sequence is cut at ``context_len``; the target predicts
the remaining tokens (a) from its own cache of the context, (b) from the mapped cache (source over
tokens [0, c-1), target consumes token c-1 onwards: the handoff), (c) with no context at all.
Reported: next-token top-1 agreement of (b) with (a), KL(a || b) per token, perplexity of the true
tokens under (a), (b), (c), and the cosine between attention outputs is left to the task evaluation.

Speed: :func:`time_transfer_vs_prefill` times ``mapper.transfer`` against the target body
re-prefilling the same context, interleaved in one run on the same device and dtype.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .capture import run_model
from .handoff import prepare_cache


@dataclass
class ContinuationMetrics:
    sequences: int
    tokens: int
    agreement: float  # top-1 of mapped == top-1 of own
    kl: float  # mean KL(own || mapped), nats/token
    ppl_own: float
    ppl_mapped: float
    ppl_no_context: float

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def _logits_after(target, cache, ids: torch.Tensor) -> torch.Tensor:
    """Target logits for ``ids`` continuing ``cache`` (None: fresh).  (B, T, V) fp32."""
    kwargs = {"cache": cache, "use_cache": True} if cache is not None else {}
    return target(input_ids=ids, **kwargs).logits.float()


@torch.no_grad()
def continuation_metrics(mapper, source, target, sequences: torch.Tensor, *, context_len: int,
                         exact_prefix: int = 0) -> ContinuationMetrics:
    """See the module docstring.  sequences: (N, T) ids with T > context_len >= 2."""
    device = next(target.parameters()).device
    agree = kl = nll_own = nll_map = nll_none = 0.0
    count = 0
    for row in sequences:
        ids = row[None].to(device)  # (1, T)
        tail = ids[:, context_len - 1 :]  # token c-1 onwards: what the target consumes
        labels = ids[:, context_len:]
        own_logits = target(input_ids=ids).logits.float()[:, context_len - 1 : -1]
        mapped_cache = prepare_cache(mapper, source, target, ids[:, :context_len], exact_prefix=exact_prefix)
        map_logits = _logits_after(target, mapped_cache, tail)[:, :-1]
        none_logits = _logits_after(target, None, tail)[:, :-1]
        own_logp, map_logp = F.log_softmax(own_logits, -1), F.log_softmax(map_logits, -1)
        agree += float((own_logits.argmax(-1) == map_logits.argmax(-1)).sum())
        kl += float((own_logp.exp() * (own_logp - map_logp)).sum())
        nll_own += float(F.cross_entropy(own_logits[0], labels[0], reduction="sum"))
        nll_map += float(F.cross_entropy(map_logits[0], labels[0], reduction="sum"))
        nll_none += float(F.cross_entropy(none_logits[0], labels[0], reduction="sum"))
        count += labels.shape[1]
    exp = lambda total: float(torch.tensor(total / count).exp())  # noqa: E731
    return ContinuationMetrics(len(sequences), count, agree / count, kl / count, exp(nll_own), exp(nll_map), exp(nll_none))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_transfer_vs_prefill(mapper, source, target, *, lengths=(256, 1024, 2048), repeats: int = 5,
                             vocab: int | None = None, seed: int = 0) -> list[dict]:
    """Median/p90 seconds of transfer() vs the target body prefilling the same context, interleaved.

    The source cache is computed once per length (it exists already when a serving stack escalates).
    """
    device = next(target.parameters()).device
    vocab = vocab or target.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        ids = torch.randint(0, vocab, (1, length), generator=gen).to(device)
        source_cache = run_model(source, ids)
        mapper.transfer(source_cache)  # warm-up
        run_model(target, ids[:, :16])
        transfer_s, prefill_s = [], []
        for _ in range(repeats):
            for sink, fn in ((transfer_s, lambda: mapper.transfer(source_cache)), (prefill_s, lambda: run_model(target, ids))):
                _sync(device)
                started = time.perf_counter()
                fn()
                _sync(device)
                sink.append(time.perf_counter() - started)
        rows.append({
            "tokens": length,
            "transfer_median_s": statistics.median(transfer_s), "transfer_p90_s": _p90(transfer_s),
            "prefill_median_s": statistics.median(prefill_s), "prefill_p90_s": _p90(prefill_s),
            "speedup": statistics.median(prefill_s) / statistics.median(transfer_s),
        })
    return rows


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
