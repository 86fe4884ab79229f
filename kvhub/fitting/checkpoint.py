"""Checkpoints of a fit's statistics: the one definition of a job's identity, and resumable passes.

:func:`job_identity` says when a checkpoint belongs to a fit: sha256 over a sorted-JSON record of
both models' config hashes, the capture options (stride, skip_first, batch size, token weighting and,
when weighting by attention, its cap) and, in a distributed fit, the rank and the number of ranks,
then the train and held-out token ids.  The single-process fit and every rank of a distributed one
call it; nothing else hashes a job.  The statistics mode (:class:`kvhub.fitting.modes.StatisticsMode`)
is not part of it: the header records it, and a fit whose mode was left to the plan resumes in the
mode its checkpoint was started in (the plan's choice can move with the memory free at the time).

A checkpoint is one safetensors file, written atomically: the statistics by split (``train.*``,
``heldout.*``, :meth:`kvhub.core.stats.KVStats.state_dict`) and, in pass 2 of a two-pass fit, pass 1's
probe grids (``probe.k``, ``probe.v``: (Ls, target layers)).  Its header:

    job           the identity         statistics    the mode (JSON)
    pass          1 or 2               batches_done  batches (distributed: steps) of that pass merged
    candidates    pass 2's source layers, comma-separated (pass 2 only)
    kvhub_version
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvhub import __version__
from kvhub.artifact import atomic_write_bytes
from kvhub.core.stats import KVStats
from kvhub.fitting.modes import StatisticsMode

log = logging.getLogger(__name__)

SPLITS = ("train", "heldout")


def job_identity(source_fp: dict, target_fp: dict, train_ids: torch.Tensor, heldout_ids: torch.Tensor | None,
                 options, *, rank: int = 0, world: int = 1) -> str:
    """The identity of a fit's statistics (module docstring); ``options`` is a FitOptions."""
    record = {
        "source": source_fp["config_hash"], "target": target_fp["config_hash"], "stride": options.stride,
        "skip_first": options.skip_first, "batch_size": options.batch_size, "weighting": options.weighting,
        "weight_cap": options.weight_cap if options.weighting == "attention" else None,
        "rank": rank, "world": world,
    }
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode())
    for ids in (train_ids, heldout_ids if heldout_ids is not None else train_ids[:0]):
        digest.update(str(tuple(ids.shape)).encode())
        digest.update(ids.to(torch.int64).contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


@dataclass
class FitState:
    """Where a fit's statistics stand: what is accumulated (by split), in which pass, after how many
    batches (or distributed steps); in pass 2 also the candidate source layers and pass 1's probe grids."""

    stats: dict[str, KVStats]
    pass_index: int = 1
    batches_done: int = 0
    candidates: list[int] | None = None
    probe: tuple[torch.Tensor, torch.Tensor] | None = None  # (K, V) probe R^2, (Ls, target layers)

    @property
    def position(self) -> int:
        """Grows along the fit, pass first, then batches: what distributed ranks agree on to resume."""
        return position(self.pass_index, self.batches_done)


def position(pass_index: int, batches_done: int) -> int:
    return (pass_index << 32) | batches_done


def save(path: Path, job: str, mode: StatisticsMode, state: FitState) -> None:
    """Write ``state`` atomically to ``path`` (module docstring)."""
    from safetensors.torch import save as to_bytes

    tensors = {f"{name}.{key}": t.contiguous().cpu() for name, s in state.stats.items()
               for key, t in s.state_dict().items()}
    header = {"job": job, "statistics": mode.to_json(), "pass": str(state.pass_index),
              "batches_done": str(state.batches_done), "kvhub_version": __version__}
    if state.candidates is not None:
        header["candidates"] = ",".join(map(str, state.candidates))
    if state.probe is not None:
        tensors["probe.k"], tensors["probe.v"] = (grid.contiguous().cpu() for grid in state.probe)
    atomic_write_bytes(Path(path), to_bytes(tensors, metadata=header))


def read_header(path: Path | None, job: str) -> dict | None:
    """The header of ``path`` if it is a checkpoint of ``job`` (None: no file, or another job's)."""
    from safetensors import safe_open

    if path is None or not Path(path).is_file():
        return None
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata() or {}
    if header.get("job") != job:
        log.warning("checkpoint %s belongs to another fit; it will be overwritten", path)
        return None
    return header


def saved_mode(path: Path | None, job: str) -> StatisticsMode | None:
    """The statistics mode a checkpoint of ``job`` was written in (None: no such checkpoint)."""
    header = read_header(path, job)
    return None if header is None else StatisticsMode.from_json(header["statistics"])


def header_position(header: dict) -> int:
    return position(int(header["pass"]), int(header["batches_done"]))


def load(path: Path | None, job: str, mode: StatisticsMode, *, device: torch.device | str = "cpu") -> FitState | None:
    """The state a checkpoint of ``job`` written in ``mode`` holds, or None (nothing to resume)."""
    from safetensors import safe_open

    header = read_header(path, job)
    if header is None:
        return None
    if StatisticsMode.from_json(header["statistics"]) != mode:
        log.warning("checkpoint %s was written with other statistics (%s); starting over", path,
                    header["statistics"])
        return None
    with safe_open(str(path), framework="pt") as handle:
        state = {key: handle.get_tensor(key).to(device) for key in handle.keys()}
    stats = {name: KVStats.from_state_dict({k[len(name) + 1:]: v for k, v in state.items()
                                            if k.startswith(f"{name}.")}) for name in SPLITS}
    candidates = [int(c) for c in header["candidates"].split(",")] if header.get("candidates") else None
    probe = (state["probe.k"], state["probe.v"]) if "probe.k" in state else None
    return FitState(stats, int(header["pass"]), int(header["batches_done"]), candidates, probe)
