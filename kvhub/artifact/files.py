"""Atomic, hash-verified files and directories, read without following symbolic links.

A reader never sees a half-written artifact: everything is written to a temporary sibling, fsynced,
then renamed into place.  A killed writer leaves at most a ``.tmp-*`` sibling, which is never mistaken
for an artifact.  Files of an artifact are opened with ``O_NOFOLLOW`` and must be regular files: a
symbolic link planted in an artifact directory (``figure.png -> ~/.ssh/id_rsa``) is refused, never
followed (docs/artifact-format.md, threat model).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvhub.errors import ArtifactError, StoreError

log = logging.getLogger(__name__)
_CHUNK = 1 << 20
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def is_no_space(exc: BaseException) -> bool:
    """A full file system (or quota): an OSError with ENOSPC / EDQUOT, or safetensors' SafetensorError, which
    carries only the text of the I/O error ("No space left on device (os error 28)")."""
    if isinstance(exc, OSError):
        return exc.errno in NO_SPACE
    return type(exc).__name__ == "SafetensorError" and ("os error 28" in str(exc) or "No space left" in str(exc))


def no_space_error(folder: str | os.PathLike, *, then: str) -> StoreError:
    """The one wording of a full disk, "no space left on FOLDER; ``then``" (the store, exports, fit outputs, the
    Hugging Face cache); ``then`` says what was (not) written and the fix."""
    return StoreError(f"no space left on {folder}; {then}")


@contextlib.contextmanager
def refused_when_full(folder: str | os.PathLike, *, then: str) -> Iterator[None]:
    """Turn a full disk inside the block (:func:`is_no_space`) into :func:`no_space_error`."""
    try:
        yield
    except Exception as exc:  # only a full disk is translated; anything else is re-raised as it is
        if not is_no_space(exc):
            raise
        raise no_space_error(folder, then=then) from exc


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


def atomic_write_if_room(path: str | os.PathLike, data: bytes, *, then: str) -> bool:
    """:func:`atomic_write_bytes` for what the work does not need (a cache entry, a checkpoint): a full disk is a
    warning, "no space left on DIR; PATH was not written; ``then``", and False (nothing half-written is left)."""
    try:
        atomic_write_bytes(path, data)
    except OSError as exc:
        if not is_no_space(exc):
            raise
        log.warning("no space left on %s; %s was not written; %s", Path(path).parent, path, then)
        return False
    return True


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
        if os.path.lexists(self.target) and not overwrite:
            raise ArtifactError(f"{self.target} already exists; choose another directory or pass overwrite=True")
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
        if os.path.lexists(self.target):  # a symbolic link is replaced, never followed
            old = self.target.with_name(f".{self.target.name}.old-{os.getpid()}")
            os.replace(self.target, old)
            os.replace(self.path, self.target)
            if old.is_symlink() or not old.is_dir():
                old.unlink(missing_ok=True)
            else:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.path, self.target)
        fsync_dir(self.target.parent)


def open_regular(path: str | os.PathLike):
    """Open ``path`` for binary reading if it is a regular file and not a symbolic link.

    Raises ArtifactError for a link, a directory, a device or a missing file.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing; the artifact is incomplete, re-fetch or re-fit it") from None
    except OSError as exc:
        if os.path.islink(path):
            raise ArtifactError(
                f"{path} is a symbolic link; kvhub reads only regular files of an artifact "
                "(replace the link by a copy of the file)"
            ) from None
        raise ArtifactError(f"cannot read {path} ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ArtifactError(f"{path} is not a regular file; an artifact holds only regular files")
    return os.fdopen(fd, "rb")


def regular_files(directory: str | os.PathLike, *, recursive: bool = True) -> dict[str, Path]:
    """``{relative posix path: path}`` of an artifact directory's files, sorted.

    Names starting with ``.`` (at any depth, e.g. a Hub download's ``.cache/``) are not part of an
    artifact.  A symbolic link anywhere else is an ArtifactError, and so is anything that is neither
    a file nor a directory: nothing is followed, nothing is silently left out.
    """
    directory = Path(directory)
    files = {}
    for top, dirnames, filenames in os.walk(directory):
        current = Path(top)
        for name in [*dirnames, *filenames]:
            if not name.startswith(".") and (current / name).is_symlink():
                raise ArtifactError(
                    f"{current / name} is a symbolic link; kvhub copies only regular files of an artifact "
                    "(replace the link by a copy of the file, or remove it)"
                )
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if recursive else []
        for name in filenames:
            path = current / name
            if name.startswith("."):
                continue
            if not path.is_file():
                raise ArtifactError(f"{path} is not a regular file; an artifact holds only regular files")
            files[path.relative_to(directory).as_posix()] = path
    return dict(sorted(files.items()))


def copy_regular(source: str | os.PathLike, destination: Path, *, refuse_hard_links: bool = False) -> str:
    """Copy one regular file (never through a symbolic link), fsync it; returns the sha256 of the bytes.

    ``refuse_hard_links``: a source with more than one name (st_nlink > 1) is an ArtifactError: a hard
    link to someone else's file (``ln ~/secret.txt DIR/leak.png``) is a regular file, and would be
    stored and published like one.
    """
    digest = hashlib.sha256()
    with open_regular(source) as reader:
        links = os.fstat(reader.fileno()).st_nlink
        if refuse_hard_links and links > 1:
            raise ArtifactError(
                f"{source} has {links} hard links (other names for the same file elsewhere); kvhub "
                "stores only files that belong to the artifact alone. Replace it by a copy "
                "(`cp FILE FILE.new && mv FILE.new FILE`); nothing was stored"
            )
        destination.parent.mkdir(parents=True, exist_ok=True)
        with open(destination, "wb") as writer:
            while chunk := reader.read(_CHUNK):
                digest.update(chunk)
                writer.write(chunk)
            writer.flush()
            os.fsync(writer.fileno())
    return digest.hexdigest()
