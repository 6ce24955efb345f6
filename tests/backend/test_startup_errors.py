"""``rebalancer serve`` with a database it cannot open: one line on stderr and exit 2,
like every other start-up refusal (issue 15, defect 7)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from backend.process import free_port
from tests.helpers.torchrun import REPO_ROOT


def _serve(db: str, tmp_path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "backend", "serve", "--port", str(free_port()), "--db", db],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )


@pytest.mark.multiproc
@pytest.mark.postgres
def test_missing_postgresql_database_is_one_line_and_exit_2(tmp_path):
    done = _serve("postgresql://postgres@127.0.0.1:5432/rebalancer_missing_db", tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("rebalancer: refusing to start, cannot open the database "
                               "postgresql://postgres@127.0.0.1:5432/rebalancer_missing_db: "), lines[0]
    assert 'database "rebalancer_missing_db" does not exist' in lines[0]
    assert "Traceback" not in done.stderr


@pytest.mark.multiproc
def test_unwritable_sqlite_folder_is_one_line_and_exit_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    done = _serve(f"sqlite:///{blocker}/sub/rebalancer.db", tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rebalancer: refusing to start, cannot open the database "), done.stderr[-3000:]


_SPAWNS_A_BACKEND = """
import sys, time
from pathlib import Path
from backend.process import spawn_backend, wait_healthy
port, db, log = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
proc = spawn_backend(port=port, db_url=db, log_path=log, new_session=True)
assert wait_healthy(f"http://127.0.0.1:{port}", proc, 60) is None
print(proc.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.multiproc
def test_a_backend_started_by_a_killed_parent_stops_by_itself(tmp_path):
    """`rebalancer demo`, a bench or a test harness killed with SIGKILL runs no cleanup; the
    backend it started (in a session of its own) must not serve on forever."""
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers.ports import free_port
    from tests.helpers.torchrun import REPO_ROOT
    from tests.helpers.waiting import wait_gone

    log = tmp_path / "server.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", _SPAWNS_A_BACKEND, str(free_port()), f"sqlite:///{tmp_path / 'r.db'}", str(log)],
        cwd=REPO_ROOT, text=True, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    server = None
    try:
        server = int(parent.stdout.readline())  # type: ignore[union-attr]
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        wait_gone(server, "the orphaned backend to stop", 30, log=lambda: log.read_text(errors="replace"))
        assert "its parent process is gone" in log.read_text(errors="replace")
    finally:
        if parent.poll() is None:
            parent.kill()
        if server is not None:
            try:
                os.kill(server, signal.SIGKILL)
            except ProcessLookupError:
                pass
