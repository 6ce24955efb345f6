"""SIGKILL of the replica that owns a job, mid-run (issue 28, item 3), with every part real:
two ``rebalancer serve`` processes on one PostgreSQL schema of their own and the real Redis
under a key prefix of their own, and a torchrun job of ``trainer_hook.demo_worker`` that
knows both replicas. Replica B takes the job within 10 s of the lease TTL, the placement in
force and every stored proposal and audit row survive (read through B), and the job trains
through the fault to its last step."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.cluster import redis_or_skip, running_replicas

redis_or_skip()

from tests.helpers.server import Server  # noqa: E402
from tests.helpers.torchrun import running_torchrun  # noqa: E402
from tests.helpers.waiting import wait_until  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

ADMIN = "failover-admin-secret-0123456789"
TTL_S = 2.0
JOB = "failover"
STEPS = 1200
B = 32
OPERATOR_SHARES = [20, 12]


def _get(server: Server, path: str) -> Any:
    status, body = server.call("GET", path, ADMIN)
    assert status == 200, (path, status, body)
    return body


def test_sigkill_of_the_owner_moves_the_job_to_the_other_replica(tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    base = f"/api/v1/jobs/{JOB}"
    env = {"REBALANCER_ADMIN_TOKEN": ADMIN, "REBALANCER_MIN_STEPS": "6", "REBALANCER_PERSIST_INTERVAL_S": "0.5"}
    with running_replicas(tmp_path, env, ttl_s=TTL_S) as replicas:
        a, b = replicas.a, replicas.b
        servers = f"{a.url},{b.url}"  # the hook tries A first, B when A is unreachable
        with running_torchrun(2, ["-m", "trainer_hook.demo_worker", "--server", servers, "--job", JOB,
                                  "--token", ADMIN, "--steps", str(STEPS), "--global-batch-size", str(B),
                                  "--speeds", "1,0.5", "--per-sample-ms", "1.0", "--fixed-ms", "1.0",
                                  "--result", str(result)]) as (proc, out):
            def log() -> str:
                return "".join(out[-60:]) + "\n" + replicas.log()

            def running(pred: Any) -> Any:
                def check() -> Any:
                    assert proc.poll() is None, f"the job ended before the fault was over:\n{log()}"
                    return pred()
                return check

            wait_until(running(lambda: replicas.owner_url(JOB) == a.ws_url), "replica A to own the job",
                       60, log=log)
            # The policy's proposal (approve mode), then an operator's placement, applied.
            wait_until(running(lambda: _get(a, f"{base}/proposals")["count"] >= 1), "a policy proposal on A",
                       90, log=log)
            # B reads the job too (REST works on every replica), so it holds it in memory.
            assert _get(b, f"{base}/placements")["count"] == 1  # version 0 only
            status, placed = a.call("POST", f"{base}/proposals", ADMIN, {
                "shares": OPERATOR_SHARES, "apply": True, "reason": "operator placement before the fault"})
            assert status == 201, placed
            version = _get(a, base)["placement"]["version"]
            assert _get(a, base)["placement"]["shares"] == OPERATOR_SHARES
            wait_until(running(lambda: any(p["version"] == version and p["applied_at"] is not None
                                           for p in _get(a, f"{base}/placements")["data"])),
                       f"every rank to apply version {version}", 60, log=log)
            proposals = {p["id"] for p in _get(a, f"{base}/proposals?limit=1000")["data"]}
            audit_rows = _get(a, f"/api/v1/audit?job={JOB}&limit=5000")["data"]
            assert {"proposal.create", "proposal.approve"} <= {r["action"] for r in audit_rows}, audit_rows
            audit = {r["id"] for r in audit_rows}

            a.proc.kill()  # SIGKILL: no release, no goodbye; its lease must expire
            a.proc.wait()
            killed = time.monotonic()
            wait_until(running(lambda: replicas.owner_url(JOB) == b.ws_url),
                       f"replica B to take the job within 10 s of the {TTL_S:g} s lease", TTL_S + 10.0,
                       interval=0.05, log=log)
            taken = time.monotonic() - killed
            wait_until(running(lambda: _get(b, base).get("connected_ranks") == 2),
                       "both ranks to reconnect to B", 30, log=log)
            print(f"[failover] B took the job {taken:.1f} s after the SIGKILL (lease {TTL_S:g} s); "
                  f"both ranks on B {time.monotonic() - killed:.1f} s after it")

            # The store of record, read through B: the placement in force, every proposal
            # and every audit row stored before the fault. B counts a rank connected once its
            # hello is admitted, a moment before its controller has read the job from the
            # store (seen once in a clean clone's CI: placement None right after both
            # reconnected), so the placement is waited for, briefly, not read at that instant.
            job = wait_until(running(lambda: (j := _get(b, base))["placement"] is not None and j),
                             "B to read the job's placement from the store", 10, log=log)
            assert job["placement"] == {"version": version, "shares": OPERATOR_SHARES}, job["placement"]
            assert proposals <= {p["id"] for p in _get(b, f"{base}/proposals?limit=1000")["data"]}
            assert audit <= {r["id"] for r in _get(b, f"/api/v1/audit?job={JOB}&limit=5000")["data"]}
            # B controls the job now: an operator action there is taken.
            status, body = b.call("PUT", f"{base}/mode", ADMIN, {"mode": "approve", "reason": "after failover"})
            assert status == 200, body
            # The ranks train on under the operator's placement, streaming to B.
            ranks = wait_until(running(lambda: (r := _get(b, f"{base}/ranks")["data"])
                                       and all(x["connected"] and x["placement_version"] == version for x in r)
                                       and r), "the ranks' metrics under the placement in force on B", 30,
                               log=log)
            assert len(ranks) == 2

            assert proc.wait(timeout=240) == 0, log()
        done = json.loads(result.read_text())
        assert done["steps"] == STEPS  # training never blocked: every step ran
        assert [p["shares"] for p in done["placements"] if p["version"] == version] == [OPERATOR_SHARES]
