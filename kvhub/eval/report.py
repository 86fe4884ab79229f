"""``kvhub report``'s folder: the R² figures of a version's maps, the retention chart of its stored task
results, its stored curves against the recompute budget and context tokens (:mod:`kvhub.eval.curves`) and a
markdown summary (figures need matplotlib: pip install 'kvhub[plots]')."""

from __future__ import annotations

from pathlib import Path

_CONDITIONS = ("acc_own", "acc_mapped", "acc_source", "acc_control", "retention")


def task_results(metrics: list[dict]) -> dict[str, dict]:
    """Latest value per (task, name) of the stored accuracy metrics (``metrics`` oldest first, as the store
    gives them), with intervals and the newest run's n, as retention_chart wants (perplexity and timing
    rows left out: :func:`write_report` lists every evaluation as the card does)."""
    tasks: dict[str, dict] = {}
    for metric in metrics:
        task = metric.get("task")
        if not task or task.startswith("ppl") or task.startswith("bench:"):
            continue
        entry = tasks.setdefault(task, {})
        entry[metric["name"]] = metric["value"]
        entry["n"] = metric.get("n")  # the newest run's: what show and the card report
    for entry in tasks.values():
        for name in _CONDITIONS:
            if f"{name}_ci_low" in entry and f"{name}_ci_high" in entry:
                entry[f"{name}_ci"] = [entry[f"{name}_ci_low"], entry[f"{name}_ci_high"]]
    return {t: e for t, e in tasks.items() if "acc_own" in e and "acc_mapped" in e}


def write_report(out: Path, *, reference: str, version, metadata: dict, tasks: dict, measurements=()) -> Path:
    """Write r2_heatmap.png, layer_r2.png, retention.png (when there are task results), budget.png and
    speedup.png (when their curves have two points; else report.md names the command that measures them) and
    report.md to the folder ``out`` (which exists); returns report.md.  ``measurements``: the store's metrics of
    the version, oldest first, whose newest evaluations report.md lists as the model card does (perplexity
    included).  Every figure's title names the mapper and its version."""
    from kvhub.eval.plots import compressed_structure, layer_r2, mapper_name, r2_heatmap, retention_chart
    from kvhub.hub.evaluations import evaluations_table, latest

    name = f"{mapper_name(metadata)} v{version.version}"
    r2_heatmap(metadata, out / "r2_heatmap.png", name=name)
    layer_r2(metadata, out / "layer_r2.png", name=name)
    metrics = metadata.get("metrics", {})
    structure = compressed_structure(metadata)
    lines = [
        f"# {reference}",
        "",
        f"- source: {version.source}",
        f"- target: {version.target}",
        f"- calibration: {version.calibration}",
        f"- maps: {structure or 'dense, full rank'}",
        "",
        f"Held-out R² of the stored maps (mean over target layers): K "
        f"{metrics.get('heldout_r2_k_mean', float('nan')):.3f}, "
        f"V {metrics.get('heldout_r2_v_mean', float('nan')):.3f}.",
        "",
        "![per-layer R²](layer_r2.png)",
        "",
        "The probe below (full-rank maps from one source layer) chose the source layers"
        + (f"; it is not the R² of these {structure} maps." if structure else "."),
        "",
        "![R² heatmap](r2_heatmap.png)",
        "",
    ]
    if tasks:
        retention_chart(tasks, out / "retention.png", name=name)
        lines += _task_table(tasks) + ["", "![retention](retention.png)"]
    lines += _curves(out, reference=reference, measurements=measurements, name=name)
    every = evaluations_table(latest(measurements))
    if every:
        lines += ["", "## Every evaluation", every.strip()]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _task_table(tasks: dict) -> list[str]:
    lines = ["| task | n | own | mapped | source | retention [95% CI] |", "| --- | --- | --- | --- | --- | --- |"]
    for task, r in sorted(tasks.items()):
        low, high = r.get("retention_ci", [float("nan")] * 2)
        lines.append(
            f"| {task} | {r.get('n', '')} | {r['acc_own']:.3f} | {r['acc_mapped']:.3f} | "
            f"{r.get('acc_source', float('nan')):.3f} | {r.get('retention', float('nan')):.3f} "
            f"[{low:.2f}, {high:.2f}] |"
        )
    return lines


def _curves(out: Path, *, reference: str, measurements, name: str) -> list[str]:
    """Draw budget.png and speedup.png where their curves have two points; report.md's lines about them."""
    from kvhub.eval import curves, plots

    budget = curves.budget_curves(measurements)
    lengths = curves.length_curves(measurements)
    lines = ["", "## Curves"]
    if budget:
        plots.budget_chart(
            budget,
            out / "budget.png",
            name=name,
            title="handoff (map + recompute) and drop (the recompute alone) against the recompute budget",
            xlabel="recompute budget (% of the context)",
        )
        lines += [
            "",
            "What the handoff keeps against the recompute budget (`kvhub eval --exact-budget`), and drop (the "
            "recomputed tokens alone) at the same budget: retention for multiple choice, else the task's own measure.",
            "",
            "![recompute budget](budget.png)",
        ]
    if lengths:
        plots.speedup_chart(lengths, out / "speedup.png", name=name)
        lines += [
            "",
            "The handoff's time-to-first-token gain over a full prefill, and transfer() against the target "
            "re-prefilling, against context tokens (`kvhub bench --lengths`).",
            "",
            "![speedup](speedup.png)",
        ]
    hints = curves.hints(reference, measurements, budget=budget, lengths=lengths)
    return lines + [""] + [f"- {hint}" for hint in hints] if hints else lines
