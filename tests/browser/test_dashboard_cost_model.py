"""Issue 23, item 2, in the job view: a real hook process gives sample lengths whose step
times follow c + a*sum(L) + b*sum(L^2); once the backend has fitted that model, the job
view in real Chromium says so in a line, with the fit's R^2 beside the length alone's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.browser._chromium import ARGS, CHROMIUM, playwright_sync_api
from tests.helpers.server import running_server
from tests.helpers.torchrun import REPO_ROOT
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.multiproc, pytest.mark.timeout(300)]

sync_api = playwright_sync_api()
JOB = "dash-cost"


def test_the_job_view_says_which_cost_model_is_in_use(tmp_path: Path) -> None:
    with running_server(tmp_path, env={"REBALANCER_DEFAULT_MODE": "auto", "REBALANCER_MIN_STEPS": "6"}) as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.backend._lengths_worker", "--server", server.url, "--job", JOB,
             "--a-ms", "0.002", "--b-ms", "1e-5", "--steps", "400", "--result", str(tmp_path / "out.json")],
            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            def fitted() -> Any:
                try:
                    body: Any = server.get(f"/api/v1/jobs/{JOB}")
                except OSError:
                    return None
                m = body.get("cost_model")
                return m if m and m["length_sq_weight_in_force"] > 0 else None

            model = wait_until(fitted, "the fitted cost model in force", 120, interval=0.3)
            with sync_api.sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                try:
                    page = browser.new_page()
                    page.set_default_timeout(60_000)
                    page.goto(f"{server.url}/job/{JOB}")
                    page.wait_for_function(
                        "() => document.querySelector('#cost-model').textContent"
                        ".startsWith('Cost model: fitted a*L+b*L^2, R² ')")
                    text = page.locator("#cost-model").inner_text()
                finally:
                    browser.close()
        finally:
            out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "(length alone: " in text and "L + " in text, text
        assert model["model"] == "fitted a*L+b*L^2"
