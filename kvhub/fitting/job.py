"""Fit by model names: resolve both models and the calibration set, then fit (one process or many).

:func:`check_request` refuses, before any model loads, what a :class:`FitRequest` (what ``kvhub fit`` takes)
alone shows will fail; :func:`prepare` turns it into a :class:`kvhub.fitting.prepared.PreparedFit` (loaded
models, calibration tokens, options and a checkpoint path); :func:`fit_by_names` runs both, then the whole
fit in this process.  :mod:`kvhub.fitting.distributed` and the benchmarks start from the same :func:`prepare`, so
every entry point fits the same job from the same arguments.

The library never prints: ``notify(message)`` receives the status lines, and ``progress(unit)``
returns a context manager yielding a ``(description, completed, total)`` callback (or None).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

import torch

from kvhub.artifact import json_sha256
from kvhub.calib.recipe import DEFAULT_CALIBRATION
from kvhub.fitting.options import FitOptions
from kvhub.fitting.prepared import PreparedFit  # re-exported: prepare() returns it

log = logging.getLogger(__name__)

Notify = Callable[[str], None]
ProgressFactory = Callable[[str], ContextManager]


@dataclass
class FitRequest:
    """What ``kvhub fit`` asks for: the models, the calibration set, the series name it is filed under
    (``name``; None: the calibration set's own), where the forward passes run, and the fit's knobs
    (:class:`kvhub.fitting.options.FitOptions`; its stride None: the calibration recipe's)."""

    src: str
    dst: str
    calib: str = DEFAULT_CALIBRATION
    name: str | None = None
    samples: int | None = None
    seq_len: int | None = None
    seed: int | None = None
    device: str | None = None
    dtype: str = "bfloat16"
    restart: bool = False
    options: FitOptions = field(default_factory=FitOptions)


def __getattr__(name: str):
    if name == "check_device":  # one device check: kvhub.dtypes owns it
        import warnings

        from kvhub.dtypes import check_device

        warnings.warn(
            "kvhub.fitting.job.check_device is replaced by kvhub.dtypes.check_device (check_request refuses a "
            "request's device)",
            DeprecationWarning,
            stacklevel=2,
        )
        return check_device
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_request(request: FitRequest, *, store=None) -> None:
    """Refuse, before any model loads, what the request alone shows will fail (:func:`fit_by_names` runs it
    first, and ``kvhub fit`` before it starts torchrun): a device torch cannot use (a ``kvhub plan --device``
    profile named as one), an unknown calibration set (with the closest built-in name), a series name that
    cannot be quoted or that is a built-in set's name over another text, a fixed k above the source's layer
    count, and fewer observations than features (read from the config, no weights: the solve would refuse
    them only after every forward pass).  With ``store`` (an open :class:`kvhub.store.Store` the mapper will
    be registered in), also a series there fitted on another text, which the store would refuse after the
    fit; its documents are read here only when that series exists."""
    from kvhub.errors import ConfigError, FitError
    from kvhub.fitting.plan import Workload, shape_of, too_few_observations

    _check_device(request.device)
    sequences = _sequences(request)
    if request.name is not None:
        _check_series_name(request.name, calib=request.calib)
    if store is not None:
        _check_series_text(request, store)
    fixed_k = request.options.top_k  # FitOptions refused a k below 1 and --candidates beside one pass
    try:
        source = shape_of(request.src)
    except ConfigError:  # no config without downloading: the fit checks these once the model is there
        return
    if fixed_k is not None and fixed_k > source.layers:
        raise ConfigError(
            f"--k {fixed_k} is more source layers than {request.src} has ({source.layers}); use "
            f"--k 1..{source.layers} or --k auto"
        )
    workload = Workload(
        samples=sequences.samples,
        seq_len=sequences.seq_len,
        stride=request.options.stride or sequences.stride,
        k=fixed_k,
    )
    problem = too_few_observations(source, workload)
    if problem is not None:
        raise FitError(f"{request.src} -> {request.dst}: {problem}")


def _check_device(device: str | None) -> None:
    """:func:`kvhub.dtypes.check_device`, saying what a ``kvhub plan`` profile name (h100, ...) is."""
    from kvhub.dtypes import check_device
    from kvhub.errors import ConfigError
    from kvhub.fitting.plan import DEVICES

    if device is not None and str(device).lower() in DEVICES:
        raise ConfigError(
            f"--device {device!r} is not a torch device but a profile of `kvhub plan --device`; run on cpu, "
            "cuda or cuda:N"
        )
    check_device(device, what="--device")


def _sequences(request: FitRequest):
    """The request's calibration sequences (sizes only); an unknown set is refused with the closest name."""
    import difflib

    from kvhub.calib.recipe import recipe_from_spec
    from kvhub.errors import UnknownCalibrationError

    try:
        recipe = recipe_from_spec(request.calib)
    except UnknownCalibrationError as exc:
        close = difflib.get_close_matches(exc.name, exc.known, n=1, cutoff=0.6)
        if not close:
            raise
        raise UnknownCalibrationError(
            f"unknown calibration set {exc.name!r}: did you mean {close[0]!r}? ({exc})", name=exc.name, known=exc.known
        ) from None
    return recipe.with_sequences(samples=request.samples, seq_len=request.seq_len, seed=request.seed).sequences


def _check_series_name(name: str, *, calib: str) -> None:
    """A valid calibration name, and not a built-in set's name for another text (kvhub.load(...,
    calib="legal-docs") would return this mapper, and a push would publish it as legal-docs)."""
    from kvhub.calib.recipe import builtin_names, recipe_from_spec
    from kvhub.errors import ConfigError
    from kvhub.store.refs import check_calibration_name  # the one spelling rule of a series name (torch-free)

    check_calibration_name(name)
    if name in builtin_names() and recipe_from_spec(calib).name != name:
        raise ConfigError(
            f"--name {name} is the name of kvhub's built-in calibration set {name!r}, and --calib "
            f"{calib} is another text; give this one its own name, e.g. --name {name}-own"
        )


def _check_series_text(request: FitRequest, store) -> None:
    """The series (models, calibration name) in ``store`` holds no version fitted on another text.  The
    text's sha256 needs the documents only, read here once more, and only when the series exists."""
    from kvhub.calib.calibration_set import read_documents
    from kvhub.calib.packing import corpus_digest
    from kvhub.calib.recipe import recipe_from_spec
    from kvhub.errors import ConfigError
    from kvhub.models.loading import registered_model_id

    recipe = recipe_from_spec(request.calib)
    series = {
        "source": registered_model_id(request.src),
        "target": registered_model_id(request.dst),
        "calibration": request.name or recipe.name,
    }
    try:  # a hash no text has: refused iff the series holds versions with a known text
        store.check_calibration_text(**series, text_sha256="-")
        return
    except ConfigError:
        pass
    documents, _ = read_documents(recipe)
    store.check_calibration_text(**series, text_sha256=corpus_digest(documents))


def _no_progress(unit: str) -> ContextManager:
    return nullcontext(None)


def prepare(
    request: FitRequest, *, notify: Notify | None = None, progress: ProgressFactory | None = None, ranks: int = 1
) -> PreparedFit:
    """Load both models (checking they share a tokenizer) and the calibration set; build the options."""
    from kvhub.calib import resolve_calibration
    from kvhub.core.fingerprint import tokenizer_hash
    from kvhub.fitting.checkpoint import sweep_temporaries
    from kvhub.fitting.fit import check_same_tokenizer
    from kvhub.fitting.resident import lazy_model
    from kvhub.models.loading import load_model

    notify = notify or log.info
    progress = progress or _no_progress
    capture, target_layout = _placement(request, ranks)
    if capture == "two-phase":  # one model resident at a time: the target loads once the source is done
        notify(f"loading {request.src} (then {request.dst}, once the source's captures are spooled)")
        source, source_tok, source_id = lazy_model(request.src, device=request.device, dtype=request.dtype)
        on = "cpu" if target_layout == "layer-outer" else request.device  # layer-outer: weights wait on the host
        target, target_tok, target_id = lazy_model(request.dst, device=on, dtype=request.dtype)
    else:
        notify(f"loading {request.src} and {request.dst}")
        source, source_tok, source_id = load_model(request.src, device=request.device, dtype=request.dtype)
        target, target_tok, target_id = load_model(request.dst, device=request.device, dtype=request.dtype)
    check_same_tokenizer(
        {"model_id": source_id, "tokenizer_hash": tokenizer_hash(source_tok)},
        {"model_id": target_id, "tokenizer_hash": tokenizer_hash(target_tok)},
    )
    with progress("items") as callback:
        calibration = resolve_calibration(
            request.calib,
            tokenizer=source_tok,
            tokenizer_id=source_id,
            samples=request.samples,
            seq_len=request.seq_len,
            seed=request.seed,
            progress=callback,
        )
    stride = request.options.stride or calibration.stride
    meta = calibration.to_metadata()
    meta["stride"] = stride
    options = request.options.replace(
        stride=stride,
        capture=capture,
        target_layout=target_layout,
        checkpoint=checkpoint_path(
            source_id, target_id, meta, stride, request.options.batch_size, request.options.weighting
        ),
    )
    sweep_temporaries(options.checkpoint.parent)  # what fits killed mid-save left
    notify(
        calibration_line(
            meta,
            train=calibration.train.shape[0],
            heldout=calibration.heldout.shape[0],
            tokens=calibration.train.shape[1],
            stride=stride,
            series=request.name,
        )
    )
    meta["series"] = request.name or meta["name"]  # the store files the mapper under it (export, push, pull keep it)
    return PreparedFit(
        source=source,
        target=target,
        source_id=source_id,
        target_id=target_id,
        train=calibration.train,
        heldout=calibration.heldout,
        source_tokenizer=source_tok,
        target_tokenizer=target_tok,
        calibration=meta,
        options=options,
    )


def _placement(request: FitRequest, ranks: int = 1) -> tuple[str, str]:
    """The request's (capture, target layout), each "auto" resolved by the plan before any model loads (one
    phase, whole target when there is no plan: a config that cannot be read without the weights).  A
    layer-outer target always takes two phases."""
    options = request.options
    capture, layout = options.capture, options.target_layout
    if "auto" in (capture, layout):
        plan = plan_for(request, ranks=ranks)
        capture = capture if capture != "auto" else ("one-phase" if plan is None else plan.capture)
        layout = layout if layout != "auto" else ("whole" if plan is None else plan.target_layout)
    return ("two-phase" if layout == "layer-outer" else capture), layout


def calibration_line(
    meta: dict, *, train: int, heldout: int, tokens: int, stride: int, series: str | None = None
) -> str:
    """fit's calibration line, naming the series the mapper is filed under (``series``: --name, else the
    set's own name).  Its hashes are labelled as list and show label them: text (the sha256 of the
    documents, one per series) and set (the built sequences, which change with the size)."""
    return (
        f"calibration {series or meta['name']} (text {meta.get('corpus_hash') or '-':.12}, set "
        f"{meta.get('content_hash', ''):.12}): {train} train + {heldout} held-out sequences x {tokens} tokens, "
        f"stride {stride}"
    )


def plan_for(request: FitRequest, *, ranks: int = 1, available: int | None = None):
    """The :class:`kvhub.fitting.plan.Plan` of a request on ``ranks`` ranks of this machine's device, with the
    device memory replaced by ``available`` bytes (default: what is free now), in the statistics mode the
    request asks for ("auto": the plan's choice); None when a config cannot be read without loading the
    model (the fit then finds out itself)."""
    from kvhub.calib.recipe import recipe_from_spec
    from kvhub.errors import ConfigError
    from kvhub.fitting.plan import Workload, machine_profile, plan_fit, shape_of

    try:
        source, target = shape_of(request.src), shape_of(request.dst)
        sequences = (
            recipe_from_spec(request.calib)
            .with_sequences(samples=request.samples, seq_len=request.seq_len, seed=request.seed)
            .sequences
        )
    except ConfigError as exc:
        log.info("no plan before loading the models: %s", exc)
        return None
    options = request.options
    workload = Workload(
        samples=sequences.samples,
        heldout=sequences.heldout_samples,
        seq_len=sequences.seq_len,
        stride=options.stride or sequences.stride,
        batch_size=options.batch_size,
        k=options.top_k,
        dtype=request.dtype,
        mlp_tokens=0 if options.map_kind == "ridge" else options.mlp_tokens,
    )
    from kvhub.fitting.spool import free_bytes, spool_root

    device = str(request.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return plan_fit(
        source,
        target,
        workload,
        machine_profile(device, available=available),
        ranks=ranks,
        statistics=options.statistics,
        candidates=options.candidates,
        capture=options.capture,
        spool_free=free_bytes(spool_root()),
        target_layout=options.target_layout,
    )


def check_plan(request: FitRequest, *, ranks: int = 1, available: int | None = None):
    """Refuse, before loading anything, a fit whose plan needs more memory than this machine has free;
    returns the plan (None when it cannot be made before loading the models)."""
    from kvhub.errors import ConfigError

    plan = plan_for(request, ranks=ranks, available=available)
    if plan is not None and not plan.fits:
        raise ConfigError(
            f"{request.src} -> {request.dst}: {plan.advice} (the memory free now). "
            f"`kvhub plan --src {request.src} --dst {request.dst}` shows the memory table; "
            "kvhub fit --ignore-plan tries anyway"
        )
    return plan


def fit_by_names(
    request: FitRequest,
    *,
    store=None,
    notify: Notify | None = None,
    progress: ProgressFactory | None = None,
):
    """The whole fit in this process: :func:`check_request` (with ``store``, the series' text too), then
    :func:`prepare`, then :func:`kvhub.fitting.fit.fit`.  Returns the Mapper.

    An interrupted fit resumes from its checkpoint (``request.restart`` discards it); the checkpoint
    is deleted once the mapper is built.
    """
    from kvhub.fitting.checkpoint import discard
    from kvhub.fitting.fit import fit
    from kvhub.fitting.mlp_fit import checkpoint_path as mlp_checkpoint
    from kvhub.fitting.phases import discard_spool

    check_request(request, store=store)
    job = prepare(request, notify=notify, progress=progress)
    if request.restart:
        discard(job.options.checkpoint)
        discard(mlp_checkpoint(job.options.checkpoint))
        discard_spool(job)
    with (progress or _no_progress)("tok/s") as callback:
        mapper = fit(job, progress=callback, notify=notify)
    _record_where(mapper, job)
    discard(job.options.checkpoint)
    discard(mlp_checkpoint(job.options.checkpoint))
    return mapper


def _record_where(mapper, job) -> None:
    """mapper.json's fit block also says where the fit ran: the models' dtype and device type (what the
    statistics were computed from; `kvhub diff` compares them)."""
    from kvhub.fitting.resident import device_of

    mapper.metadata.setdefault("fit", {}).update(
        dtype=str(job.source.dtype).removeprefix("torch."), device=device_of(job.source).type
    )


def fit_by_names_distributed(
    request: FitRequest, *, group, notify: Notify | None = None, progress: ProgressFactory | None = None
):
    """The fit on every rank of ``group`` (:mod:`kvhub.fitting.distributed`); rank 0 returns the Mapper, the others None.

    Rank 0 prepares first (so the calibration set is built into the cache once), then the others.
    """
    import torch.distributed as dist

    from kvhub.fitting.distributed import fit_distributed, remove_checkpoints
    from kvhub.fitting.mlp_fit import check_options

    check_options(request.options, heldout_sequences=1, distributed=True)  # before any model loads
    check_request(request)

    if group.device.type == "cuda":
        request = dataclasses.replace(request, device=str(group.device))
    if not group.is_main:
        notify, progress = (lambda message: None), None
        dist.barrier()
    job = prepare(request, notify=notify, progress=progress, ranks=group.world)
    if group.is_main:
        dist.barrier()
    if request.restart:
        from kvhub.fitting.phases import discard_spool

        remove_checkpoints(group, job.options.checkpoint)
        discard_spool(job, rank=group.rank, world=group.world)
        dist.barrier()
    with (progress or _no_progress)("tok/s") as callback:
        mapper = fit_distributed(job, group=group, progress=callback, notify=notify)
    if mapper is not None:
        _record_where(mapper, job)
    dist.barrier()
    remove_checkpoints(group, job.options.checkpoint)
    return mapper


def checkpoint_path(
    source_id: str, target_id: str, calibration: dict, stride: int, batch_size: int, weighting: str = "uniform"
) -> Path:
    """``<cache>/checkpoints/<key>.safetensors``, keyed by the models, the calibration tokens and the options
    (what is in the file is checked against :func:`kvhub.fitting.checkpoint.job_identity` when it is read)."""
    from kvhub.env import cache_root

    key = json_sha256(
        [
            source_id,
            target_id,
            calibration.get("content_hash"),
            calibration.get("sequences"),
            calibration.get("heldout_sequences"),
            stride,
            batch_size,
            weighting,
        ]
    )
    return cache_root() / "checkpoints" / f"{key[:24]}.safetensors"
