"""Selective exact recompute (kvhub.serving.recompute) on tiny models: the masked pass against references."""

import pytest
import torch

from kvhub.core.capture import cache_kwargs, run_model
from kvhub.errors import ConfigError
from kvhub.serving.handoff import prepare_cache
from kvhub.serving.recompute import (
    Recompute,
    attention_scores,
    cropped,
    query_attention,
    recompute_positions,
    recompute_set,
    select_spans,
    span_ids,
)
from tests.tinymodels import control_mapper, exact_family_target, make_model
from tests.tolerances import rtol
from tests.fixtures_fit import fit_tiny, token_ids as _ids


@pytest.fixture(scope="module")
def family():
    torch.manual_seed(0)
    source = make_model("qwen2", num_hidden_layers=3)
    target, _ = exact_family_target(source, insert_before=(1,), kv_repeat=2, double_head_dim=True)
    mapper = fit_tiny(source, target, ridge_lambda=1e-9)
    return source, target, control_mapper(mapper)


def _tol(model) -> float:
    return rtol(torch.float32, terms=model.config.intermediate_size * model.config.num_hidden_layers)


def _assert_caches_equal(got, want, tolerance, positions=None):
    for m, (a, b) in enumerate(zip(got.layers, want.layers)):
        for name in ("keys", "values"):
            x, y = getattr(a, name), getattr(b, name)
            if positions is not None:
                x, y = x[:, :, positions], y[:, :, positions]
            scale = float(y.abs().max())
            assert torch.allclose(x, y, rtol=tolerance, atol=tolerance * scale), f"{name} of layer {m}"


def test_spec_names_round_trip_and_bad_specs_are_refused():
    spec = Recompute(exact_prefix=4, exact_suffix=16, exact_budget=0.1, select="deviation", spans="token")
    assert spec.name() == "exact_prefix=4,exact_suffix=16,exact_budget=0.1,select=deviation,spans=token"
    assert Recompute.parse(spec.name()) == spec
    assert Recompute(exact_prefix=4).name() == "exact_prefix=4" and Recompute().name() == ""
    scored = Recompute(exact_prefix=4, exact_budget=0.05, select="target", queries=4, score="sum")
    assert scored.name() == "exact_prefix=4,exact_budget=0.05,select=target,queries=4,score=sum"
    assert Recompute.parse(scored.name()) == scored
    assert scored.capped(3) == Recompute(exact_prefix=3, exact_budget=0.05, select="target", queries=4, score="sum")
    for bad in (
        dict(exact_budget=1.5),
        dict(select="oracle"),
        dict(exact_prefix=-1),
        dict(spans="words"),
        dict(score="mean"),
    ):
        with pytest.raises(ConfigError):
            Recompute(**bad)
    for text in ("exact_budget=lots", "depth=3", "select"):
        with pytest.raises(ConfigError):
            Recompute.parse(text)


def test_spans_end_at_sentences_and_lines_and_are_capped():
    texts = ["The", " code", " is", " 4", "8", ".", " Then", " more", "\n", "a", "b", "c", "d"]
    assert span_ids(texts, max_span=3).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]


def test_whole_spans_are_taken_by_their_best_token_within_the_budget():
    spans = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    scores = torch.tensor([0.1, 0.2, 0.1, 0.3, 9.0, 5.0, 0.0, 0.0, 0.0])
    eligible = torch.ones(9, dtype=torch.bool)
    assert select_spans(scores, spans, 2, eligible=eligible).tolist() == [3, 4]
    # span 2 (4 tokens) does not fit next to span 1 in 5 tokens: span 0 (3 tokens) does
    assert select_spans(scores, spans, 5, eligible=eligible).tolist() == [0, 1, 2, 3, 4]
    eligible[4] = False  # the best token is off limits (e.g. in the exact suffix)
    assert select_spans(scores, spans, 1, eligible=eligible).tolist() == [3]
    assert select_spans(scores, spans, 0, eligible=eligible).numel() == 0


def test_attention_scores_known_answers():
    """Two queries (tokens 4 and 5 of 6) over 6 tokens; token 0 is an exact prefix, token 5 the suffix."""
    attention = torch.tensor(
        [
            [0.5, 0.1, 0.1, 0.1, 0.2, 0.0],  # query 4: spread over the nearby text
            [0.5, 0.0, 0.4, 0.0, 0.0, 0.1],
        ]
    )  # query 5: looks token 2 up
    eligible = torch.tensor([False, True, True, True, True, False])
    # max: per query, the share of its eligible attention; then the max over queries
    # query 4: (0.1, 0.1, 0.1, 0.2) / 0.5; query 5: (0, 0.4, 0, 0) / 0.4
    want = torch.tensor([0.5 / 0.5, 0.2, 1.0, 0.2, 0.4, 0.0])
    assert torch.allclose(attention_scores(attention, eligible, score="max")[1:5], want[1:5])
    # sum: (i + 1)-scaled attention summed over the queries (i + 1 = 5 and 6)
    want_sum = 5 * attention[0] + 6 * attention[1]
    assert torch.allclose(attention_scores(attention, eligible, score="sum"), want_sum)
    # the look-up wins under max, the spread under sum (token 4: 5 * 0.2 = 1.0 vs token 2: 0.5 + 2.4 = 2.9)
    assert int(attention_scores(attention, eligible, score="max")[1:5].argmax()) + 1 == 2


def test_query_attention_is_the_models_attention_per_query(family):
    """query_attention's P[i, t] equals the eager attention probabilities of a full forward pass, averaged
    over layers and heads, at the last Q query rows."""
    source, _, _ = family
    context = _ids(1, 20, 11)
    cache = cropped(run_model(source, context), 16)
    got = query_attention(source, context, cache, queries=4)
    out = source(input_ids=context, output_attentions=True)  # the tiny models run eager attention
    want = torch.stack([a[0, :, -4:].float().mean(0) for a in out.attentions]).mean(0)
    assert got.shape == (4, 20)
    assert torch.allclose(got, want, atol=1e-5)


def test_recomputing_every_token_is_the_targets_own_prefill(family):
    source, target, control = family
    ids = _ids(1, 24, 3)
    own = run_model(target, ids[:, :-1])
    cache = prepare_cache(control, source, target, ids, recompute=Recompute(exact_budget=1.0, select="random"))
    _assert_caches_equal(cache, own, _tol(target))


@torch.no_grad()
def test_masked_pass_equals_recomputing_the_tokens_one_by_one(family):
    """Reference: each chosen token in order, as a one-token forward over the cache before it (with the
    earlier chosen tokens already exact).  The masked single pass must give the same K/V everywhere."""
    source, target, control = family
    ids = _ids(1, 30, 5)
    context = ids[:, :-1]
    positions = torch.tensor([0, 3, 4, 11, 20, 27])
    mapped = control.transfer(run_model(source, context))
    reference = control.transfer(run_model(source, context))
    for t in positions.tolist():
        step = cropped(reference, t) if t else None
        from transformers import DynamicCache

        step = step or DynamicCache()
        target.base_model(input_ids=context[:, t : t + 1], position_ids=torch.tensor([[t]]), cache=step, use_cache=True)
        for mine, theirs in zip(reference.layers, step.layers):
            mine.keys[:, :, t], mine.values[:, :, t] = theirs.keys[:, :, t], theirs.values[:, :, t]
    recompute_positions(target, mapped, context, positions)
    _assert_caches_equal(mapped, reference, _tol(target))
    assert mapped.get_seq_length() == context.shape[1]


def test_untouched_positions_keep_the_mapped_values(family):
    source, target, control = family
    ids = _ids(1, 40, 6)
    plain = prepare_cache(control, source, target, ids)
    spec = Recompute(exact_prefix=2, exact_suffix=3, exact_budget=0.2, select="source", spans="token")
    cache = prepare_cache(control, source, target, ids, recompute=spec)
    changed = ~torch.isclose(cache.layers[-1].keys, plain.layers[-1].keys).all(-1).all(1)[0]  # (T,)
    source_cache = run_model(source, ids[:, :-1])
    expected = recompute_set(
        spec,
        context=ids[:, :-1],
        mapped_cache=control.transfer(source_cache),
        source_model=source,
        target_model=target,
        source_cache=source_cache,
    )
    assert torch.nonzero(changed).flatten().tolist() == expected.tolist()
    assert len(expected) == 2 + 3 + round(0.2 * 39)


@pytest.mark.parametrize("select", ["source", "target", "deviation", "random"])
def test_every_selector_respects_the_budget_and_spares_prefix_and_suffix(family, select):
    source, target, control = family
    ids = _ids(1, 60, 8)
    context = ids[:, :-1]
    source_cache = run_model(source, context)
    spec = Recompute(exact_prefix=4, exact_suffix=5, exact_budget=0.25, select=select, spans="token")
    chosen = recompute_set(
        spec,
        context=context,
        mapped_cache=control.transfer(source_cache),
        source_model=source,
        target_model=target,
        source_cache=source_cache,
    )
    middle = [t for t in chosen.tolist() if 4 <= t < 54]
    assert chosen.tolist()[:4] == [0, 1, 2, 3] and chosen.tolist()[-5:] == list(range(54, 59))
    assert len(middle) == round(0.25 * 59)
    assert source_cache.get_seq_length() == 59  # the caller's source cache is left as it was


def test_selection_needs_one_sequence(family):
    source, target, control = family
    with pytest.raises(ConfigError, match="batch 1"):
        prepare_cache(control, source, target, _ids(2, 20, 9), recompute=Recompute(exact_budget=0.1))


def test_batched_handoff_with_selection_prepares_each_row(family):
    """Over the control map (where the chosen tokens change the cache), each row of a selective handoff of a batch
    of 2 generates what the target generates from that row's own prepare_cache with the same spec, and the
    selection matters there.  Planted bugs caught: a batched handoff skipping the selection (for every row, or
    for rows after the first), or selecting once for the whole batch."""
    from kvhub.serving.handoff import handoff

    source, target, control = family
    ids = _ids(2, 40, 11)
    spec = Recompute(exact_prefix=2, exact_suffix=3, exact_budget=0.3, select="target", spans="token")
    generate = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6)
    out = handoff(control, source, target, ids, recompute=spec, **generate)

    def from_cache(row, recompute):
        cache = prepare_cache(control, source, target, row, recompute=recompute)
        return target.generate(row, attention_mask=torch.ones_like(row), **cache_kwargs(target, cache), **generate)

    for index in range(2):
        row = ids[index : index + 1]
        assert torch.equal(out[index : index + 1], from_cache(row, spec)), f"row {index}"
        assert not torch.equal(from_cache(row, Recompute(2, 3)), from_cache(row, spec))  # the selection shows


def test_handoff_takes_a_whole_recompute_spec(family):
    """handoff(recompute=spec) generates from exactly the cache prepare_cache builds for that spec (here over the
    control map, where the choice of tokens changes the cache), not from its keyword defaults."""
    from kvhub.serving.handoff import handoff

    source, target, control = family
    ids = _ids(1, 48, 12)
    spec = Recompute.parse("exact_prefix=2,exact_suffix=3,exact_budget=0.25,select=target,queries=4,spans=token")
    cache = prepare_cache(control, source, target, ids, recompute=spec)
    want = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        **cache_kwargs(target, cache),
        max_new_tokens=6,
        do_sample=False,
        min_new_tokens=6,
    )
    got = handoff(control, source, target, ids, recompute=spec, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(got, want)
    default = prepare_cache(
        control, source, target, ids, recompute=Recompute(exact_prefix=4, exact_suffix=16, exact_budget=0.08)
    )
    from_default = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        **cache_kwargs(target, default),
        max_new_tokens=6,
        do_sample=False,
        min_new_tokens=6,
    )
    assert not torch.equal(from_default, want)  # so the spec, not the defaults, made ``got``


def test_sliding_window_targets_keep_prefix_and_suffix_recomputes_and_refuse_selection():
    """A windowed cache cannot address positions: prefix/suffix take the windowed path, the default handoff
    drops its selective budget, and an explicit one is refused with the fix.

    Known answers over the control map (a mean K/V at every mapped position), context inside the window: the
    first p positions are the target's own K/V at every layer (the target computed them from the prefix alone),
    the last r are its own at layer 0 (K/V there depend on the token and its position only), the mapped middle
    is not.  Planted bugs caught: _windowed_prefix_suffix skipping the prefix overwrite, or the suffix prefill
    (the cache would then be r positions short)."""
    from kvhub.serving.handoff import handoff

    model = make_model("mistral", sliding_window=16, head_dim=16)
    mapper = fit_tiny(model, model, source_id="tiny/m", target_id="tiny/m", top_k=1, ridge_lambda=1e-9)
    assert mapper.windowed_target()
    ids = _ids(1, 13, 4)  # a context of 12 tokens: every layer still holds every position
    cache = prepare_cache(
        control_mapper(mapper), model, model, ids, recompute=Recompute(exact_prefix=3, exact_suffix=4)
    )
    own = run_model(model, ids[:, :-1])
    tolerance = _tol(model)
    assert cache.get_seq_length() == 12
    _assert_caches_equal(cache, own, tolerance, positions=[0, 1, 2])
    first, own_first = cache.layers[0], own.layers[0]
    for name in ("keys", "values"):
        got, want = getattr(first, name), getattr(own_first, name)
        assert torch.allclose(got[:, :, 8:], want[:, :, 8:], rtol=tolerance, atol=tolerance * float(want.abs().max()))
        assert not torch.allclose(got[:, :, 3:8], want[:, :, 3:8], atol=1e-3)  # the mapped middle is the control's
    ids = _ids(1, 30, 4)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert torch.equal(handoff(mapper, model, model, ids, max_new_tokens=6, do_sample=False), want)
    with pytest.raises(ConfigError, match="sliding-window"):
        prepare_cache(mapper, model, model, ids, recompute=Recompute(exact_budget=0.1))
