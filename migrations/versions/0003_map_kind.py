"""Map kinds: each version's kind (ridge, mlp), its MLP's width and depth, and its training losses.

Revision ID: 0003_map_kind
Revises: 0002_hub_publications
Create Date: 2026-12-02

Existing versions are ridge maps (kvhub before map kinds fitted nothing else): ``map_kind`` is filled with
'ridge' for them; the MLP columns stay NULL.
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0003_map_kind"
down_revision: Union[str, Sequence[str], None] = "0002_hub_publications"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("mapper_versions") as batch:
        batch.add_column(sa.Column("map_kind", sa.String(32), nullable=False, server_default="ridge"))
        batch.add_column(sa.Column("mlp_width", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("mlp_depth", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("mlp_losses", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("mapper_versions") as batch:
        batch.drop_column("mlp_losses")
        batch.drop_column("mlp_depth")
        batch.drop_column("mlp_width")
        batch.drop_column("map_kind")
