"""Streaming, mergeable sufficient statistics for linear maps X -> Y.

For paired rows x_t (p,) and y_t (q,) with weights w_t >= 0 (all 1 unless given) over n
observations we keep, in fp64,

    n (row count),  W = sum w_t,
    mean_x = sum w_t x_t / W  (p,),   mean_y = sum w_t y_t / W  (q,)
    Cxx = sum w_t (x_t - mean_x)(x_t - mean_x)^T        (p, p)
    Cxy = sum w_t (x_t - mean_x)(y_t - mean_y)^T        (p, q)
    Syy = sum w_t (y_t - mean_y)^2                      (q,)   per output dim

so integer weights give the moments of the data with row t repeated w_t times.  Each batch is
centred on its own mean, scaled by sqrt(w_t) and multiplied in fp32, then merged into the running
fp64 totals with Chan's pairwise update, e.g. for two parts a, b with d = mean_a - mean_b:

    Cxx = Cxx_a + Cxx_b + d_x d_x^T * W_a W_b / W

so ``a.merge(b)`` equals the statistics of the concatenated data (up to float rounding) and memory
is independent of n.  X is the concatenation of every source layer (p = Ls * Hs*Ds) and Y of every
target layer (q = Lt * Ht*Dt), so any layer selection, k and lambda can be solved afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhub.errors import ConfigError, IncompatibleError

F64 = torch.float64
CHUNK_COLUMNS = 4096  # columns of one fp32 product during an update: bounds its transient memory


class Moments:
    """Centred moments of (X, Y) pairs; see the module docstring.  All tensors fp64 on ``device``."""

    def __init__(self, p: int, q: int, *, device: torch.device | str = "cpu"):
        self.n = 0  # rows, whatever their weight (the solve needs more rows than features)
        self.weight_sum = 0.0  # W; equals n when unweighted
        self.mean_x = torch.zeros(p, dtype=F64, device=device)
        self.mean_y = torch.zeros(q, dtype=F64, device=device)
        self.cxx = torch.zeros(p, p, dtype=F64, device=device)
        self.cxy = torch.zeros(p, q, dtype=F64, device=device)
        self.syy = torch.zeros(q, dtype=F64, device=device)

    @property
    def p(self) -> int:
        return self.mean_x.shape[0]

    @property
    def q(self) -> int:
        return self.mean_y.shape[0]

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
        for target, right in ((self.cxx, xc), (self.cxy, yc)):
            for start in range(0, right.shape[1], CHUNK_COLUMNS):
                block = slice(start, start + CHUNK_COLUMNS)
                target[:, block] += (xc.T @ right[:, block]).to(F64)
        self.cxx.addr_(dx, dx, alpha=w)
        self.cxy.addr_(dx, dy, alpha=w)
        self.mean_x += dx * (batch_weight / total)
        self.mean_y += dy * (batch_weight / total)
        self.n, self.weight_sum = self.n + n, total

    @classmethod
    def from_batch(cls, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> "Moments":
        """Moments of one batch: centred on its fp64 (weighted) mean, products in fp32, stored fp64."""
        out = cls.__new__(cls)
        out.n = x.shape[0]
        x64, y64 = x.to(F64), y.to(F64)
        if weight is None:
            out.weight_sum = float(out.n)
            out.mean_x, out.mean_y = x64.mean(0), y64.mean(0)
            xc, yc = x64 - out.mean_x, y64 - out.mean_y
        else:
            w = _check_weight(weight, out.n).to(device=x64.device, dtype=F64)  # (N,)
            out.weight_sum = float(w.sum())
            total = max(out.weight_sum, 1e-300)  # all-zero weights: zero means, zero moments
            out.mean_x, out.mean_y = (w @ x64) / total, (w @ y64) / total
            root = w.sqrt()[:, None]  # (N, 1): sum w (.)(.)^T = (sqrt(w) .)^T (sqrt(w) .)
            xc, yc = (x64 - out.mean_x) * root, (y64 - out.mean_y) * root
        xc, yc = xc.float(), yc.float()  # (N, p), (N, q)
        out.cxx = (xc.T @ xc).to(F64)
        out.cxy = (xc.T @ yc).to(F64)
        out.syy = (yc.to(F64) ** 2).sum(0)
        return out

    def merge_(self, other: "Moments") -> "Moments":
        """In-place Chan merge: self <- stats(self data + other data)."""
        n = self.n + other.n
        if other.weight_sum == 0:  # no rows, or rows of zero weight: only the row count changes
            self.n = n
            return self
        if self.weight_sum == 0:
            for name in ("mean_x", "mean_y", "cxx", "cxy", "syy"):
                setattr(self, name, getattr(other, name).clone())
            self.n, self.weight_sum = n, other.weight_sum
            return self
        total = self.weight_sum + other.weight_sum
        dx = other.mean_x - self.mean_x
        dy = other.mean_y - self.mean_y
        w = self.weight_sum * other.weight_sum / total
        self.cxx += other.cxx + w * torch.outer(dx, dx)
        self.cxy += other.cxy + w * torch.outer(dx, dy)
        self.syy += other.syy + w * dy * dy
        self.mean_x += dx * (other.weight_sum / total)
        self.mean_y += dy * (other.weight_sum / total)
        self.n, self.weight_sum = n, total
        return self

    def merge(self, other: "Moments") -> "Moments":
        """stats(a) + stats(b) -> stats(a ++ b), as a new object."""
        out = Moments(self.p, self.q, device=self.cxx.device)
        return out.merge_(self).merge_(other)

    __add__ = merge

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {
            f"{prefix}n": torch.tensor(self.n, dtype=torch.int64),
            f"{prefix}weight_sum": torch.tensor(self.weight_sum, dtype=F64),
            f"{prefix}mean_x": self.mean_x, f"{prefix}mean_y": self.mean_y,
            f"{prefix}cxx": self.cxx, f"{prefix}cxy": self.cxy, f"{prefix}syy": self.syy,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], prefix: str = "") -> "Moments":
        """Inverse of :meth:`state_dict`; a state without ``weight_sum`` (kvhub before weighting) is unweighted."""
        out = cls.__new__(cls)
        out.n = int(state[f"{prefix}n"])
        out.weight_sum = float(state.get(f"{prefix}weight_sum", out.n))
        for name in ("mean_x", "mean_y", "cxx", "cxy", "syy"):
            setattr(out, name, state[f"{prefix}{name}"].to(F64))
        return out


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
    """Moments for keys and values of one (source, target) model pair, one data split."""

    def __init__(self, layout: Layout, *, device: torch.device | str = "cpu"):
        self.layout = layout
        p = layout.src_layers * layout.src_width
        q = layout.dst_layers * layout.dst_width
        self.k = Moments(p, q, device=device)
        self.v = Moments(p, q, device=device)

    @property
    def n(self) -> int:
        return self.k.n

    def update(self, source_keys, source_values, target_keys, target_values, *,
               weights: torch.Tensor | None = None) -> None:
        """Add one batch: lists of per-layer (N, width) blocks, as returned by kvhub.core.capture.

        ``weights`` (N,) >= 0 weigh each row in both the K and the V moments (None: all 1).
        """
        self.k.update(torch.cat(source_keys, dim=1), torch.cat(target_keys, dim=1), weights)  # (N, p), (N, q)
        self.v.update(torch.cat(source_values, dim=1), torch.cat(target_values, dim=1), weights)

    def merge(self, other: "KVStats") -> "KVStats":
        if other.layout != self.layout:
            raise IncompatibleError(f"cannot merge statistics of layouts {self.layout} and {other.layout}")
        out = KVStats(self.layout, device=self.k.cxx.device)
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
