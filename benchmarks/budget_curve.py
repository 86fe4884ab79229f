"""The budget curve: the gist suite and the aggregation tasks against the recomputed share of the context, for the
handoff (map + recompute) and for drop (the target prefills only the same positions, nothing mapped), in one run.

    python benchmarks/budget_curve.py --mapper REF --context-tokens 1024 --limit 6 \\
        --out docs/results/budget_curve_1k.json          # + .md (the table) and .png (the plot) beside it

Every share is one recompute variant of the ONE evaluation loop (:func:`kvhub.eval.run.evaluate`, as ``kvhub eval``
runs it), all scored on the same items: share 0 is the map alone; a share s > 0 is the default handoff's shape
(the first 4 and last 16 tokens exact, spans chosen by the source's attention) with ``exact_budget`` = s minus the
20 exact tokens' share, so about s of the context is recomputed in all.  ``drop`` is scored inside each variant
at exactly the positions the handoff recomputed.  Per task and share: gist (pooled over the domains, each domain,
and pooled by generation) the gap closed by handoff and drop, with handoff - drop paired over items; aggregation:
exact-match accuracy, the same differences; the recomputed share measured where the task reports it.  Each item's
scores are cached as ``kvhub eval`` caches them (keyed on the mapper's tensors, the spec, dtype and device), so a
killed run resumes, and a run at a larger ``--limit`` scores only the new items.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

SHARES = (0.0, 0.05, 0.10, 0.20, 0.30)
TASKS = ("gist", "agg-count", "agg-mode", "agg-total", "agg-order")
EXACT_PREFIX, EXACT_SUFFIX = 4, 16


def share_variant(share: float, context_tokens: int):
    """The recompute variant of ``share``: the map alone at 0, else 4 + 16 exact tokens and the rest selected."""
    from kvhub.serving.spec import Recompute

    if share <= 0:
        return Recompute()
    budget = max(0.0, share - (EXACT_PREFIX + EXACT_SUFFIX) / context_tokens)
    return Recompute(EXACT_PREFIX, EXACT_SUFFIX, round(budget, 4), "source")


def run_curve(loaded, *, tasks=TASKS, shares=SHARES, context_tokens=1024, limit=6, seed=0, task_items=None) -> dict:
    """``{"results": kvhub eval's results by task@variant, "curve": task -> points}`` over ``loaded`` (a
    :class:`kvhub.eval.run.LoadedVersion` or anything with mapper / source / target / tokenizer).  ``task_items``:
    task name -> items to use instead of built ones (tests)."""
    from kvhub.eval import run
    from kvhub.eval.conditions import library

    conditions = library(loaded)
    variant_of = {share: share_variant(share, context_tokens) for share in shares}
    task_list = run.build_tasks(tasks, conditions, limit=limit, seed=seed, context_tokens=(context_tokens,))
    for task in task_list:
        if task_items and task.task in task_items:
            task._items = task_items[task.task]
    version = getattr(loaded, "version", None)  # a registered version: its items are cached as kvhub eval's are
    parameter = next(loaded.target.parameters())
    settings = run.RunSettings(
        getattr(version, "tensors_sha256", None),
        getattr(loaded.mapper, "deshrink", None),
        seed=seed,
        limit=limit,
        dtype=str(parameter.dtype).removeprefix("torch."),
        device=str(parameter.device),
    )
    outcome = run.evaluate(task_list, list(variant_of.values()), settings=settings)
    curve = {}
    for task in task_list:
        for share, variant in variant_of.items():
            label = settings.label(variant.name())
            summary = outcome.results[f"{task.name}@{label}" if label else task.name]
            for name, point in points(task.name, summary):
                curve.setdefault(name, []).append({"share": share, "variant": variant.name(), **point})
    return {"results": outcome.results, "datasets": outcome.datasets, "curve": curve}


def points(name: str, summary: dict):
    """(row name, point) per row of one summary: the gist pooled, each domain and the keyed answers; or accuracy."""
    if "gap_closed_mapped" in summary:
        yield name, _gist_point(summary)
        if "gen_gap_closed_mapped" in summary:  # the same items scored by generation (ROUGE-L against own)
            yield f"{name}:generation", _gist_point(summary, "gen_gap_closed")
        if "judge_gap_closed_mapped" in summary:  # ... and by the judge (kvhub.eval.judge)
            yield f"{name}:judge", _gist_point(summary, "judge_gap_closed")
        for domain, inner in (summary.get("domains") or {}).items():
            yield f"{name}:{domain}", _gist_point(inner)
        if summary.get("key_n"):
            yield f"{name}:keyed", _pair(summary, "key_mapped", "key_drop", "key_map_minus_drop", "key_own", "exact")
        return
    point = _pair(summary, "acc_mapped", "acc_drop", "map_minus_drop", "acc_own", "exact")
    point["recomputed"] = summary.get("recomputed_fraction")
    yield name, point


def _gist_point(summary: dict, prefix: str = "gap_closed") -> dict:
    from kvhub.eval.curves import SCORED_BY

    metric = SCORED_BY[prefix.removesuffix("gap_closed")][1] if prefix != "gap_closed" else "gap closed"
    point = _pair(summary, f"{prefix}_mapped", f"{prefix}_drop", f"{prefix}_map_minus_drop", None, metric)
    point["best_control"] = summary[f"{prefix}_mapped"] - summary.get(f"{prefix}_map_minus_controls", float("nan"))
    return point


def _pair(summary: dict, handoff: str, drop: str, difference: str, own: str | None, metric: str) -> dict:
    return {
        "n": summary.get("key_n") if handoff.startswith("key_") else summary["n"],
        "metric": metric,
        "own": 1.0 if own is None else summary[own],
        "handoff": summary[handoff],
        "handoff_ci": summary.get(f"{handoff}_ci"),
        "drop": summary[drop],
        "drop_ci": summary.get(f"{drop}_ci"),
        "difference": summary[difference],
        "difference_ci": summary.get(f"{difference}_ci"),
    }


def table(curve: dict) -> str:
    """The curve as a markdown table: a row per task and share."""
    rows = [
        "| task | n | share | own | handoff | drop | handoff - drop [95% CI] | best control | measured share |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, pts in curve.items():
        for p in pts:
            low, high = p["difference_ci"] or [float("nan")] * 2
            control = f"{p['best_control']:.2f}" if "best_control" in p else ""
            measured = f"{100 * p['recomputed']:.1f}%" if p.get("recomputed") is not None else ""
            rows.append(
                f"| {name} | {p['n']} | {100 * p['share']:.0f}% | {p['own']:.2f} | {p['handoff']:.2f} | {p['drop']:.2f} "
                f"| {p['difference']:+.2f} [{low:+.2f}, {high:+.2f}] | {control} | {measured} |"
            )
    return "\n".join(rows) + "\n"


def write(report: dict, out: Path, *, plot: bool = True) -> list[Path]:
    """``out`` (JSON), ``out`` with .md (the table) and, where matplotlib is installed, .png (the plot)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, sort_keys=True, default=str) + "\n")
    written = [out, out.with_suffix(".md")]
    written[1].write_text(table(report["curve"]))
    if plot:
        from kvhub.eval.plots import budget_chart

        pooled = {
            k: v for k, v in report["curve"].items() if ":" not in k or k.endswith((":keyed", ":generation", ":judge"))
        }
        written.append(budget_chart(pooled, out.with_suffix(".png")))
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mapper", required=True, help="a store reference (kvhub list)")
    parser.add_argument("--db", default=None)
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--limit", type=int, default=6, help="items per gist domain and per aggregation task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--shares", default=",".join(str(s) for s in SHARES))
    parser.add_argument("--dtype", default=None, help="default: bfloat16 where the CPU has it natively, else float32")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from kvhub.dtypes import default_dtype
    from kvhub.eval.run import load_version
    from kvhub.store import open_store

    dtype = args.dtype or default_dtype("cpu")[0]
    with open_store(args.db) as store:
        loaded = load_version(store, args.mapper, device="cpu", dtype=dtype)
        report = run_curve(
            loaded,
            tasks=tuple(args.tasks.split(",")),
            shares=tuple(float(s) for s in args.shares.split(",")),
            context_tokens=args.context_tokens,
            limit=args.limit,
            seed=args.seed,
        )
    report["config"] = {
        "mapper": args.mapper,
        "source": loaded.version.source,
        "target": loaded.version.target,
        "calibration": loaded.version.calibration,
        "context_tokens": args.context_tokens,
        "limit": args.limit,
        "seed": args.seed,
        "dtype": dtype,
        "machine": f"{platform.machine()}, {platform.processor() or platform.platform()}",
    }
    for path in write(report, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
