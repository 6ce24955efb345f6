"""The control loop: modes, proposal lifecycle, guardrails, rollback and measured effect.

The policy (``backend.policy``) only decides; this module acts on its decisions. Per job it
keeps a small cache in memory and everything that matters in SQL
(``backend.storage.control``), so a restarted backend resumes where it stopped. What the
policy is handed, and the checks on operator settings, are in ``backend.control.inputs``;
measured effect and the rollback decision in ``backend.control.effect``; the errors in
``backend.control.errors`` (re-exported here).

Modes: ``observe`` (proposals are shown, never sent), ``approve`` (they wait for an
operator), ``auto`` (applied under guardrails: a cap on how far one change moves a rank, the
policy's cooldown, and rollback when the measured step time got worse).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.control import effect, inputs, records
from backend.control.errors import (
    ConflictError,
    ControlError,
    InvalidError,
    NotFoundError,
    error_detail,
)
from backend.storage import control as db
from trainer_hook.protocol import Ack, Hello, Placement, Reject, check_shares, uniform_shares

__all__ = ["Controller", "ControlError", "NotFoundError", "ConflictError", "InvalidError", "MODES"]

log = logging.getLogger(__name__)

MODES = ("observe", "approve", "auto")
_SYSTEM = "controller"


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
    applied: bool = False  # every rank acked the placement in force
    effective: int | None = None  # the batch index it took effect at
    measured: bool = False  # its effect is on record
    busy: bool = False  # a policy run is in flight
    again: bool = False  # metrics came while warming up that the last run may have missed
    think_s: float = 0.0  # how long the last policy run took (thread time, wall clock)

    def follow(self, row: db.PlacementRow) -> None:
        """Take applied / effective / measured from the placement row in force."""
        self.applied = row.applied_at is not None
        self.effective = row.effective_batch_index if self.applied else None
        self.measured = row.step_ms_after is not None

    def waiting_detail(self) -> str:
        return f"waiting for every rank to apply version {self.version}"


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
        self._lock = threading.Lock()
        # Run the policy at most this often per job, whatever the metrics rate.
        self.min_interval_s = 0.5

    # --- plumbing ---------------------------------------------------------------------

    @property
    def settings(self) -> Any:
        return self.services.settings

    def _session(self) -> Any:
        return self.services.sessionmaker()

    def _setting(self, name: str, default: Any) -> Any:
        return getattr(self.settings, name, default)

    def _notify(self, job: str) -> None:
        hub = getattr(self.services, "hub", None)
        if hub is not None:
            with contextlib.suppress(Exception):  # the dashboard is never worth a failed action
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
            st = _JobState(
                job=job, world_size=row.world_size, global_batch_size=row.global_batch_size,
                mode=row.mode, policy=dict(row.policy or {}),
                overrides=inputs.overrides_dict(s.get(db.OverridesRow, job)),
                version=pl.version if pl else 0,
                shares=list(pl.shares) if pl else uniform_shares(row.world_size, row.global_batch_size),
                status="idle", status_detail="no ranks connected since the backend started",
            )
            st.last_effect = records.last_effect(s, job)
            if pl is not None:
                st.follow(pl)
        with self._lock:  # job_control is also read from worker threads
            return self._jobs.setdefault(job, st)

    def _require(self, job: str) -> _JobState:
        st = self._load(job)
        if st is None:
            raise NotFoundError(f"Job '{job}' not found.")
        return st

    def known(self, job: str) -> bool:
        """True when the job has control state (it said hello at least once)."""
        return self._load(job) is not None

    def _config(self, st: _JobState) -> Any:
        return inputs.policy_config(st.policy, st.mode, self.settings)

    def _knob(self, st: _JobState, name: str) -> Any:
        return inputs.knob(st.policy, self.settings, name)

    def _check_overrides(self, st: _JobState, shares: Sequence[int]) -> None:
        inputs.check_overrides(st.overrides, shares, global_batch_size=st.global_batch_size)

    def _costs(self, st: _JobState) -> list[float] | None:
        return inputs.step_costs(getattr(self.services, "live", None), st.job, st.world_size)

    # --- hook events ------------------------------------------------------------------

    async def on_hello(self, hello: Hello) -> Placement:
        """Return the placement in force; a new job gets version 0, the uniform split."""
        job = hello.job
        st = self._load(job)
        with self._session() as s:
            if st is None:
                records.create_job(s, hello, mode=self._setting("default_mode", "approve"),
                                   actor=_SYSTEM, at=self._wall())
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
        if self._config(st).strategy == "static" and not st.static_checked:
            await self._static_now(st)
        self._notify(job)
        return self._placement_msg(st)

    async def _static_now(self, st: _JobState) -> None:
        """The static strategy needs no measurement: propose its split as soon as every
        rank has said hello (auto mode applies it before the first steps)."""
        if not inputs.all_said_hello(self.services.live, st.job, st.world_size):
            return
        st.static_checked = True
        try:
            await self._run_policy(st)
        except Exception:
            log.exception("static placement for job %s failed", st.job)

    def _placement_msg(self, st: _JobState, *, proposal_id: int | None = None, reason: str = "") -> Placement:
        return Placement(job=st.job, version=st.version, shares=list(st.shares),
                         global_batch_size=st.global_batch_size, proposal_id=proposal_id,
                         reason=reason)

    async def on_metrics(self, job: str) -> None:
        """Run the policy for ``job`` at most every ``min_interval_s`` seconds; while the
        job warms up, on every metrics frame (the first proposal is due as soon as the last
        rank's steps are in, not up to ``min_interval_s`` later)."""
        st = self._load(job)
        if st is None:
            return
        now = self._clock()
        st.last_metrics = now
        warming = st.status == "warming_up"
        # At thousands of ranks one run takes a good fraction of a second; spacing runs by
        # their own cost keeps the policy thread under a fifth of a core.
        if st.busy or now - st.last_run < max(0.0 if warming else self.min_interval_s,
                                              5.0 * st.think_s):
            # Lockstep ranks send their frames together: the one that completes the
            # warm-up may land while a run is in flight, so that run goes again.
            st.again = st.again or warming
            return
        while True:
            st.last_run, st.again = self._clock(), False
            try:
                await self._run_policy(st)
            except Exception:  # a policy bug must not take ingest down with it
                log.exception("policy run for job %s failed", job)
                st.status_detail = "the policy failed; see the backend log"
                return
            if not (st.again and st.status == "warming_up"):
                return
            await asyncio.sleep(5.0 * st.think_s)
            if st.busy:
                return  # a newer frame's run took over

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
            self._record_acks(s, st, row, {ack.rank: ack.batch_index})
            s.commit()
        self._notify(ack.job)

    def _record_acks(self, s: Any, st: _JobState, row: db.PlacementRow, new: dict[int, int]) -> None:
        row.acks = acks = effect.merge_acks(row.acks, new)
        if row.applied_at is None and len(acks) >= st.world_size:
            row.applied_at = self._wall()
            row.effective_batch_index = e = max(acks.values())
            lo, hi = effect.before_window(e, int(self._knob(st, "effect_window_steps")))
            row.step_ms_before = effect.window_step_ms(getattr(self.services, "live", None), st.job,
                                                       lo=lo, hi=hi)
            if row.proposal_id is not None:
                prop = s.get(db.ProposalRow, row.proposal_id)
                if prop is not None and prop.status == "approved":
                    prop.status = "applied"
        if row.version == st.version and row.applied_at is not None:
            st.follow(row)

    def _acks_from_metrics(self, st: _JobState) -> None:
        """Acks lost on the way (say, sent while the backend restarted): every rank's steps
        show the version in force, so take the first batch index each trained under it."""
        if st.applied or st.version == 0:
            return
        first = effect.first_batches_under(self.services.live, st.job, st.world_size, st.version)
        if first is None:
            return  # not every rank shows it yet; or the switch fell out of the buffers
        with self._session() as s:
            row = db.get_placement(s, st.job, st.version)
            if row is not None:
                missing = {r: k for r, k in first.items() if str(r) not in (row.acks or {})}
                self._record_acks(s, st, row, missing)
                s.commit()

    async def on_reject(self, reject: Reject) -> None:
        """A rank refused a placement: mark it and its proposal failed, with the reason."""
        st = self._load(reject.job)
        if st is None:
            return
        with self._session() as s:
            row = db.get_placement(s, reject.job, reject.version)
            if row is None:
                return
            if not row.failed:
                records.fail_placement(s, row, rank=reject.rank, reason=reject.reason, actor=_SYSTEM)
            s.commit()
            if st.version == reject.version:
                prev = db.latest_placement(s, reject.job)
                if prev is not None:
                    st.version, st.shares = prev.version, list(prev.shares)
                    st.follow(prev)
                    st.measured = True  # do not re-measure (or roll back) the restored one
        self._notify(reject.job)

    # --- reading ------------------------------------------------------------------------

    def job_control(self, job: str) -> dict[str, Any]:
        """Control state of a job for the job resource and the dashboard ({} if unknown)."""
        st = self._load(job)
        if st is None:
            return {}
        with self._session() as s:
            pending = records.pending_proposal(s, job)
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

    def activity_counts(self, job: str) -> dict[str, dict[str, int]]:
        """Proposals and placements of ``job`` by source, and rejected placements, counted
        from the stored rows (Prometheus counters that survive a restart)."""
        with self._session() as s:
            return db.activity_counts(s, job)

    def policy_settings(self, job: str) -> dict[str, Any]:
        """Effective policy settings of a job (stored values over the backend defaults)."""
        st = self._require(job)
        return inputs.policy_settings(st.policy, st.mode, self.settings)

    def overrides(self, job: str) -> dict[str, Any]:
        """The overrides in force for ``job``."""
        return dict(self._require(job).overrides)

    def placements(self, job: str, limit: int = 100) -> list[dict[str, Any]]:
        self._require(job)
        with self._session() as s:
            return [r.public() for r in db.list_placements(s, job, limit=limit)]

    def proposals(self, job: str, status: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        self._require(job)
        if status is not None and status not in db.PROPOSAL_STATUSES:
            raise InvalidError(f"status must be one of {', '.join(db.PROPOSAL_STATUSES)}; got {status!r}.")
        with self._session() as s:
            return [r.public() for r in db.list_proposals(s, job, status=status, limit=limit)]

    def audit(self, job: str, limit: int = 200) -> list[dict[str, Any]]:
        self._require(job)
        with self._session() as s:
            return [r.public() for r in db.list_audit(s, job, limit=limit)]

    # --- placements and proposals ---------------------------------------------------------

    def _new_placement(self, s: Any, st: _JobState, shares: Sequence[int], *, source: str,
                       actor: Any, reason: str, proposal_id: int | None = None,
                       current: db.PlacementRow | None | bool = True,
                       predicted_step_ms: float | None = None, auto: bool = False) -> db.PlacementRow:
        """Add the next placement version and make it the one in force here (the caller
        commits, then sends it)."""
        row = records.new_placement(
            s, st.job, shares, source=source, actor=actor, reason=reason, at=self._wall(),
            proposal_id=proposal_id, current=current, predicted_step_ms=predicted_step_ms, auto=auto)
        st.version, st.shares = row.version, list(shares)
        return row

    def _close_pending(self, s: Any, job: str, status: str, why: str, keep: int | None = None) -> None:
        records.close_pending(s, job, status, why, self._wall(), keep)

    def _add_proposal(self, s: Any, st: _JobState, shares: list[int], *, source: str, strategy: str,
                      actor: Any, reason: str, explanation: dict[str, Any] | None = None,
                      before: float | None = None, after: float | None = None,
                      gain: float | None = None) -> db.ProposalRow:
        if before is None:
            costs = self._costs(st)
            before = inputs.predict_step_ms(costs, st.shares)
            after = inputs.predict_step_ms(costs, shares)
            if before and after is not None:
                gain = (before - after) / before
        return records.add_proposal(
            s, st.job, base_version=st.version, current_shares=st.shares, shares=shares,
            source=source, strategy=strategy, actor=actor, reason=reason, at=self._wall(),
            ttl_s=float(self._knob(st, "proposal_ttl_s")), explanation=explanation,
            before=before, after=after, gain=gain)

    def expire_proposals(self) -> int:
        """Mark proposals older than their TTL expired; returns how many."""
        with self._session() as s:
            expired = records.expire_due(s, self._wall())
            s.commit()
        for job in set(expired):
            self._notify(job)
        return len(expired)

    # --- the policy loop --------------------------------------------------------------

    def _settled(self, st: _JobState) -> bool:
        """True once every rank trains under the placement in force (acked or seen in metrics)."""
        if st.applied or st.version == 0:  # version 0 is every hook's starting split
            return True
        view = self.services.live.view(st.job)
        if view is None or len(view.ranks) < st.world_size:
            return False
        return all(r.placement_version is not None and r.placement_version >= st.version
                   for r in view.ranks)

    async def _run_policy(self, st: _JobState) -> None:
        self._acks_from_metrics(st)
        await self._measure_effect(st)
        from backend.policy import InfeasibleError, decide, limit_moves
        from backend.policy.types import Proposal as PolicyProposal

        if not self._settled(st):
            st.status, st.status_detail = "proposal_pending", st.waiting_detail()
            return
        with self._session() as s:
            pending = records.pending_proposal(s, st.job)
            if pending is not None and pending.source != "policy":
                return  # an operator's own proposal is not replaced by the policy
        cfg = self._config(st)
        live = self.services.live

        def think() -> Any:
            obs = inputs.observation(
                live, st.job, world_size=st.world_size, global_batch_size=st.global_batch_size,
                shares=st.shares, version=st.version, effective=st.effective,
                window_steps=cfg.window_steps)
            return None if obs is None else decide(obs, cfg, inputs.constraints_from(st.overrides))

        if st.busy:
            st.again = True
            return
        st.busy, version = True, st.version
        try:
            # Off the event loop: at thousands of ranks building the observation and fitting
            # takes long enough to stall every websocket.
            started = time.perf_counter()
            decision = await asyncio.to_thread(think)
            st.think_s = time.perf_counter() - started
        except InfeasibleError as exc:
            st.status, st.status_detail = "imbalanced", f"the overrides admit no placement: {exc}"
            return
        finally:
            st.busy = False
        if decision is None or st.version != version:
            return  # no data yet, or the placement changed while the policy was thinking
        constraints = inputs.constraints_from(st.overrides)
        if not isinstance(decision, PolicyProposal):
            st.status = ("warming_up" if decision.status in ("warming_up", "no_data")
                         else "imbalanced" if decision.status == "infeasible" else "balanced")
            st.status_detail = decision.detail
            return
        shares = list(decision.shares)
        if st.mode == "auto" and cfg.max_move_fraction:
            max_move = inputs.auto_max_move(cfg.max_move_fraction, st.global_batch_size,
                                            constraints.granularity)
            shares = list(limit_moves(st.shares, shares, max_move, constraints))
        if shares == st.shares:
            st.status, st.status_detail = "balanced", "the policy's split equals the placement in force"
            return
        with self._session() as s:
            if pending is not None and list(pending.shares) == shares and pending.base_version == st.version:
                pid = pending.id  # already on the table (say, shown before the mode became auto)
                if st.mode == "auto" and pending.status == "proposed":
                    await self._apply(st.job, pid, actor="auto", reason="auto mode", auto=True)
                return
            blocked = records.refused_before(s, st.job, st.version, shares)
            if blocked:
                st.status, st.status_detail = "imbalanced", blocked
                return
            self._close_pending(s, st.job, "superseded", "a newer policy proposal replaced it")
            expl = decision.explanation
            prop = self._add_proposal(
                s, st, shares, source="policy", strategy=expl.strategy, actor=_SYSTEM,
                reason=decision.reason, explanation=_explanation_dict(expl),
                before=expl.step_ms_before, after=expl.step_ms_after, gain=expl.gain)
            s.commit()
            pid = prop.id
        st.status, st.status_detail = "proposal_pending", decision.reason
        if st.mode == "auto":
            await self._apply(st.job, pid, actor="auto", reason="auto mode", auto=True)
        self._notify(st.job)

    async def _measure_effect(self, st: _JobState) -> None:
        if not st.applied or st.effective is None or st.measured:
            return
        w = int(self._knob(st, "effect_window_steps"))
        lo, hi = effect.after_window(st.effective, w)
        view = self.services.live.view(st.job)
        if view is None or view.batch_index is None or view.batch_index < hi:
            return
        after = effect.window_step_ms(getattr(self.services, "live", None), st.job,
                                      lo=lo, hi=hi, need=max(1, w // 2))
        rollback = None
        with self._session() as s:
            row = db.get_placement(s, st.job, st.version)
            if row is None or after is None:
                return
            verdict = effect.judge_effect(
                version=row.version, step_ms_before=row.step_ms_before, step_ms_after=after,
                rollback_threshold=float(self._knob(st, "rollback_threshold")),
                may_roll_back=row.auto and st.mode == "auto" and row.previous_shares is not None)
            row.step_ms_after = verdict.step_ms_after
            if verdict.measured_gain is not None:
                row.measured_gain = verdict.measured_gain
            if verdict.rollback_reason is not None and row.previous_shares is not None:
                row.rolled_back = True
                rollback = (list(row.previous_shares), verdict.rollback_reason)
            st.measured = True
            st.last_effect = effect.effect_record(row)
            s.commit()
        if rollback is not None:
            await self._issue(st, rollback[0], source="rollback", actor=_SYSTEM, reason=rollback[1],
                              action="placement.auto_rollback")
        self._notify(st.job)

    # --- operator actions (the REST routes call these) ------------------------------------

    async def _issue(self, st: _JobState, shares: list[int], *, source: str, actor: Any, reason: str,
                     action: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Record and send a placement that no proposal stands behind (rollback)."""
        # Pending proposals stay: approving one now answers 409 (computed against an older
        # version), and the next policy run supersedes it.
        with self._session() as s:
            old = db.latest_placement(s, st.job)
            row = self._new_placement(s, st, shares, source=source, actor=actor, reason=reason,
                                      current=old)
            if old is not None and source == "rollback":
                old.rolled_back = True
            db.record_audit(s, actor=actor, action=action, job=st.job,
                            params={**(params or {}), "version": row.version, "shares": shares},
                            reason=reason)
            s.commit()
            out = row.public()
        self._reset_applied(st)
        await self._send(st.job, self._placement_msg(st, reason=reason))
        self._notify(st.job)
        return out

    def _reset_applied(self, st: _JobState) -> None:
        st.applied, st.effective, st.measured = False, None, False

    async def _apply(self, job: str, proposal_id: int, *, actor: Any, reason: str | None,
                     auto: bool = False) -> dict[str, Any]:
        st = self._require(job)
        with self._session() as s:
            prop = records.proposal_to_decide(s, job, proposal_id, "approved")
            if st.mode == "observe":
                raise ConflictError(f"Job '{job}' is in observe mode; set the mode to approve or auto to apply proposals.")
            if prop.base_version != st.version:
                records.decide(prop, "expired", f"placement version {st.version} came into force", self._wall())
                s.commit()
                raise ConflictError(
                    f"Proposal {proposal_id} was computed against placement version {prop.base_version} "
                    f"but version {st.version} is in force; refresh.")
            if prop.expires_at is not None and self._wall() > prop.expires_at:
                records.decide(prop, "expired", "older than its TTL", self._wall())
                s.commit()
                raise ConflictError(f"Proposal {proposal_id} expired; refresh.")
            shares = list(prop.shares)
            try:
                check_shares(shares, world_size=st.world_size, global_batch_size=st.global_batch_size)
                self._check_overrides(st, shares)
            except (ValueError, InvalidError) as exc:
                raise ConflictError(f"Proposal {proposal_id} no longer fits: {error_detail(exc)} Refresh.") from None
            row = self._new_placement(
                s, st, shares, source="auto" if auto else prop.source, actor=actor,
                reason=reason or prop.reason, proposal_id=prop.id, auto=auto,
                predicted_step_ms=prop.predicted_step_ms_after)
            records.decide(prop, "approved", reason or "", self._wall(), by=actor)
            prop.placement_version = row.version
            self._close_pending(s, job, "superseded", f"proposal {prop.id} was approved", keep=prop.id)
            db.record_audit(s, actor=actor, action="proposal.auto_apply" if auto else "proposal.approve",
                            job=job, params={"proposal_id": prop.id, "version": row.version,
                                             "shares": shares}, reason=reason)
            s.commit()
            out = prop.public()
        self._reset_applied(st)
        st.status, st.status_detail = "proposal_pending", st.waiting_detail()
        await self._send(job, self._placement_msg(st, proposal_id=proposal_id, reason=out["reason"]))
        self._notify(job)
        return out

    async def approve(self, job: str, proposal_id: int, *, actor: Any, reason: str | None = None) -> dict[str, Any]:
        """Send exactly the reviewed shares as the next placement version."""
        return await self._apply(job, proposal_id, actor=actor, reason=reason)

    async def reject(self, job: str, proposal_id: int, *, actor: Any, reason: str | None = None) -> dict[str, Any]:
        st = self._require(job)
        with self._session() as s:
            prop = records.proposal_to_decide(s, job, proposal_id, "rejected")
            records.decide(prop, "rejected", reason or "", self._wall(), by=actor)
            db.record_audit(s, actor=actor, action="proposal.reject", job=job,
                            params={"proposal_id": proposal_id}, reason=reason)
            s.commit()
            out = prop.public()
        st.status, st.status_detail = "imbalanced", f"proposal {proposal_id} was rejected"
        self._notify(job)
        return out

    async def submit_manual(self, job: str, shares: Any, *, actor: Any, reason: str | None = None,
                            apply: bool = False) -> dict[str, Any]:
        """An operator's own placement: validated, stored as a proposal, applied if asked."""
        st = self._require(job)
        try:
            shares = check_shares(shares, world_size=st.world_size, global_batch_size=st.global_batch_size)
        except ValueError as exc:
            raise InvalidError(f"Invalid placement: {exc}") from None
        self._check_overrides(st, shares)
        with self._session() as s:
            self._close_pending(s, job, "superseded", "an operator submitted a placement")
            prop = self._add_proposal(s, st, shares, source="manual", strategy="manual", actor=actor,
                                      reason=reason or "manual placement")
            db.record_audit(s, actor=actor, action="proposal.create", job=job,
                            params={"proposal_id": prop.id, "shares": shares, "apply": apply},
                            reason=reason)
            s.commit()
            pid, out = prop.id, prop.public()
        self._notify(job)
        if apply:
            return await self._apply(job, pid, actor=actor, reason=reason)
        return out

    async def rollback(self, job: str, *, actor: Any, reason: str | None = None) -> dict[str, Any]:
        """Go back to exactly the shares in force before the current placement."""
        st = self._require(job)
        with self._session() as s:
            cur = db.latest_placement(s, job)
            if cur is None or cur.previous_shares is None:
                raise ConflictError(f"Job '{job}' has no previous placement to roll back to.")
            shares, prev_version = list(cur.previous_shares), cur.previous_version
        if len(shares) != st.world_size:
            raise ConflictError(f"The previous placement of job '{job}' has another world size; it cannot return.")
        return await self._issue(st, shares, source="rollback", actor=actor,
                                 reason=reason or f"rollback to the shares of version {prev_version}",
                                 action="placement.rollback", params={"to_version": prev_version})

    async def set_mode(self, job: str, mode: str, *, actor: Any, reason: str | None = None) -> dict[str, Any]:
        st = self._require(job)
        if mode not in MODES:
            raise InvalidError(f"Mode must be one of observe, approve, auto; got {mode!r}.")
        with self._session() as s:
            row = s.get(db.JobSettingsRow, job)
            old, row.mode, row.updated_at = row.mode, mode, self._wall()
            db.record_audit(s, actor=actor, action="job.mode", job=job,
                            params={"mode": mode, "previous": old}, reason=reason)
            s.commit()
        st.mode, st.last_run = mode, -math.inf
        self._notify(job)
        return self.job_control(job)

    async def set_policy(self, job: str, changes: dict[str, Any], *, actor: Any,
                         reason: str | None = None) -> dict[str, Any]:
        """Merge ``changes`` into the job's policy settings (None removes a stored value)."""
        from backend.policy import available_strategies

        st = self._require(job)
        for key, value in changes.items():
            if value is not None:
                inputs.check_policy_value(key, value, available_strategies())
        policy = dict(st.policy)
        for k, v in changes.items():
            if v is None:
                policy.pop(k, None)
            else:
                policy[k] = v
        with self._session() as s:
            row = s.get(db.JobSettingsRow, job)
            row.policy, row.updated_at = policy, self._wall()
            db.record_audit(s, actor=actor, action="job.policy", job=job, params=changes, reason=reason)
            s.commit()
        st.policy, st.last_run, st.static_checked = policy, -math.inf, False
        self._notify(job)
        return self.policy_settings(job)

    async def set_overrides(self, job: str, overrides: dict[str, Any], *, actor: Any,
                            reason: str | None = None) -> dict[str, Any]:
        """Replace the job's overrides; when the placement in force breaks them, propose one
        that respects them (applied right away in auto mode)."""
        from backend.policy import InfeasibleError, solve

        st = self._require(job)
        ov = inputs.validate_overrides(overrides, world_size=st.world_size,
                                       global_batch_size=st.global_batch_size)
        try:
            costs = self._costs(st) or [1.0] * st.world_size
            target = list(solve([0.0] * st.world_size, costs, st.global_batch_size,
                                inputs.constraints_from(ov)))
        except InfeasibleError as exc:
            raise InvalidError(f"The overrides admit no placement: {exc}") from None
        with self._session() as s:
            records.store_overrides(s, job, ov, actor=actor, reason=reason, at=self._wall())
            s.commit()
        st.overrides, st.last_run = ov, -math.inf
        pid = None
        try:
            self._check_overrides(st, st.shares)
        except InvalidError as exc:
            with self._session() as s:
                self._close_pending(s, job, "superseded", "the overrides changed")
                prop = self._add_proposal(s, st, target, source="override", strategy="override",
                                          actor=actor, reason=f"respect the new overrides: {exc.detail}")
                s.commit()
                pid = prop.id
            if st.mode == "auto":
                await self._apply(job, pid, actor="auto", reason="auto mode: overrides changed", auto=True)
        self._notify(job)
        return {**ov, "proposal_id": pid}


def _explanation_dict(expl: Any) -> dict[str, Any]:
    import dataclasses
    import json

    # JSON round trip: evidence may hold tuples or numbers numpy produced.
    return json.loads(json.dumps(dataclasses.asdict(expl), default=_json_default))


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    return str(o)
