"""A job's shape and status on a real backend (issue 15, defects 4 and 8).

- A ``hello`` claiming another world size or global batch for a job whose ranks of the old
  shape are connected is refused with 4409 and the reason; the live ranks go on untouched.
- The same hello with a higher restart count (a TorchElastic restart) is accepted, audited,
  and the old shape's connections are closed.
- A rank whose connection drops without a close reads as lost: the job is ``degraded``
  at once; ranks that close cleanly (the job finished) are not lost.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.sync.client import ClientConnection, connect

from tests.backend._app import closed, hello, metrics
from tests.helpers.server import Server, running_server
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("shape")) as s:
        yield s


def rank(server: Server, job: str, r: int, world: int = 2, batch: int = 32, **kw: Any) -> ClientConnection:
    ws = connect(server.ws_url + "/ws/hook")
    ws.send(hello(job=job, rank=r, world_size=world, global_batch_size=batch, **kw))
    reply = json.loads(ws.recv(timeout=10))
    assert reply["type"] == "placement", reply
    return ws



def job(server: Server, name: str) -> dict[str, Any]:
    return server.get(f"/api/v1/jobs/{name}")  # type: ignore[return-value]


def audit(server: Server, name: str) -> list[dict[str, Any]]:
    return server.get(f"/api/v1/jobs/{name}/audit")["data"]  # type: ignore[index,no-any-return]


def test_hello_of_another_shape_is_refused_while_the_old_shape_runs(server: Server) -> None:
    r0, r1 = rank(server, "shape", 0), rank(server, "shape", 1)
    with r0, r1:
        r0.send(metrics(job="shape", rank=0, first=0, n=6))
        r1.send(metrics(job="shape", rank=1, first=0, n=6))
        with connect(server.ws_url + "/ws/hook") as stale:
            stale.send(hello(job="shape", rank=2, world_size=3, global_batch_size=32))
            code, reason, frames = closed(stale)
        assert code == 4409, (code, reason)
        assert frames[-1]["code"] == "conflict"
        assert frames[-1]["message"] == (
            "Job 'shape' is running with world_size 2 and global batch 32 on 2 connected ranks; this hello "
            "says world_size 3 and global batch 32. Stop those ranks or use another job name (a torchrun "
            "restart, with a higher restart count, may change the shape).")
        # The live ranks carry on: their next frames are taken, nothing was reset.
        r0.send(metrics(job="shape", rank=0, first=6, n=6))
        r1.send(metrics(job="shape", rank=1, first=6, n=6))
        wait_until(lambda: all(r["n_steps"] == 12 for r in server.get("/api/v1/jobs/shape/ranks")["data"]),  # type: ignore[index]
                   "both ranks' 12 steps", 10, log=server.log)
        j = job(server, "shape")
        assert (j["world_size"], j["placement"]["shares"]) == (2, [16, 16])
    assert all(a["action"] != "job.reshape" for a in audit(server, "shape"))
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_a_torchrun_restart_may_reshape_and_is_audited(server: Server) -> None:
    r0, r1 = rank(server, "elastic", 0), rank(server, "elastic", 1)
    with r0, r1:
        new = rank(server, "elastic", 0, world=3, batch=33, restart_count=1)
        with new:
            for old in (r0, r1):  # the previous attempt's sockets are closed, with the reason
                code, reason, _ = closed(old)
                assert code == 4409 and "restarted" in reason, (code, reason)
            j = job(server, "elastic")
            assert (j["world_size"], j["global_batch_size"], j["placement"]["shares"]) == (3, 33, [11, 11, 11])
    actions = [(a["action"], a["params"]) for a in audit(server, "elastic")]
    restarts = [p for a, p in actions if a == "job.restart"]
    assert restarts == [{"restart_count": 1, "previous_restart_count": 0, "rank": 0,
                         "world_size": 3, "global_batch_size": 33}], actions
    assert any(a == "job.reshape" for a, _ in actions)


def test_a_restart_of_the_same_shape_is_audited_once(server: Server) -> None:
    with rank(server, "again", 0), rank(server, "again", 1):
        pass
    with rank(server, "again", 0, restart_count=1), rank(server, "again", 1, restart_count=1):
        pass
    restarts = [a for a in audit(server, "again") if a["action"] == "job.restart"]
    assert len(restarts) == 1, restarts
    assert restarts[0]["reason"] == "torchrun restarted the job's workers (restart 1)"


def lost_gauge(server: Server, job: str, r: int) -> float | None:
    """``rebalancer_rank_lost{job, rank}`` as the server's /metrics has it (None: no such series)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(rf'^rebalancer_rank_lost{{job="{re.escape(job)}",rank="{r}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


def test_a_dropped_rank_makes_the_job_degraded_and_a_clean_close_does_not(server: Server) -> None:
    r0, r1 = rank(server, "lossy", 0), rank(server, "lossy", 1)
    r0.send(metrics(job="lossy", rank=0, first=0, n=5))
    r1.send(metrics(job="lossy", rank=1, first=0, n=5))
    r1.close_socket()  # the process died: no close frame
    got = wait_until(lambda: (j := job(server, "lossy"))["status"] == "degraded" and j, "status degraded",
                     10, log=server.log)
    assert got["status_detail"] == "lost ranks: 1 (1 of 2 connected)"
    assert got["connected_ranks"] == 1
    assert (lost_gauge(server, "lossy", 0), lost_gauge(server, "lossy", 1)) == (0.0, 1.0)  # for the alert
    back = rank(server, "lossy", 1)  # it comes back: no longer degraded
    wait_until(lambda: job(server, "lossy")["status"] != "degraded", "status back from degraded", 10)
    assert lost_gauge(server, "lossy", 1) == 0.0
    r0.close()
    back.close()  # a clean close: the job stopped, nothing is lost
    wait_until(lambda: job(server, "lossy")["connected_ranks"] == 0, "both ranks gone", 10)
    assert job(server, "lossy")["status"] != "degraded"
    assert (lost_gauge(server, "lossy", 0), lost_gauge(server, "lossy", 1)) == (0.0, 0.0)


def test_a_job_whose_every_rank_dies_reads_lost_on_metrics(server: Server) -> None:
    """One node's job dies whole: no rank trains on, yet each is lost (RebalancerRankLost)."""
    r0, r1 = rank(server, "crashed", 0), rank(server, "crashed", 1)
    for r, ws in enumerate((r0, r1)):
        ws.send(metrics(job="crashed", rank=r, first=0, n=5))
    r0.close_socket()
    r1.close_socket()
    wait_until(lambda: job(server, "crashed")["connected_ranks"] == 0, "both ranks gone", 10, log=server.log)
    assert job(server, "crashed")["status"] == "degraded"
    assert (lost_gauge(server, "crashed", 0), lost_gauge(server, "crashed", 1)) == (1.0, 1.0)
