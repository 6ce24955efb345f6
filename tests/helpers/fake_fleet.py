"""Many jobs' hooks in one process: real /ws/hook websockets speaking the real protocol
(hello, then metrics), no training. Each rank's compute is ``per_sample_ms * share``, so a
job of mixed devices is imbalanced the way a real one is. Connections stay open until
``close()`` (the jobs stay connected, as running jobs are)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websockets

from rebalancer_wire.protocol import Hello, Metrics, StepRecord, encode, uniform_shares
from tests.helpers.server import Server, running_server

__all__ = ["FakeJob", "FakeFleet", "FleetPage", "fleet_server"]


@dataclass
class FakeJob:
    name: str
    devices: Sequence[str]  # one device name per rank
    per_sample_ms: Sequence[float]  # one per rank
    global_batch_size: int
    next_batch: int = 0
    sockets: list[Any] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.devices)


class FakeFleet:
    """An event loop on a thread of its own holding every fake rank's websocket."""

    def __init__(self, ws_url: str, token: str):
        self.url = ws_url + "/ws/hook"
        self.headers = {"Authorization": f"Bearer {token}"}
        self.jobs: dict[str, FakeJob] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-fleet", daemon=True)
        self._thread.start()

    def _run(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def add(self, job: FakeJob, batches: int) -> None:
        """Connect every rank of ``job`` (hello, placement back), then send ``batches`` batches."""
        self.jobs[job.name] = job
        self._run(self._connect(job))
        self.steps(job.name, batches)

    def steps(self, name: str, batches: int) -> None:
        self._run(self._steps(self.jobs[name], batches))

    async def _connect(self, job: FakeJob) -> None:
        for rank, device in enumerate(job.devices):
            ws = await websockets.connect(self.url, additional_headers=self.headers, open_timeout=60,
                                          ping_interval=None)
            await ws.send(encode(Hello(job=job.name, rank=rank, world_size=job.world_size,
                                       global_batch_size=job.global_batch_size, host=f"node{rank // 8}",
                                       device_type=device.split()[0], device_name=device)))
            await asyncio.wait_for(ws.recv(), 60)  # the placement in force
            job.sockets.append(ws)

    async def _steps(self, job: FakeJob, batches: int) -> None:
        shares = uniform_shares(job.world_size, job.global_batch_size)
        first, job.next_batch = job.next_batch, job.next_batch + batches
        now = time.time()
        step = max(c * b for c, b in zip(job.per_sample_ms, shares, strict=True)) + 2.0
        for rank, ws in enumerate(job.sockets):
            compute = job.per_sample_ms[rank] * shares[rank]
            recs = [StepRecord(batch_index=b, local_batch_size=shares[rank], placement_version=0,
                               data_wait_ms=0.2, compute_ms=compute, sync_wait_ms=step - compute - 1.0,
                               optimizer_ms=0.8, step_ms=step, t=now - (first + batches - b) * step / 1000)
                    for b in range(first, first + batches)]
            for i in range(0, len(recs), 20):
                await ws.send(encode(Metrics(job=job.name, rank=rank, steps=recs[i:i + 20])))

    def close(self) -> None:
        async def shut() -> None:
            for job in self.jobs.values():
                for ws in job.sockets:
                    await ws.close()
        try:
            self._run(shut(), 30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


@contextlib.contextmanager
def fleet_server(tmp: Path, **env: str) -> Iterator[tuple[Server, str, FakeFleet]]:
    """A real backend whose jobs never go stale, its admin token, and a FakeFleet on it; ``env``
    adds settings. The fleet closes before the server."""
    admin = "admin-" + secrets.token_urlsafe(24)
    envvars = {"REBALANCER_ADMIN_TOKEN": admin, "REBALANCER_STALE_AFTER_S": "3600", **env}
    with running_server(tmp, env=envvars, timeout=60) as srv:
        fleet = FakeFleet(srv.ws_url, admin)
        try:
            yield srv, admin, fleet
        finally:
            fleet.close()


@dataclass
class FleetPage:
    """What a browser test of a ``fleet_server`` holds: the server, its admin token, the fake
    fleet and the page open on it. Tests subclass it with their own readers."""

    server: Server
    admin: str
    fleet: FakeFleet
    page: Any
