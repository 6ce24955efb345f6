"""The pages under their Content-Security-Policy in real Chromium (issue 26 item 9): the
overview, the job page with its run report (a srcdoc frame) and the report on its own load
with 0 console errors and 0 CSP violations, and no page can be framed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rebalancer_wire.protocol import Hello, Metrics, StepRecord, encode
from tests.browser._chromium import ARGS, CHROMIUM, playwright_sync_api
from tests.helpers.server import Server, running_server

pytestmark = [pytest.mark.browser]

JOB = "csp-job"
sync_api = playwright_sync_api()
websockets = pytest.importorskip("websockets")

# Every frame reports its violations to the page's list (init scripts run in every frame).
WATCH = """
window.__violations = [];
document.addEventListener('securitypolicyviolation', (e) => {
  (window.top.__violations || window.__violations).push(
    `${e.violatedDirective} blocked ${e.blockedURI || 'inline'} in ${location.href}`);
});
"""


async def _run_job(url: str) -> None:
    """A finished 2-rank job: hello, 40 steps each, goodbye (the backend stores its report)."""
    async def rank(r: int) -> None:
        async with websockets.connect(url + "/ws/hook") as ws:
            await ws.send(encode(Hello(job=JOB, rank=r, world_size=2, global_batch_size=32,
                                       device_type="H100", host="h")))
            await ws.recv()
            t0 = time.time() - 10
            recs = [StepRecord(batch_index=b, local_batch_size=16, placement_version=0, data_wait_ms=0.2,
                               compute_ms=50.0 * (1 + r), sync_wait_ms=100.0 - 50.0 * (1 + r) + 5,
                               optimizer_ms=1.0, step_ms=106.0, t=t0 + b * 0.106) for b in range(40)]
            await ws.send(encode(Metrics(job=JOB, rank=r, steps=recs)))
            await asyncio.sleep(1.5)

    await asyncio.gather(rank(0), rank(1))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Any]]:
    tmp: Path = tmp_path_factory.mktemp("csp")
    with running_server(tmp) as srv:  # open mode: no token
        asyncio.run(_run_job(srv.ws_url))  # before Playwright's own event loop runs
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                yield srv, browser
            finally:
                browser.close()


def _load(stack: tuple[Server, Any], path: str, ready: str) -> tuple[list[str], list[str]]:
    srv, browser = stack
    ctx = browser.new_context()
    ctx.add_init_script(WATCH)
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(srv.url + path)
    page.wait_for_function(ready)
    page.wait_for_timeout(500)  # late violations (styles plotly adds as it draws)
    violations = list(page.evaluate("() => window.__violations"))
    ctx.close()
    return errors, violations


def test_the_overview_runs_under_its_policy(stack: tuple[Server, Any]) -> None:
    errors, violations = _load(stack, "/", f"() => document.body.textContent.includes('{JOB}')")
    assert (errors, violations) == ([], [])


def test_the_job_page_and_its_report_frame_run_under_the_policy(stack: tuple[Server, Any]) -> None:
    ready = ("() => { const s = window.rebalancerReport; const f = document.getElementById('report-frame');"
             " return s && s.shown && f.contentDocument && f.contentDocument.querySelector('.js-plotly-plot'); }")
    errors, violations = _load(stack, f"/job/{JOB}", ready)
    assert (errors, violations) == ([], [])


def test_the_report_alone_runs_under_its_policy(stack: tuple[Server, Any]) -> None:
    errors, violations = _load(stack, f"/api/v1/jobs/{JOB}/report?format=html",
                               "() => document.querySelectorAll('.js-plotly-plot').length >= 3")
    assert (errors, violations) == ([], [])


def test_no_page_can_be_framed(stack: tuple[Server, Any]) -> None:
    srv, browser = stack
    page = browser.new_page()
    blocked: list[str] = []
    page.on("console", lambda m: blocked.append(m.text) if "frame-ancestors" in m.text else None)
    page.set_content(f'<iframe id="f" src="{srv.url}/"></iframe>')
    page.wait_for_timeout(1500)
    frame = page.frame_locator("#f")
    assert frame.locator("#jobs-table").count() == 0  # the overview never rendered in the frame
    page.close()
