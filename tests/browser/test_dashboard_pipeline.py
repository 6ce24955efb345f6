"""Issue 40 item 2 in real Chromium: a pipelined job (tests/helpers/pipeline.py, fed through
the real hook websocket of a real backend) shows on its job page as a grid of stages x
pipelines with each cell's time per micro-batch, the bottleneck stage, the bubble share,
the slowest pipeline and the stage-split advice with its module names, all as REST's
``/pipeline`` gives them; once an operator's placement ran, the card puts the stage model's
predicted step beside the measured one and flags a miss beyond 10%; a job without pipelines
keeps the card hidden."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import connect

from rebalancer_wire.protocol import Ack, Hello, encode
from tests.browser._chromium import ARGS, CHROMIUM, playwright_sync_api
from tests.helpers.pipeline import JOB, feed, hello_frame
from tests.helpers.server import Server, running_server
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

sync_api = playwright_sync_api()


def _an_operators_placement_runs_slower_than_predicted(server: Server, pipes: tuple[Any, Any]) -> None:
    """(11, 5) applied by hand: predicted 92 and 88 ms (step 93.5); pipeline 0 then runs
    1.25x slower than its stages said, 115 ms, the step 116.5."""
    assert server.call("PUT", f"/api/v1/jobs/{JOB}/mode", body={"mode": "approve"})[0] == 200
    status, body = server.call("POST", f"/api/v1/jobs/{JOB}/proposals", body={"shares": [11, 5], "apply": True})
    assert status == 201 and body["status"] == "approved", body
    # the operator's proposal is predicted by the stage model too: 136 + 1.5 before, 92 + 1.5 after
    assert (body["predicted_step_ms_before"], body["predicted_step_ms_after"]) == (pytest.approx(137.5),
                                                                                  pytest.approx(93.5))
    for rank, ws in enumerate(pipes):
        placement = json.loads(ws.recv(timeout=10))
        while placement["type"] != "placement" or placement["shares"] != [11, 5]:
            placement = json.loads(ws.recv(timeout=10))
        ws.send(encode(Ack(job=JOB, rank=rank, version=placement["version"], batch_index=16)))
    for rank, ws in enumerate(pipes):
        feed(ws, rank, 16, 16, [11, 5], placement["version"], slower={0: 1.25})
    wait_until(lambda: (p := server.get(f"/api/v1/jobs/{JOB}/pipeline")["prediction"])  # type: ignore[index]
               and p["measured_step_ms"] is not None, "the checked prediction", log=server.log)


def test_the_job_page_shows_the_pipeline_grid_and_the_advice(tmp_path: Path) -> None:
    with running_server(tmp_path, env={"REBALANCER_DEFAULT_MODE": "observe",
                                       "REBALANCER_EFFECT_WINDOW_STEPS": "8"}) as server:
        with connect(server.ws_url + "/ws/hook") as p0, connect(server.ws_url + "/ws/hook") as p1, \
                connect(server.ws_url + "/ws/hook") as plain:
            for rank, ws in enumerate((p0, p1)):
                ws.send(hello_frame(rank))
                assert json.loads(ws.recv(timeout=10))["type"] == "placement"
                feed(ws, rank, 0, 16, [8, 8], 0)
            for rank, ws in enumerate((p0, p1)):  # a hello again: its answer proves the steps are in
                ws.send(hello_frame(rank))
                assert json.loads(ws.recv(timeout=10))["type"] == "placement"
            plain.send(encode(Hello(job="plain", rank=0, world_size=1, global_batch_size=8, host="h")))
            assert json.loads(plain.recv(timeout=10))["type"] == "placement"
            rest: Any = server.get(f"/api/v1/jobs/{JOB}/pipeline")
            assert rest["advice"]["layers_per_stage"] == [3, 1]
            with sync_api.sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                try:
                    page = browser.new_page()
                    page.set_default_timeout(60_000)
                    asked: list[str] = []
                    page.on("request", lambda r: asked.append(r.url))
                    page.goto(f"{server.url}/job/{JOB}")
                    page.wait_for_function("() => !document.querySelector('#pipeline-card').hidden"
                                           " && (document.querySelector('#pipeline-grid').data || []).length === 1")
                    grid = page.evaluate("() => document.querySelector('#pipeline-grid').data[0]")
                    assert grid["type"] == "heatmap"
                    assert grid["z"] == [[c["stage_ms"] for c in row["stages"]] for row in rest["rows"]]
                    assert grid["z"] == [[4.0, 8.0], [8.0, 16.0]]
                    assert grid["y"] == ["pipeline 0 (8 mb)", "pipeline 1 (8 mb)"]
                    # Plotly drew each cell's time as its text
                    cells = page.evaluate("() => [...document.querySelectorAll('#pipeline-grid text')]"
                                          ".map(t => t.textContent).filter(t => t.endsWith(' ms'))")
                    assert sorted(cells) == sorted(["4.00 ms", "8.00 ms", "8.00 ms", "16.00 ms"])
                    stats = page.locator("#pipeline-stats").inner_text()
                    assert "stage 1" in stats and "pipeline 1" in stats
                    assert f"{100 * rest['bubble_share']:.1f}%" in stats
                    assert page.locator("#pipeline-label").text_content() == "PP 2, 1f1b, 2 pipelines"
                    advice = page.locator("#pipeline-advice").inner_text()
                    assert "layers [2, 2] → [3, 1] per stage; predicted step 109.5 ms instead of 137.5 ms" in advice
                    assert "stage 0: tok_embeddings, layers.0, layers.1" in advice and "stage 1: output" in advice
                    assert page.locator("#pipeline-prediction").inner_text() == ""  # no placement yet
                    _an_operators_placement_runs_slower_than_predicted(server, (p0, p1))
                    page.reload()
                    page.wait_for_function("() => (document.querySelector('#pipeline-prediction-head') || {})"
                                           ".textContent?.includes('measured')")
                    head = page.locator("#pipeline-prediction-head")
                    assert "bad" in (head.get_attribute("class") or "")
                    assert head.inner_text().startswith(
                        "Placement in force: predicted step 93.5 ms, measured 116.5 ms (+24.6%): missed by more "
                        "than 10%: the step took 116.5 ms against 93.5 predicted (+25%)")
                    runs = page.locator("#pipeline-prediction li").all_inner_texts()
                    assert runs == ["pipeline 0 (11 mb): predicted 92.0 ms, measured 115.0 ms (+25.0%)",
                                    "pipeline 1 (5 mb): predicted 88.0 ms, measured 88.0 ms (+0.0%)"]
                    # a job without pipelines: the card stays hidden, and its grid is never asked
                    # for (a 404 is a console error)
                    page.goto(f"{server.url}/job/plain")
                    page.wait_for_function("() => window.rebalancer && window.rebalancer.pipeline")
                    page.wait_for_timeout(2500)  # past one poll
                    assert page.locator("#pipeline-card").is_hidden()
                    assert not [u for u in asked if u.endswith("/jobs/plain/pipeline")]
                    assert [u for u in asked if u.endswith(f"/jobs/{JOB}/pipeline")]
                finally:
                    browser.close()
