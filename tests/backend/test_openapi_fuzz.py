"""schemathesis over every REST operation of a real server, with an admin token (issue 15,
defect 6's REST half): no 5xx, no response outside the OpenAPI document (status codes,
content types, bodies, ``Allow`` on 405), bounded in examples (every phase
once, deterministic: no time budget), on SQLite and on PostgreSQL (which refuses what SQLite takes).

The server has a live 2-rank job (real hook websockets, metrics and a pending proposal), and
most generated cases name it (a schemathesis dictionary on the ``job`` and ``proposal_id``
path parameters), so the job routes are fuzzed past their 404: a run against an empty
server only ever reached "Job 'x' not found.". Revoking tokens is fuzzed last and alone:
it revokes the admin token the run uses (token 1 is an obvious id), after which every
other operation answered only 401.

``positive_data_acceptance`` holds every schema-valid request to anything but 422: the
schema says each value's type, enum and bounds, so a 422 means the document is looser than
the server (issue 26). Rules across fields that JSON Schema cannot say (a hook token needs
its job, a placement's shares sum to the global batch, a proposal must be pending) are
refused with 400, 404 or 409 and a sentence, and count as answers to valid data.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.backend._app import hello, metrics
from tests.helpers.server import Server, running_server
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(420)]

ADMIN = "rb_fuzz_admin_0123456789abcdef"
JOB = "fuzz-job"
# Every operation's examples, coverage cases and MAX_EXAMPLES fuzzed cases, once, about 8 s a
# database. A time budget (--max-time) made schemathesis repeat its fuzzing until it was spent
# (30 s) and skip cases the single deterministic pass makes: without it the run found an
# empty job name and a NUL in an unknown key accepted on POST /api/v1/tokens.
MAX_EXAMPLES = 25
REVOKE = "revoke_api_v1_tokens__token_id__delete"
CONFIG = f"""
[dictionaries.jobs]
values = ["{JOB}"]
[dictionaries.proposals]
values = [1, 2]
[parameters]
"path.job" = {{ dictionary = "jobs", probability = 0.8 }}
"path.proposal_id" = {{ dictionary = "proposals", probability = 0.5 }}
[checks.positive_data_acceptance]
expected-statuses = ["2XX", "400", "401", "403", "404", "409", "503"]
"""


def _st() -> str:
    found = shutil.which("st", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("schemathesis is not installed: make setup installs it (the dev extra)")
    return found


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Both databases: PostgreSQL refuses what SQLite takes (NUL in text, over-long strings)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'rebalancer.db'}"
        return
    from tests.helpers.postgres import pg_schema

    with pg_schema() as url:
        yield url


@pytest.fixture
def live_job(tmp_path: Path, database: str) -> Iterator[Server]:
    """A server whose job JOB has two connected ranks (rank 1 three times slower) and a
    pending proposal; the hook sockets stay open, answering nothing, until the test ends."""
    with running_server(tmp_path, db_url=database, env={
            "REBALANCER_ADMIN_TOKEN": ADMIN, "REBALANCER_MIN_STEPS": "6", "REBALANCER_LOG_LEVEL": "warning"}) as server:
        auth = {"Authorization": f"Bearer {ADMIN}"}
        with connect(server.ws_url + "/ws/hook", additional_headers=auth) as r0, \
                connect(server.ws_url + "/ws/hook", additional_headers=auth) as r1:
            for rank, ws in enumerate((r0, r1)):
                ws.send(hello(job=JOB, rank=rank, world_size=2, global_batch_size=32))
                assert json.loads(ws.recv(timeout=10))["type"] == "placement"
            for rank, ws in enumerate((r0, r1)):
                ws.send(metrics(job=JOB, rank=rank, first=0, n=30, compute_ms=10.0 * (1 + 2 * rank),
                                step_ms=40.0))
            readers = [threading.Thread(target=_drain, args=(ws,), daemon=True) for ws in (r0, r1)]
            for t in readers:
                t.start()
            wait_until(lambda: server.get(f"/api/v1/jobs/{JOB}", ADMIN)["pending_proposal_id"],  # type: ignore[index]
                       "a pending proposal", 30, log=server.log)
            yield server


def _drain(ws: ClientConnection) -> None:
    try:
        for _ in ws:
            pass
    except (ConnectionClosed, OSError):
        pass


def _run(st: str, server: Server, config: Path, *args: str) -> str:
    done = subprocess.run(
        [st, "--config-file", str(config), "run", f"{server.url}/openapi.json",
         "-H", f"Authorization: Bearer {ADMIN}",
         "--checks", "all",
         "--generation-deterministic", "--generation-with-security-parameters", "false",
         "--phases", "examples,coverage,fuzzing", "--no-color", "--workers", "1", *args],
        capture_output=True, text=True, timeout=240,
        cwd=config.parent,  # its .schemathesis/ cache (replayed crashes) stays out of the repo
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-12000:]
    assert "Tested: " in report and "Selected: " in report, report[-3000:]
    return report


def test_every_operation_answers_within_its_schema(live_job: Server, tmp_path: Path):
    st = _st()
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    report = _run(st, live_job, config, "--exclude-operation-id", REVOKE,
                  "--max-examples", str(MAX_EXAMPLES))
    # The admin token held: no operation was left answering only 401/403.
    assert "Authentication failed" not in report, report[-6000:]
    assert live_job.get("/api/v1/whoami", ADMIN)["role"] == "admin"  # type: ignore[index]
    # Token revocation last and alone (it revokes the run's admin token).
    _run(st, live_job, config, "--include-operation-id", REVOKE, "--max-examples", str(MAX_EXAMPLES))
    log = live_job.log()
    assert "Traceback" not in log, log[-4000:]
