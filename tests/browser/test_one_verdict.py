"""One verdict per page (issue 39, items 1 and 5) in real Chromium against a real backend
whose jobs' ranks speak the real hook protocol (tests/helpers/fake_fleet: one process, no
training). One backend, one browser and one page serve the module; the tests run in order.

Reported on a user's jobs: "balanced" beside a red "imbalance 100.6%", Approve buttons and
pending counts on finished observe-only jobs, a red "data is stale" on jobs that ended, a
negative "saved" on a job whose split never changed, Approve answering "Proposal 94 is
superseded" while proposal 98 was on screen, and a /docs that could not authorize.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rebalancer_wire.protocol import Metrics, StepRecord, encode
from tests.browser._chromium import chromium, new_page, playwright_sync_api
from tests.helpers.fake_fleet import FakeJob, FleetPage, fleet_server
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.browser]

playwright_sync_api()  # skips this module without Chromium or Playwright
CPU = "cpu"


class Env(FleetPage):
    def rest(self, path: str) -> Any:
        return self.server.get(f"/api/v1{path}", self.admin)

    def send(self, name: str, shares: list[int], per_sample_ms: list[float], batches: int) -> None:
        """``batches`` more steps of job ``name`` under ``shares`` (version 0); a rank of
        share 0 trains a one-sample placeholder batch, as the hook's drained rank does."""
        job = self.fleet.jobs[name]

        async def go() -> None:
            first, job.next_batch = job.next_batch, job.next_batch + batches
            now = time.time()
            step = max(c * max(b, 1) for c, b in zip(per_sample_ms, shares, strict=True)) + 2.0
            for rank, ws in enumerate(job.sockets):
                compute = per_sample_ms[rank] * max(shares[rank], 1)
                recs = [StepRecord(batch_index=b, local_batch_size=shares[rank], placement_version=0,
                                   data_wait_ms=0.2, compute_ms=compute, sync_wait_ms=step - compute - 1.0,
                                   optimizer_ms=0.8, step_ms=step, t=now - (first + batches - b) * step / 1000)
                        for b in range(first, first + batches)]
                for i in range(0, len(recs), 25):
                    await ws.send(encode(Metrics(job=name, rank=rank, steps=recs[i:i + 25])))

        self.fleet._run(go())

    def end(self, name: str) -> None:
        """Every rank of ``name`` closes normally (the hook's close()): the run ended."""
        async def shut() -> None:
            for ws in self.fleet.jobs[name].sockets:
                await ws.close()
            await asyncio.sleep(0)

        self.fleet._run(shut())

    def open(self, job: str) -> None:
        self.page.goto(f"{self.server.url}/job/{job}")
        self.page.wait_for_function("() => window.rebalancer && window.rebalancer.state.draws > 0")

    def text(self, selector: str) -> str:
        return self.page.locator(selector).inner_text()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    # A pending proposal may be replaced at once (no minimum age) when clearly better.
    with fleet_server(tmp_path_factory.mktemp("verdict"), REBALANCER_PROPOSAL_MIN_AGE_S="0") as (srv, admin, fake):
        with chromium() as browser:
            page = new_page(browser, timeout_ms=30_000, viewport={"width": 1400, "height": 2000})
            page.goto(f"{srv.url}/?token={admin}")  # kept in localStorage for the pages
            yield Env(srv, admin, fake, page)


def test_a_drained_rank_does_not_make_a_balanced_job_look_imbalanced(env: Env) -> None:
    env.fleet.add(FakeJob(name="drained", devices=[CPU] * 3, per_sample_ms=[1.0] * 3, global_batch_size=48),
                  batches=0)
    env.send("drained", [24, 24, 0], [1.0, 1.0, 1.0], 30)
    wait_until(lambda: (env.rest("/jobs/drained").get("batch_index") or 0) >= 29, "30 batches of drained", 20)
    assert env.rest("/jobs/drained")["imbalance"] == pytest.approx(0.0, abs=1e-6)
    env.open("drained")
    env.page.wait_for_function("() => window.rebalancer.state.summary.batch_index >= 29")
    imbalance = env.page.locator("#stats .stat", has_text="imbalance")
    assert imbalance.locator(".v").inner_text() == "0.0%"
    assert "good" in (imbalance.locator(".v").get_attribute("class") or "")


def test_an_observe_only_job_shows_its_proposal_without_actions_and_ends_as_ended(env: Env) -> None:
    env.fleet.add(FakeJob(name="watched", devices=[CPU] * 2, per_sample_ms=[1.0, 3.0], global_batch_size=32),
                  batches=0)
    assert env.server.call("PUT", "/api/v1/jobs/watched/mode", env.admin, {"mode": "observe"})[0] == 200
    env.send("watched", [16, 16], [1.0, 3.0], 40)
    prop = wait_until(lambda: env.rest("/jobs/watched").get("pending_proposal_id"), "observe-mode proposal", 30,
                      log=env.server.log)
    env.open("watched")
    env.page.wait_for_selector("#proposal-note")
    assert env.text("#proposal-title") == f"Proposal {prop}"
    assert env.text("#proposal-note") == ("Observe mode: this proposal is shown, never sent. "
                                          "Set the mode to approve to act on it.")
    assert env.page.locator("#approve").count() == 0 and env.page.locator("#override-card").is_hidden()
    assert env.text("#status") != "proposal pending"
    # The run ends normally: "ended", no action, no stale banner, savings say what 0 means.
    env.end("watched")
    env.page.wait_for_function("() => document.getElementById('status').textContent === 'ended'")
    env.page.wait_for_selector("#ended-banner:not([hidden])")
    assert env.text("#ended-banner").startswith("The run ended at batch 39: every rank said goodbye ")
    assert env.page.locator("#proposal-note").inner_text() == "The run ended: no placement can take effect now."
    assert env.page.locator("#mode").is_hidden() and env.page.locator("#approve").count() == 0
    # No frame for a while (an ended run sends none): still no stale banner.
    env.page.evaluate("() => { window.rebalancer.state.lastFrameAt = Date.now() - 60000; }")
    env.page.wait_for_timeout(1200)
    assert env.page.locator("#stale-banner").is_hidden()
    assert env.text("#savings-note") == ("No change in split: the job still trains under the uniform split, "
                                         "so nothing is saved or lost.")
    assert env.page.locator("#savings .stat", has_text="time saved").locator(".v").inner_text() == "0.0 s"
    # The fleet counts nothing pending for it.
    env.page.goto(f"{env.server.url}/")
    row = env.page.locator("tr[data-job='watched']")
    row.wait_for()
    env.page.wait_for_function(
        "() => document.querySelector(\"tr[data-job='watched'] .pill\").textContent === 'ended'")
    assert row.locator("a.pending-link").count() == 0 and row.locator(".pill.stale").count() == 0
    assert env.rest("/fleet")["totals"]["pending_proposals"] == 0


def test_approving_a_replaced_proposal_says_what_replaced_it(env: Env) -> None:
    env.fleet.add(FakeJob(name="noisy", devices=[CPU] * 2, per_sample_ms=[1.0, 3.0], global_batch_size=32),
                  batches=0)
    env.send("noisy", [16, 16], [1.0, 3.0], 40)
    first = wait_until(lambda: env.rest("/jobs/noisy").get("pending_proposal_id"), "a proposal", 30,
                       log=env.server.log)
    env.open("noisy")
    env.page.wait_for_function(f"() => document.getElementById('proposal-title')?.textContent === 'Proposal {first}'")
    # The operator reads it; meanwhile rank 0 slows down and a clearly better split replaces
    # it before the page repaints (held here: the replacement lands between two frames).
    env.page.evaluate("() => { window.rebalancer.controls.renderProposal = () => {}; }")
    env.send("noisy", [16, 16], [4.0, 1.0], 150)
    wait_until(lambda: env.rest(f"/jobs/noisy/proposals/{first}")["status"] == "superseded",
               "the replacement", 30, log=env.server.log)
    env.page.click("#approve")
    env.page.wait_for_function("() => document.getElementById('control-msg').className === 'msg err'")
    replaced = env.rest(f"/jobs/noisy/proposals/{first}")
    second = min(p["id"] for p in env.rest("/jobs/noisy/proposals")["data"] if p["id"] > first)
    assert replaced["decision_reason"] == f"replaced by proposal {second} (a clearly better split)"
    at = time.strftime("%H:%M:%S", time.gmtime(replaced["decided_at"]))
    assert env.text("#control-msg") == (f"Proposal {first} was replaced by proposal {second} at {at} UTC "
                                        f"(a clearly better split); review {second}.")
    assert env.rest("/jobs/noisy")["placement"]["version"] == 0  # nothing was applied


def test_docs_can_authorize_and_try_a_call(env: Env) -> None:
    page = env.page
    page.goto(f"{env.server.url}/docs")
    page.click("button.btn.authorize")
    page.fill(".auth-container input", env.admin)
    page.click(".auth-btn-wrapper button.authorize")
    page.click(".auth-btn-wrapper button.btn-done")
    op = "#operations-jobs-list_jobs_api_v1_jobs_get"
    page.click(f"{op} .opblock-summary")
    page.click(f"{op} .try-out__btn")
    page.click(f"{op} .execute")
    status = page.locator(f"{op} .live-responses-table tbody .response-col_status").first
    status.wait_for()
    assert status.inner_text().strip() == "200"
