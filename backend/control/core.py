"""The controller's job store (``JobStore``), the one owner of each job's in-memory control
state (``JobState``): loading it from SQL under this replica's lease epoch (the fence every
control write checks), publishing its snapshot, and the proposal writes and checks the other
parts share. The table writes themselves are records.py's; placements are rollout.py's (``Rollout``).

``RunQueue`` is the policy scheduler's: which jobs want a policy run and which have one
running; the store reads it so that it never forgets a job a run holds.

One module, over 400 lines on purpose: loading a job, fencing its writes and publishing its
snapshot touch the same state, which has one owner."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from sqlalchemy.orm import Session

from backend.auth.tokens import Actor
from backend.control import inputs, records
from backend.control.errors import (
    ConflictError,
    ElsewhereError,
    FencedError,
    NotFoundError,
)
from backend.live.state import LiveState
from backend.modes import MODES
from backend.settings import Settings
from backend.storage import control as db
from backend.storage import owners
from backend.storage.gateway import SqlGateway
from backend.storage.metrics import job_mesh
from backend.storage.writes import database_fault
from rebalancer_wire.protocol import Hello, MeshShape, Placement, uniform_shares

__all__ = ["ARRIVAL_WAIT_S", "LOCAL_REPLICA", "MODES", "SYSTEM", "ActorLike", "JobState", "JobStore",
           "Ownership", "RunQueue", "T", "fence_detail"]

log = logging.getLogger("backend.control.controller")

# How long an action waits for a job whose first hello is being stored (``expect``).
ARRIVAL_WAIT_S = 5.0
SYSTEM = "controller"
LOCAL_REPLICA = "local"  # the replica id in job_owners of a backend without Redis
T = TypeVar("T")
ActorLike = Actor | str


class _LeaseStatus(Protocol):
    @property
    def state(self) -> str: ...  # "ok" or "paused"

    @property
    def reason(self) -> str: ...


class Ownership(Protocol):
    """Which jobs this replica controls (``backend.cluster.JobLeases`` with several replicas)."""

    replica_id: str

    def owns(self, job: str) -> bool: ...

    def epoch(self, job: str) -> int | None: ...

    def fenced(self, job: str) -> None: ...

    async def raise_epoch(self, job: str, floor: int) -> int | None: ...

    async def acquire(self, job: str) -> bool: ...

    async def owner(self, job: str) -> tuple[str | None, str | None]: ...

    def status(self) -> _LeaseStatus: ...


@dataclass
class JobState:
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
    # The placement in force's stage-model prediction and, once measured, its check (pipelined jobs).
    pipeline_prediction: dict[str, Any] | None = None
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
    # The job's cost model as the policy last found it (CostModel.as_dict; None: not yet or
    # no costs), and the k of L + k*L^2 the placements sent carry (what the hooks split by).
    cost_model: dict[str, Any] | None = None
    length_sq_weight: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    restart_count: int | None = None  # TorchElastic attempt of the ranks (None: none seen since load)
    # A device-mesh job's shape (its ranks here are replicas), from its hellos or its stored row.
    mesh: MeshShape | None = None
    # The lease epoch this replica installed in the store of record when it loaded the job
    # (None: loaded while another replica, or none, controlled it); every control write checks it.
    epoch: int | None = None
    # The placement in force as the last hello got it: every rank of a job says hello, and
    # each gets this same message (rebuilt only when what it says changed).
    hello_reply: Placement | None = None

    def replicas_sentence(self) -> str:
        """For errors about shares or ranks: what they count in this job."""
        m = self.mesh
        if m is None:
            return ""
        return (f" Job '{self.job}' is a mesh job ({m.label}): shares, pins, caps and drains are per "
                f"data-parallel replica, and it has {m.dp} replicas of {m.replica_size} ranks each.")

    def follow(self, row: db.PlacementRow) -> None:
        """Take applied / effective / measured from the placement row in force."""
        self.applied = row.applied_at is not None
        self.effective = row.effective_batch_index if self.applied else None
        self.measured = row.step_ms_after is not None

    def waiting_detail(self) -> str:
        return f"waiting for every rank to apply version {self.version}"



class RunQueue:
    """The jobs whose metrics changed since their last policy run (``dirty``) and the runs in
    flight (``running``): the scheduler's, read by the store before it forgets a job."""

    def __init__(self) -> None:
        self.dirty: set[str] = set()
        self.running: dict[str, asyncio.Task[None]] = {}

    def mark(self, job: str) -> None:
        self.dirty.add(job)

    def busy(self, job: str) -> bool:
        return job in self.running


class JobStore:
    """Each job's control state in memory, loaded from SQL and published as a snapshot; the
    fence on every control write; the checks and proposal writes the other parts share."""

    def __init__(self, *, settings: Settings, sql: SqlGateway, live: LiveState,
                 notify: Callable[[str], None], queue: RunQueue,
                 wall: Callable[[], float] = time.time, ownership: Ownership | None = None):
        self.settings = settings
        # None: one replica, which controls every job (the default). Else policy runs and
        # operator actions happen only for the jobs whose lease this replica holds.
        self.ownership = ownership
        self.gateway = sql
        self.live = live
        self._notify_hub = notify
        self.queue = queue
        self.wall = wall
        self._jobs: dict[str, JobState] = {}
        self._loading: dict[str, asyncio.Future[JobState | None]] = {}
        # Jobs a rank said hello for whose control state is not made yet (``expect``):
        # actions on them wait up to ``arrival_wait_s`` for ``on_hello`` instead of a 404.
        self._arrivals: dict[str, asyncio.Event] = {}
        self.arrival_wait_s = ARRIVAL_WAIT_S
        self._stale: set[str] = set()  # taken over while busy: reload once free (``load``)

    async def sql(self, fn: Callable[[Session], T]) -> T:
        """``fn(session)`` on the SQL gateway; a write fenced off drops the job (``_lost_fence``)."""
        try:
            return await self.gateway.run(fn)
        except FencedError as exc:
            self._lost_fence(exc.job)
            raise

    @property
    def replica_id(self) -> str:
        return self.ownership.replica_id if self.ownership is not None else LOCAL_REPLICA

    def get(self, job: str) -> JobState | None:
        """The job's state in memory; None when it is not loaded (no SQL read)."""
        return self._jobs.get(job)

    def drop(self, job: str) -> None:
        """Drop the job's state whatever holds it (its shape changed: the next use reloads it)."""
        self._jobs.pop(job, None)

    def fence(self, s: Session, st: JobState) -> None:
        """The last statement of every control write before its commit: the job's row in
        ``job_owners`` must still hold the epoch this replica loaded the job under."""
        if st.epoch is None and self.ownership is None:  # loaded while the database refused writes
            st.epoch = records.take_epoch(s, st.job, self.replica_id, None)
        if st.epoch is not None:
            held = records.check_epoch(s, st.job, self.replica_id, st.epoch,
                                      idle_limit_s=self.settings.lease_ttl_s)
            if held is None:
                return
        else:
            held = owners.epoch_of(s, st.job) or (0, "")
        s.rollback()
        raise FencedError(fence_detail(self.replica_id, st.job, st.epoch, held[0]), job=st.job)

    def _lost_fence(self, job: str) -> None:
        """A write was fenced off: drop the job's state (reloaded from the store on its next
        use) and stop controlling it until the lease says otherwise."""
        self._stale.add(job)
        if self.ownership is not None:
            self.ownership.fenced(job)

    def _term(self, job: str) -> tuple[bool, int | None]:
        """(whether this replica may install its epoch of ``job`` now, that epoch; None with
        one replica: the stored epoch plus one, a new term at every load)."""
        if self.ownership is None:
            return True, None
        epoch = self.ownership.epoch(job)
        return epoch is not None, epoch

    def publish(self, st: JobState) -> None:
        """Refresh the job's snapshot (what job_control serves) and tell the dashboard."""
        st.snapshot = {
            "mode": st.mode,
            "strategy": self.config(st).strategy,
            "policy": inputs.policy_settings(st.policy, st.mode, self.settings),
            "overrides": dict(st.overrides),
            "placement": {"version": st.version, "shares": list(st.shares)},
            "pending_proposal": st.pending,
            "pending_proposal_id": st.pending["id"] if st.pending else None,
            "verdict": st.status,
            "verdict_detail": st.status_detail,
            "last_effect": st.last_effect,
            "pipeline_prediction": st.pipeline_prediction,
            "last_metrics": st.last_metrics,
            "cost_model": cost_model_public(st.cost_model, st.length_sq_weight, st.mode),
        }
        with contextlib.suppress(Exception):  # the dashboard is never worth a failed action
            self._notify_hub(st.job)

    async def load(self, job: str) -> JobState | None:
        if job in self._stale and self.forget(job):
            self._stale.discard(job)
        st = self._jobs.get(job)
        if st is not None:
            return st
        # Every rank of a new job says hello at once: one read from SQL, the others wait on it.
        pending = self._loading.get(job)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[JobState | None] = asyncio.get_running_loop().create_future()
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

    async def _load_from_sql(self, job: str) -> JobState | None:
        loaded = await self.sql(self._reader(job))
        if loaded is None:
            return None
        if loaded.epoch is None and self.ownership is not None and self.ownership.epoch(job) is not None:
            # We hold the lease but the store has a higher epoch: Redis lost its counter, or
            # a replica paused past its lease installed its own. Raise ours past it, once.
            held = await self.sql(lambda s: owners.epoch_of(s, job))
            if held is not None and await self.ownership.raise_epoch(job, held[0]) is not None:
                loaded = await self.sql(self._reader(job)) or loaded
        st = self._jobs.setdefault(job, loaded)
        if st is loaded:
            self.publish(st)
        return st

    def _reader(self, job: str) -> Callable[[Session], JobState | None]:
        mine, term = self._term(job)
        replica = self.replica_id

        def read(s: Session) -> JobState | None:
            row = db.get_settings(s, job)
            if row is None:
                return None
            # First, in this transaction: a write of the previous owner committed before our
            # epoch is read below; one after it is refused by its own check.
            epoch = None
            if mine:
                try:
                    epoch = records.take_epoch(s, job, replica, term)
                except Exception as exc:  # a read-only database: the job loads, its writes wait
                    if not database_fault(exc):
                        raise
                    s.rollback()
            pl = db.latest_placement(s, job)
            st = JobState(
                job=job, world_size=row.world_size, global_batch_size=row.global_batch_size,
                mode=row.mode or self.settings.default_mode, policy=dict(row.policy or {}),
                overrides=inputs.overrides_dict(s.get(db.OverridesRow, job)),
                version=pl.version if pl else 0,
                shares=list(pl.shares) if pl else uniform_shares(row.world_size, row.global_batch_size),
                status="idle", status_detail="no ranks connected since the backend started",
                mesh=job_mesh(row), epoch=epoch,
            )
            st.last_effect = records.last_effect(s, job)
            if pl is not None:
                st.follow(pl)
                st.pipeline_prediction = pl.prediction
            # The k the hooks split by: the newest cost-model placement's (its audit record).
            sent = db.list_audit(s, job, action="placement.cost_model", limit=1)
            if sent:
                st.length_sq_weight = float((sent[0].params or {}).get("length_sq_weight", 0.0))
            self.read_facts(s, st)
            s.commit()
            return st

        return read

    def read_facts(self, s: Session, st: JobState) -> None:
        """Pending proposal and counts by status, read after every change (gateway thread)."""
        pending = records.pending_proposal(s, st.job)
        st.pending = pending.public() if pending is not None else None
        st.counts = db.proposal_counts(s, st.job)
        st.rollbacks = records.recent_rollbacks(s, st.job)
        st.activity = db.activity_counts(s, st.job)

    async def require(self, job: str) -> JobState:
        st = await self.load(job)
        if st is None and (arriving := self._arrivals.get(job)) is not None:
            # Live state lists the job already (GET /jobs shows it); its hello is being stored.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arriving.wait(), self.arrival_wait_s)
            st = await self.load(job)
        if st is None:
            raise NotFoundError(f"Job '{job}' not found.")
        return st

    def expect(self, job: str) -> None:
        """A rank of ``job`` said hello (ingest, beside ``LiveState.register``): until
        ``on_hello`` has made the job's control state, actions on it wait for it."""
        if job not in self._jobs:
            self._arrivals.setdefault(job, asyncio.Event())

    def arrived(self, job: str) -> None:
        if (arriving := self._arrivals.pop(job, None)) is not None:
            arriving.set()

    def controls(self, job: str) -> bool:
        """True where this replica runs ``job``'s control loop (always, with one replica)."""
        return self.ownership is None or self.ownership.owns(job)

    async def refuse_if_elsewhere(self, job: str) -> None:
        """An operator action on a job another replica controls: say where to send it; while
        Redis is down (control paused), say so. A job nobody leases is taken here first (a
        new lease epoch), so that the action is applied under this replica's fence and the
        placement in force reaches the ranks from the store of record, wherever they are."""
        if self.ownership is None or self.ownership.owns(job):
            return
        for _ in range(2):
            rid, url = await self.ownership.owner(job)
            if rid is not None and rid != self.ownership.replica_id:
                where = f" at {url}" if url else ""
                raise ElsewhereError(f"Job '{job}' is controlled by replica {rid}{where}; send this action there.",
                                     job=job, owner=rid, url=url or "")
            status = self.ownership.status()
            if status.state == "paused":  # no replica may act on a job until Redis answers
                raise ConflictError(f"Control of job '{job}' is paused: {status.reason}")
            if await self.ownership.acquire(job):
                return
        raise ConflictError(f"Job '{job}' changed owner while this action started; nothing was applied. Send it again.")

    def reload(self, job: str) -> None:
        """This replica just took ``job``'s lease: drop what memory holds of it (loaded at
        start-up, or from an earlier turn as owner), so that the next use reads the placement
        in force, the proposals and the settings from the store of record."""
        if not self.forget(job):
            log.warning("job %s was taken over while an action held it; its state reloads on the next", job)
            self._stale.add(job)

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
        if st.lock.locked() or self.queue.busy(job):
            return False
        del self._jobs[job]
        self.queue.dirty.discard(job)
        self._arrivals.pop(job, None)
        return True

    def config(self, st: JobState) -> Any:
        return inputs.policy_config(st.policy, st.mode, self.settings)

    def knob(self, st: JobState, name: str) -> Any:
        return inputs.knob(st.policy, self.settings, name)

    def check_overrides(self, st: JobState, shares: Sequence[int]) -> None:
        inputs.check_overrides(st.overrides, shares, global_batch_size=st.global_batch_size)

    def memory_constraints(self, st: JobState, overrides: dict[str, Any]) -> Any:
        return inputs.memory_constraints(self.live, st.job, overrides, st.shares, st.global_batch_size,
                                         self.config(st).memory_headroom)

    def costs(self, st: JobState) -> list[float] | None:
        return inputs.step_costs(self.live, st.job, st.world_size)

    def close_pending(self, s: Session, job: str, status: str, why: str, keep: int | None = None) -> None:
        records.close_pending(s, job, status, why, self.wall(), keep)

    def add_proposal(self, s: Session, st: JobState, shares: list[int], *, source: str, strategy: str,
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
            source=source, strategy=strategy, actor=actor, reason=reason, at=self.wall(),
            ttl_s=float(self.knob(st, "proposal_ttl_s")), explanation=explanation,
            before=before, after=after, gain=gain)

    def refuse_if_ended(self, job: str) -> None:
        """No placement for a job whose ranks have all said goodbye: none would receive it,
        and its report, stored at the goodbye, would not list it. Checked inside the SQL
        work that stores the placement, so a goodbye lands either before the check (refused)
        or after the commit (the report, read later on the same SQL thread, has it)."""
        if self.live.ended(job):
            raise ConflictError(f"Job '{job}' has ended (every rank said goodbye); a placement would never take effect.")

    def memory_problems(self, st: JobState, shares: Sequence[int]) -> tuple[list[str], dict[str, Any]]:
        """Why ``shares`` breaks a memory cap (one sentence per rank, with the predicted peak
        and the cap), and the per-rank memory explanation of ``shares``."""
        from backend.policy import memory_violations

        memories = inputs.rank_memories(self.live, st.job, st.world_size)
        headroom = self.config(st).memory_headroom
        problems = memory_violations(memories, shares, headroom)
        problems += [
            f"rank {i} measures memory but has no fit yet, so it may not gain work "
            f"({st.shares[i]} now, {shares[i]} asked)"
            for i, rm in enumerate(memories)
            if rm.source and rm.fit is None and shares[i] > st.shares[i]]
        expl: dict[str, Any] = {"memory": inputs.memory_explanation(memories, st.shares, shares, headroom)}
        return problems, expl

def fence_detail(replica: str, job: str, mine: int | None, held: int) -> str:
    """The 409 of a control write the store of record fenced off."""
    if mine is None:
        return (f"Replica {replica} does not control job '{job}' (it holds no lease epoch; the store of record "
                f"has epoch {held}); nothing was applied. Retry: the request will be forwarded to the owner.")
    return (f"Replica {replica} no longer owns job '{job}' (lease epoch {mine} < {held}); nothing was applied. "
            "Retry: the request will be forwarded to the owner.")


def cost_model_public(model: dict[str, Any] | None, in_force: float, mode: str) -> dict[str, Any]:
    """The job view's cost model: the policy's (``samples`` before any cost is seen) and the
    k the hooks split by; a fitted k not sent yet (observe mode) is said in the detail."""
    out: dict[str, Any] = dict(model) if model is not None else {
        "model": "samples", "length_sq_weight": 0.0, "r2": None, "r2_linear": None,
        "ranks_fitted": 0, "ranks_quadratic": 0, "split_shift": None,
        "detail": "no per-sample cost: every sample costs 1"}
    out["length_sq_weight_in_force"] = in_force
    if mode == "observe" and out["length_sq_weight"] != in_force:
        out["detail"] = f"{out['detail']} (observe mode: the hooks still split with k = {in_force:.3g})"
    return out

