"""The judge (kvhub.eval.judge): P(Yes) / (P(Yes) + P(No)) at the first token of a chat model's reply to "does B say
what A says", every candidate in one left-padded batch scoring as it would alone; and the gist's judged scores."""

import copy

import pytest
import torch

from kvhub.errors import ConfigError
from kvhub.eval.gist import GIST_CONDITIONS, GistScore, gist_items, read_gist_score, summarize_gist
from kvhub.eval.judge import NO, YES, _choices, judge, judge_key, judge_prompt
from kvhub.serving.spec import Recompute
from tests.eval.test_gist import _score
from tests.eval.test_longctx import FILLER, family, tokenizer  # noqa: F401 - the long-context tests' fixtures
from tests.tinymodels import make_model


@pytest.fixture(scope="module")
def judge_model():
    return make_model("qwen2", num_hidden_layers=2, vocab_size=600, seed=7).eval()


def test_the_prompt_shows_both_answers_in_the_chat_template(tokenizer):
    text = tokenizer.decode(judge_prompt(tokenizer, " the miller crossed ", "the baker rested"))
    assert (
        "Answer A:\nthe miller crossed\n" in text
        and "strict grader" in text
        and "Answer B:\nthe baker rested\n" in text
    )
    assert text.rstrip().endswith("<s>assistant")


def test_a_batch_scores_each_candidate_as_it_scores_alone(judge_model, tokenizer):
    """Left padding, its mask and the positions that skip it: each row's probability is the one it has alone,
    whatever the other rows' lengths."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    reference = encode("Paragraph 3 tells how the smith crossed the river.")
    candidates = [encode(t) for t in ("the smith crossed", "Paragraph 5 tells how the cooper rested near the mill", "")]
    batched = judge(judge_model, tokenizer, reference, candidates)
    alone = [judge(judge_model, tokenizer, reference, [c])[0] for c in candidates]
    assert batched == pytest.approx(alone, abs=1e-5)
    assert all(0.0 <= p <= 1.0 for p in batched) and len(set(round(p, 6) for p in batched)) > 1
    assert judge(judge_model, tokenizer, reference, []) == []


def test_a_judge_that_cannot_prefer_yes_or_no_scores_by_the_share_of_spellings(judge_model, tokenizer):
    """Known answer: with the output rows of every Yes and No first token zeroed, each has logit 0, so
    P(Yes) / (P(Yes) + P(No)) is the number of Yes tokens over all of them, whatever the prompt."""
    yes, no = _choices(tokenizer)
    model = copy.deepcopy(judge_model)
    with torch.no_grad():
        model.lm_head.weight[yes + no] = 0.0
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    scores = judge(model, tokenizer, encode("a b c"), [encode("a b c"), encode("the weaver")])
    assert scores == pytest.approx([len(yes) / (len(yes) + len(no))] * 2, abs=1e-6)
    assert len(yes) <= len(YES) and len(no) <= len(NO)


def test_a_tokenizer_without_a_chat_template_or_a_yes_no_distinction_is_refused(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ConfigError, match="chat template"):
        judge_prompt(plain, "a", "b")

    class Blurred:  # every word starts with the same token
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [7, len(text)]}

    with pytest.raises(ConfigError, match="cannot be a judge"):
        _choices(Blurred())


def test_the_gist_judges_every_condition_and_an_exact_map_as_own(tokenizer, family):
    """Known answer: an exact map writes the target's own answer, so the judge reads the same prompt for mapped
    and own and scores them alike; every condition is judged and its greedy ids kept for a later judge."""
    item = gist_items("document", tokenizer, context_tokens=120, n=1, seed=0, filler=FILLER)[0]
    (plain,) = _score(family, tokenizer, item, [Recompute()])
    assert set(plain.judged) == set(GIST_CONDITIONS) == set(plain.written)
    assert plain.written["mapped"] == plain.written["own"]
    assert plain.judged["mapped"] == pytest.approx(plain.judged["own"], abs=1e-6)
    assert all(0.0 <= p <= 1.0 for p in plain.judged.values())


def test_the_summary_closes_the_gap_by_the_judge_and_old_records_are_scored_again():
    nll = {"own": 1.0, "floor": 3.0, "mapped": 2.0, "control": 3.0}
    scores = [
        GistScore("a", nll, [1], judged={"own": 0.9, "floor": 0.1, "mapped": 0.5, "control": 0.3}),
        GistScore("b", nll, [1], judged={"own": 0.7, "floor": 0.3, "mapped": 0.7, "control": 0.1}),
    ]
    summary = summarize_gist(scores)
    assert summary["judged_mapped"] == pytest.approx(0.6) and summary["judged_floor"] == pytest.approx(0.2)
    assert summary["judge_gap_closed_mapped"] == pytest.approx(0.4 / 0.6)  # (0.6 - 0.2) / (0.8 - 0.2)
    assert summary["judge_gap_closed_map_minus_control"] == pytest.approx(0.4 / 0.6)
    assert "judged_mapped" not in summarize_gist([*scores, GistScore("c", nll, [1])])  # never over some items

    every = dict.fromkeys(GIST_CONDITIONS, 0.5)
    old = GistScore("a", dict.fromkeys(GIST_CONDITIONS, 1.0), [1], rouge=every).as_dict()
    with pytest.raises(ValueError, match="judge"):
        read_gist_score(old, generated=True, judged=True)
    new = {**old, "judged": every, "written": dict.fromkeys(GIST_CONDITIONS, [1, 2]), "meta": {"judge": judge_key()}}
    assert read_gist_score(new, generated=True, judged=True).judged["own"] == 0.5
    # a score by another wording of the judge is scored again, never read as this judge's
    with pytest.raises(ValueError, match="another judge"):
        read_gist_score({**new, "meta": {"judge": "0" * 12}}, generated=True, judged=True)


def test_the_judges_key_follows_its_wording(monkeypatch):
    import kvhub.eval.judge as judging

    key = judge_key()
    monkeypatch.setattr(judging, "PROMPT", judging.PROMPT + " ")
    assert judge_key() != key


def test_the_library_backend_judges_where_the_target_is_a_chat_model(tokenizer, family):
    """kvhub eval's backend judges with the target where its tokenizer has a chat template (and then refuses a
    cached record without the judge's scores); without one it scores as before and needs none."""
    from types import SimpleNamespace

    from kvhub.eval.conditions import LibraryConditions

    source, target, mapper = family
    item = gist_items("document", tokenizer, context_tokens=120, n=1, seed=0, filler=FILLER)[0]
    loaded = SimpleNamespace(mapper=mapper, source=source, target=target, tokenizer=tokenizer)
    chat = LibraryConditions(loaded)
    (score,) = chat.gist(item, [Recompute()])
    assert chat.judges and {"own", "mapped", "drop", "control", "zero", "floor"} <= set(score.judged)
    record = chat.gist_record("gist", "mapped", item, score)
    assert record["judged"] == score.judged and set(record["written"]) == set(score.written)
    assert isinstance(record["written"]["mapped"], str) and "mapped" in record["judge_gap_closed"]
    assert score.meta["judge"] == judge_key() and chat.read_gist(score.as_dict()).judged == score.judged
    with pytest.raises(ValueError, match="judge"):
        chat.read_gist({**score.as_dict(), "judged": {}})

    plain_tokenizer = copy.deepcopy(tokenizer)
    plain_tokenizer.chat_template = None
    plain = LibraryConditions(SimpleNamespace(mapper=mapper, source=source, target=target, tokenizer=plain_tokenizer))
    (unjudged,) = plain.gist(item, [Recompute()])
    assert not plain.judges and unjudged.judged == {} and set(unjudged.rouge) >= {"own", "mapped"}
    assert plain.read_gist(unjudged.as_dict()).judged == {}


def test_kvhub_eval_prints_the_judge_in_a_table_of_its_own(capsys):
    from kvhub.cli.eval_tables import print_gist

    nll = {"own": 1.0, "floor": 3.0, "mapped": 2.0, "control": 3.0}
    judged = [
        {"own": 0.9, "floor": 0.1, "mapped": 0.5, "control": 0.3},
        {"own": 0.7, "floor": 0.3, "mapped": 0.7, "control": 0.1},
    ]
    summary = summarize_gist([GistScore(i, nll, [1], judged=j) for i, j in zip("ab", judged)])
    print_gist("src:dst:calib@v1", {"gist-1024": summary}, output_format="markdown")
    out = capsys.readouterr().out
    assert "The judge's P(yes)" in out and "0.600" in out and "0.67" in out  # judged_mapped; its gap closed
    print_gist("src:dst:calib@v1", {"gist-1024": summarize_gist([GistScore("a", nll, [1])])}, output_format="markdown")
    assert "P(yes)" not in capsys.readouterr().out
