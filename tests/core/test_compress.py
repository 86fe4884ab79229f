"""Compressed maps: head-local (block-diagonal over KV head groups) and low-rank (reduced-rank ridge)."""

import json

import pytest
import torch

from kvhub.core.capture import cache_kwargs, run_model
from kvhub.errors import ConfigError
from kvhub.core.mapper import Mapper
from kvhub.core.solve import Structure, fit_map, group_rows, head_groups, map_r2, ridge, r2_score, solve
from kvhub.core.stats import KVStats, Layout, Moments
from tests.tinymodels import exact_family_target, make_model
from tests.tolerances import assert_close, cache_condition, condition_number, rtol
from tests.fixtures_fit import fit_tiny, token_ids as _ids

TRAIN_TOKENS, HELDOUT_TOKENS = 24 * 32, 6 * 32  # of _fit
R2_TOL = rtol(torch.float32, terms=HELDOUT_TOKENS)  # R^2 from fp32 moment products over the held-out tokens


def _moments(x, y):
    m = Moments(x.shape[1], y.shape[1])
    m.update(x, y)
    return m


def test_group_rows_pick_each_groups_heads_of_every_source_layer():
    # 2 source layers of width 8 (4 heads x 2 dims), 2 groups: group 1 = heads 2,3 of each layer
    assert group_rows(2, 8, 2, 1).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert group_rows(1, 8, 1, 0).tolist() == list(range(8))
    assert head_groups(2, 4) == 2 and head_groups(4, 6) == 2 and head_groups(3, 4) == 1


def test_head_local_recovers_a_block_diagonal_map_and_misses_a_dense_one():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 8, generator=gen, dtype=torch.float64)
    block = torch.zeros(8, 6, dtype=torch.float64)
    block[:4, :3] = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    block[4:, 3:] = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    dense = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    cols, ycols = torch.arange(8), slice(0, 6)
    local = Structure(groups=2)
    exact = _moments(x, x @ block + 0.5)
    linear = fit_map(exact, cols, ycols, 1e-12, local, 1, 8)
    # fp64 data, but the moments are multiplied in fp32 (kvhub/core/stats.py) over 4000 rows
    assert 1 - map_r2(exact, cols, ycols, linear, 1, 8) < rtol(torch.float32, terms=4000)
    assert_close(linear.dense(1, 8), block, terms=4000, condition=condition_number(x))
    assert_close(linear.bias, torch.full((6,), 0.5, dtype=torch.float64), terms=4000, condition=condition_number(x))
    assert linear.num_parameters() == 2 * 4 * 3 + 6
    mixed = _moments(x, x @ dense)
    assert map_r2(mixed, cols, ycols, fit_map(mixed, cols, ycols, 1e-12, local, 1, 8), 1, 8) < 0.9


def test_reduced_rank_ridge_meets_its_closed_form_loss():
    """OLS residuals are orthogonal to X, so ||Y - X W P||^2 = SSE_ols + sum of the discarded eigenvalues of
    (XW)^T (XW): the rank-r reduced-rank fit's train R^2 is known in closed form, and beats truncating W's SVD."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3000, 10, generator=gen, dtype=torch.float64)
    w = torch.randn(10, 3, generator=gen, dtype=torch.float64) @ torch.randn(3, 7, generator=gen, dtype=torch.float64)
    y = x @ w + 0.3 * torch.randn(3000, 7, generator=gen, dtype=torch.float64)
    stats = _moments(x, y)
    cols, ycols = torch.arange(10), slice(0, 7)
    weight, bias = ridge(stats, cols, ycols, 0.0)
    sse_ols = (1 - r2_score(stats, cols, ycols, weight, bias)) * float(stats.syy.sum())
    eig = torch.linalg.eigvalsh(weight.T @ stats.cxx @ weight)  # ascending
    # The identity needs W^T Cxy = W^T Cxx W, which holds only up to the rounding of the fp32 moment products
    # (Cxx is not even exactly symmetric): float32 precision of R^2, however exact the fp64 solve.
    moment_tol = rtol(torch.float32)
    for rank in (1, 2, 3):
        linear = fit_map(stats, cols, ycols, 0.0, Structure(rank=rank), 1, 10)
        expected = 1 - (sse_ols + float(eig[: 7 - rank].sum())) / float(stats.syy.sum())
        assert map_r2(stats, cols, ycols, linear, 1, 10) == pytest.approx(expected, abs=moment_tol)
        assert linear.rank == rank and linear.num_parameters() == 10 * rank + rank * 7 + 7
        u, s, vh = torch.linalg.svd(weight, full_matrices=False)
        truncated = u[:, :rank] @ torch.diag(s[:rank]) @ vh[:rank]
        naive = r2_score(stats, cols, ycols, truncated, stats.mean_y - stats.mean_x @ truncated)
        assert map_r2(stats, cols, ycols, linear, 1, 10) >= naive - moment_tol
    # At the planted rank the fit loses to OLS only the noise OLS fitted in the 7 - 3 discarded output
    # directions: about sigma^2 * 10 inputs * 4 directions (x3 for the chi-square tail) of sum(syy).
    full_rank = fit_map(stats, cols, ycols, 0.0, Structure(rank=3), 1, 10)
    noise_share = 3 * 0.3**2 * 10 * 4 / float(stats.syy.sum())
    assert 0 <= (1 - sse_ols / float(stats.syy.sum())) - map_r2(stats, cols, ycols, full_rank, 1, 10) < noise_share


def test_solve_rejects_groups_that_do_not_divide_the_widths():
    stats = KVStats(Layout(2, 6, 2, 6))
    gen = torch.Generator().manual_seed(2)
    stats.update(
        [torch.randn(50, 6, generator=gen)] * 2,
        [torch.randn(50, 6, generator=gen)] * 2,
        [torch.randn(50, 6, generator=gen)] * 2,
        [torch.randn(50, 6, generator=gen)] * 2,
    )
    with pytest.raises(ConfigError, match="head groups"):
        solve(stats, top_k=1, ridge_lambda=0.01, structure=Structure(groups=4))
    with pytest.raises(ConfigError, match="rank"):
        Structure(rank=0)


@pytest.fixture(scope="module")
def family():
    source = make_model("qwen2", num_hidden_layers=3)
    target, _ = exact_family_target(source, insert_before=(1,), kv_repeat=2, double_head_dim=True)
    return source, target


def _fit(source, target, top_k=None, **options):
    return fit_tiny(source, target, top_k=top_k, ridge_lambda=1e-9, **options)


def _greedy(model, ids, cache=None):
    kwargs = cache_kwargs(model, cache) if cache is not None else {}
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, **kwargs)


@pytest.mark.parametrize("options", [{"head_local": True}, {"rank": 32}, {"head_local": True, "rank": 16}])
def test_compressed_maps_stay_exact_on_an_exact_family_and_round_trip(family, options, tmp_path):
    """The exact family's target KV head pair 2i, 2i+1 copies source head i (head-local), and each
    target layer is a copy of one source layer of width 32 (rank <= 32; 16 per head group)."""
    source, target = family
    # two source layers each (a superset of the one the exact family copies): "auto" may pick more layers in
    # one fit than in the other where floating-point ties differ by CPU; then sizes would not compare like for like
    dense = _fit(source, target, top_k=2)
    mapper = _fit(source, target, top_k=2, **options)
    assert mapper.num_parameters() < dense.num_parameters()
    for layer in mapper.layers:
        assert abs(1 - layer["r2_k"]) < R2_TOL and abs(1 - layer["r2_v"]) < R2_TOL
    path = mapper.save(tmp_path / "m")
    metadata = json.loads((path / "mapper.json").read_text())
    assert metadata["format_version"] == 3 and metadata["structure"]["rank"] == options.get("rank")
    loaded = Mapper.load(path)
    ids = _ids(1, 20, 5)
    cache = loaded.transfer(run_model(source, ids[:, :-1]))
    own = run_model(target, ids[:, :-1])
    condition = cache_condition(source, _ids(24, 32, 0))  # the map is solved from fp32 moments of these tokens
    for got, want in zip(cache.layers, own.layers):
        assert_close(got.keys, want.keys, terms=TRAIN_TOKENS, condition=condition)
        assert_close(got.values, want.values, terms=TRAIN_TOKENS, condition=condition)
    assert torch.equal(_greedy(target, ids, cache), _greedy(target, ids))


def test_too_small_rank_loses_the_exact_map(family):
    source, target = family
    mapper = _fit(source, target, rank=4)
    assert min(layer["r2_v"] for layer in mapper.layers) < 0.99
    assert Mapper(dict(mapper.tensors), mapper.metadata).format_version() == 3  # fits store target_mean
    no_means = {name: t for name, t in mapper.tensors.items() if not name.endswith(".target_mean")}
    assert Mapper(no_means, mapper.metadata).format_version() == 2
    assert _fit(source, target).format_version() == 3
