"""Device meshes in the stored history (issue 24): ``jobs`` gains ``mesh``, the job's mesh
shape as its hooks said it, and ``ranks`` gains ``replica_ranks``, the global ranks of a
mesh job's replica (its rows are replicas). NULL for plain data parallel.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("mesh", sa.JSON, nullable=True))
    with op.batch_alter_table("ranks") as batch:
        batch.add_column(sa.Column("replica_ranks", sa.JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ranks") as batch:
        batch.drop_column("replica_ranks")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("mesh")
