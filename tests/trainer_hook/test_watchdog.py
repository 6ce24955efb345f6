"""The hang watchdog (trainer_hook.watchdog) with a frozen clock, the stall report on the
wire, and the transport carrying it in the next metrics frame."""

from __future__ import annotations

import json
import os
import threading

import pytest

from rebalancer_wire.protocol import (
    MAX_PATH_CHARS,
    MAX_STACK_CHARS,
    Hang,
    Hello,
    Metrics,
    ProtocolError,
    decode,
    encode,
)
from trainer_hook.watchdog import Watchdog, nccl_dump_here, nccl_dump_path, thread_stack


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


# --- the NCCL flight recorder's dump path (torch 2.13's FlightRecorder.hpp, ProcessGroupNCCL.hpp) ---

def test_the_flight_recorder_path_follows_the_env() -> None:
    on = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "HOME": "/home/u"}
    # The recorder is on by default (2000 entries): the default file under $HOME/.cache/torch.
    assert nccl_dump_path(on, 3, nccl=True) == "/home/u/.cache/torch/comm_lib_trace_rank_3"
    assert nccl_dump_path({**on, "XDG_CACHE_HOME": "/c"}, 3, nccl=True) == "/c/torch/comm_lib_trace_rank_3"
    assert nccl_dump_path({"TORCH_NCCL_DUMP_ON_TIMEOUT": "true"}, 0, nccl=True) == "/tmp/.cache/torch/comm_lib_trace_rank_0"
    # The prefix variables, the newer one first; the file is the prefix and the global rank.
    assert nccl_dump_path({**on, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_"}, 12, nccl=True) == "/scratch/fr_12"
    assert nccl_dump_path({**on, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_", "TORCH_FR_DUMP_TEMP_FILE": "/new/fr_"},
                          12, nccl=True) == "/new/fr_12"
    # No dump: not an NCCL job, the dump not asked for, the recorder's buffer at 0 (either name).
    assert nccl_dump_path(on, 3, nccl=False) is None
    assert nccl_dump_path({"HOME": "/home/u"}, 3, nccl=True) is None
    assert nccl_dump_path({**on, "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}, 3, nccl=True) is None
    assert nccl_dump_path({**on, "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, 3, nccl=True) is None
    assert nccl_dump_path({**on, "TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}, 3, nccl=True) is None
    assert nccl_dump_path({**on, "TORCH_NCCL_TRACE_BUFFER_SIZE": "lots"}, 3, nccl=True) is None
    # A prefix the wire could not carry is left out rather than refused with the whole report.
    assert nccl_dump_path({**on, "TORCH_FR_DUMP_TEMP_FILE": "/x" * 3000}, 3, nccl=True) is None


def test_with_dynamic_file_names_the_newest_written_file_is_named(tmp_path) -> None:
    env = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr_"),
           "TORCH_FR_DUMP_DYNAMIC_FILE_NAME": "1"}
    assert nccl_dump_path(env, 2, nccl=True) == str(tmp_path / "fr_2")  # nothing written yet: the prefix
    (tmp_path / "fr_2_old").write_text("{}")
    newest = tmp_path / "fr_2_new"
    newest.write_text("{}")
    os.utime(tmp_path / "fr_2_old", (1e9, 1e9))
    (tmp_path / "fr_20_other_rank").write_text("{}")
    os.utime(tmp_path / "fr_20_other_rank", (1e9, 1e9))
    assert nccl_dump_path(env, 2, nccl=True) == str(newest)


def test_the_report_carries_the_dump_path_and_the_wire_bounds_it() -> None:
    clock = Clock(110.0)
    dog = Watchdog(where=lambda: (4, "sync_wait", 100.0, 0.5), report=lambda h: None, after_s=5.0,
                   thread_id=threading.get_ident(), clock=clock, nccl_dump=lambda: "/tmp/fr_1")
    hang = dog.check()
    assert hang is not None and hang.nccl_dump == "/tmp/fr_1"
    frame = encode(Metrics(job="j", rank=1, hang=hang))
    got = decode(frame)
    assert isinstance(got, Metrics) and got.hang == hang
    assert "nccl_dump" not in encode(Metrics(job="j", rank=1, hang=Hang(batch_index=1, phase="compute",
                                                                        since=1.7e9, stalled_s=6.0)))
    ok = {"batch_index": 3, "phase": "sync_wait", "since": 1.7e9, "stalled_s": 6.0}
    with pytest.raises(ProtocolError, match=f"'nccl_dump' must be at most {MAX_PATH_CHARS} characters"):
        decode(_frame({**ok, "nccl_dump": "/" * (MAX_PATH_CHARS + 1)}))
    with pytest.raises(ProtocolError, match="'nccl_dump' must not be empty"):
        decode(_frame({**ok, "nccl_dump": " "}))
    with pytest.raises(ProtocolError, match="'nccl_dump' must be a string"):
        decode(_frame({**ok, "nccl_dump": 7}))


def test_no_dump_path_outside_torch_distributed() -> None:
    assert nccl_dump_here() is None  # this process never initialised a process group
