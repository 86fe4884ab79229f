"""Concurrent escalations against concurrent plain prefills, through a running `kvhub serve` pair (issue 34).

    kvhub serve REF --json -- --dtype float32 --max-model-len 4096 --block-size 32 --max-num-seqs 16
    .venv/bin/python benchmarks/serve_concurrency.py --small http://127.0.0.1:8001/v1 \\
        --large http://127.0.0.1:8002/v1 --concurrency 4 16 --context-tokens 1024 \\
        --out docs/results/serve_concurrency.json

For each concurrency C: C seeded passkey items (`kvhub eval`'s facts task, each its own tenant) go to the small
server one at a time (1 token each: their KV is stored).  Then, on the large server, per repeat: C plain
prefills sent at once (fresh tenants: the large model's own prefill), and C escalations sent at once (the
stored tenants: map + the connector's default recompute; mapped blocks never enter the prefix cache, so
every repeat maps again).  Each request asks for 1 token: its time to first token is its wall time from the
batch's common start; the batch's wall time gives the throughput (prompts per second).  Last, the answers
under the same concurrency: C escalations at once, each greedy for the answer's length, scored exact against
the stated passkey (facts kept under load; the large model's own answers are 1.00 on these items in every
other run, and a second batch of C full prefills would double the run), with the connector's report of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _batch(endpoint, prompts: list[list[int]], tenants: list[str], *, max_tokens: list[int] | None = None) -> dict:
    """Send every prompt at once; per-request seconds from the common start, the batch's wall time, the answers."""
    started = time.perf_counter()

    def one(index: int):
        tokens = max_tokens[index] if max_tokens else 1
        completion = endpoint.complete(prompts[index], max_tokens=tokens, cache_salt=tenants[index])
        return time.perf_counter() - started, completion

    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(one, range(len(prompts))))
    wall = time.perf_counter() - started
    seconds = sorted(s for s, _ in done)
    return {
        "wall_s": wall,
        "throughput_per_s": len(prompts) / wall,
        "ttft_median_s": statistics.median(seconds),
        "ttft_p90_s": seconds[min(len(seconds) - 1, int(0.9 * len(seconds)))],
        "completions": [c for _, c in done],
    }


def _exact(batch: dict, items) -> float:
    """Share of the batch's answers whose first len(answer) greedy tokens are the item's answer."""
    hits = [(c.token_ids or [])[: len(i.answer_ids)] == i.answer_ids for c, i in zip(batch["completions"], items)]
    return sum(hits) / len(items)


def _summary(rows: list[dict]) -> dict:
    keys = ("wall_s", "throughput_per_s", "ttft_median_s", "ttft_p90_s")
    return {key: statistics.median(r[key] for r in rows) for key in keys} | {"repeats": len(rows)}


def run(args) -> dict:
    from kvhub.cli.calib_cmd import load_tokenizer
    from kvhub.eval.recall_tasks import build_items
    from kvhub.eval.served import Endpoint, new_tenant

    small, large = Endpoint.at(args.small, timeout=args.timeout), Endpoint.at(args.large, timeout=args.timeout)
    tokenizer = load_tokenizer(args.tokenizer or small.model)
    report = {"small": small.model, "large": large.model, "context_tokens": args.context_tokens, "rows": []}
    for concurrency in args.concurrency:
        items = build_items("facts", tokenizer, context_tokens=args.context_tokens, n=concurrency, seed=args.seed)
        prompts = [item.prompt_ids for item in items]
        stored = [new_tenant() for _ in items]
        for prompt, tenant in zip(prompts, stored):
            small.complete(prompt, max_tokens=1, cache_salt=tenant)
        own_rows, escalated_rows = [], []
        for _ in range(args.repeats):
            own_rows.append(_batch(large, prompts, [new_tenant() for _ in items]))
            escalated_rows.append(_batch(large, prompts, stored))
        lengths = [len(item.answer_ids) for item in items]
        escalated = _batch(large, prompts, stored, max_tokens=lengths)

        loads = [c.kv_transfer_params.get("kvhub") or {} for c in escalated["completions"]]
        row = {
            "concurrency": concurrency,
            "prompt_tokens": statistics.mean(len(p) for p in prompts),
            "own": _summary(own_rows),
            "escalated": _summary(escalated_rows),
            "acc_escalated": _exact(escalated, items),
            "escalations_mapped": sum(bool(load.get("mapped_tokens")) for load in loads),
            "exact_fraction": statistics.mean(float(load.get("exact_fraction") or 0) for load in loads),
            "recompute_s_median": statistics.median(float(load.get("recompute_s") or 0) for load in loads),
        }
        row["throughput_gain"] = row["escalated"]["throughput_per_s"] / row["own"]["throughput_per_s"]
        row["ttft_median_speedup"] = row["own"]["ttft_median_s"] / row["escalated"]["ttft_median_s"]
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", required=True, help="the small server's base URL (kvhub serve --json)")
    parser.add_argument("--large", required=True, help="the large server's base URL")
    parser.add_argument("--tokenizer", help="tokenizer (default: the small model's name, its local copy)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    report = run(args)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
