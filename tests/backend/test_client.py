"""backend.client and the ``rebalancer`` client commands against a real backend process and a
real 2-rank torchrun job (one of each for the module), plus the client with no server
packages importable at all."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import typing
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from backend.client import APIError, Client, ServerUnreachable
from tests.helpers.ports import free_port
from tests.helpers.server import Server, running_server
from tests.helpers.torchrun import REPO_ROOT, running_torchrun
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

ADMIN = "client-admin-secret-0123456789"
JOB = "cli-job"
B = 32
ENV = {
    "REBALANCER_ADMIN_TOKEN": ADMIN,
    "REBALANCER_MIN_STEPS": "6",
    "REBALANCER_COOLDOWN_STEPS": "6",
    "REBALANCER_PERSIST_INTERVAL_S": "0.5",
}
# What a machine with only the client installed lacks.
SERVER_PACKAGES = ("fastapi", "starlette", "pydantic", "pydantic_settings", "sqlalchemy", "uvicorn",
                   "prometheus_client", "plotly", "psycopg", "numpy", "torch")
_BLOCKER = f"""
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {SERVER_PACKAGES!r}:
            raise ImportError(f"{{name}} is blocked: the client must not need it")
        return None
sys.meta_path.insert(0, _Blocked())
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A backend with a 2-rank job (rank 1 four times slower) that trains until the module ends."""
    tmp = tmp_path_factory.mktemp("client")
    with running_server(tmp, env=ENV) as server, running_torchrun(
            2, ["-m", "trainer_hook.demo_worker", "--server", server.url, "--job", JOB, "--token", ADMIN,
                "--steps", "0", "--global-batch-size", str(B), "--speeds", "1,0.25", "--per-sample-ms", "1.0",
                "--fixed-ms", "1.0"]) as (_, out):
        rb = Client(server.url, ADMIN)
        wait_until(lambda: rb.proposals(JOB, status="proposed") if JOB in {j["job"] for j in rb.jobs()} else None,
                   "a proposal for the slow rank", 120, log=lambda: "".join(out) + server.log())
        yield server


def cli(*args: str, env: dict[str, str] | None = None, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """``rebalancer ARGS`` in a fresh interpreter (``prelude`` runs first, e.g. the import blocker)."""
    code = f"{prelude}\nimport sys\nfrom backend.cli import main\nsys.exit(main(sys.argv[1:]))"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("REBALANCER_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=full_env, timeout=60)


def viewer_token(server: Server) -> str:
    return Client(server.url, ADMIN).create_token("viewer", name="cli-viewer")["secret"]


# --- the client -------------------------------------------------------------------------


def test_every_read_route(live: Server):
    rb = Client(live.url, ADMIN)
    assert rb.health()["status"] == "ok"
    assert rb.whoami()["role"] == "admin"
    assert JOB in [j["job"] for j in rb.jobs()]
    job = rb.job(JOB)
    assert (job["world_size"], job["global_batch_size"]) == (2, B)
    assert [r["rank"] for r in rb.ranks(JOB)] == [0, 1]
    page = rb.metrics(JOB, ranks=[1], limit=5, source="live")
    assert page["source"] == "live" and 0 < page["count"] <= 5
    assert {p["rank"] for p in page["data"]} == {1}
    assert rb.forecast(JOB, total_steps=100_000)["total_steps"] == 100_000
    assert rb.policy(JOB)["strategy"]
    assert rb.overrides(JOB)["granularity"] == 1
    assert rb.placements(JOB, limit=1)[0]["version"] >= 0
    assert any(a["action"] == "job.create" for a in rb.audit(JOB))
    assert rb.audit_log(action="job.create", limit=5)[0]["job"] == JOB
    pending = rb.proposals(JOB, status="proposed")
    assert rb.proposal(JOB, pending[0]["id"])["id"] == pending[0]["id"]
    memory = rb.memory(JOB)
    assert [m["rank"] for m in memory["data"]] == [0, 1] and memory["count"] == 2
    assert {m["status"] for m in memory["data"]} == {"unmeasured"}  # CPU ranks: no device memory
    summary = wait_until(lambda: _or_none(lambda: rb.summary(JOB)), "the run's summary", 60)
    assert summary["job"] == JOB and summary["measured_s"] > 0


def _or_none(read: typing.Callable[[], typing.Any]) -> typing.Any:
    try:
        return read()
    except APIError as exc:
        if exc.status != 404:
            raise
        return None


class _Recording(Client):
    """A real client that notes every request it sends (method, path without the query)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[tuple[str, str]] = []

    def _send(self, method: str, path: str, **kwargs: Any) -> bytes:
        self.sent.append((method, path))
        return super()._send(method, path, **kwargs)


def test_every_rest_operation_has_a_client_method(live: Server):
    """Each operation of the server's OpenAPI document is reached by a Client method (on a job
    that does not exist, so the module's job is untouched; a 404 from the handler still
    proves the route matched, a 404 'Not Found' or a 405 from the router would not)."""
    rb = _Recording(live.url, ADMIN)
    job = "route-probe"
    made = rb.create_token("viewer", name="route-probe")
    calls: list[typing.Callable[[], object]] = [
        rb.health, rb.whoami, rb.jobs, rb.fleet, lambda: rb.job(job), lambda: rb.ranks(job), lambda: rb.metrics(job),
        lambda: rb.forecast(job), lambda: rb.summary(job), lambda: rb.memory(job), lambda: rb.causes(job), lambda: rb.pipeline(job), lambda: rb.policy(job),
        lambda: rb.proposals(job), lambda: rb.proposal(job, 1), lambda: rb.overrides(job),
        lambda: rb.report(job), lambda: rb.report_html(job), lambda: rb.store_report(job),
        lambda: rb.placements(job), lambda: rb.audit(job), rb.audit_log, rb.tokens,
        lambda: rb.set_mode(job, "observe"), lambda: rb.set_policy(job, {"cooldown_steps": 10}),
        lambda: rb.submit_placement(job, [16, 16]), lambda: rb.approve(job, 1), lambda: rb.reject(job, 1),
        lambda: rb.set_overrides(job, pins={0: 8}), lambda: rb.rollback(job),
        lambda: rb.revoke_token(made["id"]),
    ]
    for call in calls:
        try:
            call()
        except APIError as exc:
            assert exc.status in (404, 409) and exc.detail not in ("Not Found", "Method Not Allowed"), (
                exc.method, exc.path, exc.status, exc.detail)

    def template(path: str) -> re.Pattern[str]:
        return re.compile("^" + re.sub(r"\\{[^/]+\\}", "[^/]+", re.escape(path)) + "$")

    doc = live.get("/openapi.json", ADMIN)["paths"]  # type: ignore[index]
    operations = {(m.upper(), p) for p, ops in doc.items() for m in ops}
    reached = {(m, p) for m, p in operations for sent_m, sent_p in rb.sent
               if sent_m == m and template(p).match(sent_p)}
    assert operations - reached == set(), "REST operations the client has no method for"


def test_tokens_and_refusals_carry_the_servers_sentence(live: Server):
    rb = Client(live.url, ADMIN)
    made = rb.create_token("viewer", name="scripted", reason="ci")
    assert made["secret"].startswith("rb_") and made["id"] in [t["id"] for t in rb.tokens()]
    viewer = Client(live.url, made["secret"])
    with pytest.raises(APIError) as err:
        viewer.set_mode(JOB, "observe")
    assert (err.value.status, err.value.detail) == (403, "This action needs the operator role.")
    assert rb.revoke_token(made["id"])["revoked_at"] is not None
    assert made["id"] in [t["id"] for t in rb.tokens(include_revoked=True)]
    with pytest.raises(APIError) as err:
        rb.revoke_token(999_999)
    assert (err.value.status, err.value.detail) == (404, "Token 999999 not found.")
    with pytest.raises(APIError) as err:
        Client(live.url, "rb_not-a-token").jobs()
    assert (err.value.status, err.value.detail) == (401, "Missing or invalid bearer token.")
    with pytest.raises(APIError) as err:
        rb.job("no-such-job")
    assert (err.value.status, err.value.detail) == (404, "Job 'no-such-job' not found.")
    with pytest.raises(APIError) as err:  # FastAPI's validation list becomes one sentence
        rb.metrics(JOB, limit=0)
    assert err.value.status == 422 and err.value.detail.startswith("query.limit: ")
    with pytest.raises(ServerUnreachable):
        Client(f"http://127.0.0.1:{free_port()}", ADMIN, timeout=2).jobs()


def test_answers_that_are_not_the_backend(tmp_path: Path):
    """A proxy's 502 page or a 500 without JSON still gives a status and a sentence."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = b"<html>bad gateway</html>" if self.path.startswith("/api/v1/jobs/x") else b"[]"
            self.send_response(502 if self.path.startswith("/api/v1/jobs/x") else 200)
            self.end_headers()
            self.wfile.write(body if self.path != "/api/v1/whoami" else b"not json")

        def log_message(self, *args: Any) -> None:
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        rb = Client(f"http://127.0.0.1:{httpd.server_port}")
        with pytest.raises(APIError) as err:
            rb.job("x")
        assert (err.value.status, err.value.detail) == (502, "<html>bad gateway</html>")
        with pytest.raises(APIError) as err:
            rb.whoami()
        assert err.value.status == 502 and "is not JSON" in err.value.detail
        got = cli("job", "x", "--server", rb.server)
        assert got.returncode == 4, got
    finally:
        httpd.shutdown()
        httpd.server_close()


# --- the CLI ------------------------------------------------------------------------------


def test_cli_story(live: Server):
    env = {"REBALANCER_SERVER": live.url, "REBALANCER_TOKEN": ADMIN}
    rb = Client(live.url, ADMIN)

    got = cli("jobs", env=env)
    assert got.returncode == 0 and JOB in got.stdout and "IMBALANCE" in got.stdout, got
    got = cli("job", JOB, "--json", env=env)
    assert got.returncode == 0 and json.loads(got.stdout)["job"] == JOB, got
    assert "placement:" in cli("job", JOB, env=env).stdout

    # Reject the pending proposal; rejecting it again is refused with the server's reason.
    got = cli("proposals", JOB, "--status", "proposed", "--json", env=env)
    pid = json.loads(got.stdout)[0]["id"]
    got = cli("reject", JOB, str(pid), "--reason", "not now", env=env)
    assert got.returncode == 0 and f"Proposal {pid} of {JOB} rejected" in got.stdout, got
    got = cli("reject", JOB, str(pid), env=env)
    assert got.returncode == 1 and got.stderr.strip().endswith("(HTTP 409)"), got
    assert rb.proposal(JOB, pid)["decision_reason"] == "not now"

    got = cli("mode", JOB, "observe", env=env)
    assert got.returncode == 0 and "observe mode" in got.stdout, got
    assert rb.job(JOB)["mode"] == "observe"
    assert cli("mode", JOB, "approve", env=env).returncode == 0

    # A placement by hand, applied at once; then roll it back to exactly the shares before.
    before = rb.job(JOB)["placement"]
    assert before is not None
    got = cli("place", JOB, "20,12", "--length-sq-weight", "0.001", "--json", env=env)
    assert got.returncode == 0, got
    placed = json.loads(got.stdout)
    assert placed["status"] == "approved" and placed["shares"] == [20, 12]
    assert placed["explanation"]["length_sq_weight"] == 0.001  # the cost model k went with it
    assert rb.job(JOB)["cost_model"]["length_sq_weight_in_force"] == 0.001
    got = cli("rollback", JOB, "--reason", "undo", env=env)
    assert got.returncode == 0 and f"restores shares {before['shares']}" in got.stdout, got
    assert rb.placements(JOB, limit=1)[0]["shares"] == before["shares"]

    # Overrides add up across calls; --clear drops them.
    assert cli("override", JOB, "--pin", "1=8", env=env).returncode == 0
    got = cli("override", JOB, "--cap", "0=30", "--json", env=env)
    assert got.returncode == 0, got
    assert rb.overrides(JOB)["pins"] == {"1": 8} and rb.overrides(JOB)["caps"] == {"0": 30}
    assert cli("override", JOB, "--clear", env=env).returncode == 0
    assert rb.overrides(JOB)["pins"] == {} and rb.overrides(JOB)["caps"] == {}

    # Exit codes: 1 refused, 2 usage, 3 unreachable; --server and --token beat the env.
    got = cli("approve", JOB, "999999", env=env)
    assert got.returncode == 1 and f"Proposal 999999 not found for job '{JOB}'. (HTTP 404)" in got.stderr, got
    got = cli("approve", JOB, "1", "--token", viewer_token(live), env=env)
    assert got.returncode == 1 and "This action needs the operator role." in got.stderr, got
    got = cli("place", JOB, "1,x", env=env)
    assert got.returncode == 2 and "like 12,12,8" in got.stderr, got
    got = cli("override", JOB, "--pin", "2", env=env)
    assert got.returncode == 2 and "RANK=N" in got.stderr, got
    got = cli("mode", JOB, "fast", env=env)
    assert got.returncode == 2, got
    got = cli("jobs", "--server", f"http://127.0.0.1:{free_port()}", "--timeout", "2", env=env)
    assert got.returncode == 3 and "Cannot reach" in got.stderr, got


def test_watch_shows_ranks_and_shares(live: Server):
    env = {"REBALANCER_SERVER": live.url, "REBALANCER_TOKEN": ADMIN}
    got = cli("watch", JOB, "--count", "2", env=env)
    assert got.returncode == 0, got
    assert "RANK" in got.stdout and "SHARE" in got.stdout and f"{JOB}  " in got.stdout, got.stdout
    got = cli("watch", JOB, "--count", "1", "--json", env=env)
    assert got.returncode == 0, got
    view = json.loads(got.stdout.splitlines()[0])
    assert view["summary"]["job"] == JOB
    assert [r["rank"] for r in view["ranks"]] == [0, 1]
    assert sum(r["share"] for r in view["ranks"]) == B
    got = cli("watch", JOB, "--count", "1", "--token", "rb_nope", env=env)
    assert got.returncode == 1, got


def test_the_client_needs_no_server_package(live: Server):
    """With FastAPI, pydantic, SQLAlchemy, ... unimportable, the CLI (watch included) works."""
    env = {"REBALANCER_SERVER": live.url, "REBALANCER_TOKEN": ADMIN}
    probe = cli("--help", prelude=_BLOCKER + "\nimport backend.client, backend.client.commands, backend.cli\n"
                "assert not any(m.split('.')[0] in " + repr(SERVER_PACKAGES) + " for m in sys.modules)")
    assert probe.returncode == 0, probe
    got = cli("jobs", "--json", env=env, prelude=_BLOCKER)
    assert got.returncode == 0 and JOB in [j["job"] for j in json.loads(got.stdout)], got
    got = cli("watch", JOB, "--count", "1", env=env, prelude=_BLOCKER)
    assert got.returncode == 0 and "RANK" in got.stdout, got
    # The blocker really blocks.
    blocked = cli("serve", "--port", str(free_port()), prelude=_BLOCKER)
    assert blocked.returncode != 0 and "blocked" in blocked.stderr
