"""PolicyRunner: where ``backend.policy.decide`` runs for the controller.

At 1,024 ranks one decision is tens to hundreds of milliseconds of numpy and Python; on a
thread of the backend's process it holds the GIL against the event loop (every websocket,
every dashboard tick). With ``process=True`` (setting ``policy_process``, env
``REBALANCER_POLICY_PROCESS``) decisions run in one worker process of their own, started
on first use; the observation and the decision cross as pickles. ``process=False`` runs
them on a worker thread (tests, small jobs). The decide function is passed in, so tests
hand the controller their own instead of patching the module.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from backend.policy.types import (
        Constraints,
        JobObservation,
        NoProposal,
        ObservationRows,
        PolicyConfig,
        Proposal,
    )

    Decide: TypeAlias = Callable[[JobObservation, PolicyConfig, Constraints], "Proposal | NoProposal"]
else:
    Decide = Callable

__all__ = ["PolicyRunner", "default_decide"]


def default_decide(obs: JobObservation, cfg: PolicyConfig, cons: Constraints) -> Proposal | NoProposal:
    """``backend.policy.decide`` (imported here so that the worker process imports numpy once)."""
    from backend.policy import decide

    return decide(obs, cfg, cons)


def _exit_with_parent(parent: int) -> None:
    """Worker initializer: end the worker when the backend is gone. A backend killed with
    SIGKILL runs no shutdown, and the worker's call queue never reports end of file (the
    worker holds the queue's write end too), so it would wait for work forever."""
    from backend.process import on_parent_gone

    on_parent_gone(parent, lambda: os._exit(0))


def _decide_rows(decide: Decide, obs: JobObservation | ObservationRows, cfg: PolicyConfig,
                 cons: Constraints) -> tuple[Proposal | NoProposal, float]:
    """Build the observation's objects (here: in the worker) and decide; also returns the
    seconds that took, timed here, so a worker's start-up is not counted as its cost."""
    from backend.policy.types import ObservationRows

    started = time.perf_counter()
    decision = decide(obs.build() if isinstance(obs, ObservationRows) else obs, cfg, cons)
    return decision, time.perf_counter() - started


def _warm() -> None:
    """Worker start-up work done before the first decision needs it."""
    import backend.policy  # noqa: F401  numpy and the policy's modules


class PolicyRunner:
    """Runs decisions in a worker process (``process=True``) or on a worker thread.

    ``decide_timed`` also says what a decision cost where it ran (building the observation's
    objects and deciding), not the wait for it: the first call in a fresh worker process
    also waits for the process to start and import numpy (about a second on a small
    machine), which is no measure of what the next decision will cost. ``start`` begins
    that start-up early (the controller calls it when a job says hello)."""

    def __init__(self, decide: Decide = default_decide, *, process: bool = False):
        self._decide = decide
        self.process = process
        self._pool: ProcessPoolExecutor | None = None

    def _ensure_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: the backend has threads (SQL gateway, uvicorn); fork would copy their locks.
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_exit_with_parent, initargs=(os.getpid(),))
        return self._pool

    def start(self) -> None:
        """Start the worker process and its imports now, once (nothing to wait for: the first
        decision queues behind them); a no-op on a thread or once started."""
        if self.process and self._pool is None:
            self._ensure_pool().submit(_warm)

    async def decide(self, obs: JobObservation | ObservationRows, cfg: PolicyConfig,
                     cons: Constraints) -> Proposal | NoProposal:
        """``obs`` as objects or as rows (built where the decision runs)."""
        return (await self.decide_timed(obs, cfg, cons))[0]

    async def decide_timed(self, obs: JobObservation | ObservationRows, cfg: PolicyConfig,
                           cons: Constraints) -> tuple[Proposal | NoProposal, float]:
        """The decision and what it cost where it ran, in seconds (per call: runs for
        different jobs may overlap)."""
        if not self.process:
            return await asyncio.to_thread(_decide_rows, self._decide, obs, cfg, cons)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._ensure_pool(), _decide_rows, self._decide, obs, cfg, cons)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
