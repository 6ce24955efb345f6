"""The control loop: modes, proposal lifecycle, guardrails, rollback and measured effect.

The policy (``backend.policy``) only decides; this module acts on its decisions. The event
loop owns each job's control state (``_JobState``); SQL (``backend.storage.control``) holds
the truth, so a restarted backend resumes where it stopped, and is reached only through the
``SqlGateway`` thread. Each change publishes a snapshot of the job's control state
(``job_control``), which the jobs routes, the dashboard hub and ``/metrics`` read without
touching SQL. One job's actions run one at a time (a lock per job).

Policy runs are scheduled like the hub's ticks: ``on_metrics`` adds the job to a dirty set
and a ticker starts a run for each dirty job that is due (every frame while it warms up,
then at most every ``policy_min_interval_s`` and never faster than five times the last
run's cost); the decision itself runs in the ``PolicyRunner`` (a process of its own).

What the policy is handed and the checks on operator settings are in
``backend.control.inputs``; measured effect and the rollback decision in
``backend.control.effect``; the status rule in ``backend.control.status``; the errors in
``backend.control.errors`` (re-exported here).

Modes: ``observe`` (proposals are shown, never sent), ``approve`` (they wait for an
operator), ``auto`` (applied under guardrails: the policy's cap on how far one change moves
a rank, its cooldown, and rollback when the measured step time got worse).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy.orm import Session

from backend.auth.tokens import Actor
from backend.control import effect, inputs, records
from backend.control.errors import (
    ConflictError,
    ControlError,
    InvalidError,
    NotFoundError,
    StateError,
    error_detail,
)
from backend.control.models import check_policy_changes
from backend.control.policy_runs import PolicyRunner
from backend.control.status import job_status
from backend.ingest.connections import HookConnections
from backend.live.state import LiveState
from backend.settings import Settings
from backend.storage import control as db
from backend.storage.gateway import SqlGateway
from backend.storage.health import log_failure
from trainer_hook.protocol import Ack, Hello, Oom, Placement, Reject, check_shares, uniform_shares

if TYPE_CHECKING:
    from backend.policy.types import Explanation

__all__ = ["Controller", "ControlError", "NotFoundError", "ConflictError", "InvalidError", "MODES"]

log = logging.getLogger(__name__)

MODES = ("observe", "approve", "auto")
# How long an action waits for a job whose first hello is being stored (``expect``).
ARRIVAL_WAIT_S = 5.0
_SYSTEM = "controller"
T = TypeVar("T")
ActorLike = Actor | str


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
    status: str = "warming_up"  # the controller's verdict; job_status() adds the rest
    status_detail: str = "waiting for the first steps"
    last_run: float = -math.inf
    last_metrics: float | None = None  # wall time of the newest metrics or hello
    devices: dict[int, Hello] = field(default_factory=dict)
    last_effect: dict[str, Any] | None = None
    static_checked: bool = False
    applied: bool = False  # every rank acked the placement in force
    effective: int | None = None  # the batch index it took effect at
    measured: bool = False  # its effect is on record
    think_s: float = 0.0  # how long the last policy run took (wall clock)
    pending: dict[str, Any] | None = None  # the pending proposal (public form)
    # Recent rolled-back policy changes: (batch index, shares before, shares undone).
    rollbacks: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    urgent: bool = False  # an urgent metrics frame came since the last policy run
    counts: dict[str, int] = field(default_factory=dict)  # proposals by status
    # proposals and placements by source, rejected placements (db.activity_counts)
    activity: dict[str, dict[str, int]] = field(default_factory=dict)
    snapshot: dict[str, Any] = field(default_factory=dict)
    cost_fit: tuple[tuple[float, ...], tuple[float, ...]] | None = None  # the policy's, per rank
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    restart_count: int | None = None  # TorchElastic attempt of the ranks (None: none seen since load)

    def follow(self, row: db.PlacementRow) -> None:
        """Take applied / effective / measured from the placement row in force."""
        self.applied = row.applied_at is not None
        self.effective = row.effective_batch_index if self.applied else None
        self.measured = row.step_ms_after is not None

    def waiting_detail(self) -> str:
        return f"waiting for every rank to apply version {self.version}"


class Controller:
    """Runs the control loop of every job. ``notify(job)`` tells the dashboard a job changed."""

    def __init__(self, *, settings: Settings, sql: SqlGateway, live: LiveState,
                 connections: HookConnections, notify: Callable[[str], None],
                 policy: PolicyRunner, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.settings = settings
        self.sql = sql
        self.live = live
        self.connections = connections
        self._notify_hub = notify
        self.policy = policy
        self._clock = clock
        self._wall = wall
        self._jobs: dict[str, _JobState] = {}
        self._dirty: set[str] = set()
        self._running: dict[str, asyncio.Task[None]] = {}
        self._loading: dict[str, asyncio.Future[_JobState | None]] = {}
        self._creating: dict[str, asyncio.Future[None]] = {}
        # Jobs a rank said hello for whose control state is not made yet (``expect``):
        # actions on them wait up to ``arrival_wait_s`` for ``on_hello`` instead of a 404.
        self._arrivals: dict[str, asyncio.Event] = {}
        self.arrival_wait_s = ARRIVAL_WAIT_S
        self._tasks: list[asyncio.Task[None]] = []
        self.policy_runs = 0

    # --- plumbing ---------------------------------------------------------------------

    async def _sql(self, fn: Callable[[Session], T]) -> T:
        return await self.sql.run(fn)

    def _publish(self, st: _JobState) -> None:
        """Refresh the job's snapshot (what job_control serves) and tell the dashboard."""
        st.snapshot = {
            "mode": st.mode,
            "strategy": self._config(st).strategy,
            "policy": inputs.policy_settings(st.policy, st.mode, self.settings),
            "overrides": dict(st.overrides),
            "placement": {"version": st.version, "shares": list(st.shares)},
            "pending_proposal": st.pending,
            "pending_proposal_id": st.pending["id"] if st.pending else None,
            "verdict": st.status,
            "verdict_detail": st.status_detail,
            "last_effect": st.last_effect,
            "last_metrics": st.last_metrics,
        }
        with contextlib.suppress(Exception):  # the dashboard is never worth a failed action
            self._notify_hub(st.job)

    async def _send(self, job: str, msg: Placement) -> None:
        try:
            await self.connections.send(job, msg)
        except Exception:  # a dead socket must not undo a recorded decision; hello resyncs
            log.exception("sending placement %s of job %s failed", msg.version, job)

    async def start(self) -> None:
        """Load every known job, then start the policy ticker and the expiry tick."""
        if self._tasks:
            return
        names = await self._sql(lambda s: [r.name for r in db.list_settings(s)])
        for job in names:
            await self._load(job)
        self._tasks = [
            asyncio.create_task(self._policy_loop(), name="rebalancer-policy"),
            asyncio.create_task(self._tick_loop(), name="rebalancer-controller"),
        ]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._running.values()]
        self._tasks, self._running = [], {}
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.policy.close()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.controller_tick_s)
            try:
                await self.expire_proposals()
            except Exception as exc:
                log_failure(log, "the controller tick", exc)

    async def _policy_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.policy_tick_s)
            try:
                self._start_due()
            except Exception:
                log.exception("scheduling policy runs failed")

    # --- job state ----------------------------------------------------------------------

    async def _load(self, job: str) -> _JobState | None:
        st = self._jobs.get(job)
        if st is not None:
            return st
        # Every rank of a new job says hello at once: one read from SQL, the others wait on it.
        pending = self._loading.get(job)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[_JobState | None] = asyncio.get_running_loop().create_future()
        self._loading[job] = fut
        try:
            st = await self._load_from_sql(job)
            fut.set_result(st)
            return st
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters get it, nobody else must
            raise
        finally:
            del self._loading[job]

    async def _load_from_sql(self, job: str) -> _JobState | None:

        def read(s: Session) -> _JobState | None:
            row = db.get_settings(s, job)
            if row is None:
                return None
            pl = db.latest_placement(s, job)
            st = _JobState(
                job=job, world_size=row.world_size, global_batch_size=row.global_batch_size,
                mode=row.mode or self.settings.default_mode, policy=dict(row.policy or {}),
                overrides=inputs.overrides_dict(s.get(db.OverridesRow, job)),
                version=pl.version if pl else 0,
                shares=list(pl.shares) if pl else uniform_shares(row.world_size, row.global_batch_size),
                status="idle", status_detail="no ranks connected since the backend started",
            )
            st.last_effect = records.last_effect(s, job)
            if pl is not None:
                st.follow(pl)
            self._read_facts(s, st)
            return st

        loaded = await self._sql(read)
        if loaded is None:
            return None
        st = self._jobs.setdefault(job, loaded)
        if st is loaded:
            self._publish(st)
        return st

    def _read_facts(self, s: Session, st: _JobState) -> None:
        """Pending proposal and counts by status, read after every change (gateway thread)."""
        pending = records.pending_proposal(s, st.job)
        st.pending = pending.public() if pending is not None else None
        st.counts = db.proposal_counts(s, st.job)
        st.rollbacks = records.recent_rollbacks(s, st.job)
        st.activity = db.activity_counts(s, st.job)

    async def _require(self, job: str) -> _JobState:
        st = await self._load(job)
        if st is None and (arriving := self._arrivals.get(job)) is not None:
            # Live state lists the job already (GET /jobs shows it); its hello is being stored.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arriving.wait(), self.arrival_wait_s)
            st = await self._load(job)
        if st is None:
            raise NotFoundError(f"Job '{job}' not found.")
        return st

    def expect(self, job: str) -> None:
        """A rank of ``job`` said hello (ingest, beside ``LiveState.register``): until
        ``on_hello`` has made the job's control state, actions on it wait for it."""
        if job not in self._jobs:
            self._arrivals.setdefault(job, asyncio.Event())

    def _arrived(self, job: str) -> None:
        if (arriving := self._arrivals.pop(job, None)) is not None:
            arriving.set()

    def known(self, job: str) -> bool:
        """True when the job has control state in memory (it said hello at least once)."""
        return job in self._jobs

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def forget(self, job: str) -> bool:
        """Drop a job's control state from memory (SQL keeps it; the next hello or read
        loads it again). False while an action or a policy run holds it: try later."""
        st = self._jobs.get(job)
        if st is None:
            return True
        if st.lock.locked() or job in self._running:
            return False
        del self._jobs[job]
        self._dirty.discard(job)
        self._arrivals.pop(job, None)
        return True

    def _config(self, st: _JobState) -> Any:
        return inputs.policy_config(st.policy, st.mode, self.settings)

    def _knob(self, st: _JobState, name: str) -> Any:
        return inputs.knob(st.policy, self.settings, name)

    def _check_overrides(self, st: _JobState, shares: Sequence[int]) -> None:
        inputs.check_overrides(st.overrides, shares, global_batch_size=st.global_batch_size)

    def _memory_constraints(self, st: _JobState, overrides: dict[str, Any]) -> Any:
        return inputs.memory_constraints(self.live, st.job, overrides, st.shares, st.global_batch_size,
                                         self._config(st).memory_headroom)

    def _costs(self, st: _JobState) -> list[float] | None:
        return inputs.step_costs(self.live, st.job, st.world_size)

    # --- hook events ------------------------------------------------------------------

    async def on_hello(self, hello: Hello) -> Placement:
        """Return the placement in force; a new job gets version 0, the uniform split."""
        job = hello.job
        st = await self._load(job)
        if st is None:
            mode = self.settings.default_mode

            def create(s: Session) -> None:
                if db.get_settings(s, job) is None:  # another rank's hello got there first
                    records.create_job(s, hello, mode=mode, actor=_SYSTEM, at=self._wall())
                    s.commit()

            if job not in self._creating:
                self._creating[job] = asyncio.ensure_future(self._sql(create))
            try:
                await asyncio.shield(self._creating[job])
            finally:
                self._creating.pop(job, None)
            st = await self._require(job)
        self._arrived(job)
        async with st.lock:
            previous = st.restart_count
            if (hello.world_size, hello.global_batch_size) != (st.world_size, st.global_batch_size):
                st = await self._reshape(st, hello)
            # Under the lock: the ranks of one restarted attempt say hello together, and
            # only the first of them may see (and audit) the restart.
            self._follow_restarts(st, hello, previous)
        if previous is not None and hello.restart_count > previous:
            await self._sql(_audit_restart(hello, previous))
        async with st.lock:
            st.devices[hello.rank] = hello
            st.last_metrics = self._wall()
            if st.status == "idle":
                st.status, st.status_detail = "warming_up", "waiting for the first steps"
            if self._config(st).strategy == "static" and not st.static_checked:
                await self._static_now(st)
            self._publish(st)
            return self._placement_msg(st)

    def _follow_restarts(self, st: _JobState, hello: Hello, previous: int | None) -> None:
        """Track the ranks' TorchElastic attempt: a higher count is a restart (audited by
        on_hello); a lower one, with no other rank connected, a new launch of the job."""
        known = st.restart_count if st.restart_count is not None else previous
        alone = not [r for r in self.connections.ranks(st.job) if r != hello.rank]
        if known is None or hello.restart_count > known or alone:
            st.restart_count = hello.restart_count
        else:
            st.restart_count = known

    async def _reshape(self, st: _JobState, hello: Hello) -> _JobState:
        """The job came back with another shape: old placements cannot apply."""
        job = st.job
        reason = (f"job restarted with world_size {hello.world_size} and global batch "
                  f"{hello.global_batch_size} (was {st.world_size} and {st.global_batch_size})")

        def work(s: Session) -> None:
            row = db.get_settings(s, job)
            assert row is not None
            row.world_size, row.global_batch_size = hello.world_size, hello.global_batch_size
            row.updated_at = self._wall()
            self._close_pending(s, job, "superseded", reason)
            records.new_placement(
                s, job, uniform_shares(hello.world_size, hello.global_batch_size), source="initial",
                actor=_SYSTEM, reason=reason, at=self._wall(), current=None)
            db.record_audit(s, actor=_SYSTEM, action="job.reshape", job=job,
                            params={"world_size": hello.world_size,
                                    "global_batch_size": hello.global_batch_size}, reason=reason)
            s.commit()

        await self._sql(work)
        self._jobs.pop(job, None)
        return await self._require(job)

    async def _static_now(self, st: _JobState) -> None:
        """The static strategy needs no measurement: propose its split as soon as every
        rank has said hello (auto mode applies it before the first steps)."""
        if not inputs.all_said_hello(self.live, st.job, st.world_size):
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

    def on_metrics(self, job: str, *, urgent: bool = False) -> None:
        """New metrics for ``job``: the next policy tick runs the policy when it is due.
        An ``urgent`` frame (a rank's step far off its recent median: a slowdown) makes it
        due at once, as during the warm-up: the answer to a slowdown should not wait out
        ``policy_min_interval_s``."""
        st = self._jobs.get(job)
        if st is None:
            return
        st.last_metrics = self._wall()
        st.urgent = st.urgent or urgent
        self._dirty.add(job)

    def _due(self, st: _JobState, now: float) -> bool:
        # While a job warms up, on every frame (the first proposal follows the last rank's
        # readiness steps at once); then at most every policy_min_interval_s. At thousands
        # of ranks a run costs a good fraction of a second: spacing runs by five times
        # their cost keeps the policy worker under a fifth of a core.
        warming = st.status == "warming_up" or st.urgent
        spacing = max(0.0 if warming else self.settings.policy_min_interval_s, 5.0 * st.think_s)
        return now - st.last_run >= spacing

    def _start_due(self) -> list[asyncio.Task[None]]:
        """Start a run for every dirty job that is due and not already running."""
        now = self._clock()
        started = []
        for job in list(self._dirty):
            st = self._jobs.get(job)
            if st is None:
                self._dirty.discard(job)
                continue
            if job in self._running or not self._due(st, now):
                continue  # stays dirty: a frame that landed during a run gets its own run
            self._dirty.discard(job)
            st.last_run, st.urgent = now, False
            task = asyncio.create_task(self._policy_task(st), name=f"rebalancer-policy-{job}")
            self._running[job] = task
            started.append(task)
        return started

    async def run_due(self) -> int:
        """Start the due policy runs and wait for them (what one ticker step does, awaited)."""
        tasks = self._start_due()
        if tasks:
            await asyncio.gather(*tasks)
        return len(tasks)

    async def _policy_task(self, st: _JobState) -> None:
        try:
            async with st.lock:
                await self._run_policy(st)
        except Exception as exc:  # a policy bug must not take ingest down with it
            if isinstance(exc, ConflictError) and self.live.ended(st.job):
                return  # the run ended under it (an auto rollback refused): nothing failed
            log_failure(log, f"the policy run for job {st.job}", exc)
            st.status_detail = "the policy failed; see the backend log"
            self._publish(st)
        finally:
            self._running.pop(st.job, None)

    async def on_ack(self, ack: Ack) -> None:
        """Record the batch index at which a rank applied a version; all acked -> applied."""
        st = await self._load(ack.job)
        if st is None:
            return
        async with st.lock:
            live = self.live

            def work(s: Session) -> bool:
                row = db.get_placement(s, ack.job, ack.version)
                if row is None:
                    return False
                self._record_acks(s, st, row, {ack.rank: ack.batch_index}, live)
                s.commit()
                self._read_facts(s, st)
                return True

            if not await self._sql(work):
                log.warning("ack for unknown placement %s of job %s", ack.version, ack.job)
                return
            self._publish(st)

    def _record_acks(self, s: Session, st: _JobState, row: db.PlacementRow, new: dict[int, int],
                     live: LiveState) -> None:
        row.acks = acks = effect.merge_acks(row.acks, new)
        if row.applied_at is None and len(acks) >= st.world_size:
            row.applied_at = self._wall()
            row.effective_batch_index = e = max(acks.values())
            lo, hi = effect.before_window(e, int(self._knob(st, "effect_window_steps")))
            row.step_ms_before = effect.window_step_ms(live, st.job, lo=lo, hi=hi)
            if row.proposal_id is not None:
                prop = s.get(db.ProposalRow, row.proposal_id)
                if prop is not None and prop.status == "approved":
                    prop.status = "applied"
        if row.version == st.version and row.applied_at is not None:
            st.follow(row)

    async def run_ended(self, job: str) -> None:
        """Every rank of ``job`` said goodbye: wait for a policy run or an operator's action
        in flight (the job's lock), then record the acks its last metrics carried, so that
        the report built next sees every placement and when each took effect."""
        st = self._jobs.get(job)
        if st is None:
            return
        async with st.lock:
            await self._acks_from_metrics(st)

    async def _acks_from_metrics(self, st: _JobState) -> None:
        """Acks lost on the way (say, sent while the backend restarted): every rank's steps
        show the version in force, so take the first batch index each trained under it."""
        if st.applied or st.version == 0:
            return
        first = effect.first_batches_under(self.live, st.job, st.world_size, st.version)
        if first is None:
            return  # not every rank shows it yet; or the switch fell out of the buffers
        live = self.live

        def work(s: Session) -> None:
            row = db.get_placement(s, st.job, st.version)
            if row is not None:
                missing = {r: k for r, k in first.items() if str(r) not in (row.acks or {})}
                self._record_acks(s, st, row, missing, live)
                s.commit()
                self._read_facts(s, st)

        await self._sql(work)

    async def on_oom(self, oom: Oom) -> None:
        """A rank ran out of memory: mark the placement it trained under unsafe, never give
        that rank as many samples again (a cap in the overrides, audited), and roll the job
        back to the previous placement, which its next run (a restart) receives."""

        st = await self._load(oom.job)
        if st is None or not 0 <= oom.rank < st.world_size:
            return
        ceiling = max(0, oom.local_batch_size - 1)
        why = (f"rank {oom.rank} ran out of memory at {oom.local_batch_size} samples under "
               f"placement version {oom.version}")
        async with st.lock:
            ov = {**st.overrides, "caps": dict(st.overrides["caps"])}
            ov["caps"][oom.rank] = min(ceiling, ov["caps"].get(oom.rank, ceiling))

            def work(s: Session) -> list[int] | None:
                previous: list[int] | None = None
                row = db.get_placement(s, oom.job, oom.version)
                if row is not None:
                    if not row.failed:
                        row.failed, row.error = True, f"unsafe: {why}"
                    if row.previous_shares is not None and len(row.previous_shares) == st.world_size:
                        previous = list(row.previous_shares)
                db.record_audit(s, actor=_SYSTEM, action="placement.oom", job=oom.job,
                                params={"version": oom.version, "rank": oom.rank,
                                        "local_batch_size": oom.local_batch_size,
                                        "batch_index": oom.batch_index,
                                        "mem_peak_bytes": oom.mem_peak_bytes,
                                        "mem_total_bytes": oom.mem_total_bytes, "cap": ceiling},
                                reason=oom.message[:500] or why)
                records.store_overrides(s, oom.job, ov, actor=_SYSTEM,
                                        reason=f"{why}: capped at {ceiling}", at=self._wall())
                s.commit()
                self._read_facts(s, st)
                return previous

            previous = await self._sql(work)
            st.overrides, st.last_run = ov, -math.inf
            st.status, st.status_detail = "imbalanced", why
            self._dirty.add(oom.job)
            target = self._oom_target(st, oom, previous)
            if isinstance(target, str):
                st.status_detail = f"{why}; {target}"
            elif target is not None and target != st.shares:
                await self._issue(st, target, source="rollback", actor=_SYSTEM,
                                  reason=f"{why}; rolled back for the next run",
                                  action="placement.oom_rollback", params={"from_version": oom.version})
            self._publish(st)

    def _oom_target(self, st: _JobState, oom: Oom, previous: list[int] | None) -> list[int] | str | None:
        """Where an out-of-memory error sends the job: the previous placement when it fits
        the new cap, else the placement in force if that fits, else a solve under the
        overrides; a sentence when the overrides admit none."""
        from backend.policy import InfeasibleError, solve

        for shares in ([previous] if oom.version == st.version and previous is not None else []) + [st.shares]:
            try:
                self._check_overrides(st, shares)
                return shares
            except InvalidError:
                continue
        try:
            costs = self._costs(st) or [1.0] * st.world_size
            return list(solve([0.0] * st.world_size, costs, st.global_batch_size,
                              self._memory_constraints(st, st.overrides)))
        except InfeasibleError as exc:
            return f"the overrides admit no placement: {exc}"

    async def on_reject(self, reject: Reject) -> None:
        """A rank refused a placement: mark it and its proposal failed, with the reason."""
        st = await self._load(reject.job)
        if st is None:
            return
        async with st.lock:
            def work(s: Session) -> None:
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
                self._read_facts(s, st)

            await self._sql(work)
            self._publish(st)

    # --- reading (memory only: no SQL) ------------------------------------------------------

    def job_control(self, job: str) -> dict[str, Any]:
        """Control state of a job for the job resource, the dashboard and /metrics ({} if
        unknown): the snapshot the last change published, with the status rule applied."""
        st = self._jobs.get(job)
        if st is None:
            return {}
        snap = st.snapshot
        view = self.live.view(job)
        age = None if st.last_metrics is None else max(self._wall() - st.last_metrics, 0.0)
        status, detail = job_status(
            verdict=st.status, detail=st.status_detail, pending=snap["pending_proposal"],
            connected_ranks=view.connected_ranks if view is not None else None,
            metrics_age_s=age, stale_after_s=self.settings.stale_after_s,
            lost_ranks=view.lost_ranks if view is not None else (), world_size=st.world_size)
        return {**snap, "status": status, "status_detail": detail}

    def cost_fit(self, job: str) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """Per-rank (a_ms, c_ms) from the policy's last decision that fitted the job (the
        one per-rank cost fit; the dashboard's uniform-split estimate uses it)."""
        st = self._jobs.get(job)
        return st.cost_fit if st is not None else None

    def proposal_counts(self, job: str) -> dict[str, int]:
        """Proposals of ``job`` by status, for Prometheus ({} if unknown)."""
        st = self._jobs.get(job)
        return dict(st.counts) if st is not None else {}

    def activity_counts(self, job: str) -> dict[str, dict[str, int]]:
        """Proposals and placements of ``job`` by source, and placements a hook rejected,
        counted from the stored rows after every change: Prometheus counters that survive a
        restart ({} if unknown)."""
        st = self._jobs.get(job)
        return {k: dict(v) for k, v in st.activity.items()} if st is not None else {}

    async def policy_settings(self, job: str) -> dict[str, Any]:
        """Effective policy settings of a job (stored values over the backend defaults)."""
        st = await self._require(job)
        return inputs.policy_settings(st.policy, st.mode, self.settings)

    async def overrides(self, job: str) -> dict[str, Any]:
        """The overrides in force for ``job``."""
        return dict((await self._require(job)).overrides)

    async def placements(self, job: str, limit: int = 100) -> list[dict[str, Any]]:
        await self._require(job)
        return await self._sql(lambda s: [r.public() for r in db.list_placements(s, job, limit=limit)])

    async def proposals(self, job: str, status: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        await self._require(job)
        if status is not None and status not in db.PROPOSAL_STATUSES:
            raise InvalidError(f"status must be one of {', '.join(db.PROPOSAL_STATUSES)}; got {status!r}.")
        return await self._sql(lambda s: [r.public() for r in db.list_proposals(s, job, status=status, limit=limit)])

    async def proposal(self, job: str, proposal_id: int) -> dict[str, Any]:
        await self._require(job)
        row = await self._sql(lambda s: (p.public() if (p := db.get_proposal(s, job, proposal_id)) else None))
        if row is None:
            raise NotFoundError(f"Proposal {proposal_id} not found for job '{job}'.")
        return row

    async def audit(self, job: str, limit: int = 200) -> list[dict[str, Any]]:
        await self._require(job)
        return await self._sql(lambda s: [r.public() for r in db.list_audit(s, job, limit=limit)])

    # --- placements and proposals (gateway thread, under the job's lock) ---------------------

    def _new_placement(self, s: Session, st: _JobState, shares: Sequence[int], *, source: str,
                       actor: ActorLike, reason: str, proposal_id: int | None = None,
                       current: db.PlacementRow | None | bool = True,
                       predicted_step_ms: float | None = None, auto: bool = False) -> db.PlacementRow:
        """Add the next placement version and make it the one in force here (the caller
        commits, then sends it)."""
        row = records.new_placement(
            s, st.job, shares, source=source, actor=actor, reason=reason, at=self._wall(),
            proposal_id=proposal_id, current=current, predicted_step_ms=predicted_step_ms, auto=auto)
        st.version, st.shares = row.version, list(shares)
        return row

    def _close_pending(self, s: Session, job: str, status: str, why: str, keep: int | None = None) -> None:
        records.close_pending(s, job, status, why, self._wall(), keep)

    def _add_proposal(self, s: Session, st: _JobState, shares: list[int], *, source: str, strategy: str,
                      actor: ActorLike, reason: str, explanation: dict[str, Any] | None = None,
                      before: float | None = None, after: float | None = None,
                      gain: float | None = None, costs: list[float] | None = None) -> db.ProposalRow:
        if before is None:
            before = inputs.predict_step_ms(costs, st.shares)
            after = inputs.predict_step_ms(costs, shares)
            if before and after is not None:
                gain = (before - after) / before
        return records.add_proposal(
            s, st.job, base_version=st.version, current_shares=st.shares, shares=shares,
            source=source, strategy=strategy, actor=actor, reason=reason, at=self._wall(),
            ttl_s=float(self._knob(st, "proposal_ttl_s")), explanation=explanation,
            before=before, after=after, gain=gain)

    async def expire_proposals(self) -> int:
        """Mark proposals older than their TTL expired; returns how many."""
        def work(s: Session) -> list[str]:
            expired = records.expire_due(s, self._wall())
            s.commit()
            for job in set(expired):
                if (st := self._jobs.get(job)) is not None:
                    self._read_facts(s, st)
            return expired

        expired = await self._sql(work)
        for job in set(expired):
            if (st := self._jobs.get(job)) is not None:
                self._publish(st)
        return len(expired)

    # --- the policy loop (under the job's lock) ---------------------------------------------

    def _settled(self, st: _JobState) -> bool:
        """True once every rank trains under the placement in force (acked or seen in metrics)."""
        if st.applied or st.version == 0:  # version 0 is every hook's starting split
            return True
        view = self.live.view(st.job)
        if view is None or len(view.ranks) < st.world_size:
            return False
        return all(r.placement_version is not None and r.placement_version >= st.version
                   for r in view.ranks)

    async def _run_policy(self, st: _JobState) -> None:
        if self.live.ended(st.job):
            return  # the run ended: nothing it is sent would take effect (run_ended)
        self.policy_runs += 1
        await self._acks_from_metrics(st)
        await self._measure_effect(st)
        from backend.policy import InfeasibleError, Rollback
        from backend.policy.types import Proposal as PolicyProposal

        if not self._settled(st):
            st.status, st.status_detail = "proposal_pending", st.waiting_detail()
            self._publish(st)
            return
        pending = st.pending
        if pending is not None and pending["source"] != "policy":
            return  # an operator's own proposal is not replaced by the policy
        cfg = self._config(st)
        constraints = inputs.constraints_from(st.overrides)
        version = st.version
        started = time.perf_counter()
        # The observation's rows are copied from live state on a worker thread (at thousands
        # of ranks it takes long enough to delay every websocket); its objects are built and
        # the decision made in the runner (a process of its own at scale).
        obs = await asyncio.to_thread(
            inputs.observation_rows, self.live, st.job, world_size=st.world_size,
            global_batch_size=st.global_batch_size, shares=list(st.shares), version=st.version,
            effective=st.effective, window_steps=cfg.window_steps,
            # The policy does not retry a rolled-back direction until the cost changed.
            rollbacks=[Rollback(k, tuple(before), tuple(after)) for k, before, after in st.rollbacks])
        if obs is None:
            return  # no data yet
        try:
            decision = await self.policy.decide(obs, cfg, constraints)
        except InfeasibleError as exc:
            st.status, st.status_detail = "imbalanced", f"the overrides admit no placement: {exc}"
            self._publish(st)
            return
        finally:
            st.think_s = time.perf_counter() - started
        expl = decision.explanation
        if expl is not None and len(expl.ranks) == st.world_size:
            ranks = sorted(expl.ranks, key=lambda r: r.rank)
            st.cost_fit = (tuple(r.a_ms for r in ranks), tuple(r.c_ms for r in ranks))
        if st.version != version:
            return  # the placement changed while the policy was thinking
        if not isinstance(decision, PolicyProposal):
            st.status = ("warming_up" if decision.status in ("warming_up", "no_data")
                         else "imbalanced" if decision.status == "infeasible" else "balanced")
            st.status_detail = decision.detail
            self._publish(st)
            return
        # The policy capped the move already (auto mode: max_move_fraction, memory caps).
        shares = list(decision.shares)
        if shares == st.shares:
            st.status, st.status_detail = "balanced", "the policy's split equals the placement in force"
            self._publish(st)
            return
        if pending is not None and list(pending["shares"]) == shares and pending["base_version"] == st.version:
            # Already on the table (say, shown before the mode became auto).
            if st.mode == "auto" and pending["status"] == "proposed":
                await self._apply_auto(st, pending["id"])
            return
        assert expl is not None  # a Proposal always explains itself

        def work(s: Session) -> int | str:
            if self.live.ended(st.job):
                return "the job ended (every rank said goodbye) while the policy was deciding"
            blocked = records.refused_before(s, st.job, st.version, shares)
            if blocked:
                return blocked
            self._close_pending(s, st.job, "superseded", "a newer policy proposal replaced it")
            prop = self._add_proposal(
                s, st, shares, source="policy", strategy=expl.strategy, actor=_SYSTEM,
                reason=decision.reason, explanation=_explanation_dict(expl),
                before=expl.step_ms_before, after=expl.step_ms_after, gain=expl.gain)
            s.commit()
            self._read_facts(s, st)
            return prop.id

        got = await self._sql(work)
        if isinstance(got, str):
            st.status, st.status_detail = "imbalanced", got
            self._publish(st)
            return
        st.status, st.status_detail = "proposal_pending", decision.reason
        self._publish(st)
        if st.mode == "auto":
            await self._apply_auto(st, got)

    async def _apply_auto(self, st: _JobState, proposal_id: int) -> None:
        """Auto mode applies the policy's proposal; a job that ended meanwhile keeps it unapplied."""
        try:
            await self._apply(st, proposal_id, actor="auto", reason="auto mode", auto=True)
        except ConflictError as exc:
            if not self.live.ended(st.job):
                raise
            st.status, st.status_detail = "balanced", exc.detail
            self._publish(st)

    async def _measure_effect(self, st: _JobState) -> None:
        if not st.applied or st.effective is None or st.measured:
            return
        w = int(self._knob(st, "effect_window_steps"))
        lo, hi = effect.after_window(st.effective, w)
        view = self.live.view(st.job)
        if view is None or view.batch_index is None or view.batch_index < hi:
            return
        after = effect.window_step_ms(self.live, st.job, lo=lo, hi=hi, need=max(1, w // 2))
        if after is None:
            return
        may_auto = st.mode == "auto"
        threshold = float(self._knob(st, "rollback_threshold"))

        def work(s: Session) -> tuple[list[int], str] | None:
            row = db.get_placement(s, st.job, st.version)
            if row is None:
                return None
            factor = 1.0
            if row.previous_shares is not None and st.effective is not None:
                factor = effect.speed_factor(
                    self.live, st.job, shares=row.previous_shares,
                    before=effect.before_window(st.effective, w), after=(lo, hi))
            verdict = effect.judge_effect(
                version=row.version, step_ms_before=row.step_ms_before, step_ms_after=after,
                rollback_threshold=threshold,
                may_roll_back=row.auto and may_auto and row.previous_shares is not None,
                speed_factor=factor)
            row.step_ms_after = verdict.step_ms_after
            if verdict.measured_gain is not None:
                row.measured_gain = verdict.measured_gain
            rollback = None
            if verdict.rollback_reason is not None and row.previous_shares is not None:
                row.rolled_back = True
                rollback = (list(row.previous_shares), verdict.rollback_reason)
            st.measured = True
            st.last_effect = effect.effect_record(row)
            s.commit()
            return rollback

        rollback = await self._sql(work)
        if rollback is not None:
            await self._issue(st, rollback[0], source="rollback", actor=_SYSTEM, reason=rollback[1],
                              action="placement.auto_rollback")
        self._publish(st)

    # --- operator actions (the REST routes call these) ------------------------------------

    async def _issue(self, st: _JobState, shares: list[int], *, source: str, actor: ActorLike,
                     reason: str, action: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Record and send a placement that no proposal stands behind (rollback)."""
        # Pending proposals stay: approving one now answers 409 (computed against an older
        # version), and the next policy run supersedes it.
        def work(s: Session) -> dict[str, Any]:
            self._refuse_if_ended(st.job)
            old = db.latest_placement(s, st.job)
            row = self._new_placement(s, st, shares, source=source, actor=actor, reason=reason,
                                      current=old)
            if old is not None and source == "rollback":
                old.rolled_back = True
            db.record_audit(s, actor=actor, action=action, job=st.job,
                            params={**(params or {}), "version": row.version, "shares": shares},
                            reason=reason)
            s.commit()
            self._read_facts(s, st)
            return row.public()

        out = await self._sql(work)
        self._reset_applied(st)
        self._publish(st)
        await self._send(st.job, self._placement_msg(st, reason=reason))
        return out

    def _reset_applied(self, st: _JobState) -> None:
        st.applied, st.effective, st.measured = False, None, False

    def _refuse_if_ended(self, job: str) -> None:
        """No placement for a job whose ranks have all said goodbye: none would receive it,
        and its report, stored at the goodbye, would not list it. Checked inside the SQL
        work that stores the placement, so a goodbye lands either before the check (refused)
        or after the commit (the report, read later on the same SQL thread, has it)."""
        if self.live.ended(job):
            raise ConflictError(f"Job '{job}' has ended (every rank said goodbye); a placement would never take effect.")

    async def _apply(self, st: _JobState, proposal_id: int, *, actor: ActorLike, reason: str | None,
                     auto: bool = False) -> dict[str, Any]:
        job = st.job

        def work(s: Session) -> dict[str, Any]:
            prop = records.proposal_to_decide(s, job, proposal_id, "approved")
            self._refuse_if_ended(job)
            if st.mode == "observe":
                raise ConflictError(f"Job '{job}' is in observe mode; set the mode to approve or auto to apply proposals.")
            if prop.base_version != st.version:
                records.decide(prop, "expired", f"placement version {st.version} came into force", self._wall())
                s.commit()
                self._read_facts(s, st)
                raise ConflictError(
                    f"Proposal {proposal_id} was computed against placement version {prop.base_version} "
                    f"but version {st.version} is in force; refresh.")
            if prop.expires_at is not None and self._wall() > prop.expires_at:
                records.decide(prop, "expired", "older than its TTL", self._wall())
                s.commit()
                self._read_facts(s, st)
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
            self._read_facts(s, st)
            return prop.public()

        try:
            out = await self._sql(work)
        except ControlError:
            self._publish(st)
            raise
        self._reset_applied(st)
        st.status, st.status_detail = "proposal_pending", st.waiting_detail()
        self._publish(st)
        await self._send(job, self._placement_msg(st, proposal_id=proposal_id, reason=out["reason"]))
        return out

    async def approve(self, job: str, proposal_id: int, *, actor: ActorLike,
                      reason: str | None = None) -> dict[str, Any]:
        """Send exactly the reviewed shares as the next placement version."""
        st = await self._require(job)
        async with st.lock:
            return await self._apply(st, proposal_id, actor=actor, reason=reason)

    async def reject(self, job: str, proposal_id: int, *, actor: ActorLike,
                     reason: str | None = None) -> dict[str, Any]:
        st = await self._require(job)
        async with st.lock:
            def work(s: Session) -> dict[str, Any]:
                prop = records.proposal_to_decide(s, job, proposal_id, "rejected")
                records.decide(prop, "rejected", reason or "", self._wall(), by=actor)
                db.record_audit(s, actor=actor, action="proposal.reject", job=job,
                                params={"proposal_id": proposal_id}, reason=reason)
                s.commit()
                self._read_facts(s, st)
                return prop.public()

            out = await self._sql(work)
            st.status, st.status_detail = "imbalanced", f"proposal {proposal_id} was rejected"
            self._publish(st)
            return out

    def _memory_problems(self, st: _JobState, shares: Sequence[int]) -> tuple[list[str], dict[str, Any]]:
        """Why ``shares`` breaks a memory cap (one sentence per rank, with the predicted peak
        and the cap), and the per-rank memory explanation of ``shares``."""
        from backend.policy import memory_violations

        memories = inputs.rank_memories(self.live, st.job, st.world_size)
        headroom = self._config(st).memory_headroom
        problems = memory_violations(memories, shares, headroom)
        problems += [
            f"rank {i} measures memory but has no fit yet, so it may not gain work "
            f"({st.shares[i]} now, {shares[i]} asked)"
            for i, rm in enumerate(memories)
            if rm.source and rm.fit is None and shares[i] > st.shares[i]]
        expl: dict[str, Any] = {"memory": inputs.memory_explanation(memories, st.shares, shares, headroom)}
        return problems, expl

    async def submit_manual(self, job: str, shares: Any, *, actor: ActorLike, reason: str | None = None,
                            apply: bool = False, force: bool = False) -> dict[str, Any]:
        """An operator's own placement: validated, stored as a proposal, applied if asked.

        A placement whose predicted peak memory breaks a rank's memory cap is refused with
        the predicted peak and the cap, unless ``force`` (audited as ``placement.memory_force``).
        """
        st = await self._require(job)
        async with st.lock:
            if isinstance(shares, list):  # JSON Schema's integers include 12.0
                shares = [int(x) if isinstance(x, float) and x.is_integer() and abs(x) < 2**53 else x
                          for x in shares]
            well_formed = isinstance(shares, list) and all(
                isinstance(x, int) and not isinstance(x, bool) for x in shares)
            try:
                shares = check_shares(shares, world_size=st.world_size, global_batch_size=st.global_batch_size)
            except ValueError as exc:
                # integers that do not fit this job (count, sum, range) are the job's refusal
                error = StateError if well_formed else InvalidError
                raise error(f"Invalid placement: {exc}") from None
            self._check_overrides(st, shares)
            problems, expl = self._memory_problems(st, shares)
            if problems and not force:
                raise StateError(f"Placement breaks memory caps: {'; '.join(problems)}. "
                                   "Send force=true to submit it anyway.")
            if problems:
                expl["memory_forced"] = problems
            costs = self._costs(st)

            def work(s: Session) -> tuple[int, dict[str, Any]]:
                self._refuse_if_ended(job)
                self._close_pending(s, job, "superseded", "an operator submitted a placement")
                prop = self._add_proposal(s, st, shares, source="manual", strategy="manual", actor=actor,
                                          reason=reason or "manual placement", costs=costs,
                                          explanation=expl)
                db.record_audit(s, actor=actor, action="proposal.create", job=job,
                                params={"proposal_id": prop.id, "shares": shares, "apply": apply,
                                        "force": force},
                                reason=reason)
                if problems:
                    db.record_audit(s, actor=actor, action="placement.memory_force", job=job,
                                    params={"proposal_id": prop.id, "shares": shares,
                                            "problems": problems}, reason=reason)
                s.commit()
                self._read_facts(s, st)
                return prop.id, prop.public()

            pid, out = await self._sql(work)
            self._publish(st)
            if apply:
                return await self._apply(st, pid, actor=actor, reason=reason)
            return out

    async def rollback(self, job: str, *, actor: ActorLike, reason: str | None = None) -> dict[str, Any]:
        """Go back to exactly the shares in force before the current placement."""
        st = await self._require(job)
        async with st.lock:
            def read(s: Session) -> tuple[list[int], int | None]:
                cur = db.latest_placement(s, job)
                if cur is None or cur.previous_shares is None:
                    raise ConflictError(f"Job '{job}' has no previous placement to roll back to.")
                return list(cur.previous_shares), cur.previous_version

            shares, prev_version = await self._sql(read)
            if len(shares) != st.world_size:
                raise ConflictError(f"The previous placement of job '{job}' has another world size; it cannot return.")
            return await self._issue(st, shares, source="rollback", actor=actor,
                                     reason=reason or f"rollback to the shares of version {prev_version}",
                                     action="placement.rollback", params={"to_version": prev_version})

    async def set_mode(self, job: str, mode: str, *, actor: ActorLike, reason: str | None = None) -> dict[str, Any]:
        st = await self._require(job)
        if mode not in MODES:
            raise InvalidError(f"Mode must be one of observe, approve, auto; got {mode!r}.")
        async with st.lock:
            def work(s: Session) -> None:
                row = db.get_settings(s, job)
                assert row is not None
                old, row.mode, row.updated_at = row.mode, mode, self._wall()
                db.record_audit(s, actor=actor, action="job.mode", job=job,
                                params={"mode": mode, "previous": old}, reason=reason)
                s.commit()

            await self._sql(work)
            st.mode, st.last_run = mode, -math.inf
            self._dirty.add(job)
            self._publish(st)
        return self.job_control(job)

    async def set_policy(self, job: str, changes: dict[str, Any], *, actor: ActorLike,
                         reason: str | None = None) -> dict[str, Any]:
        """Merge ``changes`` into the job's policy settings (None removes a stored value)."""
        st = await self._require(job)
        check_policy_changes(changes)
        async with st.lock:
            policy = dict(st.policy)
            for k, v in changes.items():
                if v is None:
                    policy.pop(k, None)
                else:
                    policy[k] = v
            # Each value may be in range and the whole still unusable (window below min_steps):
            # every policy run after it would fail, so refuse it before it is stored.
            from backend.policy.engine import check_config

            try:
                check_config(inputs.policy_config(policy, st.mode, self.settings))
            except ValueError as exc:
                raise StateError(str(exc)) from None

            def work(s: Session) -> None:
                row = db.get_settings(s, job)
                assert row is not None
                row.policy, row.updated_at = policy, self._wall()
                db.record_audit(s, actor=actor, action="job.policy", job=job, params=changes, reason=reason)
                s.commit()

            await self._sql(work)
            st.policy, st.last_run, st.static_checked = policy, -math.inf, False
            self._dirty.add(job)
            self._publish(st)
            return inputs.policy_settings(st.policy, st.mode, self.settings)

    async def set_overrides(self, job: str, overrides: dict[str, Any], *, actor: ActorLike,
                            reason: str | None = None) -> dict[str, Any]:
        """Replace the job's overrides; when the placement in force breaks them, propose one
        that respects them (applied right away in auto mode)."""
        from backend.policy import InfeasibleError, solve

        st = await self._require(job)
        ov = inputs.validate_overrides(overrides, world_size=st.world_size,
                                       global_batch_size=st.global_batch_size)
        async with st.lock:
            costs = self._costs(st)
            try:
                # Memory caps too: the proposal that respects the overrides must fit the cards.
                target = list(solve([0.0] * st.world_size, costs or [1.0] * st.world_size,
                                    st.global_batch_size, self._memory_constraints(st, ov)))
            except InfeasibleError as exc:
                raise StateError(f"The overrides admit no placement: {exc}") from None
            broken: str | None = None
            try:
                inputs.check_overrides(ov, st.shares, global_batch_size=st.global_batch_size)
            except InvalidError as exc:
                broken = exc.detail

            def work(s: Session) -> int | None:
                records.store_overrides(s, job, ov, actor=actor, reason=reason, at=self._wall())
                pid = None
                if broken is not None:
                    self._close_pending(s, job, "superseded", "the overrides changed")
                    prop = self._add_proposal(s, st, target, source="override", strategy="override",
                                              actor=actor, reason=f"respect the new overrides: {broken}",
                                              costs=costs)
                    pid = prop.id
                s.commit()
                self._read_facts(s, st)
                return pid

            pid = await self._sql(work)
            st.overrides, st.last_run = ov, -math.inf
            self._dirty.add(job)
            self._publish(st)
            if pid is not None and st.mode == "auto":
                await self._apply(st, pid, actor="auto", reason="auto mode: overrides changed", auto=True)
            return {**ov, "proposal_id": pid}


def _audit_restart(hello: Hello, previous: int) -> Callable[[Session], None]:
    def work(s: Session) -> None:
        db.record_audit(s, actor=_SYSTEM, action="job.restart", job=hello.job, params={
            "restart_count": hello.restart_count, "previous_restart_count": previous,
            "rank": hello.rank, "world_size": hello.world_size,
            "global_batch_size": hello.global_batch_size,
        }, reason=f"torchrun restarted the job's workers (restart {hello.restart_count})")
        s.commit()
    return work


def _explanation_dict(expl: Explanation) -> dict[str, Any]:
    # JSON round trip: evidence may hold tuples or numbers numpy produced.
    out: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(expl), default=_json_default))
    return out


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    return str(o)
