"""Storage faults on a real server (issue 15, defects 2 and 3).

SQLite made read-only (``chattr +i`` on the file: this machine runs tests as root, whom
``chmod`` does not stop): hooks stay connected and their metrics live, the log is not
flooded, REST mutations answer JSON 503, ``/healthz`` is degraded with the reason, and the
history written after the database recovers continues. The file deleted while serving:
``/healthz`` sees it, the backend restores it from its open connection, and nothing written
before or after is lost across a restart.
"""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
from pathlib import Path

import pytest
from websockets.sync.client import connect

from tests.backend._app import hello, joined, metrics
from tests.helpers.server import running_server
from tests.helpers.waiting import wait_until


def _chattr(flag: str, path: Path) -> None:
    subprocess.run(["chattr", flag, str(path)], check=True, capture_output=True)


@pytest.fixture
def immutable(tmp_path):
    """``set(path)`` makes a file read-only even for root; undone after the test."""
    probe = tmp_path / "probe"
    probe.write_text("x")
    try:
        _chattr("+i", probe)
        _chattr("-i", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"chattr +i does not work here: {exc}")
    made: list[Path] = []

    def set_(path: Path) -> None:
        _chattr("+i", path)
        made.append(path)

    yield set_
    for p in made:
        with contextlib.suppress(subprocess.CalledProcessError):
            _chattr("-i", p)


def _stored_steps(db: Path, job: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("SELECT COALESCE(SUM(n_steps), 0) FROM rank_metrics WHERE job = ?",
                                (job,)).fetchone()[0])
    finally:
        conn.close()


@pytest.mark.multiproc
def test_read_only_database_degrades_and_recovers(tmp_path, immutable):
    db = tmp_path / "rebalancer.db"
    env = {"REBALANCER_HEALTH_INTERVAL_S": "0.5"}
    with running_server(tmp_path, env=env) as server:
        url = server.ws_url + "/ws/hook"
        with connect(url) as rank0:
            joined(rank0, "ro")
            rank0.send(metrics(job="ro", rank=0, first=0, n=10))
            wait_until(lambda: _stored_steps(db, "ro") == 10, "the first steps stored")

            immutable(db)
            code, health = server.call("GET", "/healthz")
            assert code == 503 and health["status"] == "degraded", health
            assert "does not take writes" in health["database"], health
            assert health["database"].endswith(f"{db} is read-only"), health

            # Live ingest goes on: the connected rank and a new job, for many frames.
            with connect(url) as fresh:
                fresh.send(hello(job="ro-new", rank=0, world_size=1, global_batch_size=16))
                for i in range(30):
                    rank0.send(metrics(job="ro", rank=0, first=10 + 5 * i, n=5))
                    fresh.send(metrics(job="ro-new", rank=0, first=5 * i, n=5))
                wait_until(lambda: (server.get("/api/v1/jobs/ro")["batch_index"] == 159
                                    and server.get("/api/v1/jobs/ro-new")["batch_index"] == 149),
                           "live steps of both jobs", log=server.log)
                assert server.get("/api/v1/jobs/ro")["connected_ranks"] == 1
            # REST mutations answer JSON, not a plain-text 500.
            code, body = server.call("PUT", "/api/v1/jobs/ro/mode", body={"mode": "observe"})
            assert code == 503, (code, body)
            assert body["detail"].startswith("The database does not take writes now ("), body
            assert server.get("/api/v1/jobs/ro")["mode"] == "approve"

            _chattr("-i", db)
            wait_until(lambda: server.call("GET", "/healthz")[0] == 200, "healthz ok again",
                       log=lambda: f"{server.log()}\n{server.call('GET', '/healthz')}")
            rank0.send(metrics(job="ro", rank=0, first=160, n=10))
            # History resumes: what came during the outage (kept in memory) and after.
            wait_until(lambda: _stored_steps(db, "ro") == 170, "every step of job ro stored",
                       log=server.log)
            code, body = server.call("PUT", "/api/v1/jobs/ro/mode", body={"mode": "observe"})
            assert code == 200, body
            # Still the first connection: it was never closed.
            joined(rank0, "ro")
        log = server.log()
    assert _stored_steps(db, "ro-new") == 150
    assert "1011" not in log and "Traceback" not in log, log[-4000:]
    # Not flooded: 60 frames and a REST call in the outage, a handful of lines about it.
    fault_lines = [ln for ln in log.splitlines() if "read-only" in ln or "readonly" in ln]
    assert 1 <= len(fault_lines) <= 10, "\n".join(fault_lines)


@pytest.mark.multiproc
def test_deleted_sqlite_file_is_seen_and_restored(tmp_path):
    db = tmp_path / "rebalancer.db"
    env = {"REBALANCER_HEALTH_INTERVAL_S": "3600"}  # only /healthz looks, so the test sees it
    with running_server(tmp_path, env=env) as server:
        with connect(server.ws_url + "/ws/hook") as rank0:
            joined(rank0, "del")
            rank0.send(metrics(job="del", rank=0, first=0, n=10))
            wait_until(lambda: _stored_steps(db, "del") == 10, "the first steps stored")
            assert server.call("PUT", "/api/v1/jobs/del/mode", body={"mode": "observe"})[0] == 200
            for suffix in ("", "-wal", "-shm"):  # rm rebalancer.db*
                Path(f"{db}{suffix}").unlink(missing_ok=True)
            code, health = server.call("GET", "/healthz")
            assert code == 503 and "was deleted while the backend was serving" in health["database"]
            assert "restored" in health["database"], health
            assert server.call("GET", "/healthz")[0] == 200
            assert server.call("PUT", "/api/v1/jobs/del/mode", body={"mode": "auto"})[0] == 200
            rank0.send(metrics(job="del", rank=0, first=10, n=10))
            wait_until(lambda: _stored_steps(db, "del") == 20, "steps after the restore stored")
    with running_server(tmp_path, db_url=f"sqlite:///{db}") as server:
        job = server.get("/api/v1/jobs/del")
        audit = server.get("/api/v1/audit?job=del")
    assert job["mode"] == "auto", job
    assert [a["params"].get("mode") for a in audit["data"] if a["action"] == "job.mode"][:2] == ["auto", "observe"], audit
    assert _stored_steps(db, "del") == 20
