"""Headless matplotlib figures of a mapper (``kvhub report``): the probe R^2 heatmaps, the stored maps' held-out
R^2 per target layer, and task retention.

matplotlib is the optional ``plots`` extra: :func:`require_matplotlib` raises a ConfigError naming it.
The data of each figure comes from a plain function (:func:`layer_series`, :func:`retention_series`) so
what a figure shows can be checked without drawing it.

- ``r2_heatmap``: probe R^2 of full-rank one-layer maps, source layer x target layer, K and V; the
  source layers each stored map reads marked.  For compressed maps (head-local or low-rank) the probe
  is not the stored maps' R^2, and the title says so.
- ``layer_r2``: the held-out R^2 of the stored maps themselves (compressed ones included: mapper.json's
  per-layer r2_k / r2_v are those maps' R^2 on the held-out statistics), K and V both visible when they
  coincide; for compressed maps, the best full-rank probe of the selected sources as a reference.
- ``retention``: retention = acc(mapped) / acc(own) per task with its 95% bootstrap interval, beside the
  accuracies of each condition.
- ``budget``: what the handoff keeps (and drop, the recompute alone) against the recompute budget; ``speedup``: the
  handoff's time-to-first-token gain and transfer()'s speedup against context tokens (their data:
  :mod:`kvhub.eval.curves`).

Every figure's title names the mapper (``name``: by default :func:`mapper_name` of its metadata).
"""

from __future__ import annotations

import math
from pathlib import Path

from kvhub.artifact.metadata import describe_structure
from kvhub.errors import ConfigError

PLOTS_EXTRA = "pip install 'kvhub[plots]'"


def require_matplotlib() -> None:
    """ConfigError naming the ``plots`` extra when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"kvhub report draws its figures with matplotlib, which is not installed here: {PLOTS_EXTRA}"
        ) from exc


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_ticks(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def compressed_structure(metadata: dict) -> str:
    """'' for dense full-rank maps, else their structure as every kvhub output words it ('rank 8')."""
    structure = describe_structure(metadata.get("structure"))
    return "" if structure == "dense" else structure


# ---- data -------------------------------------------------------------------------------------------
def layer_series(metadata: dict) -> dict[str, list]:
    """Per stored target layer (ascending): target layer, held-out R^2 of its K and V maps, k, and the best
    probe R^2 (full-rank one-layer map) over the source layers it reads, for K and V."""
    layers = sorted(metadata["layers"], key=lambda layer: layer["target"])
    probe = metadata.get("probe_r2") or {}

    def best_probe(kind, layer):
        grid = probe.get(kind)
        return max(grid[s][layer["target"]] for s in layer["sources"]) if grid else math.nan

    return {
        "layers": [l["target"] for l in layers],
        "r2_k": [_number(l.get("r2_k")) for l in layers],
        "r2_v": [_number(l.get("r2_v")) for l in layers],
        "k": [len(l["sources"]) for l in layers],
        "probe_k": [best_probe("k", l) for l in layers],
        "probe_v": [best_probe("v", l) for l in layers],
    }


def retention_series(results: dict[str, dict]) -> dict[str, list]:
    """Per task (sorted): retention with its 95% interval, and the accuracy of each condition present."""
    tasks = sorted(results)
    out = {"tasks": tasks, "retention": [_number(results[t].get("retention")) for t in tasks]}
    out["retention_ci"] = [results[t].get("retention_ci") or [math.nan, math.nan] for t in tasks]
    for condition in ("own", "mapped", "control", "source"):
        if all(f"acc_{condition}" in results[t] for t in tasks):
            out[f"acc_{condition}"] = [_number(results[t][f"acc_{condition}"]) for t in tasks]
            out[f"acc_{condition}_ci"] = [results[t].get(f"acc_{condition}_ci") for t in tasks]
    return out


def _number(value) -> float:
    return math.nan if value is None else float(value)


# ---- figures ----------------------------------------------------------------------------------------
def r2_heatmap_figure(metadata: dict, *, name: str | None = None):
    plt = _pyplot()
    probe = metadata["probe_r2"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), constrained_layout=True)
    for ax, kind in zip(axes, ("k", "v")):
        image = ax.imshow(probe[kind], aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1)
        for layer in metadata["layers"]:  # small hollow rings: with k = 8-24 per layer the cells stay readable
            ax.scatter(
                [layer["target"]] * len(layer["sources"]),
                layer["sources"],
                s=9,
                marker="o",
                facecolors="none",
                edgecolors="white",
                linewidths=0.7,
            )
        ax.set_title(f"{kind.upper()}: rings = source layers the stored map reads")
        ax.set_xlabel("target layer")
        ax.set_ylabel("source layer")
        _integer_ticks(ax.xaxis)
        _integer_ticks(ax.yaxis)
        fig.colorbar(image, ax=ax, label="held-out R²")
    structure = compressed_structure(metadata)
    title = "Probe: held-out R² of a full-rank map from one source layer"
    if structure:
        title += f"\n(the stored maps are compressed, {structure}: their own R² is in layer_r2.png)"
    fig.suptitle(f"{name or mapper_name(metadata)}\n{title}")
    return fig


def mapper_name(metadata: dict) -> str:
    """'SRC -> DST (CALIB)' with the models' short names: which mapper a figure shows."""

    def short(role: str) -> str:
        return str((metadata.get(role) or {}).get("model_id", "?")).rstrip("/").split("/")[-1]

    from kvhub.artifact.metadata import calibration_series

    calibration = calibration_series(metadata.get("calibration"))
    return f"{short('source')} → {short('target')}" + (f" ({calibration})" if calibration else "")


def layer_r2_figure(metadata: dict, *, name: str | None = None):
    plt = _pyplot()
    data = layer_series(metadata)
    structure = compressed_structure(metadata)
    fig, ax = plt.subplots(figsize=(8.5, 4), constrained_layout=True)
    xs = data["layers"]
    # V dashed with large hollow squares over K's solid line and filled dots: both visible when equal
    ax.plot(xs, data["r2_k"], "-o", color="tab:blue", markersize=5, label="K")
    ax.plot(
        xs,
        data["r2_v"],
        "--s",
        color="tab:orange",
        markersize=9,
        markerfacecolor="none",
        markeredgewidth=1.5,
        label="V",
    )
    if structure:
        ax.plot(xs, data["probe_k"], ":", color="tab:blue", alpha=0.6, label="K, full-rank probe (best source read)")
        ax.plot(xs, data["probe_v"], "-.", color="tab:orange", alpha=0.6, label="V, full-rank probe (best source read)")
    values = [v for key in ("r2_k", "r2_v") for v in data[key] if not math.isnan(v)]
    bottom = min([0.0] + values)
    ax.set_ylim(bottom - 0.05 * (1 - bottom), 1.05)
    for x, k in zip(xs, data["k"]):
        ax.annotate(str(k), (x, bottom), textcoords="offset points", xytext=(0, 3), fontsize=7, ha="center")
    _integer_ticks(ax.xaxis)
    ax.set_xlabel("target layer (numbers: k, the source layers read)")
    ax.set_ylabel("held-out R²")
    ax.set_title(
        f"{name or mapper_name(metadata)}: held-out R² of the stored maps per target layer"
        + (f" ({structure})" if structure else "")
    )
    ax.legend(fontsize=8)
    return fig


# one colour per condition in every figure, and retention (a ratio, no condition) in none of theirs
CONDITION_COLOURS = {"own": "tab:blue", "mapped": "tab:orange", "control": "tab:gray", "source": "tab:green"}
RETENTION_COLOUR = "tab:purple"


def retention_figure(results: dict[str, dict], *, name: str = ""):
    plt = _pyplot()
    data = retention_series(results)
    tasks = data["tasks"]
    positions = list(range(len(tasks)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(9, 2.6 * len(tasks)), 4), constrained_layout=True)
    lows, highs = _errors(data["retention"], data["retention_ci"])
    left.bar(positions, data["retention"], 0.6, yerr=[lows, highs], capsize=4, color=RETENTION_COLOUR)
    left.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ticks = [_tick_label(task) for task in tasks]
    left.set_xticks(positions, ticks, rotation=20, ha="right")
    left.set_ylabel("retention = acc(mapped) / acc(own)")
    left.set_title("Retention, 95% interval (1 = own)")
    conditions = [c for c in ("own", "mapped", "control", "source") if f"acc_{c}" in data]
    width = 0.8 / max(1, len(conditions))
    for index, condition in enumerate(conditions):
        offset = (index - (len(conditions) - 1) / 2) * width
        cis = [ci or [v, v] for ci, v in zip(data[f"acc_{condition}_ci"], data[f"acc_{condition}"])]
        lows, highs = _errors(data[f"acc_{condition}"], cis)
        right.bar(
            [p + offset for p in positions],
            data[f"acc_{condition}"],
            width,
            capsize=3,
            label=condition,
            color=CONDITION_COLOURS[condition],
            yerr=[lows, highs] if any(lows + highs) else None,
        )
    right.set_xticks(positions, ticks, rotation=20, ha="right")
    right.set_ylabel("accuracy")
    right.set_title("Accuracy per condition")
    right.legend(fontsize=8)
    fig.suptitle(_titled(name, "Task retention of the mapped cache"))
    return fig


def _tick_label(task: str) -> str:
    """'facts-1024@exact_prefix=4,exact_budget=0.08' -> one line per part: a variant's name stays readable."""
    base, _, variant = task.partition("@")
    return "\n".join([base, *variant.split(",")]) if variant else base


def _errors(values: list[float], cis: list) -> tuple[list[float], list[float]]:
    """Error-bar lengths below and above each value (0 where the interval is unknown)."""
    lows, highs = [], []
    for value, (low, high) in zip(values, cis):
        ok = not any(math.isnan(_number(x)) for x in (value, low, high))
        lows.append(max(0.0, value - low) if ok else 0.0)
        highs.append(max(0.0, high - value) if ok else 0.0)
    return lows, highs


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _titled(name: str, title: str) -> str:
    return f"{name}: {title}" if name else title


def r2_heatmap(metadata: dict, path: Path, *, name: str | None = None) -> Path:
    return _save(r2_heatmap_figure(metadata, name=name), path)


def layer_r2(metadata: dict, path: Path, *, name: str | None = None) -> Path:
    return _save(layer_r2_figure(metadata, name=name), path)


def retention_chart(results: dict[str, dict], path: Path, *, name: str = "") -> Path:
    return _save(retention_figure(results, name=name), path)


# ---- curves: the budget (benchmarks/budget_curve.py, kvhub report) and context length (kvhub report) ----------
BUDGET_TITLE = "The budget curve: handoff (map + recompute) and drop (the recompute alone) at the same share"


def budget_figure(
    curve: dict, *, name: str = "", title: str = BUDGET_TITLE, xlabel: str = "recomputed share of the context (%)"
):
    """One panel per entry of ``curve`` (label -> points with ``share``, ``handoff``, ``drop`` (None: not
    measured), their ``*_ci``, ``own`` (None: unknown), ``metric``; :func:`benchmarks.budget_curve` rows or
    :func:`kvhub.eval.curves.budget_curves`): the handoff and drop against 100 x share, the target's own level
    dashed; at most 5 panels a row."""
    plt = _pyplot()
    labels = list(curve)
    columns = min(5, len(labels))
    rows = math.ceil(len(labels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.4 * columns, 3.4 * rows), constrained_layout=True, squeeze=False)
    for ax in axes.flat[len(labels) :]:
        ax.set_visible(False)
    for ax, label in zip(axes.flat, labels):
        points = curve[label]
        shares = [100 * p["share"] for p in points]
        for key, colour in (("handoff", CONDITION_COLOURS["mapped"]), ("drop", "tab:red")):
            values = [_number(p.get(key)) for p in points]
            if all(math.isnan(v) for v in values):
                continue
            lows, highs = _errors(values, [p.get(f"{key}_ci") or [math.nan, math.nan] for p in points])
            ax.errorbar(shares, values, yerr=[lows, highs], fmt="-o", capsize=3, color=colour, label=key)
        if points[0].get("own") is not None:
            ax.axhline(points[0]["own"], color=CONDITION_COLOURS["own"], linestyle="--", linewidth=0.9, label="own")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(points[0]["metric"])
        ax.set_title(label.replace(", ", ",\n"), fontsize=8)  # 'task, fields, select=S' on lines of their own
        ax.legend(fontsize=7)
    fig.suptitle(f"{name}\n{title}" if name else title)
    return fig


def budget_chart(curve: dict, path: Path, **options) -> Path:
    """:func:`budget_figure` (same keyword options) saved to ``path``."""
    return _save(budget_figure(curve, **options), path)


def speedup_figure(curves: dict[str, dict], *, name: str = ""):
    """Speedup against context tokens (log 2 axis), per run of :func:`kvhub.eval.curves.length_curves`: the
    handoff's TTFT gain (full prefill / handoff TTFT) solid, transfer() against re-prefill dashed, one colour a
    run; 1 = break-even."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.2), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (label, series) in enumerate(curves.items()):
        colour = colours[index % len(colours)]
        tokens = series["tokens"]
        ax.plot(tokens, series["ttft_speedup"], "-o", color=colour, label=f"handoff TTFT gain, {label}")
        ax.plot(tokens, series["speedup"], "--s", color=colour, alpha=0.7, label=f"transfer() vs re-prefill, {label}")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("speedup (x; 1 = break-even)")
    ax.set_title("Speedup against context tokens (kvhub bench, medians)")
    ax.legend(fontsize=7)
    fig.suptitle(name)
    return fig


def speedup_chart(curves: dict[str, dict], path: Path, *, name: str = "") -> Path:
    return _save(speedup_figure(curves, name=name), path)
