"""pull: download a revision, verify it, register it with its provenance; and the kvhub.load() fallback."""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvhub import __version__
from kvhub.artifact import (
    CARD_FILE,
    FIGURE_SUFFIXES,
    METADATA_FILE,
    TENSORS_FILE,
    copy_regular,
    is_figure_name,
    parse_metadata_bytes,
)
from kvhub.errors import (
    ArtifactError,
    ConfigError,
    FormatVersionError,
    HubRepoNotFoundError,
    HubRevisionNotFoundError,
    IncompatibleError,
    NotFoundError,
)
from kvhub.hub.cache import cached_blob, repo_blob
from kvhub.hub.client import HubSettings, _api, hub_errors, hub_settings, parse_repo_ref
from kvhub.hub.push import tag_number
from kvhub.hub.search import search
from kvhub.hub.verify import same_model, series_key, verify_artifact
from kvhub.progress import Progress

if TYPE_CHECKING:
    from kvhub.store import MapperVersion

logger = logging.getLogger(__name__)

NAMESPACES_ENV = "KVHUB_HUB_NAMESPACES"
_PULL_PATTERNS = [METADATA_FILE, TENSORS_FILE, CARD_FILE, *(f"*{s}" for s in FIGURE_SUFFIXES)]


@dataclass
class PullResult:
    """What :func:`pull` did; ``version`` is the store's record of the pulled mapper (numbered as on the
    Hub when that number was free, else reachable by ``alias``)."""

    version: MapperVersion
    repo_id: str
    revision: str
    commit_sha: str
    already_registered: bool = False
    metadata: dict = field(default_factory=dict)
    alias: str | None = None  # ``hub-vN`` when the store numbers the version differently from the Hub


def pull(
    store,
    repo: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    source: str | None = None,
    target: str | None = None,
    calibration: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    progress: Progress | None = None,
) -> PullResult:
    """Download ``repo`` ('owner/name[@revision]'), verify it, and register it with its provenance.

    Verification (format version, sha256, fingerprints; and when given, the source/target model and
    calibration set) happens before anything reaches the store; a download with bad bytes is also
    dropped from the Hugging Face cache so the next pull fetches it anew.  Pulling the same weights
    again returns the version already registered.  ``cache_dir``: the Hugging Face cache to use;
    ``local_files_only``: use that cache only (as HF_HUB_OFFLINE=1 does).  ``progress``: hears the bytes
    downloaded as ``pull OWNER/NAME@REVISION`` (:mod:`kvhub.hub.transfer_progress`).
    """
    from huggingface_hub.errors import RevisionNotFoundError

    repo_id, in_ref = parse_repo_ref(repo)
    if revision and in_ref and revision != in_ref:
        raise ConfigError(f"{repo!r} names revision {in_ref!r} and revision {revision!r} was also given; give one")
    revision = revision or in_ref or "main"
    settings = hub_settings(cache_dir=cache_dir, local_files_only=local_files_only)
    with hub_errors("pull", repo_id=repo_id, revision=revision, token=token, settings=settings):
        try:
            snapshot = Path(_snapshot(settings, repo_id, revision, token, progress=progress))
        except RevisionNotFoundError:
            hint = _refs_hint(settings, repo_id, token)
            raise HubRevisionNotFoundError(
                f"{repo_id} has no revision {revision!r}{hint}", repo_id=repo_id, revision=revision
            ) from None
        commit = snapshot.name
        if not os.path.lexists(snapshot / METADATA_FILE):
            raise HubRepoNotFoundError(
                f"{repo_id}@{revision} has no {METADATA_FILE}: it is not a kvhub mapper repository",
                repo_id=repo_id,
                revision=revision,
            )
        label = revision if settings.offline else _best_label(settings, repo_id, revision, commit, token)
        _remember_tag(snapshot, label, commit)
    with store.staging(prefix="pull-") as tmp:  # in the store's .tmp: gc removes what a kill leaves
        staged = tmp / "artifact"
        try:  # what is verified is the copy that gets registered, not the cache it came from
            _stage(snapshot, staged)
            metadata = verify_artifact(staged, source=source, target=target)
            _check_calibration(repo_id, metadata, calibration)
            _check_card(repo_id, staged, metadata)
            _check_names(repo_id, metadata)
        except FormatVersionError:
            raise
        except ArtifactError as exc:  # bad bytes: drop them so the next pull downloads afresh
            _purge_cached_snapshot(snapshot)
            raise type(exc)(
                f"pull {repo_id}@{revision} (commit {commit[:12]}) refused: {exc}. The download was "
                "removed from the cache and nothing was registered; run the same `kvhub pull` again, "
                "and if it fails again the files on the Hub are damaged"
            ) from None
        version, already, alias = _register(store, staged, metadata, repo_id=repo_id, revision=label, commit=commit)
    if not any(p["repo_id"] == repo_id and p["commit_sha"] == commit for p in store.publications(version)):
        store.add_publication(version, repo_id, label, commit)
    return PullResult(version, repo_id, label, commit, already_registered=already, metadata=metadata, alias=alias)


def _snapshot(settings: HubSettings, repo_id: str, revision: str, token: str | None, *, progress=None) -> str:
    """The local snapshot folder of ``repo_id`` at ``revision`` (downloaded unless offline)."""
    from huggingface_hub import snapshot_download

    from kvhub.hub.transfer_progress import byte_bars

    bars = {} if progress is None else {"tqdm_class": byte_bars(progress, f"pull {repo_id}@{revision}")}
    return snapshot_download(
        repo_id,
        revision=revision,
        allow_patterns=_PULL_PATTERNS,
        cache_dir=settings.cache_dir,
        endpoint=settings.endpoint,
        token=token,
        local_files_only=settings.offline,
        library_name="kvhub",
        library_version=__version__,
        **bars,
    )


def _refs_hint(settings: HubSettings, repo_id: str, token: str | None) -> str:
    """'; it has tags v1, v2 and branches main' for a message (best effort: refs may be unlistable)."""
    try:
        refs = _api(settings, token).list_repo_refs(repo_id)
    except Exception:  # noqa: BLE001 - only a hint for a message that is raised anyway
        return "; list its tags with `kvhub search`"
    tags = ", ".join(sorted((r.name for r in refs.tags), key=lambda n: (len(n), n))) or "none"
    return f"; it has tags {tags} and branches {', '.join(sorted(r.name for r in refs.branches))}"


def _best_label(settings: HubSettings, repo_id: str, revision: str, commit: str, token: str | None) -> str:
    """A 'v<N>' tag pointing at ``commit`` if there is one (stable provenance), else the revision asked for."""
    if tag_number(revision) is not None:
        return revision
    refs = _api(settings, token).list_repo_refs(repo_id)
    tags = sorted(
        (r.name for r in refs.tags if r.target_commit == commit and tag_number(r.name) is not None), key=tag_number
    )
    return tags[-1] if tags else revision


def _remember_tag(snapshot: Path, label: str, commit: str) -> None:
    """Record in the Hugging Face cache that tag ``label`` is ``commit`` (refs/LABEL, as huggingface_hub
    writes for a revision it downloads), so that an offline pull of OWNER/NAME@v1 finds the commit a pull
    of main brought in when v1 pointed there."""
    refs = snapshot.parent.parent / "refs"
    if tag_number(label) is None or not refs.is_dir():
        return
    ref = refs / label
    try:
        if not ref.is_file() or ref.read_text().strip() != commit:
            ref.write_text(commit)
    except OSError as exc:  # a read-only cache: the pull itself succeeded
        logger.debug("could not record %s -> %s in the Hugging Face cache: %s", label, commit[:12], exc)


def _purge_cached_snapshot(snapshot: Path) -> None:
    """Remove a snapshot folder and the blobs its files point to from the Hugging Face cache: only the
    repository's own blobs (:func:`~kvhub.hub.cache.repo_blob`); a link anywhere else goes with the folder,
    never what it points to, and a snapshot that is itself a link is unlinked, not emptied."""
    if snapshot.is_symlink():
        snapshot.unlink(missing_ok=True)
        return
    for path in snapshot.rglob("*"):
        blob = repo_blob(snapshot, path)
        if blob is not None:
            blob.unlink(missing_ok=True)
    shutil.rmtree(snapshot, ignore_errors=True)
    logger.info("dropped %s from the Hugging Face cache after a failed verification", snapshot)


def _stage(snapshot: Path, staged: Path) -> None:
    """Copy the artifact's files (mapper.json, the tensor file, the card, the figures the card shows)
    out of a cached snapshot into ``staged``, following only the cache's own links to its blobs."""
    staged.mkdir()
    shown = _card_images(snapshot / CARD_FILE)
    for path in sorted(snapshot.iterdir()):
        if (
            path.name in (METADATA_FILE, CARD_FILE)
            or path.name.endswith(".safetensors")
            or (is_figure_name(path.name) and path.name in shown)
        ):
            copy_regular(cached_blob(snapshot, path), staged / path.name)


def _card_images(card: Path) -> set[str]:
    """The file names a model card shows as images (``![...](name)``): another version's figures left on
    a branch by an older push are no part of this version."""
    if not card.is_file():
        return set()
    text = cached_blob(card.parent, card).read_text(encoding="utf-8", errors="replace")
    return set(re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text))


def hub_alias(revision: str) -> str | None:
    """``hub-v4`` for the Hub tag ``v4``: how a pulled version stays addressable by the Hub's number when
    the store's own v4 is another version; None for revisions that are not version tags."""
    return f"hub-{revision}" if tag_number(revision) is not None else None


def _register(store, staged: Path, metadata: dict, *, repo_id: str, revision: str, commit: str):
    """Register a verified staged copy unless the store already holds these weights, under these names or
    those they were published from (then that version).

    The Hub's identity is kept: a new version takes the Hub's number ``vN`` when the triple never used
    it, and the lineage records repository, tag and commit; when the store's number differs, alias
    ``hub-vN`` points at the version.  Returns (version, already registered, alias or None)."""
    existing = store.registered_as(staged) or _published_from(store, metadata)
    hub_number = tag_number(revision)
    if existing is None:
        lineage = {"hub": {"repo_id": repo_id, "revision": revision, "commit_sha": commit}}
        version = store.register(staged, lineage=lineage, preferred_version=hub_number)
    else:
        version = existing
    alias = None
    if hub_number is not None and version.version != hub_number:
        alias = hub_alias(revision)
        version = store.tag(version, alias)
    return version, existing is not None, alias


def _published_from(store, metadata: dict):
    """The version these tensors were published from when the store holds them under other model names: a
    push names the models by Hub ids (kvhub.hub.identity), so its publisher pulling it back must get the
    version it pushed (same tensors sha256, same calibration series), not a second series; None otherwise."""
    from kvhub.artifact.metadata import calibration_series

    sha256 = metadata["tensors"]["sha256"]
    same = [
        v for v in store.versions(calibration=calibration_series(metadata["calibration"])) if v.tensors_sha256 == sha256
    ]
    return min(same, key=lambda v: v.id) if same else None


def configured_namespaces() -> list[str]:
    """Hub users/organisations kvhub.load() searches, from KVHUB_HUB_NAMESPACES (comma-separated)."""
    return [ns.strip() for ns in os.environ.get(NAMESPACES_ENV, "").split(",") if ns.strip()]


def load_from_hub(
    store,
    source: str,
    target: str,
    *,
    calibration: str | None = None,
    version: int | None = None,
    hub_repo: str | None = None,
    token: str | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> PullResult:
    """Find a mapper for (source, target[, calibration]) on the Hub, pull it, register it.

    Where it looks: ``hub_repo`` ('owner/name[@revision]') if given, else every namespace in
    KVHUB_HUB_NAMESPACES (searched by card metadata; offline: the repositories of those namespaces
    already in the Hugging Face cache).  ``revision`` (a tag, branch or commit) or ``version=N`` (tag
    ``vN``) picks the revision; otherwise the head of main.  ``cache_dir``, ``local_files_only``: as
    :func:`pull`.  Raises NotFoundError (naming what was searched) when nothing matches.
    """
    wanted_rev = revision or (f"v{version}" if version is not None else None)
    fetch = dict(
        token=token,
        source=source,
        target=target,
        calibration=calibration,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
    )
    if hub_repo is not None:
        repo_id, in_ref = parse_repo_ref(hub_repo)
        return pull(store, repo_id, revision=in_ref or wanted_rev, **fetch)
    namespaces = configured_namespaces()
    if not namespaces:
        raise NotFoundError(
            f"no mapper for {source} -> {target} in the store, and no Hub source to try: pass "
            f"hub_repo='owner/name' or set {NAMESPACES_ENV}=owner1,owner2"
        )
    settings = hub_settings(cache_dir=cache_dir, local_files_only=local_files_only)
    candidates = (
        _cached_candidates(settings, namespaces, source, target, calibration, wanted_rev)
        if settings.offline
        else [
            m.repo_id
            for ns in namespaces
            for m in search(source=source, target=target, calibration=calibration, author=ns, token=token)
        ]
    )
    for repo_id in candidates:
        try:
            return pull(store, repo_id, revision=wanted_rev, **fetch)
        except (HubRevisionNotFoundError, IncompatibleError) as exc:
            logger.info("skipping %s: %s", repo_id, exc)
    where = "the local Hugging Face cache" if settings.offline else "the Hub"
    raise NotFoundError(
        f"no mapper for {source} -> {target}"
        f"{f' ({calibration})' if calibration else ''}{f' {wanted_rev}' if wanted_rev else ''} "
        f"in the store or in {where} under {', '.join(namespaces)}; fit one with `kvhub fit`"
    )


def _check_calibration(repo_id: str, metadata: dict, calibration: str | None) -> None:
    from kvhub.artifact.metadata import calibration_series

    have = calibration_series(metadata.get("calibration"))
    if calibration is not None and (have or "").lower() != calibration.lower():
        raise IncompatibleError(
            f"{repo_id} was calibrated on {have!r}, not {calibration!r}; "
            "pass the repository that holds that calibration set"
        )


def _check_card(repo_id: str, staged: Path, metadata: dict) -> None:
    """Warn when the repository's card describes other weights than its mapper.json (kvhub trusts
    mapper.json, which it verified; the card someone reads may be stale or misleading)."""
    from kvhub.hub.card import read_front_matter

    if not (staged / CARD_FILE).is_file():
        return
    block = read_front_matter((staged / CARD_FILE).read_text(encoding="utf-8", errors="replace")).get("kvhub")
    claimed = block.get("tensors_sha256") if isinstance(block, dict) else None
    if claimed is not None and claimed != metadata["tensors"]["sha256"]:
        logger.warning(
            "%s: README.md describes tensors %s, but mapper.json (verified) holds %s; the card is stale "
            "or misleading, trust `kvhub show` of the pulled version",
            repo_id,
            str(claimed)[:12],
            metadata["tensors"]["sha256"][:12],
        )


def _check_names(repo_id: str, metadata: dict) -> None:
    """Warn when mapper.json names its models by local paths: it was uploaded by hand (an export, `hf upload`),
    not by `kvhub push`, which names them by Hub ids (kvhub.hub.identity); those paths become this store's
    names for the models, and the publisher's directory layout is public."""
    from kvhub.hub.identity import is_hub_id

    paths = [
        metadata[role]["model_id"]
        for role in ("source", "target")
        if not is_hub_id(metadata[role]["model_id"]) and re.search(r"[/\\]", metadata[role]["model_id"])
    ]
    if paths:
        logger.warning(
            "%s names its models by the local paths %s: it was not published by `kvhub push` (which names them by "
            "Hub ids), and this store now names them so too; ask its publisher to push it with `kvhub push "
            "--base-model SRC_ID,DST_ID`",
            repo_id,
            " and ".join(paths),
        )


def _cached_candidates(
    settings: HubSettings,
    namespaces: list[str],
    source: str,
    target: str,
    calibration: str | None,
    revision: str | None,
) -> list[str]:
    """Repositories of ``namespaces`` whose cached snapshot at ``revision`` (default main) matches the pair."""
    found = []
    for ns in namespaces:
        for folder in sorted(Path(settings.cache_dir).glob(f"models--{ns}--*")):
            ref = folder / "refs" / (revision or "main")
            meta = folder / "snapshots" / (ref.read_text().strip() if ref.is_file() else "-") / METADATA_FILE
            if not meta.is_file():
                continue
            try:
                metadata = parse_metadata_bytes(meta.read_bytes(), where=str(meta.parent))
            except ArtifactError as exc:
                logger.warning("skipping cached %s: %s", folder.name, exc)
                continue
            src, dst, calib = series_key(metadata)
            if same_model(src, source) and same_model(dst, target) and calibration in (None, calib):
                found.append(folder.name[len("models--") :].replace("--", "/", 1))
    return found
