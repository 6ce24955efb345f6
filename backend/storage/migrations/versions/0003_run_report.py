"""The end-of-run report joins the run's summary: ``run_summaries`` gains ``report`` (the
report's JSON), ``report_reason`` and ``report_at`` (NULL until the run ends or an operator
asks for it).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("run_summaries") as batch:
        batch.add_column(sa.Column("report", sa.JSON, nullable=True))
        batch.add_column(sa.Column("report_reason", sa.String(128), nullable=True))
        batch.add_column(sa.Column("report_at", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("run_summaries") as batch:
        batch.drop_column("report_at")
        batch.drop_column("report_reason")
        batch.drop_column("report")
