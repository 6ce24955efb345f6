"""A hung job: the one rule naming its rank (backend.live.hangs), and through ingest: status
``hung`` with the rank, phase, since and stack on REST, the alert's series on /metrics, and
the recovery when steps resume."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from backend.live.hangs import hung_rank
from rebalancer_wire.protocol import Hang, Metrics, StepRecord, encode
from tests.backend._app import hello, make_app, sync


def H(batch: int, phase: str, since: float = 100.0, stack: str = "", nccl_dump: str | None = None) -> Hang:
    return Hang(batch_index=batch, phase=phase, since=since, stalled_s=6.0, stack=stack, nccl_dump=nccl_dump)


def test_the_rank_stalled_outside_the_collective_is_named() -> None:
    got = hung_rank([(0, H(9, "sync_wait")), (1, H(9, "compute", stack="s1")), (2, H(9, "sync_wait"))], [])
    assert got is not None and (got.rank, got.phase, got.stack, got.reported_by) == (1, "compute", "s1", (0, 1, 2))


def test_a_silent_rank_is_named_when_every_report_waits_in_the_collective() -> None:
    got = hung_rank([(0, H(9, "sync_wait")), (2, H(9, "sync_wait"))], [(1, 8, 99.0)])
    assert got is not None and (got.rank, got.batch_index, got.phase, got.stack) == (1, 9, "unknown", "")


def test_a_collective_that_hangs_names_the_lowest_report() -> None:
    got = hung_rank([(1, H(9, "sync_wait")), (0, H(9, "sync_wait"))], [])
    assert got is not None and got.rank == 0
    assert hung_rank([], [(0, 1, 1.0)]) is None


def _steps(job: str, rank: int, first: int, n: int, t0: float) -> str:
    steps = [StepRecord(batch_index=k, local_batch_size=4, placement_version=0, data_wait_ms=1.0, compute_ms=20.0,
                        sync_wait_ms=1.0, optimizer_ms=1.0, step_ms=23.0, t=t0 + (k - first) * 0.03)
             for k in range(first, first + n)]
    return encode(Metrics(job=job, rank=rank, steps=steps))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with TestClient(make_app(tmp_path_factory.mktemp("hangs"))) as c:
        yield c


def test_hung_then_recovered(client):
    t0 = time.time() - 10
    with client.websocket_connect("/ws/hook") as a, client.websocket_connect("/ws/hook") as b:
        ha, hb = hello(job="stuck", rank=0, global_batch_size=8), hello(job="stuck", rank=1, global_batch_size=8)
        for ws, h in ((a, ha), (b, hb)):
            ws.send_text(h)
            ws.receive_json()
        a.send_text(_steps("stuck", 0, 0, 10, t0))
        b.send_text(_steps("stuck", 1, 0, 10, t0))
        since = t0 + 0.3
        a.send_text(encode(Metrics(job="stuck", rank=0, hang=H(10, "sync_wait", since))))
        b.send_text(encode(Metrics(job="stuck", rank=1, hang=H(10, "data_wait", since, stack='File "train.py", line 12',
                                                               nccl_dump="/scratch/fr/comm_lib_trace_rank_1"))))
        for ws, h in ((a, ha), (b, hb)):
            sync(ws, h)
        job = client.get("/api/v1/jobs/stuck").json()
        assert job["status"] == "hung"
        assert (job["hung_rank"], job["hung_batch_index"], job["hung_phase"]) == (1, 10, "data_wait")
        assert job["hung_since"] == pytest.approx(since) and job["hung_stack"] == 'File "train.py", line 12'
        assert job["hung_nccl_dump"] == "/scratch/fr/comm_lib_trace_rank_1"  # the named rank's own dump
        assert job["status_detail"].startswith("rank 1 stopped stepping at batch 10 (data_wait) ")
        assert job["status_detail"].endswith(" s ago; 2 rank(s) report a stall")
        text = client.get("/metrics").text
        assert 'rebalancer_job_hung{job="stuck",rank="1"} 1.0' in text
        assert 'rebalancer_job_hung{job="stuck",rank="0"} 0.0' in text  # every rank has the series
        # Steps resume: the job is no longer hung, and the series says 0.
        a.send_text(_steps("stuck", 0, 10, 3, since + 20))
        b.send_text(_steps("stuck", 1, 10, 3, since + 20))
        for ws, h in ((a, ha), (b, hb)):
            sync(ws, h)
        job = client.get("/api/v1/jobs/stuck").json()
        assert job["status"] != "hung" and job.get("hung_rank") is None and job.get("hung_nccl_dump") is None
        text = client.get("/metrics").text
        assert 'rebalancer_job_hung{job="stuck",rank="1"} 0.0' in text and " 1.0" not in [
            line[line.rindex(" "):] for line in text.splitlines() if line.startswith("rebalancer_job_hung{")]
