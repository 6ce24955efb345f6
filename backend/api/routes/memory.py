"""``GET /api/v1/jobs/{job}/memory``: each rank's peak-memory fit and memory cap (viewer role).

The fit ``peak = m0 + m * local_batch`` comes from the step records' peak-memory readings
(``backend.policy.memory.fit_memory``, via live state); the cap is the largest local batch
whose predicted peak stays under ``(1 - memory_headroom) * total`` for the job's headroom.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from backend.api.deps import PartsDep, ViewerDep
from backend.parts import Parts
from backend.policy.memory import DEFAULT_HEADROOM, memory_cap, memory_limit_bytes

__all__ = ["router", "RankMemoryPublic", "MemoryPublic"]

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])


class RankMemoryPublic(BaseModel):
    rank: int
    source: str = Field(description="what the hook reads memory with: cuda, rocm, xpu; empty: none (no cap)")
    status: str = Field(description="fitted | measuring (may only lose work) | unmeasured (no cap)")
    share: int | None = None
    readings: int = 0
    last_peak_bytes: int | None = None
    total_bytes: int | None = None
    fixed_bytes: float | None = Field(default=None, description="m0 of the fit")
    per_sample_bytes: float | None = Field(default=None, description="m of the fit")
    method: str | None = Field(default=None, description="linear (two or more batch sizes) | proportional (one) | flat (micro-batch shares: the peak does not grow with the count)")
    batch_sizes: int = 0
    predicted_peak_bytes: float | None = Field(default=None, description="at the share in force")
    limit_bytes: float | None = Field(default=None, description="(1 - memory_headroom) * total")
    cap: int | None = Field(default=None, description="most samples the policy gives this rank")


class MemoryPublic(BaseModel):
    data: list[RankMemoryPublic]
    count: int
    memory_headroom: float


def _memory(parts: Parts, job: str) -> MemoryPublic | None:
    view = parts.live.view(job)
    if view is None:
        return None
    control = parts.controller.job_control(job)
    headroom = float((control.get("policy") or {}).get("memory_headroom", DEFAULT_HEADROOM))
    shares = (control.get("placement") or {}).get("shares") or []
    out = []
    for rv in view.ranks:
        rm = rv.memory
        share = shares[rv.rank] if rv.rank < len(shares) else None
        item: dict[str, Any] = {"rank": rv.rank, "source": rm.source if rm else "", "share": share,
                                "readings": len(parts.live.memory_readings(job, rv.rank)),
                                "last_peak_bytes": rv.mem_peak_bytes,
                                "total_bytes": rm.total_bytes if rm else None}
        fit = rm.fit if rm else None
        if fit is not None:
            total = rm.total_bytes if rm else None
            item.update(status="fitted", fixed_bytes=fit.m0_bytes, per_sample_bytes=fit.m_bytes,
                        method=fit.method, batch_sizes=fit.sizes,
                        predicted_peak_bytes=fit.predict(share) if share is not None else None,
                        limit_bytes=memory_limit_bytes(total, headroom) if total else None,
                        cap=memory_cap(fit, total, headroom))
        else:
            item["status"] = "measuring" if item["source"] else "unmeasured"
            if item["status"] == "measuring":
                item["cap"] = share  # may only lose work until the fit is known
        out.append(RankMemoryPublic(**item))
    return MemoryPublic(data=out, count=len(out), memory_headroom=headroom)


@router.get("/{job}/memory", response_model=MemoryPublic, summary="Peak-memory fit and cap per rank")
async def get_memory(job: str, _actor: ViewerDep, parts: PartsDep) -> MemoryPublic:
    found = _memory(parts, job)  # memory only: live state and the controller's snapshot
    if found is None:
        raise HTTPException(status_code=404, detail=f"Job '{job}' has no live ranks on this backend.")
    return found
