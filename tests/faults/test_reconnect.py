"""A recovered backend sees every rank back quickly (issue 15, defect 10).

After a 10 s outage one rank took over 6 s to reconnect: the back-off doubled to 8 s. The
hook's waits between attempts are now capped (1.5 s, jittered below it), so once the
backend answers again every rank is back within 2 s. The test records each transport's
waits (no wall-clock assertion): the real backend is killed, stays down until every
transport has failed several times, then starts again on the same port.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from backend.process import free_port
from rebalancer_wire.protocol import Hello
from tests.helpers.server import running_server
from tests.helpers.waiting import wait_until
from trainer_hook.transport import Transport

pytestmark = pytest.mark.multiproc


def transport(url: str, rank: int, waits: list[float]) -> Transport:
    t = Transport(url=url, token=None, on_message=lambda m: None,
                  hello=lambda: Hello(job="outage", rank=rank, world_size=2, global_batch_size=8))
    wait = t._closing.wait

    def spy(timeout: float | None = None) -> bool:
        if timeout is not None:
            waits.append(timeout)
        return wait(timeout)

    t._closing.wait = spy  # type: ignore[method-assign]
    return t


def test_every_rank_waits_at_most_1_5_s_between_attempts(tmp_path: Any) -> None:
    port = free_port()
    waits: dict[int, list[float]] = {0: [], 1: []}
    ts = [transport(f"http://127.0.0.1:{port}", r, waits[r]) for r in (0, 1)]
    try:
        with running_server(tmp_path, port=port, timeout=90) as first:
            for t in ts:
                t.start()
            wait_until(lambda: all(t.connected for t in ts), "both ranks connected", 20, log=first.log)
            first.proc.kill()  # a crash: no close frames
            first.proc.wait()
        # Down until each rank failed 6 times: the old back-off would then wait 8 s or more.
        wait_until(lambda: all(len(w) >= 6 for w in waits.values()), "6 failed attempts per rank", 60)
        with running_server(tmp_path, port=port, timeout=90) as second:
            before = {r: len(w) for r, w in waits.items()}
            wait_until(lambda: all(t.connected for t in ts), "both ranks back", 20, log=second.log)
            assert second.get("/api/v1/jobs/outage")["connected_ranks"] == 2  # type: ignore[index]
    finally:
        closers = [threading.Thread(target=t.close) for t in ts]
        for c in closers:
            c.start()
        for c in closers:
            c.join()
    for r, w in waits.items():
        assert max(w) <= 1.5, (r, w)  # so a recovered backend has every rank back within 2 s
        assert before[r] >= 6
