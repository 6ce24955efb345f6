"""The HTTP and websocket edge against one real uvicorn server (issue 26 items 1, 2, 8): a
huge body without a token is refused without being read (the server's memory does not
grow), pre-auth websocket frames are bounded, a dashboard client that leaves first logs no
traceback, and a client's X-Forwarded-For is not believed."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.helpers.server import Server, running_server

ADMIN = "admin-secret-0123456789"
BODY_BYTES = 64 << 20  # what the client declares and tries to send


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("edge-server")
    with running_server(tmp, env={"REBALANCER_ADMIN_TOKEN": ADMIN}) as s:
        yield s


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _huge_put(server: Server, headers: str) -> tuple[int, int]:
    """PUT a BODY_BYTES body, sending until the server answers or closes; returns the
    status and how many body bytes went out."""
    chunk = b"x" * (1 << 20)
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall((f"PUT /api/v1/jobs/j/mode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"{headers}Content-Length: {BODY_BYTES}\r\n\r\n").encode())
        sock.settimeout(0.0)
        reply = b""
        while sent < BODY_BYTES and b"\r\n" not in reply:
            try:
                reply += sock.recv(4096)
            except BlockingIOError:
                pass
            except OSError:
                break
            try:
                sent += sock.send(chunk)
            except BlockingIOError:
                pass
            except OSError:
                break  # the server closed: the rest is never read
        sock.settimeout(30)
        while b"\r\n" not in reply:
            more = sock.recv(4096)
            if not more:
                break
            reply += more
    return int(reply.split(b" ", 2)[1]), sent


def test_a_huge_body_without_a_token_is_refused_unread(server: Server) -> None:
    assert server.call("GET", "/healthz")[0] == 200
    before = _rss_bytes(server.proc.pid)
    for _ in range(3):
        status, sent = _huge_put(server, "")
        assert status == 401
        assert sent < BODY_BYTES
    status, _ = _huge_put(server, f"Authorization: Bearer {ADMIN}\r\n")
    assert status == 413  # with a token: too large, refused from its Content-Length
    after = _rss_bytes(server.proc.pid)
    # 3 x 64 MB declared: read in full the server would grow by tens of MB at least
    assert after / before < 1.15, (before, after)


def _ws_close(server: Server, first: str | bytes | None) -> tuple[int, str]:
    with connect(server.ws_url + "/ws/dashboard", max_size=None) as ws:
        if first is not None:
            ws.send(first)
        try:
            while True:
                ws.recv(timeout=10)
        except ConnectionClosed as exc:
            assert exc.rcvd is not None
            return exc.rcvd.code, exc.rcvd.reason


def test_a_big_frame_before_auth_closes_with_1009(server: Server) -> None:
    code, reason = _ws_close(server, "x" * 65536)
    assert (code, reason) == (1009, "The first frame must be the auth message, at most 4096 bytes; "
                                    "send {\"type\": \"auth\", \"token\": T}.")
    code, _ = _ws_close(server, json.dumps({"type": "auth", "token": "nope"}))
    assert code == 4401


def test_dashboard_clients_that_leave_first_log_no_traceback(server: Server) -> None:
    before = server.log()
    for i in range(5):
        ws = connect(server.ws_url + "/ws/dashboard")
        if i % 2:
            ws.send(json.dumps({"type": "auth", "token": "bad"}))
        ws.close()  # leaves before the server answered
    for _ in range(5):
        sock = socket.create_connection(("127.0.0.1", server.port))
        ws = connect(server.ws_url + "/ws/dashboard", sock=sock)
        sock.shutdown(socket.SHUT_RDWR)  # gone without a close frame
        ws.close()
    assert server.call("GET", "/healthz")[0] == 200  # and everything it logged is flushed
    _ws_close(server, json.dumps({"type": "auth", "token": ADMIN + "x"}))
    new = server.log()[len(before):]
    assert "Traceback" not in new and "Exception in ASGI application" not in new, new[-3000:]


def test_the_audit_log_ignores_a_forged_forwarded_for(server: Server) -> None:
    import urllib.request

    req = urllib.request.Request(
        server.url + "/api/v1/tokens", method="POST", data=json.dumps({"role": "viewer", "name": "xff"}).encode(),
        headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json",
                 "X-Forwarded-For": "203.0.113.9"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 201
    _, audit = server.call("GET", "/api/v1/audit?action=token.create", token=ADMIN)
    (row,) = [a for a in audit["data"] if a["params"].get("name") == "xff"]
    assert row["address"] == "127.0.0.1"
