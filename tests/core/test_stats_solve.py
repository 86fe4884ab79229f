"""Sufficient statistics and closed-form solves: known answers."""

import pytest
import torch

from kvhub.errors import FitError, IncompatibleError
from kvhub.core.solve import probe_r2, r2_score, ridge, solve
from kvhub.core.stats import KVStats, Layout, Moments
from tests.tolerances import assert_close, condition_number, rtol


def _planted(n, layout, sources_of, *, noise=0.0, seed=0):
    """Random source blocks and target blocks that are affine maps of the planted source layers."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, layout.src_width, generator=gen) * (1 + l) + l for l in range(layout.src_layers)]
    maps = {}
    ys = []
    for m in range(layout.dst_layers):
        x = torch.cat([xs[l] for l in sources_of[m]], 1)
        w = torch.randn(x.shape[1], layout.dst_width, generator=torch.Generator().manual_seed(100 + m))
        b = torch.randn(layout.dst_width, generator=torch.Generator().manual_seed(200 + m))
        maps[m] = (w, b)
        ys.append(x @ w + b + noise * torch.randn(n, layout.dst_width, generator=gen))
    return xs, ys, maps


def test_merged_shards_equal_whole():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(500, 6, generator=gen) * 3 + 5, torch.randn(500, 4, generator=gen) - 2
    whole = Moments(6, 4)
    whole.update(x, y)
    a, b = Moments(6, 4), Moments(6, 4)
    for i in range(0, 300, 37):
        a.update(x[i : min(i + 37, 300)], y[i : min(i + 37, 300)])
    b.update(x[300:], y[300:])
    merged = a + b
    assert merged.n == whole.n == 500
    for name in ("mean_x", "mean_y", "cxx", "cxy", "syy"):  # products of up to 300 rows in fp32
        assert_close(getattr(merged, name), getattr(whole, name), terms=500, msg=name)
    xc = x.double() - x.double().mean(0)
    assert_close(whole.cxx, xc.T @ xc, terms=500)


def test_large_offset_stays_accurate():
    """Centred updates keep the covariance right when the mean dwarfs the spread."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4000, 3, generator=gen) + 1e4
    m = Moments(3, 1)
    for i in range(0, 4000, 100):
        m.update(x[i : i + 100], x[i : i + 100, :1])
    exact = torch.cov(x.double().T) * 3999
    # fp32 products of 100 centred rows per batch; uncentred fp32 sums of x^2 ~ 1e8 would be off by ~1e4
    assert_close(m.cxx, exact, terms=100)


def test_ridge_recovers_noiseless_affine_map_with_r2_one():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(400, 5, generator=gen)
    w, b = torch.randn(5, 3, generator=gen), torch.randn(3, generator=gen)
    m = Moments(5, 3)
    m.update(x, x @ w + b)
    cols = torch.arange(5)
    weight, bias = ridge(m, cols, slice(None), 1e-10)
    # The targets are computed in fp32 and the moments multiplied in fp32 over 400 rows: "noiseless" means
    # up to float32 rounding, which the solve amplifies by the Gram matrix's condition number.
    condition = condition_number(x)
    assert_close(weight, w.double(), terms=400, condition=condition)
    assert_close(bias, b.double(), terms=400, condition=condition)
    assert 1 - r2_score(m, cols, slice(None), weight, bias) < rtol(torch.float32, terms=400)


def test_heldout_r2_from_statistics_matches_direct_computation():
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(300, 4, generator=gen), torch.randn(300, 2, generator=gen)
    y = y + x[:, :2]
    train, held = Moments(4, 2), Moments(4, 2)
    train.update(x[:200], y[:200])
    held.update(x[200:], y[200:])
    weight, bias = ridge(train, torch.arange(4), slice(None), 0.1)
    pred = x[200:].double() @ weight + bias
    resid = ((y[200:].double() - pred) ** 2).sum()
    total = ((y[200:].double() - y[200:].double().mean(0)) ** 2).sum()
    # the statistics' fp32 products over 100 rows against an fp64 computation on the same rows
    assert r2_score(held, torch.arange(4), slice(None), weight, bias) == pytest.approx(
        float(1 - resid / total), abs=rtol(torch.float32, terms=100)
    )


def test_planted_map_recovered_with_right_source_layers():
    layout = Layout(src_layers=5, src_width=4, dst_layers=3, dst_width=6)
    sources_of = {0: [1], 1: [0, 3], 2: [2, 4]}
    train, held = KVStats(layout), KVStats(layout)
    noise = 1e-3
    for split, n, seed in ((train, 3000, 0), (held, 800, 1)):
        xs, ys, _ = _planted(n, layout, sources_of, noise=noise, seed=seed)
        split.update(xs, xs, ys, ys)
    solution = solve(train, held)  # k and lambda None: chosen per target layer
    for layer in solution.layers:
        assert set(sources_of[layer.target]) <= set(layer.sources)
        # unexplained: the planted noise's share of the variance, plus fp32 rounding of the moments
        unexplained = noise**2 / float(ys[layer.target].var(0).min()) + rtol(torch.float32, terms=3000)
        assert layer.r2_k > 1 - unexplained and layer.r2_v > 1 - unexplained
    probe_k, _ = probe_r2(train, held)
    assert int(probe_k[:, 0].argmax()) == 1


def test_fixed_k_with_too_few_observations_is_refused():
    layout = Layout(src_layers=4, src_width=8, dst_layers=1, dst_width=2)
    stats = KVStats(layout)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(20, 8, generator=gen) for _ in range(4)]
    stats.update(xs, xs, [torch.randn(20, 2, generator=gen)], [torch.randn(20, 2, generator=gen)])
    with pytest.raises(FitError, match="training observations"):
        solve(stats, None, top_k=3, ridge_lambda=0.01)
    with pytest.raises(FitError, match="more observations than features"):
        solve(KVStats.from_state_dict(_tiny_state(layout)), None)


def _tiny_state(layout):
    stats = KVStats(layout)
    gen = torch.Generator().manual_seed(6)
    xs = [torch.randn(5, 8, generator=gen) for _ in range(4)]
    stats.update(xs, xs, [torch.randn(5, 2, generator=gen)], [torch.randn(5, 2, generator=gen)])
    return stats.state_dict()


def test_stats_state_dict_round_trip():
    layout = Layout(2, 3, 2, 2)
    stats = KVStats(layout)
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(10, 3, generator=gen) for _ in range(2)]
    ys = [torch.randn(10, 2, generator=gen) for _ in range(2)]
    stats.update(xs, xs, ys, ys)
    back = KVStats.from_state_dict(stats.state_dict())
    assert back.layout == layout and back.n == 10
    for name, tensor in stats.state_dict().items():  # a round trip stores the bits, no arithmetic
        assert torch.equal(back.state_dict()[name], tensor), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_diagonal_gram_blocks_equal_the_exact_centred_blocks(dtype):
    """Block-diagonal moments (a probe pass's): each stored block is Xc_l^T Xc_l of the whole data, streamed
    or merged, with fp64 or fp32 totals; the cross block is the full Xc^T Yc."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(600, 12, generator=gen) * 2 + torch.arange(600)[:, None] / 100  # a drifting mean
    y = x[:, :5] * 0.3 + torch.randn(600, 5, generator=gen)
    streamed, first, second = (Moments(12, 5, gram_blocks=3, dtype=dtype) for _ in range(3))
    for start in range(0, 600, 50):
        streamed.update(x[start : start + 50], y[start : start + 50])
        (first if start < 350 else second).update(x[start : start + 50], y[start : start + 50])
    merged = first + second
    xc, yc = x.double() - x.double().mean(0), y.double() - y.double().mean(0)
    tolerance = dict(terms=600)  # fp32 products over 600 rows (fp32 totals add 12 roundings: far less)
    for stats in (streamed, merged):
        assert tuple(stats.cxx.shape) == (3, 4, 4) and stats.cxx.dtype == dtype
        for block in range(3):
            cols = slice(4 * block, 4 * block + 4)
            assert_close(stats.cxx[block].double(), xc[:, cols].T @ xc[:, cols], **tolerance)
            view = stats.source_block(block, 4)  # what the probe reads
            assert_close(view.cxy.double(), xc[:, cols].T @ yc, **tolerance)
            assert torch.equal(view.cxx, stats.cxx[block])
        assert_close(stats.syy, (yc * yc).sum(0), terms=600)
    with pytest.raises(IncompatibleError, match="cannot merge"):
        streamed.merge_(Moments(12, 5))


def test_k_and_lambda_are_chosen_on_held_out_r2_never_on_the_training_fit():
    """Issue 47, item 4's check: with few noisy training rows the training fit always prefers the weakest ridge
    and the most source layers it can fit (it fits the noise); the auto choice is the one whose held-out R^2 is highest,
    each lambda and k scored alone by a fixed solve of the same statistics.
    Planted bug caught: choosing by ``train_r2`` picks lambda 1e-3 and the largest k."""
    from kvhub.core.solve import LAMBDA_GRID

    layout = Layout(src_layers=6, src_width=8, dst_layers=1, dst_width=4)
    train, held = KVStats(layout), KVStats(layout)
    for split, n, seed in ((train, 30, 0), (held, 3000, 1)):
        xs, ys, _ = _planted(n, layout, {0: [2]}, noise=8.0, seed=seed)
        split.update(xs, xs, ys, ys)
    (chosen,) = solve(train, held).layers
    k = len(chosen.sources)
    fixed = {lam: solve(train, held, top_k=k, ridge_lambda=lam).layers[0] for lam in LAMBDA_GRID}
    held_best = max(LAMBDA_GRID, key=lambda lam: fixed[lam].r2_k)
    train_best = max(LAMBDA_GRID, key=lambda lam: fixed[lam].train_r2_k)
    assert train_best != held_best  # the statistics tell the two apart, so the test can fail
    assert chosen.k_map.ridge_lambda == held_best
    assert chosen.r2_k == pytest.approx(fixed[held_best].r2_k)
    per_k = {c: solve(train, held, top_k=c, ridge_lambda=chosen.k_map.ridge_lambda).layers[0] for c in (1, 2, 3)}
    assert max(per_k[c].train_r2_k for c in per_k) == per_k[3].train_r2_k  # training prefers the most layers
    assert k < 3 and (chosen.r2_k + chosen.r2_v) / 2 >= max((s.r2_k + s.r2_v) / 2 for s in per_k.values()) - 1e-9
