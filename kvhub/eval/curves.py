"""The curves ``kvhub report`` draws from a version's stored metrics, without evaluating anything: what the handoff
keeps against the recompute budget (the variants ``kvhub eval --exact-budget ...`` stored) and its speedup against
context tokens (``kvhub bench --lengths ...``); and, where a curve has fewer than two points, the command that
would measure them.

Stored task names (:func:`kvhub.eval.run.metric_rows`, :func:`kvhub.eval.continuation.timing_metric_rows`):
``TASK[@VARIANT][:DOMAIN]`` with VARIANT the recompute spec (``exact_prefix=4,exact_budget=0.08,select=source``,
``deshrink=...`` appended), and ``bench:DEVICE:DTYPE:TOKENS[@VARIANT]``.
"""

from __future__ import annotations

import re

BUDGET_COMMAND = "--exact-budget 0 --exact-budget 0.08 --exact-budget 0.2 --select source"
LENGTHS_COMMAND = "--lengths 256,1024,4096"


def budget_curves(measurements) -> dict[str, list[dict]]:
    """``"TASK[, OTHER FIELDS], select=S"`` -> points by ascending budget, for the curves with two points or more,
    as :func:`kvhub.eval.plots.budget_figure` draws them: ``share`` (the --exact-budget), ``handoff`` and
    ``handoff_ci``, ``drop`` and ``drop_ci`` (None where not stored), ``own``, ``metric``, ``n``.

    The metric is what the task measured: ``retention`` = acc_mapped / acc_own for multiple choice (drop
    = acc_drop / acc_own, own = 1), ``gap closed`` for the gist tasks (by NLL; a gist task scored by
    generation as well has a second curve, ``TASK (generation)``, of the gap closed by what the target
    writes, and one judged has a third, ``TASK (judge)``), else ``exact match`` (the accuracy of generation
    tasks such as facts).  A budget-0 point has no selector: it starts every selector's curve."""
    groups: dict[tuple[str, str], dict] = {}  # (task, other fields) -> {selector or None: {budget: point}}
    for task, values in _evaluations(measurements).items():
        parsed = _split_variant(task)
        if parsed is None:
            continue
        base, budget, select, rest = parsed
        for scored, point in _points(values).items():
            groups.setdefault((base + scored, rest), {}).setdefault(select, {})[budget] = {"share": budget, **point}
    curves = {}
    for (base, rest), by_select in sorted(groups.items()):
        start = by_select.pop(None, {})
        for select, points in sorted(by_select.items()) or [(None, {})]:
            merged = sorted({**start, **points}.values(), key=lambda p: p["share"])
            if len(merged) >= 2:
                curves[", ".join(p for p in (base, rest, select and f"select={select}") if p)] = merged
    return curves


def length_curves(measurements) -> dict[str, dict[str, list]]:
    """``"DEVICE DTYPE, VARIANT"`` (``map alone`` for no recompute) -> ``tokens`` ascending, ``ttft_speedup`` (full
    prefill / handoff time to first token) and ``speedup`` (re-prefill / transfer()), for the runs timed at two
    context lengths or more."""
    from kvhub.hub.evaluations import latest

    runs: dict[str, dict[int, dict]] = {}
    for (split, task, name), metric in latest(measurements).items():
        match = re.fullmatch(r"bench:(.+):([^:]+):(\d+)(?:@(.*))?", task)
        if split == "bench" and match and name in ("speedup", "ttft_speedup"):
            device, dtype, tokens, variant = match.groups()
            label = f"{device} {dtype}, {variant or 'map alone'}"
            runs.setdefault(label, {}).setdefault(int(tokens), {})[name] = metric["value"]
    curves = {}
    for label, by_tokens in sorted(runs.items()):
        tokens = sorted(t for t, values in by_tokens.items() if len(values) == 2)
        if len(tokens) >= 2:
            curves[label] = {
                "tokens": tokens,
                "ttft_speedup": [by_tokens[t]["ttft_speedup"] for t in tokens],
                "speedup": [by_tokens[t]["speedup"] for t in tokens],
            }
    return curves


def hints(reference: str, measurements, *, budget: dict | None = None, lengths: dict | None = None) -> list[str]:
    """One line per curve not drawn (``budget`` / ``lengths``: the curves above, by default built from
    ``measurements``): the command that measures it."""
    budget = budget_curves(measurements) if budget is None else budget
    lengths = length_curves(measurements) if lengths is None else lengths
    lines = []
    if not budget:
        task = next((_task_option(t) for t in sorted(_evaluations(measurements)) if _split_variant(t)), None)
        lines.append(
            "No recompute-budget curve (fewer than two budgets of a task stored): "
            f"`kvhub eval {reference} {task or '--task facts --context-tokens 1024'} {BUDGET_COMMAND}` measures one."
        )
    if not lengths:
        lines.append(
            "No speedup curve (`kvhub bench` stored fewer than two context lengths): "
            f"`kvhub bench {reference} {LENGTHS_COMMAND}` measures one."
        )
    return lines


def _evaluations(measurements) -> dict[str, dict[str, dict]]:
    """task -> name -> the newest metric, of ``kvhub eval``'s rows (perplexity left out: it has no budget)."""
    from kvhub.hub.evaluations import latest

    tasks: dict[str, dict[str, dict]] = {}
    for (split, task, name), metric in latest(measurements).items():
        if split == "eval" and not task.startswith("ppl"):
            tasks.setdefault(task, {})[name] = metric
    return tasks


def _split_variant(task: str) -> tuple[str, float, str | None, str] | None:
    """'facts-1024@exact_prefix=4,exact_budget=0.08,select=source' -> ('facts-1024', 0.08, 'source',
    'exact_prefix=4'); a domain (``:DOMAIN``) stays with the task; None for a variant not of that form."""
    base, _, variant = task.partition("@")
    variant, _, domain = variant.partition(":")
    fields = dict(part.partition("=")[::2] for part in variant.split(",") if part)
    try:
        budget = float(fields.pop("exact_budget", 0))
    except ValueError:
        return None
    if any(not key or not value for key, value in fields.items()):
        return None
    select = fields.pop("select", None) if budget > 0 else None
    rest = ",".join(f"{key}={value}" for key, value in fields.items())
    return base + (f":{domain}" if domain else ""), budget, select, rest


GENERATION = " (generation)"  # the suffix of a gist task's curve scored by generation
JUDGED = " (judge)"  # ... and of its curve scored by the judge (kvhub.eval.judge)
SCORED_BY = {"gen_": (GENERATION, "gap closed by generation"), "judge_": (JUDGED, "gap closed by the judge")}


def _points(values: dict[str, dict]) -> dict[str, dict]:
    """A task's points at one budget: ``{"": point}``, plus ``{GENERATION: point}`` for a gist task scored by
    generation (``gen_gap_closed_*``) and ``{JUDGED: point}`` for one judged; empty when it has none of the
    metrics."""
    point = _point(values)
    points = {} if point is None else {"": point}
    if point is not None and point["metric"] == "gap closed":
        for prefix, (suffix, _) in SCORED_BY.items():
            if f"{prefix}gap_closed_mapped" in values:
                points[suffix] = _point(values, prefix=prefix)
    return points


def _point(values: dict[str, dict], *, prefix: str = "") -> dict | None:
    """One budget's point from a task's stored metrics (None when it has none of the three metrics);
    ``prefix`` "gen_" / "judge_": the gist's gap closed by generation / by the judge (:data:`SCORED_BY`)."""

    def value(name):
        return values[name]["value"] if name in values else None

    def interval(name):
        low, high = value(f"{name}_ci_low"), value(f"{name}_ci_high")
        return None if low is None or high is None else [low, high]

    n = next(iter(values.values())).get("n")
    if value(f"{prefix}gap_closed_mapped") is not None:
        metric = SCORED_BY[prefix][1] if prefix else "gap closed"
        own, handoff, drop = 1.0, f"{prefix}gap_closed_mapped", f"{prefix}gap_closed_drop"
    elif value("acc_mapped_norm") is not None and value("retention") is not None:  # multiple choice
        acc_own, acc_drop = value("acc_own"), value("acc_drop")
        return {
            "metric": "retention",
            "own": 1.0,
            "handoff": value("retention"),
            "handoff_ci": interval("retention"),
            "drop": acc_drop / acc_own if acc_drop is not None and acc_own else None,
            "drop_ci": None,
            "n": n,
        }
    elif value("acc_mapped") is not None:
        metric, own, handoff, drop = "exact match", value("acc_own"), "acc_mapped", "acc_drop"
    else:
        return None
    return {
        "metric": metric,
        "own": own,
        "handoff": value(handoff),
        "handoff_ci": interval(handoff),
        "drop": value(drop),
        "drop_ci": interval(drop),
        "n": n,
    }


def _task_option(task: str) -> str:
    """--task (and --context-tokens) that evaluate ``task`` again: 'facts-1024@...' -> '--task facts
    --context-tokens 1024'."""
    base = task.partition("@")[0].partition(":")[0]
    match = re.fullmatch(r"(.+)-(\d+)", base)
    return f"--task {match[1]} --context-tokens {match[2]}" if match else f"--task {base}"
