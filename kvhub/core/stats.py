"""Streaming, mergeable sufficient statistics for linear maps X -> Y.

For paired rows x_t (p,) and y_t (q,) with weights w_t >= 0 (all 1 unless given) over n
observations we keep

    n (row count),  W = sum w_t,
    mean_x = sum w_t x_t / W  (p,),   mean_y = sum w_t y_t / W  (q,)
    Cxx = sum w_t (x_t - mean_x)(x_t - mean_x)^T        (p, p)
    Cxy = sum w_t (x_t - mean_x)(y_t - mean_y)^T        (p, q)
    Syy = sum w_t (y_t - mean_y)^2                      (q,)   per output dim

so integer weights give the moments of the data with row t repeated w_t times.  Each batch is
centred on its own mean, scaled by sqrt(w_t) and multiplied in fp32, then merged into the running
totals with Chan's pairwise update, e.g. for two parts a, b with d = mean_a - mean_b:

    Cxx = Cxx_a + Cxx_b + d_x d_x^T * W_a W_b / W

so ``a.merge(b)`` equals the statistics of the concatenated data (up to float rounding) and memory
is independent of n.  Means and Syy are fp64; the Cxx and Cxy totals are fp64 by default, or fp32
(``dtype``) when fp64 does not fit: the merges stay exact Chan merges, only their sums round to fp32
(tests/fitting/test_two_pass.py measures that error).

X is the concatenation of every source layer (p = Ls * ds, ds = Hs*Ds) and Y of every target layer
(q = Lt * dt), so any layer selection, k and lambda can be solved afterwards.  A probe pass
(:mod:`kvhub.fitting.two_pass`) keeps only the Gram's diagonal blocks, one per source layer
(``gram="diagonal"``: Cxx stored as (Ls, ds, ds)), which is all a one-source-layer probe reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhub.errors import ConfigError, IncompatibleError

F64 = torch.float64
CHUNK_COLUMNS = 4096  # columns of one fp32 product during an update: bounds its transient memory
GRAMS = ("full", "diagonal")
ACCUMULATOR_DTYPES = {"float64": torch.float64, "float32": torch.float32}


class Moments:
    """Centred moments of (X, Y) pairs; see the module docstring.

    ``gram_blocks`` None keeps the full Cxx (p, p); B keeps only its B diagonal blocks, stored
    (B, p/B, p/B); 0 keeps no Gram at all (``cxx`` None: the cross moments of one target layer, whose
    Gram another sweep holds, :mod:`kvhub.fitting.layer_outer`).  Cxx and Cxy are ``dtype`` (fp64 or
    fp32), everything else fp64, all on ``device``.
    """

    def __init__(
        self,
        p: int,
        q: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = F64,
        gram_blocks: int | None = None,
    ):
        if dtype not in ACCUMULATOR_DTYPES.values():
            raise ConfigError(f"statistics accumulate in float64 or float32, not {dtype}")
        if gram_blocks is not None and gram_blocks != 0 and (gram_blocks < 1 or p % gram_blocks):
            raise IncompatibleError(f"{gram_blocks} diagonal Gram blocks do not divide p = {p}")
        self.n = 0  # rows, whatever their weight (the solve needs more rows than features)
        self.weight_sum = 0.0  # W; equals n when unweighted
        self.mean_x = torch.zeros(p, dtype=F64, device=device)
        self.mean_y = torch.zeros(q, dtype=F64, device=device)
        if gram_blocks is None:
            self.cxx = torch.zeros(p, p, dtype=dtype, device=device)
        elif gram_blocks == 0:
            self.cxx = None
        else:
            width = p // gram_blocks
            self.cxx = torch.zeros(gram_blocks, width, width, dtype=dtype, device=device)  # (B, p/B, p/B)
        self.cxy = torch.zeros(p, q, dtype=dtype, device=device)
        self.syy = torch.zeros(q, dtype=F64, device=device)

    @property
    def p(self) -> int:
        return self.mean_x.shape[0]

    @property
    def q(self) -> int:
        return self.mean_y.shape[0]

    @property
    def block_diagonal(self) -> bool:
        return self.cxx is not None and self.cxx.dim() == 3

    def nbytes(self) -> int:
        """Bytes of the accumulators (what :func:`kvhub.fitting.plan.statistics_bytes` predicts)."""
        return sum(t.nbytes for t in (self.mean_x, self.mean_y, self.cxx, self.cxy, self.syy) if t is not None)

    def _grams(self) -> list[tuple[slice, torch.Tensor]]:
        """(columns of x, their Gram block): the whole Cxx, each stored diagonal block, or none."""
        if self.cxx is None:
            return []
        if not self.block_diagonal:
            return [(slice(0, self.p), self.cxx)]
        width = self.cxx.shape[1]
        return [(slice(b * width, (b + 1) * width), self.cxx[b]) for b in range(self.cxx.shape[0])]

    def update(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Add rows x (N, p) and y (N, q) with optional weights (N,) >= 0 (any float dtype, same device)."""
        if x.shape[0] != y.shape[0] or x.shape[1] != self.p or y.shape[1] != self.q:
            raise IncompatibleError(
                f"statistics expect (N, {self.p}) and (N, {self.q}) rows, got {tuple(x.shape)} and {tuple(y.shape)}"
            )
        if x.shape[0] == 0:
            return
        self._merge_rows(x, y, weight)

    def _merge_rows(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None) -> None:
        """Chan-merge a batch into self without materialising its (p, p) and (p, q) moments: the fp32
        products are made :data:`CHUNK_COLUMNS` columns at a time and added in place, so the transient
        memory is N * (p + q) fp64 rows plus one (p, CHUNK_COLUMNS) product (see :mod:`kvhub.fitting.plan`)."""
        n, x64, y64 = x.shape[0], x.to(F64), y.to(F64)
        if weight is None:
            batch_weight, mean_x, mean_y = float(n), x64.mean(0), y64.mean(0)
            xc, yc = x64 - mean_x, y64 - mean_y
        else:
            w = _check_weight(weight, n).to(device=x64.device, dtype=F64)  # (N,)
            batch_weight = float(w.sum())
            if batch_weight == 0:
                self.n += n
                return
            mean_x, mean_y = (w @ x64) / batch_weight, (w @ y64) / batch_weight
            root = w.sqrt()[:, None]  # (N, 1)
            xc, yc = (x64 - mean_x) * root, (y64 - mean_y) * root
        del x64, y64
        total = self.weight_sum + batch_weight
        dx, dy = mean_x - self.mean_x, mean_y - self.mean_y
        w = self.weight_sum * batch_weight / total  # 0 for the first batch
        self.syy += (yc * yc).sum(0) + w * dy * dy
        xc, yc = xc.float(), yc.float()  # (N, p), (N, q)
        for cols, gram in self._grams():
            _add_products(gram, xc[:, cols], xc[:, cols])
        _add_products(self.cxy, xc, yc)
        self._add_shift(dx, dy, w)
        self.mean_x += dx * (batch_weight / total)
        self.mean_y += dy * (batch_weight / total)
        self.n, self.weight_sum = self.n + n, total

    def _add_shift(self, dx: torch.Tensor, dy: torch.Tensor, w: float) -> None:
        """Chan's mean-shift term, in place: Cxx += w dx dx^T (its stored blocks), Cxy += w dx dy^T."""
        dtype = self.cxy.dtype
        dx, dy = dx.to(dtype), dy.to(dtype)
        for cols, gram in self._grams():
            gram.addr_(dx[cols], dx[cols], alpha=w)
        self.cxy.addr_(dx, dy, alpha=w)

    @classmethod
    def from_batch(cls, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> "Moments":
        """Moments of one batch: centred on its fp64 (weighted) mean, products in fp32, stored fp64."""
        out = cls(x.shape[1], y.shape[1], device=x.device)
        if x.shape[0] != y.shape[0]:
            raise IncompatibleError(f"x has {x.shape[0]} rows and y {y.shape[0]}")
        if x.shape[0]:
            out._merge_rows(x, y, weight)
        return out

    def merge_(self, other: "Moments") -> "Moments":
        """In-place Chan merge: self <- stats(self data + other data) (same p, q, Gram layout)."""
        if other.cxx.shape != self.cxx.shape or other.cxy.shape != self.cxy.shape:
            raise IncompatibleError(
                f"cannot merge moments of shapes {tuple(other.cxx.shape)} into {tuple(self.cxx.shape)}"
            )
        n = self.n + other.n
        if other.weight_sum == 0:  # no rows, or rows of zero weight: only the row count changes
            self.n = n
            return self
        total = self.weight_sum + other.weight_sum
        dx = other.mean_x - self.mean_x
        dy = other.mean_y - self.mean_y
        w = self.weight_sum * other.weight_sum / total  # 0 when self is empty
        self.cxx += other.cxx.to(self.cxx.dtype)
        self.cxy += other.cxy.to(self.cxy.dtype)
        self._add_shift(dx, dy, w)
        self.syy += other.syy + w * dy * dy
        self.mean_x += dx * (other.weight_sum / total)
        self.mean_y += dy * (other.weight_sum / total)
        self.n, self.weight_sum = n, total
        return self

    def merge(self, other: "Moments") -> "Moments":
        """stats(a) + stats(b) -> stats(a ++ b), as a new object."""
        blocks = self.cxx.shape[0] if self.block_diagonal else None
        out = Moments(self.p, self.q, device=self.cxx.device, dtype=self.cxx.dtype, gram_blocks=blocks)
        return out.merge_(self).merge_(other)

    __add__ = merge

    def source_block(self, index: int, width: int) -> "Moments":
        """The moments of x's columns [index*width, (index+1)*width) against all of y: views, no copy.
        With a block-diagonal Gram, ``width`` must be its block width."""
        cols = slice(index * width, (index + 1) * width)
        if self.block_diagonal and self.cxx.shape[1] != width:
            raise IncompatibleError(f"Gram blocks are {self.cxx.shape[1]} wide, not {width}")
        out = Moments.__new__(Moments)
        out.n, out.weight_sum = self.n, self.weight_sum
        out.mean_x, out.mean_y, out.syy = self.mean_x[cols], self.mean_y, self.syy
        out.cxx = self.cxx[index] if self.block_diagonal else self.cxx[cols, cols]  # (width, width)
        out.cxy = self.cxy[cols]  # (width, q)
        return out

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {
            f"{prefix}n": torch.tensor(self.n, dtype=torch.int64),
            f"{prefix}weight_sum": torch.tensor(self.weight_sum, dtype=F64),
            f"{prefix}mean_x": self.mean_x,
            f"{prefix}mean_y": self.mean_y,
            f"{prefix}cxx": self.cxx,
            f"{prefix}cxy": self.cxy,
            f"{prefix}syy": self.syy,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], prefix: str = "") -> "Moments":
        """Inverse of :meth:`state_dict` (Cxx and Cxy keep their stored dtype and layout); a state without
        ``weight_sum`` (kvhub before weighting) is unweighted."""
        out = cls.__new__(cls)
        out.n = int(state[f"{prefix}n"])
        out.weight_sum = float(state.get(f"{prefix}weight_sum", out.n))
        for name in ("mean_x", "mean_y", "syy"):
            setattr(out, name, state[f"{prefix}{name}"].to(F64))
        out.cxx, out.cxy = state[f"{prefix}cxx"], state[f"{prefix}cxy"]
        return out


def _add_products(target: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """target += left^T @ right: fp32 products, :data:`CHUNK_COLUMNS` columns of ``right`` at a time,
    added into ``target``'s dtype."""
    for start in range(0, right.shape[1], CHUNK_COLUMNS):
        block = slice(start, start + CHUNK_COLUMNS)
        target[:, block] += (left.T @ right[:, block]).to(target.dtype)


def _check_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if weight.shape != (rows,):
        raise IncompatibleError(f"statistics expect one weight per row, shape ({rows},), got {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()) or bool((weight < 0).any()):
        raise ConfigError("row weights must be finite and non-negative")
    return weight


@dataclass
class Layout:
    """How X and Y are laid out: X = [source layer 0 | 1 | ...] of width src_width each, same for Y."""

    src_layers: int
    src_width: int
    dst_layers: int
    dst_width: int

    def src_columns(self, layers: list[int]) -> torch.Tensor:
        """Column indices of X for the given source layers, in the given order."""
        return torch.cat([torch.arange(l * self.src_width, (l + 1) * self.src_width) for l in layers])

    def dst_columns(self, layer: int) -> slice:
        return slice(layer * self.dst_width, (layer + 1) * self.dst_width)


class KVStats:
    """Moments for keys and values of one (source, target) model pair, one data split.

    ``gram``: "full" (every source-layer pair's Gram block: what the solve needs) or "diagonal" (each
    source layer's own block only: what the probe needs).  ``dtype``: of the Gram and cross totals.
    """

    def __init__(
        self, layout: Layout, *, device: torch.device | str = "cpu", dtype: torch.dtype = F64, gram: str = "full"
    ):
        if gram not in GRAMS:
            raise ConfigError(f"gram must be one of {GRAMS}, got {gram!r}")
        self.layout = layout
        p = layout.src_layers * layout.src_width
        q = layout.dst_layers * layout.dst_width
        blocks = layout.src_layers if gram == "diagonal" else None
        self.k = Moments(p, q, device=device, dtype=dtype, gram_blocks=blocks)
        self.v = Moments(p, q, device=device, dtype=dtype, gram_blocks=blocks)

    @property
    def n(self) -> int:
        return self.k.n

    @property
    def gram(self) -> str:
        return "diagonal" if self.k.block_diagonal else "full"

    def nbytes(self) -> int:
        """Bytes of the K and V accumulators."""
        return self.k.nbytes() + self.v.nbytes()

    def update(
        self, source_keys, source_values, target_keys, target_values, *, weights: torch.Tensor | None = None
    ) -> None:
        """Add one batch: lists of per-layer (N, width) blocks, as returned by kvhub.core.capture.

        ``weights`` (N,) >= 0 weigh each row in both the K and the V moments (None: all 1).
        """
        self.k.update(torch.cat(source_keys, dim=1), torch.cat(target_keys, dim=1), weights)  # (N, p), (N, q)
        self.v.update(torch.cat(source_values, dim=1), torch.cat(target_values, dim=1), weights)

    def merge(self, other: "KVStats") -> "KVStats":
        if other.layout != self.layout or other.gram != self.gram:
            raise IncompatibleError(
                f"cannot merge statistics of layouts {self.layout} ({self.gram} Gram) and "
                f"{other.layout} ({other.gram} Gram)"
            )
        out = KVStats.__new__(KVStats)
        out.layout = self.layout
        out.k, out.v = self.k.merge(other.k), self.v.merge(other.v)
        return out

    __add__ = merge

    def state_dict(self) -> dict[str, torch.Tensor]:
        layout = torch.tensor(
            [self.layout.src_layers, self.layout.src_width, self.layout.dst_layers, self.layout.dst_width]
        )
        return {"layout": layout, **self.k.state_dict("k."), **self.v.state_dict("v.")}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> "KVStats":
        out = cls.__new__(cls)
        out.layout = Layout(*[int(v) for v in state["layout"]])
        out.k = Moments.from_state_dict(state, "k.")
        out.v = Moments.from_state_dict(state, "v.")
        return out
