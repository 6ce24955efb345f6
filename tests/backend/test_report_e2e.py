"""The end-of-run report of a real finished job: a real backend process, a real 2-rank
torchrun/gloo job of ``trainer_hook.demo_worker`` (one rank four times slower, auto mode,
so placements change during the run) that ends by itself; every rank's hook closes, the
backend stores the report. Its numbers are checked against the placements history; the
CLI writes its HTML, which headless Chromium opens with the network cut off; the dashboard's
page of the finished job shows the same report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.server import Server, running_server
from tests.helpers.torchrun import REPO_ROOT, run_torchrun
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

ADMIN = "report-admin-secret-0123456789"
JOB = "report-job"
B = 32
STEPS = 60
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@dataclass
class Finished:
    server: Server
    report: dict[str, Any]
    placements: list[dict[str, Any]]
    tmp: Path


def _cli(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REBALANCER_SERVER": server.url, "REBALANCER_TOKEN": ADMIN, "PYTHONPATH": REPO_ROOT}
    return subprocess.run([sys.executable, "-m", "backend", *args], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=60)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Finished]:
    tmp = tmp_path_factory.mktemp("report")
    env = {"REBALANCER_ADMIN_TOKEN": ADMIN, "REBALANCER_DEFAULT_MODE": "auto", "REBALANCER_MIN_STEPS": "6",
           "REBALANCER_COOLDOWN_STEPS": "10", "REBALANCER_EFFECT_WINDOW_STEPS": "8",
           "REBALANCER_PERSIST_INTERVAL_S": "0.5"}
    with running_server(tmp, env=env) as server:
        run_torchrun(2, ["-m", "trainer_hook.demo_worker", "--server", server.url, "--job", JOB,
                         "--token", ADMIN, "--steps", str(STEPS), "--global-batch-size", str(B),
                         "--speeds", "1,0.25", "--per-sample-ms", "1.0", "--fixed-ms", "1.0"],
                     timeout=150)

        def stored() -> Any:
            status, body = server.call("GET", f"/api/v1/jobs/{JOB}/report", ADMIN)
            return body if status == 200 and body.get("finished") else None

        report = wait_until(stored, "the backend to store the finished job's report", 30, log=server.log)
        status, placements = server.call("GET", f"/api/v1/jobs/{JOB}/placements?limit=1000", ADMIN)
        assert status == 200
        yield Finished(server=server, report=report, placements=placements["data"], tmp=tmp)


def test_the_report_of_a_finished_job_matches_its_placements_history(finished: Finished):
    r, history = finished.report, sorted(finished.placements, key=lambda p: p["version"])
    assert r["reason"] == "every rank said goodbye" and r["steps"] == STEPS
    assert [(p["version"], p["source"], p["shares"], p["effective_batch_index"]) for p in r["placements"]] == [
        (p["version"], p["source"], p["shares"], p["effective_batch_index"]) for p in history]
    assert len(history) >= 2, "auto mode should have moved work off the slow rank"
    assert r["final_shares"] == history[-1]["shares"]
    # Each rank's mean batch is what the placements gave it, weighted by the steps each was
    # in force: version v from its effective batch index to the next one's.
    applied = [p for p in history if p["version"] == 0 or p["effective_batch_index"] is not None]
    starts = [0 if p["version"] == 0 else p["effective_batch_index"] for p in applied] + [STEPS]
    for x in r["ranks"]:
        assert x["steps"] == STEPS
        expected = sum(p["shares"][x["rank"]] * (max(min(b1, STEPS), 0) - max(min(b0, STEPS), 0))
                       for p, b0, b1 in zip(applied, starts, starts[1:], strict=False)) / STEPS
        assert x["mean_local_batch_size"] == pytest.approx(expected, abs=1e-3), (x, applied)
    # The slow rank computes longer per step; the split of each rank's time adds up.
    by = {x["rank"]: x for x in r["ranks"]}
    assert by[1]["compute_ms_per_step"] > by[0]["compute_ms_per_step"]
    for x in r["ranks"]:
        assert x["compute_s"] + x["sync_wait_s"] + x["data_wait_s"] + x["optimizer_s"] <= x["step_s"] * 1.05
    assert r["samples"] == STEPS * B
    assert r["samples_per_s"] == pytest.approx(STEPS * B / r["duration_s"], rel=1e-3)
    assert r["cost"]["total"] == pytest.approx(r["cost"]["per_hour"] * r["duration_s"] / 3600, rel=1e-3)
    assert r["savings"] is not None and r["savings"]["measured_s"] > 0
    assert {d["rank"] for d in r["advice"]["drop"]} == {0, 1}
    assert sum(r["decisions"].values()) == len(r["proposals"])


def test_cli_writes_an_offline_html_report_that_chromium_opens_without_errors(finished: Finished):
    out = finished.tmp / "report.html"
    done = _cli(finished.server, "report", JOB, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert f"Wrote the report of {JOB} to {out}" in done.stdout
    text = _cli(finished.server, "report", JOB)
    assert text.returncode == 0 and f"Job {JOB}: finished (every rank said goodbye)" in text.stdout
    as_json = _cli(finished.server, "report", JOB, "--json")
    assert json.loads(as_json.stdout)["steps"] == STEPS
    missing = _cli(finished.server, "report", "nope")
    assert missing.returncode == 1 and "Job 'nope' not found. (HTTP 404)" in missing.stderr
    cmp_out = finished.tmp / "compare.html"
    assert _cli(finished.server, "report", JOB, "--compare", JOB, "--out", str(cmp_out)).returncode == 0
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing; install Debian's chromium (make browser).")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            for page_file, charts in ((out, 4), (cmp_out, 2)):
                problems: list[str] = []
                ctx = browser.new_context()
                page = ctx.new_page()

                def route(req: Any, problems: list[str] = problems) -> None:
                    if urllib.parse.urlsplit(req.request.url).scheme != "file":
                        problems.append(f"outside request {req.request.url}")
                        req.abort()
                    else:
                        req.continue_()

                page.route("**/*", route)
                page.on("pageerror", lambda exc, problems=problems: problems.append(f"page error {exc}"))
                page.on("console", lambda m, problems=problems: m.type == "error" and problems.append(m.text))
                page.goto(page_file.as_uri())
                page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot').length >= {charts}",
                                       timeout=30_000)
                assert problems == [], (page_file, problems)
                ctx.close()
            # The dashboard's page of the finished job shows the same report.
            ctx = browser.new_context()
            page = ctx.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(f"page error {exc}"))
            page.goto(f"{finished.server.url}/job/{JOB}?token={ADMIN}")
            page.wait_for_selector("#report-card:not([hidden])", timeout=30_000)
            advice = page.locator("#report-advice li").all_inner_texts()
            assert advice == finished.report["advice"]["summary"]
            frame = page.frame_locator("#report-frame")
            frame.locator("h1").filter(has_text=f"Run report: {JOB}").wait_for(timeout=30_000)
            page.wait_for_function(
                "document.getElementById('report-frame').contentDocument"
                ".querySelectorAll('.js-plotly-plot').length >= 4", timeout=30_000)
            assert errors == []
            ctx.close()
        finally:
            browser.close()
