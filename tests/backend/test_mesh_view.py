"""A device-mesh job's shape reaches the job resource (issue 24, item 3), on a real backend.

The hook's hello says ``mesh`` (``RebalanceHook(dp_mesh=...)``) and its replica's members;
``GET /api/v1/jobs/{job}`` shows the mesh with its label and one row per replica with its
members, time and slowest member (the leaders' ``slowest_rank``), also from a second
backend on the same database (the mesh is stored). A hello whose mesh is out of range, a
leader that says another mesh than its job's, a step naming a slowest member outside its
replica, and placements or overrides that count ranks instead of replicas are refused
with one sentence while the other connections and the server go on."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.sync.client import connect

from rebalancer_wire.protocol import (
    CLOSE_CONFLICT,
    CLOSE_MALFORMED,
    MeshShape,
    Metrics,
    StepRecord,
    encode,
)
from tests.backend._app import closed, hello, metrics
from tests.helpers.server import Server, running_server
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.multiproc

DP_TP = MeshShape(dp=2, replica_size=2, dims=("dp", "tp"), shape=(2, 2))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("mesh")) as s:
        yield s


def test_a_hello_with_a_mesh_shows_in_the_job_view(server: Server) -> None:
    with connect(server.ws_url + "/ws/hook") as r0, connect(server.ws_url + "/ws/hook") as r1:
        for rank, ws in enumerate((r0, r1)):
            ws.send(hello(job="mesh-dp-tp", rank=rank, world_size=2, global_batch_size=32, mesh=DP_TP))
            assert json.loads(ws.recv(timeout=10))["type"] == "placement"
        job = server.get("/api/v1/jobs/mesh-dp-tp")
        assert isinstance(job, dict)
        assert job["mesh"] == {"dp": 2, "replica_size": 2, "dims": ["dp", "tp"], "shape": [2, 2],
                               "label": "DP 2 x TP 2"}
        assert job["world_size"] == 2  # replicas
    with connect(server.ws_url + "/ws/hook") as plain:
        plain.send(hello(job="mesh-none", rank=0, world_size=1, global_batch_size=8))
        assert json.loads(plain.recv(timeout=10))["type"] == "placement"
        job = server.get("/api/v1/jobs/mesh-none")
        assert isinstance(job, dict) and job["mesh"] is None


def test_a_bad_mesh_shape_gets_one_sentence_and_the_rest_goes_on(server: Server) -> None:
    good_hello = hello(job="mesh-good", rank=0, world_size=2, global_batch_size=32, mesh=DP_TP)
    with connect(server.ws_url + "/ws/hook") as good:
        good.send(good_hello)
        assert json.loads(good.recv(timeout=10))["type"] == "placement"
        frame = json.loads(hello(job="mesh-bad", rank=0, world_size=2, global_batch_size=32))
        frame["mesh"] = {"dp": 2, "replica_size": 2, "dims": ["dp", "tp"], "shape": [2, 3]}
        with connect(server.ws_url + "/ws/hook") as bad:
            bad.send(json.dumps(frame))
            code, _, replies = closed(bad)
        assert code == CLOSE_MALFORMED
        assert replies == [{"type": "error", "v": 2, "code": "malformed", "message":
                            "'mesh.shape' [2, 3] holds 6 ranks, but 'mesh.dp' x 'mesh.replica_size' is 2 x 2 = 4."}]
        # The job it named was never created; the good connection and the server carry on.
        assert server.call("GET", "/api/v1/jobs/mesh-bad")[0] == 404
        good.send(metrics(job="mesh-good", rank=0, n=3))
        job = wait_until(lambda: _job_at(server, "mesh-good", 2), "the good connection's steps", log=server.log)
        assert job["mesh"]["label"] == "DP 2 x TP 2"
    with connect(server.ws_url + "/ws/hook") as again:  # a corrected hello is welcome
        frame["mesh"]["shape"] = [2, 2]
        again.send(json.dumps(frame))
        assert json.loads(again.recv(timeout=10))["type"] == "placement"


def _job_at(server: Server, name: str, batch_index: int, every: bool = False) -> dict | None:
    job = server.get(f"/api/v1/jobs/{name}")
    assert isinstance(job, dict)
    if every:  # every replica at that batch
        return job if all(p["compute_ms"] is not None for p in job["replicas"]) and job["batch_index"] == batch_index else None
    return job if job.get("batch_index") == batch_index else None


def _steps(first: int, n: int, compute_ms: float, slowest: int) -> str:
    return [StepRecord(batch_index=k, local_batch_size=16, placement_version=0, data_wait_ms=0.5,
                       compute_ms=compute_ms, sync_wait_ms=2.0, optimizer_ms=1.0, step_ms=compute_ms + 3.5,
                       t=time.time(), slowest_rank=slowest) for k in range(first, first + n)]


def _leaders(server: Server, job: str) -> tuple[Any, Any]:
    """A DP 2 x TP 2 job's two replica leaders (global ranks 0 and 2), connected."""
    r0, r1 = connect(server.ws_url + "/ws/hook"), connect(server.ws_url + "/ws/hook")
    for rank, ws in enumerate((r0, r1)):
        # Replica 0's leader says its members' devices; replica 1's (an older hook) does not.
        devices = ("node-a CPU", "node-b CPU") if rank == 0 else ()
        ws.send(hello(job=job, rank=rank, world_size=2, global_batch_size=32, mesh=DP_TP,
                      replica_ranks=(2 * rank, 2 * rank + 1), replica_devices=devices))
        assert json.loads(ws.recv(timeout=10))["type"] == "placement"
    return r0, r1


def test_the_job_view_groups_ranks_by_replica_with_its_slowest_member(server: Server, tmp_path) -> None:
    r0, r1 = _leaders(server, "mesh-replicas")
    with r0, r1:
        # Replica 0's member 1 was slowest in most steps, replica 1's leader (rank 2) in all.
        steps0 = _steps(0, 3, 30.0, 0) + _steps(3, 5, 30.0, 1)
        r0.send(encode(Metrics(job="mesh-replicas", rank=0, steps=steps0)))
        r1.send(encode(Metrics(job="mesh-replicas", rank=1, steps=_steps(0, 8, 12.0, 2))))
        job = wait_until(lambda: _job_at(server, "mesh-replicas", 7, every=True), "both replicas' steps",
                         log=server.log)
        rows = [
            {"replica": 0, "members": [0, 1], "member_devices": ["node-a CPU", "node-b CPU"], "connected": True,
             "compute_ms": 30.0, "step_ms": 33.5, "slowest_rank": 1},
            {"replica": 1, "members": [2, 3], "member_devices": [], "connected": True, "compute_ms": 12.0,
             "step_ms": 15.5, "slowest_rank": 2},
        ]
        assert job["replicas"] == rows
        with connect(server.ws_url + "/ws/dashboard?job=mesh-replicas") as dash:  # the job header's rows
            assert json.loads(dash.recv(timeout=10))["summary"]["replicas"] == rows
        # A step naming a slowest member outside its replica: one sentence, that connection only.
        r1.send(encode(Metrics(job="mesh-replicas", rank=1, steps=_steps(8, 1, 12.0, 1))))
        code, _, replies = closed(r1)
        assert code == CLOSE_MALFORMED
        assert replies[-1]["message"] == ("'steps[0].slowest_rank' is 1, not a member of this replica "
                                          "(its hello's 'replica_ranks' [2, 3]).")
        # Placements and overrides count replicas: one share per rank is refused, naming them.
        base = "/api/v1/jobs/mesh-replicas"
        status, body = server.call("POST", f"{base}/proposals", body={"shares": [8, 8, 8, 8]})
        assert (status, body["detail"]) == (400, (
            "Invalid placement: shares has 4 entries but the job has world_size 2. Job 'mesh-replicas' is a "
            "mesh job (DP 2 x TP 2): shares, pins, caps and drains are per data-parallel replica, and it has "
            "2 replicas of 2 ranks each."))
        status, body = server.call("PUT", f"{base}/overrides", body={"drains": [3]})
        assert (status, body["detail"]) == (400, (
            "drains names rank 3 but the job has ranks 0 to 1. Job 'mesh-replicas' is a mesh job (DP 2 x TP 2): "
            "shares, pins, caps and drains are per data-parallel replica, and it has 2 replicas of 2 ranks each."))
        # A drain of a replica is one entry (the hooks give all its ranks no samples).
        status, body = server.call("PUT", f"{base}/overrides", body={"drains": [1]})
        assert status == 200, body
        # A second backend on the same database knows the job from storage: its mesh and members.
        with running_server(tmp_path, db_url=server.db_url) as other:
            stored = other.get(f"{base}")
            assert isinstance(stored, dict)
            assert stored["mesh"]["label"] == "DP 2 x TP 2" and stored["world_size"] == 2
            assert [(p["replica"], p["members"], p["member_devices"], p["slowest_rank"])
                    for p in stored["replicas"]] == [(0, [0, 1], [], None), (1, [2, 3], [], None)]


def test_a_leader_that_says_another_mesh_is_refused(server: Server) -> None:
    r0, r1 = _leaders(server, "mesh-twice")
    with r0, r1, connect(server.ws_url + "/ws/hook") as odd:
        other = MeshShape(dp=2, replica_size=2, dims=("dp_replicate", "dp_shard"), shape=(2, 2))
        odd.send(hello(job="mesh-twice", rank=1, world_size=2, global_batch_size=32, mesh=other,
                       replica_ranks=(1, 3)))
        code, _, replies = closed(odd)
        assert code == CLOSE_CONFLICT
        # (judged against every connected leader but the rank it claims to be: rank 0 here)
        assert replies == [{"type": "error", "v": 2, "code": "conflict", "message": (
            "Job 'mesh-twice' runs as mesh DP 2 x TP 2 (2 replicas of 2 ranks) on 1 connected replica leader; "
            "this hello says mesh DP_REPLICATE 2 x DP_SHARD 2 (2 replicas of 2 ranks). Every replica leader of "
            "one job must say the same mesh: pass every rank its slice of one world mesh as dp_mesh, or use "
            "another job name.")}]
        job = server.get("/api/v1/jobs/mesh-twice")
        assert isinstance(job, dict) and job["mesh"]["label"] == "DP 2 x TP 2"  # the job's mesh stands
