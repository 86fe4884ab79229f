"""Do de-shrunk maps (kvhub.core.deshrink, issue 24's gist lever) keep facts and task accuracy?  One ``kvhub eval``
task (facts at one length, or a multiple-choice task such as hellaswag), the same items and recompute
variant, with the registered mapper read as fitted and de-shrunk: ``kvhub eval --deshrink off`` and
``--deshrink kv`` side by side, in one report.

    python benchmarks/deshrink_facts.py --ref Qwen2.5-Coder-0.5B-Instruct:Qwen2.5-Coder-1.5B-Instruct:legal-docs@v1 \
        --context-tokens 1024 --limit 6 --dtype float32 --out docs/results/deshrink_facts_1k.json
    python benchmarks/deshrink_facts.py --ref ... --task hellaswag --variant "" --limit 100 --dtype float32 \
        --out docs/results/deshrink_hellaswag.json     # "": the map alone, as kvhub eval scores by default

Per-item results are cached as ``kvhub eval`` caches them (keyed on --deshrink too), so either command reuses them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvhub.eval import run
from kvhub.store import open_store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", required=True)
    parser.add_argument("--task", default="facts")
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--variant", default="handoff")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    variant_list = [run.parse_variant(args.variant)]
    report = {"command": " ".join(sys.argv), "results": {}}
    with open_store(None, create=False) as store:
        loaded = run.load_version(store, args.ref, dtype=args.dtype)
    plain = loaded.mapper
    for label, setting in (("as fitted", "off"), ("de-shrunk K and V", "kv")):
        loaded.mapper = plain.deshrunk(setting)
        settings = run.RunSettings(
            loaded.version.tensors_sha256, limit=args.limit, dtype=args.dtype, device=loaded.device, deshrink=setting
        )
        tasks = run.build_tasks([args.task], loaded, limit=args.limit, seed=0, context_tokens=(args.context_tokens,))
        outcome = run.evaluate(tasks, variant_list, settings=settings)
        report["results"][label] = outcome.results
        for name, summary in outcome.results.items():
            shown = {
                k: v
                for k, v in summary.items()
                if k.startswith("acc_") and not k.endswith("_ci") or k in ("retention", "recomputed_fraction")
            }
            print(f"{label:20s} {name}: " + " ".join(f"{k} {v:.3f}" for k, v in shown.items()), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
