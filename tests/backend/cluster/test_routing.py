"""Two in-process replicas on one database and the real Redis: the owner keeps a job's
hooks and its control; the other sends hooks to the owner and refuses operator actions."""

from __future__ import annotations

import json

from tests.helpers.cluster import REDIS_URL, key_prefix, redis_or_skip

redis = redis_or_skip()

import pytest  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from starlette.websockets import WebSocketDisconnect  # noqa: E402

from rebalancer_wire.protocol import CLOSE_REDIRECT  # noqa: E402
from tests.backend._app import hello, make_app  # noqa: E402


def test_a_hello_at_the_non_owner_is_sent_to_the_owner(tmp_path) -> None:  # type: ignore[no-untyped-def]
    prefix = key_prefix()
    common = {"redis_url": REDIS_URL, "redis_prefix": prefix, "lease_ttl_s": 5.0}
    a = make_app(tmp_path, advertise_url="ws://a.example:8001", **common)
    b = make_app(tmp_path, advertise_url="ws://b.example:8002", **common)
    with TestClient(a) as ca, TestClient(b) as cb:
        with ca.websocket_connect("/ws/hook") as ws:
            ws.send_text(hello("llama", rank=0))
            placement = json.loads(ws.receive_text())
            assert placement["type"] == "placement" and placement["version"] == 0
            assert a.state.parts.controller.controls("llama")
            assert not b.state.parts.controller.controls("llama")
            with cb.websocket_connect("/ws/hook") as other:
                other.send_text(hello("llama", rank=1))
                assert json.loads(other.receive_text()) == {
                    "type": "error", "v": 2, "code": "redirect", "message": "ws://a.example:8001"}
                with pytest.raises(WebSocketDisconnect) as closed:
                    other.receive_text()
                # The close reason repeats the URL (for a hook whose send met the close first).
                assert (closed.value.code, closed.value.reason) == (CLOSE_REDIRECT, "ws://a.example:8001")
            # REST reads work on both; an operator action at the non-owner says where to go.
            assert cb.get("/api/v1/jobs/llama/placements").status_code == 200
            r = cb.put("/api/v1/jobs/llama/mode", json={"mode": "approve"})
            assert r.status_code == 409
            assert r.json()["detail"] == (
                f"Job 'llama' is controlled by replica {a.state.parts.cluster.replica_id} at "
                "ws://a.example:8001; send this action there.")
            assert ca.put("/api/v1/jobs/llama/mode", json={"mode": "approve"}).status_code == 200


def test_a_bad_advertise_url_is_refused_at_start_up() -> None:
    from backend.settings import Settings

    with pytest.raises(ValueError, match="REBALANCER_ADVERTISE_URL must be a URL like 'ws://10.0.0.5:8000'"):
        Settings(advertise_url="10.0.0.5:8000")
    assert Settings(advertise_url="wss://replica-1.example").advertise_url == "wss://replica-1.example"


def test_the_replica_that_takes_a_job_over_reads_it_from_the_store_of_record(tmp_path) -> None:  # type: ignore[no-untyped-def]
    prefix = key_prefix()
    common = {"redis_url": REDIS_URL, "redis_prefix": prefix, "lease_ttl_s": 5.0}
    b = make_app(tmp_path, advertise_url="ws://b.example:8002", **common)
    with TestClient(b) as cb:
        with TestClient(make_app(tmp_path, advertise_url="ws://a.example:8001", **common)) as ca:
            with ca.websocket_connect("/ws/hook") as r0, ca.websocket_connect("/ws/hook") as r1:
                for rank, ws in enumerate((r0, r1)):
                    ws.send_text(hello("bert", rank=rank))
                    assert json.loads(ws.receive_text())["version"] == 0
                # B reads the job while A controls it: B holds version 0 in memory.
                assert cb.get("/api/v1/jobs/bert/placements").json()["count"] == 1
                r = ca.post("/api/v1/jobs/bert/proposals", json={"shares": [20, 12], "apply": True})
                assert r.status_code == 201, r.text
        # A stopped (its lease released); a rank's hello at B gets the placement A applied.
        with cb.websocket_connect("/ws/hook") as ws:
            ws.send_text(hello("bert", rank=0))
            placement = json.loads(ws.receive_text())
            assert (placement["version"], placement["shares"]) == (1, [20, 12])
            assert b.state.parts.controller.controls("bert")
            assert cb.get("/api/v1/jobs/bert").json()["placement"] == {"version": 1, "shares": [20, 12]}


def test_hooks_of_a_job_another_replica_took_are_sent_there(tmp_path) -> None:  # type: ignore[no-untyped-def]
    prefix = key_prefix()
    a = make_app(tmp_path, advertise_url="ws://a.example:8001", redis_url=REDIS_URL, redis_prefix=prefix,
                 lease_ttl_s=1.0)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        with TestClient(a) as ca, ca.websocket_connect("/ws/hook") as ws:
            ws.send_text(hello("gpt", rank=0))
            assert json.loads(ws.receive_text())["type"] == "placement"
            # Replica B took the lease (say, A was cut off from Redis past its TTL).
            client.set(f"{prefix}:replica:b", "ws://b.example:8002", px=60_000)
            client.set(f"{prefix}:lease:gpt", "b", px=60_000)
            # A's next renewal pass finds out, stops controlling the job, redirects its hooks.
            assert json.loads(ws.receive_text()) == {
                "type": "error", "v": 2, "code": "redirect", "message": "ws://b.example:8002"}
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_text()
            assert closed.value.code == CLOSE_REDIRECT
            assert not a.state.parts.controller.controls("gpt")
    finally:
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()


def test_with_redis_down_a_hello_is_taken_and_control_pauses(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.helpers.ports import free_port

    app = make_app(tmp_path, redis_url=f"redis://127.0.0.1:{free_port()}/0",
                   redis_prefix=key_prefix())
    with TestClient(app) as c, c.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello("t5", rank=0))
        assert json.loads(ws.receive_text())["type"] == "placement"  # training goes on
        assert not app.state.parts.controller.controls("t5")
        r = c.put("/api/v1/jobs/t5/mode", json={"mode": "auto"})
        assert r.status_code == 409
        assert r.json()["detail"].startswith("Control of job 't5' is paused: Redis unreachable (")
        assert r.json()["detail"].endswith("control paused, training continues.")
