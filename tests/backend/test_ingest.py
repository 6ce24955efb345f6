"""/ws/hook in process: the conversation, bad frames, and isolation between connections."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from rebalancer_wire.protocol import MAX_MESSAGE_BYTES, Ack, Hello, Metrics, Reject, encode
from tests.backend._app import hello, make_app, metrics, steps, sync


@pytest.fixture
def client(tmp_path):
    with TestClient(make_app(tmp_path)) as c:
        yield c


def _closed(ws) -> tuple[int, str]:
    """Read until the server closes; returns (close code, reason)."""
    while True:
        msg = ws.receive()
        if msg["type"] == "websocket.close":
            return msg["code"], msg.get("reason", "")


def test_hello_gets_placement_then_metrics_reach_live_state(client):
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello(rank=1, world_size=2, global_batch_size=32))
        reply = ws.receive_json()
        assert reply["type"] == "placement"
        assert reply["version"] == 0 and reply["shares"] == [16, 16]
        ws.send_text(metrics(rank=1, first=0, n=7, compute_ms=12.0, dropped=3))
        ws.send_text(encode(Ack(job="j", rank=1, version=0, batch_index=0)))
        sync(ws, hello(rank=1, world_size=2, global_batch_size=32))
        # The placement reply follows registration, so the rank reads as connected now.
        rank = client.get("/api/v1/jobs/j/ranks").json()["data"][0]
        assert rank["connected"] is True
    ranks = client.get("/api/v1/jobs/j/ranks").json()
    assert ranks["count"] == 1
    r = ranks["data"][0]
    assert (r["rank"], r["batch_index"], r["n_steps"], r["dropped"]) == (1, 6, 7, 3)
    assert r["compute_ms"] == pytest.approx(12.0)
    assert r["connected"] is False


@pytest.mark.parametrize(
    "frame, code, close",
    [
        ("{not json", "malformed", 4002),
        (json.dumps({"type": "hello", "v": 99, "job": "j"}), "unsupported_version", 4001),
        (json.dumps({"type": "nonsense", "v": 1}), "malformed", 4002),
        (json.dumps({"type": "hello", "v": 1, "job": "j", "rank": 5, "world_size": 2,
                     "global_batch_size": 8}), "malformed", 4002),
        (metrics(), "malformed", 4002),  # metrics before hello
    ],
    ids=["bad-json", "version", "unknown-type", "rank-out-of-range", "metrics-first"],
)
def test_bad_first_frames_get_error_and_close_code(client, frame, code, close):
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(frame)
        err = ws.receive_json()
        assert err["type"] == "error" and err["code"] == code and err["message"]
        assert _closed(ws)[0] == close


def test_first_frame_must_be_hello_says_so(client):
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(metrics())
        assert ws.receive_json()["message"] == "The first message must be 'hello', got 'metrics'."


def test_oversized_frame_gets_1009_and_others_keep_serving(client):
    with client.websocket_connect("/ws/hook") as good:
        good.send_text(hello(rank=0))
        good.receive_json()
        with client.websocket_connect("/ws/hook") as bad:
            bad.send_text(hello(rank=1))
            bad.receive_json()
            bad.send_text("x" * (MAX_MESSAGE_BYTES + 1))
            err = bad.receive_json()
            assert err["code"] == "too_big" and str(MAX_MESSAGE_BYTES) in err["message"]
            assert _closed(bad)[0] == 1009
        good.send_text(metrics(rank=0, n=4))
        good.send_text(metrics(rank=0, first=4, n=4))
        sync(good, hello(rank=0))
    data = client.get("/api/v1/jobs/j/ranks").json()["data"]
    by_rank = {r["rank"]: r for r in data}
    assert by_rank[0]["n_steps"] == 8
    assert by_rank[1]["n_steps"] == 0


def test_malformed_step_inside_metrics_is_refused_whole(client):
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello())
        ws.receive_json()
        frame = json.loads(metrics(n=3))
        frame["steps"][1]["compute_ms"] = -1
        ws.send_text(json.dumps(frame))
        err = ws.receive_json()
        assert err["message"] == "'compute_ms' must be a number between 0 and 86400000, got -1.0."
        assert _closed(ws)[0] == 4002
    assert client.get("/api/v1/jobs/j/ranks").json()["data"][0]["n_steps"] == 0


def test_frames_for_another_rank_or_placement_from_hook_are_refused(client):
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello(rank=0))
        ws.receive_json()
        ws.send_text(metrics(rank=1))
        err = ws.receive_json()
        assert err["message"] == "This connection speaks for job 'j' rank 0; got a 'metrics' for job 'j' rank 1."
        assert _closed(ws)[0] == 4002
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello(rank=0))
        placement = ws.receive_text()
        ws.send_text(placement)
        assert ws.receive_json()["message"] == "Hooks may not send 'placement' messages; expected metrics, ack, reject, oom or leave."


def test_reject_is_accepted_and_connection_stays_open(client):
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello())
        ws.receive_json()
        ws.send_text(encode(Reject(job="j", rank=0, version=7, reason="older than the one in force")))
        ws.send_text(metrics(n=2))
        sync(ws, hello())
    assert client.get("/api/v1/jobs/j/ranks").json()["data"][0]["n_steps"] == 2


def test_reconnect_of_same_rank_replaces_old_socket(client):
    with client.websocket_connect("/ws/hook") as first:
        first.send_text(hello())
        first.receive_json()
        with client.websocket_connect("/ws/hook") as second:
            second.send_text(hello())
            second.receive_json()
            assert _closed(first)[0] == 1000
            # The old handler's exit must not mark the rank disconnected under the new socket.
            assert client.get("/api/v1/jobs/j/ranks").json()["data"][0]["connected"] is True
            second.send_text(metrics(n=3))
            sync(second, hello())
    assert client.get("/api/v1/jobs/j/ranks").json()["data"][0]["n_steps"] == 3


def test_prometheus_metrics_reflect_ingest(client):
    with client.websocket_connect("/ws/hook") as a, client.websocket_connect("/ws/hook") as b:
        a.send_text(hello(rank=0))
        a.receive_json()
        b.send_text(hello(rank=1))
        b.receive_json()
        a.send_text(metrics(rank=0, n=5, compute_ms=10.0, step_ms=40.0, dropped=2))
        b.send_text(metrics(rank=1, n=5, compute_ms=30.0, step_ms=40.0))
        sync(a, hello(rank=0))
        sync(b, hello(rank=1))
        assert "rebalancer_hook_connections 2.0" in client.get("/metrics").text
    # Every frame was handled before the syncs returned.
    text = client.get("/metrics").text
    assert 'rebalancer_rank_compute_seconds{job="j",rank="0"} 0.01' in text
    assert 'rebalancer_rank_compute_seconds{job="j",rank="1"} 0.03' in text
    assert 'rebalancer_imbalance_ratio{job="j"} 0.5' in text  # 30 / mean(10, 30) - 1
    assert 'rebalancer_placement_version{job="j"} 0.0' in text
    assert "rebalancer_ingest_messages_total 2.0" in text
    assert "rebalancer_dropped_records_total 2.0" in text
    assert 'rebalancer_step_seconds{job="j"} 0.04' in text


def test_a_version_1_hook_is_answered_in_version_1(client):
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(encode(Hello(job="old", rank=0, world_size=1, global_batch_size=8), 1))
        reply = ws.receive_json()
        assert (reply["type"], reply["v"], reply["shares"]) == ("placement", 1, [8])
        ws.send_text(encode(Metrics(job="old", rank=0, steps=steps(0, 3, local_batch_size=8)), 1))
        sync(ws, encode(Hello(job="old", rank=0, world_size=1, global_batch_size=8), 1))
    got = client.get("/api/v1/jobs/old/memory").json()["data"][0]
    assert (got["status"], got["source"], got["cap"]) == ("unmeasured", "", None)


def test_memory_readings_in_step_records_give_the_rank_a_fit(client):
    recs = steps(0, 6, local_batch_size=8) + steps(6, 6, local_batch_size=16)
    for r in recs[1::2]:  # one record in two carries a reading: 1 GB + 0.1 GB per sample
        r.mem_peak_bytes, r.mem_total_bytes = 10**9 + r.local_batch_size * 10**8, 8 * 10**9
    with client.websocket_connect("/ws/hook") as ws:
        h = hello(job="m", rank=0, world_size=1, global_batch_size=16, memory_source="cuda")
        ws.send_text(h)
        ws.receive_json()
        assert client.get("/api/v1/jobs/m/memory").json()["data"][0]["status"] == "measuring"
        ws.send_text(encode(Metrics(job="m", rank=0, steps=recs)))
        sync(ws, h)
    got = client.get("/api/v1/jobs/m/memory").json()
    r0 = got["data"][0]
    assert got["memory_headroom"] == 0.1
    assert (r0["status"], r0["method"], r0["batch_sizes"], r0["readings"]) == ("fitted", "linear", 2, 6)
    assert r0["fixed_bytes"] == pytest.approx(10**9) and r0["per_sample_bytes"] == pytest.approx(10**8)
    assert r0["cap"] == 62 and r0["limit_bytes"] == pytest.approx(7.2 * 10**9)
    assert r0["last_peak_bytes"] == 26 * 10**8
    assert client.get("/api/v1/jobs/nope/memory").status_code == 404
