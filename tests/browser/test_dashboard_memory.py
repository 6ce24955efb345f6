"""Issue 11: the dashboard's device table shows each rank's memory fit and cap, in real
Chromium, against a real backend fed by real torchrun/gloo ranks whose device memory comes
from the fake allocator behind the hook's memory-source seam (the only fake)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.backend.test_e2e_control import ADMIN, ENV, call, wait_for
from tests.backend.test_e2e_memory import GB, memory_job
from tests.browser._chromium import chromium, new_page, playwright_sync_api
from tests.helpers.server import running_server

pytestmark = [pytest.mark.browser, pytest.mark.multiproc, pytest.mark.timeout(300)]


playwright_sync_api()  # skips this module without Chromium or Playwright


def test_device_table_shows_the_memory_fit_and_cap_of_each_rank(tmp_path: Path) -> None:
    name = "dash-memory"
    # Rank 0: a 4.7 GB card, 1 GB + 0.1 GB a sample; rank 1 has 80 GB. Rank 2 measures nothing.
    memory = f"{47 * GB // 10}:{GB}:{GB // 10},{80 * GB}:{GB}:{GB // 10},none"
    with running_server(tmp_path, env=ENV) as server, \
            memory_job(server.url, name, b=48, speeds="1,1,1", memory=memory) as (proc, out):
        mem = wait_for("rank 0's and rank 1's memory fits", lambda: (
            (r := call(server, "GET", f"/api/v1/jobs/{name}/memory", ADMIN))[0] == 200
            and all(m["status"] == "fitted" for m in r[1]["data"][:2]) and r[1]["data"]), proc=proc, log=out)
        with chromium() as browser:
            page = new_page(browser, timeout_ms=90_000)
            page.goto(f"{server.url}/job/{name}?token={ADMIN}")
            cell = "#device-table tr[data-rank='{}'] td.mem-fit"
            for rank in (0, 1):
                page.wait_for_function(
                    f"() => (document.querySelector(\"{cell.format(rank)}\") || {{}}).textContent?.includes('cap')")
                text = page.locator(cell.format(rank)).inner_text()
                assert f"cap {mem[rank]['cap']}" in text, (rank, text, mem[rank])
                assert "/sample" in (page.locator(cell.format(rank)).get_attribute("title") or "")
            assert page.locator(cell.format(2)).inner_text() == "–"  # no memory source: no cap
