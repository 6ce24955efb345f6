"""The dashboard in real Chromium against a real backend fed by a real 3-rank torchrun job.

One backend, one job (rank 2 four times slower per sample) and one browser serve the whole
module; the tests run in order: overview, live charts, approve, overrides + reject + manual
placement, viewer, stale data once the job stops. Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.browser._chromium import chromium, new_page, playwright_sync_api
from tests.helpers.server import Server, running_server
from tests.helpers.torchrun import REPO_ROOT, start_torchrun
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.multiproc]

JOB = "dash-e2e"
ARTIFACTS = Path(REPO_ROOT) / "test-artifacts"

sync_api = playwright_sync_api()  # skips this module without Chromium or Playwright


@dataclass
class Stack:
    server: Server
    admin: str
    operator: str
    viewer: str
    browser: Any
    job: Any = None

    def rest(self, path: str, *, token: str | None = None, method: str = "GET", body: Any = None) -> Any:
        req = urllib.request.Request(self.server.url + "/api/v1" + path, method=method)
        req.add_header("Authorization", f"Bearer {token or self.admin}")
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, data=data, timeout=10) as r:
            return json.loads(r.read())

    def page(self, path: str, token: str) -> Any:
        page = new_page(self.browser, viewport={"width": 1400, "height": 1800})
        sep = "&" if "?" in path else "?"
        page.goto(f"{self.server.url}{path}{sep}token={token}")
        return page


def _wait(cond: Callable[[], Any], what: str, timeout: float = 60.0, stack: Stack | None = None) -> Any:
    return wait_until(cond, what, timeout, interval=0.25, log=stack.server.log if stack else None)


def _shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True, timeout=60_000)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("dashboard")
    admin = "admin-" + secrets.token_urlsafe(24)
    with running_server(tmp, env={"REBALANCER_ADMIN_TOKEN": admin}) as srv:
        probe = Stack(srv, admin, "", "", None)
        tokens = {role: probe.rest("/tokens", method="POST", body={"role": role, "name": f"e2e-{role}"})["secret"]
                  for role in ("operator", "viewer")}
        hook = probe.rest("/tokens", method="POST", body={"role": "hook", "job": JOB, "name": "e2e-hook"})["secret"]
        job = start_torchrun(3, ["-m", "trainer_hook.demo_worker", "--server", srv.url, "--job", JOB,
                                 "--token", hook, "--steps", "0", "--global-batch-size", "48",
                                 "--speeds", "1,1,0.25", "--per-sample-ms", "1.0"])
        try:
            with chromium() as browser:
                yield Stack(srv, admin, tokens["operator"], tokens["viewer"], browser, job)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGTERM)
                try:
                    job.wait(timeout=15)
                except Exception:
                    os.killpg(job.pid, signal.SIGKILL)
                    job.wait()


def test_overview_lists_the_job(stack: Stack) -> None:
    page = stack.page("/", stack.operator)
    row = page.locator(f"tr[data-job='{JOB}']")
    row.wait_for(timeout=90_000)  # torchrun start-up on a busy 2-core machine
    # Ranks show as connected once registered; the mode once the controller has loaded the
    # new job (SQL on a loaded machine can take a second or more): wait for both.
    _wait(lambda: "3/3" in row.inner_text() and "approve" in row.inner_text(),
          "all 3 ranks connected and the mode in the overview", stack=stack)
    text = row.inner_text()
    assert JOB in text and "approve" in text
    page.context.close()


def test_the_token_is_in_no_url_after_the_page_took_it(stack: Stack) -> None:
    """Issue 15: URLs end up in logs. The page keeps a ``?token=`` in localStorage, drops it
    from the address bar, and authenticates its live socket with a first message."""
    ctx = stack.browser.new_context()
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    sockets: list[str] = []
    page.on("websocket", lambda ws: sockets.append(ws.url))
    page.goto(f"{stack.server.url}/?token={stack.viewer}")
    page.locator(f"tr[data-job='{JOB}']").wait_for(timeout=90_000)  # frames arrive: authenticated
    assert "token" not in page.url, page.url
    page.locator(f"tr[data-job='{JOB}'] a.job-link").click()
    page.wait_for_url(f"**/job/{JOB}", wait_until="commit")  # the click opened the job page
    page.wait_for_function("() => window.rebalancer && window.rebalancer.state.frames > 0")
    assert sockets and all("token" not in u for u in sockets), sockets
    assert "token" not in page.url, page.url
    assert stack.viewer not in stack.server.log()
    ctx.close()


def test_a_click_held_across_a_redraw_of_the_fleet_table_opens_the_job(stack: Stack) -> None:
    """The fleet table redraws with every overview frame (up to dashboard_max_hz a second).
    It rebuilt its rows, so a press on a job's link and the release on the link that replaced
    it made no click: a user's press (~100 ms) was lost about every other time (22 of 50). A
    frame between Playwright's own press and release (a few ms apart, more on a loaded machine)
    loses its click the same way and leaves test_the_token_is_in_no_url_after_the_page_took_it
    waiting on the fleet page for a job page that never opens. Here the release waits until the
    table has redrawn under the press."""
    ctx = stack.browser.new_context(viewport={"width": 1400, "height": 1800})
    # Count the frames the page's live socket delivers (this listener runs before the page's
    # onmessage, so at n frames the table has been drawn from n - 1 of them).
    ctx.add_init_script("""window.frames_in = 0; window.seen = [];
      const Native = window.WebSocket;
      window.WebSocket = function (...a) { const ws = new Native(...a);
        ws.addEventListener('message', () => { window.frames_in += 1; }); return ws; };
      window.WebSocket.prototype = Native.prototype;
      for (const type of ['mousedown', 'mouseup', 'click']) {
        document.addEventListener(type, (e) => window.seen.push(
          `${type} on ${e.target.tagName}.${e.target.className} connected=${e.target.isConnected}`), true);
      }""")
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    page.goto(f"{stack.server.url}/?token={stack.viewer}")
    link = page.locator(f"tr[data-job='{JOB}'] a.job-link")
    link.wait_for(timeout=90_000)
    link.hover()
    page.mouse.down()
    pressed = page.evaluate("() => window.frames_in")
    page.wait_for_function(f"() => window.frames_in >= {pressed} + 3")  # 2+ frames drawn while it is down
    page.mouse.up()
    try:  # the navigation started (its page may take a while to load on a busy machine)
        page.wait_for_url(f"**/job/{JOB}", wait_until="commit", timeout=30_000)
    except sync_api.Error as e:
        raise AssertionError(f"no job page after the release: {page.evaluate('() => window.seen')}") from e
    page.context.close()


def test_job_view_charts_update(stack: Stack) -> None:
    page = stack.page(f"/job/{JOB}", stack.operator)
    page.wait_for_function("() => window.rebalancer && window.rebalancer.state.draws > 0")
    npts = "() => (document.getElementById('series').data || [{x: []}])[0].x.length"
    last_x = "() => { const d = document.getElementById('series').data[0].x; return d[d.length - 1]; }"
    page.wait_for_function(f"() => ({npts})() > 0")
    first_n, first_last = page.evaluate(npts), page.evaluate(last_x)
    bars = page.evaluate("() => document.getElementById('rank-bars').data[0].y")
    assert len(bars) == 3
    # The series grows with new batches and the bars are redrawn with new numbers.
    page.wait_for_function(f"() => ({last_x})() > {first_last} + 5")
    assert page.evaluate(npts) > first_n
    page.wait_for_function(f"() => JSON.stringify(document.getElementById('rank-bars').data[0].y) !== {json.dumps(json.dumps(bars))}")
    # A user's zoom survives redraws (Plotly.react with layout.uirevision).
    page.evaluate("() => Plotly.relayout('rank-bars', {'yaxis.range': [0, 500]})")
    draws = page.evaluate("() => window.rebalancer.state.draws")
    page.wait_for_function(f"() => window.rebalancer.state.draws > {draws} + 3")
    assert page.evaluate("() => document.getElementById('rank-bars').layout.yaxis.range") == [0, 500]
    heat_cols = page.evaluate("() => document.getElementById('heatmap').data[0].z[0].length")
    assert heat_cols >= 1
    # The slowest rank (2) is the straggler in the bars and the device table.
    assert "straggler" in (page.locator("#device-table tr[data-rank='2']").get_attribute("class") or "")
    _shot(page, "job-view-live.png")
    page.context.close()


def test_a_mesh_jobs_header_shows_its_shape(stack: Stack) -> None:
    from websockets.sync.client import connect

    from rebalancer_wire.protocol import MeshShape, Metrics, encode
    from tests.backend._app import hello, steps

    job = "dash-mesh"
    secret = stack.rest("/tokens", method="POST", body={"role": "hook", "job": job, "name": "e2e-mesh"})["secret"]
    mesh = MeshShape(dp=2, replica_size=2, dims=("dp", "tp"), shape=(2, 2))
    auth = {"Authorization": f"Bearer {secret}"}
    with connect(stack.server.ws_url + "/ws/hook", additional_headers=auth) as ws:
        ws.send(hello(job=job, rank=0, world_size=2, global_batch_size=32, mesh=mesh, replica_ranks=(0, 1),
                      replica_devices=("node-a NVIDIA H100 80GB HBM3 #0", "node-b NVIDIA A100-SXM4-80GB #3")))
        assert json.loads(ws.recv(timeout=10))["type"] == "placement"
        recs = steps(0, 3)
        for r in recs:
            r.slowest_rank = 1  # the leader's member, rank 1, set the replica's pace
        ws.send(encode(Metrics(job=job, rank=0, steps=recs)))
        page = stack.page(f"/job/{job}", stack.viewer)
        page.wait_for_function("() => document.getElementById('stats').textContent.includes('DP 2 x TP 2')")
        assert "replicas1/2" in page.locator("#stats").text_content().replace(" ", "")
        # The replicas, their members, slowest member and the members' devices (replica 1
        # has not said hello).
        row = page.locator("#replica-table tr[data-replica='0'] td")
        row.first.wait_for()
        assert [c.strip() for c in row.all_text_contents()] == [
            "replica 0", "r0, r1", "10.0 ms", "20.0 ms", "r1",
            "r0: node-a NVIDIA H100 80GB HBM3 #0; r1: node-b NVIDIA A100-SXM4-80GB #3"]
        page.context.close()


def _control_dump(stack: Stack) -> str:
    return json.dumps({k: stack.rest(f"/jobs/{JOB}/{k}")["data"][:6] for k in ("proposals", "placements", "audit")},
                      indent=1, default=str)


def test_approve_switches_placement(stack: Stack) -> None:
    page = stack.page(f"/job/{JOB}", stack.operator)
    # The policy may replace a pending proposal with a fresher one between the page showing
    # it and the click; the backend then answers 409 and the page shows the newer one.
    for _attempt in range(4):
        page.locator("#approve").wait_for(timeout=60_000)
        if _attempt == 0:
            _shot(page, "job-view-proposal.png")
        page.click("#approve")
        page.locator("#control-msg.ok, #control-msg.err").wait_for()
        if page.locator("#control-msg.ok").count():
            # The message names the proposal the click approved ("Proposal N approved: ...").
            pid = int(page.locator("#control-msg").inner_text().split()[1])
            prop = stack.rest(f"/jobs/{JOB}/proposals/{pid}")
            break
        page.wait_for_timeout(500)
    else:
        raise AssertionError(f"no proposal could be approved:\n{_control_dump(stack)}")
    assert prop["shares"][2] < prop["shares"][0]  # work moves off the slow rank 2

    def switched() -> Any:
        placement = stack.rest(f"/jobs/{JOB}")["placement"]
        return placement if placement["shares"] == prop["shares"] else None

    try:
        placement = _wait(switched, f"job {JOB} to take proposal {pid}'s shares", stack=stack)
    except AssertionError as exc:
        raise AssertionError(f"{str(exc)[:200]}\n{_control_dump(stack)}") from None
    assert placement["version"] >= 1
    # Every rank applied it at one batch index (acks from the hook).
    row = _wait(lambda: next((p for p in stack.rest(f"/jobs/{JOB}/placements")["data"]
                              if p["version"] == placement["version"] and p["effective_batch_index"] is not None
                              and len(p["acks"]) == 3), None), "acks from all 3 ranks", stack=stack)
    assert len(set(row["acks"].values())) == 1
    decided = stack.rest(f"/jobs/{JOB}/proposals/{pid}")
    assert decided["decided_by"] == "e2e-operator" and decided["placement_version"] is not None
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "approve-placements.json").write_text(json.dumps(
        {"proposal": decided, "placements": stack.rest(f"/jobs/{JOB}/placements")["data"]}, indent=1))
    audit = stack.rest(f"/jobs/{JOB}/audit")["data"]
    assert any(a["action"] == "proposal.approve" and a["actor"] == "e2e-operator" for a in audit)
    # The time series marks the placement change once the new version's batches arrive.
    page.wait_for_function("() => (document.getElementById('series').layout.shapes || []).length > 0")
    page.context.close()


def test_override_editor_reject_and_manual_placement(stack: Stack) -> None:
    page = stack.page(f"/job/{JOB}", stack.operator)
    page.locator("#override-table tr[data-rank='2'] .pin").wait_for()
    current = stack.rest(f"/jobs/{JOB}")["placement"]["shares"]
    pin = 4 if current[2] != 4 else 6
    page.fill("#override-table tr[data-rank='2'] .pin", str(pin))
    page.click("#apply-overrides")
    page.locator("#override-msg.ok").wait_for()
    assert stack.rest(f"/jobs/{JOB}/overrides")["pins"] in ({"2": pin}, {2: pin})
    # The placement in force breaks the pin, so the controller proposes one that keeps it.
    for _attempt in range(4):
        page.wait_for_function(f"() => {{ const p = window.rebalancer.state.control.pending_proposal;"
                               f" return p && p.status === 'proposed' && p.shares[2] === {pin}; }}")
        page.locator("#reject").wait_for()
        page.click("#reject")
        page.locator("#control-msg.ok, #control-msg.err").wait_for()
        if page.locator("#control-msg.ok").count():
            pid = int(page.locator("#control-msg").inner_text().split()[1])
            break
        page.wait_for_timeout(500)  # a newer proposal replaced it: reject that one
    else:
        raise AssertionError(f"no proposal could be rejected:\n{_control_dump(stack)}")
    rejected = stack.rest(f"/jobs/{JOB}/proposals/{pid}")
    assert rejected["status"] == "rejected" and rejected["shares"][2] == pin
    # A manual placement that breaks the pin is refused with the reason ...
    page.fill("#manual-shares", "20,20,8")
    page.click("#submit-manual")
    page.locator("#override-msg.err").wait_for()
    assert "pinned" in page.locator("#override-msg").inner_text()
    # ... and one that keeps it is applied.
    before_manual = stack.rest(f"/jobs/{JOB}")["placement"]["shares"]
    shares = [24 - pin // 2, 24 - pin + pin // 2, pin]
    page.fill("#manual-shares", ",".join(map(str, shares)))
    page.click("#submit-manual")
    page.locator("#override-msg.ok").wait_for()
    _wait(lambda: stack.rest(f"/jobs/{JOB}")["placement"]["shares"] == shares, "the manual placement", stack=stack)
    _shot(page, "job-view-operator.png")
    # Rollback (after a confirm dialog) returns exactly the shares in force before.
    page.once("dialog", lambda d: d.accept())
    page.click("#rollback")
    page.locator("#override-msg.ok").wait_for()
    _wait(lambda: stack.rest(f"/jobs/{JOB}")["placement"]["shares"] == before_manual, "the rollback", stack=stack)
    # The mode switch.
    page.select_option("#mode", "observe")
    page.locator("#control-msg.ok").wait_for()
    assert stack.rest(f"/jobs/{JOB}")["mode"] == "observe"
    page.context.close()


def test_viewer_sees_no_controls(stack: Stack) -> None:
    page = stack.page(f"/job/{JOB}", stack.viewer)
    page.wait_for_function("() => window.rebalancer && window.rebalancer.state.draws > 0 && document.body.dataset.role")
    assert page.evaluate("() => document.body.dataset.role") == "viewer"
    assert "viewer" in page.locator("#whoami").inner_text()
    assert page.locator("#override-card").is_hidden()
    assert page.locator("#mode").is_hidden()
    assert page.locator("#approve").count() == 0 and page.locator("#reject").count() == 0
    assert page.locator("#series .main-svg").count() > 0  # the same charts
    _shot(page, "job-view-viewer.png")
    # The API agrees: a viewer cannot change the mode.
    with pytest.raises(urllib.error.HTTPError) as err:
        stack.rest(f"/jobs/{JOB}/mode", token=stack.viewer, method="PUT", body={"mode": "auto"})
    assert err.value.code == 403
    page.context.close()


def test_stale_banner_when_the_job_stops(stack: Stack) -> None:
    page = stack.page(f"/job/{JOB}", stack.viewer)
    page.wait_for_function("() => window.rebalancer && window.rebalancer.state.draws > 0")
    assert page.locator("#stale-banner").is_hidden()
    # Frozen, not stopped: a job whose hooks close normally has ended (its page says
    # "ended", tests/browser/test_one_verdict.py); one that just goes silent is stale.
    tree = [*psutil.Process(stack.job.pid).children(recursive=True), psutil.Process(stack.job.pid)]
    for proc in tree:
        proc.send_signal(signal.SIGSTOP)
    try:
        page.locator("#stale-banner").wait_for(state="visible")
        assert page.locator("#ended-banner").is_hidden()
    finally:
        for proc in tree:
            proc.kill()
        stack.job.wait(timeout=30)
    assert "Data is stale" in page.locator("#stale-banner").inner_text()
    assert page.locator("#conn").inner_text() == "live"  # the socket is fine; the job is silent
    page.context.close()
