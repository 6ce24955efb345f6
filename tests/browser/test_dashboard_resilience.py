"""The job view at 512 ranks (fed over 512 real /ws/hook connections) and its reconnect
after a backend restart. Real backend, real Chromium."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rebalancer_wire.protocol import DeviceSample, Hello, Metrics, StepRecord, encode
from tests.browser._chromium import ARGS, CHROMIUM, playwright_sync_api
from tests.helpers.ports import free_port
from tests.helpers.server import running_server

pytestmark = [pytest.mark.browser]

SLOW = (37, 300)

sync_api = playwright_sync_api()
websockets = pytest.importorskip("websockets")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


async def _rank(url: str, world: int, r: int, batches: int, stop: threading.Event) -> None:
    async with websockets.connect(url + "/ws/hook") as ws:
        await ws.send(encode(Hello(job="big", rank=r, world_size=world, global_batch_size=16 * world,
                                   device_type="H100", host=f"node{r // 8}")))
        await ws.recv()
        slow = 1.6 if r in SLOW else 1.0
        for b in range(0, batches, 5):
            recs = [StepRecord(batch_index=k, local_batch_size=16, placement_version=0, data_wait_ms=0.2,
                               compute_ms=100 * slow, sync_wait_ms=170 - 100 * slow, optimizer_ms=2,
                               step_ms=172, t=time.time()) for k in range(b, b + 5)]
            dev = DeviceSample(t=time.time(), source="nvml", util_pct=90.0 / slow, power_w=500.0)
            await ws.send(encode(Metrics(job="big", rank=r, steps=recs, device=[dev])))
            await asyncio.sleep(0.2)
        while not stop.is_set():  # stay connected while the page looks
            await asyncio.sleep(0.1)


def _feed(url: str, world: int, batches: int, stop: threading.Event) -> None:
    async def main() -> None:
        first = asyncio.create_task(_rank(url, world, 0, batches, stop))
        await asyncio.sleep(0.5)  # rank 0 creates the job; the others join it
        await asyncio.gather(first, *(_rank(url, world, r, batches, stop) for r in range(1, world)))

    asyncio.run(main())


def test_job_view_with_512_ranks(tmp_path, browser) -> None:
    stop = threading.Event()
    with running_server(tmp_path) as srv:
        feeder = threading.Thread(target=_feed, args=(srv.ws_url, 512, 30, stop), daemon=True)
        feeder.start()
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            page.set_default_timeout(60_000)
            page.goto(f"{srv.url}/job/big")
            page.wait_for_function("() => { const s = window.rebalancer.state;"
                                   " return s.summary && s.summary.connected_ranks === 512 && s.summary.batch_index >= 29; }")
            # Ranks join one by one; read the heatmap once its newest column has every rank.
            page.wait_for_function("() => { const z = document.getElementById('heatmap').data[0].z;"
                                   " return z.length === 512 && z[0].length >= 2"
                                   " && z.every((row) => row[row.length - 1] !== null); }")
            z = page.evaluate("() => document.getElementById('heatmap').data[0].z")
            last = [row[-1] for row in z]
            # The two slow ranks are the two hottest rows of the heatmap.
            assert sorted(range(512), key=lambda r: last[r] or 0)[-2:] in ([37, 300], [300, 37])
            # Above 128 ranks the per-rank panels redraw at most once a second, so wait for
            # that redraw instead of reading them the moment the heatmap is complete.
            page.wait_for_function("() => { const g = document.getElementById('rank-bars');"
                                   " return !!g.data && g.data[0].y.length === 512; }")
            page.wait_for_function("() => document.querySelectorAll('#device-table tbody tr').length === 512")
            assert page.evaluate("() => document.getElementById('heatmap').layout.height") >= 600
            page.screenshot(path=str(tmp_path / "big.png"))
            page.close()
        finally:
            stop.set()
            feeder.join(timeout=20)


def test_page_reconnects_after_backend_restart(tmp_path, browser) -> None:
    port = free_port()
    page = browser.new_page()
    page.set_default_timeout(30_000)
    with running_server(tmp_path, port=port) as srv:
        page.goto(f"{srv.url}/")
        page.wait_for_function("() => document.getElementById('conn').textContent === 'live'")
    page.wait_for_function("() => document.getElementById('conn').textContent.startsWith('reconnecting')")
    with running_server(tmp_path, port=port):
        page.wait_for_function("() => document.getElementById('conn').textContent === 'live'")
    page.close()
