"""Hub publications; metric sample size and seed; metric indexes.

Revision ID: 0002_hub_publications
Revises: 0001_initial_schema
Create Date: 2025-11-30

Existing metric rows keep their values; ``n`` and ``seed`` start as NULL (unknown).
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0002_hub_publications"
down_revision: Union[str, Sequence[str], None] = "0001_initial_schema"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "hub_publications",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("repo_id", sa.String(256), nullable=False),
        sa.Column("revision", sa.String(256), nullable=True),
        sa.Column("commit_sha", sa.String(64), nullable=True),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_hub_publications"),
        sa.ForeignKeyConstraint(
            ["version_id"],
            ["mapper_versions.id"],
            ondelete="CASCADE",
            name="fk_hub_publications_version_id_mapper_versions",
        ),
    )
    op.create_index("ix_hub_publications_version_id", "hub_publications", ["version_id"])
    op.create_index("ix_hub_publications_repo_id", "hub_publications", ["repo_id"])
    with op.batch_alter_table("metrics") as batch:
        batch.add_column(sa.Column("n", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("seed", sa.BigInteger(), nullable=True))
        batch.create_index("ix_metrics_name", ["name"])
        batch.create_index("ix_metrics_version_id_name", ["version_id", "name"])


def downgrade() -> None:
    with op.batch_alter_table("metrics") as batch:
        batch.drop_index("ix_metrics_version_id_name")
        batch.drop_index("ix_metrics_name")
        batch.drop_column("seed")
        batch.drop_column("n")
    op.drop_index("ix_hub_publications_repo_id", table_name="hub_publications")
    op.drop_index("ix_hub_publications_version_id", table_name="hub_publications")
    op.drop_table("hub_publications")
