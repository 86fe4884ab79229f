"""RULER-style tasks (kvhub.eval.ruler): kvpress rows whose answers need more than one span of the context."""

import re
from collections import Counter

import pytest

from kvhub.errors import ConfigError
from kvhub.eval.catalog import LONG_TASKS, RULER_TASKS
from kvhub.eval.recall_tasks import build_items
from kvhub.eval.ruler import COMMON, DECOY_HOPS, HOPS, NEEDLES, press_rows, row_item
from tests.fixtures_calib import train_tokenizer

FILLER = [
    f"Paragraph {i} tells how the {w} crossed the river and rested near the old {v} mill."
    for i, (w, v) in enumerate(
        zip(
            ["miller", "baker", "weaver", "smith", "potter", "tailor", "cooper", "mason"] * 6,
            ["stone", "wooden", "broken", "quiet", "famous", "little"] * 8,
        )
    )
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(vocab_size=600)


def test_every_ruler_task_is_a_long_task_kvhub_eval_takes():
    assert set(RULER_TASKS) <= set(LONG_TASKS)


def test_rows_have_kvpress_columns_and_become_items_ending_at_the_answer(tokenizer):
    for task in RULER_TASKS:
        rows = press_rows(task, tokenizer, FILLER, context_tokens=400, n=2, seed=0)
        assert set(rows[0].as_dict()) == {"context", "question", "answer_prefix", "answer", "max_new_tokens"}
        item = row_item(rows[0], tokenizer, "x")
        assert tokenizer.decode(item.prompt_ids).endswith(rows[0].answer_prefix.strip()[-12:])
        assert tokenizer.decode(item.answer_ids).strip() == rows[0].answer.strip()
        assert 300 <= item.meta["context_tokens"] <= 520, (task, item.meta)
        assert press_rows(task, tokenizer, FILLER, context_tokens=400, n=2, seed=0) == rows  # seeded


def test_multikey_needles_are_decoys_of_one_shape_and_one_is_asked(tokenizer):
    row = press_rows("niah-multikey", tokenizer, FILLER, context_tokens=400, n=1, seed=3)[0]
    numbers = re.findall(r"special magic numbers for (\w+) is: (\d{7})\.", row.context)
    assert len(numbers) == NEEDLES
    asked = re.search(r"number for (\w+) mentioned", row.question).group(1)
    assert dict(numbers)[asked] == row.answer.strip()


def test_variable_tracking_answer_is_the_whole_chain_of_the_asked_value(tokenizer):
    for seed in range(4):
        row = press_rows("vt", tokenizer, FILLER, context_tokens=400, n=1, seed=seed)[0]
        value = re.search(r"assigned the value (\d+) in", row.question).group(1)
        chain = re.findall(r"VAR (\w+)", row.answer)
        assert len(chain) == HOPS and f"VAR {chain[0]} = {value}." in row.context
        for before, after in zip(chain, chain[1:]):
            assert f"VAR {after} = VAR {before}." in row.context
        assert len(re.findall(r"VAR \w+ = ", row.context)) == HOPS + DECOY_HOPS  # a decoy of another value
        assert row.answer == " " + " and ".join(f"VAR {name}" for name in chain)  # as the model lists two


def test_variable_tracking_chain_runs_from_the_first_third_to_the_last(tokenizer):
    """The asked chain's first statement lies in the first third of the context, its last in the last third, so
    no third of the context holds the whole chain (at ~20 paragraphs: the depths are paragraph bounds)."""
    for seed in range(6):
        row = press_rows("vt", tokenizer, FILLER, context_tokens=1600, n=1, seed=seed)[0]
        chain = re.findall(r"VAR (\w+)", row.answer)
        first = row.context.index(f"VAR {chain[0]} = ") / len(row.context)
        last = row.context.index(f"VAR {chain[-1]} = ") / len(row.context)
        assert first < 1 / 3 and last > 2 / 3, (seed, first, last)


def test_common_words_are_the_most_frequent_in_order(tokenizer):
    row = press_rows("cwe", tokenizer, FILLER, context_tokens=600, n=1, seed=2)[0]
    counts = Counter(re.findall(r"^\d+\. (\w+)$", row.context, flags=re.M))
    answer = re.findall(r'"(\w+)"', row.answer)
    assert len(answer) == COMMON and [w for w, _ in counts.most_common(COMMON)] == answer
    assert counts[answer[-1]] > max(c for w, c in counts.items() if w not in answer)
    assert row.answer == " " + " and ".join(f'"{word}"' for word in answer) + "."


def test_unknown_task_is_refused_by_name(tokenizer):
    with pytest.raises(ConfigError, match="niah-multikey"):
        press_rows("qa", tokenizer, FILLER, context_tokens=400, n=1)
    assert len(build_items("vt", tokenizer, context_tokens=300, n=2, filler=FILLER)) == 2


def test_U3_26_built_prompts_past_the_models_positions_are_refused(tokenizer):
    """--context-tokens 512 on a 512-position model built 543-token prompts silently; the built items are
    checked against each model's max_position_embeddings, with their answers.  Planted bug caught: checking
    the requested length only (512 <= 512 passes)."""
    from types import SimpleNamespace

    from kvhub.errors import ConfigError
    from kvhub.eval.longctx import check_positions

    items = press_rows("niah-multikey", tokenizer, FILLER, context_tokens=400, n=2, seed=0)
    items = [row_item(row, tokenizer, f"x{i}") for i, row in enumerate(items)]
    longest = max(len(item.prompt_ids) for item in items)

    def model(positions):
        return SimpleNamespace(config=SimpleNamespace(max_position_embeddings=positions, model_type="qwen2"))

    check_positions(items, (model(4096), model(longest + 12)), extra=12, context_tokens=400)
    with pytest.raises(ConfigError, match="max_position_embeddings.*--context-tokens"):
        check_positions(items, (model(4096), model(longest + 11)), extra=12, context_tokens=400)
    with pytest.raises(ConfigError, match=f"up to {longest + 12} tokens"):
        check_positions(items, (model(400),), extra=12, context_tokens=400)
