"""benchmarks/budget_curve.py on the tiny exact family: every share scored through the one loop, handoff and drop
paired at the same positions, the JSON / table / plot written."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.benchmark_scripts import load_benchmark
from tests.eval.test_gist_suite import corpora  # noqa: F401 - the synthetic corpora
from tests.eval.test_longctx import family, tokenizer  # noqa: F401 - the long-context tests' fixtures


def test_share_variants_recompute_about_the_share_in_all():
    """Known answers: 0 is the map alone; 10% at 1k is 4 + 16 exact tokens and 8.05% selected (the default
    handoff's shape); a share below the 20 exact tokens' selects nothing more.  Planted bug caught: the share
    passed as a percentage (10 instead of 0.1), or the exact tokens counted twice."""
    curve = load_benchmark("budget_curve")
    zero = curve.share_variant(0.0, 1024)
    assert (zero.exact_prefix, zero.exact_suffix, zero.exact_budget) == (0, 0, 0.0)
    ten = curve.share_variant(0.10, 1024)
    assert (ten.exact_prefix, ten.exact_suffix, ten.select) == (4, 16, "source")
    assert ten.exact_budget == pytest.approx(0.10 - 20 / 1024, abs=1e-4)
    assert curve.share_variant(0.01, 1024).exact_budget == 0.0


def test_the_curve_pairs_handoff_and_drop_at_each_share(tokenizer, family, corpora, tmp_path, capsys):  # noqa: F811
    """On the exact family the handoff is the target's own cache at every share (gap closed 1, accuracy = own),
    while drop at share 0 keeps nothing and recomputes more as the share grows (the measured share rises).
    Planted bugs caught: every share scored with one variant (flat measured share), drop read from the handoff."""
    curve = load_benchmark("budget_curve")
    loaded = SimpleNamespace(mapper=family[2], source=family[0], target=family[1], tokenizer=tokenizer)
    from kvhub.eval.gist_suite import build_suite

    two = build_suite(tokenizer, split="test", context_tokens=100, per_domain=1, domains=("multiparty", "licence"))
    report = curve.run_curve(
        loaded,
        tasks=("gist", "agg-count"),
        shares=(0.0, 0.3, 0.6),
        context_tokens=100,
        limit=1,
        seed=0,
        task_items={"gist": two},
    )
    gist, agg = report["curve"]["gist-100"], report["curve"]["agg-count-100"]
    assert [p["share"] for p in gist] == [0.0, 0.3, 0.6] and "gist-100:multiparty" in report["curve"]
    assert all(p["handoff"] == pytest.approx(1.0, abs=1e-2) for p in gist)
    assert gist[0]["drop"] != pytest.approx(1.0, abs=1e-2)
    assert all(p["handoff"] == p["own"] for p in agg)
    measured = [p["recomputed"] for p in agg]
    assert measured[0] == 0 and measured[0] < measured[1] < measured[2], measured
    from kvhub.cli.eval_tables import print_results

    print_results("tiny", report["results"], output_format="tsv")  # kvhub eval's tables: a row per domain, keyed
    shown = capsys.readouterr().out
    assert "gist-100:multiparty" in shown and "gist-100:licence" in shown and "keyed n" in shown
    written = curve.write(report, tmp_path / "curve.json", plot=True)
    assert json.loads(written[0].read_text())["curve"]["gist-100"][1]["share"] == 0.3
    assert "| gist-100 | 2 | 30% |" in written[1].read_text()
    assert written[2].stat().st_size > 1000


def test_a_registered_versions_curve_is_cached_and_resumed_item_by_item(
    tokenizer,  # noqa: F811
    family,  # noqa: F811
    corpora,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """With a registered version (its tensors' sha256) each item's scores go to kvhub eval's per-item cache, so a
    second run (a killed one resumed, or the table re-rendered) scores nothing again; the generation rows come out
    of the same records.  Planted bug caught: the curve's settings without the tensors' hash (nothing cached)."""
    monkeypatch.setenv("KVHUB_CACHE", str(tmp_path / "cache"))
    curve = load_benchmark("budget_curve")
    version = SimpleNamespace(tensors_sha256="ab" * 32)
    loaded = SimpleNamespace(version=version, mapper=family[2], source=family[0], target=family[1], tokenizer=tokenizer)
    from kvhub.eval.gist_suite import build_suite

    one = build_suite(tokenizer, split="test", context_tokens=100, per_domain=1, domains=("licence",))
    options = dict(tasks=("gist",), shares=(0.0, 0.3), context_tokens=100, limit=1, seed=0, task_items={"gist": one})
    first = curve.run_curve(loaded, **options)
    assert list((tmp_path / "cache" / "eval-cache").rglob("*.jsonl"))
    import kvhub.eval.gist as gist

    def scored_again(*args, **kwargs):
        raise AssertionError("an item scored again")

    monkeypatch.setattr(gist, "score_gist_item", scored_again)
    second = curve.run_curve(loaded, **options)
    assert second["curve"]["gist-100"] == first["curve"]["gist-100"]
    assert [p["share"] for p in second["curve"]["gist-100:generation"]] == [0.0, 0.3]
