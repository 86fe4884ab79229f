"""The copies of pulled mappers in the Hugging Face cache, and the only links kvhub follows there.

A pull downloads into the Hugging Face cache and registers a verified copy in the store, so every pulled
version is on disk twice.  Once registered, the cache's copy only serves an offline re-pull; ``kvhub gc
--hub-cache`` drops the copies whose tensors the store holds (huggingface_hub's own ``delete_revisions``,
which removes a revision's snapshot and the blobs no other revision uses).

The cache may be shared, and whoever can write into it can plant links in a snapshot.  huggingface_hub's
deletion unlinks whatever a snapshot entry links to, so a revision is read or deleted only when it is the
cache's own layout (:func:`foreign_entry`): real directories from the cache root down to every snapshot
file, and every link a snapshot entry linking to a regular file in its repository's ``blobs/`` (or, through
that blob, the cache-wide shared blob store, ``<cache>/blobs/<2 hex>/<64 hex>``).  Any other revision is
skipped whole and named, nothing of it read or deleted; before deleting, every path huggingface_hub would
delete is checked to lie in the cache with no link above it.  The pull reads a cached file through
:func:`cached_blob`, the same rule.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from kvhub.artifact import METADATA_FILE, copy_regular
from kvhub.errors import HubError, IntegrityError, KVHubError

log = logging.getLogger(__name__)

_SHARED_BLOB = re.compile(r"([0-9a-f]{2})/(\1[0-9a-f]{62})")  # <cache>/blobs/<2 hex>/<64 hex>


@dataclass(frozen=True)
class CachedCopy:
    """One revision of a repository in the Hugging Face cache whose mapper the store holds as ``ref``."""

    repo_id: str
    commit: str
    bytes: int
    ref: str


@dataclass(frozen=True)
class SkippedCopy:
    """A cached revision with a mapper.json that is not the cache's own layout: neither read nor deleted."""

    repo_id: str
    commit: str
    path: str
    reason: str


@dataclass
class CacheCopies:
    """What ``gc --hub-cache`` found: the copies the store holds, and the revisions it refused to touch."""

    copies: list[CachedCopy] = field(default_factory=list)
    skipped: list[SkippedCopy] = field(default_factory=list)


def _link_problem(snapshot: Path, entry: Path) -> str | None:
    """Why the link ``entry`` of ``snapshot`` is not the cache's own (None when it is): its first hop must be
    an entry of the repository's ``blobs/`` and its target a regular file there or in the shared blob store."""
    repo = snapshot.parent.parent
    for directory in (repo, repo / "blobs"):
        problem = _not_a_directory(directory)
        if problem is not None:
            return f"links into {directory}, which {problem}"
    blobs = os.path.realpath(repo / "blobs")
    first = Path(os.path.abspath(entry.parent / os.readlink(entry)))
    target = Path(os.path.realpath(entry))
    shared = Path(os.path.realpath(repo.parent / "blobs"))
    in_shared = target.parent.parent == shared and bool(_SHARED_BLOB.fullmatch(target.relative_to(shared).as_posix()))
    if os.path.realpath(first.parent) != blobs or not (str(target.parent) == blobs or in_shared):
        return f"links to {target}, outside this repository's blobs in the Hugging Face cache"
    try:
        regular = stat.S_ISREG(os.stat(target).st_mode)
    except OSError:
        return f"links to {target}, which is missing"
    return None if regular else f"links to {target}, which is not a regular file"


def repo_blob(snapshot: Path, entry: Path) -> Path | None:
    """The entry of the repository's ``blobs/`` that the snapshot link ``entry`` points to (what deleting a
    revision removes with it: a name in the cache, never the shared store's file behind it); None when
    ``entry`` is no link or not the cache's own (:func:`cached_blob`)."""
    if not entry.is_symlink() or _link_problem(snapshot, entry) is not None:
        return None
    return Path(os.path.abspath(entry.parent / os.readlink(entry)))


def cached_blob(snapshot: Path, path: Path) -> Path:
    """The file a snapshot entry stands for: ``path`` itself when it is no link, else the blob it links to,
    which must lie in this repository's ``blobs/`` of the Hugging Face cache (or the shared store behind it):
    the only link kvhub follows is the cache's own layout.  IntegrityError naming ``path`` otherwise."""
    if not path.is_symlink():
        return path
    problem = _link_problem(snapshot, path)
    if problem is not None:
        raise IntegrityError(
            f"{path} {problem}; the cache was tampered with: delete it (`hf cache delete`) and pull again"
        )
    return Path(os.path.realpath(path))


def _not_a_directory(path: Path) -> str | None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return f"is a symbolic link (to {os.path.realpath(path)})"
    return None if stat.S_ISDIR(mode) else "is not a directory"


def foreign_entry(repo, revision) -> tuple[Path, str] | None:
    """(path, what is wrong) for the first entry of a cached revision (huggingface_hub's CachedRepoInfo and
    CachedRevisionInfo) that is not the cache's own layout; None when every one is (see the module doc)."""
    snapshot = Path(revision.snapshot_path)
    top = Path(repo.repo_path)
    refs = [top / "refs" / ref for ref in revision.refs]
    for directory in (top, top / "snapshots", top / "blobs", top / "refs", snapshot, *(r.parent for r in refs)):
        problem = _not_a_directory(directory)
        if problem is not None:
            return directory, problem
    for ref in refs:
        if os.path.realpath(ref.parent) != os.path.abspath(ref.parent):
            return ref, "lies under a symbolic link"
    for current, dirnames, filenames in os.walk(snapshot):
        for name in dirnames:
            if os.path.islink(os.path.join(current, name)):
                return Path(current, name), f"is a symbolic link (to {os.path.realpath(os.path.join(current, name))})"
        for name in filenames:
            entry = Path(current, name)
            mode = os.lstat(entry).st_mode
            problem = _link_problem(snapshot, entry) if stat.S_ISLNK(mode) else None
            if problem is None and not (stat.S_ISLNK(mode) or stat.S_ISREG(mode)):
                problem = "is not a regular file"
            if problem is not None:
                return entry, problem
    return None


def _skipped(repo, revision, path: Path, problem: str) -> SkippedCopy:
    commit = revision.commit_hash
    reason = (
        f"{path} {problem}; {repo.repo_id}@{commit[:12]} is not a plain Hugging Face cache entry, so nothing of it "
        f"was read or deleted. Look at it (`ls -l {path}`): remove what you did not put there, or delete the "
        "revision by hand (`hf cache delete`)"
    )
    return SkippedCopy(repo.repo_id, commit, str(path), reason)


def stored_copies(store, *, cache_dir: str) -> CacheCopies:
    """The cached model revisions holding a mapper.json whose tensors (sha256, series) a store version has,
    and the revisions with a mapper.json that are not the cache's own layout (skipped, nothing read)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    found = CacheCopies()
    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return found
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in sorted(repo.revisions, key=lambda r: r.commit_hash):
            snapshot = Path(revision.snapshot_path)
            if not os.path.lexists(snapshot / METADATA_FILE):
                continue
            foreign = foreign_entry(repo, revision)
            if foreign is not None:
                skipped = _skipped(repo, revision, *foreign)
                log.info("%s", skipped.reason)
                found.skipped.append(skipped)
                continue
            try:
                version = _holding(store, cached_blob(snapshot, snapshot / METADATA_FILE))
            except KVHubError as exc:  # not a kvhub mapper, or one this store cannot hold
                log.debug("%s@%s is no stored mapper: %s", repo.repo_id, revision.commit_hash[:12], exc)
                continue
            if version is not None:
                found.copies.append(CachedCopy(repo.repo_id, revision.commit_hash, revision.size_on_disk, version.ref))
    return found


def _holding(store, metadata: Path):
    """The store version with the tensors a cached mapper.json names (the snapshot's entries are links into
    the cache's blobs, which artifact reading refuses: the blob, checked by :func:`cached_blob`, is read
    without following links into a private copy)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvhub-cached-") as tmp:
        copy_regular(metadata, Path(tmp) / METADATA_FILE)
        return store.registered_as(tmp)


def drop_copies(copies: list[CachedCopy], *, cache_dir: str) -> None:
    """Delete these revisions from the Hugging Face cache (snapshots, and blobs no other revision uses).

    The cache is scanned again and each revision checked again (:func:`foreign_entry`), and every path the
    deletion would remove must lie in the cache with no link above it: HubError, nothing deleted, otherwise."""
    from huggingface_hub import scan_cache_dir

    if not copies:
        return
    info = scan_cache_dir(cache_dir)
    commits = {c.commit for c in copies}
    for repo in info.repos:
        for revision in repo.revisions:
            foreign = foreign_entry(repo, revision) if revision.commit_hash in commits else None
            if foreign is not None:
                reason = _skipped(repo, revision, *foreign).reason
                raise HubError(f"{reason}. It changed after gc listed it: nothing was deleted")
    strategy = info.delete_revisions(*commits)
    root = os.path.realpath(Path(cache_dir).expanduser())
    for path in (
        *strategy.blobs,
        *strategy.refs,
        *strategy.repos,
        *strategy.snapshots,
        *getattr(strategy, "files", ()),
    ):
        parent = os.path.abspath(Path(path).parent)
        if os.path.realpath(parent) != parent or os.path.commonpath([root, parent]) != root:
            raise HubError(
                f"{path} lies outside the Hugging Face cache {root} or under a symbolic link; gc --hub-cache "
                "deletes only inside the cache, so nothing was deleted. Look at it (`ls -l` on each folder above it)"
            )
    strategy.execute()
