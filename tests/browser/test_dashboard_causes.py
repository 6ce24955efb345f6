"""The job view's step phases and causes (issue 42) in real Chromium against a real backend
whose ranks speak the real hook protocol (tests/helpers/fake_fleet: one process, no
training): the stacked bars per rank carry every phase, the heatmap's picker shows any
phase, the one-line GC hint shows when GC pauses cost more than 2% of the step, the Hung
card names the NCCL flight recorder's dump path, and the cards share one poller of
GET /api/v1/jobs/{job}. One backend, one browser and one page serve the module."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from rebalancer_wire.protocol import Hang, Metrics, StepRecord, encode
from tests.browser._chromium import chromium, new_page, playwright_sync_api
from tests.helpers.fake_fleet import FakeJob, FleetPage, fleet_server
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.browser]

playwright_sync_api()  # skips this module without Chromium or Playwright
JOB = "why-slow"
BATCHES = 80
STEP_MS = 40.0
# rank -> (data wait, host, checkpoint, compute, GC pauses (gen 0, 1, 2), optimizer), ms a step
PHASES = {0: (2.0, 0.5, 0.0, 20.0, (0.0, 0.0, 0.0), 1.0),
          1: (9.0, 0.5, 4.0, 26.0, (0.5, 0.5, 5.0), 1.0),  # checkpoints, and GC pauses: 15% of the step
          2: (2.0, 0.5, 0.0, 20.0, (0.0, 0.0, 0.0), 1.0)}
NCCL_DUMP = "/scratch/fr/comm_lib_trace_rank_1"


@dataclass
class Env(FleetPage):
    job_gets: list[float]  # when the page asked for GET /api/v1/jobs/{JOB}


def _records(rank: int, first: int, n: int) -> list[StepRecord]:
    d, h, w, c, gc, o = PHASES[rank]
    now = time.time()
    return [StepRecord(batch_index=b, local_batch_size=4, placement_version=0, data_wait_ms=d, compute_ms=c,
                       sync_wait_ms=STEP_MS - d - c - o, optimizer_ms=o, step_ms=STEP_MS,
                       t=now - (first + n - b) * STEP_MS / 1000, host_ms=h, ckpt_ms=w, gc_ms=gc)
            for b in range(first, first + n)]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with fleet_server(tmp_path_factory.mktemp("causes_page"), REBALANCER_DEFAULT_MODE="observe") as (srv, admin, fleet):
        job = FakeJob(JOB, ["cpu"] * 3, [5.0] * 3, 12)
        fleet.add(job, 0)

        async def send() -> None:
            for rank, ws in enumerate(job.sockets):
                recs = _records(rank, 0, BATCHES)
                for i in range(0, len(recs), 20):
                    await ws.send(encode(Metrics(job=JOB, rank=rank, steps=recs[i:i + 20])))

        fleet._run(send())
        job.next_batch = BATCHES
        with chromium() as browser:
            page = new_page(browser, timeout_ms=30_000, viewport={"width": 1400, "height": 2200})
            gets: list[float] = []
            page.on("request", lambda r: gets.append(time.monotonic())
                    if r.url.split("?")[0].endswith(f"/api/v1/jobs/{JOB}") else None)
            page.goto(f"{srv.url}/?token={admin}")  # kept in localStorage for the pages
            page.goto(f"{srv.url}/job/{JOB}")
            page.wait_for_function("() => window.rebalancer && window.rebalancer.state.draws > 0")
            yield Env(srv, admin, fleet, page, gets)


def _trace(page: Any, name: str) -> list[float]:
    return page.evaluate(f"() => document.getElementById('rank-bars').data.find(t => t.name === {name!r}).y")


def test_the_bars_stack_every_phase_per_rank(env: Env) -> None:
    page = env.page
    page.wait_for_function("() => (document.getElementById('rank-bars').data || []).some(t => t.name === 'GC pauses')")
    names = page.evaluate("() => document.getElementById('rank-bars').data.map(t => t.name)")
    # No rank has an optimizer-free step here: every phase is drawn; compute stays the first trace.
    assert names == ["compute", "GC pauses", "sync wait", "data wait", "host work", "checkpoint", "optimizer"]
    assert _trace(page, "GC pauses") == [pytest.approx(0.0), pytest.approx(6.0), pytest.approx(0.0)]
    # Compute without its GC pauses; the loader's wait without host work and checkpoints.
    assert _trace(page, "compute") == [pytest.approx(20.0), pytest.approx(20.0), pytest.approx(20.0)]
    assert _trace(page, "data wait") == [pytest.approx(1.5), pytest.approx(4.5), pytest.approx(1.5)]
    assert _trace(page, "checkpoint") == [pytest.approx(0.0), pytest.approx(4.0), pytest.approx(0.0)]
    # The stack adds up to each rank's step.
    total = page.evaluate("() => document.getElementById('rank-bars').data.reduce("
                          "(acc, t) => acc.map((v, i) => v + t.y[i]), [0, 0, 0])")
    assert total == [pytest.approx(STEP_MS)] * 3


@pytest.mark.parametrize(("metric", "expected"), [("gc", [0.0, 6.0, 0.0]), ("data_wait", [2.0, 9.0, 2.0]),
                                                  ("ckpt", [0.0, 4.0, 0.0]), ("compute", [20.0, 26.0, 20.0])])
def test_the_heatmap_shows_the_phase_picked(env: Env, metric: str, expected: list[float]) -> None:
    page = env.page
    page.select_option("#heat-metric", metric)
    newest = ("() => { const z = (document.getElementById('heatmap').data || [{}])[0].z;"
              " return z ? z.map(r => r[r.length - 1]) : null; }")
    # The newest column (the last of each row) holds each rank's mean of the phase.
    wait_until(lambda: (got := page.evaluate(newest)) is not None and got == pytest.approx(expected),
               f"the heatmap's newest column of {metric} at {expected}", timeout=30)
    title = page.evaluate("() => document.getElementById('heatmap').data[0].colorbar.title.text")
    assert title == "ms"


def test_the_gc_hint_shows_above_two_percent_of_the_step(env: Env) -> None:
    page = env.page
    causes: Any = env.server.get(f"/api/v1/jobs/{JOB}/causes", env.admin)
    assert causes["gc_share"] > 0.02 and causes["hint"]
    page.wait_for_function("() => !document.getElementById('gc-hint').hidden")
    assert page.locator("#gc-hint").inner_text() == causes["hint"]
    assert "gc_freeze" in causes["hint"] or "gc_collect_every" in causes["hint"]


def test_one_poller_of_the_job_resource_feeds_every_card(env: Env) -> None:
    page = env.page
    polls = "() => window.rebalancer.poller.polls"
    start, n0 = time.monotonic(), page.evaluate(polls)
    wait_until(lambda: page.evaluate(polls) >= n0 + 3, "three more polls", timeout=30)
    n1 = page.evaluate(polls)
    asked = sum(1 for t in env.job_gets if t >= start)
    # Every GET /jobs/{job} the page made in the window is one of the poller's (the
    # communication card, the causes and hang cards and the report each asked on their own before).
    assert n1 - n0 - 1 <= asked <= n1 - n0 + 1, (asked, n0, n1)
    # And both cards render from it: the communication card's verdict and the summary's goodput.
    page.wait_for_function("() => window.rebalancer.comm.last !== null && window.rebalancer.causes.goodput !== null")


def test_the_hung_card_names_the_flight_recorder_dump(env: Env) -> None:
    page = env.page
    job = env.fleet.jobs[JOB]
    since = time.time() - 8

    async def hang() -> None:
        for rank, ws in enumerate(job.sockets):
            report = (Hang(batch_index=BATCHES, phase="data_wait", since=since, stalled_s=8.0,
                           stack='File "train.py", line 40, in <module>', nccl_dump=NCCL_DUMP) if rank == 1 else
                      Hang(batch_index=BATCHES, phase="sync_wait", since=since, stalled_s=8.0))
            await ws.send(encode(Metrics(job=JOB, rank=rank, hang=report)))

    env.fleet._run(hang())
    wait_until(lambda: env.server.get(f"/api/v1/jobs/{JOB}", env.admin)["status"] == "hung",  # type: ignore[index]
               "status hung", timeout=30)
    rest: Any = env.server.get(f"/api/v1/jobs/{JOB}", env.admin)
    assert (rest["hung_rank"], rest["hung_nccl_dump"]) == (1, NCCL_DUMP)
    page.wait_for_function("() => !document.getElementById('hang-card').hidden")
    assert page.locator("#hang-text").inner_text().startswith(f"Rank 1 stopped stepping at batch {BATCHES} (data_wait)")
    assert page.locator("#hang-nccl").inner_text() == (
        f"NCCL flight recorder dump (written when the collective times out): {NCCL_DUMP}")
