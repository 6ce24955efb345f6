"""REST ``GET /api/v1/jobs/{job}/causes``: the replay of the live windows, largest first, and
the phases through ingest to the ranks' view."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rebalancer_wire.protocol import Metrics, StepRecord, encode
from tests.backend._app import hello, make_app, sync

N = 10


def _frame(job: str, rank: int, *, data_wait: float, host: float | None, gc: tuple[float, float, float] | None,
           sync_wait: float, clock_off_s: float = 0.0, step_ms: float | None = None) -> str:
    t0 = time.time() + clock_off_s
    steps = [StepRecord(batch_index=k, local_batch_size=4, placement_version=0, data_wait_ms=data_wait,
                        compute_ms=40.0, sync_wait_ms=sync_wait, optimizer_ms=5.0,
                        step_ms=step_ms if step_ms is not None else data_wait + 40.0 + sync_wait + 5.0,
                        t=t0 + k * 0.08, host_ms=host, gc_ms=gc) for k in range(N)]
    return encode(Metrics(job=job, rank=rank, steps=steps, dropped=0))


def _two_ranks(c: TestClient, job: str, rank0: dict[str, Any], rank1: dict[str, Any]) -> None:
    """Ranks 0 and 1 of ``job`` say hello, send one frame each (``_frame``'s keywords in
    ``rank0`` and ``rank1``) and wait until the backend has folded them."""
    with c.websocket_connect("/ws/hook") as a, c.websocket_connect("/ws/hook") as b:
        ha, hb = hello(job=job, rank=0), hello(job=job, rank=1)
        for ws, h in ((a, ha), (b, hb)):
            ws.send_text(h)
            ws.receive_json()
        a.send_text(_frame(job, 0, **rank0))
        b.send_text(_frame(job, 1, **rank1))
        for ws, h in ((a, ha), (b, hb)):
            sync(ws, h)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with TestClient(make_app(tmp_path_factory.mktemp("causes_api"))) as c:
        # Rank 1 waits 30 ms for its loader (32 ms before the step, 2 of them its own host
        # work) and pauses 4 ms for GC; rank 0 arrives 30 ms early and waits.
        rank0 = {"data_wait": 2.0, "host": 0.0, "gc": None, "sync_wait": 33.0}
        rank1 = {"data_wait": 32.0, "host": 2.0, "gc": (1.0, 0.0, 3.0), "sync_wait": 3.0}
        _two_ranks(c, "slow-input", rank0=rank0, rank1=rank1)
        # The same steps from hosts whose clocks disagree (rank 0's 2 days behind, rank 1's
        # 40 minutes ahead: both within what the edge accepts) ...
        _two_ranks(c, "skewed-clocks", rank0={**rank0, "clock_off_s": -2 * 86400},
                   rank1={**rank1, "clock_off_s": 40 * 60})
        # ... and from a hook whose parts add up to twice its step (the main parts are not
        # checked against the step at the edge: device timers may overlap them).
        _two_ranks(c, "parts-off", rank0={**rank0, "step_ms": 40.0}, rank1={**rank1, "step_ms": 40.0})
        yield c


def test_clock_skew_between_hosts_does_not_move_the_causes(client):
    # The replay aligns ranks by batch index, never by their clocks.
    skewed = client.get("/api/v1/jobs/skewed-clocks/causes").json()
    plain = client.get("/api/v1/jobs/slow-input/causes").json()
    assert [(c["cause"], c["ranks"]) for c in skewed["data"]] == [(c["cause"], c["ranks"]) for c in plain["data"]]
    for got, want in zip(skewed["data"], plain["data"], strict=True):
        assert got["ms_per_step"] == pytest.approx(want["ms_per_step"])
    assert skewed["window_steps"] == N


def test_parts_that_do_not_add_up_stay_bounded_and_show_as_the_replays_error(client):
    body = client.get("/api/v1/jobs/parts-off/causes").json()
    assert body["step_ms"] == pytest.approx(40.0)  # what the hooks measured
    assert body["replayed_step_ms"] == pytest.approx(80.0)  # what their parts add up to: the gap is visible
    for c in body["data"]:
        assert 0.0 <= c["share_of_step"] <= 1.0
        assert 0.0 <= c["predicted_step_ms_without"] <= body["replayed_step_ms"]
    assert body["data"][0]["cause"] == "data_wait" and body["data"][0]["ms_per_step"] == pytest.approx(30.0)


def test_causes_come_largest_first_with_the_named_fields(client):
    body = client.get("/api/v1/jobs/slow-input/causes").json()
    assert body["count"] == len(body["data"]) == 3
    assert [c["cause"] for c in body["data"]] == ["data_wait", "gc", "host"]
    top = body["data"][0]
    assert set(top) >= {"cause", "ranks", "ms_per_step", "share_of_step", "gpu_hours_lost",
                        "predicted_step_ms_without", "remedy"}
    assert top["ranks"] == [1]
    assert top["ms_per_step"] == pytest.approx(30.0)
    assert top["predicted_step_ms_without"] == pytest.approx(50.0)
    assert top["share_of_step"] == pytest.approx(30.0 / 80.0)
    assert top["gpu_hours_lost"] == pytest.approx(30.0 * N * 2 / 3.6e6)
    assert body["window_steps"] == N and body["step_ms"] == pytest.approx(80.0)
    assert body["replayed_step_ms"] == pytest.approx(80.0)
    assert body["gc_share"] == pytest.approx(4.0 / 80.0)
    assert body["hint"].startswith("GC pauses cost 5% of the step: RebalanceHook(gc_freeze=True")


def test_unknown_job_is_404(client):
    r = client.get("/api/v1/jobs/nope/causes")
    assert r.status_code == 404
    assert r.json() == {"detail": "Job 'nope' is not live; causes come from its recent steps."}


def test_ranks_view_carries_the_phases(client):
    view = client.app.state.parts.live.view("slow-input") if hasattr(client.app.state, "parts") else None
    if view is None:
        pytest.skip("the app keeps its parts elsewhere")
    r1 = view.ranks[1]
    assert (r1.host_ms, r1.gc_ms, r1.ckpt_ms) == (pytest.approx(2.0), pytest.approx(4.0), 0.0)


def test_goodput_on_the_job_the_fleet_and_metrics(client):
    job = client.get("/api/v1/jobs/slow-input").json()
    assert job["goodput"] == pytest.approx(40.0 / 80.0)  # both ranks compute 40 ms of an 80 ms step
    assert 'rebalancer_goodput_ratio{job="slow-input"} 0.5' in client.get("/metrics").text
    body = client.get("/api/v1/jobs/slow-input/causes").json()
    cost_h, done = job["cost_per_hour"], job["batch_index"] + 1
    for c in body["data"]:  # its time lost per step, over the steps done, at the job's hourly cost
        assert c["cost_lost"] == (None if cost_h is None else pytest.approx(c["ms_per_step"] * done / 3.6e6 * cost_h))


def test_the_cli_prints_the_causes_as_a_table(client):
    from backend.client.commands import _causes_text

    text = _causes_text("slow-input", client.get("/api/v1/jobs/slow-input/causes").json())
    lines = text.splitlines()
    assert lines[0] == "Job slow-input: 10 recent steps, 80.0 ms a step (replay 80.0 ms)"
    assert lines[1].startswith("  GC pauses cost 5% of the step")
    assert lines[2].split() == ["CAUSE", "RANKS", "ms/STEP", "SHARE", "GPU-h", "LOST", "STEP", "WITHOUT", "ms"]
    assert lines[3].split()[:4] == ["data_wait", "1", "30.0", "37.5%"]
    assert any(line.startswith("data_wait: The loader keeps ranks waiting") for line in lines)
