"""A device-mesh job's shape reaches the job resource (issue 24, item 3), on a real backend.

The hook's hello says ``mesh`` (``RebalanceHook(dp_mesh=...)``); ``GET /api/v1/jobs/{job}``
shows it with its label, and a hello whose mesh is out of range is refused with one
sentence (close 4002) while the other connections and the server go on."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from websockets.sync.client import connect

from tests.backend._app import closed, hello, metrics
from tests.helpers.server import Server, running_server
from tests.helpers.waiting import wait_until
from trainer_hook.protocol import CLOSE_MALFORMED, MeshShape

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


def _job_at(server: Server, name: str, batch_index: int) -> dict | None:
    job = server.get(f"/api/v1/jobs/{name}")
    assert isinstance(job, dict)
    return job if job.get("batch_index") == batch_index else None
