"""Long-context tasks (kvhub.eval.longctx): items that state a fact once, scored exactly, with controls."""

import math
import re

import pytest
import torch

from kvhub.core.control import control_mapper
from kvhub.errors import ConfigError
from kvhub.fitting.fit import fit
from kvhub.fitting.options import FitOptions
from kvhub.eval.longctx import (
    LONG_CONDITIONS,
    RecallScore,
    code_items,
    fact_items,
    multiturn_items,
    score_recall_item,
    summarize_recall,
)
from kvhub.serving.recompute import Recompute
from tests.fixtures_calib import train_tokenizer
from tests.tinymodels import exact_family_target, make_model

FILLER = [
    f"Paragraph {i} tells how the {w} crossed the river and rested near the old mill."
    for i, w in enumerate(["miller", "baker", "weaver", "smith", "potter", "tailor", "cooper", "mason"] * 3)
]
CHAT = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(vocab_size=600, chat_template=CHAT)


def test_fact_items_state_the_asked_code_once_at_its_depth(tokenizer):
    items = fact_items(tokenizer, FILLER, context_tokens=300, n=6, seed=1, depths=(0.1, 0.9))
    for item in items:
        text = tokenizer.decode(item.prompt_ids)
        assert re.fullmatch(r"\d{5}", item.answer) and text.count(item.answer) == 1
        assert tokenizer.decode(item.answer_ids).strip() == item.answer
        codes = re.findall(r"vault is (\d{5})\.", text)
        assert len(codes) == item.meta["facts"] and item.answer in codes
        depth = text.index(item.answer) / text.index("Question:")
        assert abs(depth - item.meta["depth"]) < 0.2, (depth, item.meta)
        assert 280 <= item.meta["context_tokens"] <= 340, item.meta
    assert [i.meta["facts"] for i in items] == [1, 2, 3, 1, 2, 3]
    assert (
        fact_items(tokenizer, FILLER, context_tokens=300, n=6, seed=1, depths=(0.1, 0.9))[2].prompt_ids
        == items[2].prompt_ids
    )  # seeded


def test_multiturn_items_ask_for_a_number_stated_in_the_first_turn(tokenizer):
    item = multiturn_items(tokenizer, FILLER, context_tokens=200, n=2, seed=0)[1]
    text = tokenizer.decode(item.prompt_ids)
    first_user = text.split("<s>assistant")[0]
    assert item.answer in first_user and text.count(item.answer) == 1
    assert text.endswith("<s>assistant\n") and tokenizer.decode(item.answer_ids) == item.answer
    with pytest.raises(ConfigError, match="chat template"):
        multiturn_items(train_tokenizer(vocab_size=600), FILLER, context_tokens=200, n=1)


def test_code_items_continue_a_long_file_prefix_with_its_next_line(tokenizer):
    items = code_items(tokenizer, context_tokens=200, n=3, seed=0)
    assert len({i.meta["file"] for i in items}) == 3
    for item in items:
        assert len(item.prompt_ids) >= 200
        prefix = tokenizer.decode(item.prompt_ids)
        line = prefix.rsplit("\n", 1)[-1] + tokenizer.decode(item.answer_ids)
        assert line.strip() == item.answer.strip() and len(item.answer.strip()) >= 12


def test_summary_counts_exact_answers_per_condition_with_intervals():
    def score(own, mapped, control):
        exact = dict(own=own, mapped=mapped, control=control, source=1, floor=0)
        return RecallScore(
            "x",
            exact,
            {c: float(v) for c, v in exact.items()},
            {c: 0.0 for c in LONG_CONDITIONS},
            recomputed=10,
            meta={"context_tokens": 101},
        )

    summary = summarize_recall([score(1, 1, 0), score(1, 0, 0), score(1, 1, 1), score(0, 0, 0)])
    assert summary["acc_own"] == 0.75 and summary["acc_mapped"] == 0.5 and summary["acc_control"] == 0.25
    assert math.isclose(summary["retention"], 0.5 / 0.75) and summary["map_minus_control"] == 0.25
    low, high = summary["retention_ci"]
    assert 0 <= low <= summary["retention"] <= high
    assert summary["recomputed_fraction"] == pytest.approx(0.1)


@pytest.fixture(scope="module")
def family():
    source = make_model("qwen2", num_hidden_layers=3, vocab_size=600, seed=3)
    target, _ = exact_family_target(source, insert_before=(1,), kv_repeat=2, double_head_dim=True)
    ids = torch.randint(0, 600, (24, 48), generator=torch.Generator().manual_seed(0))
    mapper = fit(
        source,
        target,
        ids[:20],
        ids[20:],
        source_id="tiny/src",
        target_id="tiny/dst",
        options=FitOptions(ridge_lambda=1e-9, stride=1, batch_size=8),
    )
    return source, target, mapper


def test_exact_map_scores_like_own_and_the_control_does_not(tokenizer, family):
    """On an exact family the mapped cache is the target's own, so every variant scores as own does;
    the no-information control gives other log-likelihoods: the comparison can fail.

    ``recomputed`` counts the positions the recompute really made exact.  Known answers: 0 for the plain map,
    p + r = 6 for a prefix and suffix, the whole context (n - 1) for exact_budget=1 (every span fits), and
    between p + r and the spec's p + r + round(b (n - 1)) for a selection of whole sentences.
    Planted bug caught: reporting the spec's p + r + round(b (n - 1)) instead of the count (n + 5 at b = 1)."""
    source, target, mapper = family
    item = fact_items(tokenizer, FILLER, context_tokens=150, n=1, seed=2)[0]
    variants = [
        Recompute(),
        Recompute(2, 4),
        Recompute(2, 4, 0.1, "source"),
        Recompute(0, 0, 0.2, "random"),
        Recompute(2, 4, 1.0, "source"),
    ]
    scores = score_recall_item(
        item,
        mapper=mapper,
        control=control_mapper(mapper),
        source=source,
        target=target,
        tokenizer=tokenizer,
        variants=variants,
    )
    assert len(scores) == len(variants)
    for score in scores:
        assert score.exact["mapped"] == score.exact["own"]
        assert score.logp["mapped"] == pytest.approx(score.logp["own"], rel=1e-3, abs=1e-3)
    for score in scores[:-1]:  # each leaves some context to the map; the last recomputes it all
        assert abs(score.logp["control"] - score.logp["own"]) > 1e-2
    context = len(item.prompt_ids) - 1
    assert [scores[0].recomputed, scores[1].recomputed, scores[4].recomputed] == [0, 6, context]
    assert 6 <= scores[2].recomputed <= 6 + round(0.1 * context)


def test_control_needs_the_calibration_means(family):
    _, _, mapper = family
    from kvhub.core.mapper import Mapper

    bare = Mapper({k: v for k, v in mapper.tensors.items() if not k.endswith("target_mean")}, mapper.metadata)
    with pytest.raises(ConfigError, match="refit"):
        control_mapper(bare)
    control = control_mapper(mapper)
    assert all(not t.any() for name, t in control.tensors.items() if name.endswith(".weight"))
