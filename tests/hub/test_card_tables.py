"""The model card's evaluation and speed tables (ux-3 U3-9, U3-10): the target's own cache and the source
model appear once per task whatever the recompute variants evaluated, a count is never a metric, a
label names the variant only when it is not the plain mapped cache, and context sizes sort as numbers."""

from __future__ import annotations

from kvhub.hub.evaluations import bench_section, evaluation_results, evaluations_table


def _eval(task: str, name: str, value, n: int = 4) -> tuple:
    return ("eval", task, name), {"value": value, "n": n}


MEASURED = dict(
    [
        _eval("hellaswag", "acc_own", 0.5),
        _eval("hellaswag", "acc_source", 0.25),
        _eval("hellaswag", "acc_mapped", 0.5),
        _eval("hellaswag", "acc_own_norm", 0.75),
        _eval("hellaswag", "retention", 1.0),
        _eval("hellaswag@exact_prefix=4", "acc_own", 0.5),
        _eval("hellaswag@exact_prefix=4", "acc_source", 0.25),
        _eval("hellaswag@exact_prefix=4", "acc_own_norm", 0.75),
        _eval("hellaswag@exact_prefix=4", "acc_mapped", 0.5),
        _eval("hellaswag@exact_prefix=4", "retention", 1.0),
        _eval("ppl:lambada/256", "tokens", 512),
        _eval("ppl:lambada/256", "ppl_mapped", 12.5),
    ]
)


def test_own_and_source_rows_appear_once_per_task():
    rows = [line for line in evaluations_table(MEASURED).splitlines() if line.startswith("| hellaswag")]
    own = [r for r in rows if "target's own cache" in r and "normalised" not in r]
    source = [r for r in rows if "source model" in r]
    assert len(own) == 1 and len(source) == 1
    [norm] = [r for r in rows if "length-normalised), target's own cache" in r]
    assert "| - |" in norm  # variant-free: no variant


def test_counts_are_not_metrics():
    table = evaluations_table(MEASURED)
    assert "| tokens |" not in table and "512" not in table
    results = evaluation_results(MEASURED, {})
    assert "tokens" not in {r.metric_type for r in results}


def test_labels_name_only_a_real_variant():
    names = {r.metric_name for r in evaluation_results(MEASURED, {})}
    assert "retention (mapped / own accuracy)" in names
    assert "retention (mapped / own accuracy) (exact_prefix=4)" in names
    assert not any(name.endswith("(mapped)") for name in names)
    own_norm = [r for r in evaluation_results(MEASURED, {}) if r.metric_type == "acc_own_norm"]
    assert len(own_norm) == 1 and own_norm[0].metric_config is None


def test_speed_rows_sort_by_context_tokens_as_numbers():
    measured = {("bench", f"bench:cpu:bf16:{tokens}", "speedup"): {"value": 2.0} for tokens in (256, 4096, 64)}
    rows = [line for line in bench_section(measured).splitlines() if line.startswith("| cpu")]
    assert [row.split(" | ")[2] for row in rows] == ["64", "256", "4096"]
