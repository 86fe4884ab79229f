"""Plain, session-free records the Store hands out (ORM rows never leave the store)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import overload

from kvhub.store.refs import short_name
from kvhub.store.tables import VersionRow


@overload
def as_utc(moment: datetime) -> datetime: ...
@overload
def as_utc(moment: None) -> None: ...
def as_utc(moment: datetime | None) -> datetime | None:
    """Timezone-aware UTC datetime (SQLite returns naive datetimes that were written in UTC)."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=timezone.utc)


def corpus_hash(calibration: dict) -> str | None:
    """The sha256 of a calibration set's text (its kept documents), None for artifacts that predate it.

    Not ``content_hash``: that one changes with the sample count, length and seed, which versions of
    one series may differ in."""
    value = calibration.get("corpus_hash") if isinstance(calibration, dict) else None
    return value if isinstance(value, str) and value else None


@dataclass(frozen=True, eq=True)
class MapperVersion:
    """One registered mapper version.

    ``source``/``target`` are model ids as fitted, ``calibration`` the calibration-set name; together
    they are the triple whose versions are numbered 1, 2, 3, ...  ``artifact_sha256`` is the content
    address of the artifact directory (see kvhub.store.artifacts), ``tensors_sha256`` the sha256 of its
    tensor file; ``aliases`` are the aliases pointing at this version when it was read;
    ``calibration_text_sha256`` is the sha256 of the calibration text (None for artifacts that predate
    it): one per series, see kvhub.store.ingest.check_same_text.
    """

    id: int
    source: str
    target: str
    calibration: str
    version: int
    created_at: datetime
    status: str
    k: int | None
    ridge_lambda: float | None
    selected_layers: list = field(hash=False)
    family: str
    artifact_sha256: str
    tensors_sha256: str
    artifact_bytes: int
    artifact_location: str
    format_version: int
    kvhub_version: str | None
    lineage: dict | None = field(hash=False)
    aliases: tuple[str, ...] = ()
    calibration_text_sha256: str | None = None
    map_kind: str = "ridge"  # kvhub.artifact.kinds; an mlp map's shape and losses below
    mlp_width: int | None = None
    mlp_depth: int | None = None
    mlp_losses: dict | None = field(default=None, hash=False)

    @property
    def ref(self) -> str:
        """Full reference, e.g. ``Qwen/A:Qwen/B:legal-docs@v3``."""
        return f"{self.source}:{self.target}:{self.calibration}@v{self.version}"

    @property
    def short_ref(self) -> str:
        """Reference with short model names, e.g. ``a:b:legal-docs@v3`` (may be ambiguous in a store)."""
        return f"{short_name(self.source)}:{short_name(self.target)}:{self.calibration}@v{self.version}"

    def to_dict(self) -> dict:
        """JSON-ready dict (datetimes as ISO 8601 strings), including ``ref``; without the database
        ``id`` (``version`` is the number users see)."""
        data = asdict(self)
        del data["id"]
        data["created_at"] = self.created_at.isoformat()
        data["aliases"] = list(self.aliases)
        data["ref"] = self.ref
        return data


def version_record(row: VersionRow, aliases: list[str] | tuple[str, ...] = ()) -> MapperVersion:
    """MapperVersion from a row with its series and source model loaded."""
    return MapperVersion(
        id=row.id,
        source=row.series.source_name,
        target=row.series.target_name,
        calibration=row.series.calibration_name,
        version=row.version,
        created_at=as_utc(row.created_at),
        status=row.status,
        k=row.k,
        ridge_lambda=row.ridge_lambda,
        selected_layers=row.selected_layers,
        family=row.source_model.family,
        artifact_sha256=row.artifact_sha256,
        tensors_sha256=row.tensors_sha256,
        artifact_bytes=row.artifact_bytes,
        artifact_location=row.artifact_location,
        format_version=row.format_version,
        kvhub_version=row.kvhub_version,
        lineage=row.lineage,
        aliases=tuple(sorted(aliases)),
        calibration_text_sha256=corpus_hash(row.calibration_set.recipe),
        map_kind=row.map_kind or "ridge",
        mlp_width=row.mlp_width,
        mlp_depth=row.mlp_depth,
        mlp_losses=row.mlp_losses,
    )
