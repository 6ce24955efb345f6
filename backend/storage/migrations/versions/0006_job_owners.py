"""Lease fencing (issue 38): ``job_owners`` holds, per job, the lease epoch of the replica
that controls it; every control write checks it in its own transaction.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_owners",
        sa.Column("job", sa.String(128), primary_key=True),
        sa.Column("epoch", sa.Integer, nullable=False),
        sa.Column("replica", sa.String(64), nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("job_owners")
