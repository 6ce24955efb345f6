"""``GET /api/v1/jobs/{job}/causes``: why the job is slow, cause by cause (viewer role).

The job's recent steps replayed with one cause removed at a time (docs/causes.md;
``backend.live.causes.job_causes``, ``backend.policy.causes``), largest first."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response
from pydantic import BaseModel, Field

from backend.api.deps import PartsDep, ViewerDep
from backend.api.forwarding import from_owner
from backend.live.causes import cause_costs, job_causes
from backend.policy.causes import CAUSES, GC_HINT_SHARE, CauseReport

__all__ = ["router", "CausePublic", "CausesPublic", "causes_public"]

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])


class CausePublic(BaseModel):
    cause: str = Field(description=f"One of {', '.join(CAUSES)}.")
    ranks: list[int] = Field(description="The ranks the cause sits on (all ranks for communication).")
    ms_per_step: float = Field(description="Time it costs each step, ms: the replay's step without it subtracted from the replay's step.")
    share_of_step: float = Field(description="ms_per_step over the replayed step time (0..1).")
    gpu_hours_lost: float = Field(description="ms_per_step times the steps done times every device of the job, in GPU-hours.")
    predicted_step_ms_without: float = Field(description="The replay's mean step time with the cause removed, ms.")
    remedy: str = Field(description="What removes it: a placement, a setting, advice.")
    cost_lost: float | None = Field(None, description="What it has cost so far at the job's hourly price (null without prices).")
    detail: str = ""


class CausesPublic(BaseModel):
    data: list[CausePublic]
    count: int
    window_steps: int = Field(description="Steps replayed (the newest every rank sent).")
    step_ms: float | None = Field(None, description="Their measured mean step time, ms.")
    replayed_step_ms: float | None = Field(None, description="The replay's with nothing removed (its gap to step_ms is the model's error).")
    gc_share: float = Field(0.0, description="GC pauses of the rank arriving last, as a share of the step.")
    hint: str | None = Field(None, description="A one-line hint when GC pauses cost more than 2% of the step.")


def causes_public(report: CauseReport, costs: list[float | None] | None = None) -> CausesPublic:
    costs = costs or [None] * len(report.causes)
    data = [CausePublic(cause=c.cause, ranks=list(c.ranks), ms_per_step=c.ms_per_step,
                        share_of_step=c.share_of_step, gpu_hours_lost=c.gpu_hours_lost,
                        predicted_step_ms_without=c.predicted_step_ms_without, remedy=c.remedy,
                        detail=c.detail, cost_lost=cost) for c, cost in zip(report.causes, costs, strict=True)]
    hint = None
    if report.gc_share > GC_HINT_SHARE:
        hint = (f"GC pauses cost {report.gc_share:.0%} of the step: RebalanceHook(gc_freeze=True, "
                "gc_collect_every=100) freezes the heap after setup and collects on all ranks at once.")
    return CausesPublic(data=data, count=len(data), window_steps=report.steps, step_ms=report.step_ms,
                        replayed_step_ms=report.replayed_step_ms, gc_share=report.gc_share, hint=hint)


@router.get("/{job}/causes", response_model=CausesPublic, summary="Why the job is slow: causes, largest first")
async def get_causes(job: str, _actor: ViewerDep, parts: PartsDep, request: Request) -> CausesPublic | Response:
    """Each cause of lost step time with what removing it would gain (from the job's owner,
    with several replicas)."""
    if (owners := await from_owner(request, parts, job)) is not None:
        return owners
    report = job_causes(parts.live, job)
    if report is None:
        raise HTTPException(404, f"Job '{job}' is not live; causes come from its recent steps.")
    return causes_public(report, cause_costs(parts.live, job, report, parts.settings.price_for))
