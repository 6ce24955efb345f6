"""Node frames (``node_metrics``, protocol v3) against a real server: folded in one pass,
bad ones refused with a close code and counted, other ranks and other jobs untouched, and
hooks of older versions (per-rank frames, v1 and v2) still read."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.sync.client import ClientConnection, connect

from rebalancer_wire.node import NodeMetrics, encode_node
from rebalancer_wire.protocol import MAX_BATCH_JUMP, MAX_MESSAGE_BYTES, Metrics
from tests.backend._app import closed, hello, metrics, steps
from tests.helpers.server import Server, running_server

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("nodeframes")) as s:
        yield s


def _node(ws: ClientConnection, job: str, ranks: range, world: int = 8) -> None:
    for r in ranks:
        ws.send(hello(job=job, rank=r, world_size=world))
        assert json.loads(ws.recv(timeout=10))["type"] == "placement"


def _sync(ws: ClientConnection, job: str, rank: int, world: int = 8) -> None:
    """Every frame sent before on ``ws`` is handled: a repeated hello's answer comes after them."""
    ws.send(hello(job=job, rank=rank, world_size=world))
    assert json.loads(ws.recv(timeout=10))["type"] == "placement"


def _frame(job: str, ranks: list[int], first: int = 0, n: int = 3, **kw: Any) -> NodeMetrics:
    return NodeMetrics.pack(job, [Metrics(job=job, rank=r, steps=steps(first, n, compute_ms=10.0 + r, **kw))
                                  for r in ranks])


def _ranks(server: Server, job: str) -> dict[int, dict[str, Any]]:
    status, body = server.call("GET", f"/api/v1/jobs/{job}/ranks")
    assert status == 200, body
    return {r["rank"]: r for r in body["data"]}


def _refused(server: Server, frame: str, reason: str) -> float:
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf'^rebalancer_ingest_refused_frames_total\{{frame="{frame}",reason="{reason}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_node_frame_is_folded_for_every_rank_it_carries(server: Server) -> None:
    with connect(server.ws_url + "/ws/hook") as ws:
        _node(ws, "nf-ok", range(4), world=4)
        ws.send(encode_node(_frame("nf-ok", [0, 1, 2, 3], n=5)))
        ws.send(encode_node(_frame("nf-ok", [2, 0], first=5, n=2)))
        _sync(ws, "nf-ok", 0, world=4)
        ranks = _ranks(server, "nf-ok")
        assert {r: (v["n_steps"], v["batch_index"], v["compute_ms"]) for r, v in ranks.items()} == {
            0: (7, 6, 10.0), 1: (5, 4, 11.0), 2: (7, 6, 12.0), 3: (5, 4, 13.0)}


def test_old_hooks_per_rank_frames_still_work_beside_node_frames(server: Server) -> None:
    # A version-1 hook (the first protocol) and a version-2 hook, each on its own connection,
    # and a node frame for the other ranks: one job, every record read.
    with connect(server.ws_url + "/ws/hook") as old, connect(server.ws_url + "/ws/hook") as v2, \
            connect(server.ws_url + "/ws/hook") as node:
        v1_hello = json.loads(hello(job="nf-old", rank=0, world_size=4))
        v1_hello["v"] = 1
        old.send(json.dumps(v1_hello))
        reply = json.loads(old.recv(timeout=10))
        assert (reply["type"], reply["v"]) == ("placement", 1)  # answered in the version it spoke
        v1_metrics = json.loads(metrics(job="nf-old", rank=0, n=4))
        v1_metrics["v"] = 1
        old.send(json.dumps(v1_metrics))
        _node(v2, "nf-old", range(1, 2), world=4)
        v2.send(metrics(job="nf-old", rank=1, n=4))
        _node(node, "nf-old", range(2, 4), world=4)
        node.send(encode_node(_frame("nf-old", [2, 3], n=4)))
        for ws, r in ((old, 0), (v2, 1), (node, 2)):
            ws.send(json.dumps({**v1_hello, "rank": r}) if r == 0 else hello(job="nf-old", rank=r, world_size=4))
            assert json.loads(ws.recv(timeout=10))["type"] == "placement"
        assert {r: v["n_steps"] for r, v in _ranks(server, "nf-old").items()} == {0: 4, 1: 4, 2: 4, 3: 4}


def test_a_rank_without_a_hello_refuses_the_frame_and_touches_no_other_job(server: Server) -> None:
    before = _refused(server, "node_metrics", "malformed")
    with connect(server.ws_url + "/ws/hook") as other:
        _node(other, "nf-other", range(2), world=2)
        other.send(encode_node(_frame("nf-other", [0, 1], n=3)))
        with connect(server.ws_url + "/ws/hook") as ws:
            _node(ws, "nf-stranger", range(2))
            ws.send(encode_node(_frame("nf-stranger", [0, 1], n=2)))
            _sync(ws, "nf-stranger", 0)
            ws.send(encode_node(_frame("nf-stranger", [0, 1, 5], first=2, n=2)))
            code, reason, got = closed(ws)
        assert code == 4002
        assert got[-1]["message"] == ("This connection speaks for job 'nf-stranger' ranks 0, 1; got a 'node_metrics' "
                                      "frame with rank 5 without a hello on it. Say hello for each rank first.")
        # Nothing of the refused frame was kept: ranks 0 and 1 hold what came before it.
        assert {r: v["n_steps"] for r, v in _ranks(server, "nf-stranger").items()} == {0: 2, 1: 2}
        # Another job's connection goes on, its records intact.
        other.send(encode_node(_frame("nf-other", [0, 1], first=3, n=1)))
        _sync(other, "nf-other", 1, world=2)
        assert {r: (v["n_steps"], v["connected"]) for r, v in _ranks(server, "nf-other").items()} == {
            0: (4, True), 1: (4, True)}
    assert _refused(server, "node_metrics", "malformed") == before + 1


def test_columns_of_unequal_length_are_refused_with_4002_and_counted(server: Server) -> None:
    before = _refused(server, "node_metrics", "malformed")
    with connect(server.ws_url + "/ws/hook") as ws:
        _node(ws, "nf-ragged", range(2))
        body = _frame("nf-ragged", [0, 1], n=2).to_dict()
        body["steps"]["compute_ms"] = body["steps"]["compute_ms"][:-1]
        ws.send(json.dumps(body))
        code, _, got = closed(ws)
    assert code == 4002
    assert got[-1]["message"] == ("'steps.compute_ms' holds 3 values, but the frame's counts say 4 records: "
                                  "every column holds one value per record.")
    assert _refused(server, "node_metrics", "malformed") == before + 1
    assert {r: v["n_steps"] for r, v in _ranks(server, "nf-ragged").items()} == {0: 0, 1: 0}


def test_a_frame_over_the_size_bound_is_refused_with_1009_and_counted(server: Server) -> None:
    before = _refused(server, "node_metrics", "too_big")
    with connect(server.ws_url + "/ws/hook", max_size=None) as ws:
        _node(ws, "nf-big", range(2))
        body = _frame("nf-big", [0, 1], n=1).to_dict()
        body["pad"] = "x" * MAX_MESSAGE_BYTES
        ws.send(json.dumps(body))
        code, _, got = closed(ws)
    assert code == 1009
    assert got[-1]["code"] == "too_big"
    assert _refused(server, "node_metrics", "too_big") == before + 1


def test_one_ranks_bad_records_refuse_that_rank_alone(server: Server) -> None:
    with connect(server.ws_url + "/ws/hook") as ws:
        _node(ws, "nf-one", range(3))
        good = _frame("nf-one", [0, 1, 2], n=2)
        ws.send(encode_node(good))
        jump = _frame("nf-one", [0, 1, 2], first=2, n=1)
        jump.steps["batch_index"][1] = 2 + MAX_BATCH_JUMP + 10  # rank 1's step, too far from its last
        ws.send(encode_node(jump))
        err = json.loads(ws.recv(timeout=10))
        assert (err["type"], err["rank"], err["code"]) == ("error", 1, "malformed")
        assert err["message"].startswith(f"rank 1: 'batch_index' {2 + MAX_BATCH_JUMP + 10} is +{MAX_BATCH_JUMP + 11} "
                                         "from this rank's last (1)")
        _sync(ws, "nf-one", 0)
        ranks = _ranks(server, "nf-one")
        assert {r: (v["n_steps"], v["connected"]) for r, v in ranks.items()} == {
            0: (3, True), 1: (2, False), 2: (3, True)}


def test_node_frames_take_fewer_bytes_per_rank_step_than_per_rank_frames() -> None:
    t = time.time()
    frames = [Metrics(job="bytes", rank=r, steps=steps(100, 1, t0=t)) for r in range(8)]
    from rebalancer_wire.protocol import encode

    node = len(encode_node(NodeMetrics.pack("bytes", frames))) / 8
    per_rank = sum(len(encode(m)) for m in frames) / 8
    assert node < per_rank / 2
