"""``kvhub eval``, ``kvhub bench``, ``kvhub report``: measure a registered mapper and keep the results."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from kvhub.cli.console import console, err_console

MC_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "lambada")
LONG_TASKS = ("facts", "multiturn", "code")  # kvhub.eval.longctx
TASKS = MC_TASKS + ("ppl",) + LONG_TASKS


def _load_version(ref: str, db: str | None, *, device=None, dtype=None):
    """(store, version record, Mapper, source model, target model, tokenizer) for a reference."""
    from kvhub.core.mapper import Mapper
    from kvhub.models.resolve import load_model
    from kvhub.store import open_store

    store = open_store(db)
    version = store.resolve(ref)
    mapper = Mapper.load(store.artifact_path(version), device=device, dtype=dtype)
    err_console.print(f"loading {version.source} and {version.target}")
    source, tokenizer, _ = load_model(version.source, device=device, dtype=dtype or "bfloat16")
    target, _, _ = load_model(version.target, device=device, dtype=dtype or "bfloat16")
    return store, version, mapper, source, target, tokenizer


def _variants(exact_prefixes, exact_suffixes, exact_budgets, selects, specs):
    """Every (prefix, suffix, budget, selector) combination (the selector only where budget > 0), then
    the explicit --variant specs; duplicates dropped, order kept."""
    from kvhub.serving.recompute import Recompute

    variants = [Recompute(p, s, b, select)
                for p in exact_prefixes for s in exact_suffixes for b in exact_budgets
                for select in (selects if b > 0 else selects[:1])]
    variants += [Recompute.parse(spec) for spec in specs]
    unique = {}
    for variant in variants:
        unique.setdefault(variant.name(), variant)
    return list(unique.values())


@click.command("eval")
@click.argument("ref")
@click.option("--task", "tasks", multiple=True, required=True, type=click.Choice(TASKS),
              help="Task to evaluate (repeatable).  facts / multiturn / code are long-context tasks scored "
                   "exactly (see --context-tokens).")
@click.option("--limit", type=int, default=200, show_default=True, help="Items per task (seeded subset).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--exact-prefix", "exact_prefixes", type=click.IntRange(min=0), multiple=True, default=(0,),
              show_default=True,
              help="First context tokens the target recomputes itself (attention sinks); the rest is mapped. "
                   "Repeat to compare variants in one pass (own and source are scored once).")
@click.option("--exact-suffix", "exact_suffixes", type=click.IntRange(min=0), multiple=True, default=(0,),
              show_default=True,
              help="Last context tokens the target recomputes itself over the mapped cache. Repeatable; "
                   "every combination of the recompute options is a variant.")
@click.option("--exact-budget", "exact_budgets", type=click.FloatRange(0, 1), multiple=True, default=(0.0,),
              show_default=True,
              help="Fraction of the context the target recomputes selectively (whole sentences/lines chosen "
                   "by --select) over the mapped rest. Repeatable.")
@click.option("--select", "selects", type=click.Choice(("source", "target", "deviation", "random")), multiple=True,
              default=("source",), show_default=True,
              help="How --exact-budget chooses the tokens: the source's attention from the last tokens, the "
                   "target's from its exact suffix, the mapped-vs-exact deviation at the first target layer, "
                   "or random spans (the control for the signal). Repeatable.")
@click.option("--variant", "specs", multiple=True, metavar="SPEC",
              help="An explicit recompute variant, e.g. 'exact_prefix=4,exact_suffix=16,exact_budget=0.1,"
                   "select=source'. Repeatable; added to the combinations above.")
@click.option("--context-tokens", "context_tokens", type=click.IntRange(min=64), multiple=True, default=(1024,),
              show_default=True, help="For facts / multiturn / code: context length in tokens. Repeatable.")
@click.option("--ppl-calib", default=None, metavar="NAME",
              help="For --task ppl: the calibration set whose held-out text is scored (default: the mapper's own).")
@click.option("--device", default=None, help="cpu, cuda, ... (default: cuda if available).")
@click.option("--dtype", default="bfloat16", show_default=True, help="dtype of both models and the mapped cache.")
@click.option("--db", default=None, metavar="URL")
@click.option("--json", "as_json", is_flag=True)
def eval_command(ref, tasks, limit, seed, exact_prefixes, exact_suffixes, exact_budgets, selects, specs,
                 context_tokens, ppl_calib, device, dtype, db, as_json):
    """Accuracy of the target from its own cache, from the mapped cache, and of the source alone.

    By default every context token is mapped (the map alone); `--exact-prefix 4 --exact-suffix 16`
    measures what `kvhub.serving.handoff.handoff` does by default, and `--exact-budget 0.1 --select source`
    adds a selective recompute of 10% of the context.

    The long-context tasks (facts: passkey retrieval with 1-3 facts at swept depths; multiturn: a number
    stated early in a chat; code: next line after a long Python file prefix) score each answer exactly
    and add two conditions: `control`, the same recompute over a map with no information about the
    context (the mapper's calibration-mean K/V), and `floor`, the target given only the question.

    Results (retention, 95% bootstrap intervals, ...) are stored as metrics of the version and shown by
    `kvhub show`.  Per-item results are cached, so an interrupted evaluation resumes where it stopped.
    """
    from kvhub.serving.recompute import Recompute

    variants = _variants(exact_prefixes, exact_suffixes, exact_budgets, selects, specs)
    store, version, mapper, source, target, tokenizer = _load_version(ref, db, device=device, dtype=dtype)
    run = {"dtype": dtype, "device": str(next(target.parameters()).device), "seed": seed, "limit": limit}
    results = {}
    for task in tasks:
        if task == "ppl":
            summaries = {variant.name(): _eval_ppl(mapper, source, target, tokenizer, limit=limit, seed=seed,
                                                   exact_prefix=variant.exact_prefix,
                                                   exact_suffix=variant.exact_suffix, calib=ppl_calib)
                         for variant in variants if not variant.selective}
            named = {"ppl": summaries}
        elif task in LONG_TASKS:
            named = {f"{task}-{length}": _eval_recall(version, mapper, source, target, tokenizer, task, length,
                                                      variants, run)
                     for length in context_tokens}
        else:
            named = {task: _eval_task(version, mapper, source, target, tokenizer, task, variants, run)}
        for base, summaries in named.items():
            for label, summary in summaries.items():
                name = f"{base}@{label}" if label else base
                spec = Recompute.parse(label)
                summary.update(variant=label, exact_prefix=spec.exact_prefix, exact_suffix=spec.exact_suffix,
                               exact_budget=spec.budget, select=spec.select if spec.selective else None)
                results[name] = summary
                store.add_metrics(version, _as_metrics(name, summary, seed))
    if as_json:
        click.echo(json.dumps({"ref": version.ref, "config": run, "results": results}, indent=2))
    else:
        _print_results(version.ref, results)


def _eval_task(version, mapper, source, target, tokenizer, task, variants, run) -> dict[str, dict]:
    from kvhub.eval.cache import results_file, score_items
    from kvhub.eval.taskeval import ItemScore, _AttnRecorder, score_item, summarize
    from kvhub.eval.tasks import load_task
    from kvhub.cli.progress import progress_callback

    items = load_task(task, limit=run["limit"], seed=run["seed"])
    paths = [results_file(version.tensors_sha256, task, seed=run["seed"], variant=v.name(), dtype=run["dtype"],
                          device=run["device"]) for v in variants]
    recorder = _AttnRecorder(target)
    try:
        with progress_callback("items/s") as callback:
            scores = score_items(
                items, paths,
                lambda item, indices: score_item(item, mapper=mapper, source=source, target=target,
                                                 tokenizer=tokenizer, variants=tuple(variants[i] for i in indices),
                                                 recorder=recorder),
                from_dict=lambda record: ItemScore(**record), progress=callback)
    finally:
        recorder.remove()
    return {v.name(): summarize([row[i] for row in scores], seed=run["seed"]) for i, v in enumerate(variants)}


def _eval_recall(version, mapper, source, target, tokenizer, task, length, variants, run) -> dict[str, dict]:
    from kvhub.eval.control import control_mapper
    from kvhub.eval.cache import results_file, score_items
    from kvhub.eval.longctx import RecallScore, build_items, score_recall_item, summarize_recall
    from kvhub.cli.progress import progress_callback

    control = control_mapper(mapper)
    items = build_items(task, tokenizer, context_tokens=length, n=run["limit"], seed=run["seed"])
    paths = [results_file(version.tensors_sha256, f"{task}-{length}", seed=run["seed"], variant=v.name(),
                          dtype=run["dtype"], device=run["device"]) for v in variants]
    with progress_callback("items/s") as callback:
        scores = score_items(
            items, paths,
            lambda item, indices: score_recall_item(item, mapper=mapper, control=control, source=source,
                                                    target=target, tokenizer=tokenizer,
                                                    variants=[variants[i] for i in indices]),
            from_dict=lambda record: RecallScore(**record), progress=callback)
    return {v.name(): summarize_recall([row[i] for row in scores], seed=run["seed"]) for i, v in enumerate(variants)}


def _eval_ppl(mapper, source, target, tokenizer, *, limit, seed, exact_prefix, exact_suffix, calib=None) -> dict:
    from kvhub.calib import resolve_calibration
    from kvhub.eval.continuation import continuation_metrics

    calibration = mapper.metadata.get("calibration", {})
    name = calib or calibration.get("name")
    if not name:
        from kvhub.errors import ConfigError

        raise ConfigError("this mapper records no calibration set, so `--task ppl` has no held-out text; "
                          "name one with --ppl-calib")
    # the mapper's own sequence count and length, so its held-out split is the one it was fitted beside
    held = resolve_calibration(name, tokenizer=tokenizer, tokenizer_id=mapper.source["model_id"],
                               samples=calibration.get("sequences"), seq_len=calibration.get("seq_len")).heldout
    held = held[: max(1, min(limit, held.shape[0]))]
    metrics = continuation_metrics(mapper, source, target, held, context_len=held.shape[1] // 2,
                                   exact_prefix=exact_prefix, exact_suffix=exact_suffix)
    return {"n": metrics.sequences, **metrics.as_dict()}


def _as_metrics(task: str, summary: dict, seed: int) -> list[dict]:
    """Store rows for the finite numbers of a summary (e.g. gap closed is undefined when own == source)."""
    rows = []
    for name, value in summary.items():
        if isinstance(value, (int, float)) and not math.isfinite(value):
            continue
        if isinstance(value, (int, float)) and name not in ("n", "exact_prefix", "exact_suffix", "exact_budget", "sequences"):
            rows.append({"name": name, "value": float(value), "task": task, "split": "eval",
                         "n": summary.get("n"), "seed": seed})
        elif name.endswith("_ci") and isinstance(value, list) and all(math.isfinite(v) for v in value):
            rows.append({"name": f"{name}_low", "value": float(value[0]), "task": task, "split": "eval",
                         "n": summary.get("n"), "seed": seed})
            rows.append({"name": f"{name}_high", "value": float(value[1]), "task": task, "split": "eval",
                         "n": summary.get("n"), "seed": seed})
    return rows


def _print_results(ref: str, results: dict) -> None:
    from rich.table import Table

    table = Table(title=ref)
    for column in ("task", "n", "own", "mapped", "source", "retention [95% CI]", "gap closed", "agree", "attn cos"):
        table.add_column(column, justify="right")
    recall = {task: r for task, r in results.items() if "acc_control" in r}
    for task, r in results.items():
        if task in recall:
            continue
        if task.startswith("ppl"):
            table.add_row(task, str(r["n"]), f"ppl {r['ppl_own']:.2f}", f"ppl {r['ppl_mapped']:.2f}",
                          f"no ctx {r['ppl_no_context']:.2f}", "", "", f"{r['agreement']:.3f}", "")
            continue
        low, high = r["retention_ci"]
        table.add_row(task, str(r["n"]), f"{r['acc_own']:.3f}", f"{r['acc_mapped']:.3f}", f"{r['acc_source']:.3f}",
                      f"{r['retention']:.3f} [{low:.2f}, {high:.2f}]", f"{r['gap_closed']:.3f}",
                      f"{r['agree_next']:.3f}", f"{r['attn_cosine']:.3f}")
    if table.row_count:
        console.print(table)
    if recall:
        _print_recall(ref, recall)


def _print_recall(ref: str, results: dict) -> None:
    from rich.table import Table

    table = Table(title=f"{ref}: exact answers from long contexts")
    for column in ("task", "n", "tokens", "exact %", "own", "mapped", "control", "source", "floor",
                   "retention [95% CI]", "map - control [95% CI]"):
        table.add_column(column, justify="right")
    for task, r in results.items():
        low, high = r["retention_ci"]
        dlow, dhigh = r["map_minus_control_ci"]
        table.add_row(task, str(r["n"]), f"{r['context_tokens']:.0f}", f"{100 * r['recomputed_fraction']:.1f}",
                      *(f"{r[f'acc_{c}']:.2f}" for c in ("own", "mapped", "control", "source", "floor")),
                      f"{r['retention']:.2f} [{low:.2f}, {high:.2f}]",
                      f"{r['map_minus_control']:+.2f} [{dlow:+.2f}, {dhigh:+.2f}]")
    console.print(table)


@click.command("bench")
@click.argument("ref")
@click.option("--lengths", default="256,1024,4096", show_default=True, help="Context lengths in tokens.")
@click.option("--repeats", type=int, default=5, show_default=True)
@click.option("--exact-prefix", type=click.IntRange(min=0), default=0, show_default=True,
              help="Include this exact-prefix recompute in the handoff's time to first token.")
@click.option("--exact-suffix", type=click.IntRange(min=0), default=0, show_default=True,
              help="Include this exact-suffix recompute in the handoff's time to first token.")
@click.option("--exact-budget", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Include a selective recompute of this fraction of the context (token selection included).")
@click.option("--select", type=click.Choice(("source", "target", "deviation", "random")), default="source",
              show_default=True, help="Token selector of --exact-budget.")
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available).")
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--db", default=None, metavar="URL")
@click.option("--json", "as_json", is_flag=True)
def bench(ref, lengths, repeats, exact_prefix, exact_suffix, exact_budget, select, device, dtype, db, as_json):
    """Time transfer() against the target re-prefilling the same context (interleaved, same device/dtype),
    and the handoff's time to first token against a full prefill.  Stored as metrics of the version."""
    from kvhub.eval.continuation import time_transfer_vs_prefill

    store, version, mapper, source, target, _ = _load_version(ref, db, device=device, dtype=dtype)
    mapper.to(device=next(target.parameters()).device)
    rows = time_transfer_vs_prefill(mapper, source, target, lengths=[int(x) for x in lengths.split(",")],
                                    repeats=repeats, exact_prefix=exact_prefix, exact_suffix=exact_suffix,
                                    exact_budget=exact_budget, select=select)
    device_name = str(next(target.parameters()).device)
    from kvhub.serving.recompute import Recompute

    variant = Recompute(exact_prefix, exact_suffix, exact_budget, select).name()
    store.add_metrics(version, [
        {"name": name, "value": float(value), "split": "bench",
         "task": f"bench:{device_name}:{dtype}:{row['tokens']}" + (f"@{variant}" if variant else ""),
         "n": repeats}
        for row in rows for name, value in row.items() if name in ("speedup", "ttft_speedup", "transfer_median_s",
                                                                   "prefill_median_s")])
    if as_json:
        click.echo(json.dumps({"ref": version.ref, "device": device_name, "dtype": dtype,
                               "exact_prefix": exact_prefix, "exact_suffix": exact_suffix,
                               "exact_budget": exact_budget, "select": select, "rows": rows}, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"{version.ref} on {device_name} ({dtype})")
    for column in ("tokens", "transfer s", "re-prefill s", "speedup", "handoff TTFT s", "full TTFT s", "TTFT speedup"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["tokens"]), f"{r['transfer_median_s']:.4f}", f"{r['prefill_median_s']:.3f}",
                      f"{r['speedup']:.1f}x", f"{r['handoff_ttft_median_s']:.4f}", f"{r['full_ttft_median_s']:.3f}",
                      f"{r['ttft_speedup']:.1f}x")
    console.print(table)


@click.command("report")
@click.argument("ref")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--db", default=None, metavar="URL")
def report(ref, out, db):
    """Write the R^2 heatmap, per-layer R^2 and retention plots, and a markdown summary, to OUT."""
    from kvhub.core.mapper import read_metadata
    from kvhub.eval.plots import layer_r2, r2_heatmap, retention_bars
    from kvhub.store import open_store

    store = open_store(db)
    version = store.resolve(ref)
    metadata = read_metadata(store.artifact_path(version))
    out.mkdir(parents=True, exist_ok=True)
    r2_heatmap(metadata, out / "r2_heatmap.png")
    layer_r2(metadata, out / "layer_r2.png")
    tasks = _task_results(store.metrics(version))
    lines = [f"# {version.ref}", "", f"- source: {version.source}", f"- target: {version.target}",
             f"- calibration: {version.calibration}", "",
             f"held-out R² K {metadata['metrics'].get('heldout_r2_k_mean', float('nan')):.3f}, "
             f"V {metadata['metrics'].get('heldout_r2_v_mean', float('nan')):.3f}", "",
             "![R² heatmap](r2_heatmap.png)", "", "![per-layer R²](layer_r2.png)", ""]
    if tasks:
        retention_bars(tasks, out / "retention.png")
        lines += ["| task | n | own | mapped | source | retention |", "| --- | --- | --- | --- | --- | --- |"]
        for task, r in sorted(tasks.items()):
            lines.append(f"| {task} | {r.get('n', '')} | {r['acc_own']:.3f} | {r['acc_mapped']:.3f} | "
                         f"{r['acc_source']:.3f} | {r.get('retention', float('nan')):.3f} |")
        lines += ["", "![retention](retention.png)"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    console.print(f"wrote {out}/report.md")


def _task_results(metrics: list[dict]) -> dict[str, dict]:
    """Latest value per (task, name) of the accuracy metrics, with intervals, as retention_bars wants."""
    tasks: dict[str, dict] = {}
    for metric in metrics:
        task = metric.get("task")
        if not task or task == "ppl" or task.startswith("bench:"):
            continue
        entry = tasks.setdefault(task, {"n": metric.get("n")})
        entry[metric["name"]] = metric["value"]
    for entry in tasks.values():
        for cond in ("own", "mapped", "source"):
            if f"acc_{cond}_ci_low" in entry:
                entry[f"acc_{cond}_ci"] = [entry[f"acc_{cond}_ci_low"], entry[f"acc_{cond}_ci_high"]]
    return {t: e for t, e in tasks.items() if "acc_own" in e}


def attach(group: click.Group) -> None:
    for command in (eval_command, bench, report):
        group.add_command(command)
