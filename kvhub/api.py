"""Loading and publishing Mappers: ``kvhub.load`` (by model names, the store first, then the Hub) and
``kvhub.Mapper`` (:class:`Mapper`): the math core's mapper with the Hub-style face users know from PEFT
(``from_pretrained`` by one name of any kind, ``save_pretrained``, ``push_to_hub``).  The face lives here,
above the store and the Hub, so the math core (:mod:`kvhub.core.mapper`) imports neither.

One door leads from a name to a mapper: :func:`resolve` (an artifact directory, a store reference or a
:class:`~kvhub.store.refs.Ref`, a Hub repository) gives a :class:`Resolved` (the directory, the version's
ref, the two model ids) without loading a tensor; :func:`load`, :meth:`Mapper.from_pretrained`,
``kvhub.eval.run.load_version``, ``kvhub serve`` and the vLLM connector all go through it.

A mapper's *ref* is the store reference of the version it is (``SRC:DST:CALIB@v3``); a mapper read
from a bare directory has none until it is registered.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvhub.artifact.directory import replaceable_artifact_dir
from kvhub.core import mapper as core
from kvhub.errors import ConfigError, NotFoundError

if TYPE_CHECKING:  # the store (SQLAlchemy) and the Hub client are imported when a name is resolved
    from kvhub.store.refs import Ref


@dataclass(frozen=True)
class Resolved:
    """Where a name leads, read without loading a tensor: the artifact ``directory``, ``ref`` (the store
    reference of its version; None for a directory no store version holds), ``source_id`` and
    ``target_id`` (the model ids it maps between, as fitted) and ``version`` (the store's record, None
    with ``ref``)."""

    directory: Path
    ref: str | None
    source_id: str
    target_id: str
    version: Any = None

    def load(self, *, device=None, dtype=None, compute_dtype=None, deshrink: str | None = None) -> Mapper:
        """The mapper, verified (:meth:`kvhub.core.mapper.Mapper.load`), with ``ref`` set."""
        mapper = Mapper.load(self.directory, device=device, dtype=dtype, compute_dtype=compute_dtype, deshrink=deshrink)
        mapper.ref = self.ref
        return mapper

    def deshrink_setting(self, deshrink: str | None) -> str:
        """The setting the mapper would transfer with (ConfigError as :meth:`load` gives, e.g. "kv" on a
        mapper without target means), from mapper.json and the tensor file's header alone."""
        from kvhub.artifact.directory import read_metadata, tensor_path
        from kvhub.artifact.tensors import read_tensor_file
        from kvhub.core.deshrink import deshrink_setting

        metadata = read_metadata(self.directory)
        names = read_tensor_file(tensor_path(self.directory, metadata), scan=False).shapes
        return deshrink_setting(deshrink, names, metadata.get("layers", []))


def resolve(
    name: str | os.PathLike | Ref,
    *,
    revision: str | None = None,
    hub_repo: str | None = None,
    token: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    db: str | os.PathLike | None = None,
    store=None,
) -> Resolved:
    """The one door from a name to a mapper's artifact directory (nothing loaded).  ``name``:

    * a :class:`~kvhub.store.refs.Ref` (``Ref.of(src, dst, ...)``, as :func:`load` builds it) or a store
      reference (text with a ``:``, ``"SRC:DST:CALIB@production"``): that version in the store; on a miss,
      the Hub (``hub_repo``, else the namespaces of KVHUB_HUB_NAMESPACES; aliases other than ``latest``
      are this store's names and stay a miss), whose mapper is verified and registered in the store first;
    * an artifact directory (``"./mapper"``): as it is, ``ref`` the store version holding the same tensors;
    * a Hub repository (``"acme/kvmap-qwen-legal"``, ``@v3`` optional): pulled, verified and registered in
      the store (``kvhub pull``).

    revision: for a Ref, a Hub revision (a tag such as ``"v3"``, a branch or a commit), which skips the
    store (it numbers its versions its own way); for text, the selector the name lacks.  token, cache_dir,
    local_files_only: as huggingface_hub's.  db: store URL or SQLite path; store: an open
    :class:`~kvhub.store.Store` to use instead (left open).

    Raises ConfigError for a name of no known form (naming the three) or two revisions, NotFoundError (with
    the next step) when nothing matches, AmbiguousError (listing the candidates) when it matches several,
    ArtifactError for a directory whose mapper.json is not a kvhub mapper's.
    """
    from kvhub.store.refs import Ref

    hub = dict(
        hub_repo=hub_repo, token=token, cache_dir=cache_dir, local_files_only=local_files_only, db=db, store=store
    )
    if isinstance(name, Ref):
        return _resolve_ref(name, revision=revision, **hub)
    text = os.fspath(name)
    if not text.strip():
        raise ConfigError(
            'the mapper name is empty; pass an artifact directory ("./mapper"), a store reference '
            "(SRC:DST:CALIB@v3) or a Hub repository (OWNER/NAME@v3)"
        )
    if _is_directory(text):
        if revision is not None:
            raise ConfigError(
                f"{text} is a directory, which has no revisions; leave revision out, or name a store "
                "reference or a Hub repository"
            )
        return _resolve_directory(Path(text).expanduser(), db=db, store=store)
    named = _parse_name(_with_revision(text, revision))
    if isinstance(named, Ref):
        return _resolve_ref(named, revision=None, **hub)
    from kvhub.hub import pull

    with _opened(store, db) as opened:
        version = pull(
            opened, named[0], revision=named[1], token=token, cache_dir=cache_dir, local_files_only=local_files_only
        ).version
        return _resolved(opened, version)


def _opened(store, db, *, create: bool = True):
    """``store`` itself (left open), else the store at ``db`` opened for the ``with`` block."""
    from kvhub.store import open_store

    return contextlib.nullcontext(store) if store is not None else open_store(db, create=create)


def _resolved(store, version) -> Resolved:
    return Resolved(store.artifact_path(version), version.ref, version.source, version.target, version)


def _resolve_ref(ref: Ref, *, revision: str | None, db, store, **hub) -> Resolved:
    """The store's version ``ref`` names, else the Hub's (:func:`_resolve_hub`); only the Hub for a revision."""
    if revision is not None:  # a Hub revision: the store numbers its versions its own way
        return _resolve_hub(ref, miss=None, revision=revision, db=db, store=store, **hub)
    try:
        with _opened(store, db, create=False) as opened:  # a mistyped db is a miss, not a new empty store
            return _resolved(opened, opened.resolve(ref))
    except NotFoundError as miss:
        return _resolve_hub(ref, miss=miss, db=db, store=store, **hub)


def _resolve_hub(ref: Ref, *, miss: NotFoundError | None, hub_repo=None, db=None, store=None, **hub) -> Resolved:
    """Hub fallback (kvhub.hub, docs/hub.md): pull a published mapper into the store.

    The local miss stands when no Hub source is configured (no hub_repo, no KVHUB_HUB_NAMESPACES) and
    for aliases other than ``latest`` (they are names in this store, not on the Hub).  ``miss`` None:
    a Hub revision was asked for, which needs a Hub source.  ``hub``: load_from_hub's keywords.
    """
    from kvhub.hub import NAMESPACES_ENV, configured_namespaces, load_from_hub
    from kvhub.store.refs import LATEST

    if (hub_repo is None and not configured_namespaces()) or ref.alias not in (None, LATEST):
        if miss is None:
            raise ConfigError(
                f"revision={hub.get('revision')!r} names a revision on the Hub; say where with "
                f"hub_repo='owner/name' or {NAMESPACES_ENV}, or pick a store version with version="
            )
        raise miss
    with _opened(store, db) as opened:
        pulled = load_from_hub(
            opened, ref.source, ref.target, calibration=ref.calibration, version=ref.version, hub_repo=hub_repo, **hub
        )
        return _resolved(opened, pulled.version)


def _resolve_directory(directory: Path, *, db, store) -> Resolved:
    """An artifact directory as it is (mapper.json read and checked), with the store version holding the
    same tensors when a store exists and has one."""
    from kvhub.artifact.directory import read_metadata

    metadata = read_metadata(directory)
    version = _registered_version(metadata, db=db, store=store)
    return Resolved(
        directory,
        version.ref if version is not None else None,
        metadata["source"]["model_id"],
        metadata["target"]["model_id"],
        version,
    )


def load(
    src: str,
    dst: str,
    *,
    calib: str | None = None,
    version: int | str | None = None,
    alias: str | None = None,
    hub_repo: str | None = None,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    db: str | os.PathLike | None = None,
    device=None,
    dtype=None,
    torch_dtype=None,
    deshrink: str | None = None,
) -> Mapper:
    """Load the mapper from model ``src`` to model ``dst``.

    src, dst: model ids as fitted or published (``Qwen/Qwen2.5-Coder-0.5B-Instruct``) or short names
    (``qwen2.5-coder-0.5b-instruct``).  calib: calibration-set name; needed only when the pair was
    fitted on several.  version (``3``, ``"v3"``, or an alias name as in a reference's ``@SELECTOR``) or
    alias picks the version; by default the one aliased ``production`` if set, else ``latest``.  db:
    store URL or SQLite path (default: see kvhub.store.location).  device, dtype (or its alias
    torch_dtype): where the weights go and the dtype of the caches ``transfer`` returns.  deshrink: how
    transfer reads the maps ("kv", "v" or "off"; default "kv" where the artifact allows it, see
    :data:`kvhub.core.mapper.DESHRINK`).

    The Hugging Face Hub (see docs/hub.md) is asked when the store has no match, or always when
    ``revision`` (a Hub tag such as ``"v3"``, a branch or a commit) is given: in ``hub_repo``
    (``"owner/name[@revision]"``), else in the namespaces of KVHUB_HUB_NAMESPACES.  A mapper found there
    is verified and registered in the store first.  token: Hub token (default: huggingface_hub's);
    cache_dir: the Hugging Face cache; local_files_only: that cache only, no download.  The names are
    resolved by :func:`resolve`.

    Raises ConfigError for a malformed version or alias (before any store or Hub is read), NotFoundError
    (with the next step) when nothing matches, AmbiguousError (listing the candidates) when the names
    match several mappers, IntegrityError when the artifact's bytes differ from their recorded sha256.
    """
    from kvhub.store.refs import Ref

    dtype = _one_dtype(dtype, torch_dtype)
    ref = Ref.of(src, dst, calibration=calib, version=version, alias=alias)
    found = resolve(
        ref,
        revision=revision,
        hub_repo=hub_repo,
        token=token,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
        db=db,
    )
    return found.load(device=device, dtype=dtype, deshrink=deshrink)


def _one_dtype(dtype, torch_dtype):
    """``dtype``, or ``torch_dtype`` (the transformers spelling of the same thing); ConfigError for two."""
    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        raise ConfigError(
            f"dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree; torch_dtype is another name for dtype, give one"
        )
    return dtype if dtype is not None else torch_dtype


def from_pretrained(*args, **kwargs) -> Mapper:
    """:meth:`Mapper.from_pretrained` (the one declaration of its options), as a function."""
    return Mapper.from_pretrained(*args, **kwargs)


def _with_revision(text: str, revision: str | None) -> str:
    """``name@revision`` for a name without a selector; ConfigError when both name one."""
    if revision is None:
        return text
    if "@" in text:
        raise ConfigError(f"{text!r} already names a revision and revision={revision!r} names another; give one")
    if not str(revision).strip():
        raise ConfigError("revision is empty; name a tag such as v3, a branch or a commit, or leave it out")
    return f"{text}@{revision}"


def _is_directory(text: str) -> bool:
    """Whether ``text`` names a directory; a name the file system cannot even look up (too long, a NUL) is not one."""
    try:
        return Path(text).expanduser().is_dir()
    except (OSError, ValueError):
        return False


def _parse_name(text: str) -> Ref | tuple[str, str | None]:
    """What a name that is not a directory designates: a store reference (it has a ':'), else a Hub
    repository ``(repo_id, revision)``; ConfigError naming the three forms for anything else (a URL too)."""
    from kvhub.hub.client import is_repo_id, parse_repo_ref
    from kvhub.store.refs import SYNTAX_HELP, Ref, check_not_url

    check_not_url(text)
    if ":" in text:
        return Ref.parse(text)
    if is_repo_id(text.strip().partition("@")[0]):
        return parse_repo_ref(text)  # its own ConfigError for a revision left empty ("owner/name@")
    shown = repr(text) if len(text) <= 120 else repr(text[:117]) + "..."
    raise ConfigError(
        f"{shown} is neither an artifact directory, a store reference nor a Hub repository "
        f"(OWNER/NAME or OWNER/NAME@v3); for a reference, {SYNTAX_HELP}. Check the spelling, "
        "or list what exists with `kvhub list` / `kvhub search`"
    )


def _registered_version(metadata: dict, *, db, store):
    """The store's record of the version holding these tensors (mapper.json ``metadata``), if a store exists
    and has one."""
    from kvhub.store.location import resolve_db_url, sqlite_path

    if store is None:
        path = sqlite_path(resolve_db_url(db))
        if path is not None and not path.exists():
            return None
    with _opened(store, db) as opened:
        found = [
            v
            for v in opened.versions(
                source=metadata["source"]["model_id"],
                target=metadata["target"]["model_id"],
                calibration=(metadata.get("calibration") or {}).get("name"),
            )
            if v.tensors_sha256 == metadata["tensors"]["sha256"]
        ]
    return found[0] if found else None


def push_to_hub(
    mapper: Mapper,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    branch: str | None = None,
    token: str | None = None,
    db=None,
    base_model: tuple[str, str] | None = None,
    card: str = "auto",
    commit_message: str | None = None,
    create_pr: bool = False,
    license: str | None = None,
    license_name: str | None = None,
    license_link: str | None = None,
    figures: str | os.PathLike | None = None,
):
    """Register ``mapper`` in the store (its version when its tensors are there already), then publish that
    version to ``repo_id`` as one commit tagged ``vN`` (kvhub.hub.push); returns the PushResult."""
    import tempfile

    from kvhub.hub import push
    from kvhub.hub.card import card_license
    from kvhub.store import open_store

    chosen = card_license(license, name=license_name, link=license_link)  # refused before anything is written
    with open_store(db) as store:
        if mapper.ref is None:
            with tempfile.TemporaryDirectory(prefix="kvhub-push-") as tmp:
                artifact = mapper.save(Path(tmp) / "mapper")
                mapper.ref = store.register(artifact, lineage={"created_by": "Mapper.push_to_hub"}).ref
        return push(
            store,
            mapper.ref,
            repo_id,
            private=private,
            revision=revision,
            branch=branch,
            token=token,
            base_model=base_model,
            card=card,
            commit_message=commit_message,
            create_pr=create_pr,
            license=chosen,
            figures=figures,
        )


class Mapper(core.Mapper):
    """A mapper (:class:`kvhub.core.mapper.Mapper`: transfer, save, load) with the Hub-style face.
    Every mapper :func:`load` and :meth:`from_pretrained` return is one."""

    @classmethod
    def from_pretrained(
        cls,
        name: str | os.PathLike,
        *,
        revision: str | None = None,
        token: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        db=None,
        device=None,
        dtype=None,
        torch_dtype=None,
        compute_dtype=None,
        deshrink: str | None = None,
    ) -> "Mapper":
        """The mapper ``name`` designates, verified, with ``ref`` set:

        * an artifact directory (``"./mapper"``): read as it is (``ref`` is the store version holding the
          same tensors, if any);
        * a store reference (``"SRC:DST:CALIB@production"``, any selector): that version (on a miss, the
          Hub's, as :func:`load` falls back);
        * a Hub repository (``"acme/kvmap-qwen-legal"``, ``@v3`` or ``revision="v3"`` optional): pulled,
          verified and registered in the store (``kvhub pull``), then loaded from there.

        revision: a store selector or Hub revision when ``name`` has none.  token, cache_dir,
        local_files_only: as huggingface_hub's.  db: store URL or SQLite path.  torch_dtype: dtype's other
        name (see :class:`kvhub.core.mapper.Mapper` for dtypes and ``deshrink``).  The name is resolved by
        :func:`resolve`; this is the one declaration of these options (``kvhub.api.from_pretrained`` forwards)."""
        dtype = _one_dtype(dtype, torch_dtype)  # refused before any store or Hub is read
        found = resolve(
            name, revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only, db=db
        )
        return found.load(device=device, dtype=dtype, compute_dtype=compute_dtype, deshrink=deshrink)

    def save_pretrained(
        self, directory: str | os.PathLike, *, push_to_hub: bool = False, repo_id: str | None = None, **hub_options
    ) -> Path:
        """Write the artifact directory (mapper.json + mapper.safetensors), readable by
        :meth:`from_pretrained` and ``kvhub import``.  An existing kvhub artifact directory is replaced
        (atomically); any other existing directory that is not empty is refused, never overwritten.
        push_to_hub: then publish it to ``repo_id`` (:meth:`push_to_hub`, which takes ``hub_options``)."""
        if push_to_hub and not repo_id:
            raise ConfigError("save_pretrained(push_to_hub=True) needs the Hub repository: repo_id='owner/name'")
        if not push_to_hub and hub_options:
            raise ConfigError(f"{', '.join(sorted(hub_options))} only apply with push_to_hub=True")
        path = self.save(directory, overwrite=replaceable_artifact_dir(directory))
        if push_to_hub:
            self.push_to_hub(repo_id, **hub_options)
        return path

    push_to_hub = push_to_hub  # mapper.push_to_hub(repo_id, ...): the function above, with self as its mapper
