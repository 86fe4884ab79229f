"""Closed-form ridge maps over sufficient statistics: fit, compress and score a map from moments alone.

Notation (see :mod:`kvhub.core.stats`): for a source-column set S and target columns J,

    ridge:    W = (Cxx[S,S] + penalty * I)^-1 Cxy[S,J],   b = mean_y[J] - mean_x[S] W
    penalty = ridge_lambda * trace(Cxx[S,S]) / |S|   (scale-aware: ridge_lambda is relative to the
                                                      mean diagonal of the centred Gram)
    R^2     = 1 - sum_j SSE_j / sum_j Syy_j           (pooled over the layer's output dims)

and the residual sum of squares of any (W, b) on a split with moments (n, mu_x, mu_y, C*) is

    SSE_j = Syy_j - 2 (W^T Cxy)_jj + (W^T Cxx W)_jj + n * (mu_y - mu_x W - b)_j^2

(n is the total row weight, ``weight_sum``: the number of rows unless the fit weighs tokens).

A map's :class:`Structure` compresses it: head-local (``groups`` = g > 1, W block-diagonal over g head
groups) and low rank (``rank`` = r, reduced-rank ridge per block, stored as A (in, r) @ B (r, out)).
:mod:`kvhub.core.solve` searches over these maps (which sources, top_k, ridge_lambda).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhub.artifact import tensor_name
from kvhub.core.stats import F64, Moments
from kvhub.errors import ConfigError


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
    ridge_lambda: float

    @property
    def groups(self) -> int:
        return len(self.blocks)

    @property
    def rank(self) -> int | None:
        return None if self.blocks[0][1] is None else self.blocks[0][0].shape[1]

    def block_weights(self) -> list[torch.Tensor]:
        return [a if b is None else a @ b for a, b in self.blocks]

    def dense(self, n_sources: int, src_width: int) -> torch.Tensor:
        """The equivalent (n_sources * src_width, out) matrix."""
        weights = self.block_weights()
        out_width = weights[0].shape[1]
        dense = torch.zeros(n_sources * src_width, out_width * self.groups, dtype=weights[0].dtype)
        for i, weight in enumerate(weights):
            dense[group_rows(n_sources, src_width, self.groups, i), i * out_width : (i + 1) * out_width] = weight
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


def group_rows(n_sources: int, src_width: int, groups: int, index: int) -> torch.Tensor:
    """Columns of a layer input x = [source layer 1 | ... | layer n_sources] that head group ``index``
    reads: the index-th 1/groups of every source layer's src_width (heads are head-major within a layer)."""
    width = src_width // groups
    return torch.cat(
        [torch.arange(j * src_width + index * width, j * src_width + (index + 1) * width) for j in range(n_sources)]
    )


# ---- primitives ------------------------------------------------------------------------------
def _gram(moments: Moments, cols: torch.Tensor) -> torch.Tensor:
    """Cxx[S, S] as fp64 (|S|, |S|), gathered without an (|S|, p) intermediate."""
    return moments.cxx[cols[:, None], cols].to(F64)


def _penalty(gram: torch.Tensor, ridge_lambda: float) -> torch.Tensor:
    return ridge_lambda * gram.diagonal().mean().clamp_min(1e-30)


def ridge(train: Moments, cols: torch.Tensor, ycols: slice, ridge_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Centred ridge W (|S|, |J|), b (|J|,) from the training moments (fp64)."""
    gram = _gram(train, cols)  # (|S|, |S|)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    penalised = gram + _penalty(gram, ridge_lambda) * eye
    chol, info = torch.linalg.cholesky_ex(penalised)
    rhs = train.cxy[cols, ycols].to(F64)  # (|S|, |J|)
    weight = torch.cholesky_solve(rhs, chol) if int(info) == 0 else torch.linalg.lstsq(penalised, rhs).solution
    bias = train.mean_y[ycols] - train.mean_x[cols] @ weight
    return weight, bias


def sse_sst(
    split: Moments, cols: torch.Tensor, ycols: slice, weight: torch.Tensor, bias: torch.Tensor
) -> tuple[float, float]:
    """(residual, total) sums of squares of y[ycols] ~ x[cols] @ weight + bias on a split, from its moments."""
    cxy = split.cxy[cols, ycols].to(weight.dtype)
    cross = (weight * cxy).sum(0)  # diag(W^T Cxy)
    quad = ((_gram(split, cols).to(weight.dtype) @ weight) * weight).sum(0)  # diag(W^T Cxx W)
    delta = split.mean_y[ycols] - split.mean_x[cols] @ weight - bias
    sse = split.syy[ycols] - 2 * cross + quad + split.weight_sum * delta * delta
    return float(sse.sum()), float(split.syy[ycols].sum())


def r2_score(split: Moments, cols: torch.Tensor, ycols: slice, weight: torch.Tensor, bias: torch.Tensor) -> float:
    """Pooled R^2 of y ~ x[cols] @ weight + bias on a split, from its moments alone."""
    sse, sst = sse_sst(split, cols, ycols, weight, bias)
    return 1.0 - max(sse, 0.0) / max(sst, 1e-30)  # SSE from moments can round below 0: R^2 is at most 1


def reduce_rank(
    train: Moments, cols: torch.Tensor, weight: torch.Tensor, ridge_lambda: float, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors (A (in, r), B (r, out)) of the rank-r reduced-rank ridge map of a full ridge ``weight``."""
    gram = _gram(train, cols)
    fitted = weight.T @ (gram @ weight) + _penalty(gram, ridge_lambda) * (weight.T @ weight)  # W^T (Cxx + pI) W
    _, vectors = torch.linalg.eigh((fitted + fitted.T) / 2)  # ascending eigenvalues
    top = vectors[:, -rank:]  # (out, r)
    return weight @ top, top.T.contiguous()


def fit_map(
    train: Moments,
    cols: torch.Tensor,
    ycols: slice,
    ridge_lambda: float,
    structure: Structure,
    n_sources: int,
    src_width: int,
) -> LinearMap:
    """Ridge map of y[ycols] on x[cols] with the given structure (cols: the layer input's global columns,
    ``n_sources`` source layers of ``src_width``)."""
    groups, out_width = structure.groups, (ycols.stop - ycols.start) // structure.groups
    blocks, bias = [], torch.empty(ycols.stop - ycols.start, dtype=train.mean_y.dtype, device=train.mean_y.device)
    for i in range(groups):
        block_cols = cols[group_rows(n_sources, src_width, groups, i)]
        block_y = slice(ycols.start + i * out_width, ycols.start + (i + 1) * out_width)
        weight, block_bias = ridge(train, block_cols, block_y, ridge_lambda)
        factors = (weight, None)
        if structure.rank is not None and structure.rank < min(weight.shape):
            a, b = reduce_rank(train, block_cols, weight, ridge_lambda, structure.rank)
            factors = (a, b)
            block_bias = train.mean_y[block_y] - train.mean_x[block_cols] @ (a @ b)
        blocks.append(factors)
        bias[i * out_width : (i + 1) * out_width] = block_bias
    return LinearMap(blocks, bias, ridge_lambda)


def map_r2(
    split: Moments, cols: torch.Tensor, ycols: slice, linear: LinearMap, n_sources: int, src_width: int
) -> float:
    """Pooled R^2 of a (possibly block-diagonal, low-rank) map on a split."""
    out_width = (ycols.stop - ycols.start) // linear.groups
    sse = sst = 0.0
    for i, weight in enumerate(linear.block_weights()):
        block_cols = cols[group_rows(n_sources, src_width, linear.groups, i)]
        block_y = slice(ycols.start + i * out_width, ycols.start + (i + 1) * out_width)
        part = sse_sst(split, block_cols, block_y, weight, linear.bias[i * out_width : (i + 1) * out_width])
        sse, sst = sse + part[0], sst + part[1]
    return 1.0 - max(sse, 0.0) / max(sst, 1e-30)
