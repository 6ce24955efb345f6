"""The fleet view (the home page) in real Chromium against a real backend holding 50 jobs
whose ranks speak the real hook protocol (tests/helpers/fake_fleet: one process, real
websockets). One backend, one fleet and one page serve the module; the tests run in order:
rows and totals, sorting, filtering, a live update, and REST / /metrics against the page.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser._chromium import chromium, new_page, playwright_sync_api
from tests.helpers.fake_fleet import FakeJob, FleetPage, fleet_server
from tests.helpers.torchrun import REPO_ROOT
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.browser]

playwright_sync_api()  # skips this module without Chromium or Playwright

KINDS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA L4")
PER_SAMPLE_MS = {KINDS[0]: 0.5, KINDS[1]: 1.0, KINDS[2]: 2.0}
JOBS = 50
ARTIFACTS = Path(REPO_ROOT) / "test-artifacts"


def _job(i: int) -> FakeJob:
    world = 1 + i % 4
    devices = [KINDS[(i + r) % 3] for r in range(world)]
    return FakeJob(name=f"fleet-{i:02d}", devices=devices, per_sample_ms=[PER_SAMPLE_MS[d] for d in devices],
                   global_batch_size=8 * world)


class Fleet(FleetPage):
    def rest(self) -> dict[str, Any]:
        got = self.server.get("/api/v1/fleet", self.admin)
        assert isinstance(got, dict)
        return got

    def rows(self) -> list[str]:
        return self.page.eval_on_selector_all("#jobs-body tr[data-job]", "rs => rs.map(r => r.dataset.job)")

    def cells(self, column: int) -> list[str]:
        return self.page.eval_on_selector_all(
            "#jobs-body tr[data-job]", f"rs => rs.map(r => r.cells[{column}].textContent)")

    def total(self, name: str) -> str:
        return self.page.text_content(f"#total-{name}") or ""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # Jobs stay "running" for the whole module: they send their batches once, up front.
    with fleet_server(tmp_path_factory.mktemp("fleet")) as (srv, admin, fake):
        for i in range(JOBS - 1):  # the 50th arrives while the page is open
            fake.add(_job(i), batches=40)
        with chromium() as browser:
            page = new_page(browser, viewport={"width": 1600, "height": 2400})
            page.goto(f"{srv.url}/?token={admin}")
            yield Fleet(srv, admin, fake, page)


def test_every_job_has_a_row_and_the_totals_add_up(fleet: Fleet) -> None:
    wait_until(lambda: len(fleet.rows()) == JOBS - 1, "a row for each of the 49 jobs", 60,
               log=fleet.server.log)
    assert fleet.rows() == sorted(f"fleet-{i:02d}" for i in range(JOBS - 1))  # by name at first
    jobs = [_job(i) for i in range(JOBS - 1)]
    ranks = sum(j.world_size for j in jobs)
    wait_until(lambda: fleet.total("jobs") == str(JOBS - 1) and fleet.total("ranks") == str(ranks),
               "the totals of 49 jobs", 30)
    # A row: devices by kind and count, connected/total ranks, waste of an imbalanced job.
    row = fleet.page.locator("tr[data-job='fleet-05']")  # 2 ranks: L4 (2 ms/sample), H100 (0.5 ms)
    text = row.inner_text()
    assert "1× NVIDIA H100 80GB HBM3, 1× NVIDIA L4" in text and "2/2" in text
    def settled() -> dict[str, Any] | None:
        f = fleet.rest()
        multi = [r for r in f["data"] if r["world_size"] > 1]
        return f if f["count"] == JOBS - 1 and all(r["wasted_gpu_hours"] > 0 for r in multi) else None

    rest = {r["job"]: r for r in wait_until(settled, "every batch closed", 30)["data"]}
    # 40 batches; fleet-05 computes 16 and 4 ms a batch: 12 ms waited a batch.
    assert rest["fleet-05"]["wasted_gpu_hours"] == pytest.approx(40 * 12.0 / 3.6e6, rel=1e-6)
    assert rest["fleet-04"]["wasted_gpu_hours"] == 0.0  # one rank waits for nobody
    # The bound column says what the job's own REST says (backend.policy.comm, the one rule).
    verdict = fleet.server.get("/api/v1/jobs/fleet-05", fleet.admin)["bound"]["verdict"]  # type: ignore[index]
    assert rest["fleet-05"]["bound"] == verdict == "compute-bound"
    assert row.locator("td").nth(8).inner_text() == verdict
    # Pending proposals: the policy proposes for imbalanced jobs (approve mode); the row
    # links to the job page, where Approve is.
    pending = wait_until(lambda: [r for r in fleet.rest()["data"] if r["pending_proposals"]],
                         "a pending proposal", 60, log=fleet.server.log)
    name = pending[0]["job"]
    link = fleet.page.locator(f"tr[data-job='{name}'] a.pending-link")
    link.wait_for(timeout=30_000)
    assert link.get_attribute("href") == f"/job/{name}#placement-card"
    # Efficiency from the policy's fit once it has one; n/a before.
    fitted = wait_until(lambda: [r for r in fleet.rest()["data"] if r["efficiency"] is not None],
                        "a job with an efficiency figure", 60)
    assert all(0.0 < r["efficiency"] <= 1.0 for r in fitted)
    wait_until(lambda: fleet.total("pending") == str(fleet.rest()["totals"]["pending_proposals"]),
               "the page's pending total to match REST", 30)


def test_a_header_click_sorts_and_a_second_reverses(fleet: Fleet) -> None:
    header = fleet.page.locator("th[data-sort='world_size']")
    header.click()
    assert header.get_attribute("aria-sort") == "ascending"
    worlds = [int(c.split("/")[1]) for c in fleet.cells(3)]
    assert worlds == sorted(worlds) and worlds[0] == 1 and worlds[-1] == 4
    header.click()
    assert header.get_attribute("aria-sort") == "descending"
    worlds = [int(c.split("/")[1]) for c in fleet.cells(3)]
    assert worlds == sorted(worlds, reverse=True)
    # Ties keep name order; text columns sort too.
    fleet.page.locator("th[data-sort='job']").click()
    assert fleet.rows() == sorted(fleet.rows())
    fleet.page.locator("th[data-sort='job']").click()
    assert fleet.rows() == sorted(fleet.rows(), reverse=True)
    fleet.page.locator("th[data-sort='job']").click()  # back to ascending by name


def test_filters_by_text_and_status(fleet: Fleet) -> None:
    page = fleet.page
    page.fill("#filter-text", "l4")  # device kinds, case-insensitive
    want = sorted(j.name for j in map(_job, range(JOBS - 1)) if KINDS[2] in j.devices)
    wait_until(lambda: fleet.rows() == want, "only jobs with an L4", 10)
    assert page.text_content("#fleet-shown") == f"{len(want)} of {JOBS - 1} shown"
    page.fill("#filter-text", "fleet-1")  # job names
    wait_until(lambda: fleet.rows() == [f"fleet-{i}" for i in range(10, 20)], "jobs fleet-1x", 10)
    page.fill("#filter-text", "no-such-job")
    wait_until(lambda: page.inner_text("#jobs-body") == "No job matches the filter.", "an empty result", 10)
    page.fill("#filter-text", "")
    status = page.eval_on_selector("#jobs-body tr[data-job]", "r => r.dataset.status")
    page.select_option("#filter-status", status)
    statuses = page.eval_on_selector_all("#jobs-body tr[data-job]", "rs => rs.map(r => r.dataset.status)")
    assert statuses and set(statuses) == {status}
    page.select_option("#filter-status", "idle")  # every job is connected and fresh
    wait_until(lambda: page.inner_text("#jobs-body") == "No job matches the filter.", "no idle job", 10)
    page.select_option("#filter-status", "running")
    wait_until(lambda: len(fleet.rows()) == JOBS - 1, "every job running", 10)
    page.select_option("#filter-status", "")


def test_a_new_job_and_new_steps_show_up_live(fleet: Fleet) -> None:
    page = fleet.page
    before = fleet.rest()["totals"]
    job = _job(JOBS - 1)
    fleet.fleet.add(job, batches=10)
    page.locator(f"tr[data-job='{job.name}']").wait_for(timeout=30_000)  # no reload: the socket pushed it
    wait_until(lambda: len(fleet.rows()) == JOBS and fleet.total("jobs") == str(JOBS), "50 rows and jobs", 30)
    wait_until(lambda: fleet.total("ranks") == str(before["ranks"] + job.world_size), "the new ranks", 30)
    # More batches of an imbalanced job raise its waste on the page.
    cell = page.locator("tr[data-job='fleet-05'] td").nth(6)
    old = float(cell.inner_text())
    fleet.fleet.steps("fleet-05", 40)
    wait_until(lambda: float(cell.inner_text()) > old, "fleet-05's waste to grow", 30)


def test_rest_and_metrics_show_the_page_totals(fleet: Fleet) -> None:
    wait_until(lambda: fleet.rest()["count"] == JOBS, "50 jobs over REST", 30)
    got = fleet.rest()
    assert sorted(r["job"] for r in got["data"]) == fleet.rows() == sorted(fleet.rows())
    t = got["totals"]
    assert t["jobs"] == JOBS and t["running"] == JOBS
    assert t["ranks"] == sum(_job(i).world_size for i in range(JOBS))
    assert t["wasted_gpu_hours"] == pytest.approx(sum(r["wasted_gpu_hours"] for r in got["data"]), abs=1e-8)
    req = urllib.request.Request(fleet.server.url + "/metrics", headers={"Authorization": f"Bearer {fleet.admin}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("rebalancer_fleet_"))
    assert float(lines["rebalancer_fleet_jobs"]) == JOBS
    assert float(lines["rebalancer_fleet_ranks"]) == t["ranks"]
    assert float(lines["rebalancer_fleet_running_jobs"]) == JOBS
    assert float(lines["rebalancer_fleet_wasted_gpu_seconds"]) == pytest.approx(t["wasted_gpu_hours"] * 3600, rel=1e-3)
    assert fleet.total("jobs") == str(JOBS)
    ARTIFACTS.mkdir(exist_ok=True)
    fleet.page.screenshot(path=str(ARTIFACTS / "fleet.png"), full_page=True, timeout=60_000)
