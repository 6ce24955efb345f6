"""Read routes: job, ranks and metrics resources, filters, 404s, OpenAPI."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.backend._app import hello, make_app, metrics, sync


@pytest.fixture
def client(tmp_path):
    with TestClient(make_app(tmp_path, device_prices={"H100": 3.0, "A100": 2.0})) as c:
        with c.websocket_connect("/ws/hook") as a, c.websocket_connect("/ws/hook") as b:
            a.send_text(hello(rank=0, device_type="H100"))
            a.receive_json()
            b.send_text(hello(rank=1, device_type="cuda", device_name="NVIDIA A100-SXM4-80GB"))
            b.receive_json()
            a.send_text(metrics(rank=0, n=10, compute_ms=10.0, step_ms=40.0))
            b.send_text(metrics(rank=1, n=10, compute_ms=30.0, step_ms=40.0))
            sync(a, hello(rank=0, device_type="H100"))
            sync(b, hello(rank=1, device_type="cuda", device_name="NVIDIA A100-SXM4-80GB"))
        yield c


def test_job_resource(client):
    job = client.get("/api/v1/jobs/j").json()
    assert job["job"] == "j" and job["world_size"] == 2 and job["global_batch_size"] == 32
    assert job["batch_index"] == 9 and job["step_ms"] == 40.0
    assert job["imbalance"] == pytest.approx(0.5) and job["idle_fraction"] == pytest.approx(1 / 3)
    assert job["cost_per_hour"] == pytest.approx(5.0)
    assert job["idle_cost_per_hour"] == pytest.approx(5.0 / 3)
    assert job["placement"] == {"version": 0, "shares": [16, 16]}
    assert job["mode"] == "approve" and job["connected_ranks"] == 0
    listed = client.get("/api/v1/jobs").json()
    assert listed["count"] == 1 and listed["data"][0]["job"] == "j"


def test_ranks_resource(client):
    ranks = client.get("/api/v1/jobs/j/ranks").json()
    assert ranks["count"] == 2
    r0, r1 = ranks["data"]
    assert (r0["share"], r0["compute_ms"], r0["price_per_hour"]) == (16, 10.0, 3.0)
    assert (r1["device_name"], r1["price_per_hour"], r1["sync_wait_ms"]) == ("NVIDIA A100-SXM4-80GB", 2.0, 10.0)


def test_metrics_filters(client):
    everything = client.get("/api/v1/jobs/j/metrics").json()
    assert everything["source"] == "live" and everything["count"] == 20
    one = client.get("/api/v1/jobs/j/metrics", params={"rank": 1, "batch_from": 3, "batch_to": 5}).json()
    assert [(p["rank"], p["batch_index"]) for p in one["data"]] == [(1, 3), (1, 4), (1, 5)]
    both = client.get("/api/v1/jobs/j/metrics?rank=0&rank=1&limit=4").json()
    assert [(p["rank"], p["batch_index"]) for p in both["data"]] == [(0, 8), (1, 8), (0, 9), (1, 9)]
    bad = client.get("/api/v1/jobs/j/metrics", params={"batch_from": 5, "batch_to": 2})
    assert bad.status_code == 400 and bad.json() == {"detail": "batch_from (5) must not exceed batch_to (2)."}


def test_history_source_after_flush(client):
    client.app.state.parts.flush_metrics()
    hist = client.get("/api/v1/jobs/j/metrics", params={"source": "history", "rank": 1}).json()
    assert hist["source"] == "history" and hist["count"] == 1
    assert hist["data"][0]["compute_ms"] == 30.0 and hist["data"][0]["n_steps"] == 10


@pytest.mark.parametrize("path", ["/api/v1/jobs/nope", "/api/v1/jobs/nope/ranks", "/api/v1/jobs/nope/metrics"])
def test_unknown_job_is_404_with_a_sentence(client, path):
    r = client.get(path)
    assert r.status_code == 404 and r.json() == {"detail": "Job 'nope' not found."}


def test_openapi_lists_the_routes(client):
    paths = client.get("/openapi.json").json()["paths"]
    for p in ("/api/v1/jobs", "/api/v1/jobs/{job}", "/api/v1/jobs/{job}/ranks", "/api/v1/jobs/{job}/metrics",
              "/api/v1/tokens", "/api/v1/tokens/{token_id}", "/healthz"):
        assert p in paths
    assert client.get("/docs").status_code == 200


def test_rest_and_the_dashboard_give_a_job_the_same_status(tmp_path):
    """GET /jobs/{job} and the dashboard's row (GET /fleet, the hub's summary) build the
    status rule's inputs one way, whether the controller knows the job or not."""
    import time

    from rebalancer_wire.protocol import Hello

    def both(c: TestClient, job: str) -> tuple[tuple[str, str], tuple[str, str]]:
        rest = c.get(f"/api/v1/jobs/{job}").json()
        row = next(r for r in c.get("/api/v1/fleet").json()["data"] if r["job"] == job)
        return (rest["status"], rest["status_detail"]), (row["status"], row["status_detail"])

    with TestClient(make_app(tmp_path)) as c:
        live = c.app.state.parts.live
        # Live only (a hello the controller has not taken yet), fresh and an hour old.
        for job, age_s, want in (("fresh", 0.0, "warming_up"), ("stale", 3600.0, "idle")):
            live.register(Hello(job=job, rank=0, world_size=1, global_batch_size=8, host="h",
                                device_type="cpu"), now=time.time() - age_s)
            rest, dashboard = both(c, job)
            assert rest == dashboard and rest[0] == want, (job, rest, dashboard)
        # Known to the controller, a rank connected.
        with c.websocket_connect("/ws/hook") as ws:
            sync(ws, hello(job="known"))
            rest, dashboard = both(c, "known")
            assert rest == dashboard, (rest, dashboard)
