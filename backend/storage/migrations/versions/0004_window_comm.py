"""Communication in the stored history (issue 25): ``rank_metrics`` gains ``comm_bytes``
and ``comm_ms``, a rank's mean bytes handed to collectives and ms inside them per step over
the window (NULL where no step carried the counters).

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rank_metrics") as batch:
        batch.add_column(sa.Column("comm_bytes", sa.Float, nullable=True))
        batch.add_column(sa.Column("comm_ms", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rank_metrics") as batch:
        batch.drop_column("comm_ms")
        batch.drop_column("comm_bytes")
