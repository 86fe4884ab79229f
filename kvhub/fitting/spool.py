"""The source's captures on disk, so a fit holds one model at a time (two-phase capture).

Phase 1 runs the source alone over the fit's batches and writes, per batch, what the statistics read of
it: every source layer's RoPE-stripped keys and its values at the kept positions, (N, Hs*Ds) fp32 rows
(:class:`kvhub.core.capture.CapturedKV`, exactly what a one-phase fit hands :meth:`KVStats.update`).
Phase 2 runs the target alone over the same batches and reads them back, so its statistics are today's,
bit for bit.  Attention weights come from the target, so they need nothing here; a ``--map mlp`` fit's
row samples are drawn in phase 2 from the same captures.

A spool is a directory ``<kvhub cache>/spool/<job[:24]>/`` of ``batch-00000.safetensors`` files, each
written atomically (temporary file, fsync, rename) with the job identity, the batch index, the batch's
token count and the layer count in its header, and a ``complete.json`` written last, once every batch
is there.  A spool without ``complete.json`` is never read as complete: phase 1 resumes it, keeping the
batch files whose header names this job and batch and whose tensors read, and recapturing the others.
An entry found damaged in phase 2 is deleted with ``complete.json``, and the fit stops saying that a
rerun recaptures it.  The fit removes its spool when the mapper is built; ``kvhub gc`` removes
spools no fit has touched for a day (:func:`sweep`).  Nothing under a spool is followed through a
link: the directory and its files are refused when they are links.
"""

from __future__ import annotations

import json
import logging
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from kvhub import __version__
from kvhub.artifact.files import atomic_write_bytes, is_no_space
from kvhub.errors import FitError

if TYPE_CHECKING:  # torch loads only where a spool is written or read: kvhub gc sweeps without it
    from kvhub.core.capture import CapturedKV

log = logging.getLogger(__name__)

COMPLETE = "complete.json"
STALE_AFTER_S = 24 * 3600.0  # a spool untouched this long has no fit running on it


def spool_root() -> Path:
    from kvhub.env import cache_root

    return cache_root() / "spool"


def entry_name(index: int) -> str:
    return f"batch-{index:05d}.safetensors"


@dataclass
class Spool:
    """One fit's spool (module docstring): ``directory``, the fit's ``job`` identity, the ``batches`` it holds
    (indices into the fit's batches: all of them, or a distributed rank's own) and the source's ``layers``."""

    directory: Path
    job: str
    batches: tuple[int, ...]
    layers: int

    @classmethod
    def for_job(cls, job: str, *, batches, layers: int, root: Path | None = None) -> "Spool":
        """``batches``: a count (every batch) or the indices this spool holds."""
        indices = tuple(range(batches)) if isinstance(batches, int) else tuple(batches)
        return cls((root or spool_root()) / job[:24], job, indices, layers)

    # ---- phase 1 --------------------------------------------------------------------------------
    def missing(self) -> list[int]:
        """The batch indices phase 1 still has to capture (every one whose entry is absent or does not
        belong to this job and batch; such a file is deleted)."""
        self._refuse_links()
        if self.complete():
            return []
        todo = []
        for index in self.batches:
            path = self.directory / entry_name(index)
            if not path.exists():
                todo.append(index)
            elif self._entry_problem(path, index) is not None:
                log.info("spool %s: %s; capturing it again", path, self._entry_problem(path, index))
                path.unlink(missing_ok=True)
                todo.append(index)
        return todo

    def write(self, index: int, captured: "CapturedKV") -> None:
        """Write batch ``index``'s source capture atomically; a full disk is a :class:`FitError` naming the
        directory (nothing half-written is left: the temporary file is removed)."""
        import torch
        from safetensors.torch import save

        tensors = {}
        for layer, (keys, values) in enumerate(zip(captured.keys, captured.values)):
            tensors[f"k.{layer}"] = keys.detach().to("cpu", torch.float32).contiguous()
            tensors[f"v.{layer}"] = values.detach().to("cpu", torch.float32).contiguous()
        header = {
            "job": self.job,
            "batch": str(index),
            "layers": str(len(captured.keys)),
            "rows": str(captured.tokens),
            "kvhub_version": __version__,
        }
        self._refuse_links()
        try:
            atomic_write_bytes(self.directory / entry_name(index), save(tensors, metadata=header))
        except OSError as exc:
            if is_no_space(exc):
                raise FitError(
                    f"no space left on {self.directory} for the source's captures (batch {index + 1}); free space there or point KVHUB_CACHE at a larger disk, then rerun: "
                    "the batches already written are kept"
                ) from exc
            raise

    def mark_complete(self) -> None:
        """Write ``complete.json`` (after checking every entry's header): phase 2 may read the spool."""
        problems = [p for i in self.batches if (p := self._entry_problem(self._path(i), i))]
        if problems:
            raise FitError(f"spool {self.directory} is not complete: {problems[0]}; rerun the fit to capture it")
        record = {"job": self.job, "batches": list(self.batches), "layers": self.layers, "kvhub_version": __version__}
        atomic_write_bytes(self.directory / COMPLETE, json.dumps(record, sort_keys=True).encode())

    def complete(self) -> bool:
        """Whether phase 1 finished this spool: ``complete.json`` names this job, batch and layer count."""
        path = self.directory / COMPLETE
        if path.is_symlink() or not path.is_file():
            return False
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        return (
            isinstance(record, dict)
            and record.get("job") == self.job
            and (
                record.get("batches"),
                record.get("layers"),
            )
            == (list(self.batches), self.layers)
        )

    # ---- phase 2 --------------------------------------------------------------------------------
    def read(self, index: int, layers: list[int] | None = None, *, device="cpu") -> "CapturedKV":
        """Batch ``index``'s source capture (``layers``: only those source layers, in that order; the others
        are None), on ``device``.  A damaged entry is deleted with ``complete.json`` and a FitError says a
        rerun recaptures it."""
        from safetensors import SafetensorError, safe_open

        from kvhub.core.capture import CapturedKV

        if not self.complete():
            raise FitError(f"spool {self.directory} is not complete; phase 1 must finish before the target runs")
        path = self._path(index)
        problem = self._entry_problem(path, index)
        keep = range(self.layers) if layers is None else layers
        if problem is None:
            try:
                with safe_open(str(path), framework="pt", device=str(device)) as handle:
                    keys = [handle.get_tensor(f"k.{l}") if l in keep else None for l in range(self.layers)]
                    values = [handle.get_tensor(f"v.{l}") if l in keep else None for l in range(self.layers)]
                    rows = int((handle.metadata() or {})["rows"])
                problem = _tensor_problem(keys, values, rows)
            except (SafetensorError, OSError, KeyError, ValueError) as exc:
                problem = f"does not read ({exc})"
        if problem is not None:
            path.unlink(missing_ok=True)
            (self.directory / COMPLETE).unlink(missing_ok=True)
            raise FitError(
                f"spool entry {path} {problem}; it was removed: rerun the fit to capture that batch again "
                "(the other batches and the statistics checkpoint are kept)"
            )
        return CapturedKV(keys=keys, values=values)

    def nbytes(self) -> int:
        """Bytes the spool's entries take on disk now."""
        return sum(p.stat().st_size for p in self.directory.glob("batch-*.safetensors") if p.is_file())

    def remove(self) -> None:
        remove_spool(self.directory)

    # ---- checks ---------------------------------------------------------------------------------
    def _path(self, index: int) -> Path:
        return self.directory / entry_name(index)

    def _refuse_links(self) -> None:
        for path in (self.directory.parent, self.directory):
            if path.is_symlink():
                raise FitError(f"{path} is a symbolic link; kvhub spools only into a directory it owns: remove it")
        self.directory.mkdir(parents=True, exist_ok=True)

    def _entry_problem(self, path: Path, index: int) -> str | None:
        """What is wrong with entry ``path`` for batch ``index`` (None: its header is this job's)."""
        from safetensors import SafetensorError, safe_open

        if path.is_symlink():
            return "is a symbolic link"
        if not path.is_file():
            return "is missing"
        try:
            with safe_open(str(path), framework="pt") as handle:
                header = handle.metadata() or {}
                names = set(handle.keys())
        except (SafetensorError, OSError) as exc:
            return f"does not read as safetensors ({exc})"
        expected = {"job": self.job, "batch": str(index), "layers": str(self.layers)}
        wrong = [key for key, value in expected.items() if header.get(key) != value]
        if wrong:
            return f"has {wrong[0]} {header.get(wrong[0])!r}, not {expected[wrong[0]]!r}"
        if names != {f"{kind}.{l}" for kind in "kv" for l in range(self.layers)}:
            return "lacks some layers' keys or values"
        if not str(header.get("rows", "")).isdigit():
            return f"has rows {header.get('rows')!r}, not a count"
        return None


def _tensor_problem(keys: list, values: list, rows: int) -> str | None:
    import torch

    for kind, blocks in (("keys", keys), ("values", values)):
        for layer, block in enumerate(blocks):
            if block is None:
                continue
            if block.dtype != torch.float32 or block.dim() != 2 or block.shape[0] != rows:
                return f"has layer {layer} {kind} {tuple(block.shape)} {block.dtype}, not ({rows}, width) float32"
            if not bool(torch.isfinite(block).all()):
                return f"has non-finite layer {layer} {kind}"
    return None


def remove_spool(directory: Path) -> None:
    """Delete a spool directory: its regular files one by one (a link is unlinked, never followed), then the
    directory; a link in place of the directory is refused."""
    directory = Path(directory)
    if directory.is_symlink():
        raise FitError(f"{directory} is a symbolic link, not a spool; left alone")
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        info = path.lstat()
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(path)  # nothing kvhub writes; rmtree does not follow links inside
        else:
            path.unlink(missing_ok=True)
    directory.rmdir()


def sweep(root: Path | None = None, *, older_than_s: float = STALE_AFTER_S, dry_run: bool = False) -> list[Path]:
    """The spools under ``root`` (default :func:`spool_root`) no fit has written for ``older_than_s``:
    removed (unless ``dry_run``) and returned.  Links under the root are reported, never followed."""
    root = Path(root or spool_root())
    if root.is_symlink() or not root.is_dir():
        return []
    cutoff = time.time() - older_than_s
    stale = []
    for directory in sorted(root.iterdir()):
        if directory.is_symlink() or not directory.is_dir():
            continue
        newest = max((p.lstat().st_mtime for p in directory.iterdir()), default=directory.lstat().st_mtime)
        if newest < cutoff:
            stale.append(directory)
            if not dry_run:
                remove_spool(directory)
    return stale


def free_bytes(directory: Path) -> int:
    """Free bytes on the file system that holds ``directory`` (or its nearest existing parent)."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def spool_bytes(rows: int, src_layers: int, src_width: int) -> int:
    """Bytes a spool of ``rows`` kept tokens takes: K and V, every source layer, fp32 (headers aside)."""
    return rows * src_layers * src_width * 2 * 4
