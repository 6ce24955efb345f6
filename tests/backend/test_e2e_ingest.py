"""Against the real backend process (uvicorn on a free loopback port): a real torchrun/gloo
job with one slowed rank (demo_worker's injected speeds: the slow rank computes longer, its
peer waits in the all-reduce, their steps take as long), and bad frames from a raw websocket
client."""

from __future__ import annotations

import json
import statistics

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from rebalancer_wire.protocol import MAX_MESSAGE_BYTES
from tests.backend._app import hello, metrics
from tests.helpers.server import running_server
from tests.helpers.torchrun import run_torchrun
from tests.helpers.waiting import wait_until

STEPS = 30


@pytest.mark.multiproc
def test_slowed_rank_computes_longer_while_wall_steps_match(tmp_path):
    env = {"REBALANCER_DEFAULT_MODE": "observe"}  # measure only: the placement stays uniform
    with running_server(tmp_path, env=env) as server:
        run_torchrun(2, [
            "-m", "trainer_hook.demo_worker", "--server", server.url, "--job", "e2e",
            "--steps", str(STEPS), "--global-batch-size", "32", "--speeds", "1,0.25",
            "--per-sample-ms", "2.0",
        ], timeout=240)
        job = server.get("/api/v1/jobs/e2e")
        ranks = server.get("/api/v1/jobs/e2e/ranks")["data"]
        points = server.get("/api/v1/jobs/e2e/metrics?source=live")["data"]
        log = server.log()
    assert (job["world_size"], job["global_batch_size"]) == (2, 32), job
    assert job["placement"] == {"version": 0, "shares": [16, 16]}
    by_rank: dict[int, list[dict]] = {0: [], 1: []}
    for p in points:
        by_rank[p["rank"]].append(p)
    for r, pts in by_rank.items():  # every rank's every step arrived
        assert sorted(p["batch_index"] for p in pts) == list(range(STEPS)), (r, log[-3000:])
        assert all(p["local_batch_size"] == 16 and p["placement_version"] == 0 for p in pts)
    # Skip the first steps (gloo and DDP warm-up) and compare within this one run.
    def median(r: int, key: str) -> float:
        return statistics.median(p[key] for p in by_rank[r][5:])

    assert median(1, "compute_ms") > 2.5 * median(0, "compute_ms")  # injected 4x per-sample cost
    assert median(0, "sync_wait_ms") > 2.0 * median(1, "sync_wait_ms")  # the fast rank waits for it
    assert median(1, "step_ms") == pytest.approx(median(0, "step_ms"), rel=0.15)  # in the all-reduce
    assert {r["rank"] for r in ranks} == {0, 1}
    assert job["imbalance"] > 0.5


@pytest.mark.multiproc
def test_real_server_answers_bad_frames_and_keeps_serving(tmp_path):
    with running_server(tmp_path) as server:
        url = server.ws_url + "/ws/hook"
        with connect(url) as good:
            good.send(hello(job="w", rank=0))
            assert json.loads(good.recv(timeout=10))["type"] == "placement"
            with connect(url) as bad:
                bad.send(hello(job="w", rank=1))
                bad.recv(timeout=10)
                bad.send("y" * (2 * MAX_MESSAGE_BYTES))
                err = json.loads(bad.recv(timeout=10))
                assert err["type"] == "error" and err["code"] == "too_big"
                with pytest.raises(ConnectionClosed) as closed:
                    bad.recv(timeout=10)
                assert closed.value.rcvd.code == 1009
            with connect(url) as bad:
                bad.send('{"type": "hello", "v": 1, "job": "w"')
                assert json.loads(bad.recv(timeout=10))["code"] == "malformed"
                with pytest.raises(ConnectionClosed) as closed:
                    bad.recv(timeout=10)
                assert closed.value.rcvd.code == 4002
            good.send(metrics(job="w", rank=0, n=9))

            def ranks_after_the_metrics() -> dict | None:  # the frame and the GET race otherwise
                got = {r["rank"]: r for r in server.get("/api/v1/jobs/w/ranks")["data"]}
                return got if got[0]["n_steps"] == 9 else None

            ranks = wait_until(ranks_after_the_metrics, "rank 0's 9 steps", timeout=20)
        assert server.get("/healthz")["status"] == "ok"
    assert ranks[0]["n_steps"] == 9 and ranks[1]["n_steps"] == 0


@pytest.mark.multiproc
def test_all_ranks_of_a_new_job_say_hello_at_once(tmp_path):
    import asyncio

    from websockets.asyncio.client import connect as aconnect

    world = 32

    async def rank(url: str, r: int) -> dict:
        async with aconnect(url) as ws:
            await ws.send(hello(job="burst", rank=r, world_size=world, global_batch_size=64))
            return json.loads(await asyncio.wait_for(ws.recv(), 30))

    async def all_ranks(url: str) -> list[dict]:
        return await asyncio.gather(*(rank(url, r) for r in range(world)))

    with running_server(tmp_path) as server:
        replies = asyncio.run(all_ranks(server.ws_url + "/ws/hook"))
        ranks = server.get("/api/v1/jobs/burst/ranks")
        log = server.log()
    assert [r["type"] for r in replies] == ["placement"] * world, log[-3000:]
    assert {tuple(r["shares"]) for r in replies} == {(2,) * world}
    assert ranks["count"] == world
    assert "Traceback" not in log, log[-3000:]
