"""The real pair on this CPU, before and after issue 45: time to first token of an escalation against the target's own
prefill, and whether selecting from the source's prefill chooses the spans the second source pass chose.

    python benchmarks/escalation_real.py --out docs/results/escalation_real.json     # 2 CPU cores: ~15 minutes

Models: Qwen2.5-Coder-0.5B-Instruct -> 1.5B-Instruct (``kvhub fetch models``), bf16.

- ``selection``: on ``--items`` passkey items (kvhub.eval.longctx facts, ``--selection-tokens`` tokens), the
  default handoff spec's spans (select=source, score=max, 16 queries, 8%, whole sentences) chosen from the
  attention the source's prefill collected (:class:`kvhub.core.last_queries.LastQueryAttention`) and from a
  second source pass (:func:`kvhub.serving.recompute.query_attention`, the path before issue 45): how many items
  get identical spans, their mean overlap (positions chosen by both / by either), and how many have the stated
  answer inside them either way.  No mapper is involved.  In bf16 the two differ by roundings (the prefill's
  attention is the serving implementation's, the second pass eager), so near-tied spans can swap.
- ``ttft``: at each of ``--lengths``, ``--repeats`` alternating runs of the target's own prefill to its first
  logits (``own``), the escalation before issue 45 (``before``, benchmarks/escalation_ops.py) and after it
  (``after``: ``kvhub.serving.handoff.escalate`` from the source's cache and the attention its prefill
  collected, one target pass), each from the source cache a cascade holds.  **The mapper has random weights**
  (k=4, real shapes): what is timed does not depend on them, the first tokens do (so none is scored here).
  ``gain_*`` = own / escalation in wall time; ``gain_ratio`` = gain_after / gain_before; ``cpu_gain_*`` the same
  in this process's CPU time (``time.process_time``: all its threads), which other work on a shared machine
  disturbs far less than wall time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from escalation_ops import after, before  # the two paths, shared with the operator count
from gpu_scale import random_mapper

PAIR = ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct")


def selection(source, tokenizer, *, items: int, tokens: int) -> dict:
    """Spans from the prefill's attention against spans from the second source pass, item by item."""
    from kvhub.core.capture import run_model
    from kvhub.core.last_queries import LastQueryAttention
    from kvhub.eval.recall_tasks import build_items
    from kvhub.serving.recompute import (
        attention_scores,
        budget_tokens,
        cropped,
        query_attention,
        select_spans,
        selection_queries,
        spans_of,
    )
    from kvhub.serving.spec import HANDOFF

    same = covered_prefill = covered_pass = counted = 0
    overlap = 0.0
    for item in build_items("facts", tokenizer, context_tokens=tokens, n=items, seed=0):
        context = torch.tensor([item.prompt_ids[:-1]])
        length = context.shape[1]
        spec = HANDOFF.capped(length)
        queries = selection_queries(spec, length)
        with LastQueryAttention(source, queries=queries) as scored:
            cache = run_model(source, context)
        by_pass = query_attention(source, context, cropped(cache, length - queries), queries=queries)
        eligible = torch.ones(length, dtype=torch.bool)
        eligible[: spec.exact_prefix] = eligible[length - spec.exact_suffix :] = False
        spans = spans_of(spec, context[0], tokenizer)
        budget = budget_tokens(spec, length)
        chosen = [
            select_spans(attention_scores(a, eligible, score=spec.score), spans, budget, eligible=eligible)
            for a in (scored.attention[0], by_pass)
        ]
        answer = _answer_positions(item.prompt_ids[:-1], item.answer_ids, length - spec.exact_suffix)
        counted += 1
        same += bool(torch.equal(*chosen))
        union = torch.unique(torch.cat(chosen)).numel()
        overlap += (chosen[0].numel() + chosen[1].numel() - union) / max(union, 1)
        if answer is not None:
            covered_prefill += bool(torch.isin(answer, chosen[0]).all())
            covered_pass += bool(torch.isin(answer, chosen[1]).all())
    return {
        "items": counted,
        "tokens": tokens,
        "identical_spans": same,
        "mean_overlap": round(overlap / max(counted, 1), 4),  # |both| / |either| of the chosen positions
        "answer_covered_from_prefill": covered_prefill,
        "answer_covered_from_second_pass": covered_pass,
    }


def _answer_positions(prompt: list[int], answer: list[int], end: int) -> torch.Tensor | None:
    """Positions of the last statement of ``answer`` in prompt[:end] (None when it is not stated as these ids)."""
    for start in range(end - len(answer), -1, -1):
        if prompt[start : start + len(answer)] == answer:
            return torch.arange(start, start + len(answer))
    return None


def ttft(mapper, source, target, *, length: int, repeats: int) -> dict:
    from kvhub.core.capture import run_model
    from kvhub.core.last_queries import LastQueryAttention
    from kvhub.serving.recompute import selection_queries
    from kvhub.serving.spec import HANDOFF

    vocab = min(source.config.vocab_size, target.config.vocab_size) - 1000
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length))
    spec = HANDOFF.capped(length - 1)
    with LastQueryAttention(source, queries=selection_queries(spec, length - 1)) as scored:
        source_cache = run_model(source, ids[:, :-1])
    attention = scored.attention[0]
    runs = {
        "own": lambda: target(input_ids=ids, logits_to_keep=1),
        "before": lambda: before(mapper, source, target, ids, source_cache, spec),
        "after": lambda: after(mapper, source, target, ids, source_cache, attention, spec),
    }
    for fn in runs.values():
        fn()  # warm-up (the stacked maps are built here)
    samples: dict = {name: [] for name in runs}
    cpu: dict = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            fn()
            samples[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - started_cpu)
    median = {name: statistics.median(values) for name, values in samples.items()}
    median_cpu = {name: statistics.median(values) for name, values in cpu.items()}
    gain_before, gain_after = median["own"] / median["before"], median["own"] / median["after"]
    cpu_before, cpu_after = median_cpu["own"] / median_cpu["before"], median_cpu["own"] / median_cpu["after"]
    return {
        "tokens": length,
        **{f"{name}_s": [round(v, 4) for v in values] for name, values in samples.items()},
        **{f"{name}_median_s": round(value, 4) for name, value in median.items()},
        **{f"{name}_cpu_median_s": round(value, 4) for name, value in median_cpu.items()},
        "gain_before": round(gain_before, 3),
        "gain_after": round(gain_after, 3),
        "gain_ratio": round(gain_after / gain_before, 3),
        "cpu_gain_before": round(cpu_before, 3),
        "cpu_gain_after": round(cpu_after, 3),
        "cpu_gain_ratio": round(cpu_after / cpu_before, 3),
    }


def main(argv=None) -> dict:
    from kvhub.models.loading import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--items", type=int, default=30, help="passkey items of the selection check (0: skip it)")
    parser.add_argument("--selection-tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with torch.no_grad():
        source, tokenizer, _ = load_model(PAIR[0], device="cpu", dtype=args.dtype)
        target, _, _ = load_model(PAIR[1], device="cpu", dtype=args.dtype)
        mapper = random_mapper(source, target, k=4, seed=0, device=torch.device("cpu"))
        for side, name in zip(("source", "target"), PAIR):
            mapper.metadata[side]["model_id"] = name
        report = {
            "command": "python benchmarks/escalation_real.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
            "pair": list(PAIR),
            "dtype": args.dtype,
            "mapper": "random weights, k=4, the pair's shapes (timing only)",
            "selection": selection(source, tokenizer, items=args.items, tokens=args.selection_tokens)
            if args.items
            else None,
        }
        print(json.dumps(report["selection"]))
        report["ttft"] = []
        for length in (int(n) for n in args.lengths.split(",")):
            report["ttft"].append(ttft(mapper, source, target, length=length, repeats=args.repeats))
            print(json.dumps({k: v for k, v in report["ttft"][-1].items() if not k.endswith("_s")}))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
