"""The Hugging Face cache's copies of pulled mappers.

A pull downloads into the Hugging Face cache and registers a verified copy in the store, so every pulled
version is on disk twice.  Once registered, the cache's copy only serves an offline re-pull; ``kvhub gc
--hub-cache`` drops the copies whose tensors the store holds (huggingface_hub's own ``delete_revisions``,
which removes a revision's snapshot and the blobs no other revision uses).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvhub.artifact import METADATA_FILE
from kvhub.errors import KVHubError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedCopy:
    """One revision of a repository in the Hugging Face cache whose mapper the store holds as ``ref``."""

    repo_id: str
    commit: str
    bytes: int
    ref: str


def stored_copies(store, *, cache_dir: str) -> list[CachedCopy]:
    """The cached model revisions holding a mapper.json whose tensors (sha256, series) a store version has."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    found = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            if not (revision.snapshot_path / METADATA_FILE).is_file():
                continue
            try:
                version = _holding(store, revision.snapshot_path / METADATA_FILE)
            except KVHubError as exc:  # not a kvhub mapper, or one this store cannot hold
                log.debug("%s@%s is no stored mapper: %s", repo.repo_id, revision.commit_hash[:12], exc)
                continue
            if version is not None:
                found.append(CachedCopy(repo.repo_id, revision.commit_hash, revision.size_on_disk, version.ref))
    return found


def _holding(store, metadata_link):
    """The store version with the tensors a cached mapper.json names (the snapshot's entries are links into
    the cache's blobs, which artifact reading refuses: the file is read from a private copy)."""
    import shutil
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="kvhub-cached-") as tmp:
        shutil.copyfile(metadata_link.resolve(), Path(tmp) / METADATA_FILE)
        return store.registered_as(tmp)


def drop_copies(copies: list[CachedCopy], *, cache_dir: str) -> None:
    """Delete these revisions from the Hugging Face cache (snapshots, and blobs no other revision uses)."""
    from huggingface_hub import scan_cache_dir

    if copies:
        scan_cache_dir(cache_dir).delete_revisions(*(c.commit for c in copies)).execute()
