"""`kvhub report`'s curves (ux-4 U4-19): what the handoff keeps against the recompute budget, and its speedup
against context tokens, drawn from the metrics `kvhub eval` and `kvhub bench` stored (no new evaluation); a
one-line command instead of a plot that has fewer than two points; the mapper version in every title."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.eval.continuation import timing_metric_rows
from kvhub.eval.run import metric_rows
from kvhub.store import open_store
from tests.fixtures_store import make_store_artifact

pytest.importorskip("matplotlib", reason="the report's figures need matplotlib: pip install 'kvhub[plots]'")

PREFIX = "exact_prefix=4,exact_suffix=16"
# task as `kvhub eval` names it -> (acc_own, acc_mapped, acc_drop): facts at 1024 tokens, scored by exact match
FACTS = {
    f"facts-1024@{PREFIX}": (0.9, 0.30, 0.10),
    f"facts-1024@{PREFIX},exact_budget=0.08,select=source": (0.9, 0.60, 0.20),
    f"facts-1024@{PREFIX},exact_budget=0.2,select=source": (0.9, 0.80, 0.40),
    f"facts-1024@{PREFIX},exact_budget=0.08,select=random": (0.9, 0.45, 0.15),
}
# a multiple-choice task: retention = mapped / own
HELLASWAG = {"hellaswag": (0.5, 0.40, None), "hellaswag@exact_budget=0.1,select=source": (0.5, 0.45, 0.30)}
# context tokens -> (transfer() speedup, TTFT speedup), the map alone and kvhub.handoff's recompute
BENCH = {"": {256: (1.5, 0.8), 1024: (3.0, 1.6), 4096: (6.0, 2.5)}, PREFIX: {256: (1.2, 0.7), 1024: (2.5, 1.3)}}


def _recall_summary(own: float, mapped: float, drop: float | None) -> dict:
    summary = {"n": 8, "acc_own": own, "acc_mapped": mapped, "acc_mapped_ci": [mapped - 0.1, mapped + 0.1]}
    summary.update(retention=mapped / own, token_acc_mapped=mapped, recomputed_fraction=0.1)
    if drop is not None:
        summary.update(acc_drop=drop, acc_drop_ci=[drop - 0.05, drop + 0.05])
    return summary


def _choice_summary(own: float, mapped: float, drop: float | None) -> dict:
    summary = {"n": 50, "acc_own": own, "acc_mapped": mapped, "acc_source": 0.25, "acc_mapped_norm": mapped}
    summary.update(retention=mapped / own, retention_ci=[mapped / own - 0.1, mapped / own + 0.1])
    if drop is not None:
        summary["acc_drop"] = drop
    return summary


def _bench_rows(lengths: dict) -> list[dict]:
    return [
        {
            "tokens": tokens,
            "speedup": speedup,
            "ttft_speedup": ttft,
            "transfer_median_s": 0.01,
            "prefill_median_s": 0.02,
        }
        for tokens, (speedup, ttft) in lengths.items()
    ]


@pytest.fixture
def blank_maps(monkeypatch):
    from kvhub.eval import plots

    for figure in ("r2_heatmap", "layer_r2"):  # the store fixture's mapper has no probe to draw
        monkeypatch.setattr(plots, figure, lambda metadata, path, **_: path.write_bytes(b""))


def _store(tmp_path, *, evaluations: dict, bench: dict) -> tuple[str, str]:
    """A SQLite store with one tiny registered version and the metrics eval and bench store, through their rows."""
    db = str(tmp_path / "store.db")
    with open_store(db) as store:
        version = store.register(make_store_artifact(tmp_path / "artifact"))
        for task, accuracies in evaluations.items():
            summarize = _choice_summary if task.startswith("hellaswag") else _recall_summary
            store.add_metrics(version, metric_rows(task, summarize(*accuracies), seed=0))
        for variant, lengths in bench.items():
            rows = timing_metric_rows(_bench_rows(lengths), device="cpu", dtype="float32", variant=variant, repeats=3)
            store.add_metrics(version, rows)
        return db, store.reference(version)


def _report(db: str, ref: str, out) -> str:
    result = CliRunner().invoke(main, ["report", ref, "--out", str(out), "--db", db])
    assert result.exit_code == 0, result.output
    return result.output


def _stored_curves(db: str, ref: str) -> tuple[dict, dict]:
    from kvhub.eval import curves

    with open_store(db) as store:
        measurements = store.metrics(store.resolve(ref))
    return curves.budget_curves(measurements), curves.length_curves(measurements)


def check_curves(budget: dict, lengths: dict) -> None:
    """The series equal what was stored: x the --exact-budget (budget) or the context tokens (lengths)."""
    facts = f"facts-1024, {PREFIX}"
    assert set(budget) == {f"{facts}, select=source", f"{facts}, select=random", "hellaswag, select=source"}
    source = budget[f"{facts}, select=source"]
    assert [p["share"] for p in source] == [0.0, 0.08, 0.2]
    assert [p["handoff"] for p in source] == [FACTS[t][1] for t in FACTS if "random" not in t]
    assert [p["drop"] for p in source] == [FACTS[t][2] for t in FACTS if "random" not in t]
    assert {p["metric"] for p in source} == {"exact match"} and {p["own"] for p in source} == {0.9}
    assert source[1]["handoff_ci"] == pytest.approx([0.5, 0.7])
    random = budget[f"{facts}, select=random"]  # the budget-0 point is every selector's
    assert [(p["share"], p["handoff"]) for p in random] == [(0.0, 0.30), (0.08, 0.45)]
    choice = budget["hellaswag, select=source"]
    assert [p["share"] for p in choice] == [0.0, 0.1] and {p["metric"] for p in choice} == {"retention"}
    assert [p["handoff"] for p in choice] == pytest.approx([0.8, 0.9]) and choice[0]["own"] == 1.0
    assert choice[1]["drop"] == pytest.approx(0.6)  # acc_drop / acc_own, at the same budget
    assert choice[0]["drop"] is None  # not stored for the map alone
    assert set(lengths) == {"cpu float32, map alone", f"cpu float32, {PREFIX}"}
    for variant, label in (("", "map alone"), (PREFIX, PREFIX)):
        series = lengths[f"cpu float32, {label}"]
        assert series["tokens"] == sorted(BENCH[variant])
        assert series["speedup"] == [BENCH[variant][t][0] for t in series["tokens"]]
        assert series["ttft_speedup"] == [BENCH[variant][t][1] for t in series["tokens"]]


def _drawn(fig) -> dict[str, dict[str, tuple[list, list]]]:
    """{panel title: {label: (x, y)}} of the labelled lines and error-bar lines each panel draws."""
    from matplotlib.container import ErrorbarContainer

    def data(line):
        return list(line.get_xdata()), list(line.get_ydata())

    drawn = {}
    for ax in fig.axes:
        panel = drawn.setdefault(ax.get_title().replace("\n", " "), {})
        panel.update({line.get_label(): data(line) for line in ax.get_lines() if not line.get_label().startswith("_")})
        panel.update({c.get_label(): data(c.lines[0]) for c in ax.containers if isinstance(c, ErrorbarContainer)})
    return drawn


def test_U4_19_report_draws_both_curves_from_the_stored_metrics(tmp_path, blank_maps, monkeypatch):
    from kvhub.eval import plots

    figures = {}
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figures.setdefault(path.name, fig), save(fig, path))[1])
    db, ref = _store(tmp_path, evaluations={**FACTS, **HELLASWAG}, bench=BENCH)
    out = tmp_path / "report"
    output = _report(db, ref, out)
    for name in ("budget.png", "speedup.png", "retention.png", "report.md"):
        assert (out / name).stat().st_size > 0
    text = (out / "report.md").read_text()
    assert "![recompute budget](budget.png)" in text and "![speedup](speedup.png)" in text
    assert "measures one" not in output + text  # no hint where a curve is drawn
    budget, lengths = _stored_curves(db, ref)
    check_curves(budget, lengths)
    drawn = _drawn(figures["budget.png"])  # what the figure draws is the series
    for label, points in budget.items():
        assert drawn[label]["handoff"] == ([100 * p["share"] for p in points], [p["handoff"] for p in points])
    assert "budget" in figures["budget.png"].axes[0].get_xlabel()
    speed = _drawn(figures["speedup.png"])[figures["speedup.png"].axes[0].get_title()]
    for label, series in lengths.items():
        assert speed[f"handoff TTFT gain, {label}"] == (series["tokens"], series["ttft_speedup"])
        assert speed[f"transfer() vs re-prefill, {label}"] == (series["tokens"], series["speedup"])
    assert "context tokens" in figures["speedup.png"].axes[0].get_xlabel()
    mapper = "Tiny-Coder-0.5B-Instruct → Tiny-Coder-1.5B-Instruct (legal-docs) v1"
    for name in ("budget.png", "speedup.png", "retention.png"):  # U3-26's rest: every figure names the mapper
        assert mapper in figures[name].get_suptitle()


def test_U4_19_a_swapped_axis_is_caught(tmp_path):
    """The check above fails when the budget curve is drawn against context tokens and the other way round."""
    db, ref = _store(tmp_path, evaluations=FACTS | HELLASWAG, bench=BENCH)
    budget, lengths = _stored_curves(db, ref)
    check_curves(budget, lengths)
    swapped = {label: [{**p, "share": 1024} for p in points] for label, points in budget.items()}
    with pytest.raises(AssertionError):
        check_curves(swapped, lengths)
    by_budget = {label: {**s, "tokens": [0.0, 0.08, 0.2][: len(s["tokens"])]} for label, s in lengths.items()}
    with pytest.raises(AssertionError):
        check_curves(budget, by_budget)


def test_U4_19_one_point_gives_the_command_instead_of_a_plot(tmp_path, blank_maps):
    one_budget = {f"facts-1024@{PREFIX},exact_budget=0.08,select=source": (0.9, 0.6, 0.2)}
    db, ref = _store(tmp_path, evaluations=one_budget, bench={"": {1024: (3.0, 1.6)}})
    out = tmp_path / "report"
    output = _report(db, ref, out)
    assert not (out / "budget.png").exists() and not (out / "speedup.png").exists()
    assert _stored_curves(db, ref) == ({}, {})
    lines = (out / "report.md").read_text().splitlines()
    budget = [line for line in lines if "measures one" in line and "kvhub eval" in line]
    speed = [line for line in lines if "measures one" in line and "kvhub bench" in line]
    assert len(budget) == 1 and len(speed) == 1, lines
    assert f"`kvhub eval {ref} --task facts --context-tokens 1024 --exact-budget 0 --exact-budget 0.08" in budget[0]
    assert f"`kvhub bench {ref} --lengths 256,1024,4096`" in speed[0]
    assert "kvhub eval" in output and "kvhub bench" in output  # said on stderr too


def test_U4_19_nothing_stored_names_both_commands(tmp_path, blank_maps):
    db, ref = _store(tmp_path, evaluations={}, bench={})
    out = tmp_path / "report"
    _report(db, ref, out)
    text = (out / "report.md").read_text()
    assert f"`kvhub eval {ref} --task facts --context-tokens 1024 --exact-budget 0" in text
    assert f"`kvhub bench {ref} --lengths 256,1024,4096`" in text
    assert not (out / "retention.png").exists()


def _gist_summary(nll: tuple[float, float], gen: tuple[float, float] | None) -> dict:
    """A gist summary: gap closed by mapped and drop (NLL), and by generation where ``gen`` is given."""
    summary = {"n": 12, "gap_closed_mapped": nll[0], "gap_closed_mapped_ci": [nll[0] - 0.1, nll[0] + 0.1]}
    summary.update(gap_closed_drop=nll[1], gap_closed_drop_ci=[nll[1] - 0.1, nll[1] + 0.1])
    if gen is not None:
        summary.update(gen_gap_closed_mapped=gen[0], gen_gap_closed_mapped_ci=[gen[0] - 0.2, gen[0] + 0.2])
        summary.update(gen_gap_closed_drop=gen[1], gen_gap_closed_drop_ci=[gen[1] - 0.2, gen[1] + 0.2])
    return summary


def test_a_gist_task_scored_by_generation_has_a_second_curve(tmp_path, blank_maps, monkeypatch):
    """Issue 47: the budget curve of a gist task is drawn by NLL and, where generation scored it, by generation
    too, each from its own stored metrics; a task without generation has only the NLL curve."""
    from kvhub.hub.evaluations import metric_label

    stored = {  # task -> (NLL mapped, drop), (generation mapped, drop) or None
        "gist-1024@exact_prefix=4": ((0.5, 0.0), (0.1, 0.0)),
        "gist-1024@exact_prefix=4,exact_budget=0.1,select=source": ((0.8, 0.4), (0.4, 0.3)),
        "gist-1024@exact_prefix=4,exact_budget=0.3,select=source": ((0.9, 0.8), (0.6, 0.55)),
        "gist-4096@exact_prefix=4": ((0.4, 0.0), None),
        "gist-4096@exact_prefix=4,exact_budget=0.1,select=source": ((0.7, 0.3), None),
    }
    db = str(tmp_path / "store.db")
    with open_store(db) as store:
        version = store.register(make_store_artifact(tmp_path / "artifact"))
        for task, (nll, gen) in stored.items():
            store.add_metrics(version, metric_rows(task, _gist_summary(nll, gen), seed=0))
        ref = store.reference(version)
    budget, _ = _stored_curves(db, ref)
    label = "gist-1024, exact_prefix=4, select=source"
    assert set(budget) == {
        label,
        "gist-1024 (generation), exact_prefix=4, select=source",
        "gist-4096, exact_prefix=4, select=source",
    }
    by_nll, by_gen = budget[label], budget["gist-1024 (generation), exact_prefix=4, select=source"]
    assert [p["share"] for p in by_gen] == [0.0, 0.1, 0.3]
    assert [p["handoff"] for p in by_nll] == [0.5, 0.8, 0.9] and [p["drop"] for p in by_nll] == [0.0, 0.4, 0.8]
    assert [p["handoff"] for p in by_gen] == [0.1, 0.4, 0.6] and [p["drop"] for p in by_gen] == [0.0, 0.3, 0.55]
    assert by_gen[1]["handoff_ci"] == pytest.approx([0.2, 0.6]) and by_nll[1]["handoff_ci"] == pytest.approx([0.7, 0.9])
    assert {p["metric"] for p in by_gen} == {"gap closed by generation"} and {p["metric"] for p in by_nll} == {
        "gap closed"
    }
    assert metric_label("gen_gap_closed_mapped") == "gap closed by generation, mapped"
    from kvhub.eval import plots  # `kvhub report` draws both panels, each with its own axis label

    figures = {}
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figures.setdefault(path.name, fig), save(fig, path))[1])
    _report(db, ref, tmp_path / "report")
    drawn = _drawn(figures["budget.png"])
    assert drawn[label]["handoff"] == ([0.0, 10.0, 30.0], [0.5, 0.8, 0.9])
    assert drawn["gist-1024 (generation), exact_prefix=4, select=source"]["drop"] == (
        [0.0, 10.0, 30.0],
        [0.0, 0.3, 0.55],
    )
    labels = {ax.get_title().replace("\n", " "): ax.get_ylabel() for ax in figures["budget.png"].axes}
    assert labels["gist-1024 (generation), exact_prefix=4, select=source"] == "gap closed by generation"


def test_a_judged_gist_task_has_a_curve_by_the_judge(tmp_path, blank_maps):
    """A gist task the judge scored (judge_gap_closed_*) has a third curve, ``TASK (judge)``, from its own stored
    metrics, beside the NLL and generation curves."""
    from kvhub.hub.evaluations import metric_label

    db = str(tmp_path / "store.db")
    with open_store(db) as store:
        version = store.register(make_store_artifact(tmp_path / "artifact"))
        for task, judged in (
            ("gist-1024@exact_prefix=4", (0.2, 0.4)),
            ("gist-1024@exact_prefix=4,exact_budget=0.1,select=source", (0.3, 0.1)),
        ):
            summary = _gist_summary((0.5, 0.0), (0.1, 0.0))
            summary.update(judge_gap_closed_mapped=judged[0], judge_gap_closed_drop=judged[1])
            store.add_metrics(version, metric_rows(task, summary, seed=0))
        ref = store.reference(version)
    budget, _ = _stored_curves(db, ref)
    judge = budget["gist-1024 (judge), exact_prefix=4, select=source"]
    assert [(p["share"], p["handoff"], p["drop"]) for p in judge] == [(0.0, 0.2, 0.4), (0.1, 0.3, 0.1)]
    assert {p["metric"] for p in judge} == {"gap closed by the judge"}
    assert "gist-1024 (generation), exact_prefix=4, select=source" in budget
    assert metric_label("judge_gap_closed_mapped") == "gap closed by the judge, mapped"
