"""Quality levers of the solve, side by side on one calibration set's statistics (issue 6).

    python benchmarks/levers.py --calib general --samples 128 --out docs/results/levers_general.json \
        --save-dense ~/.cache/kvhub/bench/general-128

One capture pass (cached under ~/.cache/kvhub/bench/stats/, shared with domain_matrix.py) gives the
train and held-out statistics; every variant below is then only a solve:

- ``dense, k <= 16``: the per-layer k/lambda search over the grid used until now (k up to 16);
- ``dense``: the current grid (k up to 24 for a 24-layer source);
- ``head-local``: block-diagonal over KV head groups;
- ``rank r``: reduced-rank ridge per target layer.

For each: held-out R^2 (K, V), parameters and artifact MB, transfer time at --tokens (bf16, median of
--repeats, kvhub.eval.continuation.time_transfer_vs_prefill: interleaved with the target's re-prefill), and
next-token agreement / KL / perplexity on --eval-sequences held-out sequences.  With
``--weighting attention`` the statistics (both splits) weigh tokens by the target's attention, so its
held-out R^2 is attention-weighted: compare such runs by agreement / KL / perplexity, not by R^2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from domain_matrix import DST, SRC, domain_stats, mean_r2, write_report


def variants(k_grid_old):
    from kvhub.core.solve import TOP_K_GRID, Structure

    return [
        ("dense, k <= 16", {"top_k_grid": k_grid_old}),
        ("dense", {"top_k_grid": TOP_K_GRID}),
        ("head-local", {"structure": Structure(groups=2)}),
        ("rank 128", {"structure": Structure(rank=128)}),
        ("rank 64", {"structure": Structure(rank=64)}),
        ("rank 32", {"structure": Structure(rank=32)}),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calib", default="general")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--stride", type=int, default=4)
    parser.add_argument("--eval-sequences", type=int, default=4)
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", help="comma-separated variant names to run (default: all)")
    parser.add_argument(
        "--weighting",
        default="uniform",
        choices=["uniform", "attention"],
        help="token weights of the statistics (attention: by the target's attention)",
    )
    parser.add_argument("--save-dense", type=Path, help="also save the 'dense' mapper here (to import and eval)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from kvhub.eval.continuation import continuation_metrics, time_transfer_vs_prefill
    from kvhub.calib.corpus import cache_root
    from kvhub.fitting.fit import build_mapper, pair_fingerprints
    from kvhub.fitting.options import FitOptions
    from kvhub.artifact import TENSORS_FILE
    from kvhub.core.mapper import Mapper
    from kvhub.models.loading import load_model
    from kvhub.core.solve import solve

    source, tok, source_id = load_model(SRC, dtype="bfloat16")
    target, target_tok, target_id = load_model(DST, dtype="bfloat16")
    cache = cache_root() / "bench" / "stats"
    started = time.perf_counter()
    train, heldout, calibration = domain_stats(args.calib, source, target, tok, source_id, args, cache)
    print(
        f"statistics: {time.perf_counter() - started:.0f} s ({train.n} train / {heldout.n} held-out tokens)", flush=True
    )
    plain_heldout = heldout
    if args.weighting != "uniform":  # the same data unweighted, to score every variant by plain R^2 too
        plain = argparse.Namespace(**{**vars(args), "weighting": "uniform"})
        plain_heldout = domain_stats(args.calib, source, target, tok, source_id, plain, cache)[1]
    fps = pair_fingerprints(
        source, target, source_id=source_id, target_id=target_id, source_tokenizer=tok, target_tokenizer=target_tok
    )
    held = calibration.heldout[: args.eval_sequences]
    report = {
        "command": " ".join(sys.argv),
        "calib": args.calib,
        "samples": args.samples,
        "seq_len": args.seq_len,
        "weighting": args.weighting,
        "train_tokens": train.n,
        "heldout_tokens": heldout.n,
        "rows": [],
    }
    wanted = set(args.only.split(",")) if args.only else None
    for name, kwargs in variants((1, 2, 3, 4, 6, 8, 12, 16)):
        if wanted and name not in wanted:
            continue
        started = time.perf_counter()
        solution = solve(train, heldout, **kwargs)
        solve_s = time.perf_counter() - started
        options = FitOptions(stride=args.stride, weighting=args.weighting)
        options.timings["solve_s"] = solve_s
        mapper = build_mapper(solution, *fps, calibration.to_metadata(), train, heldout, options)
        with tempfile.TemporaryDirectory() as tmp:
            path = mapper.save(Path(tmp) / "m")
            size_mb = (path / TENSORS_FILE).stat().st_size / 1e6
            mapper = Mapper.load(path, dtype=torch.bfloat16)
            if name == "dense" and args.save_dense:
                mapper.save(args.save_dense, overwrite=True)
        r2_k, r2_v = mean_r2(solution, heldout)
        plain_r2 = mean_r2(solution, plain_heldout)
        cont = continuation_metrics(mapper, source, target, held, context_len=args.context_len)
        timing = time_transfer_vs_prefill(mapper, source, target, lengths=[args.tokens], repeats=args.repeats)[0]
        row = {
            "variant": name,
            "weighting": args.weighting,
            "r2_k": r2_k,
            "r2_v": r2_v,
            "r2_k_unweighted": plain_r2[0],
            "r2_v_unweighted": plain_r2[1],
            "parameters": mapper.num_parameters(),
            "artifact_mb": size_mb,
            "solve_s": solve_s,
            "k_per_layer": [len(l.sources) for l in solution.layers],
            **timing,
            **cont.as_dict(),
        }
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
