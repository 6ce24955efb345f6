"""The forwarder's answers when the owner cannot give one, in process (no Redis needed)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import pytest

from backend.cluster.forward import Forwarder, ForwardError


def _resetting_owner() -> tuple[int, socket.socket]:
    """A replica that takes the request and drops the connection without an answer (an owner
    reset or killed mid-request)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                conn.recv(65536)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()  # RST: no status line ever comes

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], listener


def test_an_owner_that_resets_mid_request_gets_a_503_that_says_so() -> None:
    port, listener = _resetting_owner()

    async def run() -> ForwardError:
        fwd = Forwarder(replica_id="b", timeout_s=10.0)
        try:
            with pytest.raises(ForwardError) as refused:
                await fwd.send(job="j", owner="a", url=f"ws://127.0.0.1:{port}", method="PUT",
                               path="/api/v1/jobs/j/mode", query="", authorization="Bearer x", body=b"{}")
            return refused.value
        finally:
            await fwd.aclose()

    try:
        err = asyncio.run(run())
    finally:
        listener.close()
    assert err.status_code == 503
    assert err.detail.startswith(
        f"Job 'j' is controlled by replica a at ws://127.0.0.1:{port}, which dropped the connection before "
        "answering (")
    assert err.detail.endswith(
        "); the action may have been applied there: read the job's audit (GET /api/v1/jobs/j/audit) before "
        "sending it again.")
