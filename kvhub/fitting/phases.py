"""Where a fit's source captures come from: the source model run beside the target (one-phase capture), or
a spool the source filled alone before the target loaded (two-phase capture, :mod:`kvhub.fitting.spool`).

``--capture one-phase`` holds both models for the whole fit.  ``--capture two-phase`` runs phase 1 (the
source over every batch, into the spool), releases the source, then runs the statistics passes with the
target alone, reading the source's rows back: the same rows, so the same statistics and the same mapper,
with one model resident at a time.  ``auto`` takes two-phase when the plan says both models do not fit
the memory free now and one at a time does (:func:`kvhub.fitting.plan.plan_fit`, the one owner of that
decision).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from kvhub.core.capture import CapturedKV, capture
from kvhub.core.fingerprint import kv_geometry
from kvhub.errors import FitInterrupted
from kvhub.fitting import modes
from kvhub.fitting.resident import device_of, loaded, release
from kvhub.fitting.spool import Spool
from kvhub.progress import Progress, report

log = logging.getLogger(__name__)

CAPTURES = modes.CAPTURES


class LiveSource:
    """The source model, run on each batch as the statistics need it (one-phase capture)."""

    def __init__(self, model, rotary, *, stride: int, skip_first: int):
        self.model, self.rotary, self.stride, self.skip_first = model, rotary, stride, skip_first
        self.config = model.config

    def capture(self, index: int, ids: torch.Tensor, layers: list[int] | None = None) -> CapturedKV:
        return capture(self.model, ids, rotary=self.rotary, stride=self.stride, skip_first=self.skip_first)


class SpooledSource:
    """Batch ``index``'s source capture, read back from a complete spool (two-phase capture, phase 2)."""

    def __init__(self, spool: Spool, device, config=None):
        self.spool, self.device, self.config = spool, device, config  # config: the source model's

    def capture(self, index: int, ids: torch.Tensor, layers: list[int] | None = None) -> CapturedKV:
        return self.spool.read(index, layers, device=self.device)


def fill_spool(
    source,
    batches: list[tuple[str, torch.Tensor]],
    spool: Spool,
    *,
    stride: int,
    skip_first: int,
    progress: Progress | None = None,
    notify: Callable[[str], None] | None = None,
    timings: dict | None = None,
) -> None:
    """Phase 1: capture every batch the spool lacks with the source alone (``source``: a model or a
    :class:`kvhub.fitting.resident.ModelHandle`, loaded only when a batch is missing and released after),
    then mark the spool complete.  Ctrl-C raises :class:`FitInterrupted` saying how many batches the spool
    keeps (a rerun captures only the others)."""
    from kvhub.core.rope import Rotary

    todo = spool.missing()
    if not todo:
        if not spool.complete():
            spool.mark_complete()
        release(source)
        return
    held = len(spool.batches)
    if held - len(todo):
        (notify or log.info)(f"resuming the source's spool ({held - len(todo)}/{held} batches captured)")
    model = loaded(source)
    rotary = Rotary.from_model(model)
    live = LiveSource(model, rotary, stride=stride, skip_first=skip_first)
    total = sum(int(batches[i][1].numel()) for i in spool.batches)
    completed = total - sum(int(batches[i][1].numel()) for i in todo)
    timings = timings if timings is not None else {}
    for index in todo:
        name, ids = batches[index]
        try:
            report(progress, f"phase 1 (source): {name} batch {index + 1}/{len(batches)}", completed, total)
            started = time.perf_counter()
            captured = live.capture(index, ids)
            timings["forward_s"] = timings.get("forward_s", 0.0) + time.perf_counter() - started
            spool.write(index, captured)
        except KeyboardInterrupt as exc:
            kept = held - len(spool.missing())
            raise FitInterrupted(
                f"fit interrupted in phase 1 (the source's captures), batch {index + 1}/{len(batches)}; the "
                f"spool keeps {kept} batches: a rerun captures only the others",
                batch=index + 1,
                batches=len(batches),
                pass_index=1,
                resume_from=kept,
                phase=1,
            ) from exc
        completed += int(ids.numel())
    spool.mark_complete()
    report(progress, "phase 1 (source): done", completed, total)
    del model, live, rotary
    release(source)


def spooled(source, spool: Spool) -> SpooledSource:
    """Phase 2's source: the spool, read onto the device the source ran on."""
    return SpooledSource(spool, device_of(source), source.config)


def is_feed(source) -> bool:
    """Whether ``source`` hands out captures by batch (a :class:`LiveSource` or :class:`SpooledSource`)
    rather than being a model."""
    return isinstance(source, (LiveSource, SpooledSource))


def discard_spool(job, *, rank: int = 0, world: int = 1) -> None:
    """Remove the spool of ``job`` (a :class:`kvhub.fitting.prepared.PreparedFit` with its stride set), for
    ``kvhub fit --restart``: its captures are recaptured."""
    from kvhub.fitting.checkpoint import job_identity
    from kvhub.fitting.spool import remove_spool, spool_root

    source_fp, target_fp = job.fingerprints()
    key = job_identity(source_fp, target_fp, job.train, job.heldout, job.options, rank=rank, world=world)
    remove_spool(spool_root() / key[:24])


def source_captures(source, phases: str, job: str, batches, options, *, held=None, progress=None, notify=None):
    """The fit's source feed and its spool: the loaded model and None (one phase), or phase 1 run into the
    spool of ``job`` and the spool read back (two phases; the source released after phase 1).  ``held``: the
    batch indices this process captures (a distributed rank's own; default every batch)."""
    if phases != "two-phase":
        return loaded(source), None
    held = range(len(batches)) if held is None else held
    spool = Spool.for_job(job, batches=list(held), layers=kv_geometry(source.config)[0])
    fill_spool(
        source,
        batches,
        spool,
        stride=options.stride,
        skip_first=options.skip_first,
        progress=progress,
        notify=notify,
        timings=options.timings,
    )
    options.timings["spool_bytes"] = spool.nbytes()
    report(progress, "phase 2 (target): loading", 0, None)
    return spooled(source, spool), spool
