"""Issue 47, item 4: every fit path chooses a target layer's k (source layers) and ridge lambdas (K and V) on
held-out R^2 only, and ranks the source layers by the mean of the K and V held-out probe R^2.

The data (:func:`_rows`): 6 source layers of width 4, one target layer of width 3.  Target K and V are affine
maps of source layers STRONG and WEAK plus noise; the other source layers are noise, except that in the
training split only, source layer SPURIOUS is a noisy copy of the target keys.  Few training rows, many
held-out ones: fitted and scored on the training rows, more source layers and a weaker ridge always look
better, and SPURIOUS looks like the second-best source layer; on the held-out rows they do not.

Every expected answer is computed here from the raw rows in fp64 (:func:`_ridge`, :func:`_r2`), not from the
statistics, by the documented procedure (:func:`_choice`: probe ranking, then the coordinate search of
:func:`kvhub.core.solve._solve_layer`).  Each test also computes the same procedure on the training rows and
asserts it chooses differently, so a path that chose on training R^2 fails it.  Each held-out argmax wins by
more than the rounding of the fp32 statistics (:func:`_argmax`), so a failure is never a near-tie.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from kvhub.core.solve import (
    DEFAULT_LAMBDA,
    DEFAULT_TOP_K,
    LAMBDA_GRID,
    PROBE_LAMBDA,
    Structure,
    rank_sources,
    solve,
)
from kvhub.core.stats import KVStats, Layout
from kvhub.fitting import mlp_fit
from kvhub.fitting.checkpoint import FitState
from kvhub.fitting.fit import build_mapper, solve_statistics
from kvhub.fitting.modes import ONE_PASS, StatisticsMode
from kvhub.fitting.options import FitOptions
from kvhub.fitting.samples import Reservoir
from kvhub.fitting.two_pass import second_pass
from tests.tolerances import rtol

LAYOUT = Layout(src_layers=6, src_width=4, dst_layers=1, dst_width=3)
STRONG, WEAK, SPURIOUS = 4, 2, 1
HELDOUT_ROWS = 4000
# how far fp32 statistics over the held-out rows may move an R^2 (relative to 1 - R^2, at least 1)
R2_ROUNDING = rtol(torch.float32, terms=HELDOUT_ROWS)


class Rows(NamedTuple):
    """One split's raw rows: source layers (n, 4) each (the same rows feed K and V), target K and V (n, 3)."""

    sources: list[torch.Tensor]
    keys: torch.Tensor
    values: torch.Tensor

    def target(self, kind: str) -> torch.Tensor:
        return self.keys if kind == "k" else self.values


def _rows(n: int, seed: int, *, spurious: bool, noise_k: float, noise_v: float) -> Rows:
    """The module docstring's data: the maps are the same in both splits, the rows and the noise are not."""
    gen = torch.Generator().manual_seed(seed)
    sources = [torch.randn(n, 4, generator=gen) + l for l in range(LAYOUT.src_layers)]
    maps = torch.Generator().manual_seed(99)
    a_strong, a_weak, b_strong, b_weak = (torch.randn(4, 3, generator=maps) for _ in range(4))
    keys = sources[STRONG] @ a_strong + 0.5 * sources[WEAK] @ a_weak + noise_k * torch.randn(n, 3, generator=gen)
    values = sources[STRONG] @ b_strong + 0.5 * sources[WEAK] @ b_weak + noise_v * torch.randn(n, 3, generator=gen)
    if spurious:
        sources[SPURIOUS] = keys @ torch.randn(3, 4, generator=maps) + 0.3 * torch.randn(n, 4, generator=gen)
    return Rows(sources, keys, values)


def _splits(train_rows: int, *, noise_k: float, noise_v: float) -> tuple[Rows, Rows]:
    train = _rows(train_rows, 0, spurious=True, noise_k=noise_k, noise_v=noise_v)
    return train, _rows(HELDOUT_ROWS, 1, spurious=False, noise_k=noise_k, noise_v=noise_v)


def _stats(rows: Rows, *, gram: str = "full", layers: list[int] | None = None) -> KVStats:
    """Statistics of ``rows`` over the source ``layers`` (None: all), as a fit accumulates them."""
    layers = list(range(LAYOUT.src_layers)) if layers is None else layers
    stats = KVStats(Layout(len(layers), LAYOUT.src_width, LAYOUT.dst_layers, LAYOUT.dst_width), gram=gram)
    picked = [rows.sources[l] for l in layers]
    for start in range(0, rows.keys.shape[0], 1000):
        batch = [x[start : start + 1000] for x in picked]
        stats.update(batch, batch, [rows.keys[start : start + 1000]], [rows.values[start : start + 1000]])
    return stats


# ---- the reference, from the raw rows --------------------------------------------------------------------------
def _ridge(x: torch.Tensor, y: torch.Tensor, ridge_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """W = (Xc^T Xc + lambda mean(diag(Xc^T Xc)) I)^-1 Xc^T Yc, b = mean_y - mean_x W, in fp64."""
    x, y = x.double(), y.double()
    xc, yc = x - x.mean(0), y - y.mean(0)
    gram = xc.T @ xc
    penalty = ridge_lambda * gram.diagonal().mean()
    weight = torch.linalg.solve(gram + penalty * torch.eye(gram.shape[0], dtype=gram.dtype), xc.T @ yc)
    return weight, y.mean(0) - x.mean(0) @ weight


def _r2(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> float:
    """Pooled R^2 of y ~ x W + b on these rows (their own mean is the baseline)."""
    x, y = x.double(), y.double()
    return float(1 - (y - x @ weight - bias).square().sum() / (y - y.mean(0)).square().sum())


def _map_r2(train: Rows, evaluate: Rows, layers: list[int], kind: str, ridge_lambda: float) -> float:
    """R^2 on ``evaluate`` of the ridge map from ``layers`` fitted on ``train``."""
    x_train, x_eval = (torch.cat([rows.sources[l] for l in layers], 1) for rows in (train, evaluate))
    return _r2(x_eval, evaluate.target(kind), *_ridge(x_train, train.target(kind), ridge_lambda))


def _probe(train: Rows, evaluate: Rows, kind: str) -> list[float]:
    """One-source-layer probe R^2 on ``evaluate``, per source layer."""
    return [_map_r2(train, evaluate, [l], kind, PROBE_LAMBDA) for l in range(LAYOUT.src_layers)]


def _ranking(train: Rows, evaluate: Rows, layers: list[int] | None = None) -> list[int]:
    """``layers`` (None: all), best first by the mean of the K and V probe R^2 on ``evaluate``."""
    layers = list(range(LAYOUT.src_layers)) if layers is None else layers
    k, v = _probe(train, evaluate, "k"), _probe(train, evaluate, "v")
    return sorted(layers, key=lambda l: -(k[l] + v[l]) / 2)


def _argmax(scores: dict, margin: float) -> object:
    """The key of the highest score, which beats every other by more than ``margin`` (relative to 1 - R^2)."""
    best = max(scores, key=scores.get)
    for key, score in scores.items():
        if key != best:
            assert scores[best] - score > margin * max(1.0, 1 - score), f"near-tie: {scores}"
    return best


def _choice(
    train: Rows, evaluate: Rows, *, counts, lambdas, layers: list[int] | None = None, margin: float = 0.0
) -> tuple[list[int], float, float]:
    """(sources ascending, lambda K, lambda V) that the documented procedure picks when it scores on
    ``evaluate``: rank ``layers`` by probe R^2, then lambdas (K and V apart) at the middle k, k on the mean
    of K and V at those lambdas, and lambdas again at that k (:func:`kvhub.core.solve._solve_layer`)."""
    ranking = _ranking(train, evaluate, layers)

    def r2(count, kind, ridge_lambda):
        return _map_r2(train, evaluate, sorted(ranking[:count]), kind, ridge_lambda)

    def lambdas_at(count):
        return [_argmax({lam: r2(count, kind, lam) for lam in lambdas}, margin) for kind in "kv"]

    start = max(c for c in counts if c <= max(DEFAULT_TOP_K, min(counts)))
    lambda_k, lambda_v = lambdas_at(start)
    top_k = _argmax({c: (r2(c, "k", lambda_k) + r2(c, "v", lambda_v)) / 2 for c in counts}, margin)
    if top_k != start:
        lambda_k, lambda_v = lambdas_at(top_k)
    return sorted(ranking[:top_k]), lambda_k, lambda_v


def _chosen(layer) -> tuple[list[int], float, float]:
    return layer.sources, layer.k_map.ridge_lambda, layer.v_map.ridge_lambda


def _assert_heldout_r2(layer, train: Rows, heldout: Rows) -> None:
    """The layer's r2_k/r2_v are its maps' held-out R^2 (and train_r2_* their training R^2), from the rows."""
    for kind, lam, held, fitted in (
        ("k", layer.k_map.ridge_lambda, layer.r2_k, layer.train_r2_k),
        ("v", layer.v_map.ridge_lambda, layer.r2_v, layer.train_r2_v),
    ):
        expected = _map_r2(train, heldout, layer.sources, kind, lam)
        assert held == pytest.approx(expected, abs=R2_ROUNDING * max(1.0, 1 - expected)), kind
        expected_fit = _map_r2(train, train, layer.sources, kind, lam)
        assert fitted == pytest.approx(expected_fit, abs=R2_ROUNDING * max(1.0, 1 - expected_fit)), kind
        assert held < fitted - 0.01, kind  # the two figures differ here, so a swap cannot pass


# ---- data sets: (train, held-out) rows, their statistics ----------------------------------------------------------
@pytest.fixture(scope="module")
def overfit():
    """40 training rows: up to k = 6 (24 features) is feasible; extra source layers only fit noise."""
    train, heldout = _splits(40, noise_k=1.0, noise_v=1.0)
    return train, heldout, _stats(train), _stats(heldout)


@pytest.fixture(scope="module")
def noisy():
    """14 training rows with noisy keys and clean values: held-out R^2 wants a strong ridge for K, a weak one for V."""
    train, heldout = _splits(14, noise_k=3.0, noise_v=0.3)
    return train, heldout, _stats(train), _stats(heldout)


# ---- ranking ------------------------------------------------------------------------------------------------------
def test_rank_sources_orders_by_the_mean_of_the_k_and_v_probe():
    """rank_sources: best first by (probe K + probe V) / 2, neither alone (here the three orders differ)."""
    probe_k = torch.tensor([[0.9], [0.5], [0.1]])  # K alone: 0, 1, 2
    probe_v = torch.tensor([[0.0], [0.5], [0.85]])  # V alone: 2, 1, 0; mean 0.45, 0.5, 0.475
    assert rank_sources(probe_k, probe_v, 0) == [1, 2, 0]


def test_the_probe_and_the_ranking_are_held_out(overfit):
    """The probe grids are held-out R^2 of one-layer maps, and a fixed k reads the held-out ranking's best k;
    ranked in-sample, SPURIOUS would be second."""
    train, heldout, train_stats, heldout_stats = overfit
    held, fitted = _ranking(train, heldout), _ranking(train, train)
    assert held[:2] == [STRONG, WEAK] and fitted[:2] == [STRONG, SPURIOUS]
    solution = solve(train_stats, heldout_stats, top_k=2, ridge_lambda=0.01)
    for grid, kind in ((solution.probe_r2_k, "k"), (solution.probe_r2_v, "v")):
        for l, expected in enumerate(_probe(train, heldout, kind)):
            assert float(grid[l, 0]) == pytest.approx(expected, abs=R2_ROUNDING * max(1.0, 1 - expected))
    assert solution.layers[0].sources == sorted(held[:2])


def test_one_pass_k_is_the_held_out_argmax_over_the_k_grid(overfit):
    """lambda fixed, k auto: k = the held-out argmax of mean(K, V) R^2 (k = 2, the planted layers); training R^2
    rises with every source layer added, so a training choice would take all 6."""
    train, heldout, train_stats, heldout_stats = overfit
    counts = (1, 2, 3, 4, 6)  # the grid's values feasible with 40 training rows of 4 features per layer
    expected = _choice(train, heldout, counts=counts, lambdas=[1e-3], margin=R2_ROUNDING)
    assert expected[0] == [WEAK, STRONG]
    ranking = _ranking(train, heldout)
    fitted = [sum(_map_r2(train, train, ranking[:c], kind, 1e-3) for kind in "kv") for c in counts]
    assert fitted == sorted(fitted) and len(set(fitted)) == len(counts)  # in-sample: the more layers the better
    solution = solve(train_stats, heldout_stats, ridge_lambda=1e-3)
    assert _chosen(solution.layers[0]) == expected
    assert solution.chosen_by == "held-out R^2"
    _assert_heldout_r2(solution.layers[0], train, heldout)


def test_one_pass_lambdas_are_the_held_out_argmax_for_k_and_v_apart(noisy):
    """k fixed, lambda auto: each of K and V takes its own held-out argmax (K: 1.0, V: 0.01); training R^2
    falls with every step up the grid, so a training choice would take 1e-3 for both."""
    train, heldout, train_stats, heldout_stats = noisy
    sources, lambda_k, lambda_v = _choice(train, heldout, counts=[2], lambdas=LAMBDA_GRID, margin=R2_ROUNDING)
    assert (lambda_k, lambda_v) == (1.0, 0.01)
    for kind in "kv":
        fitted = [_map_r2(train, train, sources, kind, lam) for lam in LAMBDA_GRID]
        assert fitted == sorted(fitted, reverse=True) and len(set(fitted)) == len(LAMBDA_GRID)
    (layer,) = solve(train_stats, heldout_stats, top_k=2).layers
    assert _chosen(layer) == (sources, lambda_k, lambda_v)
    _assert_heldout_r2(layer, train, heldout)


def _one_pass_solve(train_stats, heldout_stats):
    return solve(train_stats, heldout_stats)


def _fit_solve(train_stats, heldout_stats):
    """What kvhub.fitting.fit.fit, the distributed fit and the layer-outer fit run on their one-pass statistics."""
    state = FitState({"train": train_stats, "heldout": heldout_stats})
    return solve_statistics(state, ONE_PASS, options=FitOptions(), structure=Structure(), src_layers=6)


@pytest.mark.parametrize("solver", [_one_pass_solve, _fit_solve], ids=["solve", "solve_statistics"])
def test_auto_k_and_lambdas_follow_the_documented_search_on_held_out_r2(overfit, solver):
    """k and lambda auto: the coordinate search scored on held-out R^2 (here k = 2, lambda K 0.01, V 0.001;
    scored on the training rows it would take k = 6, lambda 1e-3 and the SPURIOUS layer)."""
    train, heldout, train_stats, heldout_stats = overfit
    counts = (1, 2, 3, 4, 6)
    expected = _choice(train, heldout, counts=counts, lambdas=LAMBDA_GRID, margin=R2_ROUNDING)
    in_sample = _choice(train, train, counts=counts, lambdas=LAMBDA_GRID)
    assert expected == ([WEAK, STRONG], 0.01, 1e-3) and in_sample[0] == list(range(6))
    solution = solver(train_stats, heldout_stats)
    assert _chosen(solution.layers[0]) == expected
    assert solution.chosen_by == "held-out R^2" and solution.top_k is None and solution.ridge_lambda is None
    _assert_heldout_r2(solution.layers[0], train, heldout)


@pytest.mark.parametrize("heldout", ["none", "empty"])
def test_without_held_out_data_k_and_lambda_are_the_defaults_not_a_training_choice(overfit, heldout):
    """No held-out rows: k = 4 and lambda = 0.01 (the documented defaults, said in the notes), no held-out R^2;
    the training rows would have chosen k = 6 and lambda 1e-3."""
    train, _, train_stats, _ = overfit
    in_sample = _choice(train, train, counts=(1, 2, 3, 4, 6), lambdas=LAMBDA_GRID)
    assert (len(in_sample[0]), in_sample[1], in_sample[2]) == (6, 1e-3, 1e-3)
    solution = solve(train_stats, None if heldout == "none" else KVStats(LAYOUT))
    (layer,) = solution.layers
    assert (len(layer.sources), layer.k_map.ridge_lambda, layer.v_map.ridge_lambda) == (
        DEFAULT_TOP_K,
        DEFAULT_LAMBDA,
        DEFAULT_LAMBDA,
    )
    assert layer.r2_k is None and layer.r2_v is None and solution.chosen_by == "fixed"
    assert any("no held-out data" in note for note in solution.notes)
    metadata = build_mapper(solution, *_fingerprints(), {}, train_stats, KVStats(LAYOUT), FitOptions()).metadata
    assert metadata["layers"][0]["r2_k"] is None and "heldout_r2_k_mean" not in metadata["metrics"]


# ---- two-pass statistics ---------------------------------------------------------------------------------------------
def _pass_one(train: Rows, heldout: Rows) -> FitState:
    return FitState({"train": _stats(train, gram="diagonal"), "heldout": _stats(heldout, gram="diagonal")})


def test_two_pass_candidates_come_from_the_held_out_probe(overfit):
    """Pass 1's probe is held-out: with k at most 2, pass 2 keeps the planted layers, not SPURIOUS (which the
    in-sample probe ranks second)."""
    train, heldout, _, _ = overfit
    state = second_pass(_pass_one(train, heldout), StatisticsMode(passes=2, top_k_max=2), top_k=None)
    assert state.candidates == sorted(_ranking(train, heldout)[:2]) == [WEAK, STRONG]
    assert sorted(_ranking(train, train)[:2]) == [SPURIOUS, STRONG]
    for grid, kind in zip(state.probe, "kv"):
        for l, expected in enumerate(_probe(train, heldout, kind)):
            assert float(grid[l, 0]) == pytest.approx(expected, abs=R2_ROUNDING * max(1.0, 1 - expected))


def test_two_pass_solve_chooses_on_held_out_r2_and_names_the_models_layers(overfit):
    """Pass 2 over the held-out best 4 candidates, k and lambda auto (k <= 4): the documented search on held-out
    R^2 among the candidates, its sources numbered as in the model (not as positions among the candidates)."""
    train, heldout, _, _ = overfit
    mode = StatisticsMode(passes=2, top_k_max=4)
    state = second_pass(_pass_one(train, heldout), mode, top_k=None)
    candidates = state.candidates
    assert candidates == sorted(_ranking(train, heldout)[:4]) and SPURIOUS not in candidates
    for name, rows in (("train", train), ("heldout", heldout)):  # pass 2: the candidates' columns only
        state.stats[name] = _stats(rows, layers=candidates)
    expected = _choice(train, heldout, counts=(1, 2, 3, 4), lambdas=LAMBDA_GRID, layers=candidates, margin=R2_ROUNDING)
    in_sample = _choice(train, train, counts=(1, 2, 3, 4), lambdas=LAMBDA_GRID, layers=candidates)
    assert expected[0] == [WEAK, STRONG] and len(in_sample[0]) == 4
    assert [candidates.index(l) for l in expected[0]] != expected[0]  # positions differ from layer numbers
    solution = solve_statistics(state, mode, options=FitOptions(), structure=Structure(), src_layers=6)
    assert _chosen(solution.layers[0]) == expected
    assert solution.chosen_by == "held-out R^2"
    _assert_heldout_r2(solution.layers[0], train, heldout)


# ---- what the artifact reports ---------------------------------------------------------------------------------------
def _fingerprints() -> tuple[dict, dict]:
    return {"model_id": "source", "dtype": "float32"}, {"model_id": "target", "dtype": "float32"}


def test_mapper_json_reports_the_held_out_r2(overfit):
    """mapper.json: per layer r2_* the held-out and train_r2_* the training R^2, metrics the held-out mean and
    min, probe_r2 the held-out probe, chosen_by "held-out R^2"."""
    train, heldout, train_stats, heldout_stats = overfit
    solution = solve(train_stats, heldout_stats)
    metadata = build_mapper(solution, *_fingerprints(), {}, train_stats, heldout_stats, FitOptions()).metadata
    (entry,) = metadata["layers"]
    _assert_heldout_r2(solution.layers[0], train, heldout)
    assert (entry["r2_k"], entry["r2_v"]) == (solution.layers[0].r2_k, solution.layers[0].r2_v)
    assert (entry["train_r2_k"], entry["train_r2_v"]) == (solution.layers[0].train_r2_k, solution.layers[0].train_r2_v)
    metrics = metadata["metrics"]
    assert metrics["heldout_r2_k_mean"] == metrics["heldout_r2_k_min"] == entry["r2_k"]
    assert metrics["heldout_r2_v_mean"] == metrics["heldout_r2_v_min"] == entry["r2_v"]
    assert metrics["heldout_tokens"] == HELDOUT_ROWS
    assert metadata["probe_r2"]["k"] == solution.probe_r2_k.tolist()  # held-out: checked above
    assert metadata["chosen_by"] == "held-out R^2" and metadata["k"] is None and metadata["lambda"] is None


# ---- the MLP map kind ------------------------------------------------------------------------------------------------
def _reservoir(rows: Rows) -> Reservoir:
    n = rows.keys.shape[0]
    reservoir = Reservoir(LAYOUT, rows_per_sequence=n, sequences=1, capacity=n)
    x = torch.cat(rows.sources, 1)
    reservoir.tensors = {"keys_x": x, "values_x": x.clone(), "keys_y": rows.keys, "values_y": rows.values}
    return reservoir


def test_mlp_early_stopping_keeps_the_best_held_out_epoch(overfit):
    """Held-out rows that the ridge map predicts exactly (their targets are its predictions): every trained epoch is
    worse there than epoch 0 (the ridge map), so the MLP stops after ``patience`` epochs and keeps epoch 0, held-out
    R^2 1.  Its training loss does fall: stopped on the training rows, it keeps a later epoch."""
    train, heldout, train_stats, heldout_stats = overfit
    solution = solve(train_stats, heldout_stats)
    exact = _reservoir(Rows([x[:200] for x in heldout.sources], heldout.keys[:200], heldout.values[:200]))
    for kind, name in (("k", "keys_y"), ("v", "values_y")):
        exact.tensors[name] = mlp_fit.map_rows(solution.layers[0], kind, exact, LAYOUT)[2]  # the ridge predictions
    options = FitOptions(map_kind="mlp", mlp_width=8, mlp_depth=1, mlp_epochs=30)
    samples = {"train": _reservoir(train), "heldout": exact}
    trained = mlp_fit.train_maps(solution, samples, LAYOUT, options, job="choice")
    on_training = mlp_fit.train_maps(
        solution, {"train": samples["train"], "heldout": samples["train"]}, LAYOUT, options, job="choice"
    )
    patience = mlp_fit.schedule_of(options).patience
    for kind in "kv":
        chosen = trained[0][kind]
        assert chosen.best_epoch == 0 and chosen.epochs == patience
        assert chosen.heldout_r2 == chosen.ridge_heldout_r2 == 1.0
        assert not any(bool(t.any()) for t in chosen.layers[-1])  # r(x) = 0: the stored map is the ridge map
        assert on_training[0][kind].best_epoch > 0
    base = build_mapper(solution, *_fingerprints(), {}, train_stats, heldout_stats, FitOptions())
    entry = mlp_fit.with_mlps(base, trained, samples, options).layers[0]
    assert (entry["r2_k"], entry["r2_v"], entry["mlp_best_epoch_k"], entry["mlp_best_epoch_v"]) == (1.0, 1.0, 0, 0)
