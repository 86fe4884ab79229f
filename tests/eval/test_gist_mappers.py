"""benchmarks/gist_mappers.py: two mappers' gist samples paired by item, known answers."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark

gist_mappers = load_benchmark("gist_mappers")


def _write(directory, records) -> None:
    directory.mkdir(parents=True)
    path = directory / "samples_gist-dev-1024_x.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _record(doc, mapped_nll, mapped_rouge, *, variant="handoff"):
    return {
        "task": "gist-dev-1024",
        "variant": variant,
        "doc_id": doc,
        "nll": {"own": 1.0, "floor": 3.0, "mapped": mapped_nll, "control": 2.8},
        "rouge": {"own": 1.0, "floor": 0.2, "mapped": mapped_rouge, "control": 0.2},
    }


def test_the_gap_each_mapper_closes_and_their_paired_difference(tmp_path, capsys):
    """A closes (3 - 2) / 2 = 0.5 by NLL and (0.6 - 0.2) / 0.8 = 0.5 by generation on both items; B 0.75 and 1.0:
    differences 0.25 and 0.5 with a zero-width interval (every item differs alike); an item only A scored is left
    out and counted; mapped - best control is mapped - control's (3 - 2.8) / 2 = 0.1 by NLL."""
    _write(tmp_path / "a", [_record("x", 2.0, 0.6), _record("y", 2.0, 0.6), _record("z", 1.0, 1.0)])
    _write(tmp_path / "b", [_record("x", 1.5, 1.0), _record("y", 1.5, 1.0)])
    gist_mappers.main([str(tmp_path / "a"), str(tmp_path / "b"), "--names", "v1,v2", "--out", str(tmp_path / "o.json")])
    result = json.loads((tmp_path / "o.json").read_text())["gist-dev-1024@handoff"]
    assert (result["n"], result["left_out"]) == (2, 1)
    nll, rouge = result["nll"], result["rouge"]
    assert (nll["a"], nll["b"], nll["difference"]) == pytest.approx((0.5, 0.75, 0.25))
    assert nll["difference_ci"] == pytest.approx([0.25, 0.25])
    assert nll["a_minus_best_control"] == pytest.approx(0.4)
    assert (rouge["a"], rouge["b"], rouge["difference"]) == pytest.approx((0.5, 1.0, 0.5))
    assert "| gist-dev-1024@handoff | 2 | NLL | 0.50 | 0.75 | +0.25 [+0.25, +0.25]" in capsys.readouterr().out


def test_no_item_scored_on_both_sides_is_an_error_that_says_so(tmp_path):
    _write(tmp_path / "a", [_record("x", 2.0, 0.6)])
    _write(tmp_path / "b", [_record("y", 2.0, 0.6)])
    with pytest.raises(SystemExit, match="no gist item scored on both sides"):
        gist_mappers.main([str(tmp_path / "a"), str(tmp_path / "b")])
