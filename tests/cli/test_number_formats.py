"""Numbers come one way (ux-3 U3-21: integers bare, three decimals, e-notation below 0.001; NaN an empty
cell in tables as null in JSON; the card as the tables), and bench says what its handoff column
recomputes (U3-25: the map alone by default, which kvhub.handoff's default is not)."""

from __future__ import annotations

import contextlib
import math
import types

import pytest
import torch
from click.testing import CliRunner

from kvhub.cli import eval_cmd, eval_tables
from kvhub.cli.main import main
from kvhub.cli.output import format_number
from kvhub.hub.evaluations import bench_section, fmt


@pytest.mark.parametrize(
    "value", [0, 1, 256, 256.0, 0.98553, 0.005814, 0.0004, 2231.4, 0.8, 1.0, -0.25], ids=lambda v: f"U3_21_{v!r}"
)
def test_the_card_formats_numbers_as_the_tables(value):
    assert fmt(value) == format_number(value)


def test_nan_is_an_empty_cell_and_ppl_has_three_decimals():
    results = {
        "hellaswag": {
            "n": 4,
            "acc_own": 0.5,
            "acc_mapped": 0.5,
            "acc_source": 0.25,
            "retention": 1.0,
            "retention_ci": [0.5, 1.5],
            "gap_closed": math.nan,
            "agree_next": 0.75,
            "attn_cosine": math.nan,
        },
        "ppl:lambada/64": {
            "n": 8,
            "ppl_own": 2244.9217,
            "ppl_mapped": 2301.5,
            "ppl_no_context": 4000.0,
            "agreement": 0.5,
        },
    }
    runner = CliRunner()
    with runner.isolation() as (out, _err, *_):
        eval_tables.print_results("ref", results, output_format="tsv")
        text = out.getvalue().decode()
    assert "nan" not in text and "2244.922" in text and "\t4000\t" in text


def test_perplexity_has_a_table_of_its_own():
    """`kvhub eval --task ppl --task hellaswag`: the accuracy table holds accuracies only, and perplexity gets its
    own table whose columns say what each number is (own, mapped, drop, no context), as bare numbers a script
    can read.

    Planted bugs caught: the ppl row filling the accuracy columns (ux-4 U4-11: the no-context perplexity under
    `source`, `drop 2076.791` under `retention [95% CI]`); drop and no context swapped; a missing drop (results
    scored before the drop condition) shifting the columns."""
    accuracy = {"n": 4, "acc_own": 0.25, "acc_mapped": 0.25, "acc_source": 0.25, "retention": 1.0}
    accuracy |= {"retention_ci": [1.0, 1.0], "gap_closed": math.nan, "agree_next": 0.75, "attn_cosine": 1.0}
    ppl = {"n": 4, "ppl_own": 2246.284, "ppl_mapped": 2243.699, "ppl_no_context": 2073.26, "agreement": 0.963}
    results = {"ppl:lambada/256": ppl | {"ppl_drop": 2076.791}, "ppl:lambada/64": ppl, "hellaswag": accuracy}
    with CliRunner().isolation() as (out, _err, *_):
        eval_tables.print_results("ref", results, output_format="tsv")
        lines = out.getvalue().decode().splitlines()
    by_task, header = {}, []
    for line in lines:  # TSV tables follow each other, each under its own header line
        cells = line.split("\t")
        if cells[0] == "task":
            header = cells
        else:
            by_task[cells[0]] = dict(zip(header, cells))
    assert set(by_task["hellaswag"]) == {"task", "n", "own", "mapped", "source", "retention [95% CI]"} | {
        "gap closed",
        "agree",
        "attn cos",
    }
    long = by_task["ppl:lambada/256"]
    assert (long["own ppl"], long["mapped ppl"], long["drop ppl"], long["no context ppl"]) == (
        "2246.284",
        "2243.699",
        "2076.791",
        "2073.260",
    )
    assert by_task["ppl:lambada/64"]["drop ppl"] == "" and by_task["ppl:lambada/64"]["no context ppl"] == "2073.260"
    assert long["agree"] == "0.963" and "retention [95% CI]" not in long


def _fake_bench(monkeypatch, rows):
    class Store(contextlib.nullcontext):
        def add_metrics(self, *args):
            pass

        def reference(self, version):
            return "src:dst:notes@v1"

    store = Store()
    loaded = types.SimpleNamespace(
        mapper=types.SimpleNamespace(to=lambda **k: None),
        target=types.SimpleNamespace(parameters=lambda: iter([torch.zeros(1)])),
        version=types.SimpleNamespace(ref="src:dst:notes@v1"),
        device="cpu",
        source=None,
    )
    monkeypatch.setattr(eval_cmd, "_load_version", lambda *a, **k: (store, loaded))
    import kvhub.eval.continuation as continuation

    monkeypatch.setattr(continuation, "time_transfer_vs_prefill", lambda *a, **k: rows)
    monkeypatch.setattr(continuation, "timing_metric_rows", lambda *a, **k: [])


ROW = {
    "tokens": 64,
    "transfer_median_s": 0.0011,
    "prefill_median_s": 0.002,
    "speedup": 1.8,
    "handoff_ttft_median_s": 0.0004,
    "full_ttft_median_s": 0.003,
    "ttft_speedup": 7.5,
}


def test_bench_times_share_one_format(monkeypatch):
    _fake_bench(monkeypatch, [ROW])
    result = CliRunner().invoke(main, ["bench", "src:dst:notes@v1", "--lengths", "64", "--format", "tsv"])
    assert result.exit_code == 0, result.output
    cells = result.stdout.splitlines()[1].split("\t")
    assert cells[1:3] == ["0.001", "0.002"] and cells[4] == "4.00e-04"


def test_bench_says_the_map_alone(monkeypatch):
    _fake_bench(monkeypatch, [ROW])
    plain = CliRunner().invoke(main, ["bench", "src:dst:notes@v1", "--lengths", "64", "--format", "tsv"])
    assert "map-alone TTFT s" in plain.stdout.splitlines()[0]
    handoff = CliRunner().invoke(
        main, ["bench", "src:dst:notes@v1", "--lengths", "64", "--variant", "handoff", "--format", "tsv"]
    )
    assert handoff.exit_code == 0, handoff.output
    assert "handoff TTFT s" in handoff.stdout.splitlines()[0]


def test_the_cards_speed_rows_name_the_map_alone():
    measured = {
        ("bench", "bench:cpu:bf16:64", "speedup"): {"value": 2.0},
        ("bench", "bench:cpu:bf16:64@exact_prefix=4", "speedup"): {"value": 1.5},
    }
    rows = [line for line in bench_section(measured).splitlines() if line.startswith("| cpu")]
    assert "| map alone |" in rows[0] and "| exact_prefix=4 |" in rows[1]
