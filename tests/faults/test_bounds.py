"""Resource bounds of a real backend (issue 15, defect 9).

Jobs were never freed from memory and nothing bounded their number: any hello created one
(17 junk jobs stayed, RSS 93 -> 174 MB after 16 idle minutes). Now a job with no connected
rank leaves memory after ``REBALANCER_FORGET_JOB_AFTER_S`` (its history stays in SQL), at
most ``REBALANCER_MAX_LIVE_JOBS`` jobs are live (one more is refused with 1013 and the
reason), and every connection has a frame-rate and size budget (4429 or 1009).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import urllib.request
from collections.abc import Iterator

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from backend.peers.budget import HOOK_FRAMES_BURST
from rebalancer_wire.protocol import PROTOCOL_VERSION
from tests.backend._app import closed, hello, metrics
from tests.helpers.server import Server, running_server
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"REBALANCER_FORGET_JOB_AFTER_S": "1", "REBALANCER_MAX_LIVE_JOBS": "3"}
    with running_server(tmp_path_factory.mktemp("bounds"), env=env) as s:
        yield s


def live_jobs(server: Server) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r"^rebalancer_live_jobs (\S+)$", text, re.M)
    assert m, text
    return float(m.group(1))



def test_a_job_without_ranks_leaves_memory_and_keeps_its_history(server: Server) -> None:
    with connect(server.ws_url + "/ws/hook") as ws:
        ws.send(hello(job="gone", rank=0, world_size=1, global_batch_size=8))
        ws.recv(timeout=10)
        ws.send(metrics(job="gone", rank=0, first=0, n=12, local_batch_size=8))
        wait_until(lambda: server.get("/api/v1/jobs/gone/metrics?source=history")["count"] > 0,  # type: ignore[index]
                   "history of job gone", 10)
    wait_until(lambda: server.get("/api/v1/jobs/gone/metrics")["source"] == "history",  # type: ignore[index]
               "job gone read from history only", 20, log=server.log)
    pts = server.get("/api/v1/jobs/gone/metrics")["data"]  # type: ignore[index]
    assert sum(p["n_steps"] for p in pts) == 12
    assert server.get("/api/v1/jobs/gone")["status"] == "idle"  # type: ignore[index]


def test_live_jobs_are_capped_with_a_clear_refusal(server: Server) -> None:
    socks = []
    try:
        for i in range(3):
            ws = connect(server.ws_url + "/ws/hook")
            ws.send(hello(job=f"cap-{i}", rank=0, world_size=1, global_batch_size=8))
            assert json.loads(ws.recv(timeout=10))["type"] == "placement"
            socks.append(ws)
        with connect(server.ws_url + "/ws/hook") as extra:
            extra.send(hello(job="cap-3", rank=0, world_size=1, global_batch_size=8))
            code, _, frames = closed(extra)
        assert code == 1013
        assert frames[-1] == {"type": "error", "v": PROTOCOL_VERSION, "code": "try_again_later", "message": (
            "The backend holds 3 live jobs with connected ranks (REBALANCER_MAX_LIVE_JOBS); "
            "job 'cap-3' can start once one of them ends.")}
        assert live_jobs(server) == 3
    finally:
        for ws in socks:
            ws.close()
    # Their ranks gone, the jobs may make room at once: a new job is taken.
    with connect(server.ws_url + "/ws/hook") as ws:
        ws.send(hello(job="cap-4", rank=0, world_size=1, global_batch_size=8))
        assert json.loads(ws.recv(timeout=10))["type"] == "placement"


def test_a_hook_flood_is_closed_with_4429(server: Server) -> None:
    with connect(server.ws_url + "/ws/hook") as ws:
        ws.send(hello(job="flood", rank=0, world_size=1, global_batch_size=8))
        ws.recv(timeout=10)
        frame = metrics(job="flood", rank=0, first=0, n=1, local_batch_size=8)
        with contextlib.suppress(ConnectionClosed):
            for _ in range(int(HOOK_FRAMES_BURST) * 4):
                ws.send(frame)
        code, reason, frames = closed(ws)
    assert code == 4429, (code, reason)
    assert frames[-1]["code"] == "rate_limited"
    assert frames[-1]["message"].startswith("More than 500 frames at once (100 a second sustained)")


@pytest.mark.parametrize("frame", ["x" * 8192, "y"])
def test_a_dashboard_flood_or_oversized_frame_is_closed(server: Server, frame: str) -> None:
    with connect(server.ws_url + "/ws/dashboard") as ws:
        ws.recv(timeout=10)  # open mode: frames come without a token
        with contextlib.suppress(ConnectionClosed):
            for _ in range(1 if len(frame) > 1 else 200):
                ws.send(frame)
        code = None
        deadline = time.monotonic() + 15  # open mode: overview frames keep coming until it closes
        try:
            while time.monotonic() < deadline:
                ws.recv(timeout=10)
        except ConnectionClosed as exc:
            assert exc.rcvd is not None
            code = exc.rcvd.code
    assert code == (1009 if len(frame) > 1 else 4429)
