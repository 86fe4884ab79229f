"""The fit on R processes with torch.distributed (gloo on CPU, NCCL on GPUs), sharded by target layer.

Capture is data-parallel: the fit's batches (:func:`kvhub.fitting.fit.fit_batches`, the single-process order)
are dealt round-robin, batch ``step * R + r`` to rank r.  After each step the ranks all-gather the
step's captured rows (source K/V, target K/V, row weights; fp32), and every rank Chan-merges the R
batches in batch order into its statistics, which keep the source Gram and only its own target
layers' cross blocks (:func:`owned_layers`: contiguous blocks).  So each rank makes the single
process's merges, in its order, restricted to its target columns (equal up to how the GEMM rounds a
column subset): no reduction of statistics is needed, and no rank ever holds the full (p, q) cross block.  Each rank
then solves its target layers (:func:`kvhub.core.solve.solve` on its restricted statistics: a target
layer's probe, selection and ridge read only its own columns), and rank 0 gathers the layer
solutions, assembles the Mapper and is the only one to save or register it.

Rows exchanged per rank: (R-1)/R of all statistics rows * (2p + 2q) * 4 bytes (:mod:`kvhub.fitting.plan`).

Two-pass statistics (:mod:`kvhub.fitting.two_pass`) run the same step loop twice: in pass 1 each rank
keeps the diagonal Gram blocks and its cross blocks, probes its own target layers and chooses their
candidate source layers (each rank its own set); in pass 2 it keeps only those source layers' columns.
Rank 0 decides the statistics mode (:func:`kvhub.fitting.fit.statistics_mode`) and every rank takes it.

Checkpoints are per rank (``<checkpoint>.rank<r>-of-<R>``), written after the same steps on every
rank, with the previous generation kept; a restarted job (torchrun restarts every rank) resumes from
the latest (pass, step) every rank has and reads (:mod:`kvhub.fitting.checkpoint` checks each), so a rank
killed mid-write, or a damaged latest generation, costs one checkpoint interval.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from datetime import timedelta
from pathlib import Path

import torch

from kvhub.core.rope import Rotary
from kvhub.core.solve import Solution
from kvhub.core.stats import KVStats, Layout, Moments
from kvhub.fitting import checkpoint as checkpoints
from kvhub.fitting.checkpoint import FitState, job_identity
from kvhub.fitting.fit import (
    build_mapper,
    capture_pair,
    fit_batches,
    layout_for,
    resuming_line,
    solve_statistics,
    statistics_mode,
    structure_for,
    with_stride,
)
from kvhub.fitting.choose import capture_mode
from kvhub.fitting.mlp_fit import check_options
from kvhub.fitting.rank_phases import layer_outer, source_captures
from kvhub.fitting.ranks import Group, _all_gather_rows, owned_layers
from kvhub.fitting.phases import is_feed
from kvhub.fitting.resident import loaded
from kvhub.fitting.options import FitOptions
from kvhub.fitting.prepared import PreparedFit, as_prepared
from kvhub.fitting.modes import ONE_PASS, StatisticsMode
from kvhub.fitting.two_pass import run_passes
from kvhub.progress import Progress, report

log = logging.getLogger(__name__)


LAUNCHER = "KVHUB_FIT_LAUNCHER"  # pid of the `kvhub fit --distributed` whose torchrun started this rank


def die_with_launcher() -> None:
    """Have the kernel SIGTERM this rank when its parent (torchrun) dies, even by SIGKILL (Linux; nothing
    elsewhere).  ``kvhub fit --distributed`` ties torchrun to itself the same way and names itself in
    ``$KVHUB_FIT_LAUNCHER``: a rank whose torchrun or launcher died before this call exits at once."""
    from kvhub.env import die_with_parent

    hook = die_with_parent()
    if hook is None:
        return
    hook()
    launcher = os.environ.get(LAUNCHER)
    if launcher and _grandparent() != int(launcher):
        raise SystemExit(f"kvhub fit --distributed (pid {launcher}) is gone; this rank stops")


def _grandparent() -> int | None:
    """The parent's parent pid (None when the parent is gone), from /proc/PID/stat: 'pid (name) state ppid ...'."""
    try:
        stat = Path(f"/proc/{os.getppid()}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


def launched() -> bool:
    """True inside a job started by torchrun (or anything that sets WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_group(device: str | None = None) -> Group:
    """Join the torchrun job (env:// rendezvous): NCCL when ``device`` is CUDA, else gloo.

    On CUDA each rank takes ``cuda:LOCAL_RANK``.  ``$KVHUB_DIST_TIMEOUT`` (seconds, default 1800)
    bounds how long a rank waits for the others, e.g. for one that died.
    """
    import torch.distributed as dist

    cuda = str(device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if cuda:
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(where)
    else:
        where = torch.device("cpu")
    if not dist.is_initialized():
        timeout = timedelta(seconds=float(os.environ.get("KVHUB_DIST_TIMEOUT", "1800")))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    return Group(dist.get_rank(), dist.get_world_size(), where)


def fit_distributed(
    job: PreparedFit,
    *args,
    group: Group,
    progress: Progress | None = None,
    notify=None,
    **fields,
):
    """:func:`kvhub.fitting.fit.fit` on ``group.world`` ranks (module docstring).  Every rank passes the same
    :class:`kvhub.fitting.prepared.PreparedFit` (token ids and options; or fit's older arguments, which build
    one); returns the Mapper on rank 0 and None on the others.  ``notify(line)``: rank 0's status lines
    (resuming from a checkpoint); default: the log."""
    job = as_prepared(job, *args, **fields)
    source_model, target_model, train_ids, heldout_ids = job.source, job.target, job.train, job.heldout
    options = with_stride(job.options)
    check_options(options, heldout_sequences=1, distributed=True)  # --map mlp: one process only
    source_fp, target_fp = job.fingerprints()
    job_key = job_identity(source_fp, target_fp, train_ids, heldout_ids, options, rank=group.rank, world=group.world)
    mode = _agreed_mode(group, source_model, target_model, train_ids, heldout_ids, options, job_key)
    source, spool = source_captures(group, source_model, job_key, options, train_ids, heldout_ids, progress, notify)
    layout = layout_for(source_model.config, target_model.config)
    if options.target_layout == "layer-outer":  # the spool is there: source_captures takes two phases
        state, owned = layer_outer(group, source, target_model, layout, options, mode, train_ids, heldout_ids, progress)
    else:
        state, owned = accumulate_sharded(
            source,
            loaded(target_model),
            train_ids,
            heldout_ids,
            group=group,
            options=options,
            progress=progress,
            job=job_key,
            mode=mode,
            notify=notify,
        )
    structure = structure_for(source_fp, target_fp, head_local=options.head_local, rank=options.rank)
    part = solve_statistics(
        state,
        mode,
        options=options,
        structure=structure,
        src_layers=layout.src_layers,
        targets=owned,
        progress=progress,
    )
    if spool is not None:
        spool.remove()  # this rank's statistics hold what it was for
    for layer in part.layers:
        layer.target = owned[layer.target]
    train, heldout = state.stats["train"], state.stats["heldout"]
    parts = _gather_to_main(group, (part, _target_means(train), options.timings))
    if not group.is_main:
        return None
    solution = _assemble([p for p, _, _ in parts])
    means = [torch.cat([m[kind] for _, m, _ in parts]) for kind in ("k", "v")]
    options.timings["ranks"] = group.world
    for key in ("forward_s", "stats_s", "exchange_s", "solve_s"):  # the ranks run in parallel
        options.timings[key] = max(t.get(key, 0.0) for _, _, t in parts)
    options.timings["tokens"] = sum(t.get("tokens", 0) for _, _, t in parts)
    summary = _means_only(layout, means, train, heldout)
    outer = options.target_layout == "layer-outer"
    return build_mapper(
        solution,
        source_fp,
        target_fp,
        job.calibration,
        summary,
        heldout,
        options,
        statistics=mode,
        capture="two-phase" if outer else capture_mode(options),
        target_layout="layer-outer" if outer else "whole",
    )


def _agreed_mode(
    group: Group, source_model, target_model, train_ids, heldout_ids, options: FitOptions, job: str
) -> StatisticsMode:
    """Rank 0's :func:`kvhub.fitting.fit.statistics_mode` (read against its latest checkpoint generation
    whose header reads), on every rank."""
    import torch.distributed as dist

    chosen = [None]
    if group.is_main:
        generations = _rank_paths(group, options.checkpoint) if options.checkpoint else (None,)
        readable = [path for path in generations if checkpoints.saved_mode(path, job) is not None]
        chosen[0] = statistics_mode(
            source_model,
            target_model,
            train_ids,
            heldout_ids,
            dataclasses.replace(options, checkpoint=(readable or [None])[0]),
            job=job,
            ranks=group.world,
        )
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def accumulate_sharded(
    source_model,
    target_model,
    train_ids,
    heldout_ids,
    *,
    group: Group,
    options: FitOptions,
    progress: Progress | None,
    job: str,
    mode: StatisticsMode = ONE_PASS,
    notify=None,
) -> tuple[FitState, list[int]]:
    """This rank's statistics over its owned target layers (after every pass of ``mode``), and those layers."""
    layout = layout_for(source_model.config, target_model.config)
    owned = owned_layers(layout.dst_layers, group.rank, group.world)
    local = Layout(layout.src_layers, layout.src_width, len(owned), layout.dst_width)
    columns = torch.cat([torch.arange(m * layout.dst_width, (m + 1) * layout.dst_width) for m in owned])
    batches = fit_batches(train_ids, heldout_ids, options.batch_size)
    save = (lambda s: _save_generation(group, options.checkpoint, job, mode, s)) if options.checkpoint else None
    rotaries = (None if is_feed(source_model) else Rotary.from_model(source_model), Rotary.from_model(target_model))
    for key in ("forward_s", "stats_s", "exchange_s"):
        options.timings.setdefault(key, 0.0)

    def run(state: FitState, label: str) -> None:
        _run_steps(
            source_model,
            target_model,
            batches,
            state,
            layout,
            columns,
            rotaries,
            group=group,
            options=options,
            progress=progress,
            label=label,
            save=save,
        )

    steps = -(-len(batches) // group.world)
    resumed = _resume(group, options.checkpoint, job, mode, layout=local, steps=steps)
    if resumed is not None and group.is_main:
        (notify or log.info)(resuming_line(resumed, steps, mode).replace(" batches ", " steps "))
    state = run_passes(resumed, local, mode, top_k=options.top_k, run=run, save=save)
    return state, owned


def _run_steps(
    source_model,
    target_model,
    batches,
    state: FitState,
    layout: Layout,
    columns: torch.Tensor,
    rotaries,
    *,
    group: Group,
    options: FitOptions,
    progress: Progress | None,
    label: str,
    save,
) -> None:
    """The steps of one pass after ``state.batches_done``: capture this rank's batch, all-gather every
    rank's rows, merge them in batch order (source columns of ``state.candidates`` only, when set)."""
    steps = -(-len(batches) // group.world)
    total = sum(int(b.numel()) for _, b in batches)
    completed = sum(int(b.numel()) for _, b in batches[: state.batches_done * group.world])
    timings = options.timings
    width = (layout.src_layers * layout.src_width, layout.dst_layers * layout.dst_width)
    sources = None if state.candidates is None else layout.src_columns(state.candidates)
    for step in range(state.batches_done, steps):
        report(progress, f"{label}: step {step + 1}/{steps}", completed, total)
        index = step * group.world + group.rank
        rows = None
        if index < len(batches):
            src, dst = capture_pair(source_model, target_model, batches[index][1], rotaries, options, index=index)
            rows = _pack(src, dst)
        started = time.perf_counter()
        gathered = _all_gather_rows(group, rows, 2 * sum(width) + 1)
        timings["exchange_s"] += time.perf_counter() - started
        started = time.perf_counter()
        for rank, block in enumerate(gathered):
            if step * group.world + rank < len(batches):
                name, ids = batches[step * group.world + rank]
                _update(state.stats[name], block, width, columns, sources, weighted=options.weighting == "attention")
                completed += int(ids.numel())
        timings["stats_s"] += time.perf_counter() - started
        state.batches_done = step + 1
        if save and state.batches_done % options.checkpoint_every == 0:
            save(state)
    report(progress, f"{label}: done", completed, total)


# ---- the exchange --------------------------------------------------------------------------------
def _pack(src, dst) -> torch.Tensor:
    """(N, 2p + 2q + 1) fp32 rows: source K | source V | target K | target V | row weight (1 if none)."""
    weights = dst.weights if dst.weights is not None else torch.ones(src.tokens, device=src.keys[0].device)
    return torch.cat([*src.keys, *src.values, *dst.keys, *dst.values, weights[:, None].float()], dim=1)


def _update(
    stats: KVStats,
    rows: torch.Tensor,
    width: tuple[int, int],
    columns: torch.Tensor,
    sources: torch.Tensor | None,
    *,
    weighted: bool,
) -> None:
    """Merge gathered rows into ``stats``: the owned target ``columns`` and the ``sources`` columns of X
    (None: all)."""
    p, q = width
    rows = rows.cpu() if stats.k.cxx.device.type == "cpu" else rows
    source_k, source_v = rows[:, :p], rows[:, p : 2 * p]  # (N, p)
    if sources is not None:
        source_k, source_v = source_k[:, sources], source_v[:, sources]  # (N, |U| * ds)
    target_k, target_v = rows[:, 2 * p : 2 * p + q], rows[:, 2 * p + q : 2 * p + 2 * q]  # (N, q)
    weights = rows[:, -1] if weighted else None
    stats.update([source_k], [source_v], [target_k[:, columns]], [target_v[:, columns]], weights=weights)


# ---- checkpoints ---------------------------------------------------------------------------------
def _rank_paths(group: Group, checkpoint: Path) -> tuple[Path, Path]:
    base = Path(checkpoint)
    current = base.with_name(f"{base.stem}.rank{group.rank}-of-{group.world}{base.suffix}")
    return current, current.with_name(current.stem + ".prev" + current.suffix)


def _save_generation(group: Group, checkpoint: Path, job: str, mode: StatisticsMode, state: FitState) -> None:
    """Write this rank's checkpoint, keeping the previous one, then wait for every rank to have written."""
    import torch.distributed as dist

    current, previous = _rank_paths(group, checkpoint)
    if current.is_file():
        os.replace(current, previous)
    checkpoints.save(current, job, mode, state)
    dist.barrier()


def _resume(
    group: Group, checkpoint: Path | None, job: str, mode: StatisticsMode, *, layout: Layout, steps: int
) -> FitState | None:
    """The latest checkpoint generation every rank has and reads (None: start over), by (pass, step).

    ``layout``: this rank's statistics in pass 1; ``steps``: the steps of a pass.  Headers are read first,
    so only the agreed generation is loaded; when that fails to load on some rank (damaged tensors: a
    warning says what), every rank drops it and the generations after it, and the ranks agree again."""
    if checkpoint is None:
        return None
    found, then = {}, "resuming from an older generation every rank reads, if any"
    for path in _rank_paths(group, checkpoint):
        header = checkpoints.read_header(path, job, mode, layout=layout, batches=steps, then=then)
        if header is not None:
            found.setdefault(header.position, path)
    while True:
        agreed = _smallest(group, max(found, default=0))
        if agreed == 0:
            return None
        state = None
        if agreed in found:
            state = checkpoints.load(found[agreed], job, mode, layout=layout, batches=steps, then=then)
        if _smallest(group, int(state is not None)):
            log.info("rank %d resumes in pass %d after step %d", group.rank, state.pass_index, state.batches_done)
            return state
        found = {at: path for at, path in found.items() if at < agreed}


def _smallest(group: Group, value: int) -> int:
    """The smallest of every rank's ``value``."""
    import torch.distributed as dist

    smallest = torch.tensor([value], dtype=torch.int64, device=group.device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return int(smallest)


def remove_checkpoints(group: Group, checkpoint: Path | None) -> None:
    for path in _rank_paths(group, checkpoint) if checkpoint else ():
        checkpoints.discard(path)


# ---- assembling on rank 0 ------------------------------------------------------------------------
def _gather_to_main(group: Group, payload) -> list | None:
    import torch.distributed as dist

    out = [None] * group.world if group.is_main else None
    dist.gather_object(payload, out, dst=0)
    return out


def _target_means(train: KVStats) -> dict[str, torch.Tensor]:
    return {"k": train.k.mean_y.cpu(), "v": train.v.mean_y.cpu()}


def _assemble(parts: list[Solution]) -> Solution:
    """One Solution from the ranks' (owned layers in rank order, probe columns likewise)."""
    first = parts[0]
    notes = list(dict.fromkeys(note for part in parts for note in part.notes))
    chosen_by = "held-out R^2" if any(p.chosen_by == "held-out R^2" for p in parts) else first.chosen_by
    return Solution(
        [layer for part in parts for layer in part.layers],
        torch.cat([p.probe_r2_k for p in parts], dim=1),
        torch.cat([p.probe_r2_v for p in parts], dim=1),
        first.top_k,
        first.ridge_lambda,
        chosen_by,
        notes,
        first.structure,
    )


def _means_only(layout: Layout, means: list[torch.Tensor], train: KVStats, heldout: KVStats) -> KVStats:
    """Statistics of the full layout carrying only what :func:`kvhub.fitting.fit.build_mapper` reads from them:
    the row counts and the target means (every target layer), no Gram or cross blocks."""
    out = KVStats.__new__(KVStats)
    out.layout = layout
    for kind, mean_y, moments in (("k", means[0], train.k), ("v", means[1], train.v)):
        summary = Moments(0, 0)
        summary.n, summary.weight_sum, summary.mean_y = moments.n, moments.weight_sum, mean_y
        setattr(out, kind, summary)
    return out
