"""The gist measure (kvhub.eval.gist): the target's own answer about the whole context, scored teacher-forced
under own / mapped / control / no-context floor, and the gap a handoff closes."""

import math

import pytest

from kvhub.core.control import control_mapper
from kvhub.eval.gist import GIST_CONDITIONS, GistScore, gap_closed, gist_items, score_gist_item, summarize_gist
from kvhub.serving.spec import Recompute
from tests.eval.test_longctx import FILLER, family, tokenizer  # noqa: F401 - the long-context tests' fixtures


def test_gap_closed_is_one_for_own_zero_for_the_floor_and_negative_below_it():
    nll = {"own": 1.0, "floor": 3.0, "mapped": 1.5, "control": 3.5}
    assert gap_closed(nll, "own") == 1.0 and gap_closed(nll, "floor") == 0.0
    assert gap_closed(nll, "mapped") == 0.75 and gap_closed(nll, "control") == -0.25
    assert math.isnan(gap_closed({"own": 2.0, "floor": 2.0, "mapped": 1.0}, "mapped"))


def test_the_summary_is_the_gap_closed_by_the_mean_nlls_with_intervals():
    scores = [
        GistScore("a", {"own": 1.0, "floor": 3.0, "mapped": 2.0, "control": 3.0}, [1]),
        GistScore("b", {"own": 1.0, "floor": 5.0, "mapped": 2.0, "control": 4.0}, [1]),
    ]
    summary = summarize_gist(scores)
    assert summary["nll_mapped"] == 2.0 and summary["nll_floor"] == 4.0
    assert summary["gap_closed_mapped"] == pytest.approx(2.0 / 3.0)  # (4 - 2) / (4 - 1), not the mean of ratios
    assert summary["gap_closed_control"] == pytest.approx(0.5 / 3.0)
    # two items: a resample is aa, ab, ba or bb (a quarter each), so the 95% interval runs from aa's gap,
    # (3 - 2) / (3 - 1), to bb's, (5 - 2) / (5 - 1)
    assert summary["gap_closed_mapped_ci"] == pytest.approx([0.5, 0.75])
    assert summary["gap_closed_control_ci"] == pytest.approx([0.0, 0.25])


def test_items_ask_about_the_whole_context(tokenizer):
    chat, document = (
        gist_items(kind, tokenizer, context_tokens=200, n=2, seed=1, filler=FILLER)[0] for kind in ("chat", "document")
    )
    assert "Summarize what we discussed" in tokenizer.decode(chat.prompt_ids)
    assert tokenizer.decode(document.prompt_ids).rstrip().endswith("<s>assistant")
    assert chat.meta["context_tokens"] >= 200 and document.meta["context_tokens"] >= 200
    assert (
        gist_items("chat", tokenizer, context_tokens=200, n=2, seed=1, filler=FILLER)[0].prompt_ids == chat.prompt_ids
    )


def _score(family, tokenizer, item, variants):
    source, target, mapper = family
    return score_gist_item(
        item,
        mapper=mapper,
        control=control_mapper(mapper),
        source=source,
        target=target,
        tokenizer=tokenizer,
        variants=variants,
        answer_tokens=12,
    )


def test_an_exact_map_closes_the_whole_gap_and_the_bare_control_does_not(tokenizer, family):
    """Known answers: on an exact family the mapped cache is own (gap closed 1.0); the no-information
    control with no recompute closes nothing or less; recomputing every token of it is own again."""
    item = gist_items("document", tokenizer, context_tokens=120, n=1, seed=0, filler=FILLER)[0]
    plain, everything = _score(family, tokenizer, item, [Recompute(), Recompute(0, 0, 1.0, "random", spans="token")])
    assert plain.nll["own"] < plain.nll["floor"], plain.nll  # the context informs the answer at all
    assert gap_closed(plain.nll, "mapped") == pytest.approx(1.0, abs=1e-3)
    assert gap_closed(plain.nll, "control") <= 0.05, plain.nll
    assert gap_closed(everything.nll, "control") == pytest.approx(1.0, abs=1e-3)
    assert set(plain.nll) == set(GIST_CONDITIONS) and len(plain.answer) == 12


def test_generation_scores_an_exact_map_as_own_and_the_summary_closes_the_gap_by_rouge(tokenizer, family):
    """Known answers by generation: greedy from the target's own cache writes its own answer (ROUGE-L 1), so
    does greedy from an exact map; the summary's generation gap is (ROUGE - floor) / (own - floor)."""
    item = gist_items("document", tokenizer, context_tokens=120, n=1, seed=0, filler=FILLER)[0]
    (plain,) = _score(family, tokenizer, item, [Recompute()])
    assert set(plain.rouge) == set(GIST_CONDITIONS)
    assert plain.rouge["own"] == 1.0 and plain.rouge["mapped"] == 1.0
    assert 0.0 <= plain.rouge["floor"] <= 1.0
    scores = [
        GistScore("a", {"own": 1.0, "floor": 3.0, "mapped": 2.0, "control": 3.0}, [1], rouge=rouge)
        for rouge in (
            {"own": 1.0, "floor": 0.2, "mapped": 0.6, "control": 0.2},
            {"own": 1.0, "floor": 0.0, "mapped": 1.0, "control": 0.4},
        )
    ]
    summary = summarize_gist(scores)
    assert summary["rouge_mapped"] == pytest.approx(0.8) and summary["rouge_floor"] == pytest.approx(0.1)
    assert summary["gen_gap_closed_mapped"] == pytest.approx(0.7 / 0.9)  # the ratio of the means
    assert summary["gen_gap_closed_map_minus_control"] == pytest.approx(0.7 / 0.9 - 0.2 / 0.9)
    # one item without generation scores: the summary has none (never a mean over some of the items)
    assert "rouge_mapped" not in summarize_gist([*scores, GistScore("c", scores[0].nll, [1])])


def test_a_cached_record_without_generation_scores_is_scored_again():
    """read_gist_score(generated=True) refuses a record written before generation was scored (the loop then
    scores that item again) and reads one that has it."""
    from kvhub.eval.gist import read_gist_score

    nll = {c: 1.0 for c in GIST_CONDITIONS}
    old = GistScore("a", nll, [1]).as_dict()
    with pytest.raises(ValueError, match="generation"):
        read_gist_score(old, generated=True)
    assert read_gist_score(old).rouge == {}
    new = GistScore("a", nll, [1], rouge=dict.fromkeys(GIST_CONDITIONS, 0.5)).as_dict()
    assert read_gist_score(new, generated=True).rouge["mapped"] == 0.5
