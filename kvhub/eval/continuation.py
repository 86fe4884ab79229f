"""Quality and speed of a mapper on real models.

Continuation metrics on held-out text: each sequence is cut at ``context_len``; the target predicts
the remaining tokens (a) from its own cache of the context, (b) from the mapped cache (source over
tokens [0, c-1), target consumes token c-1 onwards: the handoff), (c) with no context at all, and (d)
``drop``: the target over only the context positions (b) recomputed exactly, at their true positions,
the rest dropped (:mod:`kvhub.serving.drop`: the no-fit alternative at the same target compute).
Reported: next-token top-1 agreement of (b) with (a), KL(a || b) per token, perplexity of the true
tokens under (a)-(d), and the cosine between attention outputs is left to the task evaluation.
``samples`` keeps the same figures per sequence (``kvhub eval --log-samples``).

Speed: :func:`time_transfer_vs_prefill` times ``mapper.transfer`` against the target body
re-prefilling the same context, interleaved in one run on the same device and dtype.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from kvhub.core.capture import cache_kwargs, run_model
from kvhub.progress import Progress, report
from kvhub.serving.drop import drop_cache
from kvhub.serving.handoff import escalate, prepare_cache_counted, source_prefill
from kvhub.serving.spec import Recompute


@dataclass
class ContinuationMetrics:
    sequences: int
    tokens: int
    agreement: float  # top-1 of mapped == top-1 of own
    kl: float  # mean KL(own || mapped), nats/token
    ppl_own: float
    ppl_mapped: float
    ppl_no_context: float
    ppl_drop: float | None = None  # None for samples measured before the drop condition
    samples: list[dict] = field(default_factory=list, repr=False)  # per sequence: nll sums, agreement, KL

    def as_dict(self) -> dict:
        """The summary figures (``samples`` left out)."""
        return {k: v for k, v in asdict(self).items() if k != "samples"}


@torch.no_grad()
def _logits_after(target, cache, ids: torch.Tensor, *, start: int | None = None) -> torch.Tensor:
    """Target logits for ``ids`` continuing ``cache`` (None: fresh).  (B, T, V) fp32.  ``start``: the first
    position of ``ids`` when the cache holds fewer entries than positions (a drop cache)."""
    kwargs = {**cache_kwargs(target, cache), "use_cache": True} if cache is not None else {}
    if start is not None:
        kwargs["position_ids"] = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    return target(input_ids=ids, **kwargs).logits.float()


@torch.no_grad()
def window_sample(
    mapper, source, target, ids: torch.Tensor, *, context_len: int, recompute: Recompute = Recompute(), tokenizer=None
) -> dict:
    """One sequence's figures: tokens scored, summed NLL per condition (own / mapped / no_context), the share of
    next-token top-1 agreement and the mean KL(own || mapped).  ids: (1, T) with T > context_len >= 2; the
    mapped cache recomputes ``recompute`` (capped to the context; ``tokenizer`` for sentence spans)."""
    device = next(target.parameters()).device
    ids = ids.to(device)
    tail = ids[:, context_len - 1 :]  # token c-1 onwards: what the target consumes
    labels = ids[:, context_len:]
    own_logits = target(input_ids=ids).logits.float()[:, context_len - 1 : -1]
    spec = recompute.capped(context_len - 1)
    mapped_cache, positions = prepare_cache_counted(
        mapper, source, target, ids[:, :context_len], recompute=spec, tokenizer=tokenizer if spec.selective else None
    )
    map_logits = _logits_after(target, mapped_cache, tail)[:, :-1]
    none_logits = _logits_after(target, None, tail)[:, :-1]
    kept = drop_cache(target, ids[:, : context_len - 1], positions)  # the same positions, nothing mapped
    drop_logits = _logits_after(target, kept, tail, start=context_len - 1)[:, :-1]
    own_logp, map_logp = F.log_softmax(own_logits, -1), F.log_softmax(map_logits, -1)
    tokens = labels.shape[1]
    nll = {
        name: float(F.cross_entropy(logits[0], labels[0], reduction="sum"))
        for name, logits in (
            ("own", own_logits),
            ("mapped", map_logits),
            ("no_context", none_logits),
            ("drop", drop_logits),
        )
    }
    return {
        "tokens": tokens,
        **{f"nll_{k}": v for k, v in nll.items()},
        "agreement": float((own_logits.argmax(-1) == map_logits.argmax(-1)).sum()) / tokens,
        "kl": float((own_logp.exp() * (own_logp - map_logp)).sum()) / tokens,
    }


def aggregate(samples: list[dict]) -> ContinuationMetrics:
    """Token-weighted agreement and KL, and exp(mean NLL) per condition, over per-window samples."""
    count = sum(s["tokens"] for s in samples)
    total = lambda key: sum(s[key] * (s["tokens"] if key in ("agreement", "kl") else 1) for s in samples)  # noqa: E731
    exp = lambda key: float(torch.tensor(total(key) / count).exp())  # noqa: E731
    return ContinuationMetrics(
        len(samples),
        count,
        total("agreement") / count,
        total("kl") / count,
        exp("nll_own"),
        exp("nll_mapped"),
        exp("nll_no_context"),
        exp("nll_drop") if all("nll_drop" in s for s in samples) else None,
        samples=samples,
    )


@torch.no_grad()
def continuation_metrics(
    mapper,
    source,
    target,
    sequences: torch.Tensor,
    *,
    context_len: int,
    recompute: Recompute = Recompute(),
    tokenizer=None,
) -> ContinuationMetrics:
    """See the module docstring.  sequences: (N, T) ids with T > context_len >= 2; ``recompute``: the exact
    recompute of each mapped cache (any :class:`~kvhub.serving.spec.Recompute`, selective ones included)."""
    samples = [
        {
            "index": index,
            **window_sample(
                mapper, source, target, row[None], context_len=context_len, recompute=recompute, tokenizer=tokenizer
            ),
        }
        for index, row in enumerate(sequences)
    ]
    return aggregate(samples)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_transfer_vs_prefill(
    mapper,
    source,
    target,
    *,
    lengths=(256, 1024, 2048),
    repeats: int = 5,
    vocab: int | None = None,
    seed: int = 0,
    recompute: Recompute = Recompute(),
    progress: Progress | None = None,
) -> list[dict]:
    """Median/p90 seconds per context length of four operations, interleaved in one run:

    - ``transfer``: mapper.transfer of the source cache (which exists already when a stack escalates);
    - ``prefill``: the target body re-prefilling the same context (what transfer replaces);
    - ``handoff_ttft``: :func:`kvhub.serving.handoff.escalate` from the source cache a stack holds (transfer,
      the ``recompute`` spec's token selection from the attention the source's prefill collected, and one target
      pass of the recomputed tokens with the last one) -> first logits;
    - ``full_ttft``: the target (with LM head) over the whole prompt -> first logits.
    On CUDA, also the peak memory of each (torch.cuda.max_memory_allocated, MiB).
    ``progress`` gets one step ``bench`` counting the repeats of all lengths: ``bench: 1024 tokens, repeat 3/5``.
    """
    device = next(target.parameters()).device
    vocab = vocab or target.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    rows = []
    total, done = len(lengths) * repeats, 0
    for length in lengths:
        report(progress, f"bench: {length} tokens, warm-up", done, total)
        ids = torch.randint(0, vocab, (1, length), generator=gen).to(device)
        spec = recompute.capped(length - 1)
        source_cache, attention = source_prefill(source, ids[:, :-1], spec)

        def handoff_step():  # one target pass: the recomputed tokens and the last one, to the first logits
            done = escalate(
                mapper, source, target, ids, recompute=spec, source_cache=source_cache, source_attention=attention
            )
            if done.logits is not None:
                return done.logits
            # a sliding-window target, or a context recomputed whole: the last token's own forward, as handoff runs it
            position = {"position_ids": torch.tensor([[length - 1]], device=device)}
            out = target(
                input_ids=ids[:, -1:], use_cache=True, logits_to_keep=1, **position, **cache_kwargs(target, done.cache)
            )
            return out.logits

        ops = {
            "transfer": lambda: mapper.transfer(source_cache),
            "prefill": lambda: run_model(target, ids[:, :-1]),
            "handoff_ttft": handoff_step,
            "full_ttft": lambda: target(input_ids=ids, logits_to_keep=1).logits,
        }
        for fn in ops.values():  # warm-up
            fn()
        samples = {name: [] for name in ops}
        peaks = {}
        for repeat in range(1, repeats + 1):
            for name, fn in ops.items():
                samples[name].append(_timed(fn, device, peaks, name))
            done += 1
            report(progress, f"bench: {length} tokens, repeat {repeat}/{repeats}", done, total)
        row = {"tokens": length}
        for name, values in samples.items():
            row[f"{name}_median_s"] = statistics.median(values)
            row[f"{name}_p90_s"] = _p90(values)
        row["speedup"] = row["prefill_median_s"] / row["transfer_median_s"]
        row["ttft_speedup"] = row["full_ttft_median_s"] / row["handoff_ttft_median_s"]
        row.update({f"{name}_peak_mib": value for name, value in peaks.items()})
        rows.append(row)
    return rows


def _timed(fn, device: torch.device, peaks: dict, name: str) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    elapsed = time.perf_counter() - started
    if device.type == "cuda":
        peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated(device) / 2**20)
    return elapsed


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


_TIMING_METRICS = ("speedup", "ttft_speedup", "transfer_median_s", "prefill_median_s")


def timing_metric_rows(rows: list[dict], *, device: str, dtype: str, variant: str, repeats: int) -> list[dict]:
    """Store rows of :func:`time_transfer_vs_prefill`'s rows: task ``bench:<device>:<dtype>:<tokens>[@variant]``."""
    return [
        {
            "name": name,
            "value": float(row[name]),
            "split": "bench",
            "n": repeats,
            "task": f"bench:{device}:{dtype}:{row['tokens']}" + (f"@{variant}" if variant else ""),
        }
        for row in rows
        for name in _TIMING_METRICS
    ]
