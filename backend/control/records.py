"""The control loop's records: a new job, its mode, policy and shape, placement versions,
acks and effects, proposals, overrides, and the audit log.

Every write to the control tables (``backend.storage.control``) happens here (the layer
test reads the rest of ``backend/control`` for writes). Functions over an open session;
the caller commits. Each closes or adds rows the way the proposal lifecycle says
(``proposed`` -> ``approved`` -> ``applied``, or ``rejected | superseded | failed |
expired``) and touches nothing else; the controller keeps its in-memory state in step
with what these return.

One module, over 400 lines on purpose: every write to the control tables has this one home (the layer
test holds the rest of backend/control to it); split, the rule would have two.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import select

from backend.control.effect import Effect, effect_record, merge_acks
from backend.control.errors import ConflictError, NotFoundError
from backend.control.inputs import OVERRIDE_KEYS
from backend.storage import control as db
from backend.storage import owners
from rebalancer_wire.protocol import Hello, Oom, next_placement_version, uniform_shares

__all__ = [
    "create_job", "fail_placement", "store_overrides", "actor_name", "pending_proposal", "proposal_to_decide", "decide", "close_pending", "supersede",
    "expire_due", "next_version", "new_placement", "add_proposal", "refused_before", "last_effect",
    "recent_rollbacks", "approve", "reject", "audit_manual", "set_mode", "preset_mode", "mode_preset", "set_policy", "reshape",
    "record_acks", "record_oom", "audit_restart", "issued", "record_effect", "audit_token",
    "take_epoch", "check_epoch", "record_prediction",
]


_PENDING = ("proposed", "approved")


def create_job(s: Any, hello: Hello, *, mode: str, actor: str, at: float) -> None:
    """Settings and the first placement (the uniform split) of a job new to this backend.
    Its mode: an operator's preset (``preset_mode``), else the one its hello asks for, else
    ``mode`` (the backend's default)."""
    chosen = mode_preset(s, hello.job) or hello.mode or mode
    job = hello.job
    shares = uniform_shares(hello.world_size, hello.global_batch_size)
    first = next_version(s, job, running=hello.placement_version)
    row = s.scalar(select(db.JobRow).where(db.JobRow.name == job))
    if row is None:  # ingest stores the row on hello; a direct caller may come first
        row = db.JobRow(name=job, world_size=hello.world_size,
                        global_batch_size=hello.global_batch_size, created_at=at, last_seen=at)
        s.add(row)
    row.world_size, row.global_batch_size = hello.world_size, hello.global_batch_size
    row.mode, row.policy, row.updated_at = chosen, {}, at
    s.add(db.PlacementRow(
        job=job, version=first, shares=shares, source="initial", actor=actor,
        reason="uniform split for a new job", created_at=at, acks={},
    ))
    db.record_audit(s, actor=actor, action="job.create", job=job,
                    params={"world_size": hello.world_size,
                            "global_batch_size": hello.global_batch_size, "mode": chosen},
                    reason="first hello from the job")


def set_mode(s: Any, job: str, mode: str, *, actor: Any, reason: str | None, at: float) -> None:
    """The job's mode, audited with the one it replaces."""
    row = db.get_settings(s, job)
    assert row is not None
    old, row.mode, row.updated_at = row.mode, mode, at
    db.record_audit(s, actor=actor, action="job.mode", job=job,
                    params={"mode": mode, "previous": old}, reason=reason)


def preset_mode(s: Any, job: str, mode: str, *, actor: Any, reason: str | None) -> None:
    """The mode a job not seen yet starts in: an audit record (no settings row exists yet),
    which ``mode_preset`` reads when the job's first hello creates it."""
    db.record_audit(s, actor=actor, action="job.mode_preset", job=job, params={"mode": mode}, reason=reason)


def mode_preset(s: Any, job: str) -> str | None:
    """The mode preset for ``job`` since it was last created, else None."""
    preset = db.list_audit(s, job, action="job.mode_preset", limit=1)
    if not preset:
        return None
    created = db.list_audit(s, job, action="job.create", limit=1)
    if created and created[0].id > preset[0].id:
        return None  # a preset for an earlier incarnation of the name, applied then
    mode = (preset[0].params or {}).get("mode")
    return mode if isinstance(mode, str) else None


def set_policy(s: Any, job: str, policy: dict[str, Any], *, changes: dict[str, Any], actor: Any,
               reason: str | None, at: float) -> None:
    """The job's policy settings (``policy``, after ``changes``), audited with the changes."""
    row = db.get_settings(s, job)
    assert row is not None
    row.policy, row.updated_at = policy, at
    db.record_audit(s, actor=actor, action="job.policy", job=job, params=changes, reason=reason)


def reshape(s: Any, hello: Hello, *, reason: str, actor: str, at: float) -> None:
    """The job came back with another world size or global batch: its new shape, pending
    proposals superseded, the uniform split as the next version (no previous to return to)."""
    job = hello.job
    row = db.get_settings(s, job)
    assert row is not None
    row.world_size, row.global_batch_size = hello.world_size, hello.global_batch_size
    row.updated_at = at
    close_pending(s, job, "superseded", reason, at)
    new_placement(s, job, uniform_shares(hello.world_size, hello.global_batch_size), source="initial",
                  actor=actor, reason=reason, at=at, current=None)
    db.record_audit(s, actor=actor, action="job.reshape", job=job,
                    params={"world_size": hello.world_size,
                            "global_batch_size": hello.global_batch_size}, reason=reason)


def audit_restart(s: Any, hello: Hello, previous: int, *, actor: str) -> None:
    """TorchElastic restarted the job's workers (``hello`` from the new attempt)."""
    db.record_audit(s, actor=actor, action="job.restart", job=hello.job, params={
        "restart_count": hello.restart_count, "previous_restart_count": previous,
        "rank": hello.rank, "world_size": hello.world_size,
        "global_batch_size": hello.global_batch_size,
    }, reason=f"torchrun restarted the job's workers (restart {hello.restart_count})")


def record_acks(s: Any, row: db.PlacementRow, new: dict[int, int], *, world_size: int, at: float,
                step_ms_before: Callable[[int], float | None]) -> None:
    """Merge ranks' acks (rank -> batch index) into ``row``; once all ``world_size`` ranks
    acked, the placement is applied: when, from which batch, the step time before that
    batch (``step_ms_before(batch)``), and its approved proposal with it."""
    row.acks = acks = merge_acks(row.acks, new)
    if row.applied_at is None and len(acks) >= world_size:
        row.applied_at = at
        row.effective_batch_index = e = max(acks.values())
        row.step_ms_before = step_ms_before(e)
        if row.proposal_id is not None:
            prop = s.get(db.ProposalRow, row.proposal_id)
            if prop is not None and prop.status == "approved":
                prop.status = "applied"


def record_effect(row: db.PlacementRow, verdict: Effect) -> tuple[list[int], str] | None:
    """The measured effect of placement ``row``. When it must go back it is marked rolled
    back, and the shares to return to and why are returned."""
    row.step_ms_after = verdict.step_ms_after
    if verdict.measured_gain is not None:
        row.measured_gain = verdict.measured_gain
    if verdict.rollback_reason is not None and row.previous_shares is not None:
        row.rolled_back = True
        return list(row.previous_shares), verdict.rollback_reason
    return None


def record_oom(s: Any, oom: Oom, ov: dict[str, Any], *, cap: int, why: str, actor: str,
               at: float) -> db.PlacementRow | None:
    """A rank ran out of memory: the placement it trained under (returned, None when
    unknown) is unsafe, audited, and the job's overrides ``ov`` cap the rank at ``cap``."""
    row = db.get_placement(s, oom.job, oom.version)
    if row is not None and not row.failed:
        row.failed, row.error = True, f"unsafe: {why}"
    db.record_audit(s, actor=actor, action="placement.oom", job=oom.job,
                    params={"version": oom.version, "rank": oom.rank,
                            "local_batch_size": oom.local_batch_size,
                            "batch_index": oom.batch_index,
                            "mem_peak_bytes": oom.mem_peak_bytes,
                            "mem_total_bytes": oom.mem_total_bytes, "cap": cap},
                    reason=oom.message[:500] or why)
    store_overrides(s, oom.job, ov, actor=actor, reason=f"{why}: capped at {cap}", at=at)
    return row


def fail_placement(s: Any, row: db.PlacementRow, *, rank: int, reason: str, actor: str) -> None:
    """A rank refused placement ``row``: it, and its proposal if still pending, failed."""
    error = f"rank {rank} rejected placement version {row.version}: {reason}"
    row.failed = True
    row.error = error
    if row.proposal_id is not None:
        prop = s.get(db.ProposalRow, row.proposal_id)
        if prop is not None and prop.status in _PENDING:
            prop.status = "failed"
            prop.error = error
    db.record_audit(s, actor=actor, action="placement.failed", job=row.job,
                    params={"version": row.version, "rank": rank}, reason=reason)


def store_overrides(s: Any, job: str, ov: dict[str, Any], *, actor: Any, reason: str | None,
                    at: float) -> None:
    """Replace the job's overrides (as ``validate_overrides`` returns them), audited."""
    row = s.get(db.OverridesRow, job) or db.OverridesRow(job=job)
    row.pins = {str(k): v for k, v in ov["pins"].items()}
    row.caps = {str(k): v for k, v in ov["caps"].items()}
    row.floors = {str(k): v for k, v in ov["floors"].items()}
    row.drains, row.granularity = list(ov["drains"]), ov["granularity"]
    row.actor, row.reason, row.updated_at = actor_name(actor), reason or "", at
    s.add(row)
    db.record_audit(s, actor=actor, action="job.overrides", job=job,
                    params={k: ov[k] for k in OVERRIDE_KEYS}, reason=reason)


def audit_token(s: Any, action: str, params: dict[str, Any], *, actor: Any, reason: str) -> None:
    """A token was created or revoked (``token.create``, ``token.revoke``): no job's row."""
    db.record_audit(s, actor=actor, action=action, job=None, params=params, reason=reason)


def actor_name(actor: Any) -> str:
    return actor if isinstance(actor, str) else str(getattr(actor, "name", actor))


def pending_proposal(s: Any, job: str) -> db.ProposalRow | None:
    """The newest proposal still waiting for an operator, else the newest approved one."""
    rows = db.list_proposals(s, job, status="proposed", limit=1)
    if rows:
        return rows[0]
    rows = db.list_proposals(s, job, status="approved", limit=1)
    return rows[0] if rows else None


def proposal_to_decide(s: Any, job: str, proposal_id: int, verb: str) -> db.ProposalRow:
    """The proposal an operator approves or rejects; only a proposed one may be. One that
    another replaced says by which, when and why, so the operator reviews that one."""
    prop = db.get_proposal(s, job, proposal_id)
    if prop is None:
        raise NotFoundError(f"Proposal {proposal_id} not found for job '{job}'.")
    if prop.status == "superseded" and (m := _REPLACED.match(prop.decision_reason or "")):
        new, why = m.group(1), m.group(2)
        raise ConflictError(f"Proposal {proposal_id} was replaced by proposal {new} at "
                            f"{_clock_time(prop.decided_at)} ({why}); review {new}.")
    if prop.status == "superseded" and prop.decision_reason and prop.decided_at is not None:
        raise ConflictError(f"Proposal {proposal_id} was superseded at {_clock_time(prop.decided_at)} "
                            f"({prop.decision_reason}); refresh and review the newest one.")
    if prop.status != "proposed":
        raise ConflictError(f"Proposal {proposal_id} is {prop.status}; only a proposed one can be {verb}.")
    return prop


# ``supersede`` writes a replaced proposal's decision reason in this form; the 409 above reads it.
_REPLACED = re.compile(r"^replaced by proposal (\d+) \((.+)\)$")


def _clock_time(t: float | None) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(t)) if t is not None else "an unknown time"


def supersede(s: Any, job: str, new: db.ProposalRow, why: str) -> None:
    """Proposal ``new`` replaces every other proposed one of ``job`` (``why``: a few words,
    e.g. "a clearly better split"); each says by which in its decision reason."""
    close_pending(s, job, "superseded", f"replaced by proposal {new.id} ({why})", new.created_at, keep=new.id)


def decide(prop: db.ProposalRow, status: str, why: str, at: float, *, by: Any = None) -> None:
    """Close a proposal: its new status, why, when and (for an operator's decision) who."""
    prop.status, prop.decision_reason, prop.decided_at = status, why, at
    if by is not None:
        prop.decided_by = actor_name(by)


def approve(s: Any, prop: db.ProposalRow, row: db.PlacementRow, *, actor: Any, reason: str | None,
            auto: bool, at: float) -> None:
    """``prop`` was applied as placement ``row`` (by an operator, or by auto mode): approved,
    naming the version; the other proposed ones superseded; audited."""
    decide(prop, "approved", reason or "", at, by=actor)
    prop.placement_version = row.version
    close_pending(s, prop.job, "superseded", f"proposal {prop.id} was approved", at, keep=prop.id)
    db.record_audit(s, actor=actor, action="proposal.auto_apply" if auto else "proposal.approve",
                    job=prop.job, params={"proposal_id": prop.id, "version": row.version,
                                          "shares": list(prop.shares)}, reason=reason)


def audit_cost_model(s: Any, prop: db.ProposalRow, row: db.PlacementRow, *, length_sq_weight: float,
                     previous: float, actor: Any, reason: str | None) -> None:
    """An operator's placement ``row`` (from ``prop``) carried the cost model k, audited as the
    policy's own is (``placement.cost_model``: a restarted backend reads the k in force from it)."""
    db.record_audit(s, actor=actor, action="placement.cost_model", job=prop.job, reason=reason or prop.reason,
                    params={"length_sq_weight": length_sq_weight, "previous_length_sq_weight": previous,
                            "version": row.version, "shares": list(row.shares), "proposal_id": prop.id})


def reject(s: Any, prop: db.ProposalRow, *, actor: Any, reason: str | None, at: float) -> None:
    """An operator rejected ``prop``, audited."""
    decide(prop, "rejected", reason or "", at, by=actor)
    db.record_audit(s, actor=actor, action="proposal.reject", job=prop.job,
                    params={"proposal_id": prop.id}, reason=reason)


def audit_manual(s: Any, prop: db.ProposalRow, *, apply: bool, force: bool, problems: list[str],
                 actor: Any, reason: str | None) -> None:
    """An operator's own placement became proposal ``prop``; one forced past memory caps
    (``problems``) is audited as such too."""
    shares = list(prop.shares)
    db.record_audit(s, actor=actor, action="proposal.create", job=prop.job,
                    params={"proposal_id": prop.id, "shares": shares, "apply": apply, "force": force},
                    reason=reason)
    if problems:
        db.record_audit(s, actor=actor, action="placement.memory_force", job=prop.job,
                        params={"proposal_id": prop.id, "shares": shares, "problems": problems},
                        reason=reason)


def close_pending(s: Any, job: str, status: str, why: str, at: float, keep: int | None = None) -> None:
    """Close every proposed proposal of ``job`` but ``keep``."""
    for p in db.list_proposals(s, job, status="proposed"):
        if p.id != keep:
            decide(p, status, why, at)


def expire_due(s: Any, now: float) -> list[str]:
    """Mark proposed proposals past their TTL expired; returns the job of each."""
    rows = s.scalars(select(db.ProposalRow).where(
        db.ProposalRow.status == "proposed", db.ProposalRow.expires_at < now)).all()
    for p in rows:
        decide(p, "expired", "older than its TTL", now)
    return [p.job for p in rows]


def next_version(s: Any, job: str, *, running: int = 0) -> int:
    """The backend's only numbering of placements (docs/design.md, "Who numbers placements"):
    ``next_placement_version`` past the newest stored for ``job`` (failed ones included) and
    past ``running``, a version the job's hooks already run that this backend never recorded
    (its database was replaced), which they would otherwise refuse as stale."""
    newest = db.latest_placement(s, job, include_failed=True)
    return next_placement_version(newest.version if newest is not None else None,
                                  running if running > 0 else None)


def new_placement(s: Any, job: str, shares: Sequence[int], *, source: str, actor: Any, reason: str,
                  at: float, proposal_id: int | None = None,
                  current: db.PlacementRow | None | bool = True,
                  predicted_step_ms: float | None = None, auto: bool = False,
                  prediction: dict[str, Any] | None = None) -> db.PlacementRow:
    """Add the next placement version after ``current`` (True: the one in force; None: no
    previous shares to return to). Approved proposals it overtakes are superseded.
    ``prediction``: a pipelined job's stage-model prediction (``policy.pipeline_check``)."""
    version = next_version(s, job)
    if current is True:
        current = db.latest_placement(s, job)
    prev = current if isinstance(current, db.PlacementRow) else None
    row = db.PlacementRow(
        job=job, version=version, shares=list(shares),
        previous_shares=list(prev.shares) if prev else None,
        previous_version=prev.version if prev else None,
        source=source, proposal_id=proposal_id, actor=actor_name(actor), reason=reason,
        created_at=at, acks={}, auto=auto, predicted_step_ms=predicted_step_ms, prediction=prediction,
    )
    s.add(row)
    # Older proposals approved but not yet applied will never be: the hook takes the newest.
    for p in db.list_proposals(s, job, status="approved"):
        if p.id != proposal_id:
            p.status, p.error = "superseded", f"placement version {version} replaced it before every rank applied it"
    s.flush()
    return row


def issued(s: Any, row: db.PlacementRow, old: db.PlacementRow | None, *, source: str, actor: Any,
           action: str, params: dict[str, Any] | None, reason: str) -> None:
    """Placement ``row`` was issued with no proposal behind it (a rollback: ``old``, the one
    it replaces, is marked rolled back), audited as ``action``."""
    if old is not None and source == "rollback":
        old.rolled_back = True
    db.record_audit(s, actor=actor, action=action, job=row.job,
                    params={**(params or {}), "version": row.version, "shares": list(row.shares)},
                    reason=reason)


def record_prediction(s: Any, row: db.PlacementRow, checked: dict[str, Any], *, actor: Any) -> None:
    """A pipelined placement's prediction with its check (``policy.pipeline_check.check``);
    one that ran more than the tolerance off is audited (``placement.prediction_missed``)."""
    row.prediction = checked
    if checked.get("missed"):
        db.record_audit(s, actor=actor, action="placement.prediction_missed", job=row.job,
                        params={"version": row.version, "predicted_step_ms": checked.get("predicted_step_ms"),
                                "measured_step_ms": checked.get("measured_step_ms"), "error": checked.get("error")},
                        reason=str(checked.get("note", "")))


def add_proposal(s: Any, job: str, *, base_version: int, current_shares: Sequence[int],
                 shares: Sequence[int], source: str, strategy: str, actor: Any, reason: str,
                 at: float, ttl_s: float, explanation: dict[str, Any] | None = None,
                 before: float | None = None, after: float | None = None,
                 gain: float | None = None) -> db.ProposalRow:
    """Add a proposed change from ``current_shares`` (version ``base_version``) to ``shares``."""
    row = db.ProposalRow(
        job=job, status="proposed", source=source, strategy=strategy, base_version=base_version,
        shares=list(shares), current_shares=list(current_shares), predicted_step_ms_before=before,
        predicted_step_ms_after=after, predicted_gain=gain, explanation=explanation,
        reason=reason, created_by=actor_name(actor), created_at=at, expires_at=at + ttl_s,
    )
    s.add(row)
    s.flush()
    return row


def refused_before(s: Any, job: str, version: int, shares: list[int]) -> str | None:
    """Why the same split must not be proposed again (operator rejected it against this
    version, or it was rolled back for making things worse), else None."""
    for p in db.list_proposals(s, job, status="rejected", limit=20):
        if list(p.shares) == shares and p.base_version == version:
            return f"proposal {p.id} with this split was rejected; the policy waits for a change"
    for row in db.list_placements(s, job, limit=20):
        if row.rolled_back and list(row.shares) == shares:
            return f"this split (version {row.version}) was rolled back because it made steps slower"
    return None


def recent_rollbacks(s: Any, job: str, limit: int = 4) -> list[tuple[int, list[int], list[int]]]:
    """Policy changes rolled back among the last 20 placements, oldest first, as
    ``(batch_index, shares_before, shares_after)``: the batch at which the restored split
    took effect (steps after it show whether a moved rank's cost changed), or the undone
    one's when the rollback is not applied yet."""
    rows = list(db.list_placements(s, job, limit=20))
    out = []
    for i, row in enumerate(rows):
        if not (row.rolled_back and row.previous_shares is not None and row.proposal_id is not None):
            continue
        newer = rows[i - 1] if i > 0 else None
        at = newer.effective_batch_index if newer is not None else None
        if at is None:
            at = row.effective_batch_index
        if at is None:
            continue
        out.append((int(at), list(row.previous_shares), list(row.shares)))
        if len(out) >= limit:
            break
    return out[::-1]


def last_effect(s: Any, job: str) -> dict[str, Any] | None:
    """The effect of the newest measured placement among the last 20."""
    for row in db.list_placements(s, job, limit=20):
        if row.step_ms_after is not None:
            return effect_record(row)
    return None


def take_epoch(s: Any, job: str, replica: str, epoch: int | None) -> int | None:
    """This replica's lease epoch for ``job`` installed in ``job_owners`` (None: a higher one
    is there; ``epoch`` None: one replica, the stored epoch plus one)."""
    return owners.take_epoch(s, job, replica, epoch)


def check_epoch(s: Any, job: str, replica: str, epoch: int, *, idle_limit_s: float) -> tuple[int, str] | None:
    """The fence of a control write, its last statement before the commit (None: it holds)."""
    return owners.check_epoch(s, job, replica, epoch, idle_limit_s=idle_limit_s)
