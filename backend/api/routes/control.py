"""Control routes under /api/v1/jobs/{job}: mode, policy, proposals, overrides, rollback,
placements and audit. Each mutating call takes an optional ``reason`` and is audited. A
refused action raises ``ControlError``; the app's one handler (``backend.api.errors``)
answers it with its status and sentence.

Roles: viewer reads; operator approves, rejects, overrides, sets the mode, rolls back and
submits placements; admin changes the policy.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from backend.api.deps import AdminDep, ControllerDep, OperatorDep, RowId, ViewerDep
from backend.api.routes.pipeline import PredictionCheckPublic
from backend.control.models import Overrides, PolicyChanges
from backend.modes import MODES
from backend.storage.control import PROPOSAL_STATUSES
from rebalancer_wire.protocol import MAX_GLOBAL_BATCH_SIZE, MAX_LENGTH_SQ_WEIGHT, MAX_WORLD_SIZE

__all__ = [
    "router",
    "ModeIn",
    "PolicyIn",
    "ManualPlacementIn",
    "DecisionIn",
    "OverridesIn",
    "ProposalPublic",
    "PlacementPublic",
    "AuditPublic",
]

router = APIRouter(prefix="/api/v1/jobs/{job}", tags=["control"])


# --- request bodies -----------------------------------------------------------------------


class ModeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not ignored
    # str, not Literal: the controller answers a wrong mode with one plain sentence.
    mode: str = Field(description="observe | approve | auto",
                      json_schema_extra={"enum": list(MODES)})
    reason: str | None = Field(default=None, max_length=2048)


class PolicyIn(PolicyChanges):
    """Fields left out keep their value; an explicit null returns a field to the default.
    Limits are the ``Field``s of ``PolicyChanges``; a bad value is answered with one sentence
    naming the setting and its range."""

    reason: str | None = Field(default=None, max_length=2048)


class ManualPlacementIn(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not ignored
    # Any: the controller's check says exactly which entry is wrong and why.
    shares: Any = Field(description="one integer share per rank, summing to the global batch size",
                        json_schema_extra={"type": "array", "minItems": 1, "maxItems": MAX_WORLD_SIZE,
                                           "items": {"type": "integer", "minimum": 0,
                                                     "maximum": MAX_GLOBAL_BATCH_SIZE}})
    reason: str | None = Field(default=None, max_length=2048)
    apply: bool = False  # approve it in the same call
    force: bool = Field(default=False, description="submit it even though it breaks a memory cap (audited)")
    length_sq_weight: float | None = Field(
        default=None, ge=0.0, le=MAX_LENGTH_SQ_WEIGHT, allow_inf_nan=False,
        description="the cost model to send with the shares for a job that gives sample lengths: a sample "
                    "of length L weighs L + k*L^2 in the split (k, this field); left out, the k in force stays")


class DecisionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not ignored
    reason: str | None = Field(default=None, max_length=2048)


class OverridesIn(Overrides):
    """The full set of overrides (PUT replaces); send empty values to clear them. Limits
    every job shares are checked here, the job's own (its ranks, its global batch) by the
    controller: both answer with one sentence naming the entry and the rule."""

    reason: str | None = Field(default=None, max_length=2048)


# --- responses ----------------------------------------------------------------------------


class ProposalPublic(BaseModel):
    id: int
    job: str
    status: str
    source: str
    strategy: str
    base_version: int
    shares: list[int]
    current_shares: list[int]
    predicted_step_ms_before: float | None
    predicted_step_ms_after: float | None
    predicted_gain: float | None
    explanation: dict[str, Any] | None
    reason: str
    created_by: str
    created_at: float
    expires_at: float | None
    decided_by: str | None
    decided_at: float | None
    decision_reason: str | None
    placement_version: int | None
    error: str | None


class EffectPublic(BaseModel):
    step_ms_before: float | None
    step_ms_after: float | None
    predicted_step_ms: float | None
    measured_gain: float | None
    rolled_back: bool
    prediction: PredictionCheckPublic | None = Field(
        default=None, description="A pipelined job: the stage model's predicted step per pipeline and for the job, "
                                  "and the measured ones once the placement settled; null otherwise.")


class PlacementPublic(BaseModel):
    version: int
    shares: list[int]
    previous_shares: list[int] | None
    source: str
    proposal_id: int | None
    actor: str
    reason: str
    created_at: float
    effective_batch_index: int | None
    acks: dict[int, int]
    applied_at: float | None
    failed: bool
    error: str | None
    effect: EffectPublic


class AuditPublic(BaseModel):
    id: int
    time: float
    actor: str
    role: str
    address: str
    action: str
    job: str | None
    params: dict[str, Any]
    reason: str


class ProposalsPublic(BaseModel):
    data: list[ProposalPublic]
    count: int


class PlacementsPublic(BaseModel):
    data: list[PlacementPublic]
    count: int


class AuditsPublic(BaseModel):
    data: list[AuditPublic]
    count: int


# --- helpers ----------------------------------------------------------------------------


def _listed(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"data": rows, "count": len(rows)}


# --- routes -------------------------------------------------------------------------------


@router.put("/mode")
async def put_mode(job: str, body: ModeIn, actor: OperatorDep, controller: ControllerDep) -> dict[str, Any]:
    """Set the job's mode: observe, approve or auto. Returns the job's control state."""
    return await controller.set_mode(job, body.mode, actor=actor, reason=body.reason)


@router.get("/policy")
async def get_policy(job: str, actor: ViewerDep, controller: ControllerDep) -> dict[str, Any]:
    """The job's effective policy settings."""
    return await controller.policy_settings(job)


@router.put("/policy")
async def put_policy(job: str, body: PolicyIn, actor: AdminDep, controller: ControllerDep) -> dict[str, Any]:
    """Change the strategy and its parameters (admin). Returns the effective settings."""
    changes = body.model_dump(exclude_unset=True)
    reason = changes.pop("reason", None)
    return await controller.set_policy(job, changes, actor=actor, reason=reason)


@router.get("/proposals", response_model=ProposalsPublic)
async def list_proposals(
    job: str, actor: ViewerDep, controller: ControllerDep,
    status: str | None = Query(default=None, description="only proposals in this status",
                               json_schema_extra={"enum": list(PROPOSAL_STATUSES)}),
    limit: int = Query(default=100, ge=1, le=1000),
) -> dict[str, Any]:
    """Proposals of the job, newest first."""
    return _listed(await controller.proposals(job, status, limit))


@router.post("/proposals", response_model=ProposalPublic, status_code=201)
async def create_proposal(job: str, body: ManualPlacementIn, actor: OperatorDep,
                          controller: ControllerDep) -> dict[str, Any]:
    """Submit a placement by hand (validated against the job, its overrides and its memory
    caps; ``force`` submits one that breaks a memory cap, audited; ``length_sq_weight`` sends a
    cost model k with it, audited as ``placement.cost_model`` when applied)."""
    return await controller.submit_manual(job, body.shares, actor=actor, reason=body.reason,
                                                apply=body.apply, force=body.force,
                                                length_sq_weight=body.length_sq_weight)


@router.get("/proposals/{proposal_id}", response_model=ProposalPublic)
async def get_proposal(job: str, proposal_id: RowId, actor: ViewerDep, controller: ControllerDep) -> dict[str, Any]:
    return await controller.proposal(job, proposal_id)


@router.post("/proposals/{proposal_id}/approve", response_model=ProposalPublic)
async def approve(job: str, proposal_id: RowId, actor: OperatorDep, controller: ControllerDep,
                  body: DecisionIn | None = None) -> dict[str, Any]:
    """Send exactly the reviewed shares to the job as the next placement version."""
    return await controller.approve(job, proposal_id, actor=actor,
                        reason=body.reason if body else None)


@router.post("/proposals/{proposal_id}/reject", response_model=ProposalPublic)
async def reject(job: str, proposal_id: RowId, actor: OperatorDep, controller: ControllerDep,
                 body: DecisionIn | None = None) -> dict[str, Any]:
    return await controller.reject(job, proposal_id, actor=actor,
                        reason=body.reason if body else None)


@router.get("/overrides")
async def get_overrides(job: str, actor: ViewerDep, controller: ControllerDep) -> dict[str, Any]:
    """The overrides in force."""
    return await controller.overrides(job)


@router.put("/overrides")
async def put_overrides(job: str, body: OverridesIn, actor: OperatorDep, controller: ControllerDep) -> dict[str, Any]:
    """Replace the overrides; the policy respects them until cleared. When the placement in
    force breaks them, a proposal that respects them is created (``proposal_id``)."""
    return await controller.set_overrides(job, body.entries(), actor=actor, reason=body.reason)


@router.post("/rollback", response_model=PlacementPublic)
async def rollback(job: str, actor: OperatorDep, controller: ControllerDep,
                   body: DecisionIn | None = None) -> dict[str, Any]:
    """Return to exactly the shares in force before the current placement."""
    return await controller.rollback(job, actor=actor, reason=body.reason if body else None)


@router.get("/placements", response_model=PlacementsPublic)
async def list_placements(job: str, actor: ViewerDep, controller: ControllerDep,
                          limit: int = Query(default=100, ge=1, le=1000)) -> dict[str, Any]:
    """Placement history, newest first, with each rank's ack batch index and the effect."""
    return _listed(await controller.placements(job, limit))


@router.get("/audit", response_model=AuditsPublic)
async def list_audit(job: str, actor: ViewerDep, controller: ControllerDep,
                     limit: int = Query(default=200, ge=1, le=5000)) -> dict[str, Any]:
    """Audit records of the job, newest first."""
    return _listed(await controller.audit(job, limit))
