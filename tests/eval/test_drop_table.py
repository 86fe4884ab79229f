"""benchmarks/drop_table.py: one table over several kvhub eval documents, task by task."""

from tests.benchmark_scripts import load_benchmark

HANDOFF = "exact_prefix=4,exact_suffix=16,exact_budget=0.08,select=source"


def _facts(mapped: float, drop: float, n: int = 8) -> dict:
    return {
        "acc_own": 1.0,
        "acc_mapped": mapped,
        "acc_drop": drop,
        "acc_control": 0.5,
        "acc_floor": 0.0,
        "n": n,
        "recomputed_fraction": 0.099,
        "map_minus_drop": mapped - drop,
        "map_minus_drop_ci": [0.0, 0.5],
    }


def _gist(closed: float) -> dict:
    return {
        "gap_closed_mapped": closed,
        "gap_closed_drop": 0.05,
        "gap_closed_control": 0.07,
        "n": 8,
        "gap_closed_map_minus_drop": closed - 0.05,
        "gap_closed_map_minus_drop_ci": [0.1, 0.9],
    }


def test_rows_are_grouped_by_task_then_context_then_document():
    """Tasks follow the table's order (facts before the gist) and lengths ascend; within a task each document's
    row keeps the documents' order and names its map.  Planted bugs caught: rows per document instead of per
    task; 4096 sorted before 1024 as strings; the label dropped."""
    table = load_benchmark("drop_table")
    ridge = {
        "config": {"map_kind": "ridge", "calibration": "mixed"},
        "results": {
            "gist-chat-1024@" + HANDOFF: _gist(0.83),
            "gist-chat-1024": {"gap_closed_mapped": 0.78},
            "facts-4096@" + HANDOFF: _facts(1.0, 1.0, 2),
            "facts-1024@" + HANDOFF: _facts(1.0, 0.75),
        },
    }
    mlp = {
        "config": {"map_kind": "mlp", "calibration": "mixed"},
        "results": {"facts-1024@" + HANDOFF: _facts(0.88, 0.75), "gist-chat-1024@" + HANDOFF: _gist(0.84)},
    }
    lines = table.table([(table.label_of(ridge), ridge), (table.label_of(mlp), mlp)])
    body = [line.split(" | ")[:2] for line in lines[2:]]
    assert body == [
        ["| facts-1024", "ridge mixed"],
        ["| facts-1024", "mlp mixed"],
        ["| facts-4096", "ridge mixed"],
        ["| gist-chat-1024", "ridge mixed"],
        ["| gist-chat-1024", "mlp mixed"],
    ]
    assert "| 0.83 | 0.05 | 0.07 |" in lines[5] and "+0.78 [+0.10, +0.90]" in lines[5]


def test_a_document_without_a_map_kind_is_ridge():
    assert load_benchmark("drop_table").label_of({"config": {"calibration": "legal-docs"}}) == "ridge legal-docs"
