"""What a Hub repository holds for a push: its branches and tags, the mapper.json and card at a branch's
head, and which tag (if any) already holds a version's weights.  Tags are ``v<version>`` (:func:`version_tag`).

``job`` below is the push being made (:class:`kvhub.hub.push._Push`): these read its ``repo_id``,
``metadata`` (mapper.json as published) and ``local_metadata`` (as stored).
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvhub.artifact import CARD_FILE, METADATA_FILE, parse_json
from kvhub.errors import HubConflictError
from kvhub.hub.verify import series_key


def version_tag(version) -> str:
    """The Hub tag of a store version: 'v3'."""
    return f"v{version.version}"


def tag_number(revision: str) -> int | None:
    """The version number a Hub tag written by :func:`version_tag` carries ('v3' -> 3); None for other revisions."""
    match = re.fullmatch(r"v(\d+)", revision)
    return int(match.group(1)) if match else None


@dataclass
class Remote:
    branches: dict[str, str]
    tags: dict[str, str]
    private: bool
    head_metadata: dict | None = None
    head_card: str | None = None
    head_files: list[str] = field(default_factory=list)


def remote_file(api, repo_id: str, revision: str, filename: str, cache_dir: str) -> bytes | None:
    from huggingface_hub.errors import RemoteEntryNotFoundError

    try:
        return Path(api.hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir)).read_bytes()
    except RemoteEntryNotFoundError:
        return None


def remote_state(api, repo_id: str, branch: str) -> Remote:
    refs = api.list_repo_refs(repo_id)
    info = api.model_info(repo_id)
    remote = Remote(
        {r.name: r.target_commit for r in refs.branches},
        {r.name: r.target_commit for r in refs.tags},
        bool(info.private),
    )
    head = remote.branches.get(branch) or remote.branches.get("main")
    if head is None:
        return remote
    with tempfile.TemporaryDirectory(prefix="kvhub-remote-") as tmp:
        raw = remote_file(api, repo_id, head, METADATA_FILE, tmp)
        card = remote_file(api, repo_id, head, CARD_FILE, tmp)
    remote.head_files = api.list_repo_files(repo_id, revision=head)
    remote.head_metadata = json_object(raw)
    remote.head_card = card.decode("utf-8", errors="replace") if card is not None else None
    return remote


def json_object(raw: bytes | None) -> dict | None:
    """A remote mapper.json as a dict; None when missing or not a JSON object (it is then not ours)."""
    try:
        data = parse_json(raw) if raw else None
    except (UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def existing_tag(api, repo_id: str, tag: str, commit: str, job) -> str:
    """The tag's commit if it holds these very weights; HubConflictError otherwise."""
    with tempfile.TemporaryDirectory(prefix="kvhub-remote-") as tmp:
        raw = remote_file(api, repo_id, commit, METADATA_FILE, tmp)
    remote = json_object(raw) or {}
    theirs = remote.get("tensors").get("sha256") if isinstance(remote.get("tensors"), dict) else None
    if theirs == job.metadata["tensors"]["sha256"] and same_series(remote, job):
        return commit
    raise HubConflictError(
        f"{repo_id} already has a tag {tag} holding other weights (tensors sha256 {theirs}); tags never move. "
        "Another store published its own version there: push to a repository of your own",
        repo_id=repo_id,
        revision=tag,
    )


def tag_with_same_tensors(api, job, remote: Remote) -> tuple[str, str] | None:
    """(tag, commit) of a version tag in the repository whose mapper.json names these tensors, or None:
    the same weights imported into another store carry another number, and tagging them again would
    move the branch back to them."""
    wanted = job.metadata["tensors"]["sha256"]
    tags = sorted((t for t in remote.tags if tag_number(t) is not None), key=tag_number)
    with tempfile.TemporaryDirectory(prefix="kvhub-remote-") as tmp:
        for tag in tags:
            found = json_object(remote_file(api, job.repo_id, remote.tags[tag], METADATA_FILE, tmp)) or {}
            tensors = found.get("tensors") if isinstance(found.get("tensors"), dict) else {}
            if tensors.get("sha256") == wanted and same_series(found, job):
                return tag, remote.tags[tag]
    return None


def same_series(remote: dict, job) -> bool:
    """The remote mapper.json is of this series: named by the Hub ids, or (pushed by an older kvhub) by
    the local names."""
    return series_key(remote) in (series_key(job.metadata), series_key(job.local_metadata))


def check_same_series(repo_id: str, remote: dict | None, job) -> None:
    """One repository holds one (source, target, calibration) series, so tags v1, v2, ... stay unambiguous."""
    if remote is None or "source" not in remote:
        return
    if not same_series(remote, job):
        theirs, ours = ("{} -> {} ({})".format(*series_key(m)) for m in (remote, job.metadata))
        raise HubConflictError(
            f"{repo_id} holds mappers for {theirs}; this one is {ours}. Push it to a repository "
            "of its own (one repository per source, target and calibration set)",
            repo_id=repo_id,
        )
