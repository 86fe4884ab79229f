"""Closed-form solves over sufficient statistics: probe R^2, layer selection, ridge, k/lambda choice.

Notation (see :mod:`kvhub.stats`): for a source-column set S and target columns J,

    ridge:  W = (Cxx[S,S] + lam * I)^-1 Cxy[S,J],   b = mean_y[J] - mean_x[S] W
    lam   = lambda_rel * trace(Cxx[S,S]) / |S|      (scale-aware: lambda_rel is relative to the
                                                     mean diagonal of the centred Gram)
    R^2   = 1 - sum_j SSE_j / sum_j Syy_j           (pooled over the layer's output dims)

and the residual sum of squares of any (W, b) on a split with moments (n, mu_x, mu_y, C*) is

    SSE_j = Syy_j - 2 (W^T Cxy)_jj + (W^T Cxx W)_jj + n * (mu_y - mu_x W - b)_j^2

so held-out R^2 for every candidate k and lambda needs no further pass over the models.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .errors import ConfigError, FitError
from .stats import KVStats, Moments

log = logging.getLogger(__name__)

K_GRID = (1, 2, 3, 4, 6, 8, 12, 16)
LAMBDA_GRID = (1e-3, 1e-2, 1e-1, 1.0)
DEFAULT_K = 4  # used when k is 'auto' but there is no held-out split
DEFAULT_LAMBDA = 1e-2  # the paper's lambda


@dataclass
class LayerSolution:
    """The maps of one target layer: y = x @ W + b for K and V, from ``sources`` (ascending)."""

    target: int
    sources: list[int]
    lambda_k: float
    lambda_v: float
    wk: torch.Tensor  # (k*Hs*Ds, Ht*Dt) fp64
    bk: torch.Tensor  # (Ht*Dt,)
    wv: torch.Tensor
    bv: torch.Tensor
    r2_k: float | None = None  # held-out
    r2_v: float | None = None
    train_r2_k: float = float("nan")
    train_r2_v: float = float("nan")

    def to_metadata(self) -> dict:
        return {
            "target": self.target, "sources": self.sources, "k": len(self.sources),
            "lambda_k": self.lambda_k, "lambda_v": self.lambda_v,
            "r2_k": self.r2_k, "r2_v": self.r2_v,
            "train_r2_k": self.train_r2_k, "train_r2_v": self.train_r2_v,
        }


@dataclass
class Solution:
    layers: list[LayerSolution]
    probe_r2_k: torch.Tensor  # (Ls, Lt)
    probe_r2_v: torch.Tensor
    k: int | str
    lambda_: float | str
    chosen_by: str
    notes: list[str] = field(default_factory=list)

    def mean_r2(self) -> tuple[float | None, float | None]:
        if any(layer.r2_k is None for layer in self.layers):
            return None, None
        count = len(self.layers)
        return sum(l.r2_k for l in self.layers) / count, sum(l.r2_v for l in self.layers) / count


# ---- primitives ------------------------------------------------------------------------------
def ridge(train: Moments, cols: torch.Tensor, ycols: slice, lambda_rel: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Centred ridge W (|S|, |J|), b (|J|,) from the training moments (fp64)."""
    gram = train.cxx[cols][:, cols]  # (|S|, |S|)
    lam = lambda_rel * gram.diagonal().mean().clamp_min(1e-30)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    chol, info = torch.linalg.cholesky_ex(gram + lam * eye)
    rhs = train.cxy[cols, ycols]
    weight = torch.cholesky_solve(rhs, chol) if int(info) == 0 else torch.linalg.lstsq(gram + lam * eye, rhs).solution
    bias = train.mean_y[ycols] - train.mean_x[cols] @ weight
    return weight, bias


def r2_score(split: Moments, cols: torch.Tensor, ycols: slice, weight: torch.Tensor, bias: torch.Tensor) -> float:
    """Pooled R^2 of y ~ x[cols] @ weight + bias on a split, from its moments alone."""
    cxy = split.cxy[cols, ycols]
    cross = (weight * cxy).sum(0)  # diag(W^T Cxy)
    quad = ((split.cxx[cols][:, cols] @ weight) * weight).sum(0)  # diag(W^T Cxx W)
    delta = split.mean_y[ycols] - split.mean_x[cols] @ weight - bias
    sse = split.syy[ycols] - 2 * cross + quad + split.n * delta * delta
    sst = split.syy[ycols].sum().clamp_min(1e-30)
    return float(1.0 - sse.sum() / sst)


def probe_r2(train: KVStats, evaluate: KVStats | None = None, *, lambda_rel: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """R^2 of a one-source-layer ridge map for every (source l, target m): two (Ls, Lt) grids (K, V).

    Fitted on ``train``; scored on ``evaluate`` (held-out) when given, else in-sample.
    """
    layout = train.layout
    evaluate = evaluate if evaluate is not None and evaluate.n > 0 else train
    grids = []
    for fit_m, eval_m in ((train.k, evaluate.k), (train.v, evaluate.v)):
        grid = torch.zeros(layout.src_layers, layout.dst_layers, dtype=torch.float64)
        for l in range(layout.src_layers):
            cols = layout.src_columns([l])
            weight, bias = ridge(fit_m, cols, slice(None), lambda_rel)  # (Hs*Ds, q): all targets at once
            for m in range(layout.dst_layers):
                ycols = layout.dst_columns(m)
                grid[l, m] = r2_score(eval_m, cols, ycols, weight[:, ycols], bias[ycols])
        grids.append(grid)
    return grids[0], grids[1]


def rank_sources(probe_k: torch.Tensor, probe_v: torch.Tensor, target: int) -> list[int]:
    """Source layers for target layer ``target``, best first by mean(K, V) probe R^2."""
    score = (probe_k[:, target] + probe_v[:, target]) / 2
    return torch.argsort(score, descending=True, stable=True).tolist()


# ---- the solve -------------------------------------------------------------------------------
def solve(
    train: KVStats,
    heldout: KVStats | None = None,
    *,
    k: int | str = "auto",
    lambda_: float | str = "auto",
    k_grid: tuple[int, ...] = K_GRID,
    lambda_grid: tuple[float, ...] = LAMBDA_GRID,
) -> Solution:
    """Probe, select, and solve every target layer.

    ``k``/``lambda_`` are ints/floats or 'auto'.  'auto' picks, per target layer, the k (shared by K
    and V) and a lambda for K and one for V that maximise held-out R^2 (mean of K and V for k), by the
    coordinate search of :func:`_solve_layer`.
    Without held-out data 'auto' falls back to k=4, lambda=0.01 (the paper's) and says so in notes.
    """
    layout = train.layout
    has_heldout = heldout is not None and heldout.n > 0
    notes: list[str] = []
    k_candidates = _k_candidates(k, k_grid, layout.src_layers, layout.src_width, train.n, notes)
    lambda_candidates = _lambda_candidates(lambda_, lambda_grid)
    if not has_heldout and (len(k_candidates) > 1 or len(lambda_candidates) > 1):
        k_candidates = [k if isinstance(k, int) else min(DEFAULT_K, max(k_candidates))]
        lambda_candidates = [lambda_ if isinstance(lambda_, float) else DEFAULT_LAMBDA]
        notes.append(f"no held-out data: k={k_candidates[0]}, lambda={lambda_candidates[0]} (defaults)")
    probe_k, probe_v = probe_r2(train, heldout if has_heldout else None)
    layers = [
        _solve_layer(train, heldout if has_heldout else None, m, rank_sources(probe_k, probe_v, m),
                     k_candidates, lambda_candidates)
        for m in range(layout.dst_layers)
    ]
    chosen_by = "held-out R^2" if has_heldout and (len(k_candidates) > 1 or len(lambda_candidates) > 1) else "fixed"
    return Solution(layers, probe_k, probe_v, k, lambda_, chosen_by, notes)


def _k_candidates(k, k_grid, src_layers: int, src_width: int, n_train: int, notes: list[str]) -> list[int]:
    if isinstance(k, str) and k != "auto":
        raise ConfigError(f"k must be a positive integer or 'auto', got {k!r}")
    if isinstance(k, int):
        if not 1 <= k <= src_layers:
            raise ConfigError(f"k={k} is outside 1..{src_layers} (the source model's layer count)")
        if k * src_width >= n_train:
            raise FitError(
                f"k={k} needs more than {k * src_width} training observations (k * kv_heads * head_dim "
                f"features), but the calibration data gave {n_train} tokens; add calibration sequences "
                "(--samples), lower the token stride (--stride), or use a smaller k"
            )
        return [k]
    feasible = [c for c in k_grid if c <= src_layers and c * src_width < n_train]
    if not feasible:
        raise FitError(
            f"only {n_train} training observations (tokens) for {src_width} features per source layer: "
            "a ridge fit needs more observations than features; add calibration sequences (--samples) "
            "or lower the token stride (--stride)"
        )
    skipped = [c for c in k_grid if c <= src_layers and c not in feasible]
    if skipped:
        notes.append(f"k in {skipped} skipped: fewer training tokens ({n_train}) than features")
    return feasible


def _lambda_candidates(lambda_, lambda_grid) -> list[float]:
    if lambda_ == "auto":
        return list(lambda_grid)
    if isinstance(lambda_, (int, float)) and not isinstance(lambda_, bool) and lambda_ >= 0:
        return [float(lambda_)]
    raise ConfigError(f"lambda must be a non-negative number or 'auto', got {lambda_!r}")


def _best_lambda(train: Moments, heldout: Moments | None, cols, ycols, lambdas: list[float]):
    """(score, lambda, W, b) with the best held-out R^2 (score None without held-out)."""
    best = None
    for lam in lambdas:
        weight, bias = ridge(train, cols, ycols, lam)
        score = r2_score(heldout, cols, ycols, weight, bias) if heldout is not None else None
        if best is None or (score is not None and score > best[0]):
            best = (score, lam, weight, bias)
    return best


def _solve_layer(train: KVStats, heldout: KVStats | None, m: int, ranking: list[int],
                 k_candidates: list[int], lambdas: list[float]) -> LayerSolution:
    """Coordinate search: lambdas at a middle k, then k at those lambdas, then lambdas again at the best k.

    Each step maximises held-out R^2 (K and V lambdas separately; k on their mean), which needs
    |lambdas| + |k| + |lambdas| solves instead of |k| * |lambdas|.
    """
    layout = train.layout
    ycols = layout.dst_columns(m)

    def fit_at(k: int, lambdas_k: list[float], lambdas_v: list[float]):
        sources = sorted(ranking[:k])
        cols = layout.src_columns(sources)
        fit_k = _best_lambda(train.k, heldout.k if heldout else None, cols, ycols, lambdas_k)
        fit_v = _best_lambda(train.v, heldout.v if heldout else None, cols, ycols, lambdas_v)
        score = None if heldout is None else (fit_k[0] + fit_v[0]) / 2
        return score, sources, cols, fit_k, fit_v

    start_k = max(c for c in k_candidates if c <= max(DEFAULT_K, min(k_candidates)))
    best = fit_at(start_k, lambdas, lambdas)
    if len(k_candidates) > 1:
        lam_k, lam_v = [best[3][1]], [best[4][1]]
        for k in k_candidates:
            if k != start_k:
                trial = fit_at(k, lam_k, lam_v)
                if trial[0] > best[0]:
                    best = trial
        if len(best[1]) != start_k and len(lambdas) > 1:
            best = fit_at(len(best[1]), lambdas, lambdas)
    _, sources, cols, fit_k, fit_v = best
    return LayerSolution(
        target=m, sources=sources, lambda_k=fit_k[1], lambda_v=fit_v[1],
        wk=fit_k[2], bk=fit_k[3], wv=fit_v[2], bv=fit_v[3], r2_k=fit_k[0], r2_v=fit_v[0],
        train_r2_k=r2_score(train.k, cols, ycols, fit_k[2], fit_k[3]),
        train_r2_v=r2_score(train.v, cols, ycols, fit_v[2], fit_v[3]),
    )
