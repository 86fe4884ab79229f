"""``kvhub eval``: options and the refusals before any model loads.

What it runs lives in the library: :mod:`kvhub.eval.run` (versions, variants, the task loop, metric rows) over
the tasks registered in :mod:`kvhub.eval.catalog`; its tables are :mod:`kvhub.cli.eval_tables`.  ``kvhub bench``
(:mod:`kvhub.cli.bench_cmd`) loads a version as this module does.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from kvhub.cli.console import say
from kvhub.cli.eval_tables import print_results
from kvhub.cli.options import chosen_dtype, db_option, dtype_option, log_samples_option, open_db, output_path_option
from kvhub.cli.output import echo_json, format_option
from kvhub.core.deshrink import DESHRINK, DESHRINK_DEFAULT
from kvhub.eval.catalog import GIST_SUITE_TASKS, GIST_TASKS, LONG_TASKS, MC_TASKS, TASKS
from kvhub.eval.textsets import TEXT_SETS, load_text_set
from kvhub.serving.spec import SELECTORS
from kvhub.errors import ConfigError
from kvhub.calib.recipe import recipe_from_spec


def _load_version(
    ref: str,
    db: str | None,
    *,
    device=None,
    dtype=None,
    context_tokens=(),
    deshrink=None,
    lengths_option: str = "--context-tokens",
):
    """(open store, :class:`kvhub.eval.run.LoadedVersion`); long-context lengths beyond the models' context
    are refused before the models load.  The caller closes the store."""
    from kvhub.core.mapper import read_metadata
    from kvhub.eval.run import check_context_length, load_version

    store = open_db(db, create=False)  # a mistyped --db is a miss, not a new empty store
    try:
        version = store.resolve(ref)
        check_context_length(read_metadata(store.artifact_path(version)), context_tokens, option=lengths_option)
        say(f"loading {version.source} and {version.target}")
        return store, load_version(store, ref, device=device, dtype=dtype, deshrink=deshrink)
    except BaseException:
        store.close()
        raise


@click.command("eval")
@click.argument("ref")
@click.option(
    "--task",
    "tasks",
    multiple=True,
    required=True,
    type=click.Choice(TASKS),
    help="Task to evaluate (repeatable).  facts / multiturn / code / followup, the RULER-style "
    "niah-multikey / vt / cwe and the aggregation tasks agg-count / agg-mode / agg-total / agg-order are "
    "long-context tasks scored exactly; gist-chat / gist-document / "
    "gist-code score the target's own answer about the whole context (see --context-tokens); gist / gist-dev: "
    "the gist suite (six domains, --limit items each; test / dev split).",
)
@click.option(
    "--limit", type=click.IntRange(min=1), default=200, show_default=True, help="Items per task (seeded subset)."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--exact-prefix",
    "exact_prefixes",
    type=click.IntRange(min=0),
    multiple=True,
    default=(0,),
    show_default=True,
    help="First context tokens the target recomputes itself (attention sinks); the rest is mapped. "
    "Repeat to compare variants in one pass (own and source are scored once).",
)
@click.option(
    "--exact-suffix",
    "exact_suffixes",
    type=click.IntRange(min=0),
    multiple=True,
    default=(0,),
    show_default=True,
    help="Last context tokens the target recomputes itself over the mapped cache. Repeatable; "
    "every combination of the recompute options is a variant.",
)
@click.option(
    "--exact-budget",
    "exact_budgets",
    type=click.FloatRange(0, 1),
    multiple=True,
    default=(0.0,),
    show_default=True,
    help="Fraction of the context the target recomputes selectively (whole sentences/lines chosen "
    "by --select) over the mapped rest. Repeatable.",
)
@click.option(
    "--select",
    "selects",
    type=click.Choice(SELECTORS),
    multiple=True,
    default=("source",),
    show_default=True,
    help="How --exact-budget chooses the tokens: the source's attention from the last tokens, the "
    "target's from its exact suffix, the mapped-vs-exact deviation at the first target layer, "
    "or random spans (the control for the signal). Repeatable.",
)
@click.option(
    "--variant",
    "specs",
    multiple=True,
    metavar="SPEC",
    help="An explicit recompute variant, e.g. 'exact_prefix=4,exact_suffix=16,exact_budget=0.08,"
    "select=target,queries=4' (fields of kvhub.serving.spec.Recompute), or 'handoff' for "
    "kvhub.handoff's defaults. Repeatable; added to the combinations above.",
)
@click.option(
    "--context-tokens",
    "context_tokens",
    type=click.IntRange(min=64),
    multiple=True,
    default=(1024,),
    show_default=True,
    help="For the long-context and gist tasks: context length in tokens, at most the models' context "
    "length. Repeatable.",
)
@click.option(
    "--ppl-text",
    default="lambada",
    show_default=True,
    type=click.Choice(sorted(TEXT_SETS)),
    help="For --task ppl: the fixed text set scored (kvhub.eval.textsets), the same token windows for "
    "every mapper of a model pair.",
)
@click.option(
    "--ppl-seq-len",
    type=click.IntRange(min=4),
    default=256,
    show_default=True,
    help="For --task ppl: tokens per window; the first half is the (mapped) context, the second half is scored.",
)
@click.option(
    "--ppl-calib",
    default=None,
    metavar="NAME",
    help="For --task ppl: score the held-out split of this calibration set instead of --ppl-text, packed "
    "as the mapper's own (figures then depend on that packing).",
)
@click.option(
    "--deshrink",
    type=click.Choice(DESHRINK),
    default=None,
    help=f"How the maps are read: de-shrunk keys and values (kv), values only (v), or as fitted (off) "
    f"(default $KVHUB_DESHRINK, else {DESHRINK_DEFAULT}, where the mapper stores its calibration "
    "means; kvhub.core.deshrink). "
    "Results of a non-default setting are named with it.",
)
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available).")
@dtype_option("dtype of both models and the mapped cache.")
@db_option
@output_path_option("<ref>/results_<date>.json (lm-eval's layout)")
@log_samples_option("id, gold, each condition's prediction and scores")
@format_option
def eval_command(
    ref,
    tasks,
    limit,
    seed,
    exact_prefixes,
    exact_suffixes,
    exact_budgets,
    selects,
    specs,
    context_tokens,
    ppl_text,
    ppl_seq_len,
    ppl_calib,
    deshrink,
    device,
    dtype,
    db,
    output_path,
    log_samples,
    output_format,
):
    """Accuracy of the target from its own cache, from the mapped cache, and of the source alone.

    By default every context token is mapped (the map alone); `--variant handoff` (the same as
    `--exact-prefix 4 --exact-suffix 16 --exact-budget 0.08 --select source`) measures what
    `kvhub.handoff` does by default (the first 4 and last 16 tokens and 8% of the context recomputed by
    the target).  Every task scores every variant.

    Every task also scores `drop`, the no-fit alternative (for `ppl`: `ppl_drop`): the target prefills only the context tokens
    the variant recomputes (same selection, same positions, same target compute) and drops the rest.

    The long-context tasks (facts: passkey retrieval with 1-3 facts at swept depths; multiturn: a number
    stated early in a chat; code: next line after a long Python file prefix; niah-multikey, vt, cwe:
    RULER-style multi-key needles with decoys, variable tracking and common-word aggregation; agg-count,
    agg-mode, agg-total, agg-order: a count, the most frequent item, a running total and the order of events
    over a log, from lines spread over the whole context) score each
    answer exactly and add two conditions: `control`, the same recompute over a map with no information
    about the context (the mapper's calibration-mean K/V), and `floor`, the target given only the
    question.  `followup` escalates at a first question and scores a second one about another fact, with
    and without re-selecting spans for it (`reselect`, `drop_reselect`).

    The gist tasks (gist-chat: summarize a long chat; gist-document: summarize a long text; gist-code:
    continue a long Python file) score the target's own 48-token greedy answer teacher-forced (mean NLL
    per token) under its own cache, each mapped variant, drop, the control and the floor (the context
    dropped), and report the gap closed, (floor - mapped) / (floor - own): 1 is as informed as own, 0
    is no better than no context.  They also score by generation: the target's greedy answer under each
    cache against its own (ROUGE-L), and the gap closed by it, in a table of its own; and, where the target
    is a chat model, by a judge: the target asked whether that answer says what its own does (its P(yes)).

    `gist` runs the gist suite on its test split (`gist-dev`: the dev split, for choosing): --limit items per
    domain of chats, group chats, licences, manual pages, source files and long instructions, built offline
    (`kvhub fetch evals` fetches the wheels; manual pages need Debian's manpages and groff), each with a
    question about all of its context and, for group chats and instructions, a keyed answer scored exactly.
    Beside the controls above it scores the wrong document (another item's context), an all-zero mapped cache
    and, where the two caches have the same shapes, the raw source cache; each domain is reported alone and
    pooled.

    `ppl` scores perplexity on a fixed text set (--ppl-text, default the LAMBADA test passages), cut into
    the same windows for every mapper of a pair, so figures compare across mappers whatever their
    calibration data.

    Results (retention, 95% bootstrap intervals, ...) are stored as metrics of the version and shown by
    `kvhub show`.  Per-item results are cached (per mapper, task, seed, variant, dtype, device and
    --deshrink), so an interrupted evaluation resumes where it stopped.  `--json` prints lm-eval's shape:
    `results` (one entry per task and variant) and `config` (mapper, dtype, device, limit, seed, variants, each data
    set's name and sha256, kvhub version, date); `--output-path` writes it, `--log-samples` adds the items.
    Any lm-eval task: `kvhub-lm-eval --model kvhub` (docs/guide.md).
    """
    from kvhub.cli.progress import progress_callback
    from kvhub.eval import run
    from kvhub.eval.results import document

    variant_list = run.variants(
        exact_prefixes=exact_prefixes,
        exact_suffixes=exact_suffixes,
        exact_budgets=exact_budgets,
        selects=selects,
        specs=specs,
    )
    items = _check_before_loading(
        tasks,
        limit=limit,
        seed=seed,
        ppl_text=ppl_text,
        ppl_calib=ppl_calib,
        log_samples=log_samples,
        output_path=output_path,
        device=device,
        dtype=dtype,
    )
    dtype = chosen_dtype(dtype, device)
    long_lengths = context_tokens if set(tasks) & set(LONG_TASKS + GIST_TASKS + GIST_SUITE_TASKS) else ()
    store, loaded = _load_version(ref, db, device=device, dtype=dtype, context_tokens=long_lengths, deshrink=deshrink)
    with store:
        settings = run.RunSettings(
            loaded.version.tensors_sha256,
            loaded.mapper.deshrink,
            seed=seed,
            limit=limit,
            dtype=dtype,
            device=loaded.device,
            log_samples=log_samples,
        )
        task_list = run.build_tasks(
            tasks,
            loaded,
            limit=limit,
            seed=seed,
            context_tokens=context_tokens,
            ppl_text=ppl_text,
            ppl_seq_len=ppl_seq_len,
            ppl_calib=ppl_calib,
            items=items,
        )
        try:
            outcome = run.evaluate(
                task_list, variant_list, settings=settings, progress=lambda: progress_callback("items/s")
            )
        except KeyboardInterrupt:
            say(
                "Interrupted; the items scored so far are cached: run the same command to resume where it stopped",
                style="bold",
            )
            raise SystemExit(130) from None
        for name, summary in outcome.results.items():
            store.add_metrics(loaded.version, run.metric_rows(name, summary, seed=seed))
        reference = store.reference(loaded.version)  # as `kvhub list` shows it; JSON carries the full ref
    config = run.results_config(loaded, variant_list, settings=settings, tasks=tasks, datasets=outcome.datasets)
    doc = document(loaded.version.ref, outcome.results, config)
    if output_path is not None:
        for path in _write_results(doc, outcome.samples if log_samples else None, output_path, reference):
            say(f"wrote {path}")
    if output_format == "json":
        echo_json(doc)
    else:
        print_results(reference, outcome.results, output_format=output_format)


def _check_before_loading(
    tasks, *, limit, seed, ppl_text, ppl_calib, log_samples, output_path, device=None, dtype=None
) -> dict:
    """Refuse what would fail only after the models are loaded (samples with nowhere to go, an output path that
    cannot be written, an unknown device or dtype, evaluation sets not fetched, an unknown --ppl-calib); returns
    the items of each multiple-choice task, read here."""
    from kvhub.eval import tasks as task_data

    if log_samples and output_path is None:
        raise ConfigError("--log-samples writes the items beside the results: add --output-path DIR")
    check_device_and_dtype(device, dtype)
    if output_path is not None:
        _probe_output_path(output_path)
    if "ppl" in tasks and ppl_calib is None:
        load_text_set(ppl_text)  # CorpusUnavailableError naming `kvhub fetch evals` (read once, kept)
    if "ppl" in tasks and ppl_calib is not None:
        recipe_from_spec(ppl_calib)  # an unknown name fails here, with the known ones
    if set(tasks) & set(GIST_SUITE_TASKS):
        from kvhub.eval.gist_suite import check_corpora

        check_corpora()  # CorpusUnavailableError naming each missing corpus and what fetches it
    return {task: task_data.load_task(task, limit=limit, seed=seed) for task in tasks if task in MC_TASKS}


def _probe_output_path(output_path: Path) -> None:
    """Create the directory ``--output-path`` writes into and write a probe file there, so a path that cannot
    hold the results is refused before the evaluation runs, not after (ConfigError naming it)."""
    import tempfile

    path = output_path.expanduser()
    wants_file = path.suffix == ".json"
    if wants_file and path.is_dir():
        raise ConfigError(
            f"--output-path {path} is a directory, but a path ending in .json names the results file; "
            "give another file name, or a directory path without .json"
        )
    folder = path.parent if wants_file else path
    if os.path.lexists(folder) and not folder.is_dir():
        raise ConfigError(
            f"--output-path: {folder} exists and is not a directory; the results go into a directory "
            "there (or give a path ending in .json for the file itself)"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(
            f"--output-path: cannot write into {folder} ({exc.strerror or exc}); choose a directory you can write to"
        ) from None


def _write_results(doc: dict, samples, output_path: Path, reference: str) -> list[Path]:
    """results.write into a folder named after the short reference, with a failure (disk full, the folder
    removed meanwhile) as a kvhub error."""
    from kvhub.eval.results import write

    try:
        return write(doc, samples, output_path, folder_name=reference)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the results under {output_path} ({exc.strerror or exc}); the metrics are "
            f"stored (`kvhub show {reference}`), and --json prints the document"
        ) from None


def check_device_and_dtype(device: str | None, dtype: str | None) -> None:
    """ConfigError for a --device torch does not know, CUDA on a machine without it, or an unknown --dtype."""
    from kvhub.dtypes import canonical_name, check_device

    canonical_name(dtype or "bfloat16")
    check_device(device, what="--device")


def attach(group: click.Group) -> None:
    """Register eval on the ``kvhub`` group."""
    group.add_command(eval_command)
