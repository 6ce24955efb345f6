"""The end-of-run report in process: stored when every rank closes normally, built on
demand while a job runs, its sums checked against the steps sent, compare and errors."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from backend.storage.reports import get_report
from tests.backend._app import hello, make_app, metrics, sync
from tests.helpers.waiting import wait_until


def _run(client: TestClient, job: str, *, slow_ms: float, close: bool = True) -> None:
    """Two ranks, 20 steps at 16/16 then 20 steps after a manual placement 24/8 (stored
    windows in between); rank 1 computes ``slow_ms`` per step at 16 samples."""
    app = client.app
    with client.websocket_connect("/ws/hook") as a, client.websocket_connect("/ws/hook") as b:
        for ws, r in ((a, 0), (b, 1)):
            ws.send_text(hello(job=job, rank=r))
            ws.receive_json()
        t0 = time.time() - 10
        a.send_text(metrics(job=job, rank=0, n=20, compute_ms=10.0, step_ms=slow_ms + 5, t0=t0))
        b.send_text(metrics(job=job, rank=1, n=20, compute_ms=slow_ms, step_ms=slow_ms + 5, t0=t0))
        sync(a, hello(job=job, rank=0))
        sync(b, hello(job=job, rank=1))
        app.state.parts.flush_metrics()  # type: ignore[attr-defined]
        if slow_ms >= 30.0:  # rank 1 is 3x slower: the policy proposes before the operator does
            wait_until(lambda: client.get(f"/api/v1/jobs/{job}/proposals").json()["data"],
                       "the policy's proposal", 20)
        placed = client.post(f"/api/v1/jobs/{job}/proposals", json={"shares": [24, 8], "apply": True})
        assert placed.status_code == 201, placed.text
        a.receive_json()
        b.receive_json()
        a.send_text(metrics(job=job, rank=0, first=20, n=20, compute_ms=15.0, step_ms=20.0,
                            local_batch_size=24, t0=t0 + 5))
        b.send_text(metrics(job=job, rank=1, first=20, n=20, compute_ms=slow_ms / 2, step_ms=20.0,
                            local_batch_size=8, t0=t0 + 5))
        sync(a, hello(job=job, rank=0))
        sync(b, hello(job=job, rank=1))
        if not close:
            raise _KeepOpen()


class _KeepOpen(Exception):
    pass


def _stored(client: TestClient, job: str) -> Any:
    return client.app.state.parts.sql.call(lambda s: get_report(s, job))  # type: ignore[attr-defined]


def _report(client: TestClient, job: str, **params: Any) -> dict[str, Any]:
    got = client.get(f"/api/v1/jobs/{job}/report", params=params)
    assert got.status_code == 200, got.text
    return got.json()  # type: ignore[no-any-return]


def test_report_is_stored_when_every_rank_says_goodbye(tmp_path: Path):
    with TestClient(make_app(tmp_path)) as client:
        _run(client, "j", slow_ms=30.0)
        wait_until(lambda: _stored(client, "j") is not None, "the report to be stored", 10)
        r = _report(client, "j")
    assert r["finished"] is True and r["reason"] == "every rank said goodbye"
    assert r["steps"] == 40 and r["samples"] == 40 * 32
    by = {x["rank"]: x for x in r["ranks"]}
    # 20 steps at 16 samples, 20 at 24 (rank 0) or 8 (rank 1): the placements history.
    assert by[0]["mean_local_batch_size"] == pytest.approx(20.0)
    assert by[1]["mean_local_batch_size"] == pytest.approx(12.0)
    assert by[0]["compute_s"] == pytest.approx((20 * 10 + 20 * 15) / 1000)
    assert by[1]["compute_s"] == pytest.approx((20 * 30 + 20 * 15) / 1000)
    assert by[1]["sync_wait_s"] == pytest.approx((20 * 5 + 20 * 5) / 1000)
    assert by[0]["data_wait_ms_per_step"] == pytest.approx(0.5)
    assert [(p["version"], p["source"], p["shares"]) for p in r["placements"]] == [
        (0, "initial", [16, 16]), (1, "manual", [24, 8])]
    assert r["final_shares"] == [24, 8]
    assert r["decisions"] == {"approved": 1, "superseded": 1}  # the policy's, then the manual one
    assert r["cost"]["per_hour"] == pytest.approx(0.1)  # two CPU ranks at 0.05 USD/h
    assert r["cost"]["total"] == pytest.approx(0.1 * r["duration_s"] / 3600, rel=1e-3)
    assert r["samples_per_s"] == pytest.approx(40 * 32 / r["duration_s"], rel=1e-3)
    assert r["savings"] is not None and r["savings"]["measured_s"] > 0
    adv = r["advice"]
    assert [d["rank"] for d in adv["drop"]] == [0, 1]
    assert all(d["advice"].startswith(f"rank {d['rank']} adds ") for d in adv["drop"])


def test_a_running_job_gets_a_report_built_now_and_post_stores_it(tmp_path: Path):
    with TestClient(make_app(tmp_path)) as client:
        with pytest.raises(_KeepOpen), client.websocket_connect("/ws/hook") as extra:
            extra.send_text(hello(job="r", rank=0))
            extra.receive_json()
            _run(client, "r", slow_ms=20.0, close=False)
        # rank 0's second connection is still open: the job is running
        r = _report(client, "r")
        assert r["finished"] is False and r["reason"] == "on demand"
        stored = client.post("/api/v1/jobs/r/report")
        assert stored.status_code == 200
        assert _stored(client, "r")["steps"] == 40


def test_compare_html_and_errors(tmp_path: Path):
    with TestClient(make_app(tmp_path)) as client:
        _run(client, "a", slow_ms=30.0)
        _run(client, "b", slow_ms=20.0)
        both = _report(client, "a", compare="b")
        assert [x["job"] for x in both["data"]] == ["a", "b"] and both["count"] == 2
        page = client.get("/api/v1/jobs/a/report", params={"format": "html", "compare": "b"})
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "Run reports compared: a and b" in page.text
        one = client.get("/api/v1/jobs/a/report", params={"format": "html"}).text
        assert "<script src=" not in one and "Plotly.newPlot" in one  # plotly.js inlined: offline
        assert client.get("/api/v1/jobs/nope/report").json() == {"detail": "Job 'nope' not found."}
        assert client.get("/api/v1/jobs/a/report", params={"compare": "nope"}).status_code == 404
        assert client.post("/api/v1/jobs/nope/report").status_code == 404
        assert client.get("/api/v1/jobs/a/report", params={"format": "pdf"}).status_code == 422
