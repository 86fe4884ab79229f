"""Headless matplotlib figures of a mapper: R^2 heatmaps, per-layer held-out R^2, task retention."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def r2_heatmap(metadata: dict, path: Path) -> Path:
    """Probe R^2 (source layer x target layer) for K and V; selected source layers marked with dots."""
    plt = _pyplot()
    probe = metadata["probe_r2"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), constrained_layout=True)
    for ax, kind in zip(axes, ("k", "v")):
        image = ax.imshow(probe[kind], aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1)
        for layer in metadata["layers"]:
            ax.scatter([layer["target"]] * len(layer["sources"]), layer["sources"], s=8, c="red", marker="o")
        ax.set_title(f"held-out R² of one-layer maps ({kind.upper()}); red: selected")
        ax.set_xlabel("target layer")
        ax.set_ylabel("source layer")
        fig.colorbar(image, ax=ax)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def layer_r2(metadata: dict, path: Path) -> Path:
    """Held-out R^2 per target layer for K and V, with k per layer."""
    plt = _pyplot()
    layers = metadata["layers"]
    xs = [l["target"] for l in layers]
    fig, ax = plt.subplots(figsize=(8, 3.5), constrained_layout=True)
    ax.plot(xs, [l["r2_k"] for l in layers], marker="o", label="K")
    ax.plot(xs, [l["r2_v"] for l in layers], marker="s", label="V")
    for l in layers:
        ax.annotate(str(len(l["sources"])), (l["target"], 0.02), fontsize=7, ha="center")
    ax.set_ylim(0, 1)
    ax.set_xlabel("target layer (numbers: k)")
    ax.set_ylabel("held-out R²")
    ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def retention_bars(results: dict[str, dict], path: Path) -> Path:
    """Accuracy own / mapped / source per task with bootstrap 95% intervals."""
    plt = _pyplot()
    tasks = sorted(results)
    fig, ax = plt.subplots(figsize=(max(5, 1.8 * len(tasks)), 3.5), constrained_layout=True)
    width = 0.27
    for offset, cond in ((-width, "own"), (0, "mapped"), (width, "source")):
        values = [results[t][f"acc_{cond}"] for t in tasks]
        cis = [results[t].get(f"acc_{cond}_ci", [v, v]) for t, v in zip(tasks, values)]
        errors = [[v - c[0] for v, c in zip(values, cis)], [c[1] - v for v, c in zip(values, cis)]]
        ax.bar([i + offset for i in range(len(tasks))], values, width, yerr=errors, capsize=3, label=cond)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("accuracy")
    ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
