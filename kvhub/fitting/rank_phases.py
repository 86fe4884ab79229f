"""Two-phase capture and the layer-outer target on the ranks of a distributed fit (:mod:`kvhub.fitting.distributed`).

:func:`source_captures`: each rank's source, live or spooled (the rank's own batches, its own spool).
:func:`layer_outer`: the target swept layer by layer on every rank over its own batches, each target layer's
statistics kept by the rank that owns it (:func:`kvhub.fitting.ranks.owned_layers`).

Sweep m: every rank runs target layer m over its batches (batch i goes to rank i mod N, as in
:mod:`kvhub.fitting.distributed`), reads the source's rows of those batches from its own spool, and the ranks
all-gather each step's (source K | source V | layer-m K | layer-m V) rows; the owner of layer m merges every
rank's rows in batch order into that layer's cross moments, and in sweep 0 every rank merges them into the
source Gram, which each rank keeps whole.  The merges are the single-process layer-outer fit's, in the same
order, so the statistics (and the mapper) are its own (:mod:`kvhub.fitting.layer_outer`).  One-pass
statistics, no checkpoint between layers yet (a rerun keeps the spools and sweeps again).
"""

from __future__ import annotations

import time

import torch

from kvhub.core.stats import F64, KVStats, Layout
from kvhub.fitting.checkpoint import SPLITS, FitState
from kvhub.fitting.choose import capture_mode
from kvhub.fitting.fit import fit_batches
from kvhub.fitting.layer_outer import _layer_moments, onload_stack, sweep_batch
from kvhub.fitting.options import FitOptions
from kvhub.fitting.phases import source_captures as phase_sources
from kvhub.fitting.ranks import Group, _all_gather_rows, owned_layers
from kvhub.fitting.resident import loaded
from kvhub.progress import Progress, report


def accumulate_layer_outer_sharded(
    source,
    target_model,
    batches: list[tuple[str, torch.Tensor]],
    layout: Layout,
    *,
    group,
    owned: list[int],
    options,
    device,
    dtype: torch.dtype = F64,
    progress: Progress | None = None,
) -> FitState:
    """This rank's statistics over its ``owned`` target layers (layout with those layers), the target on the host
    and one layer at a time on ``device``; ``source`` reads this rank's batches from its spool."""
    body, device = target_model.base_model, torch.device(device)
    embed, rotary = onload_stack(target_model, device)
    mine = range(group.rank, len(batches), group.world)
    hidden = {index: embed(batches[index][1].to(device)).to("cpu") for index in mine}
    local = Layout(layout.src_layers, layout.src_width, len(owned), layout.dst_width)
    stats = {name: KVStats(local, dtype=dtype) for name in SPLITS}
    p, dt = layout.src_layers * layout.src_width, layout.dst_width
    steps = -(-len(batches) // group.world)
    total, done = layout.dst_layers * sum(int(ids.numel()) for _, ids in batches), 0
    for m in range(layout.dst_layers):
        layer = body.layers[m].to(device)
        keeps = m == 0 or m in owned  # sweep 0: every rank's Gram; after it, the owner's cross moments only
        moments = {name: _layer_moments(layout, dtype, gram=m == 0) for name in SPLITS} if keeps else None
        for step in range(steps):
            report(progress, f"target layer {m + 1}/{layout.dst_layers}: step {step + 1}/{steps}", done, total)
            index, rows = step * group.world + group.rank, None
            if index < len(batches):
                rows = _rows(target_model, m, hidden, index, batches[index][1], source, rotary, options, device)
            started = time.perf_counter()
            gathered = _all_gather_rows(group, rows, 2 * p + 2 * dt)
            options.timings["exchange_s"] = options.timings.get("exchange_s", 0.0) + time.perf_counter() - started
            started = time.perf_counter()
            for rank, block in enumerate(gathered):
                if step * group.world + rank >= len(batches):
                    continue
                name, ids = batches[step * group.world + rank]
                done += int(ids.numel())
                if moments is not None:
                    block = block.cpu()
                    moments[name]["k"].update(block[:, :p], block[:, 2 * p : 2 * p + dt])
                    moments[name]["v"].update(block[:, p : 2 * p], block[:, 2 * p + dt :])
            options.timings["stats_s"] = options.timings.get("stats_s", 0.0) + time.perf_counter() - started
        body.layers[m].to("cpu")
        del layer
        if moments is not None:
            for name in SPLITS:
                _place_owned(stats[name], moments[name], owned, m)
    report(progress, "target layers: done", done, total)
    options.timings["tokens"] = options.timings.get("tokens", 0) + sum(int(batches[i][1].numel()) for i in mine)
    return FitState(stats)


def layer_outer(group, source, target_model, layout, options, mode, train_ids, heldout_ids, progress):
    from kvhub.fitting.layer_outer import check_layer_outer

    check_layer_outer(target_model.config, options, mode)
    owned = owned_layers(layout.dst_layers, group.rank, group.world)
    batches = fit_batches(train_ids, heldout_ids, options.batch_size)
    kwargs = dict(group=group, owned=owned, options=options, device=source.device, dtype=mode.torch_dtype)
    state = accumulate_layer_outer_sharded(source, loaded(target_model), batches, layout, progress=progress, **kwargs)
    return state, owned


def source_captures(
    group: Group, source_model, job: str, options: FitOptions, train_ids, heldout_ids, progress, notify
):
    """This rank's source and spool (:func:`kvhub.fitting.phases.source_captures`): the model, or a spool of
    the rank's own batches (batch i goes to rank i mod N)."""
    outer = options.target_layout == "layer-outer"
    phases = "two-phase" if outer else capture_mode(options)
    batches = fit_batches(train_ids, heldout_ids, options.batch_size)
    return phase_sources(
        source_model,
        phases,
        job,
        batches,
        options,
        held=range(group.rank, len(batches), group.world),
        progress=progress,
        notify=notify if group.is_main else (lambda line: None),
    )


def _rows(target_model, m, hidden, index, ids, source, rotary, options, device) -> torch.Tensor:
    """(N, 2p + 2dt) fp32 rows of batch ``index`` for sweep ``m``: source K | V (from the spool), layer m's K | V
    (:func:`kvhub.fitting.layer_outer.sweep_batch`)."""
    k_rows, v_rows = sweep_batch(target_model, m, hidden, index, ids, rotary, options, device)
    src = source.capture(index, ids)
    device = k_rows.device
    return torch.cat([*(b.to(device) for b in src.keys), *(b.to(device) for b in src.values), k_rows, v_rows], 1)


def _place_owned(stats: KVStats, moments: dict, owned: list[int], m: int) -> None:
    """Layer m's moments into ``stats`` (a rank's owned layers): its cross block where this rank owns m; the
    source side (Gram, mean, counts) from sweep 0."""
    for kind in "kv":
        whole, part = getattr(stats, kind), moments[kind]
        if m in owned:
            columns = stats.layout.dst_columns(owned.index(m))
            whole.cxy[:, columns] = part.cxy
            whole.mean_y[columns] = part.mean_y
            whole.syy[columns] = part.syy
        if m == 0:
            whole.cxx.copy_(part.cxx)
            whole.mean_x.copy_(part.mean_x)
            whole.n, whole.weight_sum = part.n, part.weight_sum
