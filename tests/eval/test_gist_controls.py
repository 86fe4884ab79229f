"""The gist's controls that carry no information (kvhub.eval.gist_controls): the wrong document (another item's
context of the same length, through the same path) and the all-zero mapped cache, scored beside the handoff."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvhub.core.capture import run_model
from kvhub.core.control import control_mapper
from kvhub.errors import ConfigError
from kvhub.eval.gist import GistScore, GistTask, answer_nll, gap_closed, score_gist_item, summarize_gist
from kvhub.eval.gist_controls import shared_ends, wrong_document_ids, zero_mapper
from kvhub.serving.handoff import prepare_cache_counted
from kvhub.serving.spec import Recompute
from tests.eval.test_longctx import FILLER, family, tokenizer  # noqa: F401 - the long-context tests' fixtures


def _task(tokenizer, limit: int) -> GistTask:
    conditions = SimpleNamespace(tokenizer=tokenizer, check_items=lambda items, **_: None, read_gist=None)
    task = GistTask("gist-document", conditions, context_tokens=120, limit=limit)
    return task


@pytest.fixture
def built(tokenizer, monkeypatch):  # noqa: F811
    """gist-document items over the test filler (the real filler needs the evaluation wheel)."""
    from kvhub.eval import longctx

    monkeypatch.setattr(longctx, "filler_paragraphs", lambda seed=0: FILLER)
    return _task(tokenizer, 3).items(), _task(tokenizer, 4).items()


def test_the_wrong_document_is_the_next_items_context_at_this_items_length(built):
    """Each item's wrong document is the next built item's context, cropped to this item's length, between this
    item's own template head and request; the last item's comes from one more item; none depends on --limit.
    Planted bugs caught: the last item's donor wrapped to the first (changes with --limit); a short donor padded
    with the item's own context."""
    items, more = built
    assert [item.id for item in items] == [item.id for item in more[:3]]
    for index, item in enumerate(items):
        wrong, donor = item.wrong_ids, more[index + 1]
        assert item.meta["wrong_document"] == donor.id and wrong == more[index].wrong_ids
        assert len(wrong) == len(item.prompt_ids) and wrong != item.prompt_ids
        head, tail = shared_ends(item.prompt_ids, donor.prompt_ids)
        assert tail >= 1 and wrong[:head] == item.prompt_ids[:head] and wrong[-tail:] == item.prompt_ids[-tail:]
        middle = wrong[head : len(wrong) - tail]
        context = donor.prompt_ids[head : len(donor.prompt_ids) - tail]  # the donor's, repeated when shorter
        assert all(token == context[i % len(context)] for i, token in enumerate(middle))
        assert middle != item.prompt_ids[head : len(wrong) - tail]


def test_a_short_donor_repeats_and_a_donor_without_a_context_of_its_own_is_refused():
    """Planted bugs caught: a short donor padded with the item's own context."""
    prompt, donor = [1, 2, 10, 11, 12, 13, 14, 15, 8, 9], [1, 2, 20, 21, 8, 9]
    assert wrong_document_ids(prompt, donor) == [1, 2, 20, 21, 20, 21, 20, 21, 8, 9]
    with pytest.raises(ConfigError, match="another item"):
        wrong_document_ids(prompt, list(prompt))


def test_the_zero_controls_cache_is_zero_where_mapped_and_exact_where_recomputed(tokenizer, family, built):  # noqa: F811
    """Known answer: through the handoff's path, the zero control's cache is exactly 0 at every mapped position,
    and the recomputed prefix (which reads only itself) is the target's own prefill.
    Planted bugs caught: the zero map keeping the control's mean bias (the no-information control again)."""
    source, target, mapper = family
    zero = zero_mapper(control_mapper(mapper))
    item = built[0][0]
    ids = torch.tensor([item.prompt_ids])
    own = run_model(target, ids[:, :-1])
    cache, positions = prepare_cache_counted(zero, source, target, ids, recompute=Recompute(4, 0), tokenizer=tokenizer)
    assert positions.tolist() == [0, 1, 2, 3]
    for layer, exact in zip(cache.layers, own.layers):
        for mine, theirs in ((layer.keys, exact.keys), (layer.values, exact.values)):
            assert mine.shape == theirs.shape and torch.count_nonzero(mine[:, :, 4:]) == 0
            torch.testing.assert_close(mine[:, :, :4], theirs[:, :, :4], atol=1e-4, rtol=1e-4)


def test_both_controls_are_scored_through_the_mapped_path_and_summarized(tokenizer, family, built):  # noqa: F811
    """Known answers on an exact family (mapped = own): the wrong-document control scores as the target's own
    prefill of the wrong prompt, and not as the handoff; the zero control recomputed whole is own; both appear,
    with the gap each closes and mapped - the best control, in the summary.
    Planted bugs caught: the wrong control mapping the item's own context; the zero control scored with the real
    map; the best control taken as the lowest (mapped - min) rather than the highest."""
    source, target, mapper = family
    item = built[0][0]
    control = control_mapper(mapper)
    plain, everything = score_gist_item(
        item,
        mapper=mapper,
        control=control,
        zero=zero_mapper(control),
        source=source,
        target=target,
        tokenizer=tokenizer,
        variants=[Recompute(), Recompute(0, 0, 1.0, "random", spans="token")],
        answer_tokens=12,
    )
    tail = [item.prompt_ids[-1]] + plain.answer
    wrong_own = answer_nll(target, run_model(target, torch.tensor([item.wrong_ids[:-1]])), tail, len(plain.answer))
    assert plain.nll["wrong"] == pytest.approx(wrong_own, abs=1e-3)
    assert abs(plain.nll["wrong"] - plain.nll["mapped"]) > 1e-3, plain.nll
    assert gap_closed(plain.nll, "mapped") == pytest.approx(1.0, abs=1e-3)
    assert gap_closed(plain.nll, "zero") < 0.5, plain.nll
    assert gap_closed(everything.nll, "zero") == pytest.approx(1.0, abs=1e-3)

    summary = summarize_gist([plain, plain])
    for key in ("nll_wrong", "nll_zero", "gap_closed_wrong", "gap_closed_zero", "gap_closed_map_minus_controls"):
        assert key in summary and f"{key}_ci" in summary
    best = max(gap_closed(plain.nll, c) for c in ("control", "wrong", "zero"))
    assert summary["gap_closed_map_minus_controls"] == pytest.approx(gap_closed(plain.nll, "mapped") - best)


def test_a_result_beats_every_control_only_when_it_beats_the_best_one():
    """Planted bugs caught: mapped - controls computed against the no-information control alone (0.5 here, not
    -0.25: the wrong document closes more than the map)."""
    nll = {"own": 1.0, "floor": 3.0, "mapped": 2.0, "drop": 2.5, "control": 3.0, "wrong": 1.5, "zero": 2.8}
    summary = summarize_gist([GistScore("a", nll, [1])])
    assert summary["gap_closed_wrong"] == pytest.approx(0.75) and summary["gap_closed_zero"] == pytest.approx(0.1)
    assert summary["gap_closed_map_minus_wrong"] == pytest.approx(-0.25)
    assert summary["gap_closed_map_minus_controls"] == pytest.approx(-0.25)
    assert not math.isnan(summary["gap_closed_map_minus_zero"])
