"""Every file SQLite uses made unwritable while the backend serves (issue 26, item 15).

With WAL the backend memory-mapped the database's WAL index (``rebalancer.db-shm``); made
immutable mid-job (``chattr +i``), the next write to a mapped page killed the backend
with SIGBUS. The backend now runs SQLite with its rollback journal, which maps nothing,
so each file it writes (the database, the journal beside it, the folder the journal is
made in) can fail only as a statement fails: ``/healthz`` degraded naming the file, REST
changes 503, metrics held in memory and written once the file is writable again.

One server for the module, on a database an earlier version left in WAL mode.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.sync.client import connect

from backend.report.collect import GOODBYE
from tests.backend._app import hello, metrics
from tests.backend.test_storage_faults import _chattr, _stored_steps, immutable  # noqa: F401  (fixture)
from tests.helpers.server import Server, running_server
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.multiproc  # one real server for the module


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    tmp = tmp_path_factory.mktemp("files")
    folder = tmp / "db"  # the database alone in its folder: the log stays writable
    folder.mkdir()
    db = folder / "rebalancer.db"
    legacy = sqlite3.connect(db)  # as an earlier version left it: WAL mode, a row stored
    assert legacy.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    legacy.execute("CREATE TABLE legacy (x INTEGER)")
    legacy.execute("INSERT INTO legacy VALUES (7)")
    legacy.commit()
    legacy.close()
    env = {"REBALANCER_HEALTH_INTERVAL_S": "0.5", "REBALANCER_PERSIST_INTERVAL_S": "0.2"}
    with running_server(tmp, db_url=f"sqlite:///{db}", env=env) as server:
        yield server, db
        log = server.log()
    assert "Traceback" not in log and "1011" not in log, log[-4000:]


def test_a_database_left_in_wal_mode_is_switched_to_the_rollback_journal(served: tuple[Server, Path]) -> None:
    server, db = served
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert conn.execute("SELECT x FROM legacy").fetchall() == [(7,)]  # nothing stored lost
    finally:
        conn.close()
    assert not Path(f"{db}-shm").exists() and not Path(f"{db}-wal").exists()


def test_no_storage_file_is_memory_mapped(served: tuple[Server, Path]) -> None:
    # A mapped page of a file that becomes unwritable is a SIGBUS, not an error.
    server, db = served
    with connect(server.ws_url + "/ws/hook") as rank0:
        rank0.send(hello(job="mapped", rank=0, world_size=1, global_batch_size=16))
        rank0.recv(timeout=10)
        rank0.send(metrics(job="mapped", rank=0, first=0, n=10))
        wait_until(lambda: _stored_steps(db, "mapped") == 10, "the steps stored", log=server.log)
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    mapped = sorted({ln.split()[-1] for ln in maps.splitlines() if str(db.parent) in ln})
    assert mapped == [], mapped


def _report_reason(db: Path, job: str) -> str | None:
    conn = sqlite3.connect(db)
    try:
        row = conn.execute("SELECT report_reason FROM run_summaries WHERE job = ?", (job,)).fetchone()
        return row[0] if row else None
    finally:
        conn.close()


@pytest.mark.parametrize("target", ["database", "journal", "folder"])
def test_a_storage_file_made_unwritable_mid_job_degrades_and_recovers(
        served: tuple[Server, Path], immutable, target: str) -> None:  # noqa: F811
    server, db = served
    job = f"files-{target}"
    path = {"database": db, "journal": Path(f"{db}-journal"), "folder": db.parent}[target]
    with connect(server.ws_url + "/ws/hook") as rank0:
        rank0.send(hello(job=job, rank=0, world_size=1, global_batch_size=16))
        assert json.loads(rank0.recv(timeout=10))["type"] == "placement"
        rank0.send(metrics(job=job, rank=0, first=0, n=10))
        wait_until(lambda: _stored_steps(db, job) == 10, "the first steps stored", log=server.log)

        if target == "journal":
            path.touch()  # an empty journal is not a hot one: SQLite opens it for its next write
        immutable(path)
        code, health = server.call("GET", "/healthz")
        assert code == 503 and health["status"] == "degraded", health
        assert health["database"] == f"the database does not take writes: {path} is read-only", health
        for i in range(32):  # live ingest goes on
            rank0.send(metrics(job=job, rank=0, first=10 + 5 * i, n=5))
        wait_until(lambda: server.get(f"/api/v1/jobs/{job}")["batch_index"] == 169, "live steps",
                   log=server.log)
        code, body = server.call("PUT", f"/api/v1/jobs/{job}/mode", body={"mode": "observe"})
        assert code == 503, (code, body)
        assert body["detail"].startswith("The database does not take writes now ("), body
    # The run ends inside the outage: its report waits for the database with its metrics.
    wait_until(lambda: f"storing the run report of job {job} failed" in server.log(),
               "the report tried in the outage", log=server.log)
    assert server.proc.poll() is None, server.log()[-3000:]

    _chattr("-i", path)
    wait_until(lambda: server.call("GET", "/healthz")[0] == 200, "healthz ok again", log=server.log)
    wait_until(lambda: _stored_steps(db, job) == 170, "every step stored", log=server.log)
    wait_until(lambda: _report_reason(db, job) == GOODBYE, "the run's report stored", log=server.log)
    code, body = server.call("PUT", f"/api/v1/jobs/{job}/mode", body={"mode": "observe"})
    assert code == 200, body
