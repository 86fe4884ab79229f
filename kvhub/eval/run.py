"""Evaluation of a registered mapper, as ``kvhub eval`` runs it: one loop over tasks of one small protocol.

A task (:class:`Task`) says what its items are, how one item is scored under a list of recompute
variants (one score per variant, each with ``as_dict()``), how the scores of one variant are summarized,
and what ``--log-samples`` writes per item and variant.  :func:`run_task` is the loop: per-item scores
are cached (:mod:`kvhub.eval.results_cache`, keyed by :func:`kvhub.eval.results_cache.variant_key`), so an interrupted
run resumes and a new variant reuses the rest; :func:`evaluate` runs every task and returns results,
data sets and samples; :func:`results_config` and :func:`metric_rows` shape them for the results
document (:mod:`kvhub.eval.results`) and the store.  The task kinds live beside their scorers
(:class:`kvhub.eval.taskeval.ChoiceTask`, :class:`kvhub.eval.recall_tasks.RecallTask`,
:class:`kvhub.eval.gist.GistTask`, :class:`kvhub.eval.perplexity.PerplexityTask`); :func:`build_tasks`
makes them from the names the CLI takes (:mod:`kvhub.eval.catalog`, a lazy registry) over a
:class:`kvhub.eval.conditions.Conditions` backend: the library handoff, or a served pair for ``kvhub eval-serve``,
which runs through the same :func:`run_task`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvhub.progress import Progress, report

log = logging.getLogger(__name__)


@dataclass
class LoadedVersion:
    """A registered version with its mapper, both models and the source's tokenizer, on one device."""

    version: Any
    mapper: Any
    source: Any
    target: Any
    tokenizer: Any

    @property
    def device(self) -> str:
        return str(next(self.target.parameters()).device)


def load_version(
    store, ref: str, *, device: str | None = None, dtype: str | None = None, deshrink: str | None = None
) -> LoadedVersion:
    """Resolve ``ref`` in ``store`` (:func:`kvhub.api.resolve`, the one door; the Hub on a miss where one is
    configured) and load its mapper (transferring with ``deshrink``, see :mod:`kvhub.core.deshrink`) and the
    two models it was fitted for.  ConfigError for a directory no store version holds: results go to a version."""
    from kvhub.api import resolve
    from kvhub.errors import ConfigError
    from kvhub.models.loading import load_model

    found = resolve(ref, store=store)
    if found.version is None:
        raise ConfigError(
            f"{ref} is an artifact directory no store version holds; `kvhub import` it, then name its ref"
        )
    version = found.version
    mapper = found.load(device=device, dtype=dtype, deshrink=deshrink)
    log.info("loading %s and %s", version.source, version.target)
    source, tokenizer, _ = load_model(version.source, device=device, dtype=dtype or "bfloat16")
    target, _, _ = load_model(version.target, device=device, dtype=dtype or "bfloat16")
    return LoadedVersion(version, mapper, source, target, tokenizer)


def variants(*, exact_prefixes=(0,), exact_suffixes=(0,), exact_budgets=(0.0,), selects=("source",), specs=()):
    """Every (prefix, suffix, budget, selector) combination (the selector only where budget > 0), then the
    explicit ``specs`` (:meth:`Recompute.parse` text); duplicates dropped, order kept."""
    from kvhub.serving.spec import Recompute

    found = [
        Recompute(p, s, b, select)
        for p in exact_prefixes
        for s in exact_suffixes
        for b in exact_budgets
        for select in (selects if b > 0 else selects[:1])
    ]
    found += [parse_variant(spec) for spec in specs]
    unique = {}
    for variant in found:
        unique.setdefault(variant.name(), variant)
    return list(unique.values())


def parse_variant(text: str):
    """A ``--variant`` text: ``handoff`` (:data:`kvhub.serving.spec.HANDOFF`, kvhub.handoff's defaults), or fields
    as :meth:`Recompute.parse` reads them (``handoff,queries=4`` starts from those defaults)."""
    from kvhub.serving.spec import HANDOFF, Recompute

    head, _, rest = text.strip().partition(",")
    if head.strip() == "handoff":
        return Recompute.parse(rest, base=HANDOFF)
    return Recompute.parse(text)


def variant_config(variant) -> dict:
    """A variant as the results document lists it (and as each of its summaries is labelled)."""
    return {
        "name": variant.name(),
        "exact_prefix": variant.exact_prefix,
        "exact_suffix": variant.exact_suffix,
        "exact_budget": variant.exact_budget,
        "select": variant.select if variant.selective else None,
        "score": variant.score if variant.selective else None,
    }


# ---- the task protocol and its loop --------------------------------------------------------------------
class Task(Protocol):
    """One evaluation task at one setting (e.g. facts at 1024 tokens).

    ``name`` names its results (``hellaswag``, ``facts-1024``, ``ppl:lambada/256``) and its cache files;
    ``read_score`` turns a cached ``as_dict()`` back into a score (ValueError: score the item again).
    """

    name: str
    read_score: Callable[[dict], Any]

    def items(self) -> list: ...

    def score(self, item, variants: list) -> list: ...

    def summarize(self, scores: list) -> dict: ...

    def record(self, variant: str, item, score) -> dict: ...

    def dataset(self, items: list) -> dict: ...


@dataclass(frozen=True)
class RunSettings:
    """What every task of one run shares; seed, dtype, device and deshrink (how the mapper transfers,
    :mod:`kvhub.core.deshrink`) also key the per-item cache."""

    tensors_sha256: str | None  # None: a served pair, whose mapper is not known here (nothing cached)
    deshrink: str | None  # the loaded mapper's (``mapper.deshrink``): no default that could disagree with it
    seed: int = 0
    limit: int = 200
    dtype: str = "bfloat16"
    device: str = "cpu"
    log_samples: bool = False

    def label(self, variant: str) -> str:
        """A variant's name in the results (``task@label``): with ``deshrink=...`` appended when the mapper
        transfers otherwise than by default, so results of the two never share a name."""
        from kvhub.core.deshrink import DESHRINK_DEFAULT

        extra = "" if self.deshrink == DESHRINK_DEFAULT else f"deshrink={self.deshrink}"
        return ",".join(part for part in (variant, extra) if part)


@dataclass
class TaskOutcome:
    summaries: dict[str, dict]  # variant name -> summary (labelled with the variant's fields)
    dataset: dict
    records: list[dict] = field(default_factory=list)


def run_task(task: Task, variant_list: list, *, settings: RunSettings, progress: Progress | None = None) -> TaskOutcome:
    """Score every item of ``task`` under every variant, then summarize per variant: the one evaluation loop, for
    ``kvhub eval`` and ``kvhub eval-serve`` alike.  Scores are cached per item when ``settings.tensors_sha256``
    names the mapper; a served pair's one variant is ``None`` (its summary is labelled ``""``, uncached)."""
    items = task.items()
    if settings.tensors_sha256 is None:  # nothing to key a cache on: score afresh
        scores = []
        for index, item in enumerate(items):
            report(progress, "items", index, len(items))
            scores.append(task.score(item, variant_list))
        report(progress, "items", len(items), len(items))
    else:
        scores = _cached_scores(task, items, variant_list, settings, progress)
    summaries = {}
    for i, variant in enumerate(variant_list):
        summary = task.summarize([row[i] for row in scores])
        if variant is None:
            summaries[""] = summary
            continue
        config = variant_config(variant)
        labels = {k: config[k] for k in ("exact_prefix", "exact_suffix", "exact_budget", "select")}
        summaries[settings.label(variant.name())] = {
            **summary,
            "variant": config["name"],
            "deshrink": settings.deshrink,
            **labels,
        }
    records = (
        [
            task.record(settings.label(v.name()) if v is not None else "", item, row[i])
            for i, v in enumerate(variant_list)
            for item, row in zip(items, scores)
        ]
        if settings.log_samples
        else []
    )
    return TaskOutcome(summaries, task.dataset(items), records)


def _cached_scores(task: Task, items: list, variant_list: list, settings: RunSettings, progress) -> list[list]:
    from kvhub.eval.results_cache import results_file, score_items, variant_key

    paths = [
        results_file(
            settings.tensors_sha256,
            task.name,
            seed=settings.seed,
            variant=variant_key(v),
            dtype=settings.dtype,
            device=settings.device,
            deshrink=settings.deshrink,
        )
        for v in variant_list
    ]
    return score_items(
        items,
        paths,
        lambda item, indices: task.score(item, [variant_list[i] for i in indices]),
        from_dict=task.read_score,
        progress=progress,
    )


@dataclass
class Evaluation:
    """Results of a run: ``results`` by ``task@variant`` name, ``datasets`` and ``samples`` by task name."""

    results: dict[str, dict] = field(default_factory=dict)
    datasets: dict[str, dict] = field(default_factory=dict)
    samples: dict[str, list] = field(default_factory=dict)


def evaluate(
    tasks: list[Task],
    variant_list: list,
    *,
    settings: RunSettings,
    progress: Callable[[], contextlib.AbstractContextManager] | None = None,
    check: Callable[[Task, TaskOutcome], None] | None = None,
) -> Evaluation:
    """:func:`run_task` for every task; ``progress()`` opens one progress callback per task; ``check(task,
    outcome)`` runs after each task (it may raise to stop the run there)."""
    out = Evaluation()
    for task in tasks:
        with (progress or contextlib.nullcontext)() as callback:
            outcome = run_task(task, variant_list, settings=settings, progress=callback)
        if check is not None:
            check(task, outcome)
        out.datasets[task.name], out.samples[task.name] = outcome.dataset, outcome.records
        for label, summary in outcome.summaries.items():
            out.results[f"{task.name}@{label}" if label else task.name] = summary
    return out


def build_tasks(
    names,
    conditions,
    *,
    limit: int,
    seed: int,
    context_tokens=(1024,),
    ppl_text: str = "lambada",
    ppl_seq_len: int = 256,
    ppl_calib: str | None = None,
    items: dict | None = None,
) -> list[Task]:
    """The tasks ``names`` (registered in :mod:`kvhub.eval.catalog`) scored through ``conditions`` (a
    :class:`kvhub.eval.conditions.Conditions` backend; a :class:`LoadedVersion` is the library's): one per
    long-context / gist task and context length.  ``items``: multiple-choice items already read (task -> items)."""
    from kvhub.eval.catalog import task_class
    from kvhub.eval.conditions import TaskOptions, library

    if getattr(conditions, "kind", None) is None:
        conditions = library(conditions)
    options = TaskOptions(
        limit=limit,
        seed=seed,
        context_tokens=tuple(context_tokens),
        ppl_text=ppl_text,
        ppl_seq_len=ppl_seq_len,
        ppl_calib=ppl_calib,
        items=items or {},
    )
    tasks: list[Task] = []
    for name in names:
        tasks += task_class(name, conditions.kind).tasks(name, conditions, options)
    return tasks


def results_config(loaded: LoadedVersion, variant_list: list, *, settings: RunSettings, tasks, datasets: dict) -> dict:
    """The ``config`` block of the results document (:mod:`kvhub.eval.results`)."""
    from kvhub.eval.results import now

    version = loaded.version
    return {
        "source": version.source,
        "target": version.target,
        "calibration": version.calibration,
        "map_kind": version.map_kind,
        "tensors_sha256": version.tensors_sha256,
        "dtype": settings.dtype,
        "device": settings.device,
        "seed": settings.seed,
        "limit": settings.limit,
        "deshrink": settings.deshrink,
        "variants": [variant_config(v) for v in variant_list],
        "tasks": list(tasks),
        "datasets": datasets,
        "date": now(),
    }


_COUNTS = ("n", "key_n", "exact_prefix", "exact_suffix", "exact_budget", "sequences")  # labels, not measurements


def metric_rows(name: str, summary: dict, *, seed: int) -> list[dict]:
    """Store rows for the finite numbers of a summary (gap closed is undefined when own == source), the
    bounds of each ``*_ci`` interval as ``*_ci_low`` / ``*_ci_high``; a summary's ``domains`` (the gist suite) as
    tasks ``<name>:<domain>``."""
    base = {"task": name, "split": "eval", "n": summary.get("n"), "seed": seed}
    rows = []
    for part, inner in (summary.get("domains") or {}).items():  # the gist suite: each domain as its own task
        rows += metric_rows(f"{name}:{part}", inner, seed=seed)
    for key, value in summary.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in _COUNTS:
            if math.isfinite(value):
                rows.append({"name": key, "value": float(value), **base})
        elif key.endswith("_ci") and isinstance(value, list) and all(math.isfinite(v) for v in value):
            rows += [
                {"name": f"{key}_low", "value": float(value[0]), **base},
                {"name": f"{key}_high", "value": float(value[1]), **base},
            ]
    return rows


def check_context_length(metadata: dict, context_tokens, *, option: str = "--context-tokens") -> None:
    """ConfigError when a long-context length exceeds a model's ``max_position_embeddings``, as mapper.json
    (``metadata``) records the two configs: the items would run past the positions the models were trained on.
    ``option``: the command's option that gave the lengths (bench's is --lengths)."""
    from kvhub.errors import ConfigError

    limits = {
        side: ((metadata.get(side) or {}).get("config") or {}).get("max_position_embeddings")
        for side in ("source", "target")
    }
    known = {side: limit for side, limit in limits.items() if isinstance(limit, int)}
    if not known or not context_tokens:
        return
    side, limit = min(known.items(), key=lambda kv: kv[1])
    longest = max(context_tokens)
    if longest > limit:
        raise ConfigError(
            f"{option} {longest} exceeds the {side} model's context length ({limit} tokens, "
            f"max_position_embeddings of {metadata[side].get('model_id')}); use {option} "
            f"{limit // 2} or another length up to {limit}"
        )
