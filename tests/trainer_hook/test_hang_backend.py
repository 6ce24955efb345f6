"""A rank that stops stepping is named on REST and /metrics within 15 s, with its phase and
Python stack, and the job recovers when steps resume (a real backend; one hook in a thread
of this process, so the test holds its step)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.server import running_server
from tests.helpers.waiting import wait_until
from trainer_hook import RebalanceHook

pytestmark = pytest.mark.multiproc  # a real backend process (make test-unit starts none)

NAMED_WITHIN_S = 15.0


def _stuck_in_the_loss(release: threading.Event) -> None:
    release.wait(60)  # the step holds here until the test lets it go


def _train(server: str, ready: threading.Event, release: threading.Event, done: threading.Event) -> None:
    hook = RebalanceHook(server=server, job="hang-e2e", global_batch_size=4, hang_after_s=1.0)
    try:
        model = hook.attach(torch.nn.Linear(2, 1))
        for k in range(12):
            with hook.step():
                loss = model(torch.zeros(4, 2)).sum()
                if k == 8:  # stuck before its gradients are ready: computing
                    ready.set()
                    _stuck_in_the_loss(release)
                loss.backward()
                time.sleep(0.02)
    finally:
        hook.close()
        done.set()


def test_a_stalled_rank_is_named_then_recovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with running_server(tmp_path) as server:
        ready, release, done = threading.Event(), threading.Event(), threading.Event()
        t = threading.Thread(target=_train, args=(server.url, ready, release, done), daemon=True)
        t.start()
        try:
            assert ready.wait(60), "training did not reach its stalled step"
            stalled_at = time.monotonic()

            def hung() -> Any:
                job: Any = server.get("/api/v1/jobs/hang-e2e")
                return job if job["status"] == "hung" else None

            job = wait_until(hung, "the job to say hung", NAMED_WITHIN_S, interval=0.25)
            assert time.monotonic() - stalled_at <= NAMED_WITHIN_S
            assert (job["hung_rank"], job["hung_batch_index"], job["hung_phase"]) == (0, 8, "compute")
            assert "_stuck_in_the_loss" in job["hung_stack"] and "release.wait(60)" in job["hung_stack"]
            metrics = urlread(server.url + "/metrics")
            assert 'rebalancer_job_hung{job="hang-e2e",rank="0"} 1.0' in metrics
        finally:
            release.set()
        wait_until(lambda: server.get("/api/v1/jobs/hang-e2e")["status"] != "hung",  # type: ignore[index]
                   "the job to recover", 30, interval=0.25)
        assert done.wait(60)


def urlread(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()
