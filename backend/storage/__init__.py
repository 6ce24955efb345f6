"""SQL storage: the shared declarative base, engines, and the metrics tables.

Control tables (placements, proposals, overrides, audit, job settings) live in
``backend.storage.control``; the tokens table lives in ``backend.auth.tokens``.
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
    utcnow,
)

__all__ = [
    "Base",
    "make_engine",
    "make_sessionmaker",
    "JobRow",
    "RankRow",
    "RankMetricRow",
    "utcnow",
    "upsert_hello",
    "insert_windows",
    "list_jobs",
    "get_job",
    "list_ranks",
    "query_metrics",
]
