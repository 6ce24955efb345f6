"""TorchElastic restart: restarted ranks re-register and resume the placement in force.

A real backend (uvicorn) and a real torchrun job with --max-restarts 1. An operator
submits and approves a non-uniform placement over REST; after the ranks have trained
under it, one rank crashes; torchrun restarts every worker; their hooks say hello again
and must start the new attempt with the placement in force, not the uniform split.
Meanwhile the job's status says a rank is lost (``degraded``), and the restart is in the
audit log (issue 15).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from tests.helpers.ports import free_port
from tests.helpers.server import Server, running_server
from tests.helpers.torchrun import REPO_ROOT, job_env

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

ADMIN = "elastic-admin-secret-0123456789"
JOB = "elastic-restart"
SHARES = [9, 3]


def start_elastic(nproc: int, target: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """torchrun --max-restarts 1 with the c10d rendezvous and an unshared store.

    Measured here (torch 2.13, gloo): with the static rendezvous (--master-addr/port), or
    with the rendezvous store shared with init_process_group (the default), the restarted
    workers read the previous attempt's gloo addresses and fail with "Gloo
    connectFullMesh failed ... Connection refused" (pytorch issue 135712).
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "1",
        *target,
    ]
    full_env = job_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env})
    return subprocess.Popen(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
        start_new_session=True,
    )


def call(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    return server.call(method, path, ADMIN, body)


def wait_for(what: str, fn: Any, proc: Any, log: list[str], timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) while waiting for {what}:\n" + "".join(log))
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}:\n" + "".join(log[-60:]))


def test_restarted_ranks_resume_the_placement_in_force(tmp_path):
    env = {"REBALANCER_ADMIN_TOKEN": ADMIN, "REBALANCER_MIN_STEPS": "2000",  # no policy proposals
           "REBALANCER_POLICY_WINDOW_STEPS": "2000"}
    with running_server(tmp_path, env=env) as server:
        out = tmp_path / "out"
        proc = start_elastic(
            2, ["-m", "tests.integrations._elastic_job", str(out)],
            env={"REBALANCER_SERVER": server.url, "REBALANCER_JOB": JOB, "REBALANCER_TOKEN": ADMIN},
        )
        log: list[str] = []
        reader = threading.Thread(target=lambda: log.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        try:
            def connected() -> bool:
                code, body = call(server, "GET", f"/api/v1/jobs/{JOB}")
                return code == 200 and body["connected_ranks"] == 2

            wait_for("both ranks to connect", connected, proc, log)
            code, prop = call(server, "POST", f"/api/v1/jobs/{JOB}/proposals", {"shares": SHARES, "reason": "test"})
            assert code == 201, prop
            code, approved = call(server, "POST", f"/api/v1/jobs/{JOB}/proposals/{prop['id']}/approve", {})
            assert code == 200, approved
            version = approved["placement_version"]
            assert version >= 1
            seen: list[tuple[str, str]] = []

            def watch() -> None:  # the status while rank 1 is dead and torchrun restarts
                while proc.poll() is None:
                    code, body = call(server, "GET", f"/api/v1/jobs/{JOB}")
                    if code == 200:
                        seen.append((body["status"], body["status_detail"]))
                    time.sleep(0.1)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            proc.wait(timeout=120)
            reader.join(timeout=5)
            watcher.join(timeout=10)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers (own session)
                proc.wait()
        output = "".join(log)
        assert proc.returncode == 0, output
        crash = json.loads((out / "crash.json").read_text())
        assert [v for v, _ in crash["acks"]] == [version], "attempt 0 did not train under the placement"
        for rank in (0, 1):
            rec = json.loads((out / f"rank{rank}.attempt1.json").read_text())
            first = rec["trained"][0]
            # The restarted hook starts batch 0 of the new attempt under the placement in force.
            assert (first["k"], first["version"], first["shares"]) == (0, version, SHARES), rec
            assert all(t["version"] == version for t in rec["trained"])
            # Acknowledged at that batch, and every batch is this rank's share of the placement.
            assert rec["acks"] == [[version, 0]], rec["acks"]
            assert [t["local"] for t in rec["trained"]] == [SHARES[rank]] * 6, rec["trained"]
            assert rec["rejections"] == []
        # The backend still holds that placement in force, acknowledged by both ranks.
        code, placements = call(server, "GET", f"/api/v1/jobs/{JOB}/placements")
        assert code == 200
        latest = max(placements["data"], key=lambda p: p["version"])
        assert (latest["version"], latest["shares"]) == (version, SHARES)
        assert sorted(int(r) for r in latest["acks"]) == [0, 1]
        degraded = [d for s, d in seen if s == "degraded"]
        assert degraded and all(d.startswith("lost ranks: ") for d in degraded), seen
        assert any("1" in d.split("(")[0] for d in degraded), degraded
        code, audit = call(server, "GET", f"/api/v1/jobs/{JOB}/audit")
        restarts = [a for a in audit["data"] if a["action"] == "job.restart"]
        assert [a["params"]["restart_count"] for a in restarts] == [1], audit
        code, job = call(server, "GET", f"/api/v1/jobs/{JOB}")
        # the new attempt's ranks closed cleanly
        assert job["status"] != "degraded", (job["status_detail"], job, output[-4000:])
