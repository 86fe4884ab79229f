"""The recompute pass's masked attention, one layer: kvhub.serving.engine_pass.masked_attention against the
float32 formula it replaced (K/V copied to float32 and repeated per query head), side by side (issue 34).

    python benchmarks/engine_pass_attention.py --out docs/results/engine_pass_attention.json

Shapes of Qwen2.5-Coder-1.5B (12 query heads, 2 K/V heads, head_dim 128); the pass recomputes 8% of the
context (N queries at sorted random positions) over L cached positions; median of --repeats interleaved
samples after a warm-up, on this machine's threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from kvhub.serving.engine_pass import masked_attention

HEADS_Q, HEADS_KV, DIM = 12, 2, 128


def float32_formula(query, key, value, positions, cached_keys, cached_values, *, scale):
    """The pass's attention before issue 34: the layer copied to float32, K/V repeated per query head."""
    heads_kv, length, dim = cached_keys.shape
    total = max(length, int(positions.max()) + 1)
    keys = cached_keys.new_zeros((heads_kv, total, dim), dtype=torch.float32)
    values = torch.zeros_like(keys)
    keys[:, :length], values[:, :length] = cached_keys.float(), cached_values.float()
    keys[:, positions], values[:, positions] = key.float().transpose(0, 1), value.float().transpose(0, 1)
    group = query.shape[1] // heads_kv
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scores = query.float().transpose(0, 1) @ keys.transpose(1, 2) * scale
    allowed = torch.arange(total)[None, :] <= positions[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ values).transpose(0, 1).to(query.dtype)


def seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,4096,8192")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for length in (int(v) for v in args.lengths.split(",")):
            g = torch.Generator().manual_seed(length)
            count = round(0.08 * length)
            positions = torch.sort(torch.randperm(length, generator=g)[:count]).values
            q = torch.randn(count, HEADS_Q, DIM, generator=g).to(dtype)
            k, v = (torch.randn(count, HEADS_KV, DIM, generator=g).to(dtype) for _ in range(2))
            ck, cv = (torch.randn(HEADS_KV, length, DIM, generator=g).to(dtype) for _ in range(2))
            inputs = (q, k, v, positions, ck, cv)
            ops = {
                "before": partial(float32_formula, *inputs, scale=DIM**-0.5),
                "now": partial(masked_attention, *inputs, scale=DIM**-0.5),
            }
            for fn in ops.values():
                fn()
            samples = {name: [] for name in ops}
            for _ in range(args.repeats):
                for name, fn in ops.items():
                    samples[name].append(seconds(fn))
            before, now = (statistics.median(samples[name]) for name in ("before", "now"))
            rows.append(
                {
                    "dtype": dtype_name,
                    "context": length,
                    "queries": count,
                    "before_ms": 1000 * before,
                    "now_ms": 1000 * now,
                    "speedup": before / now,
                }
            )
            print(json.dumps(rows[-1]))
    report = {"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
