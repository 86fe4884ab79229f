"""Attention-weighted ridge: weighted moments, the target's attention weights, and weighted fits."""

import pytest
import torch

from kvhub.core.capture import capture, run_model, token_attention_weights, token_mask
from kvhub.errors import ConfigError
from kvhub.fitting.checkpoint import job_identity
from kvhub.fitting.fit import fit
from kvhub.fitting.options import FitOptions
from kvhub.core.solve import r2_score, ridge
from kvhub.core.stats import KVStats, Layout, Moments
from tests.tinymodels import exact_family_target, make_model
from tests.tolerances import assert_close, cache_condition, rtol
from tests.fixtures_fit import fit_tiny, token_ids as _ids

FIELDS = ("mean_x", "mean_y", "cxx", "cxy", "syy")


def _data(n=60, p=5, q=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, p, generator=gen) * 2 + 3
    y = x[:, :q] * 0.5 + torch.randn(n, q, generator=gen) - 1
    weight = torch.randint(0, 4, (n,), generator=gen).float()  # zeros included
    return x, y, weight


def _repeated(x, y, weight):
    counts = weight.long()
    return x.repeat_interleave(counts, 0), y.repeat_interleave(counts, 0)


def _assert_same_moments(a: Moments, b: Moments):
    """Equal up to the fp32 products of the moments over the (repeated) rows."""
    for name in FIELDS:
        assert_close(getattr(a, name), getattr(b, name), terms=max(a.n, b.n, int(b.weight_sum)), msg=name)


# ---- weighted moments ------------------------------------------------------------------------------
def test_integer_weights_equal_repeated_rows():
    x, y, weight = _data()
    weighted = Moments.from_batch(x, y, weight)
    repeated = Moments.from_batch(*_repeated(x, y, weight))
    _assert_same_moments(weighted, repeated)
    assert weighted.n == 60 and weighted.weight_sum == float(weight.sum()) == repeated.n


def test_weighted_updates_and_merges_in_chunks_equal_repeated_rows():
    x, y, weight = _data(n=90, seed=1)
    whole = Moments.from_batch(*_repeated(x, y, weight))
    streamed = Moments(5, 3)
    parts = []
    for start, stop in ((0, 7), (7, 30), (30, 31), (31, 64), (64, 90)):
        streamed.update(x[start:stop], y[start:stop], weight[start:stop])
        part = Moments(5, 3)
        part.update(x[start:stop], y[start:stop], weight[start:stop])
        parts.append(part)
    merged = parts[0] + parts[1] + (parts[2] + parts[3]) + parts[4]
    for stats in (streamed, merged):
        _assert_same_moments(stats, whole)
        assert stats.n == 90 and stats.weight_sum == pytest.approx(float(weight.sum()))


def test_zero_weight_chunk_counts_rows_but_carries_no_mass():
    x, y, weight = _data(n=20, seed=2)
    stats = Moments(5, 3)
    stats.update(x[:5], y[:5], torch.zeros(5))
    stats.update(x[5:], y[5:], weight[5:])
    _assert_same_moments(stats, Moments.from_batch(x[5:], y[5:], weight[5:]))
    assert stats.n == 20 and stats.weight_sum == float(weight[5:].sum())


def test_unweighted_moments_unchanged():
    """No weights: exactly the unweighted formulas (batch mean, fp32 products, fp64 Syy), weight_sum = n."""
    x, y, _ = _data(seed=3)
    stats = Moments.from_batch(x, y)
    mean_x, mean_y = x.double().mean(0), y.double().mean(0)
    xc, yc = (x.double() - mean_x).float(), (y.double() - mean_y).float()
    assert torch.equal(stats.mean_x, mean_x) and torch.equal(stats.mean_y, mean_y)
    assert torch.equal(stats.cxx, (xc.T @ xc).double()) and torch.equal(stats.cxy, (xc.T @ yc).double())
    assert torch.equal(stats.syy, ((y.double() - mean_y) ** 2).sum(0))
    assert stats.n == 60 and stats.weight_sum == 60.0
    _assert_same_moments(Moments.from_batch(x, y, torch.ones(60)), stats)


def test_weighted_r2_equals_r2_on_repeated_rows():
    x, y, weight = _data(n=80, seed=4)
    cols = torch.arange(5)
    train = Moments.from_batch(x[:50], y[:50], weight[:50])
    coef, bias = ridge(train, cols, slice(None), 0.1)
    held = Moments.from_batch(x[50:], y[50:], weight[50:])
    expanded = Moments.from_batch(*_repeated(x[50:], y[50:], weight[50:]))
    assert r2_score(held, cols, slice(None), coef, bias) == pytest.approx(
        r2_score(expanded, cols, slice(None), coef, bias), abs=rtol(torch.float32, terms=expanded.n)
    )


def test_state_dict_round_trip_and_old_state_without_weight_sum():
    layout = Layout(2, 3, 1, 2)
    x, y, weight = _data(n=12, p=6, q=2, seed=5)
    stats = KVStats(layout)
    stats.update([x[:, :3], x[:, 3:]], [x[:, :3], x[:, 3:]], [y], [y], weights=weight)
    state = stats.state_dict()
    back = KVStats.from_state_dict(state)
    assert back.k.weight_sum == back.v.weight_sum == float(weight.sum()) and back.n == 12
    old = {key: value for key, value in state.items() if not key.endswith("weight_sum")}  # kvhub before weighting
    legacy = KVStats.from_state_dict(old)
    assert legacy.n == 12 and legacy.k.weight_sum == legacy.v.weight_sum == 12.0
    legacy.k.merge_(Moments.from_batch(x, y))
    assert legacy.k.n == 24 and legacy.k.weight_sum == 24.0


def test_bad_weights_refused():
    x, y, _ = _data(n=4)
    with pytest.raises(ConfigError, match="non-negative"):
        Moments.from_batch(x, y, torch.tensor([1.0, -1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="one weight per row"):
        Moments.from_batch(x, y, torch.ones(3))


# ---- attention weights -----------------------------------------------------------------------------
def _reference_raw(model, ids):
    """raw_t = mean over layers, heads and queries i >= t of (i + 1) A[i, t], from output_attentions."""
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions  # L x (B, H, T, T)
    probs = torch.stack(attentions, 1).double()  # (B, L, H, T, T)
    tokens = ids.shape[1]
    scaled = probs * torch.arange(1, tokens + 1, dtype=torch.float64)[:, None]  # (i + 1) A[i, t]
    layers_heads = probs.shape[1] * probs.shape[2]
    return scaled.sum((1, 2, 3)) / (layers_heads * torch.arange(tokens, 0, -1))  # (B, T)


@pytest.mark.parametrize("cap", [10.0, 1.1])
def test_attention_weights_match_definition_and_stride_mask(cap):
    model = make_model("qwen2", num_hidden_layers=2)
    ids = _ids(3, 20, 0)
    weights = token_attention_weights(model, ids, cap=cap, stride=3, skip_first=2)
    keep = token_mask(torch.ones_like(ids), stride=3, skip_first=2)
    clamped = _reference_raw(model, ids).clamp(max=cap) * keep
    expected = clamped / (clamped.sum(1, keepdim=True) / keep.sum(1, keepdim=True))
    # fp32 attention probabilities summed over layers, heads and the 20 queries
    tolerance = rtol(torch.float32, terms=2 * 4 * 20)
    assert_close(weights.double(), expected, terms=2 * 4 * 20)
    assert torch.all(weights[~keep] == 0)
    assert_close(weights.sum(1) / keep.sum(1), torch.ones(3), terms=20)  # mean 1 over kept tokens
    # the cap bounds the raw weight; after normalisation the ceiling is cap / mean(min(raw, cap))
    ceiling = cap / (clamped.sum(1) / keep.sum(1))
    assert torch.all(weights.double().max(1).values <= ceiling * (1 + tolerance))
    if cap < 2:
        assert (weights.double() >= ceiling[:, None] * (1 - tolerance)).sum() > 3  # several tokens clamped


def test_capture_weights_align_with_rows_in_the_same_forward():
    model = make_model("qwen2", num_hidden_layers=2)
    ids = _ids(2, 17, 1)
    captured = capture(model, ids, stride=4, skip_first=1, attention_weights=True)
    plain = capture(model, ids, stride=4, skip_first=1)
    keep = token_mask(torch.ones_like(ids), stride=4, skip_first=1)
    assert captured.weights.shape == (captured.tokens,) and plain.weights is None
    # the same forward either way: the same bits
    assert torch.equal(captured.weights, token_attention_weights(model, ids, stride=4, skip_first=1)[keep])
    assert torch.equal(captured.keys[1], plain.keys[1])  # tiny models already run eager attention


def test_uniform_attention_gives_weight_one_and_attention_implementation_is_restored():
    model = make_model("qwen2", num_hidden_layers=2)
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.data.zero_()
        layer.self_attn.q_proj.bias.data.zero_()  # all scores 0: uniform over the i + 1 visible keys
    model.set_attn_implementation("sdpa")
    ids = _ids(2, 15, 2)
    torch.testing.assert_close(token_attention_weights(model, ids), torch.ones(2, 15))
    keep = token_mask(torch.ones_like(ids), stride=2)
    torch.testing.assert_close(token_attention_weights(model, ids, stride=2), keep.float())
    assert model.config._attn_implementation == "sdpa"


def test_sliding_window_model_weights_have_mean_one():
    model = make_model("mistral", sliding_window=6, head_dim=16, num_hidden_layers=2)
    weights = token_attention_weights(model, _ids(2, 20, 3))
    torch.testing.assert_close(weights.mean(1), torch.ones(2))


def test_padded_batch_refused():
    model = make_model("qwen2", num_hidden_layers=1)
    ids = _ids(2, 8, 4)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with pytest.raises(ConfigError, match="unpadded"):
        capture(model, ids, attention_mask=mask, attention_weights=True)


# ---- weighted fits ---------------------------------------------------------------------------------
def test_attention_weighted_fit_keeps_an_exact_map_exact():
    source = make_model("qwen2", num_hidden_layers=3)
    target, _ = exact_family_target(source, insert_before=(1,), kv_repeat=2, double_head_dim=True)
    mapper = fit_tiny(source, target, ridge_lambda=1e-9, weighting="attention")
    assert mapper.metadata["fit"]["weighting"] == "attention" and mapper.metadata["fit"]["weight_cap"] == 10.0
    r2_tol = rtol(torch.float32, terms=6 * 32)  # R^2 from fp32 moment products over the held-out tokens
    assert all(abs(1 - layer["r2_k"]) < r2_tol and abs(1 - layer["r2_v"]) < r2_tol for layer in mapper.layers)
    ids = _ids(2, 40, 7)
    mapped = mapper.transfer(run_model(source, ids))
    # weights up to the cap of 10 scale the fp32 products over the 24 x 32 training tokens
    condition = 10 * cache_condition(source, _ids(24, 32, 0))
    for m, (a, b) in enumerate(zip(mapped.layers, run_model(target, ids).layers)):
        assert_close(a.keys, b.keys, terms=24 * 32, condition=condition, msg=f"keys of layer {m}")
        assert_close(a.values, b.values, terms=24 * 32, condition=condition, msg=f"values of layer {m}")


def test_unknown_weighting_refused():
    model = make_model("qwen2", num_hidden_layers=1)
    with pytest.raises(ConfigError, match="weighting"):
        fit(
            model,
            model,
            _ids(4, 8, 0),
            None,
            source_id="a",
            target_id="a",
            options=FitOptions(top_k=1, ridge_lambda=0.01, stride=1, weighting="entropy"),
        )


def test_job_hash_separates_weightings():
    fp = {"config_hash": "abc"}
    ids = _ids(2, 8, 0)

    def job(**options):
        return job_identity(fp, fp, ids, None, FitOptions(**options))

    assert job() != job(weighting="attention")
    assert job(weighting="attention") != job(weighting="attention", weight_cap=5.0)
    assert job() == job(weight_cap=5.0)  # the cap means nothing to a uniform fit
