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
probe grids (``probe.k``, ``probe.v``: (Ls, target layers)); in a ``--map mlp`` fit also the rows kept to
train the MLPs on (``sample.{split}.*``, :class:`kvhub.fitting.samples.Reservoir`).  Its header:

    job           the identity         statistics    the mode (JSON)
    pass          1 or 2               batches_done  batches (distributed: steps) of that pass merged
    candidates    pass 2's source layers, comma-separated (pass 2 only)
    kvhub_version

Reading one back checks it against the fit that reads it: 1 <= pass <= the mode's passes,
0 <= batches_done <= the batches of a pass, candidates ascending source layers (at most the mode's
budget), every tensor there with the shape and dtype the layout and the mode give, and finite.  A
checkpoint that fails (or does not read at all) is logged as a one-line warning naming the file and
what is wrong, and the fit starts over: never a traceback, never statistics resumed from a damaged file.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvhub import __version__
from kvhub.artifact import canonical_json
from kvhub.artifact.files import atomic_write_if_room
from kvhub.core.stats import KVStats, Layout
from kvhub.fitting.modes import StatisticsMode

log = logging.getLogger(__name__)

SPLITS = ("train", "heldout")


def job_identity(
    source_fp: dict,
    target_fp: dict,
    train_ids: torch.Tensor,
    heldout_ids: torch.Tensor | None,
    options,
    *,
    rank: int = 0,
    world: int = 1,
) -> str:
    """The identity of a fit's statistics (module docstring); ``options`` is a FitOptions."""
    record = {
        "source": source_fp["config_hash"],
        "target": target_fp["config_hash"],
        "stride": options.stride,
        "skip_first": options.skip_first,
        "batch_size": options.batch_size,
        "weighting": options.weighting,
        "weight_cap": options.weight_cap if options.weighting == "attention" else None,
        "rank": rank,
        "world": world,
    }
    if getattr(options, "map_kind", "ridge") != "ridge":  # its row samples are checkpointed with the statistics
        record["map"] = {"kind": options.map_kind, "tokens": options.mlp_tokens}
    digest = hashlib.sha256(canonical_json(record))
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
    samples: dict | None = None  # split -> kvhub.fitting.samples.Reservoir (--map mlp), filled in pass 1

    @property
    def position(self) -> int:
        """Grows along the fit, pass first, then batches: what distributed ranks agree on to resume."""
        return position(self.pass_index, self.batches_done)


def position(pass_index: int, batches_done: int) -> int:
    return (pass_index << 32) | batches_done


@dataclass(frozen=True)
class Header:
    """A checkpoint's header, checked against the fit reading it (module docstring)."""

    pass_index: int
    batches_done: int
    candidates: list[int] | None

    @property
    def position(self) -> int:
        return position(self.pass_index, self.batches_done)


class _Damaged(Exception):
    """A checkpoint that cannot be resumed; the message says what is wrong with it (never leaves this module)."""


def save(path: Path, job: str, mode: StatisticsMode, state: FitState) -> None:
    """Write ``state`` atomically to ``path`` (module docstring).  A directory at ``path`` is left alone
    (reading it warned): that fit runs without checkpoints."""
    from safetensors.torch import save as to_bytes

    if Path(path).is_dir():
        return
    tensors = {
        f"{name}.{key}": t.contiguous().cpu() for name, s in state.stats.items() for key, t in s.state_dict().items()
    }
    header = {
        "job": job,
        "statistics": mode.to_json(),
        "pass": str(state.pass_index),
        "batches_done": str(state.batches_done),
        "kvhub_version": __version__,
    }
    if state.candidates is not None:
        header["candidates"] = ",".join(map(str, state.candidates))
    if state.probe is not None:
        tensors["probe.k"], tensors["probe.v"] = (grid.contiguous().cpu() for grid in state.probe)
    for split, reservoir in (state.samples or {}).items():
        tensors.update({f"sample.{split}.{key}": t.contiguous() for key, t in reservoir.state_dict().items()})
    atomic_write_if_room(
        Path(path),
        to_bytes(tensors, metadata=header),
        then="the fit goes on without it (interrupted, it resumes from the last checkpoint written, or starts over)",
    )


def discard(path: Path | None) -> None:
    """Delete the checkpoint file at ``path``, if any (a directory there is left alone)."""
    if path is not None and not Path(path).is_dir():
        Path(path).unlink(missing_ok=True)


def saved_mode(path: Path | None, job: str) -> StatisticsMode | None:
    """The statistics mode a checkpoint of ``job`` was written in (None: no such checkpoint, or one whose
    header does not read: :func:`load` says what is wrong with it)."""
    try:
        header = _own_header(path, job, quiet=True)  # load() reads it again and warns once
        return None if header is None else _mode(header)
    except _Damaged:
        return None


def read_header(
    path: Path | None, job: str, mode: StatisticsMode, *, layout: Layout, batches: int, then: str = "starting over"
) -> Header | None:
    """The checked header of the checkpoint at ``path`` if a fit of ``job`` in ``mode`` can resume it.

    ``layout``: the statistics of pass 1 (every source layer; the fit's, or a rank's, target layers);
    ``batches``: the batches (distributed: steps) of one pass.  None: no file, another job's or mode's,
    or a damaged one (a warning says what is wrong, then what the fit does: ``then``)."""
    try:
        return _checked_header(path, job, mode, layout=layout, batches=batches)
    except _Damaged as exc:
        log.warning("checkpoint %s %s; %s", path, exc, then)
        return None


def load(
    path: Path | None,
    job: str,
    mode: StatisticsMode,
    *,
    layout: Layout,
    batches: int,
    device: torch.device | str = "cpu",
    then: str = "starting over",
    samples: dict | None = None,
) -> FitState | None:
    """The state the checkpoint at ``path`` holds if a fit of ``job`` in ``mode`` can resume it (``layout``,
    ``batches``, ``then``: as for :func:`read_header`), its tensors on ``device``; None: nothing to resume
    (a warning says why when there was a checkpoint of this fit).  ``samples``: the fit's empty reservoirs
    (kvhub.fitting.samples), filled from the checkpoint's ``sample.*`` tensors, which must be there."""
    try:
        header = _checked_header(path, job, mode, layout=layout, batches=batches)
        if header is None:
            return None
        return _read_state(Path(path), header, mode, layout, device, samples)
    except _Damaged as exc:
        log.warning("checkpoint %s %s; %s", path, exc, then)
        return None


# ---- checking what was read back ------------------------------------------------------------------
def _own_header(path: Path | None, job: str, *, quiet: bool = False) -> dict | None:
    """The header of ``path`` if it is a checkpoint of ``job`` (None: no file, or another job's, which is
    logged unless ``quiet``)."""
    from safetensors import SafetensorError, safe_open

    if path is None or not Path(path).exists():
        return None
    if Path(path).is_dir():
        raise _Damaged("is a directory, not a file: this fit cannot checkpoint until it is removed")
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
    except (SafetensorError, OSError) as exc:
        raise _Damaged(f"does not read as safetensors ({exc})") from exc
    if header.get("job") != job:
        if not quiet:
            log.warning("checkpoint %s belongs to another fit; starting over (it will be overwritten)", path)
        return None
    return header


def _mode(header: dict) -> StatisticsMode:
    try:
        return StatisticsMode.from_json(header["statistics"])
    except (KeyError, TypeError, ValueError) as exc:  # ConfigError is a ValueError
        raise _Damaged(f"has unreadable statistics {header.get('statistics')!r} ({exc})") from exc


def _checked_header(
    path: Path | None, job: str, mode: StatisticsMode, *, layout: Layout, batches: int
) -> Header | None:
    header = _own_header(path, job)
    if header is None:
        return None
    saved = _mode(header)
    if saved != mode:
        log.warning("checkpoint %s was written with other statistics (%s); starting over", path, header["statistics"])
        return None
    pass_index = _integer(header, "pass", 1, mode.passes)
    batches_done = _integer(header, "batches_done", 0, batches)
    return Header(pass_index, batches_done, _candidates(header, pass_index, mode, layout.src_layers))


def _integer(header: dict, key: str, low: int, high: int) -> int:
    text = header.get(key)
    if not isinstance(text, str) or not re.fullmatch(r"-?[0-9]+", text):
        raise _Damaged(f"has {key} {text!r}, not an integer")
    if not low <= int(text) <= high:
        raise _Damaged(f"has {key} {text}, outside {low}..{high}")
    return int(text)


def _candidates(header: dict, pass_index: int, mode: StatisticsMode, src_layers: int) -> list[int] | None:
    """Pass 2's candidate source layers: ascending, in 0..src_layers-1, at most the mode's budget."""
    text = header.get("candidates")
    if pass_index == 1:
        if text is not None:
            raise _Damaged(f"has candidates {text!r} in pass 1")
        return None
    budget = min(src_layers, mode.candidates or src_layers)
    layers = text.split(",") if isinstance(text, str) else []
    if not layers or not all(re.fullmatch(r"[0-9]+", c) for c in layers):
        raise _Damaged(f"has candidates {text!r}, not comma-separated source layers")
    chosen = [int(c) for c in layers]
    if chosen != sorted(set(chosen)) or chosen[-1] >= src_layers or len(chosen) > budget:
        raise _Damaged(f"has candidates {text!r}, not at most {budget} ascending source layers of 0..{src_layers - 1}")
    return chosen


def _expected(
    header: Header, mode: StatisticsMode, layout: Layout, samples: dict | None = None
) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint with ``header`` holds, as meta tensors of their shape and dtype: the
    state_dict of empty statistics of the pass's layout (pass 2: the candidates' source layers), and in
    pass 2 the probe grids (Ls, target layers)."""
    if header.pass_index == 1:
        kept, gram = layout, "diagonal" if mode.passes == 2 else "full"
    else:
        kept, gram = Layout(len(header.candidates), layout.src_width, layout.dst_layers, layout.dst_width), "full"
    template = KVStats(kept, device="meta", dtype=mode.torch_dtype, gram=gram).state_dict()
    expected = {f"{name}.{key}": t for name in SPLITS for key, t in template.items()}
    if header.pass_index == 2:
        grid = torch.empty(layout.src_layers, layout.dst_layers, dtype=torch.float64, device="meta")
        expected.update({"probe.k": grid, "probe.v": grid})
    for split, reservoir in (samples or {}).items():
        expected.update(
            {f"sample.{split}.{key}": torch.empty_like(t, device="meta") for key, t in reservoir.state_dict().items()}
        )
    return expected


def _read_state(
    path: Path, header: Header, mode: StatisticsMode, layout: Layout, device, samples: dict | None = None
) -> FitState:
    """The checkpoint's tensors, each checked against :func:`_expected`; ``samples`` filled from it."""
    from safetensors import SafetensorError, safe_open

    expected = _expected(header, mode, layout, samples)
    try:
        with safe_open(str(path), framework="pt") as handle:
            missing = sorted(set(expected) - set(handle.keys()))
            if missing:
                more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
                raise _Damaged(f"lacks tensor {missing[0]}{more}")
            state = {key: _checked_tensor(key, handle.get_tensor(key), like) for key, like in expected.items()}
    except (SafetensorError, OSError) as exc:
        raise _Damaged(f"does not read as safetensors ({exc})") from exc
    for split, reservoir in (samples or {}).items():
        prefix = f"sample.{split}."
        reservoir.load_state_dict({k[len(prefix) :]: state.pop(k) for k in list(state) if k.startswith(prefix)})
    state = {key: t.to(device) for key, t in state.items()}
    stats = {
        name: KVStats.from_state_dict({k[len(name) + 1 :]: v for k, v in state.items() if k.startswith(f"{name}.")})
        for name in SPLITS
    }
    probe = (state["probe.k"], state["probe.v"]) if header.pass_index == 2 else None
    return FitState(stats, header.pass_index, header.batches_done, header.candidates, probe, samples)


def _checked_tensor(key: str, tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` if it has the shape and dtype of ``like`` and is finite (for ``layout``: equal to it; for a
    row count or weight sum: >= 0); else _Damaged."""
    if tuple(tensor.shape) != tuple(like.shape) or tensor.dtype != like.dtype:
        raise _Damaged(f"has tensor {key} {tuple(tensor.shape)} {tensor.dtype}, not {tuple(like.shape)} {like.dtype}")
    if key.endswith(".layout") and not torch.equal(tensor, like):
        raise _Damaged(f"has statistics of layout {tensor.tolist()}, not {like.tolist()}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise _Damaged(f"has non-finite values in {key}")
    if key.endswith((".n", ".weight_sum")) and float(tensor) < 0:
        raise _Damaged(f"has {key} {tensor.item()}, below 0")
    return tensor


def sweep_temporaries(directory: Path, *, older_than_s: float = 3600.0) -> list[Path]:
    """Delete the ``.<name>.safetensors.tmp-*`` files that fits killed mid-save left in ``directory``
    (atomic_write_bytes' temporaries), once untouched for ``older_than_s``; returns what was deleted.
    A save in progress keeps writing its temporary, so an hour-old one has no writer."""
    import stat
    import time

    cutoff = time.time() - older_than_s
    swept = []
    for path in sorted(Path(directory).glob(".*.safetensors.tmp-*")):
        try:
            info = path.lstat()
            if info.st_mtime < cutoff and not stat.S_ISDIR(info.st_mode):
                path.unlink()
                swept.append(path)
        except FileNotFoundError:  # another fit swept it first
            continue
    if swept:
        log.info("removed %d stale checkpoint temporaries from %s", len(swept), directory)
    return swept
