"""Issue 25 end to end: a real 2-rank gloo job (rank 1 slower) streams to a real backend;
REST gives each rank its bytes per step (the parameters' bytes), time in collectives,
wait for peers and busbw, and the job its bound; the job view shows the verdict badge and
the per-rank chart in real Chromium."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.browser._chromium import chromium, new_page, playwright_sync_api
from tests.helpers.server import running_server
from tests.helpers.torchrun import run_torchrun

pytestmark = [pytest.mark.browser, pytest.mark.multiproc, pytest.mark.timeout(300)]

playwright_sync_api()  # skips this module without Chromium or Playwright
JOB = "dash-comm"


def test_ranks_bound_and_the_job_view_show_communication(tmp_path: Path) -> None:
    env = {"REBALANCER_DEFAULT_MODE": "observe"}
    with running_server(tmp_path, env=env) as server:
        run_torchrun(2, ["tests/trainer_hook/_comm_worker.py", "--out", str(tmp_path), "--steps", "30",
                         "--delay-ms", "2", "--slow", "1", "--server", server.url, "--job", JOB], timeout=200)
        param_bytes = json.loads((tmp_path / "rank0.json").read_text())["param_bytes"]
        ranks: Any = server.get(f"/api/v1/jobs/{JOB}/ranks")
        job: Any = server.get(f"/api/v1/jobs/{JOB}")
        r0, r1 = ranks["data"]
        for r in (r0, r1):
            assert r["comm_bytes_per_step"] == pytest.approx(param_bytes, rel=0.01)
            assert r["busbw_gbps"] is not None and r["busbw_gbps"] > 0
        # Rank 0 waits for the slower rank 1 inside the all-reduce; rank 1 (the last arriver) does not.
        assert r0["wait_ms"] > 5 * r1["wait_ms"]
        bound = job["bound"]
        assert bound["verdict"] in ("compute-bound", "communication-bound", "balanced")
        assert bound["kind"] == "all_reduce" and bound["comm_bytes_per_step"] == pytest.approx(param_bytes, rel=0.01)
        with chromium() as browser:
            page = new_page(browser)
            page.goto(f"{server.url}/job/{JOB}")
            page.wait_for_function(
                f"() => document.querySelector('#bound-badge').textContent === '{bound['verdict']}'")
            assert bound["verdict"] in (page.locator("#bound-badge").get_attribute("class") or "")
            assert page.locator("#bound-detail").inner_text().startswith(bound["verdict"])
            page.wait_for_function("() => (document.querySelector('#comm-bars').data || []).length === 3")
            bars = page.evaluate("() => document.querySelector('#comm-bars').data[0].y")
            assert bars == [pytest.approx(r0["busbw_gbps"], rel=0.2), pytest.approx(r1["busbw_gbps"], rel=0.2)]
            # Why is this job slow: the table lists REST's causes in its order (docs/causes.md).
            causes: Any = server.get(f"/api/v1/jobs/{JOB}/causes")
            assert causes["window_steps"] > 0
            names = [c["cause"] for c in causes["data"]]
            page.wait_for_function("() => (window.rebalancer.causes.last || {}).window_steps > 0")
            shown = page.evaluate(
                "() => [...document.querySelectorAll('#causes-table tbody tr[data-cause]')].map(r => r.dataset.cause)")
            assert shown == names
