"""What a rank's frames do to control state (``HookEvents``): hello (the placement in force
back), acks, OOMs, rejects and the end of a run. It asks the scheduler for a policy run
(``PolicyScheduler.mark_dirty``) and sends placements through ``Rollout``; the policy loop
never calls back into it."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from sqlalchemy.orm import Session

from backend.control import inputs, records
from backend.control.core import SYSTEM, JobState, JobStore
from backend.control.errors import FencedError, InvalidError
from backend.control.policy_loop import PolicyLoop
from backend.control.rollout import Rollout
from backend.control.scheduling import PolicyScheduler
from backend.peers.connections import HookConnections
from backend.storage import control as db
from rebalancer_wire.protocol import Ack, Hello, Oom, Placement, Reject

__all__ = ["HookEvents"]

log = logging.getLogger("backend.control.controller")


class HookEvents:
    """Turns the hooks' frames into control state changes."""

    def __init__(self, *, store: JobStore, rollout: Rollout, policy: PolicyLoop,
                 schedule: PolicyScheduler, connections: HookConnections):
        self.store = store
        self.rollout = rollout
        self.policy = policy
        self.schedule = schedule
        self.connections = connections
        self._creating: dict[str, asyncio.Future[None]] = {}

    async def on_hello(self, hello: Hello) -> Placement:
        """Return the placement in force; a new job gets version 0, the uniform split."""
        job = hello.job
        self.policy.warm()  # a job's first decisions are near: start the policy worker now
        st = await self.store.load(job)
        if st is None:
            mode, wall = self.store.settings.default_mode, self.store.wall

            def create(s: Session) -> None:
                if db.get_settings(s, job) is None:  # another rank's hello got there first
                    records.create_job(s, hello, mode=mode, actor=SYSTEM, at=wall())
                    s.commit()

            if job not in self._creating:
                self._creating[job] = asyncio.ensure_future(self.store.sql(create))
            try:
                await asyncio.shield(self._creating[job])
            finally:
                self._creating.pop(job, None)
            st = await self.store.require(job)
        self.store.arrived(job)
        async with st.lock:
            previous = st.restart_count
            if (hello.world_size, hello.global_batch_size) != (st.world_size, st.global_batch_size):
                st = await self._reshape(st, hello)
            # Under the lock: the ranks of one restarted attempt say hello together, and
            # only the first of them may see (and audit) the restart.
            self._follow_restarts(st, hello, previous)
        if previous is not None and hello.restart_count > previous:
            await self.store.sql(_audit_restart(hello, previous))
        async with st.lock:
            st.devices[hello.rank] = hello
            st.mesh = hello.mesh  # its leaders say one mesh (the ingest refuses another)
            st.last_metrics = self.store.wall()
            if st.status == "idle":
                st.status, st.status_detail = "warming_up", "waiting for the first steps"
            if self.store.config(st).strategy == "static" and not st.static_checked:
                await self._static_now(st)
            self.store.publish(st)
            return self.rollout.hello_reply(st)

    def _follow_restarts(self, st: JobState, hello: Hello, previous: int | None) -> None:
        """Track the ranks' TorchElastic attempt: a higher count is a restart (audited by
        on_hello); a lower one, with no other rank connected, a new launch of the job."""
        known = st.restart_count if st.restart_count is not None else previous
        alone = self.connections.alone(st.job, hello.rank)
        if known is None or hello.restart_count > known or alone:
            st.restart_count = hello.restart_count
        else:
            st.restart_count = known

    async def _reshape(self, st: JobState, hello: Hello) -> JobState:
        """The job came back with another shape: old placements cannot apply."""
        job = st.job
        reason = (f"job restarted with world_size {hello.world_size} and global batch "
                  f"{hello.global_batch_size} (was {st.world_size} and {st.global_batch_size})")

        def work(s: Session) -> None:
            records.reshape(s, hello, reason=reason, actor=SYSTEM, at=self.store.wall())
            s.commit()

        await self.store.sql(work)
        self.store.drop(job)
        return await self.store.require(job)

    async def _static_now(self, st: JobState) -> None:
        """The static strategy needs no measurement: propose its split as soon as every
        rank has said hello (auto mode applies it before the first steps)."""
        if not inputs.all_said_hello(self.store.live, st.job, st.world_size):
            return
        st.static_checked = True
        try:
            await self.policy.run(st)
        except Exception:
            log.exception("static placement for job %s failed", st.job)

    async def on_ack(self, ack: Ack) -> None:
        """Record the batch index at which a rank applied a version; all acked -> applied."""
        def change(s: Session, st: JobState, row: db.PlacementRow) -> None:
            self.rollout.record_acks(s, st, row, {ack.rank: ack.batch_index})
            s.commit()

        if await self._on_placement(ack.job, ack.version, change) is False:
            log.warning("ack for unknown placement %s of job %s", ack.version, ack.job)

    async def run_ended(self, job: str) -> None:
        """Every rank of ``job`` said goodbye: wait for a policy run or an operator's action
        in flight (the job's lock), then record the acks its last metrics carried, so that
        the report built next sees every placement and when each took effect."""
        st = self.store.get(job)
        if st is None:
            return
        async with st.lock:
            await self.rollout.acks_from_metrics(st)

    async def on_oom(self, oom: Oom) -> None:
        """A rank ran out of memory: mark the placement it trained under unsafe, never give
        that rank as many samples again (a cap in the overrides, audited), and roll the job
        back to the previous placement, which its next run (a restart) receives."""

        st = await self.store.load(oom.job)
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
                row = records.record_oom(s, oom, ov, cap=ceiling, why=why, actor=SYSTEM, at=self.store.wall())
                if row is not None and row.previous_shares is not None and len(row.previous_shares) == st.world_size:
                    previous = list(row.previous_shares)
                self.store.fence(s, st)
                s.commit()
                self.store.read_facts(s, st)
                return previous

            try:
                previous = await self.store.sql(work)
            except FencedError as exc:  # another replica took the job: its hooks go there
                log.warning("job %s: the out-of-memory cap of rank %d was not stored here: %s", oom.job, oom.rank,
                            exc.detail)
                return
            st.overrides, st.last_run = ov, -math.inf
            st.status, st.status_detail = "imbalanced", why
            self.schedule.mark_dirty(oom.job)
            target = self._oom_target(st, oom, previous)
            if isinstance(target, str):
                st.status_detail = f"{why}; {target}"
            elif target is not None and target != st.shares:
                await self.rollout.issue(st, target, source="rollback", actor=SYSTEM,
                                  reason=f"{why}; rolled back for the next run",
                                  action="placement.oom_rollback", params={"from_version": oom.version})
            self.store.publish(st)

    def _oom_target(self, st: JobState, oom: Oom, previous: list[int] | None) -> list[int] | str | None:
        """Where an out-of-memory error sends the job: the previous placement when it fits
        the new cap, else the placement in force if that fits, else a solve under the
        overrides; a sentence when the overrides admit none."""
        from backend.policy import InfeasibleError, solve

        for shares in ([previous] if oom.version == st.version and previous is not None else []) + [st.shares]:
            try:
                self.store.check_overrides(st, shares)
                return shares
            except InvalidError:
                continue
        try:
            costs = self.store.costs(st) or [1.0] * st.world_size
            return list(solve([0.0] * st.world_size, costs, st.global_batch_size,
                              self.store.memory_constraints(st, st.overrides)))
        except InfeasibleError as exc:
            return f"the overrides admit no placement: {exc}"

    async def on_reject(self, reject: Reject) -> None:
        """A rank refused a placement: mark it and its proposal failed, with the reason."""
        def change(s: Session, st: JobState, row: db.PlacementRow) -> None:
            if not row.failed:
                records.fail_placement(s, row, rank=reject.rank, reason=reject.reason, actor=SYSTEM)
            s.commit()
            if st.version == reject.version:
                prev = db.latest_placement(s, reject.job)
                if prev is not None:
                    st.version, st.shares = prev.version, list(prev.shares)
                    st.follow(prev)
                    st.measured = True  # do not re-measure (or roll back) the restored one

        await self._on_placement(reject.job, reject.version, change)

    async def _on_placement(self, job: str, version: int,
                            change: Callable[[Session, JobState, db.PlacementRow], None]) -> bool | None:
        """A hook's answer to placement ``version`` of ``job``: under the job's lock, ``change``
        on its row (which commits), then the job's facts re-read and published. None: the job
        is unknown; False: the placement is (nothing changes)."""
        st = await self.store.load(job)
        if st is None:
            return None
        async with st.lock:
            def work(s: Session) -> bool:
                row = db.get_placement(s, job, version)
                if row is None:
                    return False
                change(s, st, row)
                self.store.read_facts(s, st)
                return True

            found: bool = await self.store.sql(work)
            if found:
                self.store.publish(st)
            return found


def _audit_restart(hello: Hello, previous: int) -> Callable[[Session], None]:
    def work(s: Session) -> None:
        records.audit_restart(s, hello, previous, actor=SYSTEM)
        s.commit()
    return work
