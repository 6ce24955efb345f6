"""Tables for jobs, their ranks and downsampled per-rank metrics, with repository functions.

Jobs are referenced by name (``job`` columns) so other table modules can join on it
without a foreign key to this module's ids. Works on SQLite and PostgreSQL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    Index,
    Integer,
    String,
    UniqueConstraint,
    insert,
    select,
    update,
)
from sqlalchemy.orm import Mapped, Session, mapped_column

from backend.live.windows import Window
from backend.storage.base import Base
from rebalancer_wire.protocol import Hello, MeshShape, ProtocolError

log = logging.getLogger("rebalancer.storage")

__all__ = [
    "JobRow",
    "RankRow",
    "RankMetricRow",
    "upsert_hello",
    "upsert_hellos",
    "job_mesh",
    "insert_windows",
    "list_jobs",
    "get_job",
    "list_ranks",
    "query_metrics",
]


class JobRow(Base):
    """One job: its shape, when it was seen, and (once the controller took it on) its mode
    and policy settings. Times are Unix seconds, as in every table."""

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True, index=True)
    world_size: Mapped[int]
    global_batch_size: Mapped[int]
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    last_seen: Mapped[float] = mapped_column(Float, default=time.time)
    mode: Mapped[str | None] = mapped_column(String(16), nullable=True)  # None: not controlled yet
    policy: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    updated_at: Mapped[float | None]
    # A device-mesh job's shape (MeshShape.to_dict), as its newest hello said it; None: plain DP.
    mesh: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class RankRow(Base):
    __tablename__ = "ranks"
    __table_args__ = (UniqueConstraint("job", "rank", name="uq_ranks_job_rank"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job: Mapped[str] = mapped_column(String(128), index=True)
    rank: Mapped[int]
    host: Mapped[str] = mapped_column(String(128), default="")
    pid: Mapped[int] = mapped_column(Integer, default=0)
    device_type: Mapped[str] = mapped_column(String(128), default="cpu")
    device_name: Mapped[str] = mapped_column(String(128), default="")
    mem_total_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    hook_version: Mapped[str] = mapped_column(String(128), default="")
    restart_count: Mapped[int] = mapped_column(Integer, default=0)
    # A mesh job's replica (its "rank" here): the global ranks of its members; None: plain DP.
    replica_ranks: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    first_seen: Mapped[float] = mapped_column(Float, default=time.time)
    last_seen: Mapped[float] = mapped_column(Float, default=time.time)


class RankMetricRow(Base):
    """One rank's mean step numbers over one persistence window, plus its last device reading."""

    __tablename__ = "rank_metrics"
    __table_args__ = (Index("ix_rank_metrics_job_rank_batch", "job", "rank", "batch_index_end"),
                      Index("ix_rank_metrics_t_end", "t_end"))

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job: Mapped[str] = mapped_column(String(128))
    rank: Mapped[int]
    t_start: Mapped[float]
    t_end: Mapped[float]
    batch_index_start: Mapped[int] = mapped_column(BigInteger)
    batch_index_end: Mapped[int] = mapped_column(BigInteger)
    n_steps: Mapped[int]
    placement_version: Mapped[int]
    local_batch_size: Mapped[float]
    compute_ms: Mapped[float]
    sync_wait_ms: Mapped[float]
    data_wait_ms: Mapped[float]
    optimizer_ms: Mapped[float]
    step_ms: Mapped[float]
    dropped: Mapped[int] = mapped_column(Integer, default=0)
    util_pct: Mapped[float | None]
    mem_used_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    power_w: Mapped[float | None]
    temp_c: Mapped[float | None]
    cpu_pct: Mapped[float | None]
    rss_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # Communication (issue 25): mean bytes handed to collectives and ms inside them per
    # step, over the window's steps that carried the counters (NULL where none did).
    comm_bytes: Mapped[float | None]
    comm_ms: Mapped[float | None]


def upsert_hello(session: Session, hello: Hello, *, new_run: bool = False) -> None:
    """Create or update the job and rank rows for a hello (caller commits)."""
    upsert_hellos(session, [hello])


# Ranks per ``IN (...)`` of one SELECT: under SQLite's oldest bound-parameter limit (999).
_IN_CHUNK = 900


def upsert_hellos(session: Session, hellos: Sequence[Hello]) -> None:
    """Create or update the job and rank rows of many hellos (caller commits): one SELECT of
    their jobs, one of their ranks per job (in chunks), one bulk INSERT of the new ranks and
    one batch of UPDATEs of the known ones, whatever the number of ranks. Later hellos of a
    rank (and of a job, for the job's shape) win, as if each had been stored in turn."""
    if not hellos:
        return
    now = time.time()
    last_of_job: dict[str, Hello] = {}
    by_rank: dict[tuple[str, int], Hello] = {}
    for h in hellos:
        last_of_job[h.job] = h
        by_rank[(h.job, h.rank)] = h
    jobs = {row.name: row for row in session.scalars(select(JobRow).where(JobRow.name.in_(list(last_of_job))))}
    for name, hello in last_of_job.items():
        mesh = hello.mesh.to_dict() if hello.mesh is not None else None
        job = jobs.get(name)
        if job is None:
            session.add(JobRow(name=name, world_size=hello.world_size,
                               global_batch_size=hello.global_batch_size, created_at=now, last_seen=now, mesh=mesh))
        else:
            job.world_size, job.global_batch_size, job.last_seen = hello.world_size, hello.global_batch_size, now
            job.mesh = mesh
    wanted: dict[str, list[int]] = {}
    for name, rank in by_rank:
        wanted.setdefault(name, []).append(rank)
    known: dict[tuple[str, int], int] = {}  # (job, rank) -> the row's id
    for name, ranks in wanted.items():
        for i in range(0, len(ranks), _IN_CHUNK):
            chunk = ranks[i:i + _IN_CHUNK]
            q = select(RankRow.id, RankRow.rank).where(RankRow.job == name, RankRow.rank.in_(chunk))
            for row_id, rank in session.execute(q):
                known[(name, rank)] = row_id
    new_rows: list[dict[str, Any]] = []
    changed: list[dict[str, Any]] = []
    for key, hello in by_rank.items():
        values: dict[str, Any] = {
            "host": hello.host, "pid": hello.pid, "device_type": hello.device_type,
            "device_name": hello.device_name, "mem_total_bytes": hello.mem_total_bytes,
            "hook_version": hello.hook_version, "restart_count": hello.restart_count, "last_seen": now,
            "replica_ranks": list(hello.replica_ranks) if hello.replica_ranks else None,
        }
        known_id = known.get(key)
        if known_id is None:
            new_rows.append({"job": hello.job, "rank": hello.rank, "first_seen": now, **values})
        else:
            changed.append({"id": known_id, **values})
    session.flush()  # the jobs' rows first
    if new_rows:
        session.execute(insert(RankRow), new_rows)  # one executemany
    if changed:
        session.execute(update(RankRow), changed)  # bulk UPDATE by primary key: one executemany


def job_mesh(row: JobRow) -> MeshShape | None:
    """The stored job's mesh shape; None for plain data parallel (or a value no longer
    readable, logged: shown as unknown rather than failing the read)."""
    if row.mesh is None:
        return None
    try:
        return MeshShape.from_dict(row.mesh, world_size=row.world_size)
    except ProtocolError:
        log.warning("job %s: its stored mesh %r is not readable", row.name, row.mesh)
        return None


def insert_windows(session: Session, windows: Sequence[Window]) -> int:
    """Bulk-insert persistence windows and bump last_seen (caller commits)."""
    if not windows:
        return 0
    rows = []
    for w in windows:
        d = w.device
        rows.append({
            "job": w.job, "rank": w.rank, "t_start": w.t_start, "t_end": w.t_end,
            "batch_index_start": w.batch_index_start, "batch_index_end": w.batch_index_end,
            "n_steps": w.n_steps, "placement_version": w.placement_version,
            "local_batch_size": w.local_batch_size, "compute_ms": w.compute_ms,
            "sync_wait_ms": w.sync_wait_ms, "data_wait_ms": w.data_wait_ms,
            "optimizer_ms": w.optimizer_ms, "step_ms": w.step_ms, "dropped": w.dropped,
            "util_pct": d.util_pct if d else None, "mem_used_bytes": d.mem_used_bytes if d else None,
            "power_w": d.power_w if d else None, "temp_c": d.temp_c if d else None,
            "cpu_pct": d.cpu_pct if d else None, "rss_bytes": d.rss_bytes if d else None,
            "comm_bytes": w.comm_bytes, "comm_ms": w.comm_ms,
        })
    _insert_rows(session, rows)
    latest: dict[str, float] = {}
    for w in windows:
        latest[w.job] = max(latest.get(w.job, 0.0), w.t_end)
    for name, t in latest.items():
        job = session.scalar(select(JobRow).where(JobRow.name == name))
        if job is not None:
            job.last_seen = t
    return len(rows)


_WINDOW_COLUMNS = (
    "job", "rank", "t_start", "t_end", "batch_index_start", "batch_index_end", "n_steps", "placement_version",
    "local_batch_size", "compute_ms", "sync_wait_ms", "data_wait_ms", "optimizer_ms", "step_ms", "dropped",
    "util_pct", "mem_used_bytes", "power_w", "temp_c", "cpu_pct", "rss_bytes", "comm_bytes", "comm_ms",
)


def _insert_rows(session: Session, rows: list[dict[str, Any]]) -> None:
    """The windows' rows in one statement: PostgreSQL (psycopg) takes them by ``COPY``, a
    ninth of the client CPU of an INSERT executemany (8,192 rows: 22 against 190 ms here, a
    rank's window each second); other databases by one executemany."""
    if session.get_bind().dialect.driver == "psycopg":
        cursor = session.connection().connection.driver_connection.cursor()  # type: ignore[union-attr]
        with cursor, cursor.copy(f"COPY {RankMetricRow.__tablename__} ({', '.join(_WINDOW_COLUMNS)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row([row[c] for c in _WINDOW_COLUMNS])
        return
    session.execute(insert(Base.metadata.tables[RankMetricRow.__tablename__]), rows)  # Core, not ORM bulk


def list_jobs(session: Session) -> list[JobRow]:
    return list(session.scalars(select(JobRow).order_by(JobRow.name)))


def get_job(session: Session, name: str) -> JobRow | None:
    return session.scalar(select(JobRow).where(JobRow.name == name))


def list_ranks(session: Session, job: str) -> list[RankRow]:
    return list(session.scalars(select(RankRow).where(RankRow.job == job).order_by(RankRow.rank)))


def query_metrics(
    session: Session, job: str, *, ranks: Iterable[int] | None = None,
    batch_from: int | None = None, batch_to: int | None = None, limit: int = 10_000,
) -> list[RankMetricRow]:
    """Stored windows of a job that overlap the inclusive batch range, newest ``limit``,
    returned oldest first."""
    q = select(RankMetricRow).where(RankMetricRow.job == job)
    if ranks is not None:
        q = q.where(RankMetricRow.rank.in_(list(ranks)))
    if batch_from is not None:
        q = q.where(RankMetricRow.batch_index_end >= batch_from)
    if batch_to is not None:
        q = q.where(RankMetricRow.batch_index_start <= batch_to)
    q = q.order_by(RankMetricRow.batch_index_end.desc(), RankMetricRow.rank.desc()).limit(limit)
    return list(reversed(list(session.scalars(q))))
