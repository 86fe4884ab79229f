"""Task scoring under own / mapped / source conditions, on an exact family (retention must be 1), against a
zero-information control map that must score differently (else the mapped path ignored the map)."""

from dataclasses import dataclass

import pytest
import torch

from kvhub.fitting.fit import fit
from kvhub.fitting.options import FitOptions
from kvhub.serving.recompute import Recompute
from kvhub.eval.taskeval import ItemScore, _AttnRecorder, score_item, summarize
from kvhub.core.control import control_mapper
from tests.tinymodels import exact_family_target, make_model
from tests.tolerances import rtol

VARIANTS = tuple(Recompute(p, s) for p, s in ((0, 0), (3, 0), (0, 4), (2, 3)))


@dataclass
class Item:
    context: str
    continuations: list
    label: int
    id: str
    choice_prefixes: list = None


class CharTokenizer:
    """One token per character (ids 1..127), enough to drive the scorer."""

    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + (ord(c) % 127) for c in text]}


@pytest.fixture(scope="module")
def family():
    source = make_model("qwen2", num_hidden_layers=2, seed=11)
    target, _ = exact_family_target(source, insert_before=(1,))
    ids = torch.randint(1, 128, (16, 32), generator=torch.Generator().manual_seed(0))
    mapper = fit(
        source,
        target,
        ids[:12],
        ids[12:],
        source_id="s",
        target_id="t",
        options=FitOptions(ridge_lambda=1e-9, stride=1, batch_size=8),
    )
    return source, target, mapper


ITEMS = [Item(f"the quick brown fox {i} jumps", [" over", " under the", " x"], i % 3, str(i)) for i in range(6)]
ITEMS += [
    Item(f"a cat {i} sat", [" on the mat"] * 2, i % 2, f"w{i}", choice_prefixes=[" down", " up"]) for i in range(4)
]


def _scores(mapper, source, target):
    recorder = _AttnRecorder(target)
    try:
        return [
            s
            for it in ITEMS
            for s in score_item(
                it,
                mapper=mapper,
                source=source,
                target=target,
                tokenizer=CharTokenizer(),
                recorder=recorder,
                variants=VARIANTS,
            )
        ]
    finally:
        recorder.remove()


def _tolerance(target) -> float:
    """fp32 rounding of the map (fitted over 12 x 32 tokens) and of the target's forward (MLP width per layer):
    KL and 1 - cosine are first order in that relative error at most."""
    config = target.config
    return rtol(torch.float32, terms=12 * 32) + rtol(
        torch.float32, terms=config.intermediate_size * config.num_hidden_layers
    )


def test_exact_family_scores_identically_to_own_and_a_control_map_does_not(family):
    source, target, mapper = family
    tolerance = _tolerance(target)
    for s in _scores(mapper, source, target):
        assert s.correct_mapped == s.correct_own and s.correct_norm_mapped == s.correct_norm_own
        assert s.agree_next == 1 and s.kl_next < tolerance
        assert s.attn_cosine > 1 - tolerance
    control = _scores(control_mapper(mapper), source, target)
    assert len(control) == len(ITEMS) * len(VARIANTS)
    for s in control:  # every variant leaves some context tokens to the (useless) map
        assert s.kl_next > 1e3 * tolerance and s.attn_cosine < 1 - 1e3 * tolerance, s
    summary = summarize(control, resamples=10)
    assert summary["agree_next"] < 1 and summary["kl_next"] > 1e3 * tolerance


def test_summary_retention_gap_and_intervals():
    scores = [
        ItemScore(str(i), own, mapped, src, own, mapped, src, 1, 0.0, 1.0)
        for i, (own, mapped, src) in enumerate([(1, 1, 0)] * 6 + [(1, 0, 0)] * 2 + [(0, 0, 0)] * 2)
    ]
    out = summarize(scores, resamples=200)
    assert out["acc_own"] == 0.8 and out["acc_mapped"] == 0.6 and out["acc_source"] == 0.0
    assert out["retention"] == pytest.approx(0.75) and out["gap_closed"] == pytest.approx(0.75)
    low, high = out["retention_ci"]
    assert low <= 0.75 <= high and high - low > 0


def test_choice_prefixes_are_conditioned_on_not_scored(family):
    """WinoGrande-style items: choice i's score is log p(continuation | context + prefix_i) summed over the
    continuation only, against a direct forward of the target (own) and the source.  Planted bug caught: scoring
    the prefix too (``starts = 1`` instead of ``1 + len(prefix)`` in score_item), which the exact-family
    comparison cannot see (own and mapped would share the wrong span)."""
    from kvhub.eval.taskeval import _encode

    source, target, mapper = family
    item = Item("a cat sat", [" on the mat"] * 2, 0, "w", choice_prefixes=[" down", " up"])
    ctx, pres, conts = _encode(CharTokenizer(), item)
    assert pres[0] != pres[1] and conts[0] == conts[1] and len(ctx) == len("a cat sat")
    (score,) = score_item(item, mapper=mapper, source=source, target=target, tokenizer=CharTokenizer())
    for condition, model in (("own", target), ("source", source)):
        for i, (pre, cont) in enumerate(zip(pres, conts)):
            ids = torch.tensor([ctx + pre + cont])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            start = len(ctx) + len(pre)
            direct = float(sum(logp[t - 1, ids[0, t]] for t in range(start, ids.shape[1])))
            assert score.logprobs[condition][i] == pytest.approx(direct, abs=1e-3 * max(1.0, abs(direct))), condition
