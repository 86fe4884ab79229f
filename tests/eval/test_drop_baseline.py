"""The `drop` baseline (kvhub.serving.drop) and where it is scored: facts, the gist, the follow-up turn.

Known answers: a drop cache of every position is the target's own; a drop cache continued at position T is
one forward pass over the kept tokens + the tail at their positions; a token added at a later turn sees
exactly the cached entries before its position.
"""

import pytest
import torch

from kvhub.core.capture import run_model
from kvhub.core.control import control_mapper
from kvhub.eval.followup import FOLLOWUP_CONDITIONS, followup_items, score_followup_item
from kvhub.eval.gist import GistScore, gist_items, score_gist_item, summarize_gist
from kvhub.eval.longctx import LONG_CONDITIONS, answer_score, fact_items, score_recall_item
from kvhub.eval.recall_tasks import FollowupTask
from kvhub.serving import drop
from kvhub.serving.recompute import Recompute
from tests.eval.test_longctx import FILLER, family, tokenizer  # noqa: F401 - the long-context tests' fixtures


def _ids(n, seed=0):
    return torch.randint(0, 600, (1, n), generator=torch.Generator().manual_seed(seed))


def test_drop_of_every_position_is_the_targets_own_cache(family):
    _, target, _ = family
    context, tail = _ids(40), _ids(6, seed=1)[0].tolist()
    own = answer_score(target, run_model(target, context), tail, 5)
    kept = answer_score(target, drop.drop_cache(target, context, torch.arange(40)), tail, 5, start=40)
    assert kept[2] == pytest.approx(own[2], abs=1e-4) and kept[3] == own[3]


def test_drop_continues_at_the_true_position_over_the_kept_tokens_only(family):
    """One forward pass over kept tokens + tail at positions (R, T, T+1, ...) is what a drop cache gives.
    Planted bug caught: continuing at position |R| (the cache's length) instead of T changes every logit."""
    _, target, _ = family
    context, tail = _ids(40), _ids(6, seed=1)[0].tolist()
    kept = torch.tensor([0, 1, 2, 9, 10, 11, 25, 26, 38])
    got = answer_score(target, drop.drop_cache(target, context, kept), tail, 5, start=40)
    ids = torch.cat([context[:, kept], torch.tensor([tail])], dim=1)
    positions = torch.cat([kept, torch.arange(40, 46)])[None]
    with torch.no_grad():
        logits = target(input_ids=ids, position_ids=positions).logits[0, -6:-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tail[1:])[:, None]).sum()
    assert got[2] == pytest.approx(float(want), abs=1e-3)
    wrong = answer_score(target, drop.drop_cache(target, context, kept), tail, 5)  # continues at |R| = 9
    assert abs(wrong[2] - got[2]) > 1e-3


def test_tokens_added_at_a_later_turn_see_only_earlier_positions(family):
    """Known answer: an added token's K/V equal those of a drop cache built with it from the start (both see
    the kept entries before its position).  Planted bug caught: no mask, so it sees later entries too."""
    _, target, _ = family
    context = _ids(40)
    first, later = torch.tensor([0, 1, 2, 20, 21, 30]), torch.tensor([10, 11, 12])
    cache = drop.drop_cache(target, context, first)
    assert drop.add_context_tokens(target, cache, context, torch.cat([later, first[:2]])).tolist() == [10, 11, 12]
    together = drop.drop_cache(target, context, torch.sort(torch.cat([first, later])).values)
    order = drop.entry_positions(together).tolist()
    for added, own in zip(cache.layers, together.layers):
        for index, position in enumerate([10, 11, 12]):
            torch.testing.assert_close(
                added.keys[:, :, len(first) + index], own.keys[:, :, order.index(position)], atol=1e-4, rtol=1e-4
            )
    assert drop.entry_positions(cache).tolist() == first.tolist() + later.tolist()


def test_facts_score_drop_beside_the_handoff(tokenizer, family):
    """Exact family: with every position recomputed, drop is the own cache; with a partial selection it keeps
    fewer tokens than the handoff and scores another log-likelihood (the comparison can fail)."""
    source, target, mapper = family
    item = fact_items(tokenizer, FILLER, context_tokens=150, n=1, seed=2)[0]
    variants = [Recompute(2, 4, 1.0, "source"), Recompute(2, 4, 0.1, "source")]
    whole, part = score_recall_item(
        item,
        mapper=mapper,
        control=control_mapper(mapper),
        source=source,
        target=target,
        tokenizer=tokenizer,
        variants=variants,
    )
    assert tuple(whole.exact) == LONG_CONDITIONS
    assert whole.logp["drop"] == pytest.approx(whole.logp["own"], abs=1e-3)
    assert abs(part.logp["drop"] - part.logp["own"]) > 1e-2
    assert part.logp["mapped"] == pytest.approx(part.logp["own"], abs=1e-3)


def test_gist_scores_drop_and_summarizes_its_gap(tokenizer, family):
    source, target, mapper = family
    item = gist_items("document", tokenizer, context_tokens=120, n=1, seed=0, filler=FILLER)[0]
    (score,) = score_gist_item(
        item,
        mapper=mapper,
        control=control_mapper(mapper),
        source=source,
        target=target,
        tokenizer=tokenizer,
        variants=[Recompute(2, 4, 0.1, "source")],
        answer_tokens=6,
    )
    assert score.nll["mapped"] == pytest.approx(score.nll["own"], abs=1e-3)
    assert abs(score.nll["drop"] - score.nll["own"]) > 1e-3
    scores = [
        GistScore("a", {"own": 1.0, "mapped": 1.5, "drop": 2.5, "control": 2.8, "floor": 3.0}, []),
        GistScore("b", {"own": 1.0, "mapped": 1.5, "drop": 2.5, "control": 2.8, "floor": 3.0}, []),
    ]
    summary = summarize_gist(scores)
    assert summary["gap_closed_mapped"] == pytest.approx(0.75) and summary["gap_closed_drop"] == pytest.approx(0.25)
    assert summary["gap_closed_map_minus_drop"] == pytest.approx(0.5)
    served = summarize_gist([GistScore("a", {"own": 1.0, "mapped": 1.5, "control": 2.8, "floor": 3.0}, [])])
    assert "gap_closed_drop" not in served and served["gap_closed_mapped"] == pytest.approx(0.75)


def test_followup_items_ask_turn_two_about_the_other_fact(tokenizer):
    items = followup_items(tokenizer, FILLER, context_tokens=300, n=3, seed=0)
    for item in items:
        text = tokenizer.decode(item.prompt_ids)
        assert text.count(f"in room {item.answer}.") == 1 and text.endswith("is in room")
        escalated = tokenizer.decode(item.prompt_ids[: item.meta["escalation_tokens"] + 1])
        assert escalated.endswith("vault is") and "In which room" not in escalated
        room = item.meta["room_at"]
        assert tokenizer.decode([item.prompt_ids[p] for p in room]).strip() == item.answer


def test_followup_conditions_on_an_exact_family(tokenizer, family):
    """Exact map: mapped and reselect are the own cache (the comparison can fail: the control and drop are
    not); a full-budget selection makes drop the own cache too."""
    source, target, mapper = family
    item = followup_items(tokenizer, FILLER, context_tokens=200, n=1, seed=1)[0]
    variants = [Recompute(2, 4, 0.1, "source"), Recompute(2, 4, 1.0, "source")]
    part, whole = score_followup_item(
        item,
        mapper=mapper,
        control=control_mapper(mapper),
        source=source,
        target=target,
        tokenizer=tokenizer,
        variants=variants,
    )
    assert tuple(part.exact) == FOLLOWUP_CONDITIONS
    for condition in ("mapped", "reselect"):
        assert part.logp[condition] == pytest.approx(part.logp["own"], abs=1e-3)
    assert abs(part.logp["drop"] - part.logp["own"]) > 1e-2
    assert abs(part.logp["control"] - part.logp["own"]) > 1e-2
    assert part.meta["reselected"] > 0
    assert whole.logp["drop"] == pytest.approx(whole.logp["own"], abs=1e-3)
    assert whole.meta["room_in_r1"] == 1.0


def test_followup_task_summarizes_the_reselection_pairs(tokenizer, family):
    source, target, mapper = family

    class Loaded:
        pass

    loaded = Loaded()
    loaded.mapper, loaded.source, loaded.target, loaded.tokenizer = mapper, source, target, tokenizer
    task = FollowupTask("followup", loaded, context_tokens=200, limit=1)
    assert task.name == "followup-200"
    item = followup_items(tokenizer, FILLER, context_tokens=200, n=1, seed=0)[0]
    scores = task.score(item, [Recompute(2, 4, 0.1, "source")])
    summary = task.summarize(scores)
    for key in ("reselect_minus_drop", "reselect_minus_drop_reselect", "reselect_minus_control", "map_minus_drop"):
        assert key in summary and f"{key}_ci" in summary
    missed = sum(s.meta["room_in_r1"] < 1 for s in scores)
    assert summary.get("missed_n", 0) == missed and (not missed or "missed_acc_reselect" in summary)
    with pytest.raises(ValueError):
        task.read_score({**scores[0].as_dict(), "exact": {"own": 1, "mapped": 1}})
