"""push: one commit with the artifact and its model card on a branch, tagged ``v<version>``."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvhub import __version__
from kvhub.artifact import (
    CARD_FILE,
    FIGURE_SUFFIXES,
    METADATA_FILE,
    copy_regular,
    is_figure_name,
    publishable_files,
)
from kvhub.hub.card import CardLicense, card_is_pristine, card_license, model_card, read_front_matter
from kvhub.hub.identity import base_models, check_base_models, published_metadata
from kvhub.errors import ConfigError, HubConflictError, HubOfflineError
from kvhub.hub.client import _api, hub_errors, hub_settings, parse_repo_ref
from kvhub.hub.remote import (  # version_tag and tag_number stay importable from here
    Remote,
    check_same_series,
    existing_tag,
    json_object,
    remote_file,
    remote_state,
    tag_number,
    tag_with_same_tensors,
    version_tag,
)
from kvhub.hub.verify import verify_artifact

CARD_MODES = ("auto", "keep", "replace")


def _publication(store, version, repo_id: str, tag: str):
    """The store's record of ``version`` in ``repo_id`` (preferring the one at ``tag``), or None."""
    pubs = [p for p in store.publications(version) if p["repo_id"] == repo_id]
    return next((p for p in pubs if p["revision"] == tag), pubs[0] if pubs else None)


@dataclass
class PushResult:
    """What :func:`push` did.  ``card``: written / replaced / unchanged / kept (edited on the Hub).
    ``pull_request``: the URL of the pull request opened instead of a commit (``create_pr``)."""

    repo_id: str
    tag: str
    commit_sha: str
    branch: str
    url: str
    already_published: bool = False
    card: str = "unchanged"
    notes: list[str] = field(default_factory=list)
    pull_request: str | None = None


@dataclass
class _Push:
    """One push being made: the version, what is published of it (mapper.json naming the Hub ids, the
    card's inputs, figures) and where it goes."""

    store: object
    version: object
    repo_id: str
    tag: str
    branch: str
    metadata: dict  # mapper.json as published (kvhub.hub.identity.published_metadata)
    local_metadata: dict  # mapper.json as stored: the same tensors, local names
    bases: tuple[str, str]
    license: CardLicense | None
    figures: dict[str, Path]  # file name -> where it is read from: the artifact's and ``added``
    added: dict[str, Path]  # the figures given with this push (``figures=``), which a card refresh uploads
    commit_message: str | None
    url: str
    notes: list[str] = field(default_factory=list)  # said before the push's own (an unchecked --base-model)

    def card(self, images) -> str:
        return model_card(
            self.metadata,
            repo_id=self.repo_id,
            version_tag=self.tag,
            images=images,
            base_model=self.bases,
            measurements=self.store.metrics(self.version),
            license=self.license,
        )


def push(
    store,
    ref: str,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    branch: str | None = None,
    card: str = "auto",
    token: str | None = None,
    base_model: tuple[str, str] | None = None,
    license: CardLicense | None = None,
    figures: str | os.PathLike | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
) -> PushResult:
    """Publish the version ``ref`` names to ``repo_id``: one commit on branch ``revision`` (default main;
    ``branch`` is its older name), tagged ``v{version}``.

    Idempotent: a version already published there (per the store, or per the tag on the Hub) is not
    pushed again; with ``card="replace"`` or ``figures``, its card (and figures) are refreshed on the
    branch instead, when the branch holds its weights.  ``card``: "auto" replaces README.md only if
    kvhub wrote it and nobody edited it since, "keep" never touches an existing README.md, "replace"
    always writes the generated card.  ``base_model``: Hub ids (source, target) that name the models in
    everything published (kvhub.hub.identity).  ``license``: kvhub.hub.card.card_license.  Either left
    None is taken from what the series published in ``repo_id`` (this version's publication for a refresh,
    else the newest other version's the store recorded there).  ``figures``:
    a directory whose figures (.png, .jpg, .jpeg, .svg) join the commit and the card.  ``create_pr``:
    open a pull request instead of committing; nothing is tagged or recorded until it is merged and
    pushed again.
    """
    repo_id, _ = parse_repo_ref(repo_id)
    if card not in CARD_MODES:
        raise ConfigError(f"card must be one of {', '.join(CARD_MODES)}, not {card!r}")
    branch_name = _one_branch(revision, branch)
    version = store.resolve(ref)
    pub = _publication(store, version, repo_id, version_tag(version))
    if pub is not None and card != "replace" and figures is None:  # published: nothing to decide, no Hub ids needed
        label = pub["revision"] or version_tag(version)
        notes = (
            []
            if base_model is None
            else [
                "the published mapper.json and card keep the Hub ids they were pushed with; --base-model (base_model=) "
                "names them only in a first push"
            ]
        )
        return PushResult(
            repo_id,
            label,
            pub["commit_sha"] or "",
            branch_name,
            f"{hub_settings().endpoint}/{repo_id}/tree/{label}",
            already_published=True,
            notes=notes,
        )
    inherited: list[str] = []
    if base_model is None or license is None:  # a refresh, or the series' next version: what was published
        base_model, license, inherited = _as_published(store, version, repo_id, pub, token, base_model, license)
    job = _prepare(
        store,
        ref,
        repo_id,
        revision=branch_name,
        base_model=base_model,
        license=license,
        figures=figures,
        commit_message=commit_message,
    )
    refresh = card == "replace" or bool(job.added)
    settings = hub_settings()
    if settings.offline:
        raise HubOfflineError(
            f"push to {repo_id}: HF_HUB_OFFLINE=1 forbids publishing; unset it and retry", repo_id=repo_id
        )
    api = _api(settings, token)
    aftermath = f"{ref} is not recorded as published; re-run the same `kvhub push` to retry"
    with hub_errors(
        "push to", repo_id=repo_id, revision=job.branch, token=token, settings=settings, aftermath=aftermath
    ):
        result = _push_job(api, job, pub, card, private=private, create_pr=create_pr, refresh=refresh)
    result.notes[:0] = inherited + job.notes
    return result


def _push_job(api, job: _Push, pub, card: str, *, private: bool, create_pr: bool, refresh: bool) -> PushResult:
    """The Hub side of :func:`push`: create the repository, then tag, record, refresh or publish."""
    store, repo_id = job.store, job.repo_id
    api.create_repo(repo_id, private=private, exist_ok=True)
    remote = remote_state(api, repo_id, job.branch)
    if private and not remote.private:
        raise HubConflictError(
            f"{repo_id} exists and is public, so it cannot be made private by a push. Make "
            "it private on the Hub first or push to another repository",
            repo_id=repo_id,
        )
    check_same_series(repo_id, remote.head_metadata, job)
    commit = same = None
    if job.tag in remote.tags and not create_pr:
        try:
            commit = existing_tag(api, repo_id, job.tag, remote.tags[job.tag], job)
        except HubConflictError:  # the number is taken: the weights may be there under another one
            if (same := tag_with_same_tensors(api, job, remote)) is None:
                raise
    elif not create_pr:
        same = tag_with_same_tensors(api, job, remote)
    if same is not None:
        tag, commit = same
        if pub is None:
            store.add_publication(job.version, repo_id, tag, commit)
        return PushResult(
            repo_id,
            tag,
            commit,
            job.branch,
            job.url.replace(f"/tree/{job.tag}", f"/tree/{tag}"),
            already_published=True,
            notes=[f"{repo_id}@{tag} holds these very tensors; a tag is never added for weights published already"],
        )
    if commit is not None:
        if pub is None:
            store.add_publication(job.version, repo_id, job.tag, commit)
        if refresh:
            return _refresh_card(api, job, remote, commit)
        return PushResult(
            repo_id,
            job.tag,
            commit,
            job.branch,
            job.url,
            already_published=True,
            notes=[f"{repo_id} already had {job.tag} with these weights; recorded it"],
        )
    return _publish(api, job, remote, card, create_pr=create_pr)


def _as_published(store, version, repo_id: str, pub: dict | None, token: str | None, base_model, license):
    """(base_model, license, notes): what was not given, taken from what the series published in ``repo_id``:
    ``pub`` (a refresh of this version), else the store's newest record of another version of the series
    there (its next version).  Hub ids only where the version names its models by local path; the licence
    from that publication's card.  Unchanged when nothing was published or the Hub cannot be read."""
    metadata = verify_artifact(Path(store.artifact_path(version)))
    try:
        base_models(metadata)
        needs_ids = False  # the version names its models by Hub ids itself
    except ConfigError:
        needs_ids = base_model is None
    source = pub or _series_publication(store, version, repo_id)
    settings = hub_settings()
    if not (needs_ids or license is None) or source is None or settings.offline or not source.get("commit_sha"):
        return base_model, license, []
    where = f"{source['repo_id']}@{source['revision'] or source['commit_sha'][:12]}"
    with (
        hub_errors(
            "read what was published in",
            repo_id=source["repo_id"],
            revision=source["revision"],
            token=token,
            settings=settings,
        ),
        tempfile.TemporaryDirectory(prefix="kvhub-remote-") as tmp,
    ):
        api = _api(settings, token)
        published = json_object(remote_file(api, source["repo_id"], source["commit_sha"], METADATA_FILE, tmp)) or {}
        card = remote_file(api, source["repo_id"], source["commit_sha"], CARD_FILE, tmp) if license is None else None
    taken = []
    ids = tuple((published.get(role) or {}).get("model_id") for role in ("source", "target"))
    if needs_ids and all(isinstance(i, str) and i for i in ids):
        base_model = ids
        taken.append(f"the Hub ids {ids[0]}, {ids[1]}")
    if license is None and (license := _card_licence(card)) is not None:
        taken.append(f"the licence {license.id}")
    if not taken or pub is not None:  # a refresh keeps what its own publication says, without a word
        return base_model, license, []
    return (
        base_model,
        license,
        [
            f"{' and '.join(taken)} of {where}, the series' last publication there "
            "(--base-model / --license name others)"
        ],
    )


def _series_publication(store, version, repo_id: str) -> dict | None:
    """The store's record of the newest other version of ``version``'s series published in ``repo_id``."""
    found = []
    for other in store.versions(source=version.source, target=version.target, calibration=version.calibration):
        if (other.source, other.target, other.calibration) == (
            version.source,
            version.target,
            version.calibration,
        ) and other.id != version.id:
            found += [(other.version, p) for p in store.publications(other) if p["repo_id"] == repo_id]
    return max(found, key=lambda item: item[0])[1] if found else None


def _card_licence(card: bytes | None) -> CardLicense | None:
    """The licence a published card names (None when it names none, or none kvhub accepts)."""
    meta = read_front_matter(card.decode("utf-8", errors="replace")) if card else {}
    if not isinstance(meta.get("license"), str):
        return None
    try:
        return card_license(meta["license"], name=meta.get("license_name"), link=meta.get("license_link"))
    except ConfigError:
        return None


def _one_branch(revision: str | None, branch: str | None) -> str:
    if revision and branch and revision != branch:
        raise ConfigError(f"revision {revision!r} and branch {branch!r} name two branches; give one (revision)")
    return revision or branch or "main"


def _prepare(store, ref: str, repo_id: str, *, revision: str, base_model, license, figures, commit_message) -> _Push:
    """Everything a push decides before any Hub traffic (a local path without Hub ids, a bad figures
    directory are refused here)."""
    version = store.resolve(ref)
    artifact = Path(store.artifact_path(version))
    metadata = verify_artifact(artifact)
    bases = base_models(metadata, base_model)
    notes = check_base_models(metadata, bases)
    added = _figures_in(figures)
    found = {name: artifact / name for name in publishable_files(artifact, metadata) if is_figure_name(name)}
    tag = version_tag(version)
    return _Push(
        store,
        version,
        repo_id,
        tag,
        revision,
        published_metadata(metadata, bases),
        metadata,
        bases,
        license,
        {**found, **added},
        added,
        commit_message,
        f"{hub_settings().endpoint}/{repo_id}/tree/{tag}",
        notes,
    )


def _figures_in(directory: str | os.PathLike | None) -> dict[str, Path]:
    """{name: path} of the figures directly in ``directory`` (regular files, links skipped)."""
    if directory is None:
        return {}
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"figures directory {folder} does not exist; pass the folder `kvhub report` wrote")
    found = {
        p.name: p for p in sorted(folder.iterdir()) if is_figure_name(p.name) and p.is_file() and not p.is_symlink()
    }
    if not found:
        raise ConfigError(
            f"{folder} holds no figures ({', '.join(FIGURE_SUFFIXES)}); pass the folder `kvhub report` wrote"
        )
    return found


def _publish(api, job: _Push, remote: Remote, mode: str, *, create_pr: bool) -> PushResult:
    """One commit (or pull request) with mapper.json as published, the tensors, figures and card; the tag."""
    artifact = Path(job.store.artifact_path(job.version))
    text, card_action, notes = _card_for_push(job, remote.head_card, mode)
    with tempfile.TemporaryDirectory(prefix="kvhub-push-") as tmp:
        folder = Path(tmp)
        tensors = job.local_metadata["tensors"]["file"]
        copy_regular(artifact / tensors, folder / tensors)
        (folder / METADATA_FILE).write_text(json.dumps(job.metadata, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for name, path in job.figures.items():
            copy_regular(path, folder / name, refuse_hard_links=True)
        if text is not None:
            (folder / CARD_FILE).write_text(text, encoding="utf-8")
        verify_artifact(folder)  # what leaves is a valid artifact: the renamed mapper.json included
        if job.branch not in remote.branches:
            api.create_branch(job.repo_id, branch=job.branch, exist_ok=True)
        # another version's figures on the branch would be tagged (and pulled) as this version's
        stale = [name for name in remote.head_files if is_figure_name(name) and name not in job.figures]
        commit = dict(
            repo_id=job.repo_id,
            revision=job.branch,
            commit_message=job.commit_message or _commit_title(job.metadata, job.tag),
            commit_description=f"tensors sha256 {job.metadata['tensors']['sha256']}; kvhub {__version__}",
        )
        info = (
            _pull_request(api, folder, stale, **commit)
            if create_pr
            else api.upload_folder(folder_path=tmp, delete_patterns=stale or None, **commit)
        )
    if create_pr:
        return PushResult(
            job.repo_id,
            job.tag,
            info.oid,
            job.branch,
            info.pr_url,
            card=card_action,
            notes=notes
            + [f"opened a pull request; once it is merged, push {job.version.ref} again to tag it {job.tag}"],
            pull_request=info.pr_url,
        )
    api.create_tag(job.repo_id, tag=job.tag, revision=info.oid, tag_message=_commit_title(job.metadata, job.tag))
    job.store.add_publication(job.version, job.repo_id, job.tag, info.oid)
    if text is not None and not read_front_matter(text).get("license"):
        notes.append(
            f"the card of {job.tag} names no licence; pass one (--license, license=), e.g. the base "
            f"models' licence, so that users of {job.repo_id} know what they may do with it"
        )
    if job.version.version > 1 and not any(tag_number(tag) is not None for tag in remote.tags):
        notes.append(
            f"{job.repo_id} starts at {job.tag}: a tag is the store's version number ({job.version.ref}), "
            "so every store and repository names this version alike"
        )
    return PushResult(job.repo_id, job.tag, info.oid, job.branch, job.url, card=card_action, notes=notes)


def _pull_request(api, folder: Path, stale: list[str], **commit):
    """One commit of the folder's files (and the removal of ``stale`` ones) proposed as a pull request
    against ``revision`` (upload_folder opens pull requests against main only)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    operations = [
        CommitOperationAdd(path_in_repo=path.name, path_or_fileobj=str(path)) for path in sorted(folder.iterdir())
    ]
    operations += [CommitOperationDelete(path_in_repo=name) for name in stale]
    return api.create_commit(operations=operations, create_pr=True, **commit)


def _refresh_card(api, job: _Push, remote: Remote, tag_commit: str) -> PushResult:
    """Rewrite README.md (and add figures) on the branch for a version published there already: the card
    at the head of a branch describes the weights there, so the head must hold this version's tensors
    (a branch that does not exist yet starts at the version's tag).  The tag keeps its commit."""
    if job.branch not in remote.branches:
        api.create_branch(job.repo_id, branch=job.branch, revision=tag_commit, exist_ok=True)
        remote = remote_state(api, job.repo_id, job.branch)
    head = remote.branches[job.branch]
    theirs = (remote.head_metadata or {}).get("tensors", {}).get("sha256")
    if theirs != job.metadata["tensors"]["sha256"]:
        raise HubConflictError(
            f"{job.repo_id}@{job.branch} holds other weights (tensors sha256 {str(theirs)[:12]}) than "
            f"{job.version.ref}, and a branch's card describes the weights at its head: refresh the card of the "
            f"version there, or give {job.tag} a branch of its own: push again with --revision NEW-BRANCH "
            f"(revision=; a new branch starts at the tag {job.tag})",
            repo_id=job.repo_id,
            revision=job.branch,
        )
    images = sorted({name for name in remote.head_files if is_figure_name(name)} | set(job.added))
    text = job.card(images)
    if text == remote.head_card and not job.added:
        return PushResult(
            job.repo_id,
            job.tag,
            head,
            job.branch,
            job.url,
            already_published=True,
            notes=[f"the card of {job.tag} on {job.repo_id}@{job.branch} is up to date"],
        )
    with tempfile.TemporaryDirectory(prefix="kvhub-card-") as tmp:
        (Path(tmp) / CARD_FILE).write_text(text, encoding="utf-8")
        for name, path in job.added.items():
            copy_regular(path, Path(tmp) / name, refuse_hard_links=True)
        info = api.upload_folder(
            repo_id=job.repo_id,
            folder_path=tmp,
            revision=job.branch,
            parent_commit=head,
            commit_message=job.commit_message or f"kvhub {job.tag}: refresh the model card",
        )
    return PushResult(
        job.repo_id,
        job.tag,
        info.oid,
        job.branch,
        job.url.replace(f"/tree/{job.tag}", f"/tree/{job.branch}"),
        already_published=True,
        card="replaced",
    )


def _commit_title(metadata: dict, tag: str) -> str:
    calibration = (metadata.get("calibration") or {}).get("name")
    return f"kvhub {tag}: {metadata['source']['model_id']} -> {metadata['target']['model_id']} ({calibration})"


def _card_for_push(job: _Push, remote_card: str | None, mode: str) -> tuple[str | None, str, list[str]]:
    """(README text to upload or None, what happens to the card, notes for the user)."""
    text = job.card(sorted(job.figures))
    if remote_card is None:
        return text, "written", []
    if remote_card == text:
        return text, "unchanged", []
    if mode == "replace" or (mode == "auto" and card_is_pristine(remote_card)):
        return text, "replaced", []
    if mode == "keep":
        return None, "kept", [f"README.md on {job.repo_id} left as it is (card mode keep)"]
    return (
        None,
        "kept",
        [
            f"README.md on {job.repo_id} was edited on the Hub, so it was kept: {job.tag} carries the edited card. "
            "Push again with card mode replace to overwrite it with the generated card."
        ],
    )
