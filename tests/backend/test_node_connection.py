"""/ws/hook in process: one node connection speaking for several ranks of one job."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from rebalancer_wire.protocol import MAX_BATCH_JUMP, Leave, encode
from tests.backend._app import hello, make_app, metrics, sync


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    # One app for the module (each test uses its own job name): building one costs seconds.
    with TestClient(make_app(tmp_path_factory.mktemp("node"))) as c:
        yield c


def _close_code(ws) -> int:
    while True:
        msg = ws.receive()
        if msg["type"] == "websocket.close":
            return msg["code"]


def _ranks(client, job="j"):
    return {r["rank"]: r for r in client.get(f"/api/v1/jobs/{job}/ranks").json()["data"]}


def test_one_connection_carries_every_rank_of_a_node(client):
    with client.websocket_connect("/ws/hook") as ws:
        for r in range(4):
            ws.send_text(hello(job="n1", rank=r, world_size=4, global_batch_size=32))
            assert ws.receive_json()["type"] == "placement"
        for r in range(4):
            ws.send_text(metrics(job="n1", rank=r, first=0, n=3 + r, compute_ms=10.0 + r, dropped=r))
        sync(ws, hello(job="n1", rank=0, world_size=4, global_batch_size=32))
        health = client.get("/healthz").json()
        assert (health["hook_connections"], health["hook_sockets"]) == (4, 1)
        ranks = _ranks(client, "n1")
        assert {r: (v["n_steps"], v["dropped"], v["connected"]) for r, v in ranks.items()} == {
            r: (3 + r, r, True) for r in range(4)}
        # A rank that leaves with 1001 (it moved to its own connection) is disconnected, not lost.
        ws.send_text(encode(Leave(job="n1", rank=3, code=1001)))
        ws.send_text(metrics(job="n1", rank=2, first=10, n=1))
        sync(ws, hello(job="n1", rank=0, world_size=4, global_batch_size=32))
        ranks = _ranks(client, "n1")
        assert ranks[3]["connected"] is False and ranks[2]["connected"] is True
        assert client.get("/api/v1/jobs/n1").json()["status"] != "degraded"
        # Its frames are refused now: the connection no longer speaks for it.
        ws.send_text(metrics(job="n1", rank=3, first=20, n=1))
        err = ws.receive_json()
        assert err["message"] == ("This connection speaks for job 'n1' ranks 0, 1, 2; "
                                  "got a 'metrics' for job 'n1' rank 3.")
        assert _close_code(ws) == 4002
    assert not any(r["connected"] for r in _ranks(client, "n1").values())


def test_a_node_connection_cannot_speak_for_another_job(client):
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello(job="a", rank=0))
        ws.receive_json()
        ws.send_text(hello(job="b", rank=1))
        err = ws.receive_json()
        assert err["message"] == "This connection speaks for job 'a' rank 0; open a new connection for job 'b' rank 1."
        assert _close_code(ws) == 4002
    assert client.get("/api/v1/jobs/b").status_code == 404


def test_a_bad_frame_of_one_rank_drops_that_rank_only(client):
    # One local rank's bad frame closed the whole node connection: every rank of the node lost,
    # and local rank 0 turned aggregation off for the run (issue 38).
    with client.websocket_connect("/ws/hook") as ws:
        for r in range(2):
            ws.send_text(hello(job="n3", rank=r))
            ws.receive_json()
        bad = json.loads(metrics(job="n3", rank=1, n=1))
        bad["steps"][0]["compute_ms"] = -1.0
        ws.send_text(json.dumps(bad))
        assert ws.receive_json() == {"type": "error", "v": 2, "code": "malformed", "rank": 1,
                                     "message": "'compute_ms' must be a number between 0 and 86400000, got -1.0."}
        # Rank 0 goes on; rank 1's frames still on their way are ignored, not refused.
        ws.send_text(metrics(job="n3", rank=1, first=1, n=3))
        ws.send_text(encode(Leave(job="n3", rank=1, code=1006)))
        ws.send_text(metrics(job="n3", rank=0, first=0, n=2))
        sync(ws, hello(job="n3", rank=0))
        ranks = _ranks(client, "n3")
        assert (ranks[0]["n_steps"], ranks[0]["connected"]) == (2, True)
        assert (ranks[1]["n_steps"], ranks[1]["connected"]) == (0, False)
        assert client.get("/healthz").json()["hook_sockets"] >= 1
        # Its next hello (the agent reconnected it) makes it a rank of the connection again.
        ws.send_text(hello(job="n3", rank=1))
        assert ws.receive_json()["type"] == "placement"
        ws.send_text(metrics(job="n3", rank=1, first=0, n=4))
        sync(ws, hello(job="n3", rank=0))
        assert _ranks(client, "n3")[1]["n_steps"] == 4


def test_the_only_rank_of_a_connection_is_refused_as_on_its_own(client):
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello(job="n3b", rank=0))
        ws.receive_json()
        bad = json.loads(metrics(job="n3b", rank=0, n=1))
        bad["steps"][0]["compute_ms"] = -1.0
        ws.send_text(json.dumps(bad))
        assert "rank" not in ws.receive_json()
        assert _close_code(ws) == 4002


def test_a_hello_of_another_shape_on_a_node_connection_is_refused(client):
    # On a single-node job every rank shares local rank 0's connection: the shape guard saw no
    # rank "on other connections", so one hello of another world size reshaped the live job,
    # put the uniform split over the operator's placement and failed with KeyError / 1011.
    job = "n-shape"
    with client.websocket_connect("/ws/hook") as ws:
        for r in range(2):
            ws.send_text(hello(job=job, rank=r, world_size=2, global_batch_size=32))
            assert ws.receive_json()["type"] == "placement"
        r = client.post(f"/api/v1/jobs/{job}/proposals", json={"shares": [20, 12], "apply": True})
        assert r.status_code == 201, r.text
        assert ws.receive_json()["shares"] == [20, 12]
        ws.send_text(hello(job=job, rank=1, world_size=3, global_batch_size=32))
        err = ws.receive_json()
        assert (err["code"], err["rank"]) == ("conflict", 1), err
        assert err["message"].startswith(f"Job '{job}' is running with world_size 2 and global batch 32 on 1 "
                                          f"connected rank; this hello says world_size 3"), err
        ws.send_text(metrics(job=job, rank=0, first=0, n=2, local_batch_size=20))
        sync(ws, hello(job=job, rank=0, world_size=2, global_batch_size=32))
        view = client.get(f"/api/v1/jobs/{job}").json()
        assert view["world_size"] == 2 and view["placement"]["shares"] == [20, 12], view
        assert _ranks(client, job)[0]["n_steps"] == 2
    # The same hello on a rank's own connection, for comparison: 4409.
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello(job=job, rank=0, world_size=2, global_batch_size=32))
        ws.receive_json()
        with client.websocket_connect("/ws/hook") as own:
            own.send_text(hello(job=job, rank=1, world_size=3, global_batch_size=32))
            assert own.receive_json()["code"] == "conflict"
            assert _close_code(own) == 4409


def test_a_batch_index_far_from_the_ranks_last_is_refused(client):
    # A forged frame jumping 100,000 batches was stored as history windows spanning them.
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello(job="n-jump", rank=0, batch_index=20_000))
        ws.receive_json()
        ws.send_text(metrics(job="n-jump", rank=0, first=10_000, n=3))  # queued while offline: fine
        ws.send_text(metrics(job="n-jump", rank=0, first=20_000, n=3))
        sync(ws, hello(job="n-jump", rank=0, batch_index=20_003))
        ws.send_text(metrics(job="n-jump", rank=0, first=20_003 + 100_000, n=1))
        assert ws.receive_json()["message"] == (
            f"'steps[0].batch_index' is {120_003}, +100000 from this rank's last (20003); it must be within "
            f"{MAX_BATCH_JUMP} of it (MAX_BATCH_JUMP). A run resumed elsewhere says its batch index in a new hello.")
        assert _close_code(ws) == 4002
    assert _ranks(client, "n-jump")[0]["n_steps"] == 6


def test_a_rank_moving_to_its_own_connection_keeps_the_node_connection_open(client):
    with client.websocket_connect("/ws/hook") as node:
        for r in range(2):
            node.send_text(hello(job="n4", rank=r))
            node.receive_json()
        with client.websocket_connect("/ws/hook") as own:
            own.send_text(hello(job="n4", rank=1))
            own.receive_json()
            own.send_text(metrics(job="n4", rank=1, first=0, n=4))
            sync(own, hello(job="n4", rank=1))
            # The node connection's late frame for rank 1 is ignored, its own rank goes on.
            node.send_text(metrics(job="n4", rank=1, first=0, n=9))
            node.send_text(metrics(job="n4", rank=0, first=0, n=2))
            sync(node, hello(job="n4", rank=0))
            assert client.get("/healthz").json()["hook_sockets"] == 2
            ranks = _ranks(client, "n4")
            assert (ranks[0]["n_steps"], ranks[1]["n_steps"]) == (2, 4)
            assert ranks[1]["connected"] is True


def test_leave_with_goodbye_of_every_rank_ends_the_run(client):
    with client.websocket_connect("/ws/hook") as ws:
        for r in range(2):
            ws.send_text(hello(job="n5", rank=r))
            ws.receive_json()
        ws.send_text(metrics(job="n5", rank=1, first=0, n=2))
        ws.send_text(encode(Leave(job="n5", rank=1, code=1000)))
        sync(ws, hello(job="n5", rank=0))
        assert _ranks(client, "n5")[1]["connected"] is False
        ws.close(1000)
    ranks = _ranks(client, "n5")
    assert not ranks[0]["connected"] and not ranks[1]["connected"]
    assert client.get("/api/v1/jobs/n5").json()["status"] != "degraded"


@pytest.mark.parametrize("code", [999, 5000])
def test_leave_code_out_of_range_is_refused(client, code):
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello(job="n6", rank=0))
        ws.receive_json()
        ws.send_text(json.dumps({"type": "leave", "v": 2, "job": "n6", "rank": 0, "code": code}))
        assert ws.receive_json()["message"] == f"'code' must be between 1000 and 4999, got {code}."
        assert _close_code(ws) == 4002


def test_a_frame_after_every_rank_left_is_refused(client):
    with client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello(job="n7", rank=0))
        ws.receive_json()
        ws.send_text(encode(Leave(job="n7", rank=0, code=1001)))
        ws.send_text(metrics(job="n7", rank=0, n=1))
        assert ws.receive_json()["message"] == ("This connection speaks for job 'n7' and no rank now (each left); "
                                                "got a 'metrics' for job 'n7' rank 0.")
        assert _close_code(ws) == 4002
