"""ReplicaPace (trainer_hook/mesh.py): a replica's leader reports its slowest member's times.

Two members in one process over a fake group that all-reduces (MAX) their buffers when both
have launched: which records leave when, and with which numbers, exactly."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from rebalancer_wire.protocol import StepRecord
from tests.helpers.waiting import wait_until
from trainer_hook.mesh import ReplicaPace


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


def _pair(window: int) -> tuple[ReplicaPace, ReplicaPace, list[StepRecord], _Pair]:
    group = _Pair()
    reported: list[StepRecord] = []
    # The replica's global ranks are 4 (the leader) and 7.
    leader = ReplicaPace(group, leader=True, window=window, report=reported.extend, members=(4, 7), position=0)
    member = ReplicaPace(group, leader=False, window=window, report=lambda recs: pytest.fail("a member reported"),
                         members=(4, 7), position=1)
    return leader, member, reported, group


def _close(leader: ReplicaPace, member: ReplicaPace, trained: int) -> list[StepRecord]:
    """close() on both members at once (each blocks until the other's last all-reduce)."""
    left: list[StepRecord] = []
    other = threading.Thread(target=lambda: left.extend(leader.flush(trained, 10.0)))
    other.start()
    assert list(member.flush(trained, 10.0)) == []
    other.join(10)
    return left


def test_the_leader_reports_every_step_once_with_the_slowest_members_times() -> None:
    leader, member, reported, group = _pair(window=8)
    slow = {3: 30.0, 12: 11.0, 19: 50.0}
    for k in range(20):
        assert leader.add(rec(k, 10.0, sync=10.0)) == ()  # the training thread reports nothing itself
        assert member.add(rec(k, slow.get(k, 8.0), sync=20.0 - slow.get(k, 8.0))) == ()
        leader.on_step_end(k + 1, False)
        member.on_step_end(k + 1, False)
    assert _close(leader, member, 20) == []
    # Windows 0-7 and 8-15 left during training, 16-19 at close; each record once, in order.
    assert [r.batch_index for r in reported] == list(range(20))
    for r in reported:
        want = slow.get(r.batch_index, 10.0)
        assert r.compute_ms == want, r.batch_index
        assert r.sync_wait_ms == min(10.0, 20.0 - slow.get(r.batch_index, 8.0))  # the least wait
        assert r.step_ms == 21.5  # compute + sync + 1.5 on both members
        assert r.slowest_rank == (7 if r.batch_index in slow else 4), r.batch_index  # whose compute it is
    assert group.launches == 2 * 3  # one all-reduce per hand-over and member
    assert (leader.combined, leader.late) == (20, 0)


def test_members_that_trained_different_samples_all_raise_at_the_same_batch() -> None:
    # Batch 5 of window 0 differs (another seed on rank 7, say): both members raise at the
    # next hand-over (step 12), the same batch on each, so neither waits in a collective for
    # the other; nothing is raised before, and close() only logs it.
    leader, member, reported, _ = _pair(window=4)
    raised: dict[str, tuple[int, str]] = {}
    for k in range(12):
        leader.add(rec(k, 10.0), 1000 + k)
        member.add(rec(k, 10.0), 1000 + k + (k == 5))
        for name, pace in (("leader", leader), ("member", member)):
            try:
                pace.on_step_end(k + 1, False)
            except RuntimeError as exc:
                raised.setdefault(name, (k + 1, str(exc)))
    assert raised["leader"] == raised["member"]
    step, said = raised["leader"]
    assert step == 12  # window 1 (batches 4-7) left at step 8 and was checked at step 12
    assert said.startswith("the members of one data-parallel replica (ranks [4, 7]) trained different samples "
                           "at batch 5: every rank of a replica"), said
    assert "same shuffle and seed on every rank" in said
    _close(leader, member, 12)
    assert [r.batch_index for r in reported] == list(range(12))  # what was measured still leaves


def test_members_that_trained_the_same_samples_never_raise() -> None:
    leader, member, reported, _ = _pair(window=2)
    for k in range(9):
        leader.add(rec(k, 10.0), -7 if k % 2 else 1 << 60)  # negative and large numbers too
        member.add(rec(k, 12.0), -7 if k % 2 else 1 << 60)
        leader.on_step_end(k + 1, False)
        member.on_step_end(k + 1, False)
    _close(leader, member, 9)
    assert leader.mismatch is None and member.mismatch is None
    assert [r.compute_ms for r in reported] == [12.0] * 9


def test_memory_takes_the_largest_peak_and_the_smallest_device() -> None:
    leader, member, reported, _ = _pair(window=2)
    leader.add(rec(0, 1.0, peak=100, total=1000))
    member.add(rec(0, 1.0, peak=300, total=800))
    leader.add(rec(1, 1.0))
    member.add(rec(1, 1.0, peak=500, total=900))
    for k in (1, 2):
        leader.on_step_end(k, False)
        member.on_step_end(k, False)
    _close(leader, member, 2)
    assert [(r.mem_peak_bytes, r.mem_total_bytes) for r in reported] == [(300, 800), (None, None)]


def test_a_record_after_its_window_left_goes_as_measured_and_close_without_peers_releases() -> None:
    leader, member, reported, group = _pair(window=2)
    for k in (1, 2, 3, 4):  # device events: one window is left for late records
        leader.on_step_end(k, True)
        member.on_step_end(k, True)
    wait_until(lambda: group.launches == 2, "window 0 to leave (at step 4, from both members)")
    late = rec(1, 7.0)
    assert leader.add(late) == (late,) and leader.late == 1
    kept = rec(2, 7.0)
    assert leader.add(kept) == ()
    assert leader.release() == [kept]  # close(wait_for_peers=False): as measured
    member.release()


def test_without_members_nothing_is_said_of_the_slowest_and_a_bad_position_is_refused() -> None:
    group = _Pair()
    reported: list[StepRecord] = []
    a = ReplicaPace(group, leader=True, window=1, report=reported.extend)
    b = ReplicaPace(group, leader=False, window=1, report=lambda recs: pytest.fail("a member reported"))
    a.add(rec(0, 3.0))
    b.add(rec(0, 9.0))
    for p in (a, b):
        p.on_step_end(1, False)
    _close(a, b, 1)
    assert [(r.compute_ms, r.slowest_rank) for r in reported] == [(9.0, None)]
    with pytest.raises(ValueError, match=r"position must index members \(2 of them\), got 2\."):
        ReplicaPace(group, leader=False, report=reported.extend, members=(0, 1), position=2)
