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


def test_unwritable_sqlite_folder_is_one_line_and_exit_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    done = _serve(f"sqlite:///{blocker}/sub/rebalancer.db", tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rebalancer: refusing to start, cannot open the database "), done.stderr[-3000:]
