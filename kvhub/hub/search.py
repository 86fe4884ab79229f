"""search: mappers published on the Hub, found through their cards' metadata (library_name, base_model)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvhub.artifact.metadata import calibration_series
from kvhub.errors import HubOfflineError
from kvhub.hub.client import _api, hub_errors, hub_settings
from kvhub.hub.verify import same_model

log = logging.getLogger(__name__)


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


def search(
    *,
    source: str | None = None,
    target: str | None = None,
    calibration: str | None = None,
    author: str | None = None,
    token: str | None = None,
    limit: int = 100,
) -> list[HubMapper]:
    """Mappers on the Hub (library_name kvhub) for a model pair, newest first; filters are optional."""
    settings = hub_settings()
    if settings.offline:
        raise HubOfflineError("search: HF_HUB_OFFLINE=1 and searching needs the Hub; unset it and retry", repo_id=None)
    filters = ["kvhub", *(f"base_model:{m}" for m in (source, target) if m and "/" in m)]  # Hub tags: full ids
    found = []
    with hub_errors("search", repo_id=author or "the Hub", token=token, settings=settings):
        for info in _api(settings, token).list_models(filter=filters, author=author, cardData=True, limit=limit):
            card = info.card_data.to_dict() if info.card_data is not None else {}
            if card.get("library_name") != "kvhub" or (mapper := _from_card(info, card)) is None:
                continue
            if _matches(mapper, source, target, calibration):
                found.append(mapper)
    return sorted(found, key=lambda m: m.last_modified or "", reverse=True)


def _from_card(info, card: dict) -> HubMapper | None:
    """The mapper a card describes; None (with a warning) when its metadata is not what kvhub writes:
    one malformed card on the Hub must not break a search for everyone."""
    block = card.get("kvhub") if card.get("kvhub") is not None else {}
    bases = card.get("base_model") or []
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(block, dict) or not isinstance(bases, list):
        return _skip(info, "its `kvhub` or `base_model` card metadata has the wrong type")
    source = _model_id(block.get("source")) or (bases[0] if bases else None)
    target = _model_id(block.get("target")) or (bases[1] if len(bases) > 1 else None)
    calibration = block.get("calibration") if isinstance(block.get("calibration"), dict) else {}
    metrics = block.get("metrics") if block.get("metrics") is not None else {}
    fields = (source, target, calibration_series(calibration), block.get("version"))
    if not isinstance(metrics, dict) or not all(x is None or isinstance(x, str) for x in fields):
        return _skip(info, "its `kvhub` card metadata has fields of the wrong type")
    if not source or not target:
        return None
    k = block.get("k") if isinstance(block.get("k"), (int, str, type(None))) else None
    numbers = {str(n): v for n, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return HubMapper(
        repo_id=info.id,
        source=source,
        target=target,
        calibration=calibration_series(calibration),
        version=block.get("version"),
        k=k,
        metrics=numbers,
        private=bool(info.private),
        last_modified=info.last_modified.isoformat() if info.last_modified else None,
    )


def _model_id(fingerprint) -> str | None:
    return fingerprint.get("model_id") if isinstance(fingerprint, dict) else None


def _skip(info, why: str) -> None:
    log.warning("skipping %s: %s", info.id, why)
    return None


def _matches(mapper: HubMapper, source: str | None, target: str | None, calibration: str | None) -> bool:
    return (
        (source is None or same_model(mapper.source, source))
        and (target is None or same_model(mapper.target, target))
        and (calibration is None or (mapper.calibration or "").lower() == calibration.lower())
    )
