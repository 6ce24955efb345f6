"""One job table, one time representation, stored run summaries and per-batch job metrics.

- ``control_job_settings`` (mode, policy) folds into ``jobs``; a job the controller has
  not taken on yet has ``mode`` NULL.
- Times in ``jobs``, ``ranks`` and ``auth_tokens`` become Unix seconds (Float), like every
  other table.
- ``run_summaries``: savings against the uniform split and the run's summary, per job.
- ``job_metrics``: the dashboard's per-batch series points, so charts refill after a restart.

Revision ID: 0002
Revises: 0001
"""

from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_BIGID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TIMES = {"jobs": ("created_at", "last_seen"), "ranks": ("first_seen", "last_seen"),
          "auth_tokens": ("created_at", "revoked_at")}
_NULLABLE = {("auth_tokens", "revoked_at")}


def _seconds(v: object) -> float | None:
    if v is None:
        return None
    if isinstance(v, str):
        v = datetime.fromisoformat(v)
    assert isinstance(v, datetime)
    if v.tzinfo is None:
        v = v.replace(tzinfo=timezone.utc)  # SQLite keeps naive datetimes, meant as UTC
    return v.timestamp()


def _to_seconds(table: str, cols: tuple[str, ...]) -> None:
    bind = op.get_bind()
    old = sa.table(table, sa.column("id", sa.Integer), *(sa.column(c, sa.DateTime(timezone=True)) for c in cols))
    rows = [(r[0], [_seconds(v) for v in r[1:]]) for r in bind.execute(sa.select(old.c.id, *(old.c[c] for c in cols)))]
    with op.batch_alter_table(table) as b:
        for c in cols:
            b.add_column(sa.Column(f"{c}_s", sa.Float, nullable=True))
    new = sa.table(table, sa.column("id", sa.Integer), *(sa.column(f"{c}_s", sa.Float) for c in cols))
    for rid, vals in rows:
        bind.execute(new.update().where(new.c.id == rid).values({f"{c}_s": v for c, v in zip(cols, vals, strict=True)}))
    with op.batch_alter_table(table) as b:
        for c in cols:
            b.drop_column(c)
    with op.batch_alter_table(table) as b:
        for c in cols:
            b.alter_column(f"{c}_s", new_column_name=c, existing_type=sa.Float,
                           nullable=(table, c) in _NULLABLE)


def upgrade() -> None:
    for table, cols in _TIMES.items():
        _to_seconds(table, cols)
    with op.batch_alter_table("jobs") as b:
        b.add_column(sa.Column("mode", sa.String(16), nullable=True))
        b.add_column(sa.Column("policy", sa.JSON, nullable=True))
        b.add_column(sa.Column("updated_at", sa.Float, nullable=True))
    bind = op.get_bind()
    settings = sa.table("control_job_settings", sa.column("job", sa.String), sa.column("world_size", sa.Integer),
                        sa.column("global_batch_size", sa.Integer), sa.column("mode", sa.String),
                        sa.column("policy", sa.JSON), sa.column("created_at", sa.Float),
                        sa.column("updated_at", sa.Float))
    jobs = sa.table("jobs", sa.column("id", sa.Integer), sa.column("name", sa.String),
                    sa.column("world_size", sa.Integer), sa.column("global_batch_size", sa.Integer),
                    sa.column("created_at", sa.Float), sa.column("last_seen", sa.Float),
                    sa.column("mode", sa.String), sa.column("policy", sa.JSON),
                    sa.column("updated_at", sa.Float))
    have = {r.name for r in bind.execute(sa.select(jobs.c.name))}
    for r in bind.execute(sa.select(settings)).all():
        values = {"mode": r.mode, "policy": r.policy or {}, "updated_at": r.updated_at}
        if r.job in have:
            bind.execute(jobs.update().where(jobs.c.name == r.job).values(values))
        else:
            bind.execute(jobs.insert().values(
                name=r.job, world_size=r.world_size, global_batch_size=r.global_batch_size,
                created_at=r.created_at, last_seen=r.updated_at, **values))
    op.drop_table("control_job_settings")
    op.create_table(
        "run_summaries",
        sa.Column("job", sa.String(128), primary_key=True),
        sa.Column("batch_index", sa.BigInteger, nullable=True),
        sa.Column("total_steps", sa.BigInteger, nullable=True),
        sa.Column("measured_s", sa.Float, nullable=False),
        sa.Column("uniform_s", sa.Float, nullable=False),
        sa.Column("saved_s", sa.Float, nullable=False),
        sa.Column("saved_cost", sa.Float, nullable=True),
        sa.Column("cost_per_hour", sa.Float, nullable=True),
        sa.Column("step_ms", sa.Float, nullable=True),
        sa.Column("imbalance", sa.Float, nullable=True),
        sa.Column("placement_version", sa.Integer, nullable=True),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "job_metrics",
        sa.Column("id", _BIGID, primary_key=True),
        sa.Column("job", sa.String(128), nullable=False),
        sa.Column("t", sa.Float, nullable=False),
        sa.Column("batch_index", sa.BigInteger, nullable=False),
        sa.Column("step_ms", sa.Float, nullable=False),
        sa.Column("max_compute_ms", sa.Float, nullable=False),
        sa.Column("mean_compute_ms", sa.Float, nullable=False),
        sa.Column("throughput", sa.Float, nullable=True),
        sa.Column("uniform_step_ms", sa.Float, nullable=True),
        sa.Column("version", sa.Integer, nullable=False),
    )
    op.create_index("ix_job_metrics_job_batch", "job_metrics", ["job", "batch_index"])
    op.create_index("ix_rank_metrics_t_end", "rank_metrics", ["t_end"])
    op.create_index("ix_job_metrics_t", "job_metrics", ["t"])


def downgrade() -> None:
    raise NotImplementedError("0002 folds two tables into one; restore a backup to go back.")
