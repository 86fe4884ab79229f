"""From an artifact's mapper.json to store rows (read without torch: registering stays light).

The store keeps artifacts of the format versions kvhub.artifact reads (SUPPORTED_FORMAT_VERSIONS),
each checked by kvhub.artifact before anything is stored.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import cast

from sqlalchemy import Table, select, update
from sqlalchemy.orm import Session

from kvhub import __version__
from kvhub.artifact import (  # noqa: F401
    METADATA_FILE,
    SUPPORTED_FORMAT_VERSIONS,
    json_sha256,
    read_metadata,
    verify_tensors,
)
from kvhub.artifact.metadata import calibration_series
from kvhub.errors import ArtifactError, ConfigError, IntegrityError, InvalidArtifactError, NonFiniteError
from kvhub.store.artifacts import StoredArtifact
from kvhub.store.records import corpus_hash
from kvhub.store.refs import LATEST, check_calibration_name
from kvhub.store.lookup import newest_version
from kvhub.store.tables import AliasRow, CalibrationSetRow, MetricRow, ModelRow, SeriesRow, VersionRow, utcnow

log = logging.getLogger(__name__)

METRIC_FIELDS = ("name", "value", "split", "task", "layer", "n", "seed")


def _identity(*parts) -> str:
    """The row identity of a model or calibration set: the sha256 of its key parts as one JSON list."""
    return json_sha256(list(parts))


def _integer(value) -> int | None:
    """``value`` if it is an int (not a bool), else None: informational columns never fail a write."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_checked_metadata(directory: Path, hashes: dict[str, str]) -> dict:
    """mapper.json of an artifact copy after every check of the format (kvhub.artifact), its tensor
    file's hash taken while copying equal to the recorded one, and each field the store keeps within
    its column's length."""
    if METADATA_FILE not in hashes:
        raise ArtifactError(f"{METADATA_FILE} is missing; not a kvhub mapper artifact (write one with `kvhub fit`)")
    metadata = read_metadata(directory)
    name, expected = metadata["tensors"]["file"], metadata["tensors"]["sha256"]
    if name not in hashes:
        raise ArtifactError(f"{METADATA_FILE} names tensor file {name!r}, which the artifact lacks; re-fit it")
    if hashes[name] != expected:
        raise IntegrityError(
            f"{name} has sha256 {hashes[name]}, but {METADATA_FILE} records {expected}: the artifact was "
            "modified or corrupted; re-fit it or fetch it again"
        )
    verify_tensors(directory, metadata)
    check_storable(metadata)
    return metadata


def check_storable(metadata: dict) -> None:
    """What the store needs beyond the format: a calibration-set name (its series key) and every field
    within its column's length."""
    name = calibration_series(metadata["calibration"])  # calibration.series, or .name in older files
    if not name:
        raise InvalidArtifactError(
            f"{METADATA_FILE} names no calibration set (calibration.name); the store files "
            "versions under it: re-fit the mapper with a calibration set",
            field="calibration.name",
        )
    field = "calibration.series" if metadata["calibration"].get("series") else "calibration.name"
    try:
        check_calibration_name(name)
    except ConfigError as exc:  # it would reach suggested commands (`kvhub fit ... --name NAME`) unquoted
        raise InvalidArtifactError(f"{METADATA_FILE} {field}: {exc}", field=field) from None
    check_lengths(metadata)


def _limit(column) -> int | None:
    return getattr(column.property.columns[0].type, "length", None)


def check_lengths(metadata: dict) -> None:
    """Refuse, naming the field, a mapper.json value longer than the store's column for it (PostgreSQL
    would refuse the row only after the artifact was copied; SQLite would keep it silently)."""
    fields = [("kvhub_version", metadata.get("kvhub_version"), VersionRow.kvhub_version)]
    for role in ("source", "target"):
        for key, column in (
            ("model_type", ModelRow.model_type),
            ("family", ModelRow.family),
            ("config_hash", ModelRow.config_hash),
            ("tokenizer_hash", ModelRow.tokenizer_hash),
        ):
            fields.append((f"{role}.{key}", metadata[role].get(key), column))
    calibration = metadata["calibration"]
    fields += [
        ("calibration.version", calibration.get("version"), CalibrationSetRow.version),
        ("calibration.content_hash", calibration.get("content_hash"), CalibrationSetRow.content_hash),
    ]
    fields += [(f"metrics.{m['name']}", m["name"], MetricRow.name) for m in metadata_metrics(metadata)]
    for name, value, column in fields:
        limit = _limit(column)
        if value is not None and limit is not None and len(str(value)) > limit:
            raise InvalidArtifactError(
                f"{METADATA_FILE} field `{name}` is {len(str(value))} characters long; the store keeps at most "
                f"{limit}: shorten it (nothing was stored)",
                field=name,
            )


# ---- get-or-create (a concurrent insert of the same row raises IntegrityError; the caller retries) ---
def model_row(session: Session, fingerprint: dict) -> ModelRow:
    identity = _identity(
        fingerprint["model_id"],
        fingerprint.get("revision"),
        fingerprint["config_hash"],
        fingerprint.get("tokenizer_hash"),
    )
    row = session.scalar(select(ModelRow).where(ModelRow.identity_sha256 == identity))
    if row is None:
        row = ModelRow(
            identity_sha256=identity,
            name=fingerprint["model_id"],
            revision=fingerprint.get("revision"),
            model_type=fingerprint["model_type"],
            family=fingerprint["family"],
            config_hash=fingerprint["config_hash"],
            tokenizer_hash=fingerprint.get("tokenizer_hash"),
            num_layers=fingerprint["num_layers"],
            num_kv_heads=fingerprint["num_kv_heads"],
            head_dim=fingerprint["head_dim"],
            rope=fingerprint.get("rope") or {},
            layer_types=fingerprint.get("layer_types") or [],
            fingerprint=fingerprint,
        )
        session.add(row)
        session.flush()
    return row


def calibration_row(session: Session, calibration: dict) -> CalibrationSetRow:
    version = calibration.get("version")
    version = None if version is None else str(version)
    name = calibration_series(calibration)  # the series' name: the store's calibration sets are series
    identity = _identity(name, version, calibration.get("content_hash"))
    row = session.scalar(select(CalibrationSetRow).where(CalibrationSetRow.identity_sha256 == identity))
    if row is None:
        row = CalibrationSetRow(
            identity_sha256=identity,
            name=name,
            version=version,
            content_hash=calibration.get("content_hash"),
            tokens=_integer(calibration.get("tokens")),
            recipe=calibration,
        )
        session.add(row)
        session.flush()
    return row


def series_row(session: Session, source: str, target: str, calibration: str) -> SeriesRow:
    key = (SeriesRow.source_name == source, SeriesRow.target_name == target, SeriesRow.calibration_name == calibration)
    row = session.scalar(select(SeriesRow).where(*key))
    if row is None:
        row = SeriesRow(source_name=source, target_name=target, calibration_name=calibration, last_version=0)
        session.add(row)
        session.flush()
    return row


def lock_series(session: Session, series_id: int) -> None:
    """Take the series row lock until commit (PostgreSQL; SQLite's BEGIN IMMEDIATE serialises writers).

    Everything that changes a series' counter or aliases takes it first, so those changes are ordered.
    """
    session.execute(select(SeriesRow.id).where(SeriesRow.id == series_id).with_for_update())


def next_version(session: Session, series: SeriesRow, preferred: int | None = None) -> int:
    """Take a version number (call with the series locked): ``preferred`` when it is above every number
    the series has used (the numbers between are skipped) or when no version of the series holds it (a
    pull of an older Hub tag fills the gap its number left), else the next one.  The counter only
    grows, so fit and import never hand out a number again."""
    table = cast(Table, SeriesRow.__table__)
    last = session.execute(select(table.c.last_version).where(table.c.id == series.id)).scalar_one()
    if preferred is not None and preferred <= last and not _holds(session, series.id, preferred):
        return preferred
    number = preferred if preferred is not None and preferred > last else last + 1
    session.execute(update(table).where(table.c.id == series.id).values(last_version=number))
    return number


def _holds(session: Session, series_id: int, number: int) -> bool:
    query = select(VersionRow.id).where(VersionRow.series_id == series_id, VersionRow.version == number)
    return session.scalar(query) is not None


def set_alias(session: Session, series_id: int, name: str, version_id: int) -> None:
    """Point alias ``name`` of a series at ``version_id`` (created or moved)."""
    row = session.scalar(select(AliasRow).where(AliasRow.series_id == series_id, AliasRow.name == name))
    if row is None:
        session.add(AliasRow(series_id=series_id, name=name, version_id=version_id))
    else:
        row.version_id, row.updated_at = version_id, utcnow()
    session.flush()


# ---- the version row -----------------------------------------------------------------------------
def insert_version(
    session: Session, metadata: dict, stored: StoredArtifact, lineage: dict | None, preferred_version: int | None = None
) -> int:
    """Insert the next version of the artifact's triple (numbered ``preferred_version`` when that is
    free, see :func:`next_version`) and its metrics, and point ``latest`` at the highest version; returns
    its id.

    Idempotent: an artifact whose tensors a version of its triple holds returns that version's id.
    ConfigError when the triple's versions were fitted on another calibration text (:func:`check_same_text`).
    """
    source = model_row(session, metadata["source"])
    target = model_row(session, metadata["target"])
    calibration = calibration_row(session, metadata["calibration"])
    series = series_row(session, source.name, target.name, calibration.name)
    lock_series(session, series.id)
    existing = find_same_tensors(session, metadata)
    if existing is not None:
        return existing.id
    check_same_text(session, metadata)
    number = next_version(session, series, preferred_version)
    row = VersionRow(
        series_id=series.id,
        version=number,
        source_model_id=source.id,
        target_model_id=target.id,
        calibration_set_id=calibration.id,
        k=_integer(metadata.get("k")),
        ridge_lambda=_number(metadata.get("lambda")),  # per-layer lambdas stay in selected_layers
        selected_layers=metadata.get("layers") or [],
        artifact_sha256=stored.sha256,
        tensors_sha256=metadata["tensors"]["sha256"],
        artifact_bytes=stored.bytes,
        artifact_location=stored.location,
        format_version=metadata["format_version"],
        kvhub_version=metadata.get("kvhub_version"),
        lineage=lineage,
        **map_kind_columns(metadata),
    )
    session.add(row)
    session.flush()
    measured_by = metadata.get("kvhub_version") or __version__
    session.add_all(metric_row(row.id, m, kvhub_version=measured_by) for m in metadata_metrics(metadata, warn=True))
    newest = newest_version(session, series.id)
    set_alias(session, series.id, LATEST, row.id if newest is None else newest.id)  # never None: row is there
    return row.id


def map_kind_columns(metadata: dict) -> dict:
    """The version row's map kind columns from mapper.json (checked by kvhub.artifact): ``map_kind``, and for an
    mlp map its ``mlp_width``, ``mlp_depth`` and ``mlp_losses`` (train and held-out MSE per layer, K and V)."""
    kind = metadata.get("kind") or "ridge"
    settings = metadata.get("mlp") if kind == "mlp" else None
    if not isinstance(settings, dict):
        return {"map_kind": kind}
    return {
        "map_kind": kind,
        "mlp_width": settings.get("width"),
        "mlp_depth": settings.get("depth"),
        "mlp_losses": settings.get("losses"),
    }


def check_same_text(session: Session, metadata: dict) -> None:
    """ConfigError when the artifact's triple holds versions fitted on another calibration text: a series
    is one text, so the same name over other text is refused, never merged (it needs its own name)."""
    new = corpus_hash(metadata["calibration"])
    if new is None:
        return
    key = (
        SeriesRow.source_name == metadata["source"]["model_id"],
        SeriesRow.target_name == metadata["target"]["model_id"],
        SeriesRow.calibration_name == calibration_series(metadata["calibration"]),
    )
    query = (
        select(VersionRow.version, CalibrationSetRow.recipe)
        .join(VersionRow.series)
        .join(VersionRow.calibration_set)
        .where(*key)
        .order_by(VersionRow.version)
    )
    for number, recipe in session.execute(query).all():
        old = corpus_hash(recipe)
        if old is not None and old != new:
            name = calibration_series(metadata["calibration"])
            triple = f"{metadata['source']['model_id']}:{metadata['target']['model_id']}:{name}"
            raise ConfigError(
                f"{triple} holds versions fitted on another text than this mapper's (v{number}: corpus "
                f"{old[:12]}, this one: {new[:12]}); a series holds one calibration text, so give this one its "
                f"own name: `kvhub fit ... --name {name}-2` (any new name)"
            )


def find_same_tensors(session: Session, metadata: dict) -> VersionRow | None:
    """The oldest version of the artifact's series (source, target, calibration names) whose tensor
    file has the same sha256: identical weights are one version, whatever else mapper.json says."""
    key = (
        SeriesRow.source_name == metadata["source"]["model_id"],
        SeriesRow.target_name == metadata["target"]["model_id"],
        SeriesRow.calibration_name == calibration_series(metadata["calibration"]),
    )
    query = (
        select(VersionRow)
        .join(VersionRow.series)
        .where(*key)
        .where(VersionRow.tensors_sha256 == metadata["tensors"]["sha256"])
        .order_by(VersionRow.version)
    )
    return session.scalars(query.limit(1)).first()


def metadata_metrics(metadata: dict, *, warn: bool = False) -> list[dict]:
    """Metrics recorded in mapper.json: numeric entries of ``metrics`` and per-layer held-out R^2.

    Non-finite values are skipped (the artifact keeps them), non-numeric entries too; with ``warn``, each with a
    warning (only where the version is inserted: an import reads the metrics more than once).
    """
    found = [{"name": name, "value": value} for name, value in sorted((metadata.get("metrics") or {}).items())]
    for layer in metadata.get("layers") or []:
        for name in ("r2_k", "r2_v"):
            if name in layer:
                found.append({"name": name, "value": layer[name], "split": "heldout", "layer": layer.get("target")})
    kept = []
    for metric in found:
        value = metric["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            if warn:
                log.warning("not storing metric %s=%r from mapper.json (not a finite number)", metric["name"], value)
            continue
        kept.append(metric)
    return kept


def metric_row(version_id: int, metric: dict, *, kvhub_version: str) -> MetricRow:
    """A MetricRow from {name, value, split?, task?, layer?, n?, seed?}; unknown keys are an error."""
    unknown = set(metric) - set(METRIC_FIELDS)
    if unknown or "name" not in metric or "value" not in metric:
        raise ConfigError(
            f"metric {metric!r} needs a name and a value, and may only have the keys {', '.join(METRIC_FIELDS)}"
        )
    value = metric["value"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise NonFiniteError(f"metric {metric['name']!r} has value {value!r}; only finite numbers are stored")
    for key, column in (("name", MetricRow.name), ("split", MetricRow.split), ("task", MetricRow.task)):
        text, limit = metric.get(key), _limit(column)
        if text is not None and (not isinstance(text, str) or (limit is not None and len(text) > limit)):
            raise ConfigError(f"metric {key} {str(text)[:40]!r} must be a string of at most {limit} characters")
    for key in ("layer", "n", "seed"):
        number = metric.get(key)
        if number is not None and (isinstance(number, bool) or not isinstance(number, int) or abs(number) >= 1 << 62):
            raise ConfigError(f"metric {key} {number!r} must be an integer")
    return MetricRow(
        version_id=version_id,
        name=str(metric["name"]),
        value=float(value),
        split=metric.get("split"),
        task=metric.get("task"),
        layer=metric.get("layer"),
        n=metric.get("n"),
        seed=metric.get("seed"),
        kvhub_version=kvhub_version,
    )
