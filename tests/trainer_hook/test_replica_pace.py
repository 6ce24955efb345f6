"""ReplicaPace (trainer_hook/mesh.py): a replica's leader reports its slowest member's times.

Two members in one process over a fake group that all-reduces (MAX) their buffers when both
have launched: which records leave when, and with which numbers, exactly."""

from __future__ import annotations

import threading
from typing import Any

import torch

from trainer_hook.mesh import ReplicaPace
from trainer_hook.protocol import StepRecord


class _Work:
    def __init__(self, done: threading.Event) -> None:
        self.done = done

    def wait(self, timeout: Any = None) -> bool:
        assert self.done.wait(10), "the other member never launched this all-reduce"
        return True


class _Pair:
    """A two-member group: the MAX all-reduce completes once both members launched it."""

    def __init__(self) -> None:
        self.bufs: list[torch.Tensor] = []
        self.done = threading.Event()
        self.launches = 0
        self.lock = threading.Lock()

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        with self.lock:
            self.bufs.append(tensors[0])
            self.launches += 1
            work = _Work(self.done)
            if len(self.bufs) == 2:
                a, b = self.bufs
                assert a.shape == b.shape, "members launched different windows"
                m = torch.maximum(a, b)
                a.copy_(m)
                b.copy_(m)
                self.done.set()
                self.bufs, self.done = [], threading.Event()
            return work


def rec(k: int, compute: float, sync: float = 5.0, peak: int | None = None, total: int | None = None) -> StepRecord:
    return StepRecord(batch_index=k, local_batch_size=4, placement_version=0, data_wait_ms=0.5,
                      compute_ms=compute, sync_wait_ms=sync, optimizer_ms=1.0, step_ms=compute + sync + 1.5,
                      t=1.7e9 + k, mem_peak_bytes=peak, mem_total_bytes=total)


def _run(steps: int, window: int, slow: dict[int, float]) -> tuple[list[StepRecord], list[StepRecord], _Pair]:
    group = _Pair()
    leader, member = (ReplicaPace(group, leader=True, window=window), ReplicaPace(group, leader=False, window=window))
    reported: list[StepRecord] = []
    for k in range(steps):
        for pace, compute in ((leader, 10.0), (member, slow.get(k, 8.0))):
            out = pace.add(rec(k, compute, sync=20.0 - compute))
            if pace is member:
                assert out == []
            reported += out
        for pace in (leader, member):  # both launch before either reads (one step later)
            out = pace.on_step_end(k + 1, False)
            assert pace is leader or out == []
            reported += out
    # close(): every member flushes (blocking) after the same steps; only the leader holds records.
    at_close: list[StepRecord] = []
    other = threading.Thread(target=lambda: at_close.extend(leader.flush(steps, None)))
    other.start()
    assert member.flush(steps, None) == []
    other.join(10)
    return reported, at_close, group


def test_the_leader_reports_every_step_once_with_the_slowest_members_times() -> None:
    reported, at_close, group = _run(steps=20, window=8, slow={3: 30.0, 12: 11.0, 19: 50.0})
    # Windows 0-7 and 8-15 leave a step after their last batch; 16-19 at close.
    assert [r.batch_index for r in reported] == list(range(16))
    assert [r.batch_index for r in at_close] == [16, 17, 18, 19]
    by_k = {r.batch_index: r for r in reported + at_close}
    for k, r in by_k.items():
        want = {3: 30.0, 12: 11.0, 19: 50.0}.get(k, 10.0)
        assert r.compute_ms == want, k
        assert r.sync_wait_ms == 20.0 - want  # the slowest member waits least
        assert r.step_ms == 21.5  # max of (compute + sync + 1.5) = 21.5 on both
    assert group.launches == 2 * 3  # one all-reduce per window and member


def test_memory_takes_the_largest_peak_and_the_smallest_device() -> None:
    group = _Pair()
    leader, member = ReplicaPace(group, leader=True, window=2), ReplicaPace(group, leader=False, window=2)
    leader.add(rec(0, 1.0, peak=100, total=1000))
    member.add(rec(0, 1.0, peak=300, total=800))
    leader.add(rec(1, 1.0))
    member.add(rec(1, 1.0, peak=500, total=900))
    for k in (1, 2):
        out = leader.on_step_end(k, False)
        member.on_step_end(k, False)
    out = leader.on_step_end(3, False)
    member.on_step_end(3, False)
    assert [(r.mem_peak_bytes, r.mem_total_bytes) for r in out] == [(300, 800), (None, None)]


def test_a_record_after_its_window_left_goes_as_measured_and_close_without_peers_releases() -> None:
    group = _Pair()
    leader = ReplicaPace(group, leader=True, window=2)
    leader.on_step_end(1, True)  # device events: one window is left for late records
    leader.on_step_end(2, True)
    assert group.launches == 0
    leader.on_step_end(3, True)
    leader.on_step_end(4, True)  # window 0 leaves now
    assert group.launches == 1
    late = rec(1, 7.0)
    assert leader.add(late) == [late] and leader.late == 1
    kept = rec(2, 7.0)
    assert leader.add(kept) == []
    assert leader.release() == [kept]  # close(wait_for_peers=False): as measured
