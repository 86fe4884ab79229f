"""Closed-form solves over sufficient statistics: probe R^2, layer selection, ridge, k/lambda choice.

Notation (see :mod:`kvhub.core.stats`): for a source-column set S and target columns J,

    ridge:  W = (Cxx[S,S] + lam * I)^-1 Cxy[S,J],   b = mean_y[J] - mean_x[S] W
    lam   = lambda_rel * trace(Cxx[S,S]) / |S|      (scale-aware: lambda_rel is relative to the
                                                     mean diagonal of the centred Gram)
    R^2   = 1 - sum_j SSE_j / sum_j Syy_j           (pooled over the layer's output dims)

and the residual sum of squares of any (W, b) on a split with moments (n, mu_x, mu_y, C*) is

    SSE_j = Syy_j - 2 (W^T Cxy)_jj + (W^T Cxx W)_jj + n * (mu_y - mu_x W - b)_j^2

(n is the total row weight, ``weight_sum``: the number of rows unless the fit weighs tokens)

so held-out R^2 for every candidate k and lambda needs no further pass over the models.

Compressed maps (artifact size vs quality), solved from the same statistics:

- head-local (``groups`` = g > 1): source and target KV heads fall into g groups (g = gcd(Hs, Ht));
  target head group i reads only source head group i of each selected layer, so W is block-diagonal
  with g blocks: g times fewer weights.
- low rank (``rank`` = r): reduced-rank ridge per block: W_r = W P_r with P_r the projection onto the
  top-r eigenvectors of W^T (Cxx + lam I) W (the ridge fit's fitted values on the penalised data), the
  closed-form rank-r minimiser of the penalised loss; stored as A = W V_r (in, r), B = V_r^T (r, out),
  and b = mean_y - mean_x W_r.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvhub.artifact import tensor_name
from kvhub.errors import ConfigError, FitError
from kvhub.core.stats import KVStats, Moments

log = logging.getLogger(__name__)

K_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
LAMBDA_GRID = (1e-3, 1e-2, 1e-1, 1.0)
DEFAULT_K = 4  # used when k is 'auto' but there is no held-out split
DEFAULT_LAMBDA = 1e-2  # the paper's lambda


@dataclass(frozen=True)
class Structure:
    """Shape of every map: ``groups`` head groups (1: dense over heads), ``rank`` per block (None: full)."""

    groups: int = 1
    rank: int | None = None

    def __post_init__(self):
        if self.groups < 1:
            raise ConfigError(f"head groups must be >= 1, got {self.groups}")
        if self.rank is not None and self.rank < 1:
            raise ConfigError(f"rank must be a positive integer, got {self.rank}")


@dataclass
class LinearMap:
    """y = x @ W + b, W block-diagonal over head groups; block i = A_i (full) or A_i @ B_i (low rank).

    Block i maps the columns :func:`group_rows` (i) of x to the output slice i of y.  fp64.
    """

    blocks: list[tuple[torch.Tensor, torch.Tensor | None]]
    bias: torch.Tensor  # (out,)
    lambda_: float

    @property
    def groups(self) -> int:
        return len(self.blocks)

    @property
    def rank(self) -> int | None:
        return None if self.blocks[0][1] is None else self.blocks[0][0].shape[1]

    def block_weights(self) -> list[torch.Tensor]:
        return [a if b is None else a @ b for a, b in self.blocks]

    def dense(self, sources: int, src_width: int) -> torch.Tensor:
        """The equivalent (sources * src_width, out) matrix."""
        weights = self.block_weights()
        out_width = weights[0].shape[1]
        dense = torch.zeros(sources * src_width, out_width * self.groups, dtype=weights[0].dtype)
        for i, weight in enumerate(weights):
            dense[group_rows(sources, src_width, self.groups, i), i * out_width:(i + 1) * out_width] = weight
        return dense

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Artifact tensors (fp32, named by kvhub.artifact): ``{prefix}.weight`` or ``.weight_a``/``.weight_b``,
        2-D when dense over heads, else stacked (groups, ...); and ``{prefix}.bias``."""
        stack = (lambda ts: ts[0]) if self.groups == 1 else torch.stack
        out = {tensor_name(prefix, "bias"): self.bias.float()}
        if self.rank is None:
            out[tensor_name(prefix, "weight")] = stack([a.float() for a, _ in self.blocks])
        else:
            out[tensor_name(prefix, "weight_a")] = stack([a.float() for a, _ in self.blocks])
            out[tensor_name(prefix, "weight_b")] = stack([b.float() for _, b in self.blocks])
        return out

    def num_parameters(self) -> int:
        return sum(a.numel() + (0 if b is None else b.numel()) for a, b in self.blocks) + self.bias.numel()


def group_rows(sources: int, src_width: int, groups: int, index: int) -> torch.Tensor:
    """Columns of a layer input x = [source layer 1 | ... | layer k] that head group ``index`` reads:
    the index-th 1/groups of every source layer's src_width (heads are head-major within a layer)."""
    width = src_width // groups
    return torch.cat([torch.arange(j * src_width + index * width, j * src_width + (index + 1) * width)
                      for j in range(sources)])


@dataclass
class LayerSolution:
    """The maps of one target layer for K and V, from ``sources`` (ascending)."""

    target: int
    sources: list[int]
    k_map: LinearMap
    v_map: LinearMap
    r2_k: float | None = None  # held-out
    r2_v: float | None = None
    train_r2_k: float = float("nan")
    train_r2_v: float = float("nan")

    @property
    def lambda_k(self) -> float:
        return self.k_map.lambda_

    @property
    def lambda_v(self) -> float:
        return self.v_map.lambda_

    def to_metadata(self) -> dict:
        meta = {
            "target": self.target, "sources": self.sources, "k": len(self.sources),
            "lambda_k": self.lambda_k, "lambda_v": self.lambda_v,
            "r2_k": self.r2_k, "r2_v": self.r2_v,
            "train_r2_k": self.train_r2_k, "train_r2_v": self.train_r2_v,
        }
        if self.k_map.groups > 1 or self.k_map.rank is not None:
            meta.update({"head_groups": self.k_map.groups, "rank": self.k_map.rank})
        return meta


@dataclass
class Solution:
    layers: list[LayerSolution]
    probe_r2_k: torch.Tensor  # (Ls, Lt)
    probe_r2_v: torch.Tensor
    k: int | str
    lambda_: float | str
    chosen_by: str
    notes: list[str] = field(default_factory=list)
    structure: Structure = Structure()

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


def sse_sst(split: Moments, cols: torch.Tensor, ycols: slice, weight: torch.Tensor, bias: torch.Tensor) -> tuple[float, float]:
    """(residual, total) sums of squares of y[ycols] ~ x[cols] @ weight + bias on a split, from its moments."""
    cxy = split.cxy[cols, ycols]
    cross = (weight * cxy).sum(0)  # diag(W^T Cxy)
    quad = ((split.cxx[cols][:, cols] @ weight) * weight).sum(0)  # diag(W^T Cxx W)
    delta = split.mean_y[ycols] - split.mean_x[cols] @ weight - bias
    sse = split.syy[ycols] - 2 * cross + quad + split.weight_sum * delta * delta
    return float(sse.sum()), float(split.syy[ycols].sum())


def r2_score(split: Moments, cols: torch.Tensor, ycols: slice, weight: torch.Tensor, bias: torch.Tensor) -> float:
    """Pooled R^2 of y ~ x[cols] @ weight + bias on a split, from its moments alone."""
    sse, sst = sse_sst(split, cols, ycols, weight, bias)
    return 1.0 - sse / max(sst, 1e-30)


def reduce_rank(train: Moments, cols: torch.Tensor, weight: torch.Tensor, lambda_rel: float,
                rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors (A (in, r), B (r, out)) of the rank-r reduced-rank ridge map of a full ridge ``weight``."""
    gram = train.cxx[cols][:, cols]
    lam = lambda_rel * gram.diagonal().mean().clamp_min(1e-30)
    fitted = weight.T @ (gram @ weight) + lam * (weight.T @ weight)  # W^T (Cxx + lam I) W  (out, out)
    _, vectors = torch.linalg.eigh((fitted + fitted.T) / 2)  # ascending eigenvalues
    top = vectors[:, -rank:]  # (out, r)
    return weight @ top, top.T.contiguous()


def fit_map(train: Moments, cols: torch.Tensor, ycols: slice, lambda_rel: float, structure: Structure,
            sources: int, src_width: int) -> LinearMap:
    """Ridge map of y[ycols] on x[cols] with the given structure (cols: the layer input's global columns)."""
    groups, out_width = structure.groups, (ycols.stop - ycols.start) // structure.groups
    blocks, bias = [], torch.empty(ycols.stop - ycols.start, dtype=train.mean_y.dtype, device=train.mean_y.device)
    for i in range(groups):
        block_cols = cols[group_rows(sources, src_width, groups, i)]
        block_y = slice(ycols.start + i * out_width, ycols.start + (i + 1) * out_width)
        weight, block_bias = ridge(train, block_cols, block_y, lambda_rel)
        factors = (weight, None)
        if structure.rank is not None and structure.rank < min(weight.shape):
            a, b = reduce_rank(train, block_cols, weight, lambda_rel, structure.rank)
            factors = (a, b)
            block_bias = train.mean_y[block_y] - train.mean_x[block_cols] @ (a @ b)
        blocks.append(factors)
        bias[i * out_width:(i + 1) * out_width] = block_bias
    return LinearMap(blocks, bias, lambda_rel)


def map_r2(split: Moments, cols: torch.Tensor, ycols: slice, linear: LinearMap, sources: int, src_width: int) -> float:
    """Pooled R^2 of a (possibly block-diagonal, low-rank) map on a split."""
    out_width = (ycols.stop - ycols.start) // linear.groups
    sse = sst = 0.0
    for i, weight in enumerate(linear.block_weights()):
        block_cols = cols[group_rows(sources, src_width, linear.groups, i)]
        block_y = slice(ycols.start + i * out_width, ycols.start + (i + 1) * out_width)
        part = sse_sst(split, block_cols, block_y, weight, linear.bias[i * out_width:(i + 1) * out_width])
        sse, sst = sse + part[0], sst + part[1]
    return 1.0 - sse / max(sst, 1e-30)


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
    structure: Structure = Structure(),
) -> Solution:
    """Probe, select, and solve every target layer.

    ``structure``: head groups and rank of the maps (see the module docstring); groups must divide
    both models' KV head counts (:func:`head_groups` gives the largest), and the caller passes the
    same structure to score them.

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
    if layout.src_width % structure.groups or layout.dst_width % structure.groups:
        raise ConfigError(f"{structure.groups} head groups do not divide the source/target layer widths "
                          f"({layout.src_width}, {layout.dst_width}); use kvhub.core.solve.head_groups")
    layers = [
        _solve_layer(train, heldout if has_heldout else None, m, rank_sources(probe_k, probe_v, m),
                     k_candidates, lambda_candidates, structure)
        for m in range(layout.dst_layers)
    ]
    chosen_by = "held-out R^2" if has_heldout and (len(k_candidates) > 1 or len(lambda_candidates) > 1) else "fixed"
    return Solution(layers, probe_k, probe_v, k, lambda_, chosen_by, notes, structure)


def head_groups(source_kv_heads: int, target_kv_heads: int) -> int:
    """Head groups of a head-local map: gcd of the KV head counts (each group: whole heads on both sides)."""
    import math

    return math.gcd(source_kv_heads, target_kv_heads)


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


def _best_lambda(train: Moments, heldout: Moments | None, cols, ycols, lambdas: list[float],
                 structure: Structure, sources: int, src_width: int) -> tuple[float | None, LinearMap]:
    """(held-out R^2, map) of the lambda with the best held-out R^2 (R^2 None without held-out)."""
    best = None
    for lam in lambdas:
        linear = fit_map(train, cols, ycols, lam, structure, sources, src_width)
        score = map_r2(heldout, cols, ycols, linear, sources, src_width) if heldout is not None else None
        if best is None or (score is not None and score > best[0]):
            best = (score, linear)
    return best


def _solve_layer(train: KVStats, heldout: KVStats | None, m: int, ranking: list[int],
                 k_candidates: list[int], lambdas: list[float], structure: Structure) -> LayerSolution:
    """Coordinate search: lambdas at a middle k, then k at those lambdas, then lambdas again at the best k.

    Each step maximises held-out R^2 (K and V lambdas separately; k on their mean), which needs
    |lambdas| + |k| + |lambdas| solves instead of |k| * |lambdas|.
    """
    layout = train.layout
    ycols = layout.dst_columns(m)

    def fit_at(k: int, lambdas_k: list[float], lambdas_v: list[float]):
        sources = sorted(ranking[:k])
        cols = layout.src_columns(sources)
        shape = (structure, k, layout.src_width)
        fit_k = _best_lambda(train.k, heldout.k if heldout else None, cols, ycols, lambdas_k, *shape)
        fit_v = _best_lambda(train.v, heldout.v if heldout else None, cols, ycols, lambdas_v, *shape)
        score = None if heldout is None else (fit_k[0] + fit_v[0]) / 2
        return score, sources, cols, fit_k, fit_v

    start_k = max(c for c in k_candidates if c <= max(DEFAULT_K, min(k_candidates)))
    best = fit_at(start_k, lambdas, lambdas)
    if len(k_candidates) > 1:
        lam_k, lam_v = [best[3][1].lambda_], [best[4][1].lambda_]
        for k in k_candidates:
            if k != start_k:
                trial = fit_at(k, lam_k, lam_v)
                if trial[0] > best[0]:
                    best = trial
        if len(best[1]) != start_k and len(lambdas) > 1:
            best = fit_at(len(best[1]), lambdas, lambdas)
    _, sources, cols, (r2_k, k_map), (r2_v, v_map) = best
    shape = (len(sources), layout.src_width)
    return LayerSolution(
        target=m, sources=sources, k_map=k_map, v_map=v_map, r2_k=r2_k, r2_v=r2_v,
        train_r2_k=map_r2(train.k, cols, ycols, k_map, *shape),
        train_r2_v=map_r2(train.v, cols, ycols, v_map, *shape),
    )
