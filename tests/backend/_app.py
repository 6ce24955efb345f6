"""Builders for in-process backend tests: an app on a fresh SQLite file, hook frames."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from backend.main import create_app
from backend.settings import Settings
from rebalancer_wire.protocol import Hello, Metrics, StepRecord, encode


def make_app(tmp_path: Path, **settings: Any) -> FastAPI:
    """An app on a fresh SQLite file; policy decisions on a thread (no worker process)."""
    settings.setdefault("db", f"sqlite:///{tmp_path / 'rebalancer.db'}")
    settings.setdefault("policy_process", False)
    return create_app(Settings(**settings))


def hello(job: str = "j", rank: int = 0, world_size: int = 2, global_batch_size: int = 32, **kw: Any) -> str:
    return encode(Hello(job=job, rank=rank, world_size=world_size, global_batch_size=global_batch_size,
                        host="h", device_type=kw.pop("device_type", "cpu"), **kw))


def steps(first: int, n: int, *, compute_ms: float = 10.0, step_ms: float = 20.0,
          local_batch_size: int = 16, t0: float | None = None) -> list[StepRecord]:
    t0 = time.time() if t0 is None else t0
    return [
        StepRecord(batch_index=b, local_batch_size=local_batch_size, placement_version=0,
                   data_wait_ms=0.5, compute_ms=compute_ms, sync_wait_ms=step_ms - compute_ms,
                   optimizer_ms=1.0, step_ms=step_ms, t=t0 + (b - first) * step_ms / 1000.0)
        for b in range(first, first + n)
    ]


def metrics(job: str = "j", rank: int = 0, first: int = 0, n: int = 5, dropped: int = 0, **kw: Any) -> str:
    return encode(Metrics(job=job, rank=rank, steps=steps(first, n, **kw), dropped=dropped))


def sync(ws: Any, hello_frame: str) -> None:
    """Wait until the server handled every frame sent so far on ``ws``.

    Frames of one connection are handled in order and a repeated hello is answered with the
    placement, so its reply proves the earlier frames are in live state.
    """
    ws.send_text(hello_frame)
    reply = ws.receive_json()
    assert reply["type"] == "placement", reply


def joined(ws: Any, job: str) -> None:
    """On a real websocket client: say hello as the one rank of ``job`` (B = 16) and take the
    placement the server answers with (a repeated hello: proof it handled what came before)."""
    ws.send(hello(job=job, rank=0, world_size=1, global_batch_size=16))
    reply = json.loads(ws.recv(timeout=10))
    assert reply["type"] == "placement", reply


def closed(ws: Any) -> tuple[int, str, list[dict[str, Any]]]:
    """Read a real websocket client connection until the server closes it; returns the close
    code, its reason and every frame that came before."""
    import json

    from websockets.exceptions import ConnectionClosed

    got = []
    try:
        while True:
            got.append(json.loads(ws.recv(timeout=10)))
    except ConnectionClosed as exc:
        assert exc.rcvd is not None
        return exc.rcvd.code, exc.rcvd.reason, got
