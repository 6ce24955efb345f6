"""Transport against the real backend (uvicorn on a free port): tokens, hello, metrics, acks."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rebalancer_wire.protocol import Ack, Hello, Message, Placement, StepRecord
from tests.helpers.server import Server, running_server
from trainer_hook.probe import DeviceProbe
from trainer_hook.transport import Transport

ADMIN = "admin-secret-0123456789"
WAIT_S = 30.0


def _until(pred: Callable[[], Any], what: str, server: Server) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        val = pred()
        if val:
            return val
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{server.log()[-3000:]}")


def _hello(job: str, rank: int) -> Callable[[], Hello]:
    probe = DeviceProbe(use_nvml=False)
    dtype, dname, mem = probe.describe()
    return lambda: Hello(job=job, rank=rank, world_size=2, global_batch_size=16, device_type=dtype,
                         device_name=dname, mem_total_bytes=mem)


def _step(k: int) -> StepRecord:
    return StepRecord(batch_index=k, local_batch_size=8, placement_version=0, data_wait_ms=0.2,
                      compute_ms=10.0 + k % 3, sync_wait_ms=1.0, optimizer_ms=0.5, step_ms=12.0 + k % 3,
                      t=time.time())


@pytest.mark.multiproc
def test_real_backend_token_hello_metrics_ack(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="trainer_hook.transport")
    with running_server(tmp_path, env={"REBALANCER_ADMIN_TOKEN": ADMIN}) as server:
        # A wrong token: the backend refuses it (error + close 4401); the transport says why.
        bad = Transport(url=server.url, token="not-a-token", hello=_hello("t1", 0), on_message=lambda m: None,
                        auth_backoff_s=600.0)
        bad.start()
        try:
            _until(lambda: "refused this hook's token" in caplog.text, "the auth error", server)
            assert not bad.connected
        finally:
            bad.close(timeout=1.0)

        got: list[Message] = []
        placement = threading.Event()

        def on_message(msg: Message) -> None:
            got.append(msg)
            if isinstance(msg, Placement):
                placement.set()

        transports = [Transport(url=server.url, token=ADMIN, hello=_hello("t1", r),
                                on_message=on_message if r == 0 else (lambda m: None))
                      for r in range(2)]
        probe = DeviceProbe(use_nvml=False, interval_s=0.2, on_sample=transports[0].put_device)
        for t in transports:
            t.start()
        probe.start()
        try:
            assert placement.wait(WAIT_S), server.log()[-3000:]
            first = got[0]
            assert isinstance(first, Placement) and first.version == 0 and first.shares == [8, 8]
            for k in range(60):
                for t in transports:
                    t.put_step(_step(k))
            transports[0].send_control(Ack(job="t1", rank=0, version=0, batch_index=0))

            def ranks() -> list[dict[str, Any]] | None:
                body: Any = server.get("/api/v1/jobs/t1/ranks", token=ADMIN)
                data = body["data"]
                ok = len(data) == 2 and all(r["n_steps"] == 60 for r in data) and data[0]["device"]
                return data if ok else None

            data = _until(ranks, "every step of both ranks and a device sample", server)
            assert [r["batch_index"] for r in data] == [59, 59]
            assert all(r["connected"] and r["dropped"] == 0 for r in data)
            assert data[0]["device_type"] == "CPU"
            assert data[0]["device"]["source"] == "psutil" and data[0]["device"]["rss_bytes"] > 0
        finally:
            probe.stop()
            for t in transports:
                t.close()
        assert not any(t.name == "rebalancer-transport" and t.is_alive() for t in threading.enumerate())
