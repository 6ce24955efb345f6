"""REST: each rank's communication (``/ranks``) and what bounds the job (``bound``)."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from rebalancer_wire.protocol import Metrics, StepRecord, encode
from tests.backend._app import hello, make_app, sync

N = 10
MB = 2_000_000


def _frame(job: str, rank: int, compute: float, sync_wait: float, comm_ms: float | None, nbytes: int | None) -> str:
    t0 = time.time()
    steps = [StepRecord(batch_index=k, local_batch_size=16, placement_version=0, data_wait_ms=0.5,
                        compute_ms=compute, sync_wait_ms=sync_wait, optimizer_ms=1.0,
                        step_ms=0.5 + compute + sync_wait + 1.0, t=t0 + k * 0.05,
                        comm_bytes=nbytes, comm_ms=comm_ms) for k in range(N)]
    return encode(Metrics(job=job, rank=rank, steps=steps, dropped=0))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with TestClient(make_app(tmp_path_factory.mktemp("comm_api"))) as c:
        with c.websocket_connect("/ws/hook") as a, c.websocket_connect("/ws/hook") as b, \
                c.websocket_connect("/ws/hook") as x:
            ha, hb = hello(job="ar", rank=0, comm_kind="all_reduce"), hello(job="ar", rank=1, comm_kind="all_reduce")
            hx = hello(job="plain", rank=0, world_size=1, global_batch_size=16)
            for ws, h in ((a, ha), (b, hb), (x, hx)):
                ws.send_text(h)
                ws.receive_json()
            # Rank 1 computes 30 ms and arrives last; 4 ms of transfer, 3 exposed; rank 0 waits 20 ms.
            a.send_text(_frame("ar", 0, 10.0, 23.0, 24.0, MB))
            b.send_text(_frame("ar", 1, 30.0, 3.0, 4.0, MB))
            x.send_text(_frame("plain", 0, 10.0, 0.0, None, None))
            for ws, h in ((a, ha), (b, hb), (x, hx)):
                sync(ws, h)
        yield c


def test_ranks_carry_bytes_time_wait_and_busbw(client):
    r0, r1 = client.get("/api/v1/jobs/ar/ranks").json()["data"]
    assert r0["comm_bytes_per_step"] == MB and r1["comm_bytes_per_step"] == MB
    assert (r0["comm_ms"], r0["wait_ms"]) == (pytest.approx(24.0), pytest.approx(20.0))
    assert (r1["comm_ms"], r1["wait_ms"]) == (pytest.approx(4.0), pytest.approx(0.0))
    # 2 MB in 4 ms: algbw 0.5 GB/s, busbw x 2(2-1)/2 = 0.5
    assert r0["busbw_gbps"] == pytest.approx(0.5) and r1["busbw_gbps"] == pytest.approx(0.5)


def test_the_job_says_what_bounds_it_with_figures(client):
    bound = client.get("/api/v1/jobs/ar").json()["bound"]
    assert bound["verdict"] == "compute-bound" and bound["kind"] == "all_reduce"
    assert bound["step_ms"] == pytest.approx(34.5) and bound["compute_ms"] == 30.0
    assert bound["exposed_comm_ms"] == 3.0 and bound["transfer_ms"] == 4.0
    assert bound["comm_share"] == pytest.approx(3 / 34.5) and bound["busbw_gbps"] == pytest.approx(0.5)
    assert bound["n_steps"] == N
    assert bound["detail"].startswith("compute-bound: 34.5 ms step; compute 87%; 9% of the step is exposed "
                                      "all-reduce at 0.5 GB/s busbw")


def test_absent_counters_are_null(client):
    (r,) = client.get("/api/v1/jobs/plain/ranks").json()["data"]
    assert (r["comm_bytes_per_step"], r["comm_ms"], r["wait_ms"], r["busbw_gbps"]) == (None, None, None, None)
    bound = client.get("/api/v1/jobs/plain").json()["bound"]
    assert bound["busbw_gbps"] is None and bound["comm_bytes_per_step"] is None and bound["kind"] is None


def test_metrics_carry_bytes_busbw_exposed_seconds_and_the_verdict(client):
    text = client.get("/metrics").text
    lines = set(text.splitlines())
    assert 'rebalancer_rank_comm_bytes{job="ar",rank="0"} 2000000.0' in lines
    assert 'rebalancer_rank_comm_wait_seconds{job="ar",rank="0"} 0.02' in lines
    assert 'rebalancer_rank_bus_bandwidth_bytes_per_second{job="ar",rank="1"} 500000000.0' in lines
    assert 'rebalancer_exposed_comm_seconds{job="ar"} 0.003' in lines
    assert 'rebalancer_bound{job="ar",bound="compute-bound"} 1.0' in lines
    assert 'rebalancer_bound{job="ar",bound="communication-bound"} 0.0' in lines
    assert 'rebalancer_rank_comm_bytes{job="plain",rank="0"}' not in text  # absent, not 0


def test_the_run_report_carries_the_verdict_and_each_ranks_communication(client):
    report = client.post("/api/v1/jobs/ar/report").json()
    comm = report["communication"]
    assert comm["verdict"] == "compute-bound" and comm["busbw_gbps"] == pytest.approx(0.5)
    assert [(r["rank"], r["comm_bytes_per_step"]) for r in comm["ranks"]] == [(0, MB), (1, MB)]
    assert comm["ranks"][0]["wait_ms"] == pytest.approx(20.0)
    page = client.get("/api/v1/jobs/ar/report", params={"format": "html"}).text
    assert "<h2>Communication</h2>" in page and "compute-bound" in page


def test_the_fleet_view_shows_the_same_verdict(client):
    rows = {r["job"]: r for r in client.get("/api/v1/fleet").json()["data"]}
    for job in ("ar", "plain"):  # the one rule: the fleet row says what the job's REST says
        assert rows[job]["bound"] == client.get(f"/api/v1/jobs/{job}").json()["bound"]["verdict"]
    assert rows["ar"]["bound"] == "compute-bound"
