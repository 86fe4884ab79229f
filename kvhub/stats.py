"""Streaming, mergeable sufficient statistics for linear maps X -> Y.

For paired rows x (p,) and y (q,) over n observations we keep, in fp64,

    n,  mean_x (p,),  mean_y (q,),
    Cxx = sum (x - mean_x)(x - mean_x)^T        (p, p)
    Cxy = sum (x - mean_x)(y - mean_y)^T        (p, q)
    Syy = sum (y - mean_y)^2                    (q,)   per output dim

Each batch is centred on its own mean and multiplied in fp32, then merged into the running fp64
totals with Chan's pairwise update, e.g. for two parts a, b with d = mean_a - mean_b:

    Cxx = Cxx_a + Cxx_b + d_x d_x^T * n_a n_b / n

so ``a.merge(b)`` equals the statistics of the concatenated data (up to float rounding) and memory
is independent of n.  X is the concatenation of every source layer (p = Ls * Hs*Ds) and Y of every
target layer (q = Lt * Ht*Dt), so any layer selection, k and lambda can be solved afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import IncompatibleError

F64 = torch.float64


class Moments:
    """Centred moments of (X, Y) pairs; see the module docstring.  All tensors fp64 on ``device``."""

    def __init__(self, p: int, q: int, *, device: torch.device | str = "cpu"):
        self.n = 0
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

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add rows x (N, p) and y (N, q) (any float dtype, same device as the moments)."""
        if x.shape[0] != y.shape[0] or x.shape[1] != self.p or y.shape[1] != self.q:
            raise IncompatibleError(
                f"statistics expect (N, {self.p}) and (N, {self.q}) rows, got {tuple(x.shape)} and {tuple(y.shape)}"
            )
        if x.shape[0] == 0:
            return
        batch = Moments.from_batch(x, y)
        self.merge_(batch)

    @classmethod
    def from_batch(cls, x: torch.Tensor, y: torch.Tensor) -> "Moments":
        """Moments of one batch: centred on its fp64 mean, products in fp32, stored fp64."""
        out = cls.__new__(cls)
        out.n = x.shape[0]
        out.mean_x = x.to(F64).mean(0)
        out.mean_y = y.to(F64).mean(0)
        xc = (x.to(F64) - out.mean_x).float()  # (N, p)
        yc = (y.to(F64) - out.mean_y).float()  # (N, q)
        out.cxx = (xc.T @ xc).to(F64)
        out.cxy = (xc.T @ yc).to(F64)
        out.syy = (yc.to(F64) ** 2).sum(0)
        return out

    def merge_(self, other: "Moments") -> "Moments":
        """In-place Chan merge: self <- stats(self data + other data)."""
        if other.n == 0:
            return self
        if self.n == 0:
            self.n = other.n
            for name in ("mean_x", "mean_y", "cxx", "cxy", "syy"):
                setattr(self, name, getattr(other, name).clone())
            return self
        n = self.n + other.n
        dx = other.mean_x - self.mean_x
        dy = other.mean_y - self.mean_y
        w = self.n * other.n / n
        self.cxx += other.cxx + w * torch.outer(dx, dx)
        self.cxy += other.cxy + w * torch.outer(dx, dy)
        self.syy += other.syy + w * dy * dy
        self.mean_x += dx * (other.n / n)
        self.mean_y += dy * (other.n / n)
        self.n = n
        return self

    def merge(self, other: "Moments") -> "Moments":
        """stats(a) + stats(b) -> stats(a ++ b), as a new object."""
        out = Moments(self.p, self.q, device=self.cxx.device)
        return out.merge_(self).merge_(other)

    __add__ = merge

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {
            f"{prefix}n": torch.tensor(self.n, dtype=torch.int64),
            f"{prefix}mean_x": self.mean_x, f"{prefix}mean_y": self.mean_y,
            f"{prefix}cxx": self.cxx, f"{prefix}cxy": self.cxy, f"{prefix}syy": self.syy,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], prefix: str = "") -> "Moments":
        out = cls.__new__(cls)
        out.n = int(state[f"{prefix}n"])
        for name in ("mean_x", "mean_y", "cxx", "cxy", "syy"):
            setattr(out, name, state[f"{prefix}{name}"].to(F64))
        return out


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

    def update(self, source_keys, source_values, target_keys, target_values) -> None:
        """Add one batch: lists of per-layer (N, width) blocks, as returned by kvhub.capture."""
        self.k.update(torch.cat(source_keys, dim=1), torch.cat(target_keys, dim=1))  # (N, p), (N, q)
        self.v.update(torch.cat(source_values, dim=1), torch.cat(target_values, dim=1))

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
