"""schemathesis over every REST operation of a real server, with an admin token (issue 15,
defect 6's REST half): no 5xx, no response outside the OpenAPI document (status codes,
bodies, ``Allow`` on 405), bounded in examples and time.

Left out, on purpose: ``positive_data_acceptance``. Rules across fields (a hook token needs
its job, a placement's shares sum to the global batch, a proposal must be pending) cannot
be said in JSON Schema; the server refuses them with a sentence (400, 404, 409 or 422),
which that check counts as rejecting valid data.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.server import running_server

ADMIN = "rb_fuzz_admin_0123456789abcdef"
MAX_EXAMPLES = 8
MAX_TIME_S = 60


def _st() -> str:
    found = shutil.which("st", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("schemathesis is not installed: make setup installs it (the dev extra)")
    return found


def test_every_operation_answers_within_its_schema(tmp_path):
    st = _st()
    with running_server(tmp_path, env={"REBALANCER_ADMIN_TOKEN": ADMIN,
                                       "REBALANCER_LOG_LEVEL": "warning"}) as server:
        done = subprocess.run(
            [st, "run", f"{server.url}/openapi.json", "-H", f"Authorization: Bearer {ADMIN}",
             "--checks", "all", "--exclude-checks", "positive_data_acceptance",
             "--max-examples", str(MAX_EXAMPLES), "--max-time", str(MAX_TIME_S),
             "--generation-deterministic", "--generation-with-security-parameters", "false",
             "--phases", "examples,coverage,fuzzing", "--no-color", "--workers", "1"],
            capture_output=True, text=True, timeout=MAX_TIME_S + 120,
        )
        log = server.log()
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-12000:]
    assert "Tested: " in report and "Selected: " in report, report[-3000:]
    assert "Traceback" not in log, log[-4000:]
