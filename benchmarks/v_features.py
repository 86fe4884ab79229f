"""Richer inputs for the map (issue 47, item 4): held-out R^2 when a target layer's K and V are read from more of
the source than its K (or V) at the same position, from one capture pass.

    python benchmarks/v_features.py --samples 64 --heldout 16 --dtype bfloat16 --out docs/results/v_features.json
    # --moments FILE keeps the pass's moments (5 GB for this pair) to solve again, e.g. with another --grid

The pass keeps, per kept token t of every calibration sequence (the recipe's stride; each sequence's first kept
token is left out of every variant, since it has no t-1), four blocks of every source layer: K_t (RoPE stripped),
V_t, K_{t-1} and V_{t-1}; and the target's K_t and V_t.  Each variant below is solved from the same moments
exactly as ``kvhub fit`` solves (a "source layer" of the solve is one block of one source layer, so the top-k
selection and k and lambda are chosen per target layer on held-out R^2, from the same candidates):

- ``same``: K from the source's K_t, V from its V_t (what kvhub fits today);
- ``kv``: K and V each from K_t and V_t (the other half of each source layer's cache at the same position);
- ``previous``: K from K_t and K_{t-1}, V from V_t and V_{t-1} (the neighbouring position);
- ``kv+previous``: all four blocks.

The report holds each variant's held-out R^2 (mean and min over target layers, K and V), its in-sample R^2
(the linear ceiling the data allows), and the mean number of source features a target layer reads.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

SRC = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
DST = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
BLOCKS = ("K_t", "V_t", "K_t-1", "V_t-1")  # the source blocks, in the order of X's columns
VARIANTS = {  # name -> (blocks the K map reads, blocks the V map reads)
    "same": (("K_t",), ("V_t",)),
    "kv": (("K_t", "V_t"), ("V_t", "K_t")),
    "previous": (("K_t", "K_t-1"), ("V_t", "V_t-1")),
    "kv+previous": (BLOCKS, ("V_t", "K_t", "V_t-1", "K_t-1")),
}


def shifted_rows(src, dst, sequences: int):
    """(X, Y) rows of one captured batch: X = [K_t | V_t | K_t-1 | V_t-1] over every source layer, Y = [K_t | V_t]
    over every target layer, for each sequence's kept tokens but its first (rows come sequence by sequence)."""
    per = src.keys[0].shape[0] // sequences  # kept tokens per sequence (unpadded: the same for each)
    keep = torch.ones(sequences, per, dtype=torch.bool)
    keep[:, 0] = False
    keep = keep.reshape(-1)

    def previous(block: torch.Tensor) -> torch.Tensor:
        return torch.roll(block.reshape(sequences, per, -1), 1, dims=1).reshape(sequences * per, -1)

    keys, values = torch.cat(src.keys, 1), torch.cat(src.values, 1)  # (N, Ls*ds)
    x = torch.cat([keys, values, previous(keys), previous(values)], 1)[keep]
    y = torch.cat([torch.cat(dst.keys, 1), torch.cat(dst.values, 1)], 1)[keep]
    return x, y


def variant_stats(moments, layout, variant: str):
    """The KVStats of ``variant``: for K and V, the columns of their blocks (each block a run of "source
    layers") against the target's K or V columns."""
    from kvhub.core.stats import KVStats, Layout, Moments

    width, layers = layout.src_width, layout.src_layers
    out = KVStats.__new__(KVStats)
    key_blocks, value_blocks = VARIANTS[variant]
    out.layout = Layout(layers * len(key_blocks), width, layout.dst_layers, layout.dst_width)
    q = layout.dst_layers * layout.dst_width
    for name, blocks, ycols in (("k", key_blocks, slice(0, q)), ("v", value_blocks, slice(q, 2 * q))):
        cols = torch.cat([torch.arange(layers * width) + BLOCKS.index(b) * layers * width for b in blocks])
        part = Moments.__new__(Moments)
        part.n, part.weight_sum = moments.n, moments.weight_sum
        part.mean_x, part.mean_y = moments.mean_x[cols], moments.mean_y[ycols]
        part.cxx = moments.cxx[cols][:, cols]
        part.cxy = moments.cxy[cols][:, ycols]
        part.syy = moments.syy[ycols]
        setattr(out, name, part)
    return out


def summary(solution, width: int) -> dict:
    def mean(values):
        return round(sum(values) / len(values), 4)

    layers = solution.layers
    return {
        "r2_k_mean": mean([l.r2_k for l in layers]),
        "r2_v_mean": mean([l.r2_v for l in layers]),
        "r2_k_min": round(min(l.r2_k for l in layers), 4),
        "r2_v_min": round(min(l.r2_v for l in layers), 4),
        "train_r2_k_mean": mean([l.train_r2_k for l in layers]),
        "train_r2_v_mean": mean([l.train_r2_v for l in layers]),
        "features_mean": mean([len(l.sources) * width for l in layers]),
        "k_per_layer": [len(l.sources) for l in layers],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", default=SRC)
    parser.add_argument("--dst", default=DST)
    parser.add_argument("--calib", default="mixed")
    parser.add_argument("--samples", type=int, default=64, help="training sequences [kvhub fit's default]")
    parser.add_argument("--heldout", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--grid", default=None, help="k (blocks per target layer) candidates, comma-separated [kvhub fit's]"
    )
    parser.add_argument(
        "--moments", type=Path, default=None, help="save the pass's moments here; reuse them if present"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from kvhub.core.rope import Rotary
    from kvhub.core.solve import TOP_K_GRID, Structure, solve
    from kvhub.core.stats import Moments
    from kvhub.fitting.fit import capture_pair, layout_for
    from kvhub.fitting.job import FitRequest, prepare
    from kvhub.fitting.options import FitOptions

    request = FitRequest(
        src=args.src,
        dst=args.dst,
        calib=args.calib,
        samples=args.samples,
        dtype=args.dtype,
        options=FitOptions(batch_size=args.batch_size),
    )
    fit = prepare(request, notify=print)
    fit.heldout = fit.heldout[: args.heldout]
    options = fit.options
    layout = layout_for(fit.source.config, fit.target.config)
    rotaries = (Rotary.from_model(fit.source), Rotary.from_model(fit.target))
    p = len(BLOCKS) * layout.src_layers * layout.src_width
    q = 2 * layout.dst_layers * layout.dst_width
    grid = TOP_K_GRID if args.grid is None else tuple(int(k) for k in args.grid.split(","))
    started = time.perf_counter()
    reused = args.moments is not None and args.moments.exists()
    if reused:
        saved = torch.load(args.moments)
        moments = {split: Moments.from_state_dict(saved, f"{split}.") for split in ("train", "heldout")}
    else:
        moments = {split: Moments(p, q) for split in ("train", "heldout")}
        for split, ids in (("heldout", fit.heldout), ("train", fit.train)):
            for first in range(0, ids.shape[0], args.batch_size):
                batch = ids[first : first + args.batch_size]
                src, dst = capture_pair(fit.source, fit.target, batch, rotaries, options)
                moments[split].update(*shifted_rows(src, dst, batch.shape[0]))
                seconds = time.perf_counter() - started
                print(f"{split}: {first + batch.shape[0]}/{ids.shape[0]} sequences, {seconds:.0f} s", flush=True)
        if args.moments is not None:
            torch.save(
                {**moments["train"].state_dict("train."), **moments["heldout"].state_dict("heldout.")}, args.moments
            )
    report = {
        "command": "python benchmarks/v_features.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "src": fit.source_id,
        "dst": fit.target_id,
        "calibration": {k: fit.calibration.get(k) for k in ("name", "version", "content_hash", "seq_len", "stride")},
        "train_sequences": int(fit.train.shape[0]),
        "heldout_sequences": int(fit.heldout.shape[0]),
        "train_rows": moments["train"].n,
        "heldout_rows": moments["heldout"].n,
        "dtype": args.dtype,
        "forward_s": None if reused else round(time.perf_counter() - started, 1),  # None: moments read from --moments
        "top_k_grid": list(grid),
        "variants": {},
    }
    for variant in args.variants.split(","):
        solve_started = time.perf_counter()
        train = variant_stats(moments["train"], layout, variant)
        heldout = variant_stats(moments["heldout"], layout, variant)
        solution = solve(train, heldout, structure=Structure(), top_k_grid=grid)
        row = {**summary(solution, layout.src_width), "solve_s": round(time.perf_counter() - solve_started, 1)}
        report["variants"][variant] = row
        print(variant, json.dumps({k: v for k, v in row.items() if k != "k_per_layer"}), flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
