"""A pipelined job's predictions on record (issue 40 item 3): ``control_placements`` gains
``prediction``, the stage model's step per pipeline and for the job when the placement was
made, and, once it settled, the measured ones beside them (NULL for a job without pipelines).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("control_placements") as batch:
        batch.add_column(sa.Column("prediction", sa.JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("control_placements") as batch:
        batch.drop_column("prediction")
