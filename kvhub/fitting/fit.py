"""capture -> statistics -> solve -> Mapper, with progress callbacks and resumable checkpoints.

The statistics take one pass over the calibration sequences, or two when the full statistics do not
fit (:mod:`kvhub.fitting.two_pass`: a probe pass, then a pass over the chosen source layers only);
:func:`statistics_mode` asks the plan (:func:`kvhub.fitting.plan.plan_fit`, the one owner of that
decision) unless the options force a mode.  In each pass every batch runs through the source and the
target model, both captures feed :class:`kvhub.core.stats.KVStats` (train and held-out splits
separately), and the solve (:mod:`kvhub.core.solve`) never touches the models again.  Statistics are
checkpointed atomically every ``checkpoint_every`` batches and when pass 1 ends
(:mod:`kvhub.fitting.checkpoint`); a fit started again with the same checkpoint file and the same job
(models, tokens, stride, ...) continues after the last checkpointed batch of its pass and ends with the
same statistics, hence the same mapper.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Callable

import torch

from kvhub import __version__
from kvhub.artifact import map_prefix, tensor_name
from kvhub.core.capture import capture
from kvhub.core.mapper import Mapper
from kvhub.core.rope import Rotary
from kvhub.core.solve import Solution, Structure, head_groups, solve
from kvhub.core.stats import KVStats, Layout
from kvhub.errors import FitInterrupted
from kvhub.fitting import checkpoint, mlp_fit
from kvhub.fitting.checkpoint import FitState, job_identity
from kvhub.fitting.modes import ONE_PASS, StatisticsMode
from kvhub.fitting.options import DEFAULT_STRIDE, FitOptions

# check_same_tokenizer and pair_fingerprints: re-exported (they live with PreparedFit)
from kvhub.fitting.prepared import PreparedFit, as_prepared, check_same_tokenizer, pair_fingerprints  # noqa: F401
from kvhub.fitting.samples import first_sequence, reservoirs
from kvhub.fitting.choose import capture_mode, statistics_mode
from kvhub.fitting.layer_outer import Sweeps, accumulate_layer_outer, check_layer_outer
from kvhub.fitting.phases import is_feed, source_captures
from kvhub.fitting.resident import device_of, loaded
from kvhub.fitting.two_pass import run_passes, solve_candidates
from kvhub.core.fingerprint import kv_geometry
from kvhub.progress import Progress, report

log = logging.getLogger(__name__)


def with_stride(options: FitOptions) -> FitOptions:
    """``options`` with a stride: the paper's when none was given (:func:`kvhub.fitting.job.prepare` gives the
    calibration recipe's)."""
    return options if options.stride is not None else options.replace(stride=DEFAULT_STRIDE)


def structure_for(source_fp: dict, target_fp: dict, *, head_local: bool, rank: int | None) -> Structure:
    """Map structure of a fit: head groups = gcd of the KV head counts when head-local, else 1."""
    groups = head_groups(source_fp["num_kv_heads"], target_fp["num_kv_heads"]) if head_local else 1
    if head_local and groups == 1:
        log.warning(
            "head-local maps: %s and %s KV heads share no common group; the map stays dense",
            source_fp["num_kv_heads"],
            target_fp["num_kv_heads"],
        )
    return Structure(groups=groups, rank=rank)


def layout_for(source_config, target_config) -> Layout:
    s_layers, s_heads, s_dim = kv_geometry(source_config)
    t_layers, t_heads, t_dim = kv_geometry(target_config)
    return Layout(s_layers, s_heads * s_dim, t_layers, t_heads * t_dim)


def fit(
    job: PreparedFit,
    *args,
    progress: Progress | None = None,
    notify: Callable[[str], None] | None = None,
    **fields,
) -> Mapper:
    """Fit a Mapper from ``job.source``'s cache to ``job.target``'s (:class:`kvhub.fitting.prepared.PreparedFit`:
    models, ids, train (N, T) and held-out (M, T) long token ids without padding, the calibration metadata
    mapper.json keeps, options).  Returns an unsaved Mapper (weights fp32).  ``notify(line)`` hears status
    lines (resuming from a checkpoint); default: the log.  Ctrl-C raises :class:`kvhub.errors.FitInterrupted`,
    which says where the fit stopped and what resumes.

    The older form ``fit(source_model, target_model, train_ids, heldout_ids, source_id=..., target_id=...,
    source_tokenizer=, target_tokenizer=, calibration=, options=)`` still works: it builds the PreparedFit.
    """
    job = as_prepared(job, *args, **fields)
    source_model, target_model, train_ids, heldout_ids = job.source, job.target, job.train, job.heldout
    options = with_stride(job.options)
    mlp_fit.check_options(options, heldout_sequences=0 if heldout_ids is None else int(heldout_ids.shape[0]))
    source_fp, target_fp = job.fingerprints()
    job_key = job_identity(source_fp, target_fp, train_ids, heldout_ids, options)
    mode = statistics_mode(source_model, target_model, train_ids, heldout_ids, options, job=job_key)
    layout = layout_for(source_model.config, target_model.config)
    batches = fit_batches(train_ids, heldout_ids, options.batch_size)
    samples = (
        None
        if options.map_kind == "ridge"
        else reservoirs(
            layout,
            {"train": train_ids, "heldout": heldout_ids},
            capacity=options.mlp_tokens,
            stride=options.stride,
            skip_first=options.skip_first,
        )
    )
    target_layout = options.target_layout if options.target_layout != "auto" else "whole"
    if target_layout == "layer-outer":
        check_layer_outer(target_model.config, options, mode)
    phases = "two-phase" if target_layout == "layer-outer" else capture_mode(options)
    source, spool = source_captures(source_model, phases, job_key, batches, options, progress=progress, notify=notify)
    if target_layout == "layer-outer":
        device = device_of(source_model)  # where the source ran: the target's layers visit it one at a time
        state = accumulate_layer_outer(
            source,
            loaded(target_model),
            batches,
            layout,
            options=options,
            device=device,
            dtype=mode.torch_dtype,
            progress=progress,
            sweeps=Sweeps(spool.directory / "sweeps", job_key, len(batches)) if options.checkpoint else None,
            notify=notify,
        )
    else:
        state = accumulate_passes(
            source,
            loaded(target_model),
            batches,
            layout,
            mode=mode,
            options=options,
            progress=progress,
            job=job_key,
            notify=notify,
            samples=samples,
        )
    structure = structure_for(source_fp, target_fp, head_local=options.head_local, rank=options.rank)
    solution = solve_statistics(
        state, mode, options=options, structure=structure, src_layers=layout.src_layers, progress=progress
    )
    mapper = build_mapper(
        solution,
        source_fp,
        target_fp,
        job.calibration,
        state.stats["train"],
        state.stats["heldout"],
        options,
        statistics=mode,
        capture=phases,
        target_layout=target_layout,
    )
    if spool is not None:
        spool.remove()  # the statistics hold what it was for; the MLPs train on the reservoirs
    if samples is None:
        return mapper
    started = time.perf_counter()
    trained = mlp_fit.train_maps(
        solution,
        state.samples,
        layout,
        options,
        job=job_key,
        progress=progress,
        device=device_of(target_model),
    )
    options.timings["mlp_s"] = time.perf_counter() - started
    return mlp_fit.with_mlps(mapper, trained, state.samples, options)


def accumulate(
    source_model, target_model, train_ids, heldout_ids, *, options: FitOptions, progress: Progress | None, job: str
) -> tuple[KVStats, KVStats]:
    """One pass over both splits; returns the full (train, heldout) statistics.  Resumes from a checkpoint."""
    options = with_stride(options)
    layout = layout_for(source_model.config, target_model.config)
    state = accumulate_passes(
        source_model,
        target_model,
        fit_batches(train_ids, heldout_ids, options.batch_size),
        layout,
        mode=ONE_PASS,
        options=options,
        progress=progress,
        job=job,
    )
    return state.stats["train"], state.stats["heldout"]


def accumulate_passes(
    source_model,
    target_model,
    batches,
    layout: Layout,
    *,
    mode: StatisticsMode,
    options: FitOptions,
    progress: Progress | None,
    job: str,
    notify: Callable[[str], None] | None = None,
    samples: dict | None = None,
) -> FitState:
    """Every pass of ``mode`` over ``batches``, resuming from ``options.checkpoint`` (and saying so to
    ``notify``, default the log); the last pass's state.  ``samples``: reservoirs (kvhub.fitting.samples)
    pass 1 fills, checkpointed with the statistics, and saved once more when the passes end (so a fit
    stopped while its MLPs train resumes without a forward pass)."""
    save = (lambda s: checkpoint.save(options.checkpoint, job, mode, s)) if options.checkpoint else None
    rotaries = (None if is_feed(source_model) else Rotary.from_model(source_model), Rotary.from_model(target_model))

    def run(state: FitState, label: str) -> None:
        run_pass(
            source_model,
            target_model,
            batches,
            state,
            rotaries,
            options=options,
            progress=progress,
            label=label,
            save=save,
        )

    resumed = checkpoint.load(options.checkpoint, job, mode, layout=layout, batches=len(batches), samples=samples)
    if resumed is not None:
        (notify or log.info)(resuming_line(resumed, len(batches), mode))
    state = run_passes(resumed, layout, mode, top_k=options.top_k, run=run, save=save, samples=samples)
    if save and samples is not None:
        save(state)
    return state


def resuming_line(state: FitState, batches: int, mode: StatisticsMode) -> str:
    """``resuming from checkpoint (40/188 batches done)``, naming the pass when there are two."""
    of_pass = f" of pass {state.pass_index}" if mode.passes == 2 else ""
    return f"resuming from checkpoint ({state.batches_done}/{batches} batches done{of_pass})"


def run_pass(
    source_model,
    target_model,
    batches,
    state: FitState,
    rotaries,
    *,
    options: FitOptions,
    progress: Progress | None,
    label: str,
    save,
) -> None:
    """Merge ``batches[state.batches_done:]`` into ``state`` (in pass 2, only the candidates' source
    layers), calling ``save(state)`` every ``options.checkpoint_every`` batches.  Ctrl-C raises
    :class:`FitInterrupted` naming the batch and what the checkpoint holds."""
    total = sum(int(b.numel()) for _, b in batches)
    completed = sum(int(b.numel()) for _, b in batches[: state.batches_done])
    options.timings.setdefault("forward_s", 0.0), options.timings.setdefault("stats_s", 0.0)
    # a checkpoint exists once resumed (batches_done > 0) or at pass 2's start (saved when pass 1 ended)
    saved = state.batches_done if save and (state.batches_done or state.pass_index == 2) else None
    for index in range(state.batches_done, len(batches)):
        name, ids = batches[index]
        try:
            report(progress, f"{label}: {name} batch {index + 1}/{len(batches)}", completed, total)
            captured = _accumulate_batch(
                source_model,
                target_model,
                ids,
                state.stats[name],
                rotaries,
                options,
                sources=state.candidates,
                index=index,
            )
            if state.samples is not None and state.pass_index == 1:
                state.samples[name].add(first_sequence(batches, index), *captured)
        except KeyboardInterrupt as exc:
            raise _interrupted(label, index + 1, len(batches), state.pass_index, saved) from exc
        completed += int(ids.numel())
        state.batches_done = index + 1
        if save and state.batches_done % options.checkpoint_every == 0:
            save(state)
            saved = state.batches_done
    report(progress, f"{label}: done", completed, total)


def _interrupted(label: str, batch: int, batches: int, pass_index: int, saved: int | None) -> FitInterrupted:
    kept = (
        "no checkpoint yet: a rerun starts over"
        if saved is None
        else f"the checkpoint holds {saved} batches of pass {pass_index}"
    )
    return FitInterrupted(
        f"fit interrupted in {label}, batch {batch}/{batches}; {kept}",
        batch=batch,
        batches=batches,
        pass_index=pass_index,
        resume_from=saved,
    )


def solve_statistics(
    state: FitState,
    mode: StatisticsMode,
    *,
    options: FitOptions,
    structure: Structure,
    src_layers: int,
    targets: list[int] | None = None,
    progress: Progress | None = None,
) -> Solution:
    """The solve of the accumulated statistics (pass 2's in a two-pass fit), reported to ``progress`` a
    target layer at a time; its time goes to ``solve_s``."""
    started = time.perf_counter()
    if mode.passes == 1:
        solution = solve(
            state.stats["train"],
            state.stats["heldout"],
            top_k=options.top_k,
            ridge_lambda=options.ridge_lambda,
            structure=structure,
            progress=progress,
        )
    else:
        solution = solve_candidates(
            state,
            mode,
            top_k=options.top_k,
            ridge_lambda=options.ridge_lambda,
            structure=structure,
            src_layers=src_layers,
            targets=targets,
            progress=progress,
        )
    options.timings["solve_s"] = time.perf_counter() - started
    return solution


def _accumulate_batch(
    source_model,
    target_model,
    ids,
    stats: KVStats,
    rotaries,
    options: FitOptions,
    *,
    sources: list[int] | None = None,
    index: int | None = None,
):
    """Merge batch ``index`` (``ids``) into ``stats``; returns its (source, target) captures."""
    src, dst = capture_pair(source_model, target_model, ids, rotaries, options, index=index, layers=sources)
    started = time.perf_counter()
    device = stats.k.cxx.device
    weights = dst.weights.to(device) if dst.weights is not None else None
    keep = range(len(src.keys)) if sources is None else sources
    stats.update(
        [src.keys[l].to(device) for l in keep],
        [src.values[l].to(device) for l in keep],
        [b.to(device) for b in dst.keys],
        [b.to(device) for b in dst.values],
        weights=weights,
    )
    options.timings["stats_s"] += time.perf_counter() - started
    return src, dst


def fit_batches(train_ids, heldout_ids, batch_size: int) -> list[tuple[str, torch.Tensor]]:
    """The fit's batches, in the order their statistics are merged: (split name, (B, T) ids), train first."""
    splits = [("train", train_ids), ("heldout", heldout_ids if heldout_ids is not None else train_ids[:0])]
    return [(name, ids[i : i + batch_size]) for name, ids in splits for i in range(0, ids.shape[0], batch_size)]


def capture_pair(
    source_model, target_model, ids, rotaries, options: FitOptions, *, index: int | None = None, layers=None
):
    """Both models' captures of one batch of ids: (source CapturedKV, target CapturedKV with row weights
    when weighting by attention).  ``source_model``: the model, or a feed of captures by batch ``index``
    (:mod:`kvhub.fitting.phases`; ``layers``: the source layers the statistics read, None: all).  Adds the
    forward time and tokens to ``options.timings``."""
    started = time.perf_counter()
    kwargs = {"stride": options.stride, "skip_first": options.skip_first}
    if is_feed(source_model):
        src = source_model.capture(index, ids, layers)
    else:
        src = capture(source_model, ids, rotary=rotaries[0], **kwargs)
    dst = capture(
        target_model,
        ids,
        rotary=rotaries[1],
        attention_weights=_attention_weighted(options),
        weight_cap=options.weight_cap,
        **kwargs,
    )
    timings = options.timings
    timings["forward_s"] = timings.get("forward_s", 0.0) + time.perf_counter() - started
    timings["tokens"] = timings.get("tokens", 0) + int(ids.numel())
    return src, dst


def _attention_weighted(options: FitOptions) -> bool:
    return options.weighting == "attention"  # FitOptions refused any other than "uniform"


# ---- the mapper -------------------------------------------------------------------------------
def target_means(train: KVStats) -> dict[str, torch.Tensor]:
    """``{k,v}.{m}.target_mean`` (Ht*Dt,) fp32: the calibration mean of target layer m's RoPE-stripped
    keys and of its values.  A cache of these constants is the no-information control of an evaluation
    (:mod:`kvhub.core.control`): what a handoff scores above it is what the mapped context contributes."""
    out = {}
    for kind, moments in (("k", train.k), ("v", train.v)):
        for m in range(train.layout.dst_layers):
            out[tensor_name(map_prefix(kind, m), "target_mean")] = (
                moments.mean_y[train.layout.dst_columns(m)].float().clone()
            )
    return out


def build_mapper(
    solution: Solution,
    source_fp: dict,
    target_fp: dict,
    calibration: dict,
    train: KVStats,
    heldout: KVStats,
    options: FitOptions,
    *,
    statistics: StatisticsMode = ONE_PASS,
    capture: str = "one-phase",
    target_layout: str = "whole",
) -> Mapper:
    """Weights (fp32) and mapper.json metadata from a solution; ``statistics``: how they were accumulated
    (recorded under ``fit``, which kvhub does not read back)."""
    tensors = {}
    for layer in solution.layers:
        tensors.update(layer.k_map.tensors(map_prefix("k", layer.target)))
        tensors.update(layer.v_map.tensors(map_prefix("v", layer.target)))
    tensors.update(target_means(train))
    r2_k, r2_v = solution.mean_r2()
    metrics = {"train_tokens": train.n, "heldout_tokens": heldout.n}
    if r2_k is not None:
        metrics.update(
            {
                "heldout_r2_k_mean": r2_k,
                "heldout_r2_v_mean": r2_v,
                "heldout_r2_k_min": min(l.r2_k for l in solution.layers),
                "heldout_r2_v_min": min(l.r2_v for l in solution.layers),
            }
        )
    metadata = {
        "kvhub_version": __version__,
        "kind": "ridge",
        "source": source_fp,
        "target": target_fp,
        "k": solution.top_k,
        "lambda": solution.ridge_lambda,
        "chosen_by": solution.chosen_by,
        "structure": {"head_groups": solution.structure.groups, "rank": solution.structure.rank},
        "notes": solution.notes,
        "layers": [layer.to_metadata() for layer in solution.layers],
        "probe_r2": {"k": solution.probe_r2_k.tolist(), "v": solution.probe_r2_v.tolist()},
        "calibration": calibration,
        "fit": {
            **options.fit_block(),
            "statistics": dataclasses.asdict(statistics),
            "capture": capture,
            "target_layout": target_layout,
            "timings": {k: round(v, 3) if isinstance(v, float) else v for k, v in options.timings.items()},
        },
        "metrics": metrics,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return Mapper(tensors, json.loads(json.dumps(metadata, default=str)))
