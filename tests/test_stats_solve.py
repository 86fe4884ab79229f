"""Sufficient statistics and closed-form solves: known answers."""

import pytest
import torch

from kvhub.errors import FitError
from kvhub.solve import probe_r2, r2_score, ridge, solve
from kvhub.stats import KVStats, Layout, Moments


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
    for name in ("mean_x", "mean_y", "cxx", "cxy", "syy"):
        torch.testing.assert_close(getattr(merged, name), getattr(whole, name), rtol=1e-5, atol=1e-6)
    xc = x.double() - x.double().mean(0)
    torch.testing.assert_close(whole.cxx, xc.T @ xc, rtol=1e-5, atol=1e-6)


def test_large_offset_stays_accurate():
    """Centred updates keep the covariance right when the mean dwarfs the spread."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4000, 3, generator=gen) + 1e4
    m = Moments(3, 1)
    for i in range(0, 4000, 100):
        m.update(x[i : i + 100], x[i : i + 100, :1])
    exact = torch.cov(x.double().T) * 3999
    torch.testing.assert_close(m.cxx, exact, rtol=1e-3, atol=1e-2)


def test_ridge_recovers_noiseless_affine_map_with_r2_one():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(400, 5, generator=gen)
    w, b = torch.randn(5, 3, generator=gen), torch.randn(3, generator=gen)
    m = Moments(5, 3)
    m.update(x, x @ w + b)
    cols = torch.arange(5)
    weight, bias = ridge(m, cols, slice(None), 1e-10)
    torch.testing.assert_close(weight.float(), w, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(bias.float(), b, atol=1e-4, rtol=1e-4)
    assert r2_score(m, cols, slice(None), weight, bias) > 1 - 1e-8


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
    assert r2_score(held, torch.arange(4), slice(None), weight, bias) == pytest.approx(float(1 - resid / total), abs=1e-6)


def test_planted_map_recovered_with_right_source_layers():
    layout = Layout(src_layers=5, src_width=4, dst_layers=3, dst_width=6)
    sources_of = {0: [1], 1: [0, 3], 2: [2, 4]}
    train, held = KVStats(layout), KVStats(layout)
    for split, n, seed in ((train, 3000, 0), (held, 800, 1)):
        xs, ys, _ = _planted(n, layout, sources_of, noise=1e-3, seed=seed)
        split.update(xs, xs, ys, ys)
    solution = solve(train, held, k="auto", lambda_="auto")
    for layer in solution.layers:
        assert set(sources_of[layer.target]) <= set(layer.sources)
        assert layer.r2_k > 0.9999 and layer.r2_v > 0.9999
    probe_k, _ = probe_r2(train, held)
    assert int(probe_k[:, 0].argmax()) == 1


def test_fixed_k_with_too_few_observations_is_refused():
    layout = Layout(src_layers=4, src_width=8, dst_layers=1, dst_width=2)
    stats = KVStats(layout)
    xs = [torch.randn(20, 8) for _ in range(4)]
    stats.update(xs, xs, [torch.randn(20, 2)], [torch.randn(20, 2)])
    with pytest.raises(FitError, match="training observations"):
        solve(stats, None, k=3, lambda_=0.01)
    with pytest.raises(FitError, match="more observations than features"):
        solve(KVStats.from_state_dict(_tiny_state(layout)), None)


def _tiny_state(layout):
    stats = KVStats(layout)
    xs = [torch.randn(5, 8) for _ in range(4)]
    stats.update(xs, xs, [torch.randn(5, 2)], [torch.randn(5, 2)])
    return stats.state_dict()


def test_stats_state_dict_round_trip():
    layout = Layout(2, 3, 2, 2)
    stats = KVStats(layout)
    xs = [torch.randn(10, 3) for _ in range(2)]
    ys = [torch.randn(10, 2) for _ in range(2)]
    stats.update(xs, xs, ys, ys)
    back = KVStats.from_state_dict(stats.state_dict())
    assert back.layout == layout and back.n == 10
    torch.testing.assert_close(back.k.cxy, stats.k.cxy)
