"""The fitted cost model end to end (issue 23, item 2): real hook processes give sample
lengths to a real backend, which fits time = c + a*sum(L) + b*sum(L^2) per rank, says in
the job view which model is in use and how well it fits, and sends the fitted k to the hooks
in a placement (auto mode) that both ranks of a torchrun job schedule at the same batch for
their split, and the job view in real Chromium says so in a line, with the fit's R^2 beside
the length alone's. One server for the module.

The workers time each step on a clock that moves by exactly its modelled cost (with a seeded
1% jitter; ``tests/backend/_lengths_worker.py``): the fit's inputs are the same on every run,
so a loaded machine's late wake-ups no longer decide which model this test sees (the CI once
got the wire's bound for k, and once the linear model's name while a k stayed in force). The
policy's handling of that noise is tested by replaying it (``tests/backend/policy/test_costfit.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser._chromium import ARGS, CHROMIUM, playwright_sync_api
from tests.helpers.server import Server, running_server
from tests.helpers.torchrun import REPO_ROOT, start_torchrun
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.browser, pytest.mark.timeout(300)]

sync_api = playwright_sync_api()

ENV = {"REBALANCER_DEFAULT_MODE": "auto", "REBALANCER_MIN_STEPS": "6", "REBALANCER_COOLDOWN_STEPS": "6"}
# ms per token and per squared token. The quadratic job's 2,000-token document costs 40 ms of
# attention beside 4 ms linear; the linear job's 20 ms. Both stand well above the jitter of
# sleeps on a loaded machine, which is the noise the fit has to see through.
A_MS, B_MS = 0.002, 1e-5
A_LINEAR_MS = 0.01


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("costmodel"), env=ENV) as s:
        yield s


def _start(server: Server, job: str, a_ms: float, b_ms: float, out: Path, ranks: int) -> subprocess.Popen[str]:
    args = ["-m", "tests.backend._lengths_worker", "--server", server.url, "--job", job,
            "--a-ms", str(a_ms), "--b-ms", str(b_ms), "--steps", "400", "--result", str(out)]
    if ranks > 1:
        return start_torchrun(ranks, args)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


LAST: dict[str, Any] = {}  # the newest job view per job, shown when a wait times out


def _cost_model_line(server: Server, job: str) -> str:
    """The job page's cost-model line, once it names the fitted model (real Chromium)."""
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(f"{server.url}/job/{job}")
            page.wait_for_function("() => document.querySelector('#cost-model').textContent"
                                   ".startsWith('Cost model: fitted a*L+b*L^2, R² ')")
            return page.locator("#cost-model").inner_text()
        finally:
            browser.close()


def _cost_model(server: Server, job: str) -> dict[str, Any] | None:
    try:
        body: Any = server.get(f"/api/v1/jobs/{job}")
    except OSError:
        return None
    LAST[job] = body
    model = body.get("cost_model")
    return model if model and model["ranks_fitted"] >= 1 and (body.get("batch_index") or 0) >= 60 else None


def test_the_job_view_names_the_fitted_model_on_quadratic_data_and_the_linear_one_on_linear(
        server: Server, tmp_path: Path) -> None:
    quad_out, lin_out = tmp_path / "quad.json", tmp_path / "lin.json"
    quad = _start(server, "tok-quad", A_MS, B_MS, quad_out, ranks=2)
    lin = _start(server, "tok-lin", A_LINEAR_MS, 0.0, lin_out, ranks=1)

    def shown() -> str:
        return json.dumps({j: {k: v.get(k) for k in ("batch_index", "status_detail", "cost_model")}
                           for j, v in LAST.items()}, indent=1)

    try:
        fitted = wait_until(
            lambda: (m if (m := _cost_model(server, "tok-quad")) and m["length_sq_weight_in_force"] > 0 else None),
            "the fitted cost model in force on tok-quad", 120, interval=0.3, log=shown)
        linear = wait_until(lambda: _cost_model(server, "tok-lin"), "a cost model on tok-lin", 120, interval=0.3,
                            log=shown)
        line = _cost_model_line(server, "tok-quad")  # while the jobs still run: the live page
    finally:
        for proc in (quad, lin):
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out
    placements: Any = server.get("/api/v1/jobs/tok-quad/placements")  # every ack is in by now

    # Quadratic cost: the fit explains the step times better than the length alone.
    assert fitted["model"] == "fitted a*L+b*L^2", fitted
    # k = b/a; a, small beside c and b, is the loose end on a loaded machine (its sleeps
    # overshoot): within 4x either way, as the replay of this job under heavy noise asks
    # (test_costfit; unit tests pin the fit itself on clean data). The project's CI once
    # showed the wire's bound here (1e6), each rank's own b/a in that noise.
    assert B_MS / A_MS / 4 < fitted["length_sq_weight"] < 4 * B_MS / A_MS, fitted
    # R^2 is what that noise leaves (0.68 on that run): the fit explains more than the length alone.
    assert fitted["r2"] > fitted["r2_linear"] and fitted["r2"] > 0.5, fitted
    assert fitted["ranks_quadratic"] == fitted["ranks_fitted"] == 2
    assert "L + " in fitted["detail"]
    assert "(length alone: " in line and "L + " in line, line
    # The first placement the fit sent (newest first in the list) put k in force, so both
    # ranks acked it; the policy may send k again as it refits, and one sent as the job
    # ends never takes effect (the ranks finished first), so only the first is checked.
    sent = [p for p in placements["data"] if p["source"] == "cost_model"][::-1]
    assert sent and sent[0]["shares"] == [4, 4] and "cost model: fitted a*L+b*L^2" in sent[0]["reason"], placements
    assert sorted(sent[0]["acks"]) == ["0", "1"], sent
    # Both ranks scheduled the fitted k with that placement, at the same batch: their split
    # weighs L + k*L^2 from then on, alike.
    timelines = [json.loads(Path(f"{quad_out}.{r}").read_text())["timeline"] for r in (0, 1)]
    assert timelines[0] == timelines[1]
    mine = [e for e in timelines[0] if e["version"] == sent[0]["version"]]
    assert mine, (timelines, sent)
    assert mine[0]["length_sq_weight"] > 0 and mine[0]["start_batch"] == sent[0]["effective_batch_index"], (mine, sent)

    # Linear cost: the length alone explains the step times; nothing is sent.
    assert linear["model"] == "work (linear)", linear
    assert linear["length_sq_weight"] == linear["length_sq_weight_in_force"] == 0.0
    assert linear["r2"] is not None and linear["r2"] > 0.5 and linear["ranks_quadratic"] == 0, linear
    lin_placements: Any = server.get("/api/v1/jobs/tok-lin/placements")
    assert not [p for p in lin_placements["data"] if p["source"] == "cost_model"]
    assert all(e["length_sq_weight"] == 0.0 for e in json.loads(Path(f"{lin_out}.0").read_text())["timeline"])
