"""The fault suite (issue 15), real processes: a torchrun/gloo job against a real backend.

- The backend SIGKILLed mid-job and restarted on the same database: training never stops,
  the placement in force, proposals, audit and stored history (less what was in flight)
  are kept, and the steps trained while it was down reach it after the restart.
- The database made read-only and writable again during a job: training unaffected (same
  step time within the run), every rank stays connected and its steps live, /healthz
  degraded then ok, and the history of the outage is written once it is writable.
"""

from __future__ import annotations

import sqlite3
import statistics
from pathlib import Path

import pytest

from backend.process import free_port
from tests.backend.test_e2e_control import (
    ADMIN,
    ENV,
    approve_flow,
    call,
    check_restart,
    job,
    tokens,
    wait_for,
)
from tests.backend.test_storage_faults import _chattr, immutable  # noqa: F401  (fixture)
from tests.helpers.server import running_server
from tests.helpers.torchrun import running_torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


def _stored_ids(db: Path, name: str) -> set[int]:
    conn = sqlite3.connect(db)
    try:
        return {r[0] for r in conn.execute("SELECT id FROM rank_metrics WHERE job = ?", (name,))}
    finally:
        conn.close()


def test_backend_sigkilled_mid_job_and_restarted(tmp_path: Path):
    db = tmp_path / "rebalancer.db"
    db_url = f"sqlite:///{db}"
    tok = tokens(db_url)
    port = free_port()
    name = "fault-kill"
    with job(f"http://127.0.0.1:{port}", name) as (proc, out):
        with running_server(tmp_path, db_url=db_url, port=port, env=ENV) as server:
            prop, version, snapshot = approve_flow(server, name, tok, proc, out)
            stored = _stored_ids(db, name)
            k_kill = call(server, "GET", f"/api/v1/jobs/{name}", ADMIN)[1]["batch_index"]
            server.proc.kill()  # SIGKILL: no shutdown, no final flush
            server.proc.wait()
        assert proc.poll() is None, "".join(out)  # training goes on without the backend
        with running_server(tmp_path, db_url=db_url, port=port, env=ENV) as server:
            check_restart(server, name, prop, version, snapshot, proc, out)
            assert stored <= _stored_ids(db, name)  # history less what was in flight
            # Training never stopped: the job went on past the kill and streams again.
            k_now = call(server, "GET", f"/api/v1/jobs/{name}", ADMIN)[1]["batch_index"]
            assert k_now > k_kill, (k_kill, k_now)
            assert proc.poll() is None, "".join(out)


def test_database_read_only_then_writable_during_a_job(tmp_path: Path, immutable):  # noqa: F811
    db = tmp_path / "rebalancer.db"
    name = "fault-ro"
    env = {**ENV, "REBALANCER_DEFAULT_MODE": "observe", "REBALANCER_HEALTH_INTERVAL_S": "0.5"}
    with running_server(tmp_path, env=env) as server, running_torchrun(2, [
            "-m", "trainer_hook.demo_worker", "--server", server.url, "--job", name, "--token", ADMIN,
            "--steps", "0", "--global-batch-size", "32", "--per-sample-ms", "1.0"]) as (proc, out):
        base = f"/api/v1/jobs/{name}"

        def batch() -> int:
            return call(server, "GET", base, ADMIN)[1].get("batch_index") or 0

        wait_for("steps stored", lambda: batch() >= 30 and _stored_ids(db, name), proc=proc, log=out)
        k_fault = batch()
        immutable(db)
        wait_for("healthz degraded", lambda: server.call("GET", "/healthz")[1]["status"] == "degraded",
                 proc=proc, log=out)
        connected = []
        wait_for("60 steps during the outage", lambda: (
            connected.append(call(server, "GET", base, ADMIN)[1]["connected_ranks"]) or batch() >= k_fault + 60),
            proc=proc, log=out)
        k_back = batch()
        _chattr("-i", db)
        wait_for("healthz ok", lambda: server.call("GET", "/healthz")[0] == 200, proc=proc, log=out)
        assert set(connected) == {2}, connected  # live view uninterrupted: no rank was dropped
        # Training unaffected: rank 0's step time in the outage against before it, same run.
        _, m = call(server, "GET", f"{base}/metrics?rank=0&batch_from=5&source=live", ADMIN)
        steps = {p["batch_index"]: p["step_ms"] for p in m["data"]}
        assert set(range(5, k_back)) <= set(steps), "live steps missing"
        before = statistics.median(steps[k] for k in range(5, k_fault))
        during = statistics.median(steps[k] for k in range(k_fault + 5, k_back))
        assert during / before < 1.5, (before, during)
        # History resumes: the outage's windows are written once the file is writable.

        def stored_through() -> int:
            conn = sqlite3.connect(db)
            try:
                return conn.execute("SELECT COALESCE(MAX(batch_index_end), 0) FROM rank_metrics "
                                    "WHERE job = ? AND rank = 0", (name,)).fetchone()[0]
            finally:
                conn.close()

        wait_for("history past the outage", lambda: stored_through() > k_back + 10, proc=proc, log=out)
        conn = sqlite3.connect(db)
        windows = sorted(conn.execute("SELECT batch_index_start, batch_index_end FROM rank_metrics "
                                      "WHERE job = ? AND rank = 0", (name,)))
        conn.close()
        ends = [e for _, e in windows]
        assert windows[0][0] == 0 and all(s == e + 1 for (s, _), e in zip(windows[1:], ends, strict=False)), windows
        assert ends[-1] > k_back  # every step through the outage stored, none lost
        assert proc.poll() is None, "".join(out)
        log = server.log()
    assert "1011" not in log and "Traceback" not in log, log[-4000:]
