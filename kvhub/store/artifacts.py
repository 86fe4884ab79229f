"""Content-addressed artifact directories.

Address: the sha256 of the directory's manifest, the text ``"<sha256 of file>  <relative path>\\n"``
for every regular file, sorted by path (``sha256sum`` format, POSIX separators).  Names starting with
``.`` (at any depth, e.g. a Hub download's ``.cache/``) are not part of an artifact.  mapper.json is
hashed like any file, so two artifacts with the same tensors but other metadata get two addresses.

Layout under the root::

    sha256/<2 hex>/<64 hex>/   stored artifacts, files read-only
    .tmp/                      copies, pull stagings and removals in progress
    .lock                      writers hold it shared, gc holds it exclusive

``.tmp`` and ``.lock`` are checked with lstat (``.lock`` opened with O_NOFOLLOW): a symbolic link at
either is refused before anything is read or deleted, so a planted link never makes gc empty, or a
writer write into, a directory outside the store.

A copy is written under ``.tmp``, fsynced, then renamed into place, so a stored directory is always
complete; a killed writer leaves only ``.tmp`` debris.  Writers hold the shared lock from the start of
the copy until their database row is committed (:meth:`ArtifactStore.writing`), so gc, holding the
exclusive lock, sees no write in flight: every ``.tmp`` entry is debris and every stored directory
without a row is unreferenced.  Locks are POSIX ``flock`` locks (local disks, NFSv4).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import stat
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Literal, overload

from kvhub.artifact import copy_regular, fsync_dir, regular_files, sha256_file
from kvhub.artifact.files import is_no_space, no_space_error
from kvhub.errors import ArtifactError, IntegrityError, StoreError

OBJECTS_DIR = "sha256"
TMP_DIR = ".tmp"
LOCK_FILE = ".lock"
_LOCATION = re.compile(rf"{OBJECTS_DIR}/([0-9a-f]{{2}})/(\1[0-9a-f]{{62}})")


@dataclass
class GcReport:
    """What gc removed (or would remove, with ``dry_run``); ``missing``: referenced but absent artifacts."""

    dry_run: bool
    artifacts: list[tuple[str, int]] = field(default_factory=list)
    temporaries: list[tuple[str, int]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.artifacts + self.temporaries)


@dataclass(frozen=True)
class StoredArtifact:
    """An artifact in the store: content address, location under the root, total bytes, file hashes."""

    sha256: str
    location: str
    bytes: int
    files: dict[str, str]


def manifest_sha256(files: dict[str, str]) -> str:
    """sha256 of the manifest text of ``{relative path: file sha256}``."""
    text = "".join(f"{files[name]}  {name}\n" for name in sorted(files))
    return hashlib.sha256(text.encode()).hexdigest()


def artifact_files(directory: Path) -> dict[str, Path]:
    """``{relative posix path: path}`` of the regular files of an artifact directory (see module doc).

    A symbolic link in it is an ArtifactError: nothing is ever copied through one.
    """
    return regular_files(directory)


def copy_hashing(source: Path, destination: Path, *, refuse_hard_links: bool = False) -> str:
    """Copy one regular file (never through a symbolic link), fsync it; returns the sha256 of the bytes.
    ``refuse_hard_links``: a file with other names (st_nlink > 1) is an ArtifactError (:meth:`ArtifactStore.put`)."""
    return copy_regular(source, destination, refuse_hard_links=refuse_hard_links)


def _make_read_only(directory: Path) -> None:
    for path in artifact_files(directory).values():
        path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)


_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


def _read_only(root: Path, exc: OSError) -> StoreError:
    return StoreError(
        f"the artifact store {root} is read-only ({exc.strerror}): list, show and load work, this command "
        "writes; run it where the store is writable"
    )


def _open_lock(lock: Path, *, write: bool) -> int:
    """The lock file's descriptor.  A writer's is opened for writing, so a read-only store is refused before
    anything else; a reader's (gc --dry-run) falls back to read-only (flock needs no write access).
    O_NOFOLLOW: a link planted at .lock would make every writer create or open its target."""
    no_follow = getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(lock, os.O_RDWR | os.O_CREAT | no_follow, 0o666)
    except OSError as exc:
        if write or exc.errno not in _READ_ONLY:
            raise
        return os.open(lock, os.O_RDONLY | no_follow)


def _refused_entry(path: Path, what: str) -> StoreError:
    return StoreError(
        f"{path} is {what}; the artifact store holds only real directories and files. Nothing was "
        f"read or deleted; remove it (`rm {path}`) and run the command again"
    )


def _remove_tree(path: Path) -> None:
    """Delete a file or directory tree (read-only files go too: POSIX checks the directory's mode)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class ArtifactStore:
    """The artifact directory tree rooted at ``root`` (created on first write)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    # ---- locations -----------------------------------------------------------------------------
    def path(self, location: str) -> Path:
        """Absolute path of a stored location such as ``sha256/ab/ab12...``.

        ``location`` comes from the database, which whoever shares the store can write: anything but
        the exact form ``sha256/<2 hex>/<64 hex>`` (no ``..``, no absolute path, no link in between)
        is refused, so no path a row names can lead outside the store.
        """
        path = self._entry(location)
        if path.is_symlink():
            raise StoreError(
                f"{path} is a symbolic link; the artifact store holds only real directories. "
                "Nothing was read or deleted; remove the version (`kvhub rm REF`) and re-import it"
            )
        return path

    def _entry(self, location: str) -> Path:
        """The path of a location of the exact form ``sha256/<2 hex>/<64 hex>``, whose parents inside the
        store are no links (StoreError otherwise)."""
        if not self.is_location(location):
            raise StoreError(
                f"the store's database names the artifact location {location!r}, which is not a content address "
                f"inside {self.root}; the row was edited by hand or by another program. Nothing was read or "
                "deleted; remove the version (`kvhub rm REF`) and re-import or pull it"
            )
        path = self.root / location
        for parent in (self.root / OBJECTS_DIR, path.parent):
            if parent.is_symlink():
                raise StoreError(
                    f"{parent} is a symbolic link; the artifact store holds only real directories. "
                    "Nothing was read or deleted; replace the link by a directory"
                )
        return path

    @staticmethod
    def is_location(location) -> bool:
        """True for a location of the form the store writes, ``sha256/<2 hex>/<64 hex>``."""
        return isinstance(location, str) and bool(_LOCATION.fullmatch(location))

    @staticmethod
    def location_of(sha256: str) -> str:
        return f"{OBJECTS_DIR}/{sha256[:2]}/{sha256}"

    def locations(self) -> list[str]:
        """Every stored artifact directory, referenced or not."""
        objects = self.root / OBJECTS_DIR
        if not objects.is_dir():
            return []
        found = (
            f"{OBJECTS_DIR}/{prefix.name}/{entry.name}"
            for prefix in objects.iterdir()
            if prefix.is_dir() and not prefix.is_symlink()
            for entry in prefix.iterdir()
        )
        return sorted(location for location in found if _LOCATION.fullmatch(location))

    def temporaries(self) -> list[Path]:
        """Everything under ``.tmp`` (debris of killed writers, when no write is in flight).

        ``.tmp`` itself must be a real directory: a symbolic link there (which would make gc empty
        whatever it points to) is a StoreError, raised before anything is read or deleted."""
        tmp = self._tmp_dir(create=False)
        return sorted(tmp.iterdir()) if tmp is not None else []

    @overload
    def _tmp_dir(self, *, create: Literal[True] = True) -> Path: ...
    @overload
    def _tmp_dir(self, *, create: bool) -> Path | None: ...
    def _tmp_dir(self, *, create: bool = True) -> Path | None:
        """``<root>/.tmp``, checked with lstat: a real directory (created when ``create``), never a link
        or a file; None when it does not exist and ``create`` is False."""
        tmp = self.root / TMP_DIR
        try:
            mode = os.lstat(tmp).st_mode
        except FileNotFoundError:
            if not create:
                return None
            self.root.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(tmp)
            mode = os.lstat(tmp).st_mode
        if stat.S_ISLNK(mode):
            raise _refused_entry(tmp, "a symbolic link")
        if not stat.S_ISDIR(mode):
            raise _refused_entry(tmp, "not a directory")
        return tmp

    def size(self, path: Path) -> int:
        """Total bytes of the regular files below ``path`` (a link counts 0: it is never followed)."""
        if path.is_symlink():
            return 0
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())

    # ---- locks ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the shared lock: gc waits until the caller's artifact has its database row."""
        with self._lock(exclusive=False, timeout_s=None):
            yield

    @contextlib.contextmanager
    def collecting(self, *, timeout_s: float = 120.0, write: bool = True) -> Iterator[None]:
        """Hold the exclusive lock: no artifact write is in flight while it is held.  ``write``: the caller
        deletes (a read-only store is then refused at once); False for a dry run, which only reads."""
        with self._lock(exclusive=True, timeout_s=timeout_s, write=write):
            yield

    @contextlib.contextmanager
    def _lock(self, *, exclusive: bool, timeout_s: float | None, write: bool = True) -> Iterator[None]:
        try:
            import fcntl
        except ImportError as exc:  # Windows
            raise StoreError("the artifact store needs POSIX file locks (fcntl); use Linux or macOS") from exc
        lock = self.root / LOCK_FILE
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = _open_lock(lock, write=write)
        except OSError as exc:
            if os.path.islink(lock):
                raise _refused_entry(lock, "a symbolic link") from None
            if write and exc.errno in _READ_ONLY:
                raise _read_only(self.root, exc) from None
            raise StoreError(
                f"cannot open the store's lock file {lock} ({exc.strerror}); check that the store directory is writable"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _refused_entry(lock, "not a regular file")
        try:
            mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            self._acquire(fd, mode, timeout_s)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _acquire(self, fd: int, mode: int, timeout_s: float | None) -> None:
        import fcntl

        if timeout_s is None:
            fcntl.flock(fd, mode)
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StoreError(
                        f"another kvhub process has been writing to {self.root} for {timeout_s:.0f} s; "
                        "retry when it has finished"
                    ) from None
                time.sleep(0.05)

    # ---- writing -------------------------------------------------------------------------------
    def put(
        self, source: str | os.PathLike, *, check: Callable[[Path, dict[str, str]], None] | None = None
    ) -> StoredArtifact:
        """Copy ``source`` into the store (call inside :meth:`writing`); returns where it landed.

        ``check(copy_dir, {path: sha256})`` runs on the complete copy before it is renamed into place
        and may raise to reject it.  An artifact already stored under the same address is reused if it
        still verifies, replaced otherwise.
        """
        source = Path(source)
        files = artifact_files(source) if source.is_dir() else {}
        if not files:
            raise ArtifactError(
                f"{source} is not an artifact directory (no files); pass the directory `kvhub fit --out` wrote"
            )
        tmp = self._tmp_dir() / uuid.uuid4().hex
        try:
            hashes = {name: copy_hashing(path, tmp / name, refuse_hard_links=True) for name, path in files.items()}
            if check is not None:
                check(tmp, hashes)
            digest = manifest_sha256(hashes)
            size = sum((tmp / name).stat().st_size for name in hashes)
            stored = StoredArtifact(digest, self.location_of(digest), size, hashes)
            self._install(tmp, stored)
        except OSError as exc:
            if exc.errno in _READ_ONLY:
                raise _read_only(self.root, exc) from None
            if not is_no_space(exc):
                raise
            raise no_space_error(
                self.root,
                then="nothing was stored. Free some space (`kvhub gc` removes unreferenced artifacts) and import again",
            ) from exc
        finally:
            if os.path.lexists(tmp):
                _remove_tree(tmp)
        return stored

    @contextlib.contextmanager
    def staging(self, *, prefix: str) -> Iterator[Path]:
        """A new empty directory under ``.tmp``, removed on exit, with the shared lock held meanwhile:
        gc never deletes it while in use, and removes it if the process is killed (``kvhub pull``)."""
        with self.writing():
            path = self._tmp_dir() / f"{prefix}{uuid.uuid4().hex}"
            path.mkdir()
            try:
                yield path
            finally:
                _remove_tree(path)

    def _install(self, tmp: Path, stored: StoredArtifact) -> None:
        final = self.path(stored.location)
        if final.is_dir():
            try:
                self.verify(stored.location, sha256=stored.sha256)
                return
            except ArtifactError:
                self.remove(stored.location)  # corrupt copy of the same content: replace it
        _make_read_only(tmp)
        for directory in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
            fsync_dir(directory)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # anything but "a concurrent writer stored the same content first"
                raise
        fsync_dir(final.parent)

    def remove(self, location: str) -> None:
        """Delete a stored artifact: renamed into ``.tmp`` first, so it vanishes at once.  A symbolic link
        in its place is unlinked (what it points to is never touched)."""
        path = self._entry(location)
        if path.is_symlink():
            path.unlink()
            return
        if not path.exists():
            return
        try:
            trash = self._tmp_dir() / f"{uuid.uuid4().hex}.removing"
            os.rename(path, trash)
        except OSError as exc:
            if exc.errno not in _READ_ONLY:
                raise
            raise _read_only(self.root, exc) from None
        _remove_tree(trash)

    def remove_temporary(self, path: Path) -> None:
        """Delete one ``.tmp`` entry (only while holding :meth:`collecting`)."""
        _remove_tree(path)

    # ---- reading -------------------------------------------------------------------------------
    def verify(self, location: str, *, sha256: str, trusted: dict[str, str] | None = None) -> Path:
        """Raise unless the stored directory's manifest hashes to ``sha256``; returns its path.

        Files named in ``trusted`` are not re-read; their given hash enters the manifest instead (for a
        file its reader verifies anyway, e.g. the tensors, which Mapper.load hashes).
        """
        path = self.path(location)
        if not path.is_dir():
            raise ArtifactError(
                f"artifact {sha256[:12]} is missing from {self.root}; it was deleted outside kvhub. "
                "Re-import it (`kvhub import DIR`), pull it (`kvhub pull`), or remove the version (`kvhub rm REF`)"
            )
        trusted = trusted or {}
        files = artifact_files(path)
        hashes = {name: trusted.get(name) or sha256_file(file) for name, file in files.items()}
        actual = manifest_sha256(hashes)
        if actual != sha256:
            raise IntegrityError(
                f"artifact {path} has manifest sha256 {actual}, the store records {sha256}: files were "
                "modified, added or removed. Re-import the artifact (`kvhub import DIR`) or pull it again"
            )
        return path
