"""``GET /api/v1/fleet``: every job held in memory with its status, devices, efficiency,
waste, savings, bound and pending proposals, and the fleet's totals (viewer role).

The figures are ``backend.live.fleet``'s, read from the dashboard hub (``DashboardHub.fleet``):
the same summary the home page's live feed and ``/metrics``' ``rebalancer_fleet_*`` show.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from backend.api.deps import HubDep, ViewerDep

__all__ = ["router", "FleetDevice", "FleetJobPublic", "FleetTotals", "FleetPublic"]

router = APIRouter(prefix="/api/v1", tags=["fleet"])


class FleetDevice(BaseModel):
    kind: str = Field(description="device name the hooks reported (or its type)")
    count: int


class FleetJobPublic(BaseModel):
    job: str
    status: str
    status_detail: str = ""
    mode: str | None = None
    world_size: int
    connected_ranks: int
    devices: list[FleetDevice]
    step_ms: float | None = None
    balanced_step_ms: float | None = Field(
        None, description="The step with the slowest rank's predicted compute replaced by the oracle split's "
        "(the policy's per-rank fit); null until the policy has fitted the job.")
    efficiency: float | None = Field(None, description="balanced_step_ms / step_ms (1: balanced); null: n/a.")
    wasted_gpu_hours: float = Field(description="Rank-hours spent waiting for the slowest rank's compute so far.")
    saved_s: float | None = Field(None, description="Time saved against the uniform split so far.")
    saved_cost: float | None = Field(None, description="saved_s priced at the job's hourly cost.")
    cost_per_hour: float | None = None
    imbalance: float | None = None
    eta_s: float | None = None
    batch_index: int | None = None
    bound: str | None = Field(None, description="compute, communication or input; null: not known.")
    pending_proposals: int = Field(description="Proposals waiting for an operator (approve on the job page).")
    pending_proposal_id: int | None = None


class FleetTotals(BaseModel):
    jobs: int
    ranks: int
    connected_ranks: int
    running: int = Field(description="Jobs whose status is not idle.")
    by_status: dict[str, int]
    wasted_gpu_hours: float
    saved_s: float
    saved_cost: float | None = None
    pending_proposals: int
    efficiency: float | None = Field(None, description="Rank-weighted mean over jobs with a figure.")


class FleetPublic(BaseModel):
    data: list[FleetJobPublic]
    count: int
    totals: FleetTotals


@router.get("/fleet", response_model=FleetPublic, summary="Every job and the fleet's totals")
async def get_fleet(_actor: ViewerDep, hub: HubDep) -> dict[str, Any]:
    """Every job held in memory (at most REBALANCER_MAX_LIVE_JOBS), by name, and the totals."""
    return hub.fleet(refresh=True)
