"""Atomic, hash-verified files and directories.

A reader never sees a half-written artifact: everything is written to a temporary sibling, fsynced,
then renamed into place.  A killed writer leaves at most a ``.tmp-*`` sibling, which is never mistaken
for an artifact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from . import __version__
from .errors import ArtifactError, FormatVersionError, IntegrityError

FORMAT_VERSION = 2  # the newest mapper artifact format this kvhub reads (docs/artifact-format.md)
TENSORS_FILE = "mapper.safetensors"
METADATA_FILE = "mapper.json"


def sha256_file(path: str | os.PathLike, *, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file below ``path`` and the directories themselves."""
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_dir(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via temp file + fsync + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class AtomicDirectory:
    """Context manager: fill ``.path`` (a temp dir), and on success it is renamed to ``target``.

    An exception (or a kill) leaves ``target`` untouched.  ``overwrite=True`` replaces an existing
    target; otherwise an existing target is an error raised before any work is done.
    """

    def __init__(self, target: str | os.PathLike, *, overwrite: bool = False):
        self.target = Path(target)
        self.overwrite = overwrite
        if self.target.exists() and not overwrite:
            raise ArtifactError(
                f"{self.target} already exists; choose another directory or pass overwrite=True (--force)"
            )
        self.path: Path | None = None

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.tmp-", dir=self.target.parent))
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self.path is not None
        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        fsync_tree(self.path)
        if self.target.exists():
            old = self.target.with_name(f".{self.target.name}.old-{os.getpid()}")
            os.replace(self.target, old)
            os.replace(self.path, self.target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.path, self.target)
        fsync_dir(self.target.parent)


def read_metadata(directory: str | os.PathLike) -> dict:
    """Read mapper.json, checking that it exists and that its format version is one this kvhub reads."""
    path = Path(directory) / METADATA_FILE
    if not path.is_file():
        raise ArtifactError(f"{directory} is not a kvhub mapper artifact: {METADATA_FILE} is missing")
    try:
        metadata = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}); the artifact is corrupt, re-fetch or re-fit it") from exc
    version = metadata.get("format_version")
    if not isinstance(version, int):
        raise ArtifactError(f"{path} has no integer format_version; the artifact is corrupt")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{directory} has artifact format version {version}, this kvhub ({__version__}) reads up to "
            f"{FORMAT_VERSION}; upgrade with `pip install -U kvhub`"
        )
    return metadata


def verify_tensors(directory: str | os.PathLike, metadata: dict) -> None:
    """Raise IntegrityError unless the tensor file's sha256 matches mapper.json."""
    path = Path(directory) / metadata["tensors"]["file"]
    if not path.is_file():
        raise ArtifactError(f"{path} is missing; the artifact is incomplete, re-fetch or re-fit it")
    actual = sha256_file(path)
    if actual != metadata["tensors"]["sha256"]:
        raise IntegrityError(
            f"{path} has sha256 {actual}, but mapper.json records {metadata['tensors']['sha256']}: "
            "the file was modified or corrupted; re-fetch it (kvhub pull) or re-fit"
        )
