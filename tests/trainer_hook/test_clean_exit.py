"""Every way a script may end a hooked 2-rank gloo job ends cleanly: exit code 0 (or the
user's own error), no abort (``terminate called``, ``Fatal Python error``), no Python
thread still running at exit, no process left behind.

The jobs are the soak's (``bench._soak_worker``) against a real backend, launched and
judged by the soak's own launcher and rules (``bench._launch``, ``bench.soak.classify``).
Before the hook closed itself at exit, ``no-close`` left the transport, probe and
websocket threads running into interpreter finalisation (``SOAK-THREADS-LEFT``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench._launch import first_stacks, launch, torchrun_cmd
from bench.soak import PATHS, WORKER, classify
from tests.helpers.server import Server, running_server

pytestmark = pytest.mark.multiproc

# (soak path, what the script does at its end). The usual end, hook.close() then
# destroy_process_group(), is every other soak path's: tests/bench/test_soak.py runs two
# of them (a live and a killed backend) and judges them by the same rules.
ENDS = {
    "end-after-destroy": "destroy_process_group(), then hook.close()",
    "end-no-close": "neither: the interpreter's exit",
    "end-exception": "the user's error raised from the loop",
    "end-interrupt": "KeyboardInterrupt from the loop",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("clean-exit")) as srv:
        yield srv


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(ENDS))
def test_every_end_of_a_script_exits_cleanly(name: str, server: Server, tmp_path: Path) -> None:
    path = PATHS[name]
    res = launch(torchrun_cmd(2, [*WORKER, *path.args]), timeout=150,
                 env={"REBALANCER_SERVER": server.url, "REBALANCER_JOB": f"exit-{name}"},
                 log_path=tmp_path / "job.log")
    reasons = classify(path, res)
    assert reasons == [], f"{ENDS[name]}: {reasons}\n{first_stacks(res.output)}"
