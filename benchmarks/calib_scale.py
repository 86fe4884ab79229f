"""Calibration size: held-out R^2 (and, optionally, mappers for the gist) at several sizes, from one pass.

    python benchmarks/calib_scale.py --calib mixed --sizes 16,32,64,128 --dtype float32 \
        --artifacts /tmp/calib_scale --out docs/results/calib_scale.json

One capture pass over the largest size's sequences: the held-out split first (the same --heldout
sequences score every size, 16 by default as for ``kvhub fit``'s 64), then the training sequences in order; when the training statistics
hold the first n sequences for n in --sizes, they are solved exactly as ``kvhub fit`` solves them
(k and lambda chosen per layer on held-out R^2) and the size's row is written: held-out R^2 (mean and
min over the target layers, K and V), the training tokens and the forward seconds it took to get
there (the fit time that size costs on this machine).  With --artifacts each size's mapper is saved
there (``<dir>/n<size>``) for ``benchmarks/gist_levers.py --mapper``.  The report is rewritten after
each size, so a run stopped early keeps what it measured.

The sizes are prefixes of one draw of the largest size (``kvhub fit --samples N`` draws its own N
sequences), so the rows differ only in how many of the same sequences the solve saw.

With --map mlp the pass also keeps every row (:mod:`kvhub.fitting.samples`: 80 KB a row for the Qwen
0.5B -> 1.5B pair, 2.6 GB at 64 sequences of 512), and at each size the residual MLPs are trained on that
size's rows on top of that size's ridge maps, as ``kvhub fit --map mlp --mlp-tokens <all rows>`` trains
them, stopping early on the first half of the held-out sequences: the row adds the MLP maps' held-out R^2
and the ridge maps' on those rows (what ``kvhub fit`` reports, chosen on them) and on the other half, which
neither training nor stopping saw (``*_unseen``), the gains and the training seconds.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time
from pathlib import Path

SRC = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
DST = "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def parse_sizes(text: str) -> list[int]:
    sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"--sizes needs positive sequence counts, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", default=SRC)
    parser.add_argument("--dst", default=DST)
    parser.add_argument("--calib", default="mixed")
    parser.add_argument("--sizes", default="16,32,64,128", help="training sequence counts, comma-separated")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence [the recipe's]")
    parser.add_argument("--stride", type=int, default=None, help="token stride [the recipe's]")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--heldout",
        type=int,
        default=16,
        help="held-out sequences scoring every size (the recipe draws more for a larger size)",
    )
    parser.add_argument(
        "--map",
        dest="map_kind",
        choices=("ridge", "mlp"),
        default="ridge",
        help="mlp: also train the residual MLPs at each size (module docstring)",
    )
    parser.add_argument("--mlp-epochs", type=int, default=None, help="--map mlp: most epochs per MLP [kvhub fit's]")
    parser.add_argument("--artifacts", type=Path, default=None, help="save each size's mapper under DIR/n<size>")
    parser.add_argument("--out", type=Path, default=None, help="JSON report")
    args = parser.parse_args(argv)
    sizes = parse_sizes(args.sizes)

    from kvhub.core.rope import Rotary
    from kvhub.core.solve import Structure, solve
    from kvhub.core.stats import KVStats
    from kvhub.fitting.fit import build_mapper, capture_pair, layout_for, pair_fingerprints
    from kvhub.fitting.samples import reservoirs
    from kvhub.fitting.job import FitRequest, prepare
    from kvhub.fitting.options import FitOptions

    request = FitRequest(
        src=args.src,
        dst=args.dst,
        calib=args.calib,
        samples=sizes[-1],
        seq_len=args.seq_len,
        device=args.device,
        dtype=args.dtype,
        options=FitOptions(stride=args.stride, batch_size=args.batch_size),
    )
    fit = prepare(request, notify=print)
    fit.heldout = fit.heldout[: args.heldout]
    mlp_knobs = {} if args.mlp_epochs is None else {"mlp_epochs": args.mlp_epochs}
    options = dataclasses.replace(fit.options, map_kind=args.map_kind, checkpoint=None, **mlp_knobs)
    source_fp, target_fp = pair_fingerprints(
        fit.source,
        fit.target,
        source_id=fit.source_id,
        target_id=fit.target_id,
        source_tokenizer=fit.source_tokenizer,
        target_tokenizer=fit.target_tokenizer,
    )
    layout = layout_for(fit.source.config, fit.target.config)
    rotaries = (Rotary.from_model(fit.source), Rotary.from_model(fit.target))
    train, heldout = KVStats(layout), KVStats(layout)
    kept = None
    if args.map_kind == "mlp":  # every row of both splits: a size's rows are a prefix of the training rows
        splits = {"train": fit.train[: sizes[-1]], "heldout": fit.heldout}
        every = max(int(ids.numel()) for ids in splits.values())
        kept = reservoirs(layout, splits, capacity=every, stride=options.stride, skip_first=options.skip_first)
    report = {
        "src": fit.source_id,
        "dst": fit.target_id,
        "calibration": fit.calibration,
        "heldout_sequences": int(fit.heldout.shape[0]),
        "seq_len": int(fit.train.shape[1]),
        "stride": options.stride,
        "dtype": args.dtype,
        "threads": _threads(),
        "map": args.map_kind,
        "sizes": [],
    }

    def merge(stats: KVStats, ids, split: str, first: int) -> None:
        src, dst = capture_pair(fit.source, fit.target, ids, rotaries, options)
        stats.update(src.keys, src.values, dst.keys, dst.values)
        if kept is not None:
            kept[split].add(first, src, dst)

    started = time.perf_counter()
    for first in range(0, fit.heldout.shape[0], args.batch_size):
        merge(heldout, fit.heldout[first : first + args.batch_size], "heldout", first)
    report["heldout_forward_s"] = round(time.perf_counter() - started, 1)
    print(f"held-out: {fit.heldout.shape[0]} sequences in {report['heldout_forward_s']} s", flush=True)

    done, train_s = 0, 0.0
    for size in sizes:
        started = time.perf_counter()
        for first in range(done, size, args.batch_size):
            merge(train, fit.train[first : min(first + args.batch_size, size)], "train", first)
        done, train_s = size, train_s + time.perf_counter() - started
        solve_started = time.perf_counter()
        solution = solve(train, heldout, structure=Structure())
        solve_s = time.perf_counter() - solve_started
        row = {
            "sequences": size,
            "train_tokens": train.n,
            "forward_s": round(train_s, 1),
            "solve_s": round(solve_s, 1),
            **_r2(solution),
        }
        mapper = build_mapper(
            solution, source_fp, target_fp, {**fit.calibration, "samples": size}, train, heldout, options
        )
        if kept is not None:
            device = next(fit.source.parameters()).device
            mapper = _with_mlps(mapper, solution, kept, size, layout, options, row, device=device)
        if args.artifacts is not None:
            row["artifact"] = str(mapper.save(args.artifacts / f"n{size}", overwrite=True))
        report["sizes"].append(row)
        print(json.dumps(row), flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _with_mlps(mapper, solution, kept: dict, size: int, layout, options, row: dict, *, device):
    """``mapper`` with residual MLPs trained on the first ``size`` sequences' rows, stopping early on the first
    half of the held-out sequences; into ``row``: their R^2 there and the ridge maps' (``mlp_r2_*``,
    ``mlp_ridge_r2_*``: what ``kvhub fit`` reports, the rows early stopping chose on), the same on the other half,
    which neither training nor stopping saw (``*_unseen``), and the training time."""
    from kvhub.fitting import mlp_fit

    half = kept["heldout"].size // kept["heldout"].rows_per_sequence // 2
    unseen = _rows(kept["heldout"], half, None)
    samples = {"train": _rows(kept["train"], 0, size), "heldout": _rows(kept["heldout"], 0, half)}
    started = time.perf_counter()
    trained = mlp_fit.train_maps(solution, samples, layout, options, job=f"calib_scale:{size}", device=device)
    options.timings["mlp_s"] = time.perf_counter() - started
    mapper = mlp_fit.with_mlps(mapper, trained, samples, options)
    metrics = mapper.metadata["metrics"]
    for kind in ("k", "v"):
        row[f"mlp_r2_{kind}_mean"] = round(metrics[f"heldout_r2_{kind}_mean"], 4)
        row[f"mlp_ridge_r2_{kind}_mean"] = round(metrics[f"ridge_heldout_r2_{kind}_mean"], 4)
        row[f"mlp_gain_{kind}"] = round(
            metrics[f"heldout_r2_{kind}_mean"] - metrics[f"ridge_heldout_r2_{kind}_mean"], 4
        )
        best = [layer[f"mlp_best_epoch_{kind}"] for layer in mapper.metadata["layers"]]
        row[f"mlp_layers_improved_{kind}"] = sum(epoch > 0 for epoch in best)
        ridge, mlp = _unseen_r2(solution, trained, unseen, layout, kind, mlp_fit.schedule_of(options).activation)
        row[f"mlp_r2_{kind}_unseen"], row[f"mlp_ridge_r2_{kind}_unseen"] = round(mlp, 4), round(ridge, 4)
        row[f"mlp_gain_{kind}_unseen"] = round(mlp - ridge, 4)
    row["mlp_train_rows"] = samples["train"].size
    row["mlp_stop_rows"], row["mlp_unseen_rows"] = samples["heldout"].size, unseen.size
    row["mlp_s"] = round(options.timings["mlp_s"], 1)
    return mapper


def _unseen_r2(solution, trained: dict, rows, layout, kind: str, activation: str) -> tuple[float, float]:
    """Mean over target layers of the pooled R^2 on ``rows`` of the ridge map and of the MLP map (ridge + r)."""
    from kvhub.core.mlp import residual
    from kvhub.fitting.mlp_fit import map_rows

    ridge, mlp = [], []
    for layer in solution.layers:
        x, y, base = map_rows(layer, kind, rows, layout)
        total = float((y - y.mean(0)).double().square().sum())
        fitted = base + residual([x], trained[layer.target][kind].layers, activation)
        ridge.append(1 - float((y - base).double().square().sum()) / total)
        mlp.append(1 - float((y - fitted).double().square().sum()) / total)
    return sum(ridge) / len(ridge), sum(mlp) / len(mlp)


def _rows(reservoir, first: int, last: int | None):
    """The rows of a full reservoir's sequences ``first`` .. ``last`` - 1 (None: to the end), as a view."""
    per = reservoir.rows_per_sequence
    view = copy.copy(reservoir)
    view.rows = reservoir.rows[first * per : None if last is None else last * per]
    view.tensors = {
        name: t[first * per : None if last is None else last * per] for name, t in reservoir.tensors.items()
    }
    return view


def _r2(solution) -> dict:
    keys = [layer.r2_k for layer in solution.layers]
    values = [layer.r2_v for layer in solution.layers]
    return {
        "r2_k_mean": round(sum(keys) / len(keys), 4),
        "r2_v_mean": round(sum(values) / len(values), 4),
        "r2_k_min": round(min(keys), 4),
        "r2_v_min": round(min(values), 4),
        "train_r2_v_mean": round(sum(layer.train_r2_v for layer in solution.layers) / len(values), 4),
        "k_chosen": sorted({len(layer.sources) for layer in solution.layers}),
    }


def _threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    raise SystemExit(main())
