"""The one status rule, and decisions in the policy's worker process."""

from __future__ import annotations

import asyncio

import pytest

from backend.control.policy_runs import PolicyRunner
from backend.control.status import NEVER_CONNECTED, job_status
from backend.policy.types import (
    Constraints,
    JobObservation,
    PolicyConfig,
    Proposal,
    RankObservation,
    StepSample,
)

PENDING = {"id": 7, "status": "proposed", "reason": "rank 2 is slower"}


def _status(**kw):
    args = {"verdict": "balanced", "detail": "even", "pending": None, "connected_ranks": 2,
            "metrics_age_s": 1.0, "stale_after_s": 30.0, **kw}
    return job_status(**args)


def test_status_rule_in_order_of_precedence():
    assert _status(connected_ranks=None) == NEVER_CONNECTED
    assert _status(connected_ranks=0, pending=PENDING) == ("idle", "no rank is connected")
    assert _status(metrics_age_s=31.0, pending=PENDING) == ("idle", "no metrics from the job recently")
    assert _status(pending=PENDING) == ("proposal_pending", "proposal 7 is proposed: rank 2 is slower")
    assert _status() == ("balanced", "even")
    assert _status(metrics_age_s=None, verdict="warming_up", detail="w") == ("warming_up", "w")
    with pytest.raises(ValueError, match="Unknown job status verdict 'fine'"):
        _status(verdict="fine")


def _observation() -> JobObservation:
    per_sample = (1.0, 1.0, 4.0)
    ranks = tuple(
        RankObservation(rank=r, device_type="cpu",
                        steps=tuple(StepSample(batch_index=k, local_batch_size=16,
                                               compute_ms=per_sample[r] * 16) for k in range(30)))
        for r in range(3))
    return JobObservation(job="j", world_size=3, global_batch_size=48, batch_index=29, shares=(16, 16, 16),
                          placement_version=0, steps_since_change=30, ranks=ranks)


@pytest.mark.multiproc
def test_decisions_in_the_worker_process_match_the_thread():
    obs, cfg = _observation(), PolicyConfig(strategy="profiled", min_steps=5)

    async def both():
        proc, thread = PolicyRunner(process=True), PolicyRunner(process=False)
        try:
            return await proc.decide(obs, cfg, Constraints()), await thread.decide(obs, cfg, Constraints())
        finally:
            proc.close()

    in_process, on_thread = asyncio.run(both())
    assert isinstance(in_process, Proposal) and in_process == on_thread
    assert in_process.shares[2] < 16


@pytest.mark.multiproc
def test_a_decision_costs_its_own_time_not_the_worker_start():
    """The scheduler spaces a job's runs by five times their cost. The first decision in a
    fresh worker process also pays for spawning it and importing numpy (about a second
    here): counted as the decision's cost, it held a short-step job's warm-up runs back for
    seconds, and the first proposal came 40 steps late (bench.tokens --real, B=16). The cost
    is measured where the decision runs; both figures come from the same call."""
    import time

    obs, cfg = _observation(), PolicyConfig(strategy="profiled", min_steps=5)

    async def first_call() -> tuple[float, float]:
        runner = PolicyRunner(process=True)
        try:
            started = time.perf_counter()
            _, cost = await runner.decide_timed(obs, cfg, Constraints())
            return time.perf_counter() - started, cost
        finally:
            runner.close()

    wall, cost = asyncio.run(first_call())
    assert 0 < cost < wall / 3, (cost, wall)


_KILLED_PARENT = """
import asyncio, sys
from backend.control.policy_runs import PolicyRunner
from backend.policy.types import Constraints, PolicyConfig
from tests.backend.test_status_and_policy_runs import _observation

async def main():
    runner = PolicyRunner(process=True)
    await runner.decide(_observation(), PolicyConfig(strategy="profiled", min_steps=5), Constraints())
    print(*runner._pool._processes, flush=True)  # the worker's pid
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.multiproc
def test_the_policy_worker_exits_when_the_backend_is_killed():
    """SIGKILL of the backend (the fault suite does it; so does an OOM killer) must not leave
    its policy process running forever."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from tests.helpers.torchrun import REPO_ROOT
    from tests.helpers.waiting import wait_gone

    parent = subprocess.Popen([sys.executable, "-c", _KILLED_PARENT], cwd=REPO_ROOT, text=True,
                              stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    try:
        worker = int(parent.stdout.readline())  # type: ignore[union-attr]
        assert psutil.pid_exists(worker)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        wait_gone(worker, "the orphaned policy worker to exit", 20)
    finally:
        if parent.poll() is None:
            parent.kill()
        try:
            psutil.Process(worker).kill()
        except (psutil.NoSuchProcess, UnboundLocalError):
            pass
