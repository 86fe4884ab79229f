"""Domain-transfer matrix: fit on each calibration domain, evaluate on held-out text of every domain.

    python benchmarks/domain_matrix.py --domains legal-docs,code,chat,general --samples 16 \
        --out docs/results/domain_matrix.json

One capture pass per domain gives its train and held-out statistics (cached under
~/.cache/kvhub/bench/stats/); every (fit domain, eval domain) held-out R^2 then comes from the
statistics alone (kvhub.core.solve.map_r2), and next-token agreement / KL from a few held-out sequences
of each eval domain (kvhub.eval.continuation.continuation_metrics).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SRC = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
DST = "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def domain_stats(domain, source, target, tok, source_id, args, cache: Path):
    """(train KVStats, heldout KVStats, calibration set) of one domain, cached on disk."""
    from safetensors.torch import load_file, save_file

    from kvhub.calib import resolve_calibration
    from kvhub.fitting.fit import accumulate
    from kvhub.fitting.options import FitOptions
    from kvhub.core.stats import KVStats

    calibration = resolve_calibration(
        domain, tokenizer=tok, tokenizer_id=source_id, samples=args.samples, seq_len=args.seq_len
    )
    weighting = getattr(args, "weighting", "uniform")
    suffix = "" if weighting == "uniform" else f"-{weighting}"
    path = cache / f"{domain}-{calibration.content_hash[:16]}-s{args.stride}{suffix}.safetensors"
    if path.is_file():
        state = load_file(str(path))
        split = lambda p: KVStats.from_state_dict({k[len(p) :]: v for k, v in state.items() if k.startswith(p)})  # noqa: E731
        return split("train."), split("heldout."), calibration
    options = FitOptions(stride=args.stride, batch_size=4, weighting=weighting)
    train, heldout = accumulate(
        source, target, calibration.train, calibration.heldout, options=options, progress=None, job="domain-matrix"
    )
    cache.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"{p}{k}": v.contiguous()
        for p, s in (("train.", train), ("heldout.", heldout))
        for k, v in s.state_dict().items()
    }
    save_file(tensors, str(path))
    return train, heldout, calibration


def write_report(path: Path | None, report: dict) -> None:
    """Write a benchmark's JSON report (when --out was given)."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")


def mean_r2(solution, stats) -> tuple[float, float]:
    from kvhub.core.solve import map_r2

    layout = stats.layout
    k_scores, v_scores = [], []
    for layer in solution.layers:
        cols, ycols = layout.src_columns(layer.sources), layout.dst_columns(layer.target)
        shape = (len(layer.sources), layout.src_width)
        k_scores.append(map_r2(stats.k, cols, ycols, layer.k_map, *shape))
        v_scores.append(map_r2(stats.v, cols, ycols, layer.v_map, *shape))
    return sum(k_scores) / len(k_scores), sum(v_scores) / len(v_scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domains", default="legal-docs,code,chat,general")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--stride", type=int, default=4)
    parser.add_argument("--agreement-sequences", type=int, default=2)
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from kvhub.eval.continuation import continuation_metrics
    from kvhub.calib.corpus import cache_root
    from kvhub.fitting.fit import build_mapper, pair_fingerprints
    from kvhub.fitting.options import FitOptions
    from kvhub.models.loading import load_model
    from kvhub.core.solve import solve

    source, tok, source_id = load_model(SRC, dtype="bfloat16")
    target, _, target_id = load_model(DST, dtype="bfloat16")
    domains = args.domains.split(",")
    cache = cache_root() / "bench" / "stats"
    stats = {}
    for domain in domains:
        started = time.perf_counter()
        stats[domain] = domain_stats(domain, source, target, tok, source_id, args, cache)
        print(f"{domain}: statistics in {time.perf_counter() - started:.0f} s", flush=True)
    fps = pair_fingerprints(source, target, source_id=source_id, target_id=target_id)
    report = {"command": " ".join(sys.argv), "samples": args.samples, "seq_len": args.seq_len, "rows": []}
    report["fixed_vs_auto"] = []
    for fit_domain in domains:
        train, heldout, calibration = stats[fit_domain]
        solution = solve(train, heldout)
        fixed = solve(train, heldout, top_k=4, ridge_lambda=0.01)  # the paper's lambda, a mid-size k
        row = {
            "fit": fit_domain,
            "auto": mean_r2(solution, heldout),
            "k4_lambda0.01": mean_r2(fixed, heldout),
            "auto_k": [len(l.sources) for l in solution.layers],
        }
        report["fixed_vs_auto"].append(row)
        print(json.dumps(row), flush=True)
        mapper = build_mapper(solution, *fps, calibration.to_metadata(), train, heldout, FitOptions(stride=args.stride))
        for eval_domain in domains:
            r2_k, r2_v = mean_r2(solution, stats[eval_domain][1])
            held = stats[eval_domain][2].heldout[: args.agreement_sequences]
            cont = continuation_metrics(mapper, source, target, held, context_len=args.context_len)
            row = {"fit": fit_domain, "eval": eval_domain, "r2_k": r2_k, "r2_v": r2_v, **cont.as_dict()}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
