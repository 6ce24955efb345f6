"""Read routes for jobs, their ranks and their step metrics (viewer role).

A job is known from live state (since this backend started) or from SQL (any job that
ever said hello). The controller's ``job_control(job)`` (mode, strategy, placement,
pending proposal, status) is merged into the job resource.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field

from backend.api.deps import ServicesDep, ViewerDep
from backend.live.state import JobView, RankView
from backend.parts import Services
from backend.storage import metrics as store
from backend.storage.metrics import epoch
from trainer_hook.protocol import MAX_BATCH_INDEX, MAX_WORLD_SIZE

__all__ = ["router", "JobPublic", "JobsPublic", "RankPublic", "RanksPublic", "MetricPoint", "MetricsPublic"]

log = logging.getLogger("rebalancer.api")
router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])

# Above this compute-time imbalance a job without a controller verdict reads "imbalanced".
IMBALANCE_THRESHOLD = 0.10


class PlacementBrief(BaseModel):
    version: int
    shares: list[int]


class JobPublic(BaseModel):
    """A job; keys from the controller's job_control (policy, overrides, ...) are merged in."""

    model_config = ConfigDict(extra="allow")

    job: str
    world_size: int
    global_batch_size: int
    mode: str | None = None
    strategy: str | None = None
    status: str
    status_detail: str = ""
    batch_index: int | None = None
    step_rate_hz: float | None = None
    step_ms: float | None = None
    imbalance: float | None = None
    idle_fraction: float | None = None
    placement: PlacementBrief | None = None
    pending_proposal_id: int | None = None
    connected_ranks: int = 0
    created_at: float | None = None
    last_seen: float | None = None
    total_steps: int | None = Field(None, description="Steps the run takes in all, as its hooks reported.")
    eta_s: float | None = Field(None, description="Seconds to finish: steps left times the recent step time.")
    cost_per_hour: float | None = None
    idle_cost_per_hour: float | None = None


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int


class DevicePublic(BaseModel):
    t: float | None = None
    source: str | None = None
    util_pct: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    power_w: float | None = None
    temp_c: float | None = None
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    throttle_reasons: list[str] = []
    cpu_pct: float | None = None
    rss_bytes: int | None = None


class RankPublic(BaseModel):
    rank: int
    host: str = ""
    device_type: str = ""
    device_name: str = ""
    connected: bool = False
    share: int | None = None
    batch_index: int | None = None
    placement_version: int | None = None
    compute_ms: float | None = None
    sync_wait_ms: float | None = None
    data_wait_ms: float | None = None
    optimizer_ms: float | None = None
    step_ms: float | None = None
    step_rate_hz: float | None = None
    local_batch_size: float | None = None
    n_steps: int = 0
    device: DevicePublic | None = None
    dropped: int = 0
    last_seen: float | None = None
    price_per_hour: float | None = None


class RanksPublic(BaseModel):
    data: list[RankPublic]
    count: int


class MetricPoint(BaseModel):
    """Live: one step (n_steps 1). History: the mean over batch_index_start..batch_index."""

    rank: int
    batch_index: int
    batch_index_start: int
    n_steps: int
    t: float
    placement_version: int
    local_batch_size: float
    compute_ms: float
    sync_wait_ms: float
    data_wait_ms: float
    optimizer_ms: float
    step_ms: float


class MetricsPublic(BaseModel):
    data: list[MetricPoint]
    count: int
    source: Literal["live", "history"]


def _not_found(job: str) -> HTTPException:
    return HTTPException(404, f"Job '{job}' not found.")


def _control(services: Services, job: str) -> dict[str, Any]:
    ctl = services.controller
    if ctl is None:
        return {}
    try:
        return dict(ctl.job_control(job) or {})
    except Exception:  # the read API must answer even if the control loop is broken
        log.exception("job_control(%r) failed", job)
        return {}


def _costs(services: Services, view: JobView) -> tuple[float | None, float | None]:
    prices = [services.settings.price_for(r.device_type, r.device_name) for r in view.ranks]
    known = [p for p in prices if p is not None]
    if not known:
        return None, None
    total = sum(known)
    idle = total * view.idle_fraction if view.idle_fraction is not None else None
    return total, idle


def _job_from_live(services: Services, view: JobView) -> dict[str, Any]:
    cost, idle_cost = _costs(services, view)
    if view.connected_ranks == 0:
        status, detail = "idle", "no rank is connected"
    elif view.imbalance is None:
        status, detail = "warming_up", "waiting for the first steps"
    elif view.imbalance > IMBALANCE_THRESHOLD:
        status, detail = "imbalanced", f"the slowest rank computes {view.imbalance:.0%} above the mean"
    else:
        status, detail = "balanced", "rank compute times are within 10% of the mean"
    return {
        "job": view.job, "world_size": view.world_size, "global_batch_size": view.global_batch_size,
        "status": status, "status_detail": detail, "batch_index": view.batch_index,
        "step_rate_hz": view.step_rate_hz, "step_ms": view.step_ms, "imbalance": view.imbalance,
        "idle_fraction": view.idle_fraction, "connected_ranks": view.connected_ranks,
        "created_at": view.created_at, "last_seen": view.last_seen,
        "cost_per_hour": cost, "idle_cost_per_hour": idle_cost,
        "total_steps": view.total_steps, "eta_s": view.eta_s,
    }


def _job_from_row(row: store.JobRow) -> dict[str, Any]:
    return {
        "job": row.name, "world_size": row.world_size, "global_batch_size": row.global_batch_size,
        "status": "idle", "status_detail": "no rank has connected since the backend started",
        "created_at": epoch(row.created_at), "last_seen": epoch(row.last_seen),
    }


def _merge(base: dict[str, Any], control: dict[str, Any]) -> JobPublic:
    merged = {**base, **control}
    # Live numbers win over the controller's only where it has no verdict of its own.
    for key in ("status", "status_detail"):
        if not control.get(key):
            merged[key] = base[key]
    if merged.get("status") == "idle" and base.get("connected_ranks"):
        merged["status"], merged["status_detail"] = base["status"], base["status_detail"]
    return JobPublic(**merged)


def _build_job(services: Services, job: str) -> JobPublic | None:
    view = services.live.view(job)
    if view is not None:
        return _merge(_job_from_live(services, view), _control(services, job))
    with services.sessionmaker() as s:
        row = store.get_job(s, job)
        if row is None:
            return None
        base = _job_from_row(row)
    return _merge(base, _control(services, job))


@router.get("", response_model=JobsPublic, summary="List jobs")
async def list_jobs(_actor: ViewerDep, services: ServicesDep) -> JobsPublic:
    """Every job seen live since start plus every job stored in SQL."""

    def build() -> JobsPublic:
        names = set(services.live.jobs())
        with services.sessionmaker() as s:
            names.update(r.name for r in store.list_jobs(s))
        jobs = [j for j in (_build_job(services, n) for n in sorted(names)) if j is not None]
        return JobsPublic(data=jobs, count=len(jobs))

    return await asyncio.to_thread(build)


@router.get("/{job}", response_model=JobPublic, summary="One job")
async def get_job(job: str, _actor: ViewerDep, services: ServicesDep) -> JobPublic:
    found = await asyncio.to_thread(_build_job, services, job)
    if found is None:
        raise _not_found(job)
    return found


def _device(d: Any) -> DevicePublic | None:
    if d is None:
        return None
    return DevicePublic(
        t=d.t, source=d.source, util_pct=d.util_pct, mem_used_bytes=d.mem_used_bytes,
        mem_total_bytes=d.mem_total_bytes, power_w=d.power_w, temp_c=d.temp_c,
        sm_clock_mhz=d.sm_clock_mhz, sm_clock_max_mhz=d.sm_clock_max_mhz,
        throttle_reasons=list(d.throttle_reasons), cpu_pct=d.cpu_pct, rss_bytes=d.rss_bytes,
    )


def _shares(services: Services, job: str) -> list[int] | None:
    placement = _control(services, job).get("placement") or {}
    shares = placement.get("shares")
    return list(shares) if shares else None


def _rank_live(services: Services, r: RankView, shares: list[int] | None) -> RankPublic:
    return RankPublic(
        rank=r.rank, host=r.host, device_type=r.device_type, device_name=r.device_name,
        connected=r.connected, share=shares[r.rank] if shares and r.rank < len(shares) else None,
        batch_index=r.batch_index, placement_version=r.placement_version, compute_ms=r.compute_ms,
        sync_wait_ms=r.sync_wait_ms, data_wait_ms=r.data_wait_ms, optimizer_ms=r.optimizer_ms,
        step_ms=r.step_ms, step_rate_hz=r.step_rate_hz, local_batch_size=r.local_batch_size,
        n_steps=r.n_steps, device=_device(r.device), dropped=r.dropped, last_seen=r.last_seen,
        price_per_hour=services.settings.price_for(r.device_type, r.device_name),
    )


def _ranks(services: Services, job: str) -> RanksPublic | None:
    shares = _shares(services, job)
    view = services.live.view(job)
    if view is not None:
        data = [_rank_live(services, r, shares) for r in view.ranks]
        return RanksPublic(data=data, count=len(data))
    with services.sessionmaker() as s:
        if store.get_job(s, job) is None:
            return None
        rows = store.list_ranks(s, job)
        data = []
        for row in rows:
            last = store.query_metrics(s, job, ranks=[row.rank], limit=1)
            m = last[0] if last else None
            data.append(RankPublic(
                rank=row.rank, host=row.host, device_type=row.device_type, device_name=row.device_name,
                connected=False, share=shares[row.rank] if shares and row.rank < len(shares) else None,
                batch_index=m.batch_index_end if m else None,
                placement_version=m.placement_version if m else None,
                compute_ms=m.compute_ms if m else None, sync_wait_ms=m.sync_wait_ms if m else None,
                data_wait_ms=m.data_wait_ms if m else None, optimizer_ms=m.optimizer_ms if m else None,
                step_ms=m.step_ms if m else None, local_batch_size=m.local_batch_size if m else None,
                last_seen=epoch(row.last_seen),
                price_per_hour=services.settings.price_for(row.device_type, row.device_name),
            ))
    return RanksPublic(data=data, count=len(data))


@router.get("/{job}/ranks", response_model=RanksPublic, summary="Ranks of a job")
async def get_ranks(job: str, _actor: ViewerDep, services: ServicesDep) -> RanksPublic:
    found = await asyncio.to_thread(_ranks, services, job)
    if found is None:
        raise _not_found(job)
    return found


@router.get("/{job}/metrics", response_model=MetricsPublic, summary="Step metrics of a job")
async def get_metrics(
    job: str,
    _actor: ViewerDep,
    services: ServicesDep,
    rank: Annotated[list[Annotated[int, Field(ge=0, le=MAX_WORLD_SIZE - 1)]] | None,
                    Query(description="Only these ranks (repeat the parameter).")] = None,
    batch_from: Annotated[int | None, Query(ge=0, le=MAX_BATCH_INDEX, description="First batch index (inclusive).")] = None,
    batch_to: Annotated[int | None, Query(ge=0, le=MAX_BATCH_INDEX, description="Last batch index (inclusive).")] = None,
    source: Annotated[Literal["auto", "live", "history"], Query(
        description="live: every buffered step; history: stored per-window means; "
        "auto: live when the job is in memory.")] = "auto",
    limit: Annotated[int, Query(ge=1, le=100_000, description="Newest points kept.")] = 5000,
) -> MetricsPublic:
    if batch_from is not None and batch_to is not None and batch_from > batch_to:
        raise HTTPException(422, f"batch_from ({batch_from}) must not exceed batch_to ({batch_to}).")
    ranks = set(rank) if rank else None

    def build() -> MetricsPublic | None:
        use_live = source == "live" or (source == "auto" and job in services.live)
        if use_live:
            if job not in services.live:
                return None
            pts = [
                MetricPoint(rank=r, batch_index=s.batch_index, batch_index_start=s.batch_index, n_steps=1,
                            t=s.t, placement_version=s.placement_version,
                            local_batch_size=s.local_batch_size, compute_ms=s.compute_ms,
                            sync_wait_ms=s.sync_wait_ms, data_wait_ms=s.data_wait_ms,
                            optimizer_ms=s.optimizer_ms, step_ms=s.step_ms)
                for r, s in services.live.steps(job, ranks=ranks, batch_from=batch_from,
                                                batch_to=batch_to, limit=limit)
            ]
            return MetricsPublic(data=pts, count=len(pts), source="live")
        with services.sessionmaker() as sess:
            if store.get_job(sess, job) is None:
                return None
            rows = store.query_metrics(sess, job, ranks=ranks, batch_from=batch_from,
                                       batch_to=batch_to, limit=limit)
        pts = [
            MetricPoint(rank=m.rank, batch_index=m.batch_index_end, batch_index_start=m.batch_index_start,
                        n_steps=m.n_steps, t=m.t_end, placement_version=m.placement_version,
                        local_batch_size=m.local_batch_size, compute_ms=m.compute_ms,
                        sync_wait_ms=m.sync_wait_ms, data_wait_ms=m.data_wait_ms,
                        optimizer_ms=m.optimizer_ms, step_ms=m.step_ms)
            for m in rows
        ]
        return MetricsPublic(data=pts, count=len(pts), source="history")

    found = await asyncio.to_thread(build)
    if found is None:
        raise _not_found(job)
    return found
