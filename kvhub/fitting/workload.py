"""What a fit is asked to do, in sizes: :class:`Workload` (calibration sequences, stride, batch, k, dtype), the
k a plan costs, and the refusal of a workload with fewer observations than features (the plan's, ``kvhub fit``'s
and the solve's one rule)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvhub.calib.recipe import Sequences
from kvhub.errors import ConfigError
from kvhub.fitting.shapes import ModelShape

_SEQUENCES = Sequences()


@dataclass
class Workload:
    """Calibration sizes of a fit (defaults: those of kvhub.calib.recipe.Sequences, the built-in recipes')."""

    samples: int = _SEQUENCES.samples
    heldout: int = _SEQUENCES.heldout_samples
    seq_len: int = _SEQUENCES.seq_len
    stride: int = _SEQUENCES.stride
    batch_size: int = 4
    k: int | None = None  # None: 'auto' (costs are for the largest k of the grid)
    dtype: str = "bfloat16"
    mlp_tokens: int = 0  # --map mlp: rows kept per split for the MLPs (--mlp-tokens); 0: a ridge fit keeps none

    @property
    def rows(self) -> int:
        """Statistics rows of the whole calibration set (train + held-out)."""
        return (self.samples + self.heldout) * math.ceil(self.seq_len / self.stride)


def workload_for(
    *,
    samples: int | None = None,
    heldout: int | None = None,
    seq_len: int | None = None,
    stride: int | None = None,
    batch_size: int = 4,
    k: int | None = None,
    dtype: str = "bfloat16",
    mlp_tokens: int = 0,
) -> Workload:
    """A Workload; what is left None takes the calibration recipes' defaults (kvhub.calib.recipe)."""
    from kvhub.calib.recipe import Sequences, heldout_count

    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ConfigError(f"k must be a positive integer or None ('auto'), not {k!r}")
    defaults = Sequences()
    samples = samples or defaults.samples
    return Workload(
        samples=samples,
        heldout=heldout if heldout is not None else heldout_count(samples, defaults.heldout_fraction),
        seq_len=seq_len or defaults.seq_len,
        stride=stride or defaults.stride,
        batch_size=batch_size,
        k=k,
        dtype=dtype,
        mlp_tokens=mlp_tokens,
    )


def _k_for(source: ModelShape, workload: Workload) -> int:
    """The fit's k, or under 'auto' the largest k of the grid the source layers and the rows allow."""
    from kvhub.core.solve import TOP_K_GRID

    if workload.k is not None:
        return workload.k
    train_rows = workload.samples * math.ceil(workload.seq_len / workload.stride)
    feasible = [k for k in TOP_K_GRID if k <= source.layers and k * source.kv_width < train_rows]
    return max(feasible, default=1)


def too_few_observations(source: ModelShape, workload: Workload) -> str | None:
    """Why the solve would refuse this workload before any forward pass could change it, or None.

    A ridge fit needs more training rows, samples * ceil(seq_len / stride), than features, k times the
    source's KV width (under 'auto' the smallest k of the grid, 1); the same rule as
    :func:`kvhub.core.solve.solve`, so a refusal here is one the fit would reach after its forward passes."""
    per_sequence = math.ceil(workload.seq_len / workload.stride)
    rows, k = workload.samples * per_sequence, workload.k or 1
    features = k * source.kv_width
    if features < rows:
        return None
    needed = features // per_sequence + 1
    what = f"k {k} x {source.kv_width}" if workload.k else f"{source.kv_width}"
    return (
        f"{workload.samples} sequences of {workload.seq_len} tokens at stride {workload.stride} give {rows} "
        f"training observations, but a ridge fit needs more than its {features} features ({what}, the KV "
        f"width of {source.model_id}); use --samples {needed} or more, a longer --seq-len or a smaller --stride"
        + (", or a smaller --k" if workload.k and workload.k > 1 else "")
    )
