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
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.storage import control as db
from trainer_hook.protocol import Ack, Hello, Placement, Reject, check_shares, uniform_shares

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
    applied: bool = False  # every rank acked the placement in force
    effective: int | None = None  # the batch index it took effect at
    measured: bool = False  # its effect is on record
    busy: bool = False  # a policy run is in flight


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
            ov = s.get(db.OverridesRow, job)
            st = _JobState(
                job=job, world_size=row.world_size, global_batch_size=row.global_batch_size,
                mode=row.mode, policy=dict(row.policy or {}), overrides=_overrides_dict(ov),
                version=pl.version if pl else 0,
                shares=list(pl.shares) if pl else uniform_shares(row.world_size, row.global_batch_size),
                status="idle", status_detail="no ranks connected since the backend started",
            )
            st.last_effect = _last_effect(s, job)
            if pl is not None:
                st.applied = pl.applied_at is not None
                st.effective = pl.effective_batch_index if st.applied else None
                st.measured = pl.step_ms_after is not None
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

    # --- hook events ------------------------------------------------------------------

    async def on_hello(self, hello: Hello) -> Placement:
        """Return the placement in force; a new job gets version 0, the uniform split."""
        job = hello.job
        st = self._load(job)
        with self._session() as s:
            if st is None:
                shares = uniform_shares(hello.world_size, hello.global_batch_size)
                # A job that already runs a version this backend never recorded (its database
                # was replaced) must get a newer one, or the hook would refuse it as stale.
                first = hello.placement_version + 1 if hello.placement_version > 0 else 0
                s.add(db.JobSettingsRow(
                    job=job, world_size=hello.world_size, global_batch_size=hello.global_batch_size,
                    mode=self._setting("default_mode", "approve"), policy={},
                    created_at=self._wall(), updated_at=self._wall(),
                ))
                s.add(db.PlacementRow(
                    job=job, version=first, shares=shares, source="initial", actor=_SYSTEM,
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
        if self._config(st).strategy == "static" and not st.static_checked:
            await self._static_now(st)
        self._notify(job)
        return self._placement_msg(st)

    async def _static_now(self, st: _JobState) -> None:
        """The static strategy needs no measurement: propose its split as soon as every
        rank has said hello (auto mode applies it before the first steps)."""
        live = self.services.live
        if any(live.hello(st.job, r) is None for r in range(st.world_size)):
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
            self._record_acks(s, st, row, {ack.rank: ack.batch_index})
            s.commit()
        self._notify(ack.job)

    def _record_acks(self, s: Any, st: _JobState, row: db.PlacementRow, new: dict[int, int]) -> None:
        acks = dict(row.acks or {})
        for rank, k in new.items():
            # The first ack is the switch; a restarted rank acking again must not rewrite it.
            acks.setdefault(str(rank), k)
        row.acks = acks
        if row.applied_at is None and len(acks) >= st.world_size:
            row.applied_at = self._wall()
            row.effective_batch_index = e = max(acks.values())
            w = int(self._knob(st, "effect_window_steps"))
            row.step_ms_before = self._window_step_ms(st.job, lo=e - w, hi=e - 1)
            if row.proposal_id is not None:
                prop = s.get(db.ProposalRow, row.proposal_id)
                if prop is not None and prop.status == "approved":
                    prop.status = "applied"
        if row.version == st.version and row.applied_at is not None:
            st.applied, st.effective = True, row.effective_batch_index
            st.measured = row.step_ms_after is not None

    def _acks_from_metrics(self, st: _JobState) -> None:
        """Acks lost on the way (say, sent while the backend restarted): every rank's steps
        show the version in force, so take the first batch index each trained under it."""
        if st.applied or st.version == 0:
            return
        live = self.services.live
        view = live.view(st.job)
        if view is None or len(view.ranks) < st.world_size or any(
                r.placement_version is None or r.placement_version < st.version for r in view.ranks):
            return
        first: dict[int, int] = {}
        for rank, rec in live.steps(st.job):
            if rec.placement_version == st.version and rank not in first:
                first[rank] = rec.batch_index
        if len(first) < st.world_size:
            return  # the switch fell out of the buffers; acks that still arrive will do
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
                    st.applied = prev.applied_at is not None
                    st.effective = prev.effective_batch_index if st.applied else None
                    st.measured = True  # do not re-measure (or roll back) the restored one
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

    # --- the policy loop --------------------------------------------------------------

    def _config(self, st: _JobState) -> Any:
        from backend.policy.types import PolicyConfig

        p, g = st.policy, self._setting
        max_move = p.get("max_move_fraction", g("auto_max_move_fraction", 0.25))
        return PolicyConfig(
            strategy=p.get("strategy", g("default_strategy", "profiled")),
            workload=p.get("workload", g("default_workload", "llm")),
            custom_weights=p.get("custom_weights"),
            min_gain=float(p.get("min_gain", g("min_gain", 0.05))),
            cooldown_steps=int(p.get("cooldown_steps", g("cooldown_steps", 20))),
            min_steps=int(p.get("min_steps", g("min_steps", 10))),
            window_steps=int(p.get("window_steps", g("policy_window_steps", 100))),
            # The move cap is an auto-mode guardrail; an operator reviews the full change.
            max_move_fraction=max_move if st.mode == "auto" else None,
            horizon_steps=int(p.get("horizon_steps", 20)),
            params=dict(p.get("params", {})),
        )

    def _knob(self, st: _JobState, name: str) -> Any:
        defaults = {"rollback_threshold": self._setting("rollback_threshold", 0.05),
                    "effect_window_steps": self._setting("effect_window_steps", 20),
                    "proposal_ttl_s": self._setting("proposal_ttl_s", 300.0)}
        return st.policy.get(name, defaults[name])

    def policy_settings(self, job: str) -> dict[str, Any]:
        """Effective policy settings of a job (stored values over the backend defaults)."""
        st = self._require(job)
        cfg = self._config(st)
        return {
            "strategy": cfg.strategy, "workload": cfg.workload, "custom_weights": cfg.custom_weights,
            "min_gain": cfg.min_gain, "cooldown_steps": cfg.cooldown_steps,
            "min_steps": cfg.min_steps, "window_steps": cfg.window_steps,
            "max_move_fraction": st.policy.get("max_move_fraction",
                                               self._setting("auto_max_move_fraction", 0.25)),
            "horizon_steps": cfg.horizon_steps, "params": cfg.params,
            **{k: self._knob(st, k) for k in ("rollback_threshold", "effect_window_steps", "proposal_ttl_s")},
        }

    def _constraints(self, st: _JobState) -> Any:
        """The operator's overrides as policy constraints (``decide`` adds memory caps)."""
        from backend.policy.types import Constraints

        ov = st.overrides
        return Constraints(pins=dict(ov["pins"]), caps=dict(ov["caps"]), floors=dict(ov["floors"]),
                           drains=frozenset(ov["drains"]), granularity=int(ov["granularity"]))

    def _observation(self, st: _JobState) -> Any:
        from backend.policy import normalize_device
        from backend.policy.types import DeviceSignals, JobObservation, RankObservation, StepSample

        live = self.services.live
        view = live.view(st.job)
        if view is None or any(live.hello(st.job, r) is None for r in range(st.world_size)):
            return None
        window = self._config(st).window_steps
        ranks = []
        for r in range(st.world_size):
            h = live.hello(st.job, r)
            steps = live.recent_steps(st.job, r, window)
            dev = live.recent_device(st.job, r, 120)
            ranks.append(RankObservation(
                rank=r,
                device_type=normalize_device(h.device_name or h.device_type, h.mem_total_bytes) if h else None,
                mem_total_bytes=h.mem_total_bytes if h else None,
                steps=tuple(StepSample(s.batch_index, s.local_batch_size, s.compute_ms) for s in steps),
                device=tuple(DeviceSignals(
                    t=d.t, util_pct=d.util_pct, mem_used_bytes=d.mem_used_bytes,
                    mem_total_bytes=d.mem_total_bytes, temp_c=d.temp_c, sm_clock_mhz=d.sm_clock_mhz,
                    sm_clock_max_mhz=d.sm_clock_max_mhz, power_w=d.power_w,
                    throttle_reasons=tuple(d.throttle_reasons)) for d in dev),
            ))
        return JobObservation(
            job=st.job, world_size=st.world_size, global_batch_size=st.global_batch_size,
            batch_index=view.batch_index or 0, shares=tuple(st.shares), placement_version=st.version,
            steps_since_change=max(0, (view.batch_index or 0) - (st.effective or 0)), ranks=tuple(ranks),
        )

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
            st.status, st.status_detail = "proposal_pending", f"waiting for every rank to apply version {st.version}"
            return
        with self._session() as s:
            pending = self._pending(s, st.job)
            if pending is not None and pending.source != "policy":
                return  # an operator's own proposal is not replaced by the policy
        cfg = self._config(st)

        def think() -> Any:
            obs = self._observation(st)
            return None if obs is None else decide(obs, cfg, self._constraints(st))

        if st.busy:
            return
        st.busy, version = True, st.version
        try:
            # Off the event loop: at thousands of ranks building the observation and fitting
            # takes long enough to stall every websocket.
            decision = await asyncio.to_thread(think)
        except InfeasibleError as exc:
            st.status, st.status_detail = "imbalanced", f"the overrides admit no placement: {exc}"
            return
        finally:
            st.busy = False
        if decision is None or st.version != version:
            return  # no data yet, or the placement changed while the policy was thinking
        constraints = self._constraints(st)
        if not isinstance(decision, PolicyProposal):
            st.status = ("warming_up" if decision.status in ("warming_up", "no_data")
                         else "imbalanced" if decision.status == "infeasible" else "balanced")
            st.status_detail = decision.detail
            return
        shares = list(decision.shares)
        if st.mode == "auto" and cfg.max_move_fraction:
            max_move = max(1, int(cfg.max_move_fraction * st.global_batch_size))
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
            blocked = self._refused_before(s, st, shares)
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

    def _refused_before(self, s: Any, st: _JobState, shares: list[int]) -> str | None:
        """Why the same split must not be proposed again (operator rejected it, or it was
        rolled back for making things worse), else None."""
        for p in db.list_proposals(s, st.job, status="rejected", limit=20):
            if list(p.shares) == shares and p.base_version == st.version:
                return f"proposal {p.id} with this split was rejected; the policy waits for a change"
        for row in db.list_placements(s, st.job, limit=20):
            if row.rolled_back and list(row.shares) == shares:
                return f"this split (version {row.version}) was rolled back because it made steps slower"
        return None

    def _add_proposal(self, s: Any, st: _JobState, shares: list[int], *, source: str, strategy: str,
                      actor: Any, reason: str, explanation: dict[str, Any] | None = None,
                      before: float | None = None, after: float | None = None,
                      gain: float | None = None) -> db.ProposalRow:
        if before is None:
            before, after = self._predict(st, st.shares), self._predict(st, shares)
            if before and after is not None:
                gain = (before - after) / before
        now = self._wall()
        row = db.ProposalRow(
            job=st.job, status="proposed", source=source, strategy=strategy, base_version=st.version,
            shares=list(shares), current_shares=list(st.shares), predicted_step_ms_before=before,
            predicted_step_ms_after=after, predicted_gain=gain, explanation=explanation,
            reason=reason, created_by=_actor_name(actor), created_at=now,
            expires_at=now + float(self._knob(st, "proposal_ttl_s")),
        )
        s.add(row)
        s.flush()
        return row

    def _costs(self, st: _JobState) -> list[float] | None:
        """Per-sample compute cost of each rank (median of recent steps), None without data."""
        live = getattr(self.services, "live", None)
        if live is None:
            return None
        out = []
        for r in range(st.world_size):
            per = [s.compute_ms / s.local_batch_size
                   for s in live.recent_steps(st.job, r, 50) if s.local_batch_size > 0]
            if not per:
                return None
            out.append(_median(per))
        return out

    def _predict(self, st: _JobState, shares: Sequence[int]) -> float | None:
        costs = self._costs(st)
        return max(c * b for c, b in zip(costs, shares, strict=True)) if costs else None

    # --- effect and rollback -------------------------------------------------------------

    def _window_step_ms(self, job: str, *, lo: int, hi: int, need: int = 1) -> float | None:
        """Mean over batch indices lo..hi of the median step time across ranks."""
        live = getattr(self.services, "live", None)
        if live is None or hi < lo:
            return None
        by_index: dict[int, list[float]] = {}
        for _rank, rec in live.steps(job, batch_from=max(0, lo), batch_to=hi):
            by_index.setdefault(rec.batch_index, []).append(rec.step_ms)
        if len(by_index) < need:
            return None
        return sum(_median(v) for v in by_index.values()) / len(by_index)

    async def _measure_effect(self, st: _JobState) -> None:
        if not st.applied or st.effective is None or st.measured:
            return
        w = int(self._knob(st, "effect_window_steps"))
        settle = 2  # the first steps after a switch pay one-off costs (new shapes, caches)
        lo, hi = st.effective + settle, st.effective + settle + w - 1
        view = self.services.live.view(st.job)
        if view is None or view.batch_index is None or view.batch_index < hi:
            return
        after = self._window_step_ms(st.job, lo=lo, hi=hi, need=max(1, w // 2))
        rollback = None
        with self._session() as s:
            row = db.get_placement(s, st.job, st.version)
            if row is None or after is None:
                return
            row.step_ms_after = after
            if row.step_ms_before:
                row.measured_gain = (row.step_ms_before - after) / row.step_ms_before
            thr = float(self._knob(st, "rollback_threshold"))
            worse = row.step_ms_before is not None and after > row.step_ms_before * (1 + thr)
            if worse and row.auto and st.mode == "auto" and row.previous_shares is not None:
                row.rolled_back = True
                rollback = (list(row.previous_shares),
                            f"measured step time rose from {row.step_ms_before:.1f} ms to {after:.1f} ms "
                            f"after version {row.version}; rolling back")
            st.measured = True
            st.last_effect = {"version": row.version, **row.public()["effect"]}
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
            prop = db.get_proposal(s, job, proposal_id)
            if prop is None:
                raise NotFoundError(f"Proposal {proposal_id} not found for job '{job}'.")
            if prop.status != "proposed":
                raise ConflictError(f"Proposal {proposal_id} is {prop.status}; only a proposed one can be approved.")
            if st.mode == "observe":
                raise ConflictError(f"Job '{job}' is in observe mode; set the mode to approve or auto to apply proposals.")
            if prop.base_version != st.version:
                prop.status, prop.decided_at = "expired", self._wall()
                prop.decision_reason = f"placement version {st.version} came into force"
                s.commit()
                raise ConflictError(
                    f"Proposal {proposal_id} was computed against placement version {prop.base_version} "
                    f"but version {st.version} is in force; refresh.")
            if prop.expires_at is not None and self._wall() > prop.expires_at:
                prop.status, prop.decided_at, prop.decision_reason = "expired", self._wall(), "older than its TTL"
                s.commit()
                raise ConflictError(f"Proposal {proposal_id} expired; refresh.")
            shares = list(prop.shares)
            try:
                check_shares(shares, world_size=st.world_size, global_batch_size=st.global_batch_size)
                self._check_overrides(st, shares)
            except (ValueError, InvalidError) as exc:
                raise ConflictError(f"Proposal {proposal_id} no longer fits: {_detail(exc)} Refresh.") from None
            row = self._new_placement(
                s, st, shares, source="auto" if auto else prop.source, actor=actor,
                reason=reason or prop.reason, proposal_id=prop.id, auto=auto,
                predicted_step_ms=prop.predicted_step_ms_after)
            prop.status, prop.decided_by, prop.decided_at = "approved", _actor_name(actor), self._wall()
            prop.decision_reason, prop.placement_version = reason or "", row.version
            self._close_pending(s, job, "superseded", f"proposal {prop.id} was approved", keep=prop.id)
            db.record_audit(s, actor=actor, action="proposal.auto_apply" if auto else "proposal.approve",
                            job=job, params={"proposal_id": prop.id, "version": row.version,
                                             "shares": shares}, reason=reason)
            s.commit()
            out = prop.public()
        self._reset_applied(st)
        st.status, st.status_detail = "proposal_pending", f"waiting for every rank to apply version {st.version}"
        await self._send(job, self._placement_msg(st, proposal_id=proposal_id, reason=out["reason"]))
        self._notify(job)
        return out

    async def approve(self, job: str, proposal_id: int, *, actor: Any, reason: str | None = None) -> dict[str, Any]:
        """Send exactly the reviewed shares as the next placement version."""
        return await self._apply(job, proposal_id, actor=actor, reason=reason)

    async def reject(self, job: str, proposal_id: int, *, actor: Any, reason: str | None = None) -> dict[str, Any]:
        st = self._require(job)
        with self._session() as s:
            prop = db.get_proposal(s, job, proposal_id)
            if prop is None:
                raise NotFoundError(f"Proposal {proposal_id} not found for job '{job}'.")
            if prop.status != "proposed":
                raise ConflictError(f"Proposal {proposal_id} is {prop.status}; only a proposed one can be rejected.")
            prop.status, prop.decided_by, prop.decided_at = "rejected", _actor_name(actor), self._wall()
            prop.decision_reason = reason or ""
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
                _check_policy_value(key, value, available_strategies())
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
        from backend.policy.types import Constraints

        st = self._require(job)
        ov = self._validate_overrides(st, overrides)
        try:
            probe = Constraints(pins=ov["pins"], caps=ov["caps"], floors=ov["floors"],
                                drains=frozenset(ov["drains"]), granularity=ov["granularity"])
            costs = self._costs(st) or [1.0] * st.world_size
            target = list(solve([0.0] * st.world_size, costs, st.global_batch_size, probe))
        except InfeasibleError as exc:
            raise InvalidError(f"The overrides admit no placement: {exc}") from None
        with self._session() as s:
            row = s.get(db.OverridesRow, job) or db.OverridesRow(job=job)
            row.pins = {str(k): v for k, v in ov["pins"].items()}
            row.caps = {str(k): v for k, v in ov["caps"].items()}
            row.floors = {str(k): v for k, v in ov["floors"].items()}
            row.drains, row.granularity = list(ov["drains"]), ov["granularity"]
            row.actor, row.reason, row.updated_at = _actor_name(actor), reason or "", self._wall()
            s.add(row)
            db.record_audit(s, actor=actor, action="job.overrides", job=job,
                            params={k: ov[k] for k in ("pins", "caps", "floors", "drains", "granularity")},
                            reason=reason)
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

    def _validate_overrides(self, st: _JobState, o: dict[str, Any]) -> dict[str, Any]:
        n, b = st.world_size, st.global_batch_size

        def rank(r: Any, what: str) -> int:
            try:
                r = int(r)
            except (TypeError, ValueError):
                raise InvalidError(f"{what} keys must be rank numbers, got {r!r}.") from None
            if not 0 <= r < n:
                raise InvalidError(f"{what} names rank {r} but the job has ranks 0 to {n - 1}.")
            return r

        out: dict[str, Any] = {}
        for key in ("pins", "caps", "floors"):
            m = {}
            for r, v in (o.get(key) or {}).items():
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= b:
                    raise InvalidError(f"{key}[{r}] must be an integer between 0 and {b}, got {v!r}.")
                m[rank(r, key)] = v
            out[key] = m
        out["drains"] = sorted({rank(r, "drains") for r in (o.get("drains") or [])})
        g = o.get("granularity", 1)
        if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= b:
            raise InvalidError(f"granularity must be an integer between 1 and {b}, got {g!r}.")
        out["granularity"] = g
        both = sorted(set(out["pins"]) & set(out["drains"]))
        if both:
            raise InvalidError(f"Rank {both[0]} is both pinned and drained; choose one.")
        return out

    def _check_overrides(self, st: _JobState, shares: Sequence[int]) -> None:
        """Raise InvalidError naming the first override that ``shares`` breaks."""
        ov, g = st.overrides, st.overrides["granularity"]
        for r, v in ov["pins"].items():
            if shares[r] != v:
                raise InvalidError(f"Placement breaks the overrides: rank {r} is pinned to {v} samples but gets {shares[r]}.")
        for r in ov["drains"]:
            if shares[r] != 0:
                raise InvalidError(f"Placement breaks the overrides: rank {r} is drained but gets {shares[r]} samples.")
        for r, v in ov["caps"].items():
            if shares[r] > v:
                raise InvalidError(f"Placement breaks the overrides: rank {r} is capped at {v} samples but gets {shares[r]}.")
        for r, v in ov["floors"].items():
            if shares[r] < v:
                raise InvalidError(f"Placement breaks the overrides: rank {r} needs at least {v} samples but gets {shares[r]}.")
        if g > 1:
            fixed = set(ov["pins"]) | set(ov["drains"])
            off = [r for r, v in enumerate(shares) if r not in fixed and v % g]
            # When B is no multiple of g one rank must carry the remainder.
            if len(off) > (1 if st.global_batch_size % g else 0):
                raise InvalidError(f"Placement breaks the overrides: rank {off[0]} gets {shares[off[0]]} samples, not a multiple of the granularity {g}.")

    # --- housekeeping -------------------------------------------------------------------

    def expire_proposals(self) -> int:
        """Mark proposals older than their TTL expired; returns how many."""
        from sqlalchemy import select

        now = self._wall()
        with self._session() as s:
            rows = s.scalars(select(db.ProposalRow).where(
                db.ProposalRow.status == "proposed", db.ProposalRow.expires_at < now)).all()
            for p in rows:
                p.status, p.decided_at, p.decision_reason = "expired", now, "older than its TTL"
            s.commit()
            jobs = {p.job for p in rows}
        for job in jobs:
            self._notify(job)
        return len(rows)

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


# Policy settings an admin may change: (kind, lowest, highest).
_POLICY_NUMBERS: dict[str, tuple[type, float, float]] = {
    "min_gain": (float, 0.0, 0.99),
    "cooldown_steps": (int, 0, 1_000_000),
    "min_steps": (int, 1, 1_000_000),
    "window_steps": (int, 2, 100_000),
    "max_move_fraction": (float, 0.001, 1.0),
    "horizon_steps": (int, 1, 100_000),
    "rollback_threshold": (float, 0.0, 1.0),
    "effect_window_steps": (int, 2, 10_000),
    "proposal_ttl_s": (float, 1.0, 7 * 86400.0),
}
_WORKLOADS = ("llm", "vision", "diffusion", "recsys", "custom")


def _check_policy_value(key: str, v: Any, strategies: Sequence[str]) -> None:
    """Raise InvalidError saying what a policy setting must be."""
    if key == "strategy":
        if v not in strategies:
            raise InvalidError(f"Unknown strategy {v!r}; choose one of {', '.join(strategies)}.")
    elif key == "workload":
        if v not in _WORKLOADS:
            raise InvalidError(f"workload must be one of {', '.join(_WORKLOADS)}; got {v!r}.")
    elif key in ("custom_weights", "params"):
        ok = isinstance(v, dict) and all(
            isinstance(k, str) and _is_number(x) and (key == "params" or x > 0) for k, x in v.items())
        if not ok:
            what = "device types to weights > 0" if key == "custom_weights" else "names to numbers"
            raise InvalidError(f"{key} must map {what}, got {v!r}.")
    elif key in _POLICY_NUMBERS:
        kind, lo, hi = _POLICY_NUMBERS[key]
        fits = isinstance(v, int) if kind is int else _is_number(v)
        if isinstance(v, bool) or not fits or not lo <= v <= hi:
            noun = "an integer" if kind is int else "a number"
            raise InvalidError(f"{key} must be {noun} between {_num(lo)} and {_num(hi)}, got {v!r}.")
    else:
        known = ", ".join(["strategy", "workload", "custom_weights", "params", *_POLICY_NUMBERS])
        raise InvalidError(f"Unknown policy setting {key!r}; known settings: {known}.")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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


def _detail(exc: Exception) -> str:
    return exc.detail if isinstance(exc, ControlError) else str(exc)


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


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))
