"""kvhub.eval.continuation.continuation_metrics (the README's agreement / KL / perplexity figures): known answers."""

import math

import pytest
import torch

from kvhub.eval.continuation import continuation_metrics
from kvhub.fitting.fit import fit
from kvhub.fitting.options import FitOptions
from kvhub.core.control import control_mapper
from kvhub.serving.spec import Recompute
from tests.tinymodels import exact_family_target, make_model
from tests.tolerances import rtol

CONTEXT = 6


def _ids(n, t, seed):
    return torch.randint(1, 128, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def family():
    source = make_model("qwen2", num_hidden_layers=2, seed=11)
    target, _ = exact_family_target(source, insert_before=(1,))
    mapper = fit(
        source,
        target,
        _ids(12, 32, 0),
        _ids(4, 32, 1),
        source_id="s",
        target_id="t",
        options=FitOptions(ridge_lambda=1e-9, stride=1, batch_size=8),
    )
    return source, target, mapper


def _tolerance(target) -> float:
    """fp32 rounding of the map (fitted over 12 x 32 tokens) and of the target's forward (MLP width per layer)."""
    config = target.config
    return rtol(torch.float32, terms=12 * 32) + rtol(
        torch.float32, terms=config.intermediate_size * config.num_hidden_layers
    )


@torch.no_grad()
def _perplexity_token_by_token(model, sequences, *, start: int, first: int) -> float:
    """exp(mean NLL) of tokens t >= first, each scored by a fresh forward over sequence[start:t]."""
    nll, count = 0.0, 0
    for row in sequences:
        for t in range(first, row.shape[0]):
            logits = model(input_ids=row[None, start:t]).logits[0, -1].double()
            nll -= float(torch.log_softmax(logits, -1)[row[t]])
            count += 1
    return math.exp(nll / count)


def test_exact_map_agrees_and_perplexities_match_a_token_by_token_count(family):
    source, target, mapper = family
    sequences = _ids(3, 11, 5)
    metrics = continuation_metrics(mapper, source, target, sequences, context_len=CONTEXT)
    assert (metrics.sequences, metrics.tokens) == (3, 3 * (11 - CONTEXT))
    tolerance = _tolerance(target)
    assert metrics.agreement == 1.0 and abs(metrics.kl) < tolerance
    own = _perplexity_token_by_token(target, sequences, start=0, first=CONTEXT)
    no_context = _perplexity_token_by_token(target, sequences, start=CONTEXT - 1, first=CONTEXT)
    assert metrics.ppl_own == pytest.approx(own, rel=tolerance)
    assert metrics.ppl_mapped == pytest.approx(own, rel=tolerance)
    assert metrics.ppl_no_context == pytest.approx(no_context, rel=tolerance)
    assert abs(metrics.ppl_no_context - own) > 1e3 * tolerance * own  # the context matters to this model


def test_zero_information_map_does_not_score_like_the_targets_own_cache(family):
    source, target, mapper = family
    metrics = continuation_metrics(control_mapper(mapper), source, target, _ids(3, 11, 5), context_len=CONTEXT)
    tolerance = _tolerance(target)
    assert (
        metrics.kl > 1e3 * tolerance and abs(metrics.ppl_mapped - metrics.ppl_own) > 1e3 * tolerance * metrics.ppl_own
    )


def test_uniform_target_has_perplexity_vocab_size(family):
    """A zero LM head gives every token logit 0: perplexity = vocabulary size, KL 0, argmax token 0 everywhere."""
    source, target, mapper = family
    uniform, _ = exact_family_target(source, insert_before=(1,))
    with torch.no_grad():
        uniform.lm_head.weight.zero_()
    metrics = continuation_metrics(
        mapper, source, uniform, _ids(2, 9, 6), context_len=CONTEXT, recompute=Recompute(1, 2)
    )
    vocab = uniform.config.vocab_size
    for value in (metrics.ppl_own, metrics.ppl_mapped, metrics.ppl_no_context):
        assert value == pytest.approx(vocab, rel=rtol(torch.float32, terms=vocab))
    assert metrics.agreement == 1.0 and metrics.kl == 0.0 and metrics.tokens == 2 * (9 - CONTEXT)


def test_drop_perplexity_is_own_when_every_position_is_kept_and_the_kept_tokens_alone_otherwise(family):
    """``ppl_drop`` (kvhub.serving.drop over the handoff's recompute set): a handoff that recomputes the whole
    context keeps every position, so drop = own; one that recomputes the first p and last r keeps only those,
    and each continuation token is scored by one forward over the kept tokens and the tail at their true
    positions.  Planted bug caught: the tail continuing at |R| instead of c - 1."""
    source, target, mapper = family
    sequences = _ids(2, 11, 5)
    whole = continuation_metrics(
        control_mapper(mapper), source, target, sequences, context_len=CONTEXT, recompute=Recompute(CONTEXT - 1, 0)
    )
    assert whole.ppl_drop == pytest.approx(whole.ppl_own, rel=_tolerance(target))
    kept = torch.tensor([0, 1, 4])  # exact_prefix=2, exact_suffix=1 over the c - 1 = 5 context tokens
    metrics = continuation_metrics(mapper, source, target, sequences, context_len=CONTEXT, recompute=Recompute(2, 1))
    nll, count = 0.0, 0
    with torch.no_grad():
        for row in sequences:
            ids = torch.cat([row[kept], row[CONTEXT - 1 :]])[None]
            positions = torch.cat([kept, torch.arange(CONTEXT - 1, row.shape[0])])[None]
            logp = torch.log_softmax(target(input_ids=ids, position_ids=positions).logits[0].double(), -1)
            for index, token in enumerate(row[CONTEXT:].tolist()):
                nll -= float(logp[len(kept) + index, token])
                count += 1
    assert metrics.ppl_drop == pytest.approx(math.exp(nll / count), rel=_tolerance(target))
    assert abs(metrics.ppl_drop - metrics.ppl_own) > 1e3 * _tolerance(target) * metrics.ppl_own
