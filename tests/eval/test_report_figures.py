"""The report's figures (ux-3 U3-26): the heatmap's source-layer marks leave its cells readable, the
per-layer figure names its mapper, and retention has a colour of its own, no condition's."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib", reason="the report's figures need matplotlib: pip install 'kvhub[plots]'")

from kvhub.eval import plots  # noqa: E402

METADATA = {
    "source": {"model_id": "Qwen/Qwen2.5-Coder-0.5B-Instruct"},
    "target": {"model_id": "Qwen/Qwen2.5-Coder-1.5B-Instruct"},
    "calibration": {"name": "legal-docs"},
    "probe_r2": {"k": [[0.5, 0.6], [0.7, 0.8]], "v": [[0.4, 0.5], [0.6, 0.7]]},
    "layers": [
        {"target": 0, "sources": [0, 1], "r2_k": 0.9, "r2_v": 0.8},
        {"target": 1, "sources": [0, 1], "r2_k": 0.85, "r2_v": 0.75},
    ],
    "k": 2,
}


def test_U3_26_heatmap_marks_are_hollow_rings():
    fig = plots.r2_heatmap_figure(METADATA)
    for ax in fig.axes[:2]:
        marks = [c for c in ax.collections if c.get_offsets().size]
        assert marks and all(c.get_facecolors().size == 0 for c in marks)  # hollow: the cell shows through
    assert "Qwen2.5-Coder-0.5B-Instruct → Qwen2.5-Coder-1.5B-Instruct (legal-docs)" in fig.get_suptitle()


def test_U3_26_layer_figure_names_the_mapper():
    fig = plots.layer_r2_figure(METADATA)
    assert "Qwen2.5-Coder-0.5B-Instruct → Qwen2.5-Coder-1.5B-Instruct (legal-docs)" in fig.axes[0].get_title()


def test_U3_26_retention_has_no_conditions_colour():
    from matplotlib.colors import to_rgba

    results = {
        "hellaswag": {
            "acc_own": 0.5,
            "acc_mapped": 0.4,
            "acc_source": 0.3,
            "retention": 0.8,
            "retention_ci": [0.6, 1.0],
        }
    }
    fig = plots.retention_figure(results)
    left, right = fig.axes[:2]
    retention = {tuple(patch.get_facecolor()) for patch in left.patches}
    conditions = {tuple(patch.get_facecolor()) for patch in right.patches}
    assert retention and not retention & conditions
    assert to_rgba(plots.CONDITION_COLOURS["source"]) in conditions
