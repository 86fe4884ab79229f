"""How a fit accumulates its statistics: one pass or two, fp64 or fp32 totals, and the bytes each allocates.

    one pass    every source layer's full statistics: the (p, p) Gram and the (p, qr) cross block
    two passes  pass 1 keeps each source layer's diagonal Gram block (Ls, ds, ds) and the cross block,
                which is all every probe R^2 reads (kvhub.core.solve.probe_r2); pass 2, over the same
                batches, keeps the full statistics of at most ``candidates`` source layers, each target
                layer's best ``top_k_max`` by probe R^2 (kvhub.fitting.two_pass)

Bytes of one rank's accumulators, train and held-out, K and V (``b`` = 8 for fp64 totals, 4 for fp32;
the means and Syy are fp64 either way; ``qr`` = the rank's target columns, ``c`` = candidates):

    S(p, g, qr, b) = 2 splits * 2 (K, V) * (8 (p + 2 qr) + b (g + p qr)),    g = stored Gram entries
    one pass:    S(p, p^2, qr, b)
    two passes:  max(S(p, Ls ds^2, qr, b), S(c ds, (c ds)^2, qr, b))

(pass 1's accumulators are freed before pass 2 allocates its own).  :mod:`kvhub.fitting.plan` decides
the mode from these figures; :class:`kvhub.core.stats.KVStats` allocates exactly these bytes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from kvhub.artifact import parse_json
from kvhub.errors import ConfigError

MODES = ("auto", "one-pass", "two-pass")  # what ``kvhub fit --stats`` and ``kvhub plan --stats`` accept
# where the models run (kvhub.fitting.phases): what ``kvhub fit --capture`` and ``kvhub plan --capture`` accept
CAPTURES = ("auto", "one-phase", "two-phase")
# how the target runs (kvhub.fitting.layer_outer): what ``kvhub fit --target-layout`` and ``kvhub plan`` accept
TARGET_LAYOUTS = ("auto", "whole", "layer-outer")
ACCUMULATORS = {"float64": 8, "float32": 4}  # dtype of the totals -> bytes per entry (no torch: the CLI imports this)


@dataclass(frozen=True)
class StatisticsMode:
    """One or two passes; the dtype of the Gram and cross totals; in two passes, the most source layers
    pass 2 keeps (``candidates``, None: no limit) and the largest top_k the solve may choose, which is
    also how many candidates each target layer contributes (``top_k_max``, None: the fit's fixed k, or
    the largest of the k grid)."""

    passes: int = 1
    dtype: str = "float64"
    candidates: int | None = None
    top_k_max: int | None = None

    def __post_init__(self):
        if self.passes not in (1, 2):
            raise ConfigError(f"statistics take one or two passes, not {self.passes}")
        if self.dtype not in ACCUMULATORS:
            raise ConfigError(f"statistics accumulate in {' or '.join(ACCUMULATORS)}, not {self.dtype!r}")
        if self.passes == 1 and (self.candidates is not None or self.top_k_max is not None):
            raise ConfigError("candidate source layers belong to two-pass statistics; use --stats two-pass")
        for name in ("candidates", "top_k_max"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"two-pass {name} must be a positive integer, got {value!r}")
        if self.candidates is not None and self.top_k_max is not None and self.top_k_max > self.candidates:
            raise ConfigError(
                f"two-pass statistics keeping {self.candidates} candidate source layers cannot "
                f"solve k up to {self.top_k_max}; keep more candidates or lower --k"
            )

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def depth(self, top_k: int | None, top_k_grid: tuple[int, ...], src_layers: int) -> int:
        """Candidates per target layer in pass 2: ``top_k_max``, else a fixed top_k, else the largest
        grid value the candidates and the source layers allow."""
        if isinstance(top_k, int):
            if self.top_k_max is not None and top_k > self.top_k_max:
                raise ConfigError(
                    f"k={top_k} is more than the {self.top_k_max} source layers per target layer "
                    "the two-pass statistics keep; lower --k or keep more candidates"
                )
            return top_k if self.top_k_max is None else self.top_k_max
        if self.top_k_max is not None:
            return self.top_k_max
        limit = min(src_layers, self.candidates or src_layers)
        return max([c for c in top_k_grid if c <= limit], default=1)

    def describe(self) -> str:
        if self.passes == 1:
            return f"one pass, {self.dtype}"
        kept = f"at most {self.candidates}" if self.candidates else "every chosen"
        depth = f", k <= {self.top_k_max}" if self.top_k_max else ""
        return f"two passes, {self.dtype}: pass 2 keeps {kept} source layers{depth}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "StatisticsMode":
        return cls(**parse_json(text))


ONE_PASS = StatisticsMode()


def statistics_bytes(p: int, q_owned: int, *, gram_entries: int | None = None, dtype: str = "float64") -> int:
    """Bytes KVStats allocates for train + held-out: S(p, g, qr, b) of the module docstring (g = p^2
    unless ``gram_entries`` says how many Gram entries are stored)."""
    gram = p * p if gram_entries is None else gram_entries
    return 2 * 2 * (8 * (p + 2 * q_owned) + ACCUMULATORS[dtype] * (gram + p * q_owned))


def pass_bytes(src_layers: int, src_width: int, q_owned: int, mode: StatisticsMode) -> tuple[int, ...]:
    """Accumulator bytes of each pass of ``mode`` (pass 2 at ``candidates`` source layers, or all of them)."""
    p = src_layers * src_width
    if mode.passes == 1:
        return (statistics_bytes(p, q_owned, dtype=mode.dtype),)
    kept = min(src_layers, mode.candidates or src_layers) * src_width
    return (
        statistics_bytes(p, q_owned, gram_entries=p * src_width, dtype=mode.dtype),
        statistics_bytes(kept, q_owned, dtype=mode.dtype),
    )
