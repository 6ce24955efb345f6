"""SQL storage: the shared declarative base, engines, and the metrics tables.

Control tables (placements, proposals, overrides, audit) live in
``backend.storage.control``; run summaries, per-batch job metrics and retention in
``backend.storage.summaries``; the tokens table in ``backend.auth.tokens``; the schema's
migrations in ``backend.storage.migrations``; the SQL thread in ``backend.storage.gateway``.
"""

from backend.storage.base import Base, make_engine, make_sessionmaker
from backend.storage.metrics import (
    JobRow,
    RankMetricRow,
    RankRow,
    get_job,
    insert_windows,
    list_jobs,
    list_ranks,
    query_metrics,
    upsert_hello,
    upsert_hellos,
)

__all__ = [
    "Base",
    "make_engine",
    "make_sessionmaker",
    "JobRow",
    "RankRow",
    "RankMetricRow",
    "upsert_hello",
    "upsert_hellos",
    "insert_windows",
    "list_jobs",
    "get_job",
    "list_ranks",
    "query_metrics",
]
