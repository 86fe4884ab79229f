"""`kvhub report` tells what `show` and the card tell (ux-3 U3-11): after two runs of an evaluation the
newest one's n, and every stored evaluation, perplexity included."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.store import open_store
from tests.fixtures_store import make_store_artifact

pytest.importorskip("matplotlib", reason="the report's figures need matplotlib: pip install 'kvhub[plots]'")


def _run(version, store, *, n: int, value: float) -> None:
    rows = {"acc_own": 0.5, "acc_mapped": value, "acc_source": 0.25, "retention": value / 0.5}
    store.add_metrics(
        version, [{"name": k, "value": v, "task": "hellaswag", "split": "eval", "n": n} for k, v in rows.items()]
    )


def test_U3_11_report_shows_the_newest_run_and_perplexity(tmp_path, monkeypatch):
    from kvhub.eval import plots

    for figure in ("r2_heatmap", "layer_r2"):  # the store fixture's mapper has no probe to draw
        monkeypatch.setattr(plots, figure, lambda metadata, path, **_: path.write_bytes(b""))
    db = str(tmp_path / "store.db")
    with open_store(db) as store:
        version = store.register(make_store_artifact(tmp_path / "a"))
        _run(version, store, n=8, value=0.375)
        _run(version, store, n=4, value=0.5)
        store.add_metrics(
            version, [{"name": "ppl_mapped", "value": 12.5, "task": "ppl:lambada/256", "split": "eval", "n": 16}]
        )
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["report", version.ref, "--out", str(out), "--db", db])
    assert result.exit_code == 0, result.output
    text = (out / "report.md").read_text()
    assert "| hellaswag | 4 | 0.500 | 0.500 |" in text  # n and accuracy of the newest run, as show gives them
    assert "| hellaswag | 8 |" not in text
    assert "ppl:lambada/256" in text and "12.5" in text
