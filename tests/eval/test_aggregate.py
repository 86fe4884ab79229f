"""Aggregation tasks (kvhub.eval.aggregate): keys recounted from the log the model reads, asked lines spread over
the whole context, registered in the catalog and scored through the long-context path."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from kvhub.eval import aggregate
from kvhub.eval.catalog import AGG_TASKS, LONG_TASKS, REGISTRY
from kvhub.eval.recall_tasks import build_items
from tests.eval.test_longctx import family, tokenizer  # noqa: F401 - the long-context tests' fixtures


def _log(tokenizer, item) -> tuple[str, list[str]]:  # noqa: F811
    text = tokenizer.decode(item.prompt_ids)
    return text, re.findall(r"^Day \d+: (.*)$", text, flags=re.MULTILINE)


@pytest.mark.parametrize("task", AGG_TASKS)
def test_every_key_is_recounted_from_the_text_and_items_are_seeded(tokenizer, task):  # noqa: F811
    """Known answers from the decoded prompt: what the asked city's parcels held (distinct) and their count, the fruit sold
    most (ahead by >= 3), the payments in log order and their sum, the trains in order of their lines; the answer
    tokens decode to the key; about the asked length; counts and payments inside the module's ranges.
    Planted bugs caught: a count taken before the log was rebuilt at its measured length (another log)."""
    items = build_items(task, tokenizer, context_tokens=500, n=3, seed=4)
    for item in items:
        text, lines = _log(tokenizer, item)
        assert tokenizer.decode(item.answer_ids).strip() == item.answer
        assert 400 <= item.meta["context_tokens"] <= 625, item.meta["context_tokens"]
        if task == "agg-count":
            city = re.search(r"parcels arrived from (\w+) in the log", text).group(1)
            held = [m.group(1) for line in lines if (m := re.search(f"from {city} with (\\w+)\\.", line))]
            assert ", ".join(held) + f" -> {len(held)} parcels" == item.answer and len(set(held)) == len(held)
            assert aggregate.COUNT_RANGE[0] <= len(held) <= aggregate.COUNT_RANGE[1]
        elif task == "agg-mode":
            counts = Counter(re.search(r"basket of (\w+)\.", line).group(1) for line in lines).most_common()
            assert counts[0][0] == item.answer and counts[0][1] - counts[1][1] >= 3
        elif task == "agg-total":
            paid = [int(x) for x in re.findall(r"paid (\d+) euros", text)]
            assert " + ".join(map(str, paid)) + f" = {sum(paid)}" == item.answer
            assert aggregate.PAYMENT_RANGE[0] <= len(paid) <= aggregate.PAYMENT_RANGE[1]
            assert max(paid) <= aggregate.EUROS_MAX
        else:
            left = [re.search(r"the (\w+) train left", line).group(1) for line in lines if "train left" in line]
            assert ", ".join(left) == item.answer and len(left) == 3
    assert build_items(task, tokenizer, context_tokens=500, n=3, seed=4)[1].prompt_ids == items[1].prompt_ids


def test_the_asked_lines_are_spread_over_the_whole_log(tokenizer):  # noqa: F811
    """An asked line in the first third of the log and one in the last (count, total, order), also when only two
    lines are asked: no third holds all."""
    for task in ("agg-count", "agg-total", "agg-order"):
        for item in build_items(task, tokenizer, context_tokens=400, n=6, seed=1):
            text, lines = _log(tokenizer, item)
            mark = {"agg-total": " paid ", "agg-order": "train left"}.get(task)
            if mark is None:
                mark = "from " + re.search(r"parcels arrived from (\w+) in the log", text).group(1) + " with"
            where = [i / len(lines) for i, line in enumerate(lines) if mark in line]
            assert min(where) < 1 / 3 and max(where) >= 2 / 3 - 1 / len(lines), (task, where)


def test_spread_puts_two_lines_in_the_first_and_the_last_third():
    """_spread's known answer: 2 lines of 90 fall in [0, 30) and [60, 90), 5 lines one in each fifth."""
    import random

    for seed in range(20):
        first, last = aggregate._spread(random.Random(seed), 90, 2)
        assert 0 <= first < 30 and 60 <= last < 90
        assert [i // 18 for i in aggregate._spread(random.Random(seed), 90, 5)] == [0, 1, 2, 3, 4]


def test_registered_as_long_context_tasks_for_both_backends():
    assert set(AGG_TASKS) <= set(LONG_TASKS)
    for task in AGG_TASKS:
        assert REGISTRY[task].target == "kvhub.eval.recall_tasks:RecallTask"
        assert set(REGISTRY[task].runs_on) == {"library", "served"}


def test_an_exact_map_answers_as_own_does(tokenizer, family):  # noqa: F811
    """Through the long-context scorer on the exact family: mapped = own on every item (the map is exact)."""
    from kvhub.core.control import control_mapper
    from kvhub.eval.longctx import score_recall_item
    from kvhub.serving.spec import Recompute

    source, target, mapper = family
    for item in build_items("agg-count", tokenizer, context_tokens=120, n=2, seed=0):
        (score,) = score_recall_item(
            item,
            mapper=mapper,
            control=control_mapper(mapper),
            source=source,
            target=target,
            tokenizer=tokenizer,
            variants=[Recompute()],
        )
        assert score.exact["mapped"] == score.exact["own"]
        assert score.logp["mapped"] == pytest.approx(score.logp["own"], abs=1e-3)
