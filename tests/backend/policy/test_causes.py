"""The what-if replay (backend.policy.causes) on constructed windows: exact numbers."""

from __future__ import annotations

import pytest

from backend.policy.causes import CauseStep, attribute


def step(k: int, b: int, *, d: float = 0.0, c: float, s: float, o: float = 0.0, host: float = 0.0,
         ckpt: float = 0.0, gc: float = 0.0, comm: tuple[int, float] | None = None, work: float | None = None) -> CauseStep:
    return CauseStep(batch_index=k, local_batch_size=b, data_wait_ms=d, compute_ms=c, sync_wait_ms=s,
                     optimizer_ms=o, step_ms=d + c + s + o, host_ms=host, ckpt_ms=ckpt, gc_ms=gc,
                     comm_bytes=comm[0] if comm else None, comm_ms=comm[1] if comm else None, work=work)


def by_name(report):  # type: ignore[no-untyped-def]
    return {c.cause: c for c in report.causes}


def test_a_loader_that_keeps_one_rank_waiting_is_the_top_cause() -> None:
    # Rank 1 waits 30 ms for its loader and 2 ms on its own host work; both compute 40 ms;
    # the transfer is 3 ms (rank 1's wait inside the collective: it arrives last).
    steps = {0: [step(k, 4, d=2.0, c=40.0, s=33.0, o=5.0) for k in range(10)],
             1: [step(k, 4, d=32.0, c=40.0, s=3.0, o=5.0, host=2.0) for k in range(10)]}
    report = attribute(steps, global_batch_size=8, steps_done=3600)
    assert report.steps == 10 and report.step_ms == 80.0 and report.replayed_step_ms == 80.0
    assert [c.cause for c in report.causes] == ["data_wait", "host"]
    top = report.causes[0]
    assert top.ranks == (1,)
    assert top.ms_per_step == pytest.approx(30.0)  # arrivals 40 and 42: a 50 ms step
    assert top.predicted_step_ms_without == pytest.approx(50.0)
    assert top.share_of_step == pytest.approx(30.0 / 80.0)
    assert top.gpu_hours_lost == pytest.approx(30.0 * 3600 * 2 / 3.6e6)  # 2 ranks x 3,600 steps
    assert "num_workers" in top.remedy
    host = report.causes[1]
    assert (host.ranks, host.ms_per_step, host.predicted_step_ms_without) == ((1,), pytest.approx(2.0), pytest.approx(78.0))


def test_a_slow_rank_and_the_placement_that_absorbs_it() -> None:
    # Rank 2 computes 20 ms per sample, the others 10; 4 samples each of 12.
    steps = {r: [step(k, 4, c=40.0 * (2 if r == 2 else 1), s=2.0 if r == 2 else 42.0, o=4.0) for k in range(6)]
             for r in range(3)}
    got = by_name(attribute(steps, global_batch_size=12, steps_done=100))
    assert list(got) == ["slow_rank", "placement"]
    assert got["slow_rank"].ranks == (2,)
    assert got["slow_rank"].predicted_step_ms_without == pytest.approx(46.0)  # 40 + 2 + 4
    assert got["slow_rank"].ms_per_step == pytest.approx(40.0)
    # The solver's split (5, 5, 2) takes the step to 50 ms of compute.
    assert got["placement"].predicted_step_ms_without == pytest.approx(56.0)
    assert got["placement"].ms_per_step == pytest.approx(30.0)
    assert "[5, 5, 2]" in got["placement"].remedy


def test_gc_pauses_on_the_rank_that_arrives_last() -> None:
    steps = {0: [step(k, 4, c=50.0, s=2.0, o=3.0, gc=10.0) for k in range(4)],
             1: [step(k, 4, c=45.0, s=7.0, o=3.0) for k in range(4)]}
    report = attribute(steps, global_batch_size=8, steps_done=10)
    got = by_name(report)
    # Without rank 0's pauses both arrive at 45 and the step is 45 + 2 + 3 = 50 ms (not 40 + ...:
    # rank 1 then arrives last). Rank 0 is no slow device: without its pauses it computes 40 ms,
    # so the slowest rank is rank 1, and rank 1 at the median speed does not shorten the step.
    assert got["gc"].ms_per_step == pytest.approx(5.0)
    assert got["gc"].ranks == (0,)
    assert "slow_rank" not in got
    assert report.gc_share == pytest.approx(10.0 / 55.0)
    assert "gc_freeze" in got["gc"].remedy


def test_transfers_at_the_best_bandwidth_measured() -> None:
    # 1 MB a step, fully exposed: 10 ms on even steps, 20 ms on odd ones.
    def x(k: int) -> float:
        return 10.0 if k % 2 == 0 else 20.0

    steps = {r: [step(k, 4, c=50.0, s=x(k), comm=(1_000_000, x(k))) for k in range(8)] for r in range(2)}
    got = by_name(attribute(steps, global_batch_size=8, steps_done=8))
    assert list(got) == ["communication"]
    assert got["communication"].ms_per_step == pytest.approx(5.0)
    assert got["communication"].predicted_step_ms_without == pytest.approx(60.0)


def test_sample_cost_skew_from_the_steps_work() -> None:
    # Rank 0 alternates 100 and 300 units of work (0.1 ms each), rank 1 always 200.
    steps = {0: [step(k, 4, c=10.0 if k % 2 == 0 else 30.0, s=10.0 if k % 2 == 0 else 0.0,
                      work=100.0 if k % 2 == 0 else 300.0) for k in range(6)],
             1: [step(k, 4, c=20.0, s=0.0 if k % 2 == 0 else 10.0, work=200.0) for k in range(6)]}
    got = by_name(attribute(steps, global_batch_size=8, steps_done=6))
    assert list(got) == ["sample_cost_skew"]
    assert got["sample_cost_skew"].ranks == (0, 1)  # each holds more than the even share in turn
    assert got["sample_cost_skew"].ms_per_step == pytest.approx(5.0)  # steps of 20 and 30 -> 15 and 25


def test_sample_cost_skew_when_one_rank_always_holds_the_long_sample() -> None:
    # A work-split loader gives the long sample (8 of 12 units) to rank 0 every step: its work never
    # varies, yet packing to even lengths (4 units each, 1 ms a unit) takes the step from 8 to 4 ms.
    steps = {0: [step(k, 1, c=8.0, s=0.0, work=8.0) for k in range(6)],
             1: [step(k, 6, c=2.0, s=6.0, work=2.0) for k in range(6)],
             2: [step(k, 5, c=2.0, s=6.0, work=2.0) for k in range(6)]}
    got = by_name(attribute(steps, global_batch_size=12, steps_done=6))
    assert list(got) == ["sample_cost_skew"]  # no placement: a count-based fit cannot split a sample
    assert got["sample_cost_skew"].ranks == (0,)
    assert got["sample_cost_skew"].ms_per_step == pytest.approx(4.0)


def test_checkpoint_writes_and_alignment_on_common_steps() -> None:
    # Every fourth step rank 0 writes a checkpoint of 40 ms before it; rank 1 has one step more.
    steps = {0: [step(k, 4, d=40.0 if k % 4 == 0 else 0.0, ckpt=40.0 if k % 4 == 0 else 0.0, c=20.0,
                      s=0.0) for k in range(8)],
             1: [step(k, 4, c=20.0, s=40.0 if k % 4 == 0 else 0.0) for k in range(9)]}
    report = attribute(steps, global_batch_size=8, steps_done=8)
    assert report.steps == 8
    got = by_name(report)
    assert list(got) == ["checkpoint"]
    assert got["checkpoint"].ms_per_step == pytest.approx(10.0)  # 40 ms on 2 of 8 steps
    assert "async_save" in got["checkpoint"].remedy


def test_a_balanced_job_has_no_cause_and_an_empty_window_none() -> None:
    steps = {r: [step(k, 4, c=40.0, s=1.0, o=2.0) for k in range(5)] for r in range(4)}
    assert attribute(steps, global_batch_size=16, steps_done=5).causes == ()
    empty = attribute({0: [], 1: []}, global_batch_size=16, steps_done=0)
    assert (empty.causes, empty.steps, empty.step_ms) == ((), 0, None)
    with pytest.raises(ValueError, match="global_batch_size must be >= 1, got 0."):
        attribute(steps, global_batch_size=0, steps_done=0)
