"""The first schema of this release: metric history, tokens and control tables.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_BIGID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("world_size", sa.Integer, nullable=False),
        sa.Column("global_batch_size", sa.Integer, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_jobs_name", "jobs", ["name"], unique=True)
    op.create_table(
        "ranks",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("job", sa.String(128), nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("host", sa.String(128), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("device_type", sa.String(128), nullable=False),
        sa.Column("device_name", sa.String(128), nullable=False),
        sa.Column("mem_total_bytes", sa.BigInteger, nullable=True),
        sa.Column("hook_version", sa.String(128), nullable=False),
        sa.Column("restart_count", sa.Integer, nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("job", "rank", name="uq_ranks_job_rank"),
    )
    op.create_index("ix_ranks_job", "ranks", ["job"])
    op.create_table(
        "rank_metrics",
        sa.Column("id", _BIGID, primary_key=True),
        sa.Column("job", sa.String(128), nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("t_start", sa.Float, nullable=False),
        sa.Column("t_end", sa.Float, nullable=False),
        sa.Column("batch_index_start", sa.BigInteger, nullable=False),
        sa.Column("batch_index_end", sa.BigInteger, nullable=False),
        sa.Column("n_steps", sa.Integer, nullable=False),
        sa.Column("placement_version", sa.Integer, nullable=False),
        sa.Column("local_batch_size", sa.Float, nullable=False),
        sa.Column("compute_ms", sa.Float, nullable=False),
        sa.Column("sync_wait_ms", sa.Float, nullable=False),
        sa.Column("data_wait_ms", sa.Float, nullable=False),
        sa.Column("optimizer_ms", sa.Float, nullable=False),
        sa.Column("step_ms", sa.Float, nullable=False),
        sa.Column("dropped", sa.Integer, nullable=False),
        sa.Column("util_pct", sa.Float, nullable=True),
        sa.Column("mem_used_bytes", sa.BigInteger, nullable=True),
        sa.Column("power_w", sa.Float, nullable=True),
        sa.Column("temp_c", sa.Float, nullable=True),
        sa.Column("cpu_pct", sa.Float, nullable=True),
        sa.Column("rss_bytes", sa.BigInteger, nullable=True),
    )
    op.create_index("ix_rank_metrics_job_rank_batch", "rank_metrics", ["job", "rank", "batch_index_end"])
    op.create_table(
        "auth_tokens",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("job", sa.String(128), nullable=True),
        sa.Column("secret_sha256", sa.String(64), nullable=False),
        sa.Column("hint", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_auth_tokens_secret_sha256", "auth_tokens", ["secret_sha256"], unique=True)
    op.create_table(
        "control_job_settings",
        sa.Column("job", sa.String(128), primary_key=True),
        sa.Column("world_size", sa.Integer, nullable=False),
        sa.Column("global_batch_size", sa.Integer, nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("policy", sa.JSON, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "control_overrides",
        sa.Column("job", sa.String(128), primary_key=True),
        sa.Column("pins", sa.JSON, nullable=False),
        sa.Column("caps", sa.JSON, nullable=False),
        sa.Column("floors", sa.JSON, nullable=False),
        sa.Column("drains", sa.JSON, nullable=False),
        sa.Column("granularity", sa.Integer, nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "control_placements",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("job", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("shares", sa.JSON, nullable=False),
        sa.Column("previous_shares", sa.JSON, nullable=True),
        sa.Column("previous_version", sa.Integer, nullable=True),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("proposal_id", sa.Integer, nullable=True),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("effective_batch_index", sa.Integer, nullable=True),
        sa.Column("acks", sa.JSON, nullable=False),
        sa.Column("applied_at", sa.Float, nullable=True),
        sa.Column("failed", sa.Boolean, nullable=False),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("auto", sa.Boolean, nullable=False),
        sa.Column("predicted_step_ms", sa.Float, nullable=True),
        sa.Column("step_ms_before", sa.Float, nullable=True),
        sa.Column("step_ms_after", sa.Float, nullable=True),
        sa.Column("measured_gain", sa.Float, nullable=True),
        sa.Column("rolled_back", sa.Boolean, nullable=False),
        sa.UniqueConstraint("job", "version", name="uq_control_placements_job_version"),
    )
    op.create_index("ix_control_placements_job", "control_placements", ["job"])
    op.create_table(
        "control_proposals",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("job", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("strategy", sa.String(32), nullable=False),
        sa.Column("base_version", sa.Integer, nullable=False),
        sa.Column("shares", sa.JSON, nullable=False),
        sa.Column("current_shares", sa.JSON, nullable=False),
        sa.Column("predicted_step_ms_before", sa.Float, nullable=True),
        sa.Column("predicted_step_ms_after", sa.Float, nullable=True),
        sa.Column("predicted_gain", sa.Float, nullable=True),
        sa.Column("explanation", sa.JSON, nullable=True),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=True),
        sa.Column("decided_by", sa.String(128), nullable=True),
        sa.Column("decided_at", sa.Float, nullable=True),
        sa.Column("decision_reason", sa.Text, nullable=True),
        sa.Column("placement_version", sa.Integer, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
    )
    op.create_index("ix_control_proposals_status", "control_proposals", ["status"])
    op.create_index("ix_control_proposals_job", "control_proposals", ["job"])
    op.create_table(
        "control_audit",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("address", sa.String(128), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("job", sa.String(128), nullable=True),
        sa.Column("params", sa.JSON, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
    )
    op.create_index("ix_control_audit_job", "control_audit", ["job"])
    op.create_index("ix_control_audit_time", "control_audit", ["time"])


def downgrade() -> None:
    for table in ("control_audit", "control_proposals", "control_placements", "control_overrides",
                  "control_job_settings", "auth_tokens", "rank_metrics", "ranks", "jobs"):
        op.drop_table(table)
