"""benchmarks/escalation_ops.py, small: the operator counts of one escalation before and after issue 45, beside
the target's own prefill (so the benchmark cannot rot, and its two paths agree on the first logits)."""

import json

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("escalation_ops")


def test_both_paths_are_counted_phase_by_phase_and_agree(script, tmp_path):
    """One short run: every phase of both paths counted, the handoff counts beside them, the two paths' first
    logits equal to fp32 rounding and the one-pass path dispatching fewer operators than the two-pass one
    (counts, not times: the same on every machine).  Planted bugs caught: a phase left out of a total, the
    source's prefill counted into the escalation, the 'after' path still running a first-token forward."""
    out = tmp_path / "ops.json"
    report = script.main(["--lengths", "96", "--host-length", "48", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    (row,) = report["lengths"]
    assert set(row["before"]) == {"map", "select", "recompute", "first_token", "total", "vs_own"}
    assert set(row["after"]) == {"scoring", "map", "select", "recompute", "total", "vs_own", "escalate"}
    for path in ("before", "after"):
        phases = {k: v for k, v in row[path].items() if k not in ("total", "vs_own", "escalate")}
        assert row[path]["total"] == sum(phases.values()) and min(phases.values()) > 0
    assert row["after"]["total"] < row["before"]["total"] and row["handoff"]["after"] < row["handoff"]["before"]
    assert row["source_prefill"] > 0 and row["own"] > row["source_prefill"]  # 28 layers against 24
    assert row["first_logits_max_abs_diff"] < 1e-4 and row["same_first_token"]
    assert report["host"]["before"] > 0 and report["host"]["after"] > 0


@pytest.mark.realmodel
def test_the_real_pair_script_runs(tmp_path):
    """benchmarks/escalation_real.py, smallest: the real Qwen pair (``kvhub fetch models``), one passkey item, one
    short length.  Planted bugs caught: the selection comparing a path with itself (identical spans counted
    but no item), gains computed from the wrong medians."""
    real = load_benchmark("escalation_real")
    report = real.main(["--items", "1", "--lengths", "96", "--repeats", "1", "--out", str(tmp_path / "real.json")])
    assert report["selection"]["items"] == 1 and 0 <= report["selection"]["identical_spans"] <= 1
    (row,) = report["ttft"]
    assert row["gain_after"] == pytest.approx(row["own_median_s"] / row["after_median_s"], rel=1e-2)
