"""Read routes for jobs, their ranks and their step metrics (viewer role).

A job is known from live state (since this backend started) or from SQL (any job that
ever said hello). The controller's ``job_control(job)`` (mode, strategy, placement,
pending proposal, status) is merged into the job resource.

One module, over 400 lines on purpose: the read routes of one resource (a job, its ranks,
metrics and summary) with the response schemas the OpenAPI document is built from."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from backend.api.deps import LiveDep, PartsDep, SettingsDep, SqlDep, ViewerDep
from backend.api.forwarding import from_owner
from backend.api.routes.pipeline import PipelineBrief, pipeline_brief
from backend.live.forecast import forecast, goodput
from backend.live.replicas import replica_rows, stored_replica_rows
from backend.live.state import JobView, RankView
from backend.parts import Parts
from backend.policy.comm import RankComm
from backend.policy.costfit import SPLIT_SHIFT
from backend.storage import metrics as store
from rebalancer_wire.protocol import MAX_BATCH_INDEX, MAX_WORLD_SIZE, DeviceSample

__all__ = ["router", "OwnerPublic", "MeshPublic", "ReplicaPublic", "SummaryPublic", "BoundPublic", "CostModelPublic", "JobPublic", "JobsPublic", "RankPublic", "RanksPublic", "MetricPoint", "MetricsPublic", "ForecastPublic"]

log = logging.getLogger("rebalancer.api")
router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])

class PlacementBrief(BaseModel):
    version: int
    shares: list[int]


class MeshPublic(BaseModel):
    """A device-mesh job's shape, as its hooks said it (docs/meshes.md): its ranks here are
    its data-parallel replicas."""

    dp: int = Field(description="Data-parallel replicas: the job's world_size.")
    replica_size: int = Field(description="Ranks per replica (its tensor/context-parallel group).")
    dims: list[str] = Field(description="The mesh's dimension names, e.g. ['dp', 'tp'].")
    shape: list[int] = Field(description="One size per name in dims.")
    label: str = Field(description="How people read it, e.g. 'DP 2 x TP 2'.")


class ReplicaPublic(BaseModel):
    """One data-parallel replica of a mesh job (its row here; docs/meshes.md)."""

    replica: int = Field(description="The replica index: its rank in this job's placements and overrides.")
    members: list[int] = Field(description="The global ranks of its members (its TP/CP group), leader first.")
    member_devices: list[str] = Field(
        default_factory=list,
        description="Each member's host and device, in the order of members (live only; empty when unknown).")
    connected: bool = False
    compute_ms: float | None = Field(None, description="The replica's compute time: its slowest member's (live only).")
    step_ms: float | None = None
    slowest_rank: int | None = Field(
        None, description="The member slowest in most of the newest steps (a global rank; live only).")


class OwnerPublic(BaseModel):
    """The backend replica that controls a job (docs/scale-out.md): its id and the URL it
    advertises to hooks (REBALANCER_ADVERTISE_URL; "" when it advertises none)."""

    replica_id: str
    url: str = ""


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
    goodput: float | None = Field(None, description="Useful compute over paid device time, 0..1 (docs/causes.md).")
    lost_cost_per_hour: float | None = Field(None, description="cost_per_hour * (1 - goodput): what the rest costs an hour.")
    hung_rank: int | None = Field(None, description="With status hung: the rank the job waits on (docs/causes.md).")
    hung_since: float | None = Field(None, description="Unix time of that rank's last step end.")
    hung_batch_index: int | None = Field(None, description="The batch it is stuck in (or before).")
    hung_phase: str | None = Field(None, description="data_wait, compute, sync_wait, optimizer; unknown: it sent no report.")
    hung_stack: str | None = Field(None, description="Its training thread's Python stack, innermost last (at most 16 KiB).")
    hung_nccl_dump: str | None = Field(
        None, description="On CUDA, where its NCCL flight recorder dump is written when the collective times out.")
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
    eta_s: float | None = Field(None, deprecated=True, description=(
        "Deprecated: the job's forecast says it, as eta_seconds (GET /api/v1/jobs/{job}/forecast); "
        "the same figure, kept here for existing readers."))
    cost_per_hour: float | None = None
    idle_cost_per_hour: float | None = None
    bound: BoundPublic | None = Field(None, description="What bounds the step (live jobs only).")
    mesh: MeshPublic | None = Field(None, description="A device-mesh job's shape; null for plain data parallel.")
    replicas: list[ReplicaPublic] | None = Field(
        None, description="A mesh job's replicas with their members, time and slowest member; null for plain data parallel.")
    cost_model: CostModelPublic | None = Field(
        None, description="What a sample costs in the split, and how well that explains the step times.")
    pipeline: PipelineBrief | None = Field(
        None, description="A pipelined job's shape, bottleneck stage, bubble share and slowest pipeline "
                          "(GET /api/v1/jobs/{job}/pipeline has the grid); null without pipelines.")
    owner: OwnerPublic | None = Field(
        None, description="With several replicas: the replica that controls the job (its lease holder); null with "
                          "one replica, or while no replica holds the job.")
    share_unit: Literal["sample", "micro_batch"] = Field(
        "sample", description="What a share counts: samples, or fixed-shape micro-batches "
                              "(RebalanceHook(micro_batches=M): global_batch_size is M; docs/streaming.md).")


class CostModelPublic(BaseModel):
    """The job's cost model (``backend.policy.work.job_cost_model``): ``samples`` (no cost),
    ``work (linear)`` (a cost per sample, or lengths as they are) or ``fitted a*L+b*L^2``
    (lengths, a sample costing ``L + k*L^2``)."""

    model: Literal["samples", "work (linear)", "fitted a*L+b*L^2"]
    length_sq_weight: float = Field(0.0, description="k of L + k*L^2 as fitted (b/a); 0 unless fitted.")
    length_sq_weight_in_force: float = Field(0.0, description="The k the hooks split by (the placement's).")
    r2: float | None = Field(None, description="Median over fitted ranks of the step-time variance the model explains.")
    r2_linear: float | None = Field(None, description="The same for the length alone (jobs that give lengths).")
    ranks_fitted: int = 0
    ranks_quadratic: int = Field(0, description=(
        "Ranks that count for the quadratic term: by a clear margin (slowest step left out) to adopt it, by "
        "its F test to keep a fitted k in force."))
    split_shift: float | None = Field(None, description=(
        "How far the model's k would move a rank's share of a batch's work from the k in force (median "
        f"relative change over recent steps); a new k is sent past {SPLIT_SHIFT:g}. Null without lengths."))
    detail: str = ""


class BoundPublic(BaseModel):
    """What bounds the job's step, with the figures behind it (``backend.policy.comm``)."""

    verdict: Literal["compute-bound", "communication-bound", "input-bound", "balanced", "unknown"]
    detail: str = ""
    n_steps: int = Field(0, description="Steps assessed (the newest every rank reported).")
    kind: str | None = Field(None, description="The gradient collective: all_reduce or reduce_scatter.")
    step_ms: float | None = None
    compute_ms: float | None = Field(None, description="The slowest rank's compute time.")
    exposed_comm_ms: float | None = Field(None, description="The last arriver's sync wait: communication no compute hid.")
    data_wait_ms: float | None = Field(None, description="The longest data wait.")
    compute_share: float | None = None
    comm_share: float | None = None
    input_share: float | None = None
    comm_bytes_per_step: float | None = None
    transfer_ms: float | None = Field(None, description="The last arriver's time inside the collectives.")
    algbw_gbps: float | None = None
    busbw_gbps: float | None = Field(None, description="algbw x 2(n-1)/n (all-reduce) or (n-1)/n (reduce-scatter).")


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int


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
    device: DeviceSample | None = Field(default=None, description="The newest reading of its device (live only).")
    dropped: int = 0
    last_seen: float | None = None
    price_per_hour: float | None = None
    # With a per-sample cost (tokens): work per second of compute, mean share of the batch's work.
    work_per_s: float | None = None
    work_share: float | None = None
    # What the rank's hook reported in its hello; "... observe-only (rebalancer run)" for
    # a rank monitored by `rebalancer run` without code change (the job page says so).
    hook_version: str = ""
    comm_bytes_per_step: float | None = Field(default=None, description="Bytes handed to gradient collectives a step.")
    comm_ms: float | None = Field(default=None, description="Time a step with a gradient collective in flight.")
    wait_ms: float | None = Field(default=None, description="Of comm_ms, the wait for peers (the rest is transfer).")
    busbw_gbps: float | None = Field(default=None, description="Bus bandwidth, GB/s (nccl-tests definition).")
    host_ms: float | None = Field(default=None, description="Of data_wait_ms, the loop's own host work (docs/causes.md).")
    ckpt_ms: float | None = Field(default=None, description="Of data_wait_ms, checkpoint writes.")
    gc_ms: float | None = Field(default=None, description="Python GC pauses a step (within the other times).")
    # A pipelined job (docs/pipelines.md): each row is a pipeline, spoken for by its leader.
    pp_stage: int | None = Field(default=None, description="The pipeline stage of the rank that speaks for this row.")
    pp_size: int | None = Field(default=None, description="Stages of this pipeline; null without pipelines.")
    bubble_ms: float | None = Field(default=None, description="The pipeline's idle time a step (mean of its stages').")
    bottleneck_stage: int | None = Field(default=None, description="Its stage slowest per micro-batch.")


class RanksPublic(BaseModel):
    data: list[RankPublic]
    count: int


class MetricPoint(BaseModel):
    """Live: one step (n_steps 1). History: the mean over batch_index_start..batch_index."""

    rank: int
    batch_index: int = Field(description="The step's batch (history: the window's last).")
    batch_index_start: int = Field(description="The window's first batch (live: batch_index).")
    n_steps: int = Field(description="Steps in the point: 1 live, the window's in history.")
    t: float = Field(description="Unix time the step (the window) ended.")
    placement_version: int = Field(description="The placement the step ran under.")
    local_batch_size: float = Field(description="Samples (or micro-batches) the rank trained: its share.")
    compute_ms: float = Field(description="Until the rank's gradients were ready, less the wait inside their sync.")
    sync_wait_ms: float = Field(description="Waiting inside gradient synchronisation.")
    data_wait_ms: float = Field(description="Waiting for the DataLoader.")
    optimizer_ms: float = Field(description="In the optimizer step.")
    step_ms: float = Field(description="Wall time of the whole step.")
    # History: mean bytes handed to collectives and ms inside them per step (null where the
    # window's steps carried no counters; live points leave them null).
    comm_bytes: float | None = None
    comm_ms: float | None = None


class MetricsPublic(BaseModel):
    data: list[MetricPoint]
    count: int
    source: Literal["live", "history"]


class SummaryPublic(BaseModel):
    """A run's summary: savings against the uniform split and its latest figures. Live
    while the job is in memory, else the stored one (it survives a restart)."""

    job: str
    batch_index: int | None = None
    total_steps: int | None = None
    measured_s: float = Field(description="Wall time of the closed batches, seconds.")
    uniform_s: float = Field(description="What those batches would have taken under the uniform split.")
    saved_s: float = Field(description="uniform_s - measured_s.")
    saved_cost: float | None = Field(None, description="saved_s priced at the job's hourly cost.")
    cost_per_hour: float | None = None
    step_ms: float | None = None
    imbalance: float | None = None
    placement_version: int | None = None
    updated_at: float


class ForecastPublic(BaseModel):
    """ETA and cost to finish (``backend.live.forecast``: the figures the job resource, the
    fleet and the dashboard show)."""

    job: str
    batch_index: int | None = Field(description="The newest batch the job closed.")
    total_steps: int | None = Field(description="Steps in all: the query's, else what the hooks reported.")
    remaining_steps: int | None = Field(description="Steps left after the newest batch.")
    step_ms: float | None = Field(description="The recent step time the ETA assumes.")
    eta_seconds: float | None = Field(description="Seconds to finish: remaining_steps x step_ms.")
    eta_s: float | None = Field(deprecated=True, description="Deprecated name of eta_seconds (the same value).")
    cost_per_hour: float | None = Field(description="The ranks' hourly prices summed (settings' prices).")
    idle_cost_per_hour: float | None = Field(description="cost_per_hour x the job's idle fraction.")
    unpriced_ranks: int = Field(description="Ranks whose device has no price (left out of the cost).")
    cost_to_finish: float | None = Field(description="eta_seconds priced at cost_per_hour.")


def _not_found(job: str) -> HTTPException:
    return HTTPException(404, f"Job '{job}' not found.")


def _job_from_live(parts: Parts, view: JobView) -> dict[str, Any]:
    fc = forecast(view, parts.settings.price_for)
    comm = parts.live.communication(view.job)
    return {
        "bound": comm.figures() if comm is not None else None,
        "job": view.job, "world_size": view.world_size, "global_batch_size": view.global_batch_size,
        "batch_index": view.batch_index,
        "step_rate_hz": view.step_rate_hz, "step_ms": view.step_ms, "imbalance": view.imbalance,
        "idle_fraction": view.idle_fraction, "connected_ranks": view.connected_ranks,
        "created_at": view.created_at, "last_seen": view.last_seen,
        "cost_per_hour": fc.cost_per_hour, "idle_cost_per_hour": fc.idle_cost_per_hour,
        "total_steps": fc.total_steps, "eta_s": fc.eta_s, "mesh": view.mesh.as_view() if view.mesh else None,
        "replicas": replica_rows(view), **_hung(view), "goodput": (good := goodput(view)),
        "lost_cost_per_hour": fc.cost_per_hour * (1.0 - good) if fc.cost_per_hour is not None and good is not None else None,
        "share_unit": view.share_unit,  # "micro_batch": shares count micro-batches (docs/streaming.md)
        "pipeline": pipeline_brief(parts.live.pipelines, view.job),
    }


def _hung(view: JobView) -> dict[str, Any]:
    h = view.hung
    if h is None:
        return {}
    return {"hung_rank": h.rank, "hung_since": h.since, "hung_batch_index": h.batch_index,
            "hung_phase": h.phase, "hung_stack": h.stack, "hung_nccl_dump": h.nccl_dump}


def _job_from_row(row: store.JobRow, ranks: list[store.RankRow] | None = None) -> dict[str, Any]:
    """A stored job; with its rank rows, a mesh job's replicas and their members too."""
    mesh = store.job_mesh(row)
    return {
        "job": row.name, "world_size": row.world_size, "global_batch_size": row.global_batch_size,
        "created_at": row.created_at, "last_seen": row.last_seen, "mesh": mesh.as_view() if mesh else None,
        "replicas": stored_replica_rows(mesh, ((r.rank, r.replica_ranks) for r in ranks)) if ranks is not None else None,
    }


# What a job's list entry takes from its owner's fleet row when another replica controls it.
_SHARED = ("world_size", "connected_ranks", "batch_index", "step_ms", "imbalance", "eta_s", "cost_per_hour")


def _build(parts: Parts, job: str, row: dict[str, Any] | None) -> JobPublic | None:
    """The job resource: live numbers (or the stored row) and the controller's snapshot,
    whose status is the one status rule's (``backend.control.status``)."""
    view = parts.live.view(job)
    shared = None if view is not None else parts.hub.remote_fleet_row(job)
    if view is not None:
        base = _job_from_live(parts, view)
    elif row is not None:
        base = row
    else:
        return None
    if shared is not None:  # another replica controls it: its owner's figures (the fleet's)
        return JobPublic(**{**base, **{k: getattr(shared, k) for k in _SHARED},
                            "status": shared.status, "status_detail": shared.status_detail, "mode": shared.mode})
    control = parts.controller.job_control(job)
    if not control:
        status, detail = parts.controller.job_status(job)
        control = {"status": status, "status_detail": detail}
    return JobPublic(**{**base, **control})


@router.get("", response_model=JobsPublic, summary="List jobs")
async def list_jobs(_actor: ViewerDep, parts: PartsDep) -> JobsPublic:
    """Every job seen live since start plus every job stored in SQL; with several replicas,
    a job another replica controls carries its owner's figures (shared with the fleet)."""
    rows = await parts.sql.run(lambda s: {r.name: _job_from_row(r) for r in store.list_jobs(s)})
    names = sorted(set(parts.live.jobs()) | set(rows))
    jobs = [j for j in (_build(parts, n, rows.get(n)) for n in names) if j is not None]
    return JobsPublic(data=jobs, count=len(jobs))


@router.get("/{job}", response_model=JobPublic, summary="One job")
async def get_job(job: str, _actor: ViewerDep, parts: PartsDep, request: Request) -> JobPublic | Response:
    """The job's live numbers and control state (from its owner, with several replicas)."""
    if (owners := await from_owner(request, parts, job)) is not None:
        return owners
    row = None
    if job not in parts.live:
        row = await parts.sql.run(
            lambda s: (_job_from_row(r, store.list_ranks(s, job) if r.mesh else None) if (r := store.get_job(s, job)) else None))
    found = _build(parts, job, row)
    if found is None:
        raise _not_found(job)
    found.owner = await _owner(parts, job)
    return found


async def _owner(parts: Parts, job: str) -> OwnerPublic | None:
    """Which replica controls ``job``: this one while it holds the lease, else whoever Redis
    says (None with one replica, or when nobody holds it)."""
    cluster = parts.cluster
    if cluster is None:
        return None
    if cluster.owns(job):
        return OwnerPublic(replica_id=cluster.replica_id, url=cluster.advertise_url)
    rid, url = await cluster.owner(job)
    return None if rid is None else OwnerPublic(replica_id=rid, url=url or "")


@router.get("/{job}/summary", response_model=SummaryPublic, summary="Savings and summary of a run")
async def get_summary(job: str, _actor: ViewerDep, parts: PartsDep, request: Request) -> dict[str, Any] | Response:
    """Time and cost saved against the uniform split, and the run's latest figures."""
    if (owners := await from_owner(request, parts, job)) is not None:
        return owners
    found = await parts.summary(job)
    if found is None:
        raise HTTPException(404, f"Job '{job}' has no summary yet.")
    return found


@router.get("/{job}/forecast", response_model=ForecastPublic, summary="ETA and cost to finish",
            operation_id="forecast_api_v1_jobs__job__forecast_get")  # as it was in routes/pages.py
def get_forecast(
    job: str, _actor: ViewerDep, live: LiveDep, settings: SettingsDep,
    total_steps: Annotated[int | None, Query(
        ge=1, le=MAX_BATCH_INDEX, description="Steps the run will take in all (default: what its hooks reported).")] = None,
) -> ForecastPublic:
    """ETA and cost: the recent step time times the steps left; prices from settings."""
    view = live.view(job)
    if view is None:
        raise _not_found(job)
    fc = forecast(view, settings.price_for, total_steps)
    return ForecastPublic.model_validate({"job": job, "eta_seconds": fc.eta_s, **fc.as_dict()})


def _shares(parts: Parts, job: str) -> list[int] | None:
    placement = parts.controller.job_control(job).get("placement") or {}
    shares = placement.get("shares")
    return list(shares) if shares else None


def _rank_live(parts: Parts, job: str, r: RankView, shares: list[int] | None,
               comm: RankComm | None) -> RankPublic:
    hello = parts.live.hello(job, r.rank)
    return RankPublic(
        comm_bytes_per_step=comm.comm_bytes_per_step if comm else None, comm_ms=comm.comm_ms if comm else None,
        wait_ms=comm.wait_ms if comm else None, busbw_gbps=comm.busbw_gbps if comm else None,
        rank=r.rank, host=r.host, device_type=r.device_type, device_name=r.device_name,
        connected=r.connected, share=shares[r.rank] if shares and r.rank < len(shares) else None,
        batch_index=r.batch_index, placement_version=r.placement_version, compute_ms=r.compute_ms,
        sync_wait_ms=r.sync_wait_ms, data_wait_ms=r.data_wait_ms, optimizer_ms=r.optimizer_ms,
        step_ms=r.step_ms, step_rate_hz=r.step_rate_hz, local_batch_size=r.local_batch_size,
        n_steps=r.n_steps, device=r.device, dropped=r.dropped, last_seen=r.last_seen,
        price_per_hour=parts.settings.price_for(r.device_type, r.device_name),
        work_per_s=r.work_per_s, work_share=r.work_share,
        hook_version=hello.hook_version if hello is not None else "",
        host_ms=r.host_ms, ckpt_ms=r.ckpt_ms, gc_ms=r.gc_ms, **parts.live.pipelines.rank_fields(job, r.rank),
    )


def _stored_ranks(s: Session, job: str) -> list[tuple[store.RankRow, store.RankMetricRow | None]] | None:
    if store.get_job(s, job) is None:
        return None
    out = []
    for row in store.list_ranks(s, job):
        last = store.query_metrics(s, job, ranks=[row.rank], limit=1)
        out.append((row, last[0] if last else None))
    return out


@router.get("/{job}/ranks", response_model=RanksPublic, summary="Ranks of a job")
async def get_ranks(job: str, _actor: ViewerDep, parts: PartsDep, request: Request) -> RanksPublic | Response:
    """Every rank's live numbers (from the job's owner, with several replicas)."""
    if (owners := await from_owner(request, parts, job)) is not None:
        return owners
    shares = _shares(parts, job)
    view = parts.live.view(job)
    if view is not None:
        comm = parts.live.communication(job)
        by_rank = {c.rank: c for c in comm.ranks} if comm is not None else {}
        data = [_rank_live(parts, job, r, shares, by_rank.get(r.rank)) for r in view.ranks]
        return RanksPublic(data=data, count=len(data))
    stored = await parts.sql.run(lambda s: _stored_ranks(s, job))
    if stored is None:
        raise _not_found(job)
    price = parts.settings.price_for
    data = [RankPublic(
        rank=row.rank, host=row.host, device_type=row.device_type, device_name=row.device_name,
        connected=False, share=shares[row.rank] if shares and row.rank < len(shares) else None,
        batch_index=m.batch_index_end if m else None,
        placement_version=m.placement_version if m else None,
        compute_ms=m.compute_ms if m else None, sync_wait_ms=m.sync_wait_ms if m else None,
        data_wait_ms=m.data_wait_ms if m else None, optimizer_ms=m.optimizer_ms if m else None,
        step_ms=m.step_ms if m else None, local_batch_size=m.local_batch_size if m else None,
        last_seen=row.last_seen, price_per_hour=price(row.device_type, row.device_name),
        hook_version=row.hook_version,
    ) for row, m in stored]
    return RanksPublic(data=data, count=len(data))


@router.get("/{job}/metrics", response_model=MetricsPublic, summary="Step metrics of a job")
async def get_metrics(
    job: str,
    _actor: ViewerDep,
    live: LiveDep, sql: SqlDep,
    rank: Annotated[list[Annotated[int, Field(ge=0, le=MAX_WORLD_SIZE - 1)]] | None,
                    Query(description="Only these ranks (repeat the parameter).")] = None,
    batch_from: Annotated[int | None, Query(ge=0, le=MAX_BATCH_INDEX, description="First batch index (inclusive); batch_from <= batch_to.")] = None,
    batch_to: Annotated[int | None, Query(ge=0, le=MAX_BATCH_INDEX, description="Last batch index (inclusive); not below batch_from (400 otherwise).")] = None,
    source: Annotated[Literal["auto", "live", "history"], Query(
        description="live: every buffered step; history: stored per-window means; "
        "auto: live when the job is in memory.")] = "auto",
    limit: Annotated[int, Query(ge=1, le=100_000, description="Newest points kept.")] = 5000,
) -> MetricsPublic:
    if batch_from is not None and batch_to is not None and batch_from > batch_to:
        raise HTTPException(400, f"batch_from ({batch_from}) must not exceed batch_to ({batch_to}).")
    ranks = set(rank) if rank else None

    use_live = source == "live" or (source == "auto" and job in live)
    if use_live:
        if job not in live:
            raise _not_found(job)
        pts = [
            MetricPoint(rank=r, batch_index=s.batch_index, batch_index_start=s.batch_index, n_steps=1,
                        t=s.t, placement_version=s.placement_version,
                        local_batch_size=s.local_batch_size, compute_ms=s.compute_ms,
                        sync_wait_ms=s.sync_wait_ms, data_wait_ms=s.data_wait_ms,
                        optimizer_ms=s.optimizer_ms, step_ms=s.step_ms)
            for r, s in live.steps(job, ranks=ranks, batch_from=batch_from,
                                         batch_to=batch_to, limit=limit)
        ]
        return MetricsPublic(data=pts, count=len(pts), source="live")

    def read(sess: Session) -> list[store.RankMetricRow] | None:
        if store.get_job(sess, job) is None:
            return None
        return list(store.query_metrics(sess, job, ranks=ranks, batch_from=batch_from,
                                        batch_to=batch_to, limit=limit))

    rows = await sql.run(read)
    if rows is None:
        raise _not_found(job)
    pts = [
        MetricPoint(rank=m.rank, batch_index=m.batch_index_end, batch_index_start=m.batch_index_start,
                    n_steps=m.n_steps, t=m.t_end, placement_version=m.placement_version,
                    local_batch_size=m.local_batch_size, compute_ms=m.compute_ms,
                    sync_wait_ms=m.sync_wait_ms, data_wait_ms=m.data_wait_ms,
                    optimizer_ms=m.optimizer_ms, step_ms=m.step_ms,
                    comm_bytes=m.comm_bytes, comm_ms=m.comm_ms)
        for m in rows
    ]
    return MetricsPublic(data=pts, count=len(pts), source="history")
