"""``kvhub eval-serve --task turns`` (kvhub.eval.served_turns): three turns after an escalation, against the
in-process stand-in for ``kvhub serve``'s two servers (tests/eval/test_eval_serve.py: an exact map, so every
arm but the control answers as the large model does, and each arm's requests are logged)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvhub.cli.main import main
from kvhub.errors import ConfigError
from kvhub.eval.served import Endpoint
from kvhub.eval.served_conditions import ServedConditions, run_served
from kvhub.eval.served_turns import TURN_ARMS, TURNS, TurnItem, TurnsTask, summarize_turns, turn_items
from tests.eval.test_eval_serve import LARGE_NAME, PROMPTS, greedy
from tests.eval.test_eval_serve import module_pair, models, pair, tokenizer, tokenizer_dir  # noqa: F401 (fixtures)

ANSWER = 3


@pytest.fixture(scope="module")
def conversations(models, tokenizer):
    """Two three-turn items whose answers are the large model's greedy continuation of each turn's prompt;
    each turn appends that answer and a new question longer than the exact tail (so the stored turn-1 prompt
    is an earlier turn's)."""
    out = []
    for index, text in enumerate(PROMPTS[:2]):
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts, answers = [], []
        for turn in range(TURNS):
            if turn:
                prompt = (
                    prompt
                    + answers[-1]
                    + tokenizer(f" and then, at turn {turn + 1}, on to", add_special_tokens=False)["input_ids"]
                )
            prompts.append(prompt)
            answers.append(greedy(models["large"], prompt, ANSWER))
        golds = [tokenizer.decode(a) for a in answers]
        out.append(TurnItem(f"hand-{index}", prompts, answers, golds, {"context_tokens": len(prompts[0])}))
    return out


def _evaluate(small, large, tokenizer, conversations) -> dict:
    """The turns task over ``conversations`` through run_task, with its samples."""
    task = TurnsTask(
        "turns",
        ServedConditions(small, large, tokenizer),
        context_tokens=64,
        limit=len(conversations),
        items=conversations,
    )
    return run_served(task, log_samples=True)


def test_every_arm_is_scored_per_turn_and_later_escalated_turns_map_the_stored_prefix(
    pair, models, tokenizer, conversations
):
    small, large = Endpoint.at(pair.small_url), Endpoint.at(pair.large_url)
    summary = _evaluate(small, large, tokenizer, conversations[:2])
    assert summary["n"] == 2 and summary["turns"] == TURNS and summary["task"] == "turns"
    for turn in range(1, TURNS + 1):
        for arm in ("own", "mapped", "relay", "settled"):
            assert summary[f"acc_{arm}_t{turn}"] == 1.0
        expected_control = (
            sum(
                greedy(models["control"], item.prompts[turn - 1], ANSWER) == item.answers[turn - 1]
                for item in conversations
            )
            / 2
        )
        assert summary[f"acc_control_t{turn}"] == expected_control
        assert summary[f"unmapped_mapped_t{turn}"] == summary[f"unmapped_relay_t{turn}"] == 0
        # settled: turn 1 escalated; later turns hit the large model's own prefill of turn 1, nothing loaded
        assert summary[f"unmapped_settled_t{turn}"] == (0 if turn == 1 else 2)
        # mapped: turns 2 and 3 extend the stored turn-1 prompt by more than the exact tail; relay stored each turn
        assert summary[f"select_fallback_mapped_t{turn}"] == (0 if turn == 1 else 2)
        assert summary[f"select_fallback_relay_t{turn}"] == 0
        assert summary[f"ttft_mapped_t{turn}"] > 0 and summary[f"small_s_relay_t{turn}"] > 0
    assert summary["vs_turn1_mapped_t1"] == 1.0
    assert summary["speedup_own_t1"] == 1.0
    assert summary["conversation_s_own"] > 0 and summary["settle_s"] > 0
    samples = summary["samples"]
    assert [s["id"] for s in samples] == ["hand-0", "hand-1"] and len(samples[0]["relay"]) == TURNS


def test_the_small_server_sees_turn_one_for_the_escalation_and_every_turn_for_the_relay(pair, tokenizer, conversations):
    small, large = Endpoint.at(pair.small_url), Endpoint.at(pair.large_url)
    _evaluate(small, large, tokenizer, conversations[:1])
    lengths = [len(p) for p in conversations[0].prompts]
    by_salt: dict = {}
    for server, salt, control, length in pair.requests:
        by_salt.setdefault(salt, []).append((server, control, length))
    assert len(by_salt) == 4  # own, escalated (mapped + control), relay, settled
    smalls = sorted(
        ([length for server, _, length in requests if server == "small"] for requests in by_salt.values()), key=len
    )
    assert smalls == [[], lengths[:1], lengths[:1], lengths]
    escalated = next(r for r in by_salt.values() if any(control for _, control, _ in r))
    settled = next(
        r for r in by_salt.values() if sum(server == "small" for server, _, _ in r) == 1 and r is not escalated
    )
    # turn 1: timed + answer + the settling prefill of the same prompt; later turns: timed + answer
    assert [length for server, _, length in settled if server == "large"] == [lengths[0]] * 3 + [
        n for n in lengths[1:] for _ in range(2)
    ]
    # each turn: the timed 1-token request and the answer, with and without the control map
    assert [length for server, _, length in escalated if server == "large"] == [n for n in lengths for _ in range(4)]


def test_a_pair_that_maps_nothing_is_refused_not_scored_as_an_escalation(
    pair, tokenizer_dir, conversations, monkeypatch
):
    import kvhub.eval.served_turns as served_turns

    monkeypatch.setattr(served_turns, "turn_items", lambda *a, **k: conversations[:1])
    pair.storing = False
    try:
        result = CliRunner().invoke(
            main,
            ["eval-serve", "--small", pair.small_url, "--large", pair.large_url, "--task", "turns", "--limit", "1"],
        )
    finally:
        pair.storing = True
    assert result.exit_code != 0
    assert "reported no kvhub transfer" in result.output and "Traceback" not in result.output


def test_the_cli_prints_one_row_per_arm_and_writes_the_turn_keys(pair, tokenizer_dir, conversations, monkeypatch):
    import kvhub.eval.served_turns as served_turns

    monkeypatch.setattr(served_turns, "turn_items", lambda *a, **k: conversations)
    args = ["eval-serve", "--small", pair.small_url, "--large", pair.large_url, "--task", "turns", "--limit", "2"]
    table = CliRunner().invoke(main, args)
    assert table.exit_code == 0, table.output
    for arm in TURN_ARMS:
        assert arm in table.output
    done = CliRunner().invoke(main, args + ["--json"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    result = doc["results"]["turns-1024"]
    assert result["acc_mapped_t3"] == 1.0 and "samples" not in result
    assert doc["config"]["datasets"]["turns-1024"]["n"] == 2
    assert doc["config"]["large"]["model"] == LARGE_NAME


def test_summary_of_no_items_and_times_per_turn():
    assert summarize_turns([]) == {"n": 0, "turns": TURNS}


def test_turn_items_state_each_fact_once_and_each_prompt_extends_the_last(tokenizer):
    filler = [f"Paragraph {'abcdefghij'[i % 10]} says nothing in particular about anything at all." for i in range(40)]
    items = turn_items(tokenizer, context_tokens=600, n=2, seed=1, filler=filler)
    for item in items:
        assert len(item.prompts) == TURNS and item.meta["context_tokens"] == len(item.prompts[0])
        for earlier, later in zip(item.prompts, item.prompts[1:]):
            assert later[: len(earlier)] == earlier
        first = tokenizer.decode(item.prompts[0])
        for turn, (gold, answer) in enumerate(zip(item.golds, item.answers)):
            assert tokenizer.decode(answer) == " " + gold
            assert first.count(gold) == 1  # stated once in the context
            if turn:  # the previous answer is in the transcript
                assert f" {item.golds[turn - 1]}." in tokenizer.decode(item.prompts[turn])[len(first) :]
    assert turn_items(tokenizer, context_tokens=600, n=2, seed=1, filler=filler) == items  # seeded


def test_a_tokenizer_that_merges_across_turns_is_refused(tokenizer):
    class Merging:
        """Starts every text with its count of questions: a later turn's ids never extend an earlier turn's."""

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [text.count("Question")] + tokenizer(text, add_special_tokens=False)["input_ids"]}

    with pytest.raises(ConfigError, match="does not extend the previous one"):
        turn_items(Merging(), context_tokens=300, n=1, filler=["Some filler text here."] * 20)
