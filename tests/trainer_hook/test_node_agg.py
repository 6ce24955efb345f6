"""Node aggregation (trainer_hook/node_agg.py): the agent, its fallback, against a real backend.

One uvicorn server for the module; the ranks are transports in this process (a torchrun
job through the agent is in tests/trainer_hook/test_node_agg_torchrun.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rebalancer_wire.protocol import Hello, Message, Placement, StepRecord
from tests.helpers.server import Server, running_server
from tests.helpers.waiting import wait_until
from trainer_hook.node_agg import (
    ENV_NODE_AGGREGATION,
    NodeAgent,
    agent_path,
    make_transport,
    node_aggregation,
)
from trainer_hook.transport import Transport

WORLD = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("nodeagg")) as s:
        yield s


def _hello(job: str, rank: int) -> Callable[[], Hello]:
    return lambda: Hello(job=job, rank=rank, world_size=WORLD, global_batch_size=16, local_rank=rank, host="n",
                         pid=os.getpid())


def _step(k: int) -> StepRecord:
    return StepRecord(batch_index=k, local_batch_size=4, placement_version=0, data_wait_ms=0.2, compute_ms=10.0,
                      sync_wait_ms=1.0, optimizer_ms=0.5, step_ms=12.0, t=time.time())


def _env(job: str, local_rank: int, tmp: Path) -> dict[str, str]:
    return {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(WORLD), "TORCHELASTIC_RUN_ID": job,
            "MASTER_PORT": str(tmp.stat().st_ino), "GROUP_RANK": "0"}


def _node(server: Server, job: str, tmp: Path) -> tuple[list[Transport], list[list[Message]]]:
    got: list[list[Message]] = [[] for _ in range(WORLD)]
    ts = [make_transport(job=job, url=server.url, token=None, hello=_hello(job, r), on_message=got[r].append,
                         env=_env(job, r, tmp), flush_interval_s=0.1) for r in range(WORLD)]
    for t in ts:
        t.start()
    return ts, got


def _ranks(server: Server, job: str) -> dict[int, dict[str, Any]]:
    status, body = server.call("GET", f"/api/v1/jobs/{job}/ranks")
    return {r["rank"]: r for r in body["data"]} if status == 200 else {}


def _steps_arrived(server: Server, job: str, n: int) -> bool:
    ranks = _ranks(server, job)
    return len(ranks) == WORLD and all(r["n_steps"] == n for r in ranks.values())


def test_env_switch_and_paths(tmp_path: Path) -> None:
    assert node_aggregation({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"})
    assert not node_aggregation({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})  # one rank on the node
    assert not node_aggregation({"LOCAL_WORLD_SIZE": "8"})  # not under torchrun
    assert not node_aggregation({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8", ENV_NODE_AGGREGATION: "0"})
    assert node_aggregation({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", ENV_NODE_AGGREGATION: "on"})
    assert not node_aggregation({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8", ENV_NODE_AGGREGATION: "maybe"})
    env = _env("j", 0, tmp_path)
    assert agent_path("j", env) == agent_path("j", {**env, "LOCAL_RANK": "3"})
    assert agent_path("j", env) != agent_path("k", env)
    assert agent_path("j", env) != agent_path("j", {**env, "GROUP_RANK": "1"})  # another node


def test_ranks_of_a_node_share_one_connection_then_fall_back(server: Server, tmp_path: Path) -> None:
    job = "node-agg"
    ts, got = _node(server, job, tmp_path)
    agent = ts[0].relay
    assert isinstance(agent, NodeAgent)
    try:
        wait_until(lambda: agent.guests == [1, 2, 3], "every local rank connected to the agent")
        for k in range(30):
            for t in ts:
                t.put_step(_step(k))
        wait_until(lambda: _steps_arrived(server, job, 30), "30 steps of every rank on REST", timeout=60,
                   log=server.log)
        health: Any = server.get("/healthz")
        assert (health["hook_connections"], health["hook_sockets"]) == (WORLD, 1)
        # Every local rank got the placement through the agent, once.
        for r in range(1, WORLD):
            placements = [m for m in got[r] if isinstance(m, Placement)]
            assert [p.shares for p in placements] == [[4, 4, 4, 4]]

        # The agent goes away mid-run: the other ranks use their own connections, nothing is lost.
        agent.stop("test")
        for k in range(30, 60):
            for t in ts:
                t.put_step(_step(k))
        wait_until(lambda: _steps_arrived(server, job, 60), "60 steps of every rank on REST", timeout=60,
                   log=server.log)
        wait_until(lambda: server.get("/healthz")["hook_sockets"] == WORLD,  # type: ignore[index]
                   "a connection per rank")
        ranks = _ranks(server, job)
        assert all(r["connected"] and r["dropped"] == 0 for r in ranks.values())
        assert sum(t.dropped for t in ts) == 0
    finally:
        for t in ts:
            t.close(timeout=2.0)
    wait_until(lambda: not any(r["connected"] for r in _ranks(server, job).values()), "every rank closed",
               log=server.log)
    job_status: Any = server.get(f"/api/v1/jobs/{job}")
    assert job_status["status"] != "degraded"
    # Nothing of the agent outlives it (a thread left running keeps a script from exiting).
    left = [t.name for t in threading.enumerate() if t.name == "rebalancer-node-agent"]
    assert left == [], left


def test_a_bad_frame_of_one_local_rank_drops_that_rank_alone(server: Server, tmp_path: Path) -> None:
    # One local rank's frame the backend refused (a step larger than the global batch) closed
    # the shared node connection and turned aggregation off for the run (issue 38).
    job = "node-bad-frame"
    ts, _ = _node(server, job, tmp_path)
    agent = ts[0].relay
    assert isinstance(agent, NodeAgent)
    try:
        wait_until(lambda: agent.guests == [1, 2, 3], "every local rank connected to the agent")
        for k in range(5):
            for t in ts:
                t.put_step(_step(k))
        wait_until(lambda: _steps_arrived(server, job, 5), "5 steps of every rank", timeout=60, log=server.log)
        bad = _step(5)
        bad.local_batch_size = 17  # the job's global batch is 16
        ts[2].put_step(bad)
        wait_until(lambda: "rank 2 from its node connection" in server.log(), "the backend dropped rank 2",
                   log=server.log)
        for k in range(6, 12):
            for t in ts:
                t.put_step(_step(k))
        wait_until(lambda: _steps_arrived(server, job, 11), "steps 0-4 and 6-11 of every rank", timeout=60,
                   log=lambda: str({i: (r["n_steps"], r["connected"]) for i, r in _ranks(server, job).items()}))
        assert ts[0].relay is agent and not agent._stopping  # noqa: SLF001
        assert server.get("/healthz")["hook_sockets"] == 1  # type: ignore[index]
        assert agent.guests == [1, 2, 3]
    finally:
        for t in ts:
            t.close(timeout=2.0)


def test_closing_rank_0_stops_the_agent_and_its_thread(server: Server, tmp_path: Path) -> None:
    job = "agent-thread"
    ts, _ = _node(server, job, tmp_path)
    agent = ts[0].relay
    assert isinstance(agent, NodeAgent)
    wait_until(lambda: agent.guests == [1, 2, 3], "every local rank connected to the agent")
    for t in reversed(ts):
        t.close(timeout=2.0)
    serving = [t for t in threading.enumerate() if t.name == "rebalancer-node-agent"]
    assert serving == [], "the agent's thread outlives hook.close()"
    assert not Path(agent.path).exists()


def test_without_the_agent_a_rank_waits_quietly_then_uses_its_own_connection(
        server: Server, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # While it waits, the agent's rank may just be slower to start: `make demo` printed
    # "Cannot reach the backend at unix:...; attempt 1, training goes on." on every start.
    job = "no-agent"
    caplog.set_level(logging.DEBUG, logger="trainer_hook.transport")
    t = make_transport(job=job, url=server.url, token=None, hello=_hello(job, 2), on_message=lambda m: None,
                       env=_env(job, 2, tmp_path), local_agent_wait_s=0.5)
    t.start()
    try:
        t.put_step(_step(0))
        wait_until(lambda: _ranks(server, job).get(2, {}).get("n_steps") == 1, "the step on its own connection")
        assert t.url == t.urls[1]
    finally:
        t.close(timeout=2.0)
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "trainer_hook.transport"]
    assert any(level == "DEBUG" and m.startswith("The node agent at unix:") for level, m in said), said
    # Once the wait is over, one warning that says what happens, in words about the agent.
    warnings = [m for level, m in said if level == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith("No node agent answered at unix:"), said
    assert not any("Cannot reach the backend" in m for _, m in said), said
