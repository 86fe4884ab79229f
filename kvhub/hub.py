"""Publish mapper versions to the Hugging Face Hub and fetch them back (see docs/hub.md).

    push(store, "qwen-0.5b:qwen-1.5b:legal@3", "acme/kvmap")  -> one commit on a branch + tag "v3"
    pull(store, "acme/kvmap@v3")                                -> verified, registered MapperVersion
    search(source=SRC, target=DST)                              -> mappers published for a pair
    load_from_hub(store, SRC, DST, calibration=...)             -> the fallback of kvhub.load()

Settings are read when a function runs, not when a module is imported: ``HF_ENDPOINT``,
``HF_HUB_OFFLINE`` (either the variable or huggingface_hub's own flag switches kvhub to the local
cache), ``HF_HUB_CACHE``/``HF_HOME`` and ``KVHUB_HUB_NAMESPACES``.  Tokens come from huggingface_hub
(``HF_TOKEN`` or ``hf auth login``) unless passed explicitly; kvhub never prints, logs or stores them,
and strips them from any message it re-raises.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .artifact import sha256_file
from .card import IMAGE_SUFFIXES, card_is_pristine, model_card
from .errors import (
    ArtifactError,
    ConfigError,
    HubAuthError,
    HubConflictError,
    HubError,
    HubOfflineError,
    HubRepoNotFoundError,
    HubRevisionNotFoundError,
    IncompatibleError,
    IntegrityError,
    NotFoundError,
)
from .fingerprint import _sha256_json
from .mapper import METADATA_FILE, TENSORS_FILE, read_metadata, verify_tensors

logger = logging.getLogger(__name__)

CARD_FILE = "README.md"
NAMESPACES_ENV = "KVHUB_HUB_NAMESPACES"
CARD_MODES = ("auto", "keep", "replace")
_PULL_PATTERNS = [METADATA_FILE, TENSORS_FILE, CARD_FILE, *(f"*{s}" for s in IMAGE_SUFFIXES)]
_REPO_ID = re.compile(r"^[\w.\-]+/[\w.\-]+$")


# ---- settings and errors -----------------------------------------------------------------------------
@dataclass(frozen=True)
class HubSettings:
    """Where and how kvhub talks to the Hub, resolved from the environment at call time."""

    endpoint: str
    offline: bool
    cache_dir: str


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_settings() -> HubSettings:
    """Endpoint, offline flag and download cache, read now (huggingface_hub reads them at import)."""
    from huggingface_hub import constants

    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    offline = _truthy(os.environ.get("HF_HUB_OFFLINE")) or constants.HF_HUB_OFFLINE
    cache = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else constants.HF_HUB_CACHE
    )
    return HubSettings(endpoint=endpoint, offline=bool(offline), cache_dir=os.path.expanduser(cache))


def _api(settings: HubSettings, token: str | None):
    from huggingface_hub import HfApi

    return HfApi(endpoint=settings.endpoint, token=token, library_name="kvhub", library_version=__version__)


def _has_token(token: str | None) -> bool:
    from huggingface_hub import get_token

    return bool(token or get_token())


def _redact(text: str, token: str | None) -> str:
    """``text`` with the token in use (and anything shaped like an HF token) masked."""
    from huggingface_hub import get_token

    for secret in {token, get_token()} - {None, ""}:
        text = text.replace(secret, "***")
    return re.sub(r"hf_[A-Za-z0-9]{20,}", "hf_***", text)


def parse_repo_ref(text: str) -> tuple[str, str | None]:
    """'owner/name[@revision]' -> (repo_id, revision or None)."""
    repo_id, _, revision = text.strip().partition("@")
    if not _REPO_ID.match(repo_id):
        raise ConfigError(f"{text!r} is not a Hub repository; write it as OWNER/NAME or OWNER/NAME@REVISION")
    return repo_id, revision or None


@contextlib.contextmanager
def _hub_errors(action: str, *, repo_id: str | None, revision: str | None = None, token: str | None = None,
                settings: HubSettings | None = None, aftermath: str = "") -> Iterator[None]:
    """Translate huggingface_hub/httpx failures into kvhub errors with a next step (tokens redacted)."""
    import httpx2
    from huggingface_hub import errors as hf

    where = f"{repo_id}@{revision}" if revision else str(repo_id)
    endpoint = settings.endpoint if settings else "the Hub"
    tail = f" {aftermath}" if aftermath else ""
    try:
        yield
    except (hf.OfflineModeIsEnabled, hf.LocalEntryNotFoundError) as exc:
        offline = settings.offline if settings else True
        if offline or isinstance(exc, hf.OfflineModeIsEnabled):
            raise HubOfflineError(
                f"{action} {where}: HF_HUB_OFFLINE=1 and it is not in the local cache; unset HF_HUB_OFFLINE "
                "(or pull it once while online) and retry", repo_id=repo_id, revision=revision) from None
        raise HubError(f"{action} {where}: cannot reach {endpoint} and nothing is cached "
                       f"({_redact(str(exc).splitlines()[0], token)}); check the network and retry{tail}") from None
    except hf.RevisionNotFoundError:
        raise HubRevisionNotFoundError(
            f"{repo_id} has no revision {revision!r}; `kvhub search` or the repo's tags list what exists",
            repo_id=repo_id, revision=revision) from None
    except hf.RepositoryNotFoundError as exc:
        if exc.response is not None and exc.response.status_code == 401 and not _has_token(token):
            raise HubAuthError(
                f"{action} {repo_id}: the Hub does not show this repository without a token: it is private "
                "(or does not exist); set HF_TOKEN or run `hf auth login` and retry",
                repo_id=repo_id, revision=revision) from None
        raise HubRepoNotFoundError(
            f"{action} {repo_id}: repository not found on {endpoint} (or it is private and your token cannot "
            "see it); check the name", repo_id=repo_id, revision=revision) from None
    except hf.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        message = _redact(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc), token)
        if status == 401:
            raise HubAuthError(f"{action} {where}: the Hub rejected the token ({message}); set a valid HF_TOKEN "
                               "or run `hf auth login`", repo_id=repo_id, revision=revision) from None
        if status == 403:
            raise HubAuthError(f"{action} {where}: your token may not do this ({message}); use a token with write "
                               f"access to {str(repo_id).split('/')[0]}", repo_id=repo_id, revision=revision) from None
        raise HubError(f"{action} {where}: the Hub answered {status} ({message}){tail}") from None
    except httpx2.HTTPError as exc:
        raise HubError(f"{action} {where}: the connection to {endpoint} failed ({type(exc).__name__}: "
                       f"{_redact(str(exc), token)}){tail}") from None


# ---- verification -----------------------------------------------------------------------------------
def verify_artifact(directory: str | os.PathLike, *, source: str | None = None, target: str | None = None) -> dict:
    """Check an artifact directory before trusting it; returns its mapper.json.

    Format version (FormatVersionError), sha256 of the tensors (IntegrityError), fingerprints
    consistent with their configs and with the tensor shapes (IntegrityError), and, when given,
    the source/target model ids (IncompatibleError).
    """
    metadata = read_metadata(directory)
    verify_tensors(directory, metadata)
    check_fingerprints(directory, metadata)
    for role, wanted in (("source", source), ("target", target)):
        have = metadata[role]["model_id"]
        if wanted is not None and have.lower() != wanted.lower():
            raise IncompatibleError(f"{directory} maps {metadata['source']['model_id']} -> "
                                    f"{metadata['target']['model_id']}, not the {role} {wanted} you asked for")
    return metadata


def check_fingerprints(directory: str | os.PathLike, metadata: dict) -> None:
    """Each fingerprint's config_hash matches its config; layer indices and tensor shapes match both."""
    from safetensors import safe_open

    for role in ("source", "target"):
        fp = metadata.get(role) or {}
        missing = [k for k in ("model_id", "config", "config_hash", "num_layers", "num_kv_heads", "head_dim")
                   if k not in fp]
        if missing:
            raise IntegrityError(f"mapper.json in {directory}: the {role} fingerprint lacks {missing}; re-fetch it")
        if _sha256_json(fp["config"]) != fp["config_hash"]:
            raise IntegrityError(f"mapper.json in {directory}: the {role} fingerprint's config does not hash to "
                                 f"its config_hash; the file was edited or corrupted, re-fetch it")
    src, dst = metadata["source"], metadata["target"]
    with safe_open(str(Path(directory) / metadata["tensors"]["file"]), framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    expected = {}
    for layer in metadata.get("layers", []):
        m, sources = layer["target"], layer["sources"]
        if not 0 <= m < dst["num_layers"] or not all(0 <= s < src["num_layers"] for s in sources):
            raise IntegrityError(f"mapper.json in {directory}: layer {m} <- {sources} is outside the fingerprints' "
                                 f"{src['num_layers']} / {dst['num_layers']} layers")
        d_in = len(sources) * src["num_kv_heads"] * src["head_dim"]
        d_out = dst["num_kv_heads"] * dst["head_dim"]
        for kind in ("k", "v"):
            expected[f"{kind}.{m}.weight"], expected[f"{kind}.{m}.bias"] = (d_in, d_out), (d_out,)
    if shapes != expected:
        wrong = sorted(set(shapes.items()) ^ set(expected.items()))[:4]
        raise IntegrityError(f"{directory}: tensor names or shapes disagree with the fingerprints ({wrong}); "
                             "the artifact is inconsistent, re-fetch or re-fit it")


# ---- store seam (kvhub.store) -----------------------------------------------------------------------
def version_tag(version) -> str:
    """The Hub tag of a store version: 'v3'."""
    return f"v{version.version}"


def _publication(store, version, repo_id: str, tag: str):
    for pub in store.publications(version):
        if pub.repo_id == repo_id and pub.revision == tag:
            return pub
    return None


# ---- push -------------------------------------------------------------------------------------------
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
         token: str | None = None) -> PushResult:
    """Publish the version ``ref`` names to ``repo_id``: one commit on ``branch``, tagged ``v{version}``.

    Idempotent: a version already published there (per the store, or per the tag on the Hub) is not
    pushed again.  ``card``: "auto" replaces README.md only if kvhub wrote it and nobody edited it since,
    "keep" never touches an existing README.md, "replace" always writes the generated card.
    """
    repo_id, _ = parse_repo_ref(repo_id)
    if card not in CARD_MODES:
        raise ConfigError(f"card must be one of {', '.join(CARD_MODES)}, not {card!r}")
    branch = branch or "main"
    version = store.resolve(ref)
    artifact = Path(store.artifact_path(version))
    metadata = verify_artifact(artifact)
    tag = version_tag(version)
    settings = hub_settings()
    url = f"{settings.endpoint}/{repo_id}/tree/{tag}"
    if (pub := _publication(store, version, repo_id, tag)) is not None:
        return PushResult(repo_id, tag, pub.commit_sha, branch, url, already_published=True)
    if settings.offline:
        raise HubOfflineError(f"push to {repo_id}: HF_HUB_OFFLINE=1 forbids publishing; unset it and retry",
                              repo_id=repo_id)
    api = _api(settings, token)
    aftermath = f"; {ref} is not recorded as published, re-run the same `kvhub push` to retry"
    with _hub_errors("push to", repo_id=repo_id, revision=branch, token=token, settings=settings,
                     aftermath=aftermath):
        api.create_repo(repo_id, private=private, exist_ok=True)
        remote = _remote_state(api, repo_id, branch)
        if private and not remote.private:
            raise HubConflictError(f"{repo_id} exists and is public; --private cannot hide it. Make it private on "
                                   "the Hub first or push to another repository", repo_id=repo_id)
        if tag in remote.tags:
            commit = _existing_tag(api, repo_id, tag, remote.tags[tag], metadata)
            store.add_publication(version, repo_id, tag, commit)
            return PushResult(repo_id, tag, commit, branch, url, already_published=True,
                              notes=[f"{repo_id} already had {tag} with these weights; recorded it"])
        _check_same_series(repo_id, remote.head_metadata, metadata)
        images = sorted(p.name for p in artifact.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        text, card_action, notes = _card_for_push(metadata, remote.head_card, card, repo_id=repo_id, tag=tag,
                                                  images=images)
        with tempfile.TemporaryDirectory(prefix="kvhub-push-") as tmp:
            for name in (TENSORS_FILE, METADATA_FILE, *images):
                shutil.copyfile(artifact / name, Path(tmp) / name)
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
    remote.head_metadata = json.loads(raw) if raw else None
    remote.head_card = card.decode("utf-8", errors="replace") if card is not None else None
    return remote


def _existing_tag(api, repo_id: str, tag: str, commit: str, metadata: dict) -> str:
    """The tag's commit if it holds these very weights; HubConflictError otherwise."""
    with tempfile.TemporaryDirectory(prefix="kvhub-remote-") as tmp:
        raw = _remote_file(api, repo_id, commit, METADATA_FILE, tmp)
    theirs = (json.loads(raw).get("tensors") or {}).get("sha256") if raw else None
    if theirs == metadata["tensors"]["sha256"]:
        return commit
    raise HubConflictError(
        f"{repo_id} already has a tag {tag} holding other weights (tensors sha256 {theirs}); tags never move. "
        "Another store published its own version there: push to a repository of your own",
        repo_id=repo_id, revision=tag)


def _series(metadata: dict) -> tuple[str, str, str | None]:
    calibration = (metadata.get("calibration") or {}).get("name")
    return metadata["source"]["model_id"].lower(), metadata["target"]["model_id"].lower(), calibration


def _check_same_series(repo_id: str, remote: dict | None, metadata: dict) -> None:
    """One repository holds one (source, target, calibration) series, so tags v1, v2, ... stay unambiguous."""
    if remote is None or "source" not in remote:
        return
    if _series(remote) != _series(metadata):
        theirs, ours = (" -> ".join(map(str, _series(m)[:2])) + f" ({_series(m)[2]})" for m in (remote, metadata))
        raise HubConflictError(f"{repo_id} holds mappers for {theirs}; this one is {ours}. Push it to a repository "
                               "of its own (one repository per source, target and calibration set)",
                               repo_id=repo_id)


def _card_for_push(metadata: dict, remote_card: str | None, mode: str, *, repo_id: str, tag: str,
                   images: list[str]) -> tuple[str | None, str, list[str]]:
    """(README text to upload or None, what happens to the card, notes for the user)."""
    text = model_card(metadata, repo_id=repo_id, version_tag=tag, images=images)
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


# ---- pull -------------------------------------------------------------------------------------------
@dataclass
class PullResult:
    """What :func:`pull` did; ``version`` is the store's MapperVersion."""

    version: object
    repo_id: str
    revision: str
    commit_sha: str
    already_registered: bool = False
    metadata: dict = field(default_factory=dict)


def pull(store, repo: str, *, revision: str | None = None, token: str | None = None,
         source: str | None = None, target: str | None = None) -> PullResult:
    """Download ``repo`` ('owner/name[@revision]'), verify it, and register it with its provenance.

    Verification (format version, sha256, fingerprints) happens before anything reaches the store; a
    download that fails it is also dropped from the Hugging Face cache so the next pull fetches it anew.
    Pulling the same commit again returns the version already registered.
    """
    repo_id, in_ref = parse_repo_ref(repo)
    revision = revision or in_ref or "main"
    settings = hub_settings()
    with _hub_errors("pull", repo_id=repo_id, revision=revision, token=token, settings=settings):
        snapshot = Path(_snapshot(settings, repo_id, revision, token))
        commit = snapshot.name
        if not (snapshot / METADATA_FILE).is_file():
            raise HubRepoNotFoundError(f"{repo_id}@{revision} has no {METADATA_FILE}: it is not a kvhub mapper "
                                       "repository", repo_id=repo_id, revision=revision)
        try:
            metadata = verify_artifact(snapshot, source=source, target=target)
        except (ArtifactError, IncompatibleError):
            _purge_cached_snapshot(snapshot)
            raise
        label = revision if settings.offline else _best_label(settings, repo_id, revision, commit, token)
    version, already = _register(store, snapshot, metadata, repo_id=repo_id, revision=label, commit=commit)
    if not any(p.repo_id == repo_id and p.commit_sha == commit for p in store.publications(version)):
        store.add_publication(version, repo_id, label, commit)
    return PullResult(version, repo_id, label, commit, already_registered=already, metadata=metadata)


def _snapshot(settings: HubSettings, repo_id: str, revision: str, token: str | None) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(
        repo_id, revision=revision, allow_patterns=_PULL_PATTERNS, cache_dir=settings.cache_dir,
        endpoint=settings.endpoint, token=token, local_files_only=settings.offline,
        library_name="kvhub", library_version=__version__,
    )


def _best_label(settings: HubSettings, repo_id: str, revision: str, commit: str, token: str | None) -> str:
    """A 'v<N>' tag pointing at ``commit`` if there is one (stable provenance), else the revision asked for."""
    if re.fullmatch(r"v\d+", revision):
        return revision
    refs = _api(settings, token).list_repo_refs(repo_id)
    tags = sorted((r.name for r in refs.tags if r.target_commit == commit and re.fullmatch(r"v\d+", r.name)),
                  key=lambda name: int(name[1:]))
    return tags[-1] if tags else revision


def _purge_cached_snapshot(snapshot: Path) -> None:
    """Remove a snapshot folder and the blobs its files point to from the Hugging Face cache."""
    for path in snapshot.rglob("*"):
        if path.is_symlink():
            blob = path.resolve()
            if blob.is_file() and blob.parent.name == "blobs":
                blob.unlink(missing_ok=True)
    shutil.rmtree(snapshot, ignore_errors=True)
    logger.info("dropped %s from the Hugging Face cache after a failed verification", snapshot)


def _register(store, snapshot: Path, metadata: dict, *, repo_id: str, revision: str, commit: str):
    """Register a verified snapshot (a clean copy of it) unless the store already holds these weights."""
    existing = store.find_by_tensors_sha256(metadata["tensors"]["sha256"])
    if existing is not None:
        return existing, True
    with tempfile.TemporaryDirectory(prefix="kvhub-pull-") as tmp:
        staged = Path(tmp) / "artifact"
        staged.mkdir()
        for path in snapshot.iterdir():
            if path.is_file():
                shutil.copyfile(path, staged / path.name)  # follows the cache's symlinks to the blobs
        if sha256_file(staged / TENSORS_FILE) != metadata["tensors"]["sha256"]:
            raise IntegrityError(f"{snapshot} changed while it was being copied; pull again")
        lineage = {"hub": {"repo_id": repo_id, "revision": revision, "commit_sha": commit}}
        return store.register(staged, lineage=lineage), False


# ---- search -----------------------------------------------------------------------------------------
@dataclass
class HubMapper:
    """One mapper repository on the Hub, as its card metadata describes it."""

    repo_id: str
    source: str
    target: str
    calibration: str | None
    version: str | None
    k: object = None
    metrics: dict = field(default_factory=dict)
    private: bool = False
    last_modified: str | None = None


def search(*, source: str | None = None, target: str | None = None, calibration: str | None = None,
           author: str | None = None, token: str | None = None, limit: int = 100) -> list[HubMapper]:
    """Mappers on the Hub (library_name kvhub) for a model pair, newest first; filters are optional."""
    settings = hub_settings()
    if settings.offline:
        raise HubOfflineError("search: HF_HUB_OFFLINE=1 and searching needs the Hub; unset it and retry",
                              repo_id=None)
    filters = ["kvhub", *(f"base_model:{m}" for m in (source, target) if m)]
    found = []
    with _hub_errors("search", repo_id=author or "the Hub", token=token, settings=settings):
        for info in _api(settings, token).list_models(filter=filters, author=author, cardData=True, limit=limit):
            card = info.card_data.to_dict() if info.card_data is not None else {}
            if card.get("library_name") != "kvhub" or (mapper := _from_card(info, card)) is None:
                continue
            if _matches(mapper, source, target, calibration):
                found.append(mapper)
    return sorted(found, key=lambda m: m.last_modified or "", reverse=True)


def _from_card(info, card: dict) -> HubMapper | None:
    block = card.get("kvhub") or {}
    bases = card.get("base_model") or []
    bases = [bases] if isinstance(bases, str) else list(bases)
    source = (block.get("source") or {}).get("model_id") or (bases[0] if bases else None)
    target = (block.get("target") or {}).get("model_id") or (bases[1] if len(bases) > 1 else None)
    if not source or not target:
        return None
    return HubMapper(
        repo_id=info.id, source=source, target=target, calibration=(block.get("calibration") or {}).get("name"),
        version=block.get("version"), k=block.get("k"), metrics=block.get("metrics") or {},
        private=bool(info.private), last_modified=info.last_modified.isoformat() if info.last_modified else None,
    )


def _matches(mapper: HubMapper, source: str | None, target: str | None, calibration: str | None) -> bool:
    def same(a: str | None, b: str | None) -> bool:
        return b is None or (a or "").lower() == b.lower()

    return same(mapper.source, source) and same(mapper.target, target) and same(mapper.calibration, calibration)


# ---- kvhub.load() fallback --------------------------------------------------------------------------
def configured_namespaces() -> list[str]:
    """Hub users/organisations kvhub.load() searches, from KVHUB_HUB_NAMESPACES (comma-separated)."""
    return [ns.strip() for ns in os.environ.get(NAMESPACES_ENV, "").split(",") if ns.strip()]


def load_from_hub(store, source: str, target: str, *, calibration: str | None = None, version: int | None = None,
                  hub_repo: str | None = None, token: str | None = None) -> PullResult:
    """Find a mapper for (source, target[, calibration]) on the Hub, pull it, register it.

    Where it looks: ``hub_repo`` ('owner/name[@revision]') if given, else every namespace in
    KVHUB_HUB_NAMESPACES (searched by card metadata; offline: the repositories of those namespaces
    already in the Hugging Face cache).  ``version=N`` asks for tag ``vN``; otherwise the head of main.
    Raises NotFoundError (naming what was searched) when nothing matches.
    """
    wanted_rev = f"v{version}" if version is not None else None
    if hub_repo is not None:
        repo_id, revision = parse_repo_ref(hub_repo)
        result = pull(store, repo_id, revision=revision or wanted_rev, token=token, source=source, target=target)
        _check_calibration(result, calibration)
        return result
    namespaces = configured_namespaces()
    if not namespaces:
        raise NotFoundError(f"no mapper for {source} -> {target} in the store, and no Hub source to try: pass "
                            f"hub_repo='owner/name' or set {NAMESPACES_ENV}=owner1,owner2")
    settings = hub_settings()
    candidates = (_cached_candidates(settings, namespaces, source, target, calibration, wanted_rev) if settings.offline
                  else [m.repo_id for ns in namespaces
                        for m in search(source=source, target=target, calibration=calibration, author=ns,
                                        token=token)])
    for repo_id in candidates:
        try:
            return pull(store, repo_id, revision=wanted_rev, token=token, source=source, target=target)
        except (HubRevisionNotFoundError, IncompatibleError) as exc:
            logger.info("skipping %s: %s", repo_id, exc)
    where = "the local Hugging Face cache" if settings.offline else "the Hub"
    raise NotFoundError(f"no mapper for {source} -> {target}"
                        f"{f' ({calibration})' if calibration else ''}{f' {wanted_rev}' if wanted_rev else ''} "
                        f"in the store or in {where} under {', '.join(namespaces)}; fit one with `kvhub fit`")


def _check_calibration(result: PullResult, calibration: str | None) -> None:
    have = (result.metadata.get("calibration") or {}).get("name")
    if calibration is not None and have != calibration:
        raise IncompatibleError(f"{result.repo_id} was calibrated on {have!r}, not {calibration!r}; "
                                "pass the repository that holds that calibration set")


def _cached_candidates(settings: HubSettings, namespaces: list[str], source: str, target: str,
                       calibration: str | None, revision: str | None) -> list[str]:
    """Repositories of ``namespaces`` whose cached snapshot at ``revision`` (default main) matches the pair."""
    found = []
    for ns in namespaces:
        for folder in sorted(Path(settings.cache_dir).glob(f"models--{ns}--*")):
            ref = folder / "refs" / (revision or "main")
            meta = folder / "snapshots" / (ref.read_text().strip() if ref.is_file() else "-") / METADATA_FILE
            if not meta.is_file():
                continue
            metadata = json.loads(meta.read_text())
            series = _series(metadata)
            if series[:2] == (source.lower(), target.lower()) and calibration in (None, series[2]):
                found.append(folder.name[len("models--"):].replace("--", "/", 1))
    return found
