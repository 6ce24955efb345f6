"""Savings and the run summary are stored and served over REST after a restart, charts
refill from stored points, and metric history older than the retention is deleted."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from backend.control.policy_runs import PolicyRunner
from backend.parts import build_parts
from backend.settings import Settings
from backend.storage.metrics import RankMetricRow
from backend.storage.summaries import JobMetricRow
from tests.backend._app import hello, make_app, metrics, sync
from tests.helpers.waiting import wait_until, wait_until_async


def _run_job(c: TestClient) -> None:
    """Two ranks, rank 1 three times slower per sample: the uniform split is the slow one."""
    with c.websocket_connect("/ws/hook") as a, c.websocket_connect("/ws/hook") as b:
        for ws, r in ((a, 0), (b, 1)):
            ws.send_text(hello(rank=r))
            ws.receive_json()
        a.send_text(metrics(rank=0, n=20, compute_ms=10.0, step_ms=40.0))
        b.send_text(metrics(rank=1, n=20, compute_ms=30.0, step_ms=40.0))
        sync(a, hello(rank=0))
        sync(b, hello(rank=1))
        parts = c.app.state.parts
        # The policy ticker fits each rank's cost; the hub (ticking once in 100 s here) folds
        # the batches after that, so each gets its uniform-split estimate.
        wait_until(lambda: parts.controller.cost_fit("j") is not None, "the policy to fit the job")
        c.portal.call(parts.hub.notify, "j")
        c.portal.call(parts.hub.tick)
        c.portal.call(parts.persist_now)


def test_the_summary_survives_a_restart_and_charts_refill(tmp_path):
    with TestClient(make_app(tmp_path, device_prices={"cpu": 2.0}, dashboard_max_hz=0.01)) as c:
        _run_job(c)
        live = c.get("/api/v1/jobs/j/summary").json()
    assert live["batch_index"] == 19 and live["cost_per_hour"] == pytest.approx(4.0)
    assert live["measured_s"] == pytest.approx(20 * 0.040)
    assert live["uniform_s"] > 0 and live["saved_s"] == pytest.approx(live["uniform_s"] - live["measured_s"])

    with TestClient(make_app(tmp_path, device_prices={"cpu": 2.0})) as c:  # a restarted backend
        stored = c.get("/api/v1/jobs/j/summary").json()
        for k in ("batch_index", "measured_s", "uniform_s", "saved_s", "saved_cost", "cost_per_hour"):
            assert stored[k] == pytest.approx(live[k]), k
        assert c.get("/api/v1/jobs/nope/summary").json() == {"detail": "Job 'nope' has no summary yet."}
        with c.websocket_connect("/ws/hook") as a:  # the job comes back: its charts refill
            a.send_text(hello(rank=0))
            a.receive_json()
            with c.websocket_connect("/ws/dashboard?job=j") as dash:
                frame = dash.receive_json()
        assert frame["series"]["b"] == list(range(20))
        assert frame["savings"]["saved_s"] == pytest.approx(live["saved_s"])


def test_history_older_than_the_retention_is_deleted_by_the_periodic_task(tmp_path):
    parts = build_parts(Settings(db=f"sqlite:///{tmp_path / 'r.db'}", retention_days=1.0),
                        policy=PolicyRunner(process=False))
    now = time.time()
    with parts.sql.sessions() as s:
        for t in (now - 3 * 86400, now - 2 * 86400, now - 60):
            s.add(RankMetricRow(job="j", rank=0, t_start=t - 1, t_end=t, batch_index_start=0,
                                batch_index_end=1, n_steps=2, placement_version=0, local_batch_size=8,
                                compute_ms=1, sync_wait_ms=1, data_wait_ms=0, optimizer_ms=0, step_ms=2))
            s.add(JobMetricRow(job="j", t=t, batch_index=1, step_ms=2, max_compute_ms=1,
                               mean_compute_ms=1, version=0))
        s.commit()

    def counts() -> tuple[int, int]:
        with parts.sql.sessions() as s:
            return (s.scalar(select(func.count()).select_from(RankMetricRow)),
                    s.scalar(select(func.count()).select_from(JobMetricRow)))

    async def story() -> None:
        await parts.start()  # the retention task runs at start, then every retention_interval_s
        await wait_until_async(lambda: counts() == (1, 1), "the retention task to delete old rows")
        await parts.stop()

    asyncio.run(story())
    assert counts() == (1, 1)
