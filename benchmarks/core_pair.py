"""Core benchmark on the real pair (Qwen2.5-Coder 0.5B -> 1.5B): fit quality, continuation quality,
transfer vs re-prefill, fit cost and fit memory at two calibration sizes.

    kvhub fetch models                           # once: fetch + convert the two models
    python benchmarks/core_pair.py --samples 128 --small-samples 32 --out docs/results/core_pair.json

Each fit runs in its own subprocess so its peak RSS (ru_maxrss) is the fit's alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from kvhub.fitting.options import auto_or

SRC = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
DST = "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def fit_once(args) -> dict:
    """Fit and save; print a JSON line with timings, metrics and this process's peak RSS."""
    import torch

    from kvhub.calib import resolve_calibration
    from kvhub.fitting.fit import fit
    from kvhub.fitting.options import FitOptions
    from kvhub.models.loading import load_model

    torch.manual_seed(0)
    source, tok, source_id = load_model(args.src, dtype="bfloat16")
    target, target_tok, target_id = load_model(args.dst, dtype="bfloat16")
    rss_models = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    calibration = resolve_calibration(
        args.calib, tokenizer=tok, tokenizer_id=source_id, samples=args.samples, seq_len=args.seq_len
    )
    options = FitOptions(top_k=args.k, ridge_lambda=args.lambda_, stride=args.stride, batch_size=args.batch_size)
    started = time.perf_counter()
    mapper = fit(
        source,
        target,
        calibration.train,
        calibration.heldout,
        source_id=source_id,
        target_id=target_id,
        source_tokenizer=tok,
        target_tokenizer=target_tok,
        calibration=calibration.to_metadata(),
        options=options,
    )
    wall = time.perf_counter() - started
    if args.artifact:
        mapper.save(args.artifact, overwrite=True)
    result = {
        "samples": calibration.train.shape[0],
        "heldout": calibration.heldout.shape[0],
        "seq_len": calibration.train.shape[1],
        "stride": args.stride,
        "fit_wall_s": wall,
        "timings": mapper.metadata["fit"]["timings"],
        "metrics": mapper.metadata["metrics"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "models_rss_mb": rss_models / 1024,
        "k_per_layer": [len(l["sources"]) for l in mapper.layers],
    }
    print("RESULT " + json.dumps(result), flush=True)
    return result


def run_fit_subprocess(args, samples: int, artifact: Path | None) -> dict:
    command = [
        sys.executable,
        __file__,
        "--fit-only",
        "--samples",
        str(samples),
        "--seq-len",
        str(args.seq_len),
        "--calib",
        args.calib,
        "--stride",
        str(args.stride),
        "--k",
        str(args.k),
        "--lambda",
        str(args.lambda_),
        "--batch-size",
        str(args.batch_size),
        "--src",
        args.src,
        "--dst",
        args.dst,
    ]
    if artifact:
        command += ["--artifact", str(artifact)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    line = next(l for l in output.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def evaluate(args, artifact: Path) -> dict:
    import torch

    from kvhub.calib import resolve_calibration
    from kvhub.eval.continuation import continuation_metrics, time_transfer_vs_prefill
    from kvhub.serving.spec import Recompute
    from kvhub.core.mapper import Mapper
    from kvhub.models.loading import load_model

    source, tok, source_id = load_model(args.src, dtype="bfloat16")
    target, _, _ = load_model(args.dst, dtype="bfloat16")
    mapper = Mapper.load(artifact, dtype=torch.bfloat16, compute_dtype=args.compute_dtype)
    calibration = resolve_calibration(
        args.calib, tokenizer=tok, tokenizer_id=source_id, samples=args.samples, seq_len=args.seq_len
    )
    held = calibration.heldout[: args.eval_sequences]
    result = {"continuation": {}, "timing": None, "compute_dtype": str(args.compute_dtype or "bfloat16")}
    for exact in sorted({0, args.exact_prefix}):
        metrics = continuation_metrics(
            mapper, source, target, held, context_len=args.context_len, recompute=Recompute(exact_prefix=exact)
        )
        result["continuation"][f"exact_prefix={exact}"] = metrics.as_dict()
        print(f"continuation exact_prefix={exact}: {metrics}", flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    result["timing"] = time_transfer_vs_prefill(mapper, source, target, lengths=lengths, repeats=args.repeats)
    for row in result["timing"]:
        print(f"timing {row}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", default=SRC)
    parser.add_argument("--dst", default=DST)
    parser.add_argument("--calib", default="legal-docs")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--small-samples", type=int, default=32, help="second fit size for the memory comparison")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--stride", type=int, default=4)
    parser.add_argument("--k", default="auto")
    parser.add_argument("--lambda", dest="lambda_", default="auto")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--eval-sequences", type=int, default=16)
    parser.add_argument("--exact-prefix", type=int, default=4)
    parser.add_argument("--lengths", default="256,1024,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--artifact", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--fit-only", action="store_true")
    parser.add_argument("--eval-only", action="store_true", help="reuse --artifact (or the default one); no fits")
    parser.add_argument("--compute-dtype", default=None, help="dtype of the mapping matmuls (default: bfloat16)")
    args = parser.parse_args()
    args.k, args.lambda_ = auto_or(args.k, int), auto_or(args.lambda_, float)
    if args.fit_only:
        fit_once(args)
        return
    from kvhub.calib.corpus import cache_root

    artifact = args.artifact or cache_root() / "bench" / f"core-{args.calib}-{args.samples}"
    report = {"command": " ".join(sys.argv), "src": args.src, "dst": args.dst, "calib": args.calib}
    if args.eval_only:
        report.update(evaluate(args, artifact))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")
        return
    if args.small_samples:
        report["fit_small"] = run_fit_subprocess(args, args.small_samples, None)
        print(f"fit small: {report['fit_small']}", flush=True)
    report["fit"] = run_fit_subprocess(args, args.samples, artifact)
    print(f"fit: {report['fit']}", flush=True)
    report.update(evaluate(args, artifact))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
