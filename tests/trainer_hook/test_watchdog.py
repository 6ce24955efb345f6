"""The hang watchdog (trainer_hook.watchdog) with a frozen clock, the stall report on the
wire, and the transport carrying it in the next metrics frame."""

from __future__ import annotations

import json
import threading

import pytest

from rebalancer_wire.protocol import (
    MAX_STACK_CHARS,
    Hang,
    Hello,
    Metrics,
    ProtocolError,
    decode,
    encode,
)
from trainer_hook.watchdog import Watchdog, thread_stack


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_one_report_per_stall_with_where_and_since() -> None:
    clock = Clock(100.0)
    where: list[tuple[int, str, float, float] | None] = [None]
    sent: list[Hang] = []
    dog = Watchdog(where=lambda: where[0], report=sent.append, after_s=5.0, thread_id=threading.get_ident(),
                   clock=clock, wall=lambda: 1.7e9)
    assert dog.check() is None  # before the first step: nothing to watch
    where[0] = (7, "compute", 98.0, 0.5)  # batch 7, computing; the last step ended at 98 s
    assert dog.check() is None  # 2 s: not yet
    clock.t = 103.5
    hang = dog.check()
    assert hang is not None and sent == [hang]
    assert (hang.batch_index, hang.phase, hang.stalled_s, hang.since) == (7, "compute", 5.5, 1.7e9 - 5.5)
    assert "test_one_report_per_stall_with_where_and_since" in hang.stack  # this thread's own frame
    clock.t = 200.0
    assert dog.check() is None and len(sent) == 1  # the same stall is reported once
    where[0] = (8, "data_wait", 199.0, 0.5)  # a step ended: a new watch
    clock.t = 210.0
    assert dog.check() is not None and len(sent) == 2


def test_long_steps_stretch_the_threshold() -> None:
    clock = Clock(130.0)
    dog = Watchdog(where=lambda: (3, "sync_wait", 100.0, 8.0), report=lambda h: None, after_s=5.0,
                   thread_id=threading.get_ident(), clock=clock)
    assert dog.check() is None  # 30 s into 8 s steps: five steps are 40 s
    clock.t = 141.0
    assert dog.check() is not None


def test_a_deep_stack_is_cut_to_its_innermost_frames() -> None:
    got: list[str] = []

    def deep(n: int) -> None:
        if n:
            deep(n - 1)
        else:
            got.append(thread_stack(threading.get_ident(), limit=2000))

    deep(300)
    assert len(got[0]) <= 2000 and got[0].startswith("...\n") and "got.append(thread_stack" in got[0]
    assert len(thread_stack(threading.get_ident())) <= MAX_STACK_CHARS
    assert thread_stack(-1) == ""


def _frame(hang: dict[str, object]) -> str:
    return json.dumps({"type": "metrics", "v": 2, "job": "j", "rank": 0, "hang": hang})


def test_the_report_is_checked_at_the_edge() -> None:
    ok = {"batch_index": 3, "phase": "optimizer", "since": 1.7e9, "stalled_s": 6.0, "stack": "x"}
    msg = decode(_frame(ok))
    assert isinstance(msg, Metrics) and msg.hang == Hang(**ok)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="'hang.phase' must be one of data_wait, compute, sync_wait, optimizer, got 'lunch'."):
        decode(_frame({**ok, "phase": "lunch"}))
    with pytest.raises(ProtocolError, match=f"'stack' must be at most {MAX_STACK_CHARS} characters"):
        decode(_frame({**ok, "stack": "y" * (MAX_STACK_CHARS + 1)}))
    with pytest.raises(ProtocolError, match="'hang' must be a JSON object"):
        decode(_frame("stuck"))  # type: ignore[arg-type]
    skewed = decode(_frame({**ok, "since": 1.0e9}))
    assert isinstance(skewed, Metrics)
    with pytest.raises(ProtocolError, match="'hang.since' is .* from the backend's clock"):
        skewed.check_against(Hello(job="j", rank=0, world_size=1, global_batch_size=4), now=1.7e9)
    assert "hang" not in encode(Metrics(job="j", rank=0))


def test_the_transport_sends_a_stall_in_its_next_frame() -> None:
    from trainer_hook.transport import Transport

    t = Transport(url="ws://127.0.0.1:1/ws/hook", token=None, hello=lambda: Hello(job="j", rank=0, world_size=1, global_batch_size=4),
                  on_message=lambda m: None)
    t._ident = ("j", 0)
    assert t._build_frame() is None
    t.put_hang(Hang(batch_index=2, phase="compute", since=1.7e9, stalled_s=6.0))
    frame = t._build_frame()
    assert frame is not None and json.loads(frame)["hang"]["batch_index"] == 2
    assert t._build_frame() is None  # sent once
