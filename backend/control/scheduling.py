"""When policy runs happen (``PolicyScheduler``): the dirty set (``RunQueue``) that
``on_metrics`` and ``mark_dirty`` fill, the ticker that starts ``PolicyLoop.run`` for each due
job, and the tick that expires stale proposals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from sqlalchemy.orm import Session

from backend.control import records
from backend.control.core import JobState, JobStore, RunQueue
from backend.control.errors import (
    ConflictError,
)
from backend.control.policy_loop import PolicyLoop
from backend.settings import Settings
from backend.storage import control as db
from backend.storage.health import log_failure

__all__ = ["PolicyScheduler"]

log = logging.getLogger("backend.control.controller")


class PolicyScheduler:
    """Starts a policy run for each job that is dirty and due; owns the ticker tasks."""

    def __init__(self, *, store: JobStore, policy: PolicyLoop, queue: RunQueue, settings: Settings,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.policy = policy
        self.queue = queue
        self.settings = settings
        self._clock = clock
        self._tasks: list[asyncio.Task[None]] = []

    def mark_dirty(self, job: str) -> None:
        """``job``'s settings or overrides changed: the next tick runs its policy (due at once
        when the caller reset ``last_run``)."""
        self.queue.mark(job)

    async def start(self) -> None:
        """Load every known job, then start the policy ticker and the expiry tick."""
        if self._tasks:
            return
        names = await self.store.sql(lambda s: [r.name for r in db.list_settings(s)])
        for job in names:
            await self.store.load(job)
        self._tasks = [
            asyncio.create_task(self._policy_loop(), name="rebalancer-policy"),
            asyncio.create_task(self._tick_loop(), name="rebalancer-controller"),
        ]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self.queue.running.values()]
        self._tasks = []
        self.queue.running.clear()
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

    def on_metrics(self, job: str, *, urgent: bool = False) -> None:
        """New metrics for ``job``: the next policy tick runs the policy when it is due.
        An ``urgent`` frame (a rank's step far off its recent median: a slowdown) makes it
        due at once, as during the warm-up: the answer to a slowdown should not wait out
        ``policy_min_interval_s``."""
        st = self.store.get(job)
        if st is None:
            return
        st.last_metrics = self.store.wall()
        st.urgent = st.urgent or urgent
        self.queue.mark(job)

    def _due(self, st: JobState, now: float) -> bool:
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
        dirty, running = self.queue.dirty, self.queue.running
        for job in list(dirty):
            st = self.store.get(job)
            if st is None or not self.store.controls(job):  # another replica's job (or paused)
                dirty.discard(job)
                continue
            if job in running or not self._due(st, now):
                continue  # stays dirty: a frame that landed during a run gets its own run
            dirty.discard(job)
            st.last_run, st.urgent = now, False
            task = asyncio.create_task(self._policy_task(st), name=f"rebalancer-policy-{job}")
            running[job] = task
            started.append(task)
        return started

    async def run_due(self) -> int:
        """Start the due policy runs and wait for them (what one ticker step does, awaited)."""
        tasks = self._start_due()
        if tasks:
            await asyncio.gather(*tasks)
        return len(tasks)

    async def _policy_task(self, st: JobState) -> None:
        try:
            async with st.lock:
                await self.policy.run(st)
        except Exception as exc:  # a policy bug must not take ingest down with it
            if isinstance(exc, ConflictError) and self.store.live.ended(st.job):
                return  # the run ended under it (an auto rollback refused): nothing failed
            log_failure(log, f"the policy run for job {st.job}", exc)
            st.status_detail = "the policy failed; see the backend log"
            self.store.publish(st)
        finally:
            self.queue.running.pop(st.job, None)

    async def expire_proposals(self) -> int:
        """Mark proposals older than their TTL expired; returns how many."""
        store = self.store

        def work(s: Session) -> list[str]:
            expired = records.expire_due(s, store.wall())
            s.commit()
            for job in set(expired):
                if (st := store.get(job)) is not None:
                    store.read_facts(s, st)
            return expired

        expired = await store.sql(work)
        for job in set(expired):
            if (st := store.get(job)) is not None:
                store.publish(st)
        return len(expired)
