"""`kvhub report`: a clear error naming the plots extra without matplotlib (and no folder left behind); figures with
titles, integer layer ticks, K and V both visible, the stored (compressed) maps' true R^2, and retention plotted."""

from __future__ import annotations

import json

import sys

import pytest
import torch
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.core.capture import capture, run_model
from kvhub.core.rope import Rotary, strip_rope
from kvhub.fitting.fit import fit
from kvhub.fitting.options import FitOptions
from kvhub.store import open_store
from tests.tinymodels import exact_family_target, make_model

pytest.importorskip("matplotlib", reason="the report's figures need matplotlib: pip install 'kvhub[plots]'")

TASKS = {"hellaswag": (0.8, 0.6, 0.3, 0.75, (0.5, 0.95)), "piqa": (0.7, 0.7, 0.6, 1.0, (0.8, 1.2))}


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    """A rank-2 mapper of an exact family (its R^2 far below the full-rank probe's 1), registered with task
    metrics; returns (db, ref, mapper, source, target, held-out ids)."""
    source = make_model("qwen2", num_hidden_layers=2, seed=11)
    target, _ = exact_family_target(source, insert_before=(1,))
    ids = torch.randint(1, 128, (16, 32), generator=torch.Generator().manual_seed(0))
    mapper = fit(
        source,
        target,
        ids[:12],
        ids[12:],
        source_id="tiny-src",
        target_id="tiny-dst",
        calibration={"name": "random-ids"},
        options=FitOptions(top_k=1, ridge_lambda=1e-3, rank=2, stride=1, batch_size=8),
    )
    root = tmp_path_factory.mktemp("report")
    mapper.save(root / "mapper")
    db = str(root / "store.db")
    with open_store(db) as store:
        version = store.register(root / "mapper")
        for task, (own, mapped, src, retention, (low, high)) in TASKS.items():
            rows = {
                "acc_own": own,
                "acc_mapped": mapped,
                "acc_source": src,
                "retention": retention,
                "retention_ci_low": low,
                "retention_ci_high": high,
            }
            store.add_metrics(
                version, [{"name": k, "value": v, "task": task, "split": "eval", "n": 50} for k, v in rows.items()]
            )
        ref = version.ref
    return db, ref, mapper, source, target, ids[12:]


def _true_r2(mapper, source, target, held) -> dict[int, tuple[float, float]]:
    """Held-out R^2 of each stored map, computed from the models: map the source's cache, strip the target's
    RoPE, compare with the target's own K/V (pooled over tokens and dims, centred per dim).  The maps as
    stored (deshrink off): R^2 describes the ridge prediction, which de-shrinking rescales at transfer."""
    cache = run_model(source, held)
    positions = torch.arange(held.shape[1])[None]
    as_fitted = mapper.deshrunk("off")
    mapped = as_fitted.map_layers(
        [l.keys for l in cache.layers], [l.values for l in cache.layers], positions, dtype=torch.float32
    )
    own = capture(target, held)
    rotary = Rotary.from_model(target)

    def rows(x):  # (B, H, T, D) -> (B*T, H*D)
        return x.transpose(1, 2).reshape(-1, x.shape[1] * x.shape[3])

    def r2(y, estimate):
        return float(1 - ((y - estimate) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())

    out = {}
    for layer, (keys, values) in zip(mapper.layers, mapped):
        m = layer["target"]
        keys = strip_rope(keys.float(), *rotary.cos_sin(positions.expand(held.shape[0], -1), m))
        out[m] = (r2(own.keys[m], rows(keys)), r2(own.values[m], rows(values)))
    return out


def test_without_matplotlib_report_names_the_extra_and_writes_nothing(compressed, tmp_path, monkeypatch):
    db, ref, *_ = compressed
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["report", ref, "--out", str(out), "--db", db])
    assert result.exit_code == 2, result.output
    assert "pip install 'kvhub[plots]'" in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_report_writes_the_figures_and_summary(compressed, tmp_path):
    db, ref, *_ = compressed
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["report", ref, "--out", str(out), "--db", db])
    assert result.exit_code == 0, result.output
    for name in ("r2_heatmap.png", "layer_r2.png", "retention.png", "report.md"):
        assert (out / name).stat().st_size > 0
    text = (out / "report.md").read_text()
    assert "rank 2" in text and "| hellaswag | 50 | 0.800 | 0.600 | 0.300 | 0.750 [0.50, 0.95] |" in text
    as_json = CliRunner().invoke(main, ["report", ref, "--out", str(tmp_path / "again"), "--db", db, "--json"])
    listed = json.loads(as_json.stdout)  # U15: one output switch, the full ref
    assert listed["ref"].startswith(ref.split("@")[0]) and str(tmp_path / "again" / "report.md") in listed["files"]
    missing = CliRunner().invoke(main, ["report", ref, "--out", str(tmp_path / "typo"), "--db", db + ".typo"])
    assert missing.exit_code != 0 and not (tmp_path / "typo").exists()


def test_layer_figure_shows_the_stored_compressed_maps_true_r2(compressed):
    import matplotlib.pyplot as plt

    from kvhub.eval.plots import layer_r2_figure, layer_series

    _, _, mapper, source, target, held = compressed
    data = layer_series(mapper.metadata)
    truth = _true_r2(mapper, source, target, held)
    assert data["layers"] == sorted(truth)
    for m, r2_k, r2_v, probe_k in zip(data["layers"], data["r2_k"], data["r2_v"], data["probe_k"]):
        assert r2_k == pytest.approx(truth[m][0], abs=1e-4) and r2_v == pytest.approx(truth[m][1], abs=1e-4)
        assert r2_k < probe_k - 0.1  # rank 2: well below the full-rank probe the heatmap shows
    fig = layer_r2_figure(mapper.metadata)
    try:
        ax = fig.axes[0]
        assert "stored maps" in ax.get_title() and "rank 2" in ax.get_title()
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert list(lines["K"].get_ydata()) == data["r2_k"] and list(lines["V"].get_ydata()) == data["r2_v"]
        k, v = lines["K"], lines["V"]  # distinguishable where they coincide
        assert (k.get_linestyle(), k.get_marker()) != (v.get_linestyle(), v.get_marker())
        assert v.get_markerfacecolor() == "none" and v.get_markersize() > k.get_markersize()
        assert all(float(t).is_integer() for t in ax.get_xticks())
    finally:
        plt.close(fig)


def test_heatmap_and_retention_figures(compressed):
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer

    from kvhub.eval.report import task_results as _task_results
    from kvhub.eval.plots import r2_heatmap_figure, retention_figure

    db, ref, mapper, *_ = compressed
    heatmap = r2_heatmap_figure(mapper.metadata)
    try:
        assert "full-rank" in heatmap._suptitle.get_text() and "rank 2" in heatmap._suptitle.get_text()
        for ax in heatmap.axes[:2]:
            assert ax.get_title() and all(float(t).is_integer() for t in [*ax.get_xticks(), *ax.get_yticks()])
    finally:
        plt.close(heatmap)
    with open_store(db) as store:
        results = _task_results(store.metrics(store.resolve(ref)))
    assert results["hellaswag"]["retention_ci"] == [0.5, 0.95]
    figure = retention_figure(results)
    try:
        retention_ax, accuracy_ax = figure.axes[:2]
        assert "etention" in retention_ax.get_title() and accuracy_ax.get_title()
        heights = [bar.get_height() for bar in retention_ax.patches]
        assert heights == [TASKS[t][3] for t in sorted(TASKS)]  # retention itself, not the accuracies
        bars = [c for c in accuracy_ax.containers if isinstance(c, BarContainer)]
        assert [c.get_label() for c in bars] == ["own", "mapped", "source"]
        assert [bar.get_height() for bar in bars[0]] == [TASKS[t][0] for t in sorted(TASKS)]
    finally:
        plt.close(figure)
