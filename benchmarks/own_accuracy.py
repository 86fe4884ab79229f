"""The target's own-prefill accuracy on long-context tasks, model loaded once, no mapper: how the task parameters
of :mod:`kvhub.eval.ruler` and :mod:`kvhub.eval.aggregate` were chosen (issue 47, item 2: own >= 0.8 at 1k).

    nice -n 10 python benchmarks/own_accuracy.py --model Qwen2.5-Coder-1.5B-Instruct --tasks vt,cwe,agg-count,agg-total \\
        --context-tokens 1024 --n 6 --out own_accuracy_1k.json

Items come from :func:`kvhub.eval.recall_tasks.build_items`, exactly as ``kvhub eval`` builds them; each is scored as
``own`` is in :func:`kvhub.eval.longctx.score_recall_item` (the target's cache of the prompt, the answer teacher
forced: correct iff greedy decoding writes it).  Beside the score, the target's greedy continuation (the answer's
length + 4 tokens), to see what it writes when it misses.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

from kvhub.core.capture import cache_kwargs, run_model
from kvhub.eval.longctx import answer_score
from kvhub.eval.recall_tasks import build_items
from kvhub.models.loading import load_model


@torch.no_grad()
def greedy(model, cache, last_id: int, start: int, steps: int) -> list[int]:
    """``steps`` greedy tokens after ``last_id`` at position ``start``, continuing ``cache`` (which grows)."""
    out, token = [], last_id
    for position in range(start, start + steps):
        ids = torch.tensor([[token]])
        logits = model(input_ids=ids, position_ids=torch.tensor([[position]]), **cache_kwargs(model, cache)).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
    return out


def score_own(model, tokenizer, item) -> dict:
    """The ``own`` condition of one item: exact (teacher forced) and the greedy continuation, with timings."""
    started = time.perf_counter()
    context = torch.tensor([item.prompt_ids[:-1]])
    cache = run_model(model, context)
    prefill_s = time.perf_counter() - started
    written = greedy(model, copy.deepcopy(cache), item.prompt_ids[-1], context.shape[1], len(item.answer_ids) + 4)
    exact, token_acc, _, _ = answer_score(model, cache, [item.prompt_ids[-1]] + item.answer_ids, len(item.answer_ids))
    return {
        "id": item.id,
        "exact": exact,
        "token_acc": token_acc,
        "gold": item.answer,
        "greedy": tokenizer.decode(written),
        "tokens": len(item.prompt_ids),
        "prefill_s": round(prefill_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--tasks", default="vt,cwe,agg-count,agg-total")
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--n", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=0, help="score items FIRST..n-1 only (the same items as with n)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    model, tokenizer, _ = load_model(args.model, device="cpu", dtype=args.dtype)
    report = {"command": " ".join(sys.argv), "machine": platform.processor() or platform.machine(), "tasks": {}}
    for task in args.tasks.split(","):
        items = build_items(task, tokenizer, context_tokens=args.context_tokens, n=args.n, seed=args.seed)
        rows = []
        for item in items[args.first :]:
            rows.append(score_own(model, tokenizer, item))
            print(task, json.dumps(rows[-1]), flush=True)
        accuracy = sum(row["exact"] for row in rows) / len(rows)
        report["tasks"][task] = {"own": accuracy, "n": len(rows), "items": rows}
        print(f"== {task}: own {accuracy:.2f} ({sum(r['exact'] for r in rows)}/{len(rows)})", flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
