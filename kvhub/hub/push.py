"""push: one commit with the artifact and its model card on a branch, tagged ``v<version>``."""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvhub import __version__
from kvhub.artifact import CARD_FILE, METADATA_FILE, copy_regular, is_figure_name, publishable_files
from kvhub.hub.card import base_models, card_is_pristine, model_card
from kvhub.errors import ConfigError, HubConflictError, HubOfflineError
from kvhub.hub.client import _api, hub_errors, hub_settings, parse_repo_ref
from kvhub.hub.verify import series_key, verify_artifact

CARD_MODES = ("auto", "keep", "replace")


def version_tag(version) -> str:
    """The Hub tag of a store version: 'v3'."""
    return f"v{version.version}"


def tag_number(revision: str) -> int | None:
    """The version number a Hub tag written by :func:`version_tag` carries ('v3' -> 3); None for other revisions."""
    match = re.fullmatch(r"v(\d+)", revision)
    return int(match.group(1)) if match else None


def _publication(store, version, repo_id: str, tag: str):
    """The store's record of ``version`` in ``repo_id`` (preferring the one at ``tag``), or None."""
    pubs = [p for p in store.publications(version) if p["repo_id"] == repo_id]
    return next((p for p in pubs if p["revision"] == tag), pubs[0] if pubs else None)


@dataclass
class PushResult:
    """What :func:`push` did.  ``card``: written / replaced / unchanged / kept (edited on the Hub)."""

    repo_id: str
    tag: str
    commit_sha: str
    branch: str
    url: str
    already_published: bool = False
    card: str = "unchanged"
    notes: list[str] = field(default_factory=list)


@dataclass
class _Remote:
    branches: dict[str, str]
    tags: dict[str, str]
    private: bool
    head_metadata: dict | None = None
    head_card: str | None = None


def push(store, ref: str, repo_id: str, *, private: bool = False, branch: str | None = None, card: str = "auto",
         token: str | None = None, base_model: tuple[str, str] | None = None) -> PushResult:
    """Publish the version ``ref`` names to ``repo_id``: one commit on ``branch``, tagged ``v{version}``.

    Idempotent: a version already published there (per the store, or per the tag on the Hub) is not
    pushed again.  ``card``: "auto" replaces README.md only if kvhub wrote it and nobody edited it since,
    "keep" never touches an existing README.md, "replace" always writes the generated card.
    ``base_model``: Hub ids (source, target) for the card when the mapper names local models that
    kvhub cannot map to Hub ids (kvhub.hub.card.base_models).
    """
    repo_id, _ = parse_repo_ref(repo_id)
    if card not in CARD_MODES:
        raise ConfigError(f"card must be one of {', '.join(CARD_MODES)}, not {card!r}")
    branch = branch or "main"
    version = store.resolve(ref)
    artifact = Path(store.artifact_path(version))
    metadata = verify_artifact(artifact)
    bases = base_models(metadata, base_model)  # refuses a local path before any Hub traffic
    tag = version_tag(version)
    settings = hub_settings()
    url = f"{settings.endpoint}/{repo_id}/tree/{tag}"
    if (pub := _publication(store, version, repo_id, tag)) is not None:
        label = pub["revision"] or tag
        return PushResult(repo_id, label, pub["commit_sha"] or "", branch,
                          f"{settings.endpoint}/{repo_id}/tree/{label}", already_published=True)
    if settings.offline:
        raise HubOfflineError(f"push to {repo_id}: HF_HUB_OFFLINE=1 forbids publishing; unset it and retry",
                              repo_id=repo_id)
    api = _api(settings, token)
    aftermath = f"{ref} is not recorded as published; re-run the same `kvhub push` to retry"
    with hub_errors("push to", repo_id=repo_id, revision=branch, token=token, settings=settings,
                    aftermath=aftermath):
        api.create_repo(repo_id, private=private, exist_ok=True)
        remote = _remote_state(api, repo_id, branch)
        if private and not remote.private:
            raise HubConflictError(f"{repo_id} exists and is public; --private cannot hide it. Make it private on "
                                   "the Hub first or push to another repository", repo_id=repo_id)
        _check_same_series(repo_id, remote.head_metadata, metadata)
        if tag in remote.tags:
            commit = _existing_tag(api, repo_id, tag, remote.tags[tag], metadata)
            store.add_publication(version, repo_id, tag, commit)
            return PushResult(repo_id, tag, commit, branch, url, already_published=True,
                              notes=[f"{repo_id} already had {tag} with these weights; recorded it"])
        files = publishable_files(artifact, metadata)  # the format's files and figures: nothing else leaves
        images = [name for name in files if is_figure_name(name)]
        text, card_action, notes = _card_for_push(metadata, remote.head_card, card, repo_id=repo_id, tag=tag,
                                                  images=images, base_model=bases,
                                                  measurements=store.metrics(version))
        with tempfile.TemporaryDirectory(prefix="kvhub-push-") as tmp:
            for name in files:
                copy_regular(artifact / name, Path(tmp) / name)
            if text is not None:
                (Path(tmp) / CARD_FILE).write_text(text, encoding="utf-8")
            if branch not in remote.branches:
                api.create_branch(repo_id, branch=branch, exist_ok=True)
            info = api.upload_folder(
                repo_id=repo_id, folder_path=tmp, revision=branch, commit_message=_commit_title(metadata, tag),
                commit_description=f"tensors sha256 {metadata['tensors']['sha256']}; kvhub {__version__}",
            )
        api.create_tag(repo_id, tag=tag, revision=info.oid, tag_message=_commit_title(metadata, tag))
    store.add_publication(version, repo_id, tag, info.oid)
    return PushResult(repo_id, tag, info.oid, branch, url, card=card_action, notes=notes)


def _commit_title(metadata: dict, tag: str) -> str:
    calibration = (metadata.get("calibration") or {}).get("name")
    return f"kvhub {tag}: {metadata['source']['model_id']} -> {metadata['target']['model_id']} ({calibration})"


def _remote_file(api, repo_id: str, revision: str, filename: str, cache_dir: str) -> bytes | None:
    from huggingface_hub.errors import RemoteEntryNotFoundError

    try:
        return Path(api.hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir)).read_bytes()
    except RemoteEntryNotFoundError:
        return None


def _remote_state(api, repo_id: str, branch: str) -> _Remote:
    refs = api.list_repo_refs(repo_id)
    info = api.model_info(repo_id)
    remote = _Remote({r.name: r.target_commit for r in refs.branches}, {r.name: r.target_commit for r in refs.tags},
                     bool(info.private))
    head = remote.branches.get(branch) or remote.branches.get("main")
    if head is None:
        return remote
    with tempfile.TemporaryDirectory(prefix="kvhub-remote-") as tmp:
        raw = _remote_file(api, repo_id, head, METADATA_FILE, tmp)
        card = _remote_file(api, repo_id, head, CARD_FILE, tmp)
    remote.head_metadata = _json_object(raw)
    remote.head_card = card.decode("utf-8", errors="replace") if card is not None else None
    return remote


def _json_object(raw: bytes | None) -> dict | None:
    """A remote mapper.json as a dict; None when missing or not a JSON object (it is then not ours)."""
    try:
        data = json.loads(raw) if raw else None
    except (UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _existing_tag(api, repo_id: str, tag: str, commit: str, metadata: dict) -> str:
    """The tag's commit if it holds these very weights; HubConflictError otherwise."""
    with tempfile.TemporaryDirectory(prefix="kvhub-remote-") as tmp:
        raw = _remote_file(api, repo_id, commit, METADATA_FILE, tmp)
    remote = _json_object(raw) or {}
    theirs = remote.get("tensors").get("sha256") if isinstance(remote.get("tensors"), dict) else None
    if theirs == metadata["tensors"]["sha256"] and series_key(remote) == series_key(metadata):
        return commit
    raise HubConflictError(
        f"{repo_id} already has a tag {tag} holding other weights (tensors sha256 {theirs}); tags never move. "
        "Another store published its own version there: push to a repository of your own",
        repo_id=repo_id, revision=tag)


def _check_same_series(repo_id: str, remote: dict | None, metadata: dict) -> None:
    """One repository holds one (source, target, calibration) series, so tags v1, v2, ... stay unambiguous."""
    if remote is None or "source" not in remote:
        return
    if series_key(remote) != series_key(metadata):
        theirs, ours = ("{} -> {} ({})".format(*series_key(m)) for m in (remote, metadata))
        raise HubConflictError(f"{repo_id} holds mappers for {theirs}; this one is {ours}. Push it to a repository "
                               "of its own (one repository per source, target and calibration set)",
                               repo_id=repo_id)


def _card_for_push(metadata: dict, remote_card: str | None, mode: str, *, repo_id: str, tag: str,
                   images: list[str], base_model: tuple[str, str],
                   measurements: list[dict]) -> tuple[str | None, str, list[str]]:
    """(README text to upload or None, what happens to the card, notes for the user)."""
    text = model_card(metadata, repo_id=repo_id, version_tag=tag, images=images, base_model=base_model,
                      measurements=measurements)
    if remote_card is None:
        return text, "written", []
    if remote_card == text:
        return text, "unchanged", []
    if mode == "replace" or (mode == "auto" and card_is_pristine(remote_card)):
        return text, "replaced", []
    if mode == "keep":
        return None, "kept", [f"README.md on {repo_id} left as it is (--card keep)"]
    return None, "kept", [
        f"README.md on {repo_id} was edited on the Hub, so it was kept: {tag} carries the edited card. "
        "Re-push with --card replace to overwrite it with the generated card."
    ]


