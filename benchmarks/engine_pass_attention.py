"""The recompute pass's masked attention, one layer: kvhub.serving.engine_pass.masked_attention (fused
scaled_dot_product_attention over chunks of sorted queries) against the two formulas it replaced, side by side
(issue 34): the dense masked softmax in the model's dtype (query heads grouped per K/V head, a float32 score
matrix), and before it the float32 formula (K/V copied to float32 and repeated per query head).

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


def dense_formula(query, key, value, positions, cached_keys, cached_values, *, scale):
    """The pass's attention between the float32 formula and the fused one: model dtype, heads grouped, the whole
    (H_kv, group * N, S) score matrix materialised in float32, masked and softmaxed."""
    heads_kv, length, dim = cached_keys.shape
    total = max(length, int(positions.max()) + 1)
    dtype, count, heads_q = query.dtype, query.shape[0], query.shape[1]
    keys = cached_keys.new_empty((heads_kv, total, dim), dtype=dtype)
    values = torch.empty_like(keys)
    keys[:, :length], values[:, :length] = cached_keys, cached_values
    keys[:, positions], values[:, positions] = key.transpose(0, 1), value.transpose(0, 1)
    group = heads_q // heads_kv
    grouped = query.transpose(0, 1).reshape(heads_kv, group * count, dim)
    scores = (grouped @ keys.transpose(1, 2)).float().view(heads_kv, group, count, total) * scale
    allowed = torch.arange(total)[None, :] <= positions[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = probs.to(dtype).view(heads_kv, group * count, total) @ values
    return out.view(heads_q, count, dim).transpose(0, 1)


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
                "float32": partial(float32_formula, *inputs, scale=DIM**-0.5),
                "dense": partial(dense_formula, *inputs, scale=DIM**-0.5),
                "now": partial(masked_attention, *inputs, scale=DIM**-0.5),
            }
            for fn in ops.values():
                fn()
            samples = {name: [] for name in ops}
            for _ in range(args.repeats):
                for name, fn in ops.items():
                    samples[name].append(seconds(fn))
            median = {name: statistics.median(values) for name, values in samples.items()}
            error = (ops["now"]()[0].float() - ops["dense"]().float()).abs().max().item()
            rows.append(
                {
                    "dtype": dtype_name,
                    "context": length,
                    "queries": count,
                    **{f"{name}_ms": 1000 * value for name, value in median.items()},
                    "speedup_vs_dense": median["dense"] / median["now"],
                    "speedup_vs_float32": median["float32"] / median["now"],
                    "max_abs_diff_vs_dense": error,
                }
            )
            print(json.dumps(rows[-1]))
    report = {"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
