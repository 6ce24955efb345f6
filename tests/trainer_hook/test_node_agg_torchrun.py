"""Node aggregation in a real 4-rank torchrun job (gloo, one "node") against a real backend:
one hook connection carries every rank; when local rank 0's agent stops mid-run, the other
ranks go to their own connections, training completes and no record is lost. One job."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.server import Server, running_server
from tests.helpers.torchrun import running_torchrun
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.multiproc

JOB, WORLD, STEPS = "node4", 4, 400


def _health(server: Server) -> tuple[int, int]:
    h: Any = server.get("/healthz")
    return h["hook_connections"], h["hook_sockets"]


def _ranks(server: Server) -> dict[int, dict[str, Any]]:
    status, body = server.call("GET", f"/api/v1/jobs/{JOB}/ranks")
    return {r["rank"]: r for r in body["data"]} if status == 200 else {}


def _training(server: Server) -> bool:
    ranks = _ranks(server)
    return len(ranks) == WORLD and all(r["connected"] and (r["batch_index"] or 0) >= 5 for r in ranks.values())


def test_one_connection_per_node_and_fallback_when_the_agent_stops(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with running_server(tmp_path) as server:
        target = ["tests/trainer_hook/_node_agg_worker.py", server.url, JOB, str(STEPS), str(out)]
        with running_torchrun(WORLD, target) as (proc, lines):
            wait_until(lambda: _training(server) or proc.poll() is not None, "4 ranks training", 120,
                       interval=0.2, log=lambda: "".join(lines))
            assert proc.poll() is None, "".join(lines)
            assert _health(server) == (WORLD, 1)  # four ranks, one websocket
            (out / "stop-agent").touch()
            wait_until(lambda: _health(server) == (WORLD, WORLD) or proc.poll() is not None,
                       "a connection per rank after the agent stopped", 60, interval=0.1)
            assert proc.poll() is None, "the job ended before the ranks were seen on their own connections"
            deadline = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert proc.returncode == 0, "".join(lines)
        results = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
        assert sorted(results) == list(range(WORLD))
        assert results[0]["agent"] and 0 < results[0]["stopped_at"] < STEPS - 1
        for r in range(1, WORLD):  # each ended on its own connection to the backend
            assert results[r]["url"].startswith("ws://127.0.0.1"), results[r]
        wait_until(lambda: all(not r["connected"] for r in _ranks(server).values()), "every rank closed", 30)
        ranks = _ranks(server)
        assert {r: (v["n_steps"], v["batch_index"], v["dropped"]) for r, v in ranks.items()} == {
            r: (STEPS, STEPS - 1, 0) for r in range(WORLD)}
        assert all(res["dropped"] == 0 for res in results.values())
        job: Any = server.get(f"/api/v1/jobs/{JOB}")
        assert job["status"] != "degraded", job
