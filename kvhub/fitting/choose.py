"""How a fit runs: its statistics mode (one pass or two, :mod:`kvhub.fitting.two_pass`) and its capture (one
phase or two, :mod:`kvhub.fitting.phases`), from the options, the fit's checkpoint and the plan
(:func:`kvhub.fitting.plan.plan_fit`, the one owner of what fits)."""

from __future__ import annotations

import logging

from kvhub.dtypes import dtype_name
from kvhub.errors import ConfigError
from kvhub.fitting import checkpoint
from kvhub.fitting.modes import ONE_PASS, StatisticsMode
from kvhub.fitting.options import FitOptions
from kvhub.fitting.resident import device_of, loaded_bytes

log = logging.getLogger(__name__)


def statistics_mode(
    source_model, target_model, train_ids, heldout_ids, options: FitOptions, *, job: str, ranks: int = 1
) -> StatisticsMode:
    """How this fit accumulates its statistics: the mode of its checkpoint when it resumes one the options
    allow; else the options' StatisticsMode; else the plan's choice for "auto", "one-pass" or "two-pass"
    (:func:`kvhub.fitting.plan.plan_fit` against the memory free now plus the loaded models)."""
    requested = options.statistics  # FitOptions refused a mode that is none, and candidates beside one-pass
    saved = checkpoint.saved_mode(options.checkpoint, job)
    if saved is not None and _allows(requested, options.candidates, saved):
        return saved
    if isinstance(requested, StatisticsMode):
        return requested
    return _planned_mode(source_model, target_model, train_ids, heldout_ids, options, ranks=ranks)


def _allows(requested, candidates: int | None, saved: StatisticsMode) -> bool:
    """Whether a checkpoint written in ``saved`` mode may be resumed by a fit asking for ``requested``."""
    if isinstance(requested, StatisticsMode):
        return requested == saved
    if candidates is not None and saved.candidates != candidates:
        return False
    return requested == "auto" or (saved.passes == 2) == (requested == "two-pass")


def _planned_mode(
    source_model, target_model, train_ids, heldout_ids, options: FitOptions, *, ranks: int
) -> StatisticsMode:
    from kvhub.fitting.plan import DTYPE_BYTES, ModelShape, Workload, machine_profile, plan_fit

    try:
        shapes = [ModelShape.from_config(model.config.to_dict()) for model in (source_model, target_model)]
    except ConfigError as exc:  # a config the plan cannot read: no memory estimate to decide on
        log.info("no plan for these models (%s); statistics as asked, without a candidate budget", exc)
        two = options.statistics == "two-pass" or options.candidates is not None
        return StatisticsMode(passes=2, candidates=options.candidates) if two else ONE_PASS
    dtype = dtype_name(source_model.dtype)
    workload = Workload(
        samples=train_ids.shape[0],
        heldout=0 if heldout_ids is None else heldout_ids.shape[0],
        seq_len=train_ids.shape[1],
        stride=options.stride,
        batch_size=options.batch_size,
        k=options.top_k,
        mlp_tokens=0 if options.map_kind == "ridge" else options.mlp_tokens,
        dtype=dtype if dtype in DTYPE_BYTES else "float32",
    )
    device = str(device_of(source_model))
    loaded = loaded_bytes(source_model) + loaded_bytes(target_model)
    profile = machine_profile(device, loaded=loaded * (1 if device.startswith("cuda") else ranks))
    plan = plan_fit(
        *shapes, workload, profile, ranks=ranks, statistics=options.statistics, candidates=options.candidates
    )
    log.info("statistics: %s (%s)", plan.statistics.describe(), plan.advice)
    return plan.statistics


def capture_mode(options: FitOptions) -> str:
    """ "one-phase" or "two-phase": what ``options.capture`` asks; "auto" takes one phase (both models
    resident) unless the plan chose two phases before the models loaded (``kvhub fit`` asks it)."""
    return "two-phase" if options.capture == "two-phase" else "one-phase"
