"""The control loop: modes, proposal lifecycle, guardrails, rollback and measured effect.

The policy (``backend.policy``) only decides; this module acts on its decisions. Per job it
keeps a small cache in memory and everything that matters in SQL
(``backend.storage.control``), so a restarted backend resumes where it stopped.

Modes: ``observe`` (proposals are shown, never sent), ``approve`` (they wait for an
operator), ``auto`` (applied under guardrails: a cap on how far one change moves a rank, the
policy's cooldown, and rollback when the measured step time got worse).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.storage import control as db
from trainer_hook.protocol import Ack, Hello, Placement, Reject, uniform_shares

__all__ = ["Controller", "ControlError", "NotFoundError", "ConflictError", "InvalidError", "MODES"]

log = logging.getLogger(__name__)

MODES = ("observe", "approve", "auto")
_PENDING = ("proposed", "approved")
_SYSTEM = "controller"


class ControlError(Exception):
    """A refused control action; ``status_code`` is the HTTP status the API answers with."""

    status_code = 400

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


class NotFoundError(ControlError):
    status_code = 404


class ConflictError(ControlError):
    status_code = 409


class InvalidError(ControlError):
    status_code = 422


@dataclass
class _JobState:
    """What the controller keeps in memory for one job (SQL holds the truth)."""

    job: str
    world_size: int
    global_batch_size: int
    mode: str
    policy: dict[str, Any]
    overrides: dict[str, Any]
    version: int
    shares: list[int]
    status: str = "warming_up"
    status_detail: str = "waiting for the first steps"
    last_run: float = -math.inf
    last_metrics: float = -math.inf
    devices: dict[int, Hello] = field(default_factory=dict)
    last_effect: dict[str, Any] | None = None
    static_checked: bool = False


class Controller:
    """Runs the control loop of every job. Built by ``create_app`` as ``Controller(services)``.

    ``services`` provides ``settings``, ``sessionmaker`` (SQLAlchemy), ``live`` (LiveState),
    ``connections`` (HookConnections) and, optionally, ``hub`` (DashboardHub).
    """

    def __init__(self, services: Any, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.services = services
        self._clock = clock
        self._wall = wall
        self._jobs: dict[str, _JobState] = {}
        self._task: asyncio.Task[None] | None = None
        # Run the policy at most this often per job, whatever the metrics rate.
        self.min_interval_s = 0.5

    # --- plumbing ---------------------------------------------------------------------

    @property
    def settings(self) -> Any:
        return self.services.settings

    def _session(self) -> Any:
        for name in ("sessionmaker", "session_factory", "Session", "sessions"):
            sm = getattr(self.services, name, None)
            if sm is not None:
                return sm()
        raise RuntimeError("services has no sessionmaker; create_app must wire one before the controller.")

    def _setting(self, name: str, default: Any) -> Any:
        return getattr(self.settings, name, default)

    def _notify(self, job: str) -> None:
        hub = getattr(self.services, "hub", None)
        if hub is not None:
            with contextlib.suppress(Exception):
                hub.notify(job)

    async def _send(self, job: str, msg: Placement) -> None:
        conns = getattr(self.services, "connections", None)
        if conns is None:
            return
        try:
            await conns.send(job, msg)
        except Exception:  # a dead socket must not undo a recorded decision; hello resyncs
            log.exception("sending placement %s of job %s failed", msg.version, job)

    async def start(self) -> None:
        """Start the background tick (proposal expiry, idle detection)."""
        if self._task is None:
            self._task = asyncio.create_task(self._tick_loop(), name="rebalancer-controller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _tick_loop(self) -> None:
        interval = float(self._setting("controller_tick_s", 1.0))
        while True:
            await asyncio.sleep(interval)
            try:
                self.expire_proposals()
            except Exception:
                log.exception("controller tick failed")

    # --- job state ----------------------------------------------------------------------

    def _load(self, job: str) -> _JobState | None:
        st = self._jobs.get(job)
        if st is not None:
            return st
        with self._session() as s:
            row = db.get_settings(s, job)
            if row is None:
                return None
            pl = db.latest_placement(s, job)
            ov = s.get(db.OverridesRow, job)
            st = _JobState(
                job=job, world_size=row.world_size, global_batch_size=row.global_batch_size,
                mode=row.mode, policy=dict(row.policy or {}), overrides=_overrides_dict(ov),
                version=pl.version if pl else 0,
                shares=list(pl.shares) if pl else uniform_shares(row.world_size, row.global_batch_size),
                status="idle", status_detail="no ranks connected since the backend started",
            )
            st.last_effect = _last_effect(s, job)
        self._jobs[job] = st
        return st

    def _require(self, job: str) -> _JobState:
        st = self._load(job)
        if st is None:
            raise NotFoundError(f"Job '{job}' not found.")
        return st

    def known(self, job: str) -> bool:
        """True when the job has control state (it said hello at least once)."""
        return self._load(job) is not None

    # --- hook events ------------------------------------------------------------------

    async def on_hello(self, hello: Hello) -> Placement:
        """Return the placement in force; a new job gets version 0, the uniform split."""
        job = hello.job
        st = self._load(job)
        send_new = False
        with self._session() as s:
            if st is None:
                shares = uniform_shares(hello.world_size, hello.global_batch_size)
                s.add(db.JobSettingsRow(
                    job=job, world_size=hello.world_size, global_batch_size=hello.global_batch_size,
                    mode=self._setting("default_mode", "approve"), policy={},
                    created_at=self._wall(), updated_at=self._wall(),
                ))
                s.add(db.PlacementRow(
                    job=job, version=0, shares=shares, source="initial", actor=_SYSTEM,
                    reason="uniform split for a new job", created_at=self._wall(), acks={},
                ))
                db.record_audit(s, actor=_SYSTEM, action="job.create", job=job,
                                params={"world_size": hello.world_size,
                                        "global_batch_size": hello.global_batch_size},
                                reason="first hello from the job")
                s.commit()
                st = None
            elif (hello.world_size, hello.global_batch_size) != (st.world_size, st.global_batch_size):
                # The job came back with another shape: old placements cannot apply.
                reason = (f"job restarted with world_size {hello.world_size} and global batch "
                          f"{hello.global_batch_size} (was {st.world_size} and {st.global_batch_size})")
                row = s.get(db.JobSettingsRow, job)
                row.world_size, row.global_batch_size = hello.world_size, hello.global_batch_size
                row.updated_at = self._wall()
                self._close_pending(s, job, "superseded", reason)
                self._new_placement(s, st, uniform_shares(hello.world_size, hello.global_batch_size),
                                    source="initial", actor=_SYSTEM, reason=reason, current=None)
                db.record_audit(s, actor=_SYSTEM, action="job.reshape", job=job,
                                params={"world_size": hello.world_size,
                                        "global_batch_size": hello.global_batch_size}, reason=reason)
                s.commit()
                self._jobs.pop(job, None)
                st = None
        if st is None:
            self._jobs.pop(job, None)
            st = self._require(job)
        st.devices[hello.rank] = hello
        st.last_metrics = self._clock()
        if st.status == "idle":
            st.status, st.status_detail = "warming_up", "waiting for the first steps"
        self._notify(job)
        if send_new:
            await self._send(job, self._placement_msg(st))
        return self._placement_msg(st)

    def _placement_msg(self, st: _JobState, *, proposal_id: int | None = None, reason: str = "") -> Placement:
        return Placement(job=st.job, version=st.version, shares=list(st.shares),
                         global_batch_size=st.global_batch_size, proposal_id=proposal_id,
                         reason=reason)

    async def on_metrics(self, job: str) -> None:
        """Run the policy for ``job`` at most every ``min_interval_s`` seconds."""
        st = self._load(job)
        if st is None:
            return
        now = self._clock()
        st.last_metrics = now
        if now - st.last_run < self.min_interval_s:
            return
        st.last_run = now
        try:
            await self._run_policy(st)
        except Exception:  # a policy bug must not take ingest down with it
            log.exception("policy run for job %s failed", job)
            st.status_detail = "the policy failed; see the backend log"

    async def on_ack(self, ack: Ack) -> None:
        """Record the batch index at which a rank applied a version; all acked -> applied."""
        st = self._load(ack.job)
        if st is None:
            return
        with self._session() as s:
            row = db.get_placement(s, ack.job, ack.version)
            if row is None:
                log.warning("ack for unknown placement %s of job %s", ack.version, ack.job)
                return
            acks = dict(row.acks or {})
            acks[str(ack.rank)] = ack.batch_index
            row.acks = acks
            if row.applied_at is None and len(acks) >= st.world_size:
                row.applied_at = self._wall()
                row.effective_batch_index = max(acks.values())
                before = self._window_step_ms(st.job, hi=row.effective_batch_index)
                row.step_ms_before = before
                if row.proposal_id is not None:
                    prop = s.get(db.ProposalRow, row.proposal_id)
                    if prop is not None and prop.status == "approved":
                        prop.status = "applied"
            s.commit()
        self._notify(ack.job)

    async def on_reject(self, reject: Reject) -> None:
        """A rank refused a placement: mark it and its proposal failed, with the reason."""
        st = self._load(reject.job)
        if st is None:
            return
        error = f"rank {reject.rank} rejected placement version {reject.version}: {reject.reason}"
        with self._session() as s:
            row = db.get_placement(s, reject.job, reject.version)
            if row is None:
                return
            if not row.failed:
                row.failed = True
                row.error = error
                if row.proposal_id is not None:
                    prop = s.get(db.ProposalRow, row.proposal_id)
                    if prop is not None and prop.status in _PENDING:
                        prop.status = "failed"
                        prop.error = error
                db.record_audit(s, actor=_SYSTEM, action="placement.failed", job=reject.job,
                                params={"version": reject.version, "rank": reject.rank},
                                reason=reject.reason)
            s.commit()
            if st.version == reject.version:
                prev = db.latest_placement(s, reject.job)
                if prev is not None:
                    st.version, st.shares = prev.version, list(prev.shares)
        self._notify(reject.job)

    # --- reading ------------------------------------------------------------------------

    def job_control(self, job: str) -> dict[str, Any]:
        """Control state of a job for the job resource and the dashboard ({} if unknown)."""
        st = self._load(job)
        if st is None:
            return {}
        with self._session() as s:
            pending = self._pending(s, job)
            pending_d = pending.public() if pending else None
        status, detail = st.status, st.status_detail
        stale = float(self._setting("stale_after_s", 30.0))
        if self._clock() - st.last_metrics > stale:
            status, detail = "idle", "no metrics from the job recently"
        elif pending is not None:
            status = "proposal_pending"
            detail = f"proposal {pending.id} is {pending.status}: {pending.reason}"
        return {
            "mode": st.mode,
            "strategy": self._config(st).strategy,
            "policy": self.policy_settings(job),
            "overrides": dict(st.overrides),
            "placement": {"version": st.version, "shares": list(st.shares)},
            "pending_proposal": pending_d,
            "pending_proposal_id": pending_d["id"] if pending_d else None,
            "status": status,
            "status_detail": detail,
            "last_effect": st.last_effect,
        }

    def proposal_counts(self, job: str) -> dict[str, int]:
        """Proposals of ``job`` by status, for Prometheus."""
        with self._session() as s:
            return db.proposal_counts(s, job)

    def _pending(self, s: Any, job: str) -> db.ProposalRow | None:
        rows = db.list_proposals(s, job, status="proposed", limit=1)
        if rows:
            return rows[0]
        rows = db.list_proposals(s, job, status="approved", limit=1)
        return rows[0] if rows else None

    # --- placements -------------------------------------------------------------------

    def _new_placement(self, s: Any, st: _JobState, shares: Sequence[int], *, source: str,
                       actor: Any, reason: str, proposal_id: int | None = None,
                       current: db.PlacementRow | None | bool = True,
                       predicted_step_ms: float | None = None, auto: bool = False) -> db.PlacementRow:
        """Add the next placement version (the caller commits, then sends it)."""
        newest = db.latest_placement(s, st.job, include_failed=True)
        version = newest.version + 1 if newest is not None else 0
        if current is True:
            current = db.latest_placement(s, st.job)
        prev = current if isinstance(current, db.PlacementRow) else None
        row = db.PlacementRow(
            job=st.job, version=version, shares=list(shares),
            previous_shares=list(prev.shares) if prev else None,
            previous_version=prev.version if prev else None,
            source=source, proposal_id=proposal_id, actor=_actor_name(actor), reason=reason,
            created_at=self._wall(), acks={}, auto=auto, predicted_step_ms=predicted_step_ms,
        )
        s.add(row)
        # Older proposals approved but not yet applied will never be: the hook takes the newest.
        for p in db.list_proposals(s, st.job, status="approved"):
            if p.id != proposal_id:
                p.status, p.error = "superseded", f"placement version {version} replaced it before every rank applied it"
        s.flush()
        st.version, st.shares = version, list(shares)
        return row

    def _close_pending(self, s: Any, job: str, status: str, why: str, keep: int | None = None) -> None:
        for p in db.list_proposals(s, job, status="proposed"):
            if p.id != keep:
                p.status, p.decision_reason, p.decided_at = status, why, self._wall()

    # The rest of the loop (policy runs, approvals, overrides, effect) is in the next part.
    async def _run_policy(self, st: _JobState) -> None:
        return None

    def _config(self, st: _JobState) -> Any:
        from backend.policy.types import PolicyConfig

        return PolicyConfig(strategy=st.policy.get("strategy", self._setting("default_strategy", "profiled")))

    def policy_settings(self, job: str) -> dict[str, Any]:
        st = self._require(job)
        return dict(st.policy)

    def _window_step_ms(self, job: str, *, hi: int | None = None, lo: int | None = None) -> float | None:
        return None

    def expire_proposals(self) -> int:
        return 0


def _actor_name(actor: Any) -> str:
    return actor if isinstance(actor, str) else str(getattr(actor, "name", actor))


def _overrides_dict(row: db.OverridesRow | None) -> dict[str, Any]:
    if row is None:
        return {"pins": {}, "caps": {}, "floors": {}, "drains": [], "granularity": 1}
    return {
        "pins": {int(k): int(v) for k, v in (row.pins or {}).items()},
        "caps": {int(k): int(v) for k, v in (row.caps or {}).items()},
        "floors": {int(k): int(v) for k, v in (row.floors or {}).items()},
        "drains": sorted(int(r) for r in (row.drains or [])),
        "granularity": int(row.granularity or 1),
    }


def _last_effect(s: Any, job: str) -> dict[str, Any] | None:
    for row in db.list_placements(s, job, limit=20):
        if row.step_ms_after is not None:
            return {"version": row.version, **row.public()["effect"]}
    return None


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))
