"""Initial store schema: store properties, models, calibration sets, series, versions, aliases, metrics.

Revision ID: 0001_initial_schema
Revises:
Create Date: 2025-11-30

Tables are written out here (never imported from kvhub.store.tables) so this script keeps meaning
what it meant when it was written.  Constraint names follow kvhub.store.tables.NAMING_CONVENTION.
"""

import uuid
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0001_initial_schema"
down_revision: Union[str, Sequence[str], None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

_TZ = sa.DateTime(timezone=True)


def _id() -> sa.Column:
    return sa.Column("id", sa.Integer(), nullable=False)


def upgrade() -> None:
    properties = op.create_table(
        "store_properties",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("value", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_store_properties"),
    )
    # The store id names this store's folder under the artifacts directory, so two stores sharing
    # that directory never collect each other's artifacts.
    op.bulk_insert(properties, [{"name": "store_id", "value": uuid.uuid4().hex}])

    op.create_table(
        "models",
        _id(),
        sa.Column("identity_sha256", sa.String(64), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("revision", sa.String(), nullable=True),
        sa.Column("model_type", sa.String(64), nullable=False),
        sa.Column("family", sa.String(64), nullable=False),
        sa.Column("config_hash", sa.String(64), nullable=False),
        sa.Column("tokenizer_hash", sa.String(64), nullable=True),
        sa.Column("num_layers", sa.Integer(), nullable=False),
        sa.Column("num_kv_heads", sa.Integer(), nullable=False),
        sa.Column("head_dim", sa.Integer(), nullable=False),
        sa.Column("rope", sa.JSON(), nullable=False),
        sa.Column("layer_types", sa.JSON(), nullable=False),
        sa.Column("fingerprint", sa.JSON(), nullable=False),
        sa.Column("created_at", _TZ, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_models"),
        sa.UniqueConstraint("identity_sha256", name="uq_models_identity_sha256"),
    )
    op.create_index("ix_models_name", "models", ["name"])
    op.create_index("ix_models_family", "models", ["family"])

    op.create_table(
        "calibration_sets",
        _id(),
        sa.Column("identity_sha256", sa.String(64), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("version", sa.String(64), nullable=True),
        sa.Column("content_hash", sa.String(64), nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=True),
        sa.Column("recipe", sa.JSON(), nullable=False),
        sa.Column("created_at", _TZ, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_calibration_sets"),
        sa.UniqueConstraint("identity_sha256", name="uq_calibration_sets_identity_sha256"),
    )
    op.create_index("ix_calibration_sets_name", "calibration_sets", ["name"])

    op.create_table(
        "mapper_series",
        _id(),
        sa.Column("source_name", sa.String(), nullable=False),
        sa.Column("target_name", sa.String(), nullable=False),
        sa.Column("calibration_name", sa.String(), nullable=False),
        sa.Column("last_version", sa.Integer(), nullable=False),
        sa.Column("created_at", _TZ, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_mapper_series"),
        sa.UniqueConstraint(
            "source_name",
            "target_name",
            "calibration_name",
            name="uq_mapper_series_source_name_target_name_calibration_name",
        ),
    )

    op.create_table(
        "mapper_versions",
        _id(),
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("source_model_id", sa.Integer(), nullable=False),
        sa.Column("target_model_id", sa.Integer(), nullable=False),
        sa.Column("calibration_set_id", sa.Integer(), nullable=False),
        sa.Column("created_at", _TZ, nullable=False),
        sa.Column("k", sa.Integer(), nullable=True),
        sa.Column("ridge_lambda", sa.Float(), nullable=True),
        sa.Column("selected_layers", sa.JSON(), nullable=False),
        sa.Column("artifact_sha256", sa.String(64), nullable=False),
        sa.Column("tensors_sha256", sa.String(64), nullable=False),
        sa.Column("artifact_bytes", sa.BigInteger(), nullable=False),
        sa.Column("artifact_location", sa.String(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("format_version", sa.Integer(), nullable=False),
        sa.Column("kvhub_version", sa.String(32), nullable=True),
        sa.Column("lineage", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_mapper_versions"),
        sa.UniqueConstraint("series_id", "version", name="uq_mapper_versions_series_id_version"),
        sa.CheckConstraint("status IN ('ready')", name="ck_mapper_versions_status"),
        sa.ForeignKeyConstraint(
            ["series_id"],
            ["mapper_series.id"],
            ondelete="RESTRICT",
            name="fk_mapper_versions_series_id_mapper_series",
        ),
        sa.ForeignKeyConstraint(
            ["source_model_id"],
            ["models.id"],
            ondelete="RESTRICT",
            name="fk_mapper_versions_source_model_id_models",
        ),
        sa.ForeignKeyConstraint(
            ["target_model_id"],
            ["models.id"],
            ondelete="RESTRICT",
            name="fk_mapper_versions_target_model_id_models",
        ),
        sa.ForeignKeyConstraint(
            ["calibration_set_id"],
            ["calibration_sets.id"],
            ondelete="RESTRICT",
            name="fk_mapper_versions_calibration_set_id_calibration_sets",
        ),
    )
    for column in ("source_model_id", "target_model_id", "calibration_set_id", "artifact_sha256"):
        op.create_index(f"ix_mapper_versions_{column}", "mapper_versions", [column])

    op.create_table(
        "aliases",
        _id(),
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("updated_at", _TZ, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_aliases"),
        sa.UniqueConstraint("series_id", "name", name="uq_aliases_series_id_name"),
        sa.ForeignKeyConstraint(
            ["series_id"], ["mapper_series.id"], ondelete="CASCADE", name="fk_aliases_series_id_mapper_series"
        ),
        sa.ForeignKeyConstraint(
            ["version_id"], ["mapper_versions.id"], ondelete="CASCADE", name="fk_aliases_version_id_mapper_versions"
        ),
    )
    op.create_index("ix_aliases_version_id", "aliases", ["version_id"])

    op.create_table(
        "metrics",
        _id(),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("split", sa.String(64), nullable=True),
        sa.Column("task", sa.String(128), nullable=True),
        sa.Column("layer", sa.Integer(), nullable=True),
        sa.Column("measured_at", _TZ, nullable=False),
        sa.Column("kvhub_version", sa.String(32), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_metrics"),
        sa.ForeignKeyConstraint(
            ["version_id"], ["mapper_versions.id"], ondelete="CASCADE", name="fk_metrics_version_id_mapper_versions"
        ),
    )


def downgrade() -> None:
    op.drop_table("metrics")
    op.drop_index("ix_aliases_version_id", table_name="aliases")
    op.drop_table("aliases")
    for column in ("source_model_id", "target_model_id", "calibration_set_id", "artifact_sha256"):
        op.drop_index(f"ix_mapper_versions_{column}", table_name="mapper_versions")
    op.drop_table("mapper_versions")
    op.drop_table("mapper_series")
    op.drop_index("ix_calibration_sets_name", table_name="calibration_sets")
    op.drop_table("calibration_sets")
    op.drop_index("ix_models_family", table_name="models")
    op.drop_index("ix_models_name", table_name="models")
    op.drop_table("models")
    op.drop_table("store_properties")
