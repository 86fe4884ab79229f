"""Two-pass statistics, for pairs whose full statistics do not fit: probe first, then keep only candidates.

Pass 1 accumulates, for both splits and for K and V, only what the probe reads
(:func:`kvhub.core.solve.probe_r2`): each source layer's own Gram block Cxx[l, l] (Ls, ds, ds), the
cross block Cxy (p, qr), the means and Syy (``KVStats(gram="diagonal")``).  From its probe grids
(Ls, Lt) :func:`kvhub.core.solve.candidate_sources` picks the candidate source layers U: every
target layer's best, then every target's second best, ..., down to ``top_k_max``, at most
``candidates`` layers.  Pass 2 runs the same batches through both models again and accumulates the
full statistics of U's columns only, a :class:`kvhub.core.stats.KVStats` of
``Layout(|U|, ds, Lt, dt)``, and the solve (:func:`kvhub.core.solve.solve`) runs unchanged on them with
k at most ``top_k_max``.  Its source indices are positions in U; :func:`solve_candidates` maps them back
to the model's layers and puts pass 1's probe grids (every source layer) in the solution.

Memory: max(pass 1, pass 2) (:mod:`kvhub.fitting.modes`), since pass 1's statistics are dropped before
pass 2 allocates its own.  When U holds every target layer's best ``top_k_max`` layers and the
one-pass fit's k is at most ``top_k_max`` (with k auto (None): and ``top_k_max`` >= 4, where the coordinate
search of :func:`kvhub.core.solve.solve` starts), the solution is the one-pass solution: a layer's probe
reads the same sums either way (up to how fp32 products round per Gram block: near-ties aside), so each
target layer ranks U's layers as the one-pass fit ranks all of them, and every k the search tries takes
the same layers from the same sums (tests/fitting/test_two_pass.py checks the weights to 1e-10).
"""

from __future__ import annotations

import logging
from typing import Callable

from kvhub.core.solve import TOP_K_GRID, Solution, Structure, candidate_sources, probe_r2, solve
from kvhub.core.stats import KVStats, Layout
from kvhub.fitting.checkpoint import SPLITS, FitState
from kvhub.fitting.modes import StatisticsMode

log = logging.getLogger(__name__)


def run_passes(
    state: FitState | None,
    layout: Layout,
    mode: StatisticsMode,
    *,
    top_k: int | None,
    run: Callable[[FitState, str], None],
    save: Callable[[FitState], None] | None,
    samples: dict | None = None,
) -> FitState:
    """Every pass of ``mode`` from ``state`` (None: the start, with the reservoirs ``samples``, which pass 1
    fills) over ``layout`` (a rank's target layers): ``run(state, label)`` merges a pass's remaining
    batches; ``save(state)`` checkpoints the start of pass 2, so a restarted fit never runs pass 1 again.
    Returns the last pass's state."""
    if state is None:
        gram = "diagonal" if mode.passes == 2 else "full"
        state = FitState({name: KVStats(layout, dtype=mode.torch_dtype, gram=gram) for name in SPLITS}, samples=samples)
    if state.pass_index == 1:
        run(state, "capture" if mode.passes == 1 else "capture pass 1")
        if mode.passes == 1:
            return state
        state = second_pass(state, mode, top_k=top_k)
        if save:
            save(state)
    run(state, "capture pass 2")
    return state


def second_pass(state: FitState, mode: StatisticsMode, *, top_k: int | str) -> FitState:
    """Probe pass 1's statistics, choose the candidates, and return empty pass-2 statistics for them.

    Consumes ``state``: its pass-1 statistics are dropped before pass 2's are allocated.
    """
    train, heldout = state.stats["train"], state.stats["heldout"]
    layout = train.layout
    probe_k, probe_v = probe_r2(train, heldout if heldout.n > 0 else None)
    depth = mode.depth(top_k, TOP_K_GRID, layout.src_layers)
    candidates = candidate_sources(probe_k, probe_v, range(layout.dst_layers), depth=depth, max_layers=mode.candidates)
    log.info("two-pass statistics: pass 2 keeps source layers %s of %d", candidates, layout.src_layers)
    state.stats.clear()
    del train, heldout
    kept = Layout(len(candidates), layout.src_width, layout.dst_layers, layout.dst_width)
    stats = {name: KVStats(kept, dtype=mode.torch_dtype) for name in SPLITS}
    return FitState(stats, pass_index=2, candidates=candidates, probe=(probe_k, probe_v), samples=state.samples)


def solve_candidates(
    state: FitState,
    mode: StatisticsMode,
    *,
    top_k: int | None,
    ridge_lambda: float | None,
    structure: Structure,
    src_layers: int,
    targets: list[int] | None = None,
    progress=None,
) -> Solution:
    """The solve on pass 2's statistics, with source layers numbered as in the model (module docstring);
    ``progress`` as in :func:`kvhub.core.solve.solve`."""
    candidates = state.candidates
    depth = mode.depth(top_k, TOP_K_GRID, src_layers)
    grid = tuple(c for c in TOP_K_GRID if c <= depth)
    train, heldout = state.stats["train"], state.stats["heldout"]
    solution = solve(
        train, heldout, top_k=top_k, ridge_lambda=ridge_lambda, top_k_grid=grid, structure=structure, progress=progress
    )
    for layer in solution.layers:
        layer.sources = [candidates[i] for i in layer.sources]  # ascending: candidates are
    solution.probe_r2_k, solution.probe_r2_v = state.probe
    scope = (
        ""
        if not targets
        else (
            f" for target layer {targets[0]}" if len(targets) == 1 else f" for target layers {targets[0]}-{targets[-1]}"
        )
    )
    solution.notes.append(
        f"two-pass statistics ({mode.dtype}): pass 2 kept source layers "
        f"{','.join(map(str, candidates))} ({len(candidates)} of {src_layers}){scope}; "
        f"k at most {depth}"
    )
    return solution
