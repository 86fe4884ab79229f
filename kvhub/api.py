"""``kvhub.load``: a Mapper by model names, from the local store (the Hub fallback plugs in below)."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import NotFoundError
from .mapper import Mapper


def load(
    src: str,
    dst: str,
    *,
    calib: str | None = None,
    version: int | str | None = None,
    alias: str | None = None,
    hub_repo: str | None = None,
    db: str | os.PathLike | None = None,
    device=None,
    dtype=None,
) -> Mapper:
    """Load the mapper from model ``src`` to model ``dst``.

    src, dst: model ids as fitted (``Qwen/Qwen2.5-Coder-0.5B-Instruct``) or short names
    (``qwen2.5-coder-0.5b-instruct``).  calib: calibration-set name; needed only when the pair was
    fitted on several.  version (``3`` or ``"v3"``) or alias picks the version; by default the one
    aliased ``production`` if set, else ``latest``.  db: store URL or SQLite path (default: see
    kvhub.store.location).  device, dtype: where the weights go and the dtype of the caches
    ``transfer`` returns.  hub_repo (``"owner/name[@revision]"``): where to look on the Hugging Face
    Hub when the store has no match; without it, the namespaces in KVHUB_HUB_NAMESPACES are searched
    (see docs/hub.md).  A mapper found on the Hub is verified and registered in the store first.

    Raises NotFoundError when nothing matches, AmbiguousError (listing the candidates) when the names
    match several mappers, IntegrityError when the artifact's bytes differ from their recorded sha256.
    """
    try:
        directory = _resolve_local(src, dst, calib=calib, version=version, alias=alias, db=db)
    except NotFoundError as miss:
        directory = _resolve_hub(src, dst, calib=calib, version=version, alias=alias, miss=miss,
                                 hub_repo=hub_repo, db=db)
    return Mapper.load(directory, device=device, dtype=dtype)


def _resolve_local(src, dst, *, calib, version, alias, db) -> Path:
    """Artifact directory of the matching version in the local store; NotFoundError on a miss."""
    from .store import open_store

    with open_store(db) as store:
        found = store.find(src, dst, calibration=calib, version=version, alias=alias)
        return store.artifact_path(found)


def _resolve_hub(src, dst, *, calib, version, alias, miss: NotFoundError, hub_repo=None, db=None) -> Path:
    """Hub fallback (kvhub.hub, docs/hub.md): pull a published mapper into the store, return its directory.

    The local miss stands when no Hub source is configured (no hub_repo, no KVHUB_HUB_NAMESPACES) and
    for aliases other than ``latest`` (they are names in this store, not on the Hub).
    """
    # ---- hub fallback hook (owned by kvhub.hub; keep this body minimal) ----
    from .hub import configured_namespaces, load_from_hub
    from .store import open_store
    from .store.refs import parse_selector

    if (hub_repo is None and not configured_namespaces()) or alias not in (None, "latest"):
        raise miss
    number = parse_selector(version)[0] if version is not None else None
    with open_store(db) as store:
        pulled = load_from_hub(store, src, dst, calibration=calib, version=number, hub_repo=hub_repo)
        return store.artifact_path(pulled.version)
