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


def _solve_costs(
    source: ModelShape, target: ModelShape, k: int, owned_layers: int, auto: bool, solved_layers: int
) -> tuple[int, float]:
    """(transient bytes, FLOPs) of one rank's solve, K and V: the probe (one ridge per source layer against
    the owned targets, scored per pair; over ``solved_layers`` source layers again in a two-pass fit's
    solve) plus each owned layer's coordinate search (kvhub.core.solve._solve_layer: every lambda at k=4,
    every k once, every lambda again at the best k, costed as k = ``k``).
    One ridge of kd = k*ds inputs and dt outputs: kd^3/3 (Cholesky) + 2 kd^2 dt (solve) + 2 kd^2 dt (scoring)."""
    from kvhub.core.solve import DEFAULT_TOP_K, LAMBDA_GRID, TOP_K_GRID

    ds, dt = source.kv_width, target.kv_width
    q_owned, kd = owned_layers * dt, k * ds
    memory = 8 * max(3 * ds * ds + 2 * ds * q_owned, 3 * kd * kd + 3 * kd * dt)
    ridge = lambda inputs: inputs**3 / 3 + 4 * inputs * inputs * dt  # noqa: E731
    probed = source.layers + (solved_layers if solved_layers < source.layers else 0)
    probe = probed * (ds**3 / 3 + 4 * ds * ds * q_owned)
    if auto:
        grid = [c for c in TOP_K_GRID if c <= k]
        per_layer = (
            len(LAMBDA_GRID) * ridge(min(DEFAULT_TOP_K, k) * ds)
            + sum(ridge(c * ds) for c in grid)
            + len(LAMBDA_GRID) * ridge(kd)
        )
    else:
        per_layer = ridge(kd)
    return memory, 2 * (probe + owned_layers * per_layer)
