"""SQLAlchemy models of the store's tables (the live schema; migrations never import this module).

Tables
    store_properties  store-wide settings (the store id)
    models            one row per model fingerprint (name + revision + config hash + tokenizer hash)
    calibration_sets  one row per (name, recipe version, content hash)
    mapper_series     one row per (source name, target name, calibration name): the triple a reference
                      names; ``last_version`` is the counter that keeps version numbers monotonic even
                      after the newest version is removed
    mapper_versions   one immutable row per registered artifact (its map kind, and an mlp map's shape and losses)
    aliases           (series, name) -> version; ``latest`` is maintained by the store
    metrics           name/value/split/task/layer/n/seed measurements of a version
    hub_publications  where a version was pushed (repo id, revision, commit sha)

Constraint names come from :data:`NAMING_CONVENTION` so migrations can name them identically on
SQLite and PostgreSQL.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    event,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from kvhub.errors import StoreError

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

STATUS_READY = "ready"


def utcnow() -> datetime:
    """Timezone-aware now in UTC (SQLite hands it back naive; see records.as_utc)."""
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class StorePropertyRow(Base):
    """Store-wide settings; ``store_id`` (set by the first migration) names this store's artifact folder."""

    __tablename__ = "store_properties"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String)


class ModelRow(Base):
    """A model fingerprint; ``identity_sha256`` hashes name, revision, config and tokenizer hashes."""

    __tablename__ = "models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    identity_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String, index=True)
    revision: Mapped[str | None] = mapped_column(String)
    model_type: Mapped[str] = mapped_column(String(64))
    family: Mapped[str] = mapped_column(String(64), index=True)
    config_hash: Mapped[str] = mapped_column(String(64))
    tokenizer_hash: Mapped[str | None] = mapped_column(String(64))
    num_layers: Mapped[int] = mapped_column(Integer)
    num_kv_heads: Mapped[int] = mapped_column(Integer)
    head_dim: Mapped[int] = mapped_column(Integer)
    rope: Mapped[dict] = mapped_column(JSON)
    layer_types: Mapped[list] = mapped_column(JSON)
    fingerprint: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CalibrationSetRow(Base):
    """A calibration set as recorded in mapper.json; ``recipe`` keeps the whole dict."""

    __tablename__ = "calibration_sets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    identity_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String, index=True)
    version: Mapped[str | None] = mapped_column(String(64))
    content_hash: Mapped[str | None] = mapped_column(String(64))
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    recipe: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class SeriesRow(Base):
    """The triple a reference names; owns the version counter and the aliases."""

    __tablename__ = "mapper_series"
    __table_args__ = (UniqueConstraint("source_name", "target_name", "calibration_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    source_name: Mapped[str] = mapped_column(String)
    target_name: Mapped[str] = mapped_column(String)
    calibration_name: Mapped[str] = mapped_column(String)
    last_version: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class VersionRow(Base):
    """One registered artifact.  Immutable: the ORM refuses updates (see the listener below)."""

    __tablename__ = "mapper_versions"
    __table_args__ = (
        UniqueConstraint("series_id", "version"),
        CheckConstraint(f"status IN ('{STATUS_READY}')", name="status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    series_id: Mapped[int] = mapped_column(ForeignKey("mapper_series.id", ondelete="RESTRICT"))
    version: Mapped[int] = mapped_column(Integer)
    source_model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="RESTRICT"), index=True)
    target_model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="RESTRICT"), index=True)
    calibration_set_id: Mapped[int] = mapped_column(ForeignKey("calibration_sets.id", ondelete="RESTRICT"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    k: Mapped[int | None] = mapped_column(Integer)
    ridge_lambda: Mapped[float | None] = mapped_column(Float)
    selected_layers: Mapped[list] = mapped_column(JSON)
    artifact_sha256: Mapped[str] = mapped_column(String(64), index=True)
    tensors_sha256: Mapped[str] = mapped_column(String(64))
    artifact_bytes: Mapped[int] = mapped_column(BigInteger)
    artifact_location: Mapped[str] = mapped_column(String)
    status: Mapped[str] = mapped_column(String(16), default=STATUS_READY)
    format_version: Mapped[int] = mapped_column(Integer)
    kvhub_version: Mapped[str | None] = mapped_column(String(32))
    lineage: Mapped[dict | None] = mapped_column(JSON)
    map_kind: Mapped[str] = mapped_column(String(32), default="ridge", server_default="ridge")  # artifact.kinds
    mlp_width: Mapped[int | None] = mapped_column(Integer)  # kind mlp: hidden width and layers of its MLPs
    mlp_depth: Mapped[int | None] = mapped_column(Integer)
    mlp_losses: Mapped[dict | None] = mapped_column(JSON)  # {"k"|"v": {"train"|"heldout": [MSE per layer]}}

    series: Mapped[SeriesRow] = relationship()
    source_model: Mapped[ModelRow] = relationship(foreign_keys=[source_model_id])
    target_model: Mapped[ModelRow] = relationship(foreign_keys=[target_model_id])
    calibration_set: Mapped[CalibrationSetRow] = relationship()


class AliasRow(Base):
    """(series, name) -> version: one version per alias per triple."""

    __tablename__ = "aliases"
    __table_args__ = (UniqueConstraint("series_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    series_id: Mapped[int] = mapped_column(ForeignKey("mapper_series.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    version_id: Mapped[int] = mapped_column(ForeignKey("mapper_versions.id", ondelete="CASCADE"), index=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class MetricRow(Base):
    """One measurement; ``layer`` is set for per-layer metrics, ``split``/``task`` where they apply."""

    __tablename__ = "metrics"
    __table_args__ = (Index(None, "version_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("mapper_versions.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128), index=True)
    value: Mapped[float] = mapped_column(Float)
    split: Mapped[str | None] = mapped_column(String(64))
    task: Mapped[str | None] = mapped_column(String(128))
    layer: Mapped[int | None] = mapped_column(Integer)
    n: Mapped[int | None] = mapped_column(BigInteger)
    seed: Mapped[int | None] = mapped_column(BigInteger)
    measured_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    kvhub_version: Mapped[str] = mapped_column(String(32))


class PublicationRow(Base):
    """A push of a version to the Hugging Face Hub."""

    __tablename__ = "hub_publications"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("mapper_versions.id", ondelete="CASCADE"), index=True)
    repo_id: Mapped[str] = mapped_column(String(256), index=True)
    revision: Mapped[str | None] = mapped_column(String(256))
    commit_sha: Mapped[str | None] = mapped_column(String(64))
    published_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


@event.listens_for(VersionRow, "before_update")
def _refuse_version_update(mapper, connection, target) -> None:
    raise StoreError(f"mapper version row {target.id} is immutable; register a new version instead of editing this one")
