"""Closed-form solves over sufficient statistics: probe R^2, layer selection, ridge, top_k/lambda choice.

Names: ``top_k`` is the number of source layers a target layer reads (mapper.json and ``kvhub fit
--k`` call it k); ``ridge_lambda`` the relative ridge strength (mapper.json: lambda, lambda_k,
lambda_v); a ``_k``/``_v`` suffix or a "k"/"v" label always means keys/values.

The ridge maps themselves (fit, compress, score from moments alone: :mod:`kvhub.core.ridge`) need only
sufficient statistics, so held-out R^2 for every candidate top_k and ridge_lambda needs no further pass
over the models.  The probe (one source layer l -> target layer m) reads only Cxx[l,l], Cxy[l,:], the
means and Syy, so it runs on full statistics and on a probe pass's block-diagonal ones alike
(:mod:`kvhub.fitting.two_pass`).

Compressed maps (artifact size vs quality), solved from the same statistics:

- head-local (``groups`` = g > 1): source and target KV heads fall into g groups (g = gcd(Hs, Ht));
  target head group i reads only source head group i of each selected layer, so W is block-diagonal
  with g blocks: g times fewer weights.
- low rank (``rank`` = r): reduced-rank ridge per block: W_r = W P_r with P_r the projection onto the
  top-r eigenvectors of W^T (Cxx + penalty I) W (the ridge fit's fitted values on the penalised data),
  the closed-form rank-r minimiser of the penalised loss; stored as A = W V_r (in, r), B = V_r^T (r, out),
  and b = mean_y - mean_x W_r.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvhub.core.ridge import (  # noqa: F401 - the primitives stay importable from here
    LinearMap,
    Structure,
    fit_map,
    group_rows,
    map_r2,
    r2_score,
    reduce_rank,
    ridge,
    sse_sst,
)
from kvhub.core.stats import F64, KVStats, Moments
from kvhub.errors import ConfigError, FitError

log = logging.getLogger(__name__)

TOP_K_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
LAMBDA_GRID = (1e-3, 1e-2, 1e-1, 1.0)
DEFAULT_TOP_K = 4  # used when top_k is 'auto' but there is no held-out split
DEFAULT_LAMBDA = 1e-2  # the paper's lambda
PROBE_LAMBDA = 1e-4  # ridge_lambda of the one-source-layer probe maps


@dataclass
class LayerSolution:
    """The maps of one target layer for keys (``k_map``) and values (``v_map``), from ``sources``
    (ascending; top_k = len(sources))."""

    target: int
    sources: list[int]
    k_map: LinearMap
    v_map: LinearMap
    r2_k: float | None = None  # held-out
    r2_v: float | None = None
    train_r2_k: float = float("nan")
    train_r2_v: float = float("nan")

    def to_metadata(self) -> dict:
        """The layer's entry in mapper.json (field names owned by kvhub.artifact)."""
        meta = {
            "target": self.target,
            "sources": self.sources,
            "k": len(self.sources),
            "lambda_k": self.k_map.ridge_lambda,
            "lambda_v": self.v_map.ridge_lambda,
            "r2_k": self.r2_k,
            "r2_v": self.r2_v,
            "train_r2_k": self.train_r2_k,
            "train_r2_v": self.train_r2_v,
        }
        if self.k_map.groups > 1 or self.k_map.rank is not None:
            meta.update({"head_groups": self.k_map.groups, "rank": self.k_map.rank})
        return meta


@dataclass
class Solution:
    layers: list[LayerSolution]
    probe_r2_k: torch.Tensor  # (Ls, Lt)
    probe_r2_v: torch.Tensor
    top_k: int | None  # as asked: a count, or None ("auto": chosen per layer)
    ridge_lambda: float | None
    chosen_by: str
    notes: list[str] = field(default_factory=list)
    structure: Structure = Structure()

    def mean_r2(self) -> tuple[float | None, float | None]:
        if any(layer.r2_k is None for layer in self.layers):
            return None, None
        count = len(self.layers)
        return sum(l.r2_k for l in self.layers) / count, sum(l.r2_v for l in self.layers) / count


def probe_r2(
    train: KVStats, evaluate: KVStats | None = None, *, ridge_lambda: float = PROBE_LAMBDA
) -> tuple[torch.Tensor, torch.Tensor]:
    """R^2 of a one-source-layer ridge map for every (source l, target m): two (Ls, Lt) grids (K, V).

    Fitted on ``train``; scored on ``evaluate`` (held-out) when given, else in-sample.  Reads only each
    source layer's own Gram block, so full and block-diagonal (``gram="diagonal"``) statistics give
    the same grids.
    """
    layout = train.layout
    evaluate = evaluate if evaluate is not None and evaluate.n > 0 else train
    width, cols = layout.src_width, torch.arange(layout.src_width)
    grids = []
    for fit_moments, eval_moments in ((train.k, evaluate.k), (train.v, evaluate.v)):
        grid = torch.zeros(layout.src_layers, layout.dst_layers, dtype=F64)
        for l in range(layout.src_layers):
            fit_l, eval_l = fit_moments.source_block(l, width), eval_moments.source_block(l, width)
            weight, bias = ridge(fit_l, cols, slice(None), ridge_lambda)  # (ds, q): all targets at once
            for m in range(layout.dst_layers):
                ycols = layout.dst_columns(m)
                grid[l, m] = r2_score(eval_l, cols, ycols, weight[:, ycols], bias[ycols])
        grids.append(grid)
    return grids[0], grids[1]


def rank_sources(probe_k: torch.Tensor, probe_v: torch.Tensor, target: int) -> list[int]:
    """Source layers for target layer ``target``, best first by mean(K, V) probe R^2."""
    score = (probe_k[:, target] + probe_v[:, target]) / 2
    return torch.argsort(score, descending=True, stable=True).tolist()


def candidate_sources(
    probe_k: torch.Tensor, probe_v: torch.Tensor, targets, *, depth: int, max_layers: int | None = None
) -> list[int]:
    """The source layers a second statistics pass keeps for ``targets``, ascending.

    Every target's best source layer (by :func:`rank_sources`), then every target's second best, ...,
    down to ``depth``, skipping repeats, until ``max_layers`` layers are chosen (None: no limit).  So every
    target keeps its best d layers for the largest d that ``max_layers`` allows; below that limit, each
    target's best ``depth`` layers are all kept, which is what a solve with top_k <= depth reads.
    """
    if depth < 1 or (max_layers is not None and max_layers < 1):
        raise ConfigError(f"candidate depth and max_layers must be >= 1, got {depth} and {max_layers}")
    rankings = [rank_sources(probe_k, probe_v, m) for m in targets]
    chosen: list[int] = []
    for d in range(min(depth, probe_k.shape[0])):
        for ranking in rankings:
            if ranking[d] in chosen:
                continue
            if max_layers is not None and len(chosen) == max_layers:
                return sorted(chosen)
            chosen.append(ranking[d])
    return sorted(chosen)


# ---- the solve -------------------------------------------------------------------------------
@dataclass
class ScoredMap:
    """A map and its held-out R^2 (None without held-out data)."""

    linear: LinearMap
    heldout_r2: float | None


@dataclass
class Trial:
    """One target layer solved from its best ``len(sources)`` source layers (ascending), K and V."""

    sources: list[int]
    cols: torch.Tensor  # the sources' columns of X
    keys: ScoredMap
    values: ScoredMap

    @property
    def score(self) -> float | None:
        """Mean held-out R^2 of K and V: what top_k is chosen on."""
        if self.keys.heldout_r2 is None:
            return None
        return (self.keys.heldout_r2 + self.values.heldout_r2) / 2


def solve(
    train: KVStats,
    heldout: KVStats | None = None,
    *,
    top_k: int | None = None,
    ridge_lambda: float | None = None,
    top_k_grid: tuple[int, ...] = TOP_K_GRID,
    lambda_grid: tuple[float, ...] = LAMBDA_GRID,
    structure: Structure = Structure(),
    progress: Callable[[str, int, int | None], None] | None = None,
) -> Solution:
    """Probe, select, and solve every target layer; ``progress(label, layers done, layers)`` hears each
    target layer start (a solve on a large pair takes minutes).

    ``structure``: head groups and rank of the maps (see the module docstring); groups must divide
    both models' KV head counts (:func:`head_groups` gives the largest), and the caller passes the
    same structure to score them.

    ``top_k``/``ridge_lambda`` are an int/float, or None ("auto"): then they are picked, per target layer, the top_k
    (shared by K and V) and a ridge_lambda for K and one for V that maximise held-out R^2 (mean of K
    and V for top_k), by the coordinate search of :func:`_solve_layer`.
    Without held-out data None falls back to top_k=4, ridge_lambda=0.01 (the paper's) and says so in notes.
    """
    layout = train.layout
    has_heldout = heldout is not None and heldout.n > 0
    notes: list[str] = []
    counts = _top_k_candidates(top_k, top_k_grid, layout.src_layers, layout.src_width, train.n, notes)
    lambdas = _lambda_candidates(ridge_lambda, lambda_grid)
    if not has_heldout and (len(counts) > 1 or len(lambdas) > 1):
        counts = counts if len(counts) == 1 else [min(DEFAULT_TOP_K, max(counts))]
        lambdas = lambdas if len(lambdas) == 1 else [DEFAULT_LAMBDA]
        notes.append(f"no held-out data: k={counts[0]}, lambda={lambdas[0]} (defaults)")
    probe_k, probe_v = probe_r2(train, heldout if has_heldout else None)
    if layout.src_width % structure.groups or layout.dst_width % structure.groups:
        raise ConfigError(
            f"{structure.groups} head groups do not divide the source/target layer widths "
            f"({layout.src_width}, {layout.dst_width}); use kvhub.core.solve.head_groups"
        )
    layers = []
    for m in range(layout.dst_layers):
        if progress is not None:
            progress(f"solve: target layer {m + 1}/{layout.dst_layers}", m, layout.dst_layers)
        layers.append(
            _solve_layer(
                train,
                heldout if has_heldout else None,
                m,
                rank_sources(probe_k, probe_v, m),
                counts,
                lambdas,
                structure,
            )
        )
    if progress is not None:
        progress("solve: done", layout.dst_layers, layout.dst_layers)
    chosen_by = "held-out R^2" if has_heldout and (len(counts) > 1 or len(lambdas) > 1) else "fixed"
    return Solution(layers, probe_k, probe_v, top_k, ridge_lambda, chosen_by, notes, structure)


def head_groups(source_kv_heads: int, target_kv_heads: int) -> int:
    """Head groups of a head-local map: gcd of the KV head counts (each group: whole heads on both sides)."""
    return math.gcd(source_kv_heads, target_kv_heads)


def _top_k_candidates(top_k, top_k_grid, src_layers: int, src_width: int, n_train: int, notes: list[str]) -> list[int]:
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool)):
        raise ConfigError(
            f"k (source layers per target layer) must be a positive integer or None (auto), got {top_k!r}"
        )
    if top_k is not None:
        if not 1 <= top_k <= src_layers:
            raise ConfigError(f"k={top_k} is outside 1..{src_layers} (the source layers the statistics hold)")
        if top_k * src_width >= n_train:
            raise FitError(
                f"k={top_k} needs more than {top_k * src_width} training observations (k * kv_heads * head_dim "
                f"features), but the calibration data gave {n_train} tokens; add calibration sequences "
                "(--samples), lower the token stride (--stride), or use a smaller k"
            )
        return [top_k]
    feasible = [c for c in top_k_grid if c <= src_layers and c * src_width < n_train]
    if not feasible:
        raise FitError(
            f"only {n_train} training observations (tokens) for {src_width} features per source layer: "
            "a ridge fit needs more observations than features; add calibration sequences (--samples) "
            "or lower the token stride (--stride)"
        )
    skipped = [c for c in top_k_grid if c <= src_layers and c not in feasible]
    if skipped:
        notes.append(f"k in {skipped} skipped: fewer training tokens ({n_train}) than features")
    return feasible


def _lambda_candidates(ridge_lambda, lambda_grid) -> list[float]:
    if ridge_lambda is None:
        return list(lambda_grid)
    if isinstance(ridge_lambda, (int, float)) and not isinstance(ridge_lambda, bool) and ridge_lambda >= 0:
        return [float(ridge_lambda)]
    raise ConfigError(f"lambda must be a non-negative number or None (auto), got {ridge_lambda!r}")


def _best_lambda(
    train: Moments,
    heldout: Moments | None,
    cols,
    ycols,
    lambdas: list[float],
    structure: Structure,
    n_sources: int,
    src_width: int,
) -> ScoredMap:
    """The map of the ridge_lambda with the best held-out R^2 (the first one without held-out data)."""
    best = None
    for ridge_lambda in lambdas:
        linear = fit_map(train, cols, ycols, ridge_lambda, structure, n_sources, src_width)
        score = map_r2(heldout, cols, ycols, linear, n_sources, src_width) if heldout is not None else None
        if best is None or (score is not None and score > best.heldout_r2):
            best = ScoredMap(linear, score)
    return best


def _solve_layer(
    train: KVStats,
    heldout: KVStats | None,
    target: int,
    ranking: list[int],
    counts: list[int],
    lambdas: list[float],
    structure: Structure,
) -> LayerSolution:
    """Coordinate search: lambdas at a middle top_k, then top_k at those lambdas, then lambdas again at
    the best top_k.

    Each step maximises held-out R^2 (K and V lambdas separately; top_k on their mean), which needs
    |lambdas| + |counts| + |lambdas| solves instead of |counts| * |lambdas|.
    """
    layout = train.layout
    ycols = layout.dst_columns(target)

    def fit_at(top_k: int, key_lambdas: list[float], value_lambdas: list[float]) -> Trial:
        sources = sorted(ranking[:top_k])
        cols = layout.src_columns(sources)
        shape = (structure, top_k, layout.src_width)
        keys = _best_lambda(train.k, heldout.k if heldout else None, cols, ycols, key_lambdas, *shape)
        values = _best_lambda(train.v, heldout.v if heldout else None, cols, ycols, value_lambdas, *shape)
        return Trial(sources, cols, keys, values)

    start = max(c for c in counts if c <= max(DEFAULT_TOP_K, min(counts)))
    best = fit_at(start, lambdas, lambdas)
    if len(counts) > 1:
        key_lambda, value_lambda = [best.keys.linear.ridge_lambda], [best.values.linear.ridge_lambda]
        for top_k in counts:
            if top_k != start:
                trial = fit_at(top_k, key_lambda, value_lambda)
                if trial.score > best.score:
                    best = trial
        if len(best.sources) != start and len(lambdas) > 1:
            best = fit_at(len(best.sources), lambdas, lambdas)
    shape = (len(best.sources), layout.src_width)
    k_map, v_map = best.keys.linear, best.values.linear
    return LayerSolution(
        target=target,
        sources=best.sources,
        k_map=k_map,
        v_map=v_map,
        r2_k=best.keys.heldout_r2,
        r2_v=best.values.heldout_r2,
        train_r2_k=map_r2(train.k, best.cols, ycols, k_map, *shape),
        train_r2_v=map_r2(train.v, best.cols, ycols, v_map, *shape),
    )
