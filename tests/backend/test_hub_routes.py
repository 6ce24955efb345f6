"""The dashboard's routes in the real app: pages, static files, plotly, /ws/dashboard auth
and frames fed through /ws/hook, whoami and forecast."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from backend.assets import plotly_js_path
from rebalancer_wire.protocol import Metrics, encode
from tests.backend._app import hello, metrics, steps, sync
from tests.conftest import ADMIN
from tests.helpers.waiting import wait_until


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture
def client(app_client):
    return app_client


def _token(client: TestClient, role: str, job: str | None = None) -> str:
    r = client.post("/api/v1/tokens", json={"role": role, "job": job}, headers=_bearer(ADMIN))
    assert r.status_code == 201, r.text
    return r.json()["secret"]


def test_pages_and_static_files(client):
    for path in ("/", "/job/some-job"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        # Each page's body in the one layout: the head they share, the title their own.
        assert r.text.startswith("<!doctype html>") and 'href="/static/css/app.css"' in r.text
    assert "<title>Rebalancer · fleet</title>" in client.get("/").text
    assert 'src="/static/plotly.min.js"' in client.get("/job/x").text
    js = client.get("/static/js/job.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert client.get("/static/css/app.css").headers["content-type"].startswith("text/css")
    plotly = client.get("/static/plotly.min.js")
    assert plotly.status_code == 200 and len(plotly.content) == plotly_js_path().stat().st_size
    assert client.get("/static/nope.js").json() == {"detail": "No static file 'nope.js'."}
    # Nothing outside frontend/ is reachable, however the path is spelled.
    for evil in ("/static/../backend/settings.py", "/static/%2e%2e/backend/settings.py",
                 "/static/..%2fpyproject.toml"):
        assert client.get(evil).status_code == 404


def test_dashboard_socket_refuses_missing_bad_and_hook_tokens(client):
    for query in ("", "?token=wrong"):
        with client.websocket_connect(f"/ws/dashboard{query}") as ws, pytest.raises(WebSocketDisconnect) as exc:
            ws.receive_text()
        assert exc.value.code == 4401
    hook = _token(client, "hook", job="j")
    with client.websocket_connect(f"/ws/dashboard?token={hook}") as ws, pytest.raises(WebSocketDisconnect) as exc:
        ws.receive_text()
    assert exc.value.code == 4403


def test_dashboard_socket_streams_a_fed_job(client):
    viewer = _token(client, "viewer")
    with client.websocket_connect("/ws/hook", headers=_bearer(ADMIN)) as h0, \
            client.websocket_connect("/ws/hook", headers=_bearer(ADMIN)) as h1:
        for rank, ws in enumerate((h0, h1)):
            ws.send_text(hello(rank=rank))
            ws.receive_text()  # the placement in force
        with client.websocket_connect(f"/ws/dashboard?job=j&token={viewer}") as dash:
            first = dash.receive_json()
            assert first["type"] == "job" and first["full"] is True and first["job"] == "j"
            seen: list[int] = []
            control = first["control"]
            deadline = time.monotonic() + 20
            b = 0
            while len(seen) < 20 and time.monotonic() < deadline:
                h0.send_text(metrics(rank=0, first=b, n=5, compute_ms=10.0))
                h1.send_text(metrics(rank=1, first=b, n=5, compute_ms=30.0, step_ms=40.0))
                b += 5
                frame = dash.receive_json()
                seen += frame["series"]["b"]
                control = frame.get("control", control)  # sent again only when it changed
            assert seen[:20] == list(range(20))  # every batch once, in order, across deltas
            assert frame["ranks"]["rank"] == [0, 1]
            assert frame["ranks"]["compute_ms"] == [10.0, 30.0]
            assert control["placement"]["shares"] == [16, 16]
        with client.websocket_connect(f"/ws/dashboard?token={viewer}") as overview:
            jobs = overview.receive_json()["jobs"]
            assert [j["job"] for j in jobs] == ["j"] and jobs[0]["world_size"] == 2


def test_whoami_and_forecast(client):
    viewer, operator = _token(client, "viewer"), _token(client, "operator")
    assert client.get("/api/v1/whoami").status_code == 401
    me = client.get("/api/v1/whoami", headers=_bearer(viewer)).json()
    assert me["role"] == "viewer" and me["operator"] is False and me["open_mode"] is False
    assert client.get("/api/v1/whoami", headers=_bearer(operator)).json()["operator"] is True
    assert client.get("/api/v1/jobs/j/forecast", headers=_bearer(viewer)).json() == {"detail": "Job 'j' not found."}
    with client.websocket_connect("/ws/hook", headers=_bearer(ADMIN)) as h0:
        h0.send_text(hello(rank=0, world_size=1, device_type="H100"))
        h0.receive_text()
        h0.send_text(metrics(rank=0, first=0, n=10, step_ms=100.0))
        def forecast():
            f = client.get("/api/v1/jobs/j/forecast?total_steps=1010", headers=_bearer(viewer)).json()
            return f if f["batch_index"] == 9 else None

        f = wait_until(forecast, "the forecast to see batch 9", timeout=10, interval=0.05)
    assert f["remaining_steps"] == 1000 and f["eta_seconds"] == pytest.approx(100.0)
    assert f["eta_s"] == f["eta_seconds"]  # the deprecated name, kept
    assert f["cost_per_hour"] == pytest.approx(3.0)  # the H100 default price
    assert f["cost_to_finish"] == pytest.approx(3.0 * 100 / 3600)
    bad = client.get("/api/v1/jobs/j/forecast?total_steps=0", headers=_bearer(viewer))
    assert bad.status_code == 422


def test_eta_from_the_total_steps_the_hooks_report(client):
    viewer = _token(client, "viewer")
    auth = _bearer(viewer)
    with client.websocket_connect("/ws/hook", headers=_bearer(ADMIN)) as h0:
        h0.send_text(hello(rank=0, world_size=1, total_steps=1010))
        h0.receive_text()
        h0.send_text(metrics(rank=0, first=0, n=10, step_ms=100.0))
        sync(h0, hello(rank=0, world_size=1))  # a hello without total_steps keeps the known one
        job = client.get("/api/v1/jobs/j", headers=auth).json()
        assert job["batch_index"] == 9 and job["total_steps"] == 1010
        assert job["eta_s"] == pytest.approx(1000 * 0.1)
        f = client.get("/api/v1/jobs/j/forecast", headers=auth).json()
        assert f["total_steps"] == 1010 and f["remaining_steps"] == 1000
        assert f["eta_seconds"] == pytest.approx(100.0) == job["eta_s"]  # the job's (deprecated) copy agrees
        # The loop learns a longer run (set_total_steps): metrics carry the new total.
        h0.send_text(encode(Metrics(job="j", rank=0, steps=steps(10, 10, step_ms=100.0), total_steps=2020)))
        sync(h0, hello(rank=0, world_size=1))
        job = client.get("/api/v1/jobs/j", headers=auth).json()
        assert job["total_steps"] == 2020 and job["eta_s"] == pytest.approx(2000 * 0.1)
        # The query parameter still wins over the reported total.
        f = client.get("/api/v1/jobs/j/forecast?total_steps=120", headers=auth).json()
        assert f["remaining_steps"] == 100 and f["eta_seconds"] == pytest.approx(10.0)
        # An invalid total is refused like any malformed frame; the connection's job is untouched.
        h0.send_text(encode(Metrics(job="j", rank=0, steps=steps(20, 1))).replace('"dropped":0', '"dropped":0,"total_steps":0'))
        err = h0.receive_json()
        assert err["type"] == "error" and "'total_steps' must be between 1 and 2147483647, got 0." in err["message"]
    with client.websocket_connect("/ws/hook", headers=_bearer(ADMIN)) as h0:
        h0.send_text(hello(rank=0, world_size=1))
        h0.receive_text()
        assert client.get("/api/v1/jobs/j", headers=auth).json()["total_steps"] == 2020
