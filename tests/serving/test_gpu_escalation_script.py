"""benchmarks/gpu_escalation.py on the CPU with tiny configs (a smoke test, so the prepared GPU run cannot
rot: the GPU run is the same code on the real configs)."""

import json

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("gpu_escalation")


def test_the_escalation_is_timed_beside_the_targets_own_prefill(script, tmp_path):
    out = tmp_path / "escalation.json"
    script.main(
        [
            "--tiny",
            "--dtype",
            "float32",
            "--repeats",
            "1",
            "--lengths",
            "40",
            "--pairs",
            "qwen3-14b->32b",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert "random weights" in report["weights"] and report["tiny"]
    pair = report["pairs"]["qwen3-14b->32b"]
    assert (pair["source"], pair["target"]) == ("Qwen/Qwen3-14B", "Qwen/Qwen3-32B")
    (row,) = pair["lengths"]
    assert row["tokens"] == 40 and len(row["own_s"]) == len(row["escalation_s"]) == len(row["map_only_s"]) == 1
    assert row["own_median_s"] > 0 and row["escalation_median_s"] > 0
    # 39 context tokens: the first 4 and last 16 recomputed, 8% of 39 rounds to no whole span beyond them
    assert 20 <= row["recomputed_tokens"] <= 39 and row["exact_fraction"] == (row["recomputed_tokens"] + 1) / 39
    assert row["speedup"] == row["own_median_s"] / row["escalation_median_s"]


def test_every_pair_has_real_shapes_and_a_tiny_form(script):
    from kvhub.fitting.plan import ModelShape

    for name, (source, target) in script.PAIRS.items():
        real = [ModelShape.from_config(script.config_of(spec, tiny=False)) for spec in (source, target)]
        assert real[1].parameters() > 2 * real[0].parameters() > 0, name  # a 7B- or 32B-class target
        tiny = [script.config_of(spec, tiny=True, depth=depth) for spec, depth in ((source, 0), (target, 2))]
        assert tiny[0]["model_type"] == tiny[1]["model_type"] and tiny[1]["num_hidden_layers"] == 5


def test_a_spent_budget_skips_instead_of_overrunning(script, tmp_path):
    out = tmp_path / "skipped.json"
    report = script.main(["--tiny", "--budget-s", "0", "--out", str(out)])
    assert all("skipped" in pair for pair in report["pairs"].values())
    assert json.loads(out.read_text())["pairs"].keys() == script.PAIRS.keys()
