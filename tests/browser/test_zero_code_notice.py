"""The job page of a job monitored by `rebalancer run` (no code change) says so under its
header, with the one line that enables rebalancing and the policy's predicted gain: none
for one process, the proposal's for a 2-rank DDP job with a straggler."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.browser._chromium import chromium, new_page, playwright_sync_api
from tests.helpers.server import running_server
from tests.helpers.torchrun import REPO_ROOT, job_env, torchrun_cmd

pytestmark = [pytest.mark.browser, pytest.mark.multiproc, pytest.mark.timeout(240)]

playwright_sync_api()  # skips this module without Chromium or Playwright
SCRIPT = os.path.join(REPO_ROOT, "tests", "integrations", "_plain_single_job.py")
DDP_SCRIPT = os.path.join(REPO_ROOT, "tests", "integrations", "_plain_ddp_job.py")


def test_job_page_shows_the_zero_code_notice(tmp_path: Path) -> None:
    with running_server(tmp_path) as server:
        proc = subprocess.run(
            [sys.executable, "-m", "backend", "run", "--server", server.url, "--job", "zc-page", "--",
             sys.executable, SCRIPT, "60"],
            env=job_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr
        ranks = server.get("/api/v1/jobs/zc-page/ranks")["data"]  # type: ignore[index]
        assert ranks[0]["hook_version"].endswith("observe-only (rebalancer run): ddp")
        # Rank 1 computes 30 ms longer a step: the policy proposes moving work off it.
        proc = subprocess.run(
            [sys.executable, "-m", "backend", "run", "--server", server.url, "--job", "zc-gain", "--",
             *torchrun_cmd(2, [DDP_SCRIPT, "80", "0", "30"])],
            env=job_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0, proc.stderr
        proposal = server.get("/api/v1/jobs/zc-gain/proposals")["data"][0]  # type: ignore[index]
        assert proposal["status"] == "proposed" and proposal["predicted_gain"] > 0
        with chromium() as browser:
            page = new_page(browser)
            page.goto(f"{server.url}/job/zc-page")
            page.wait_for_selector("#zero-code-notice:not([hidden])")
            text = page.locator("#zero-code-notice").inner_text()
            assert text.startswith("Monitored by rebalancer run without code change: observe only. "
                                   "One line enables rebalancing: ")
            line = page.locator("#zero-code-line").inner_text()
            assert line.startswith("hook = RebalanceHook(global_batch_size=4); hook.attach(ddp_model); "
                                   "loader = hook.data_loader(dataset)")
            gain = page.locator("#zero-code-gain").inner_text()
            assert gain == "the policy predicts no gain above its threshold yet (observe mode)."
            page.goto(f"{server.url}/job/zc-gain")
            page.wait_for_selector("#zero-code-notice:not([hidden])")
            assert page.locator("#zero-code-line").inner_text().startswith(
                "hook = RebalanceHook(global_batch_size=16); hook.attach(ddp_model);")
            want = (f"the policy predicts {100 * proposal['predicted_gain']:.1f}% shorter steps with it "
                    f"(proposal {proposal['id']}, observe mode).")
            page.wait_for_function("w => document.getElementById('zero-code-gain').innerText === w", arg=want)
