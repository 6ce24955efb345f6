"""Measured effect and the rollback decision, as data."""

from __future__ import annotations

from backend.control.effect import after_window, before_window, judge_effect, merge_acks


def test_windows_around_the_switch_skip_the_settle_steps():
    assert before_window(100, 20) == (80, 99)
    assert after_window(100, 20) == (102, 121)


def test_a_slower_auto_change_goes_back():
    e = judge_effect(version=3, step_ms_before=100.0, step_ms_after=110.0,
                     rollback_threshold=0.05, may_roll_back=True)
    assert e.measured_gain is not None and round(e.measured_gain, 6) == -0.1
    assert e.rollback_reason == ("measured step time rose from 100.0 ms to 110.0 ms "
                                 "after version 3; rolling back")


def test_within_the_threshold_or_not_allowed_it_stays():
    kw = {"version": 3, "step_ms_before": 100.0, "rollback_threshold": 0.05}
    assert judge_effect(step_ms_after=104.0, may_roll_back=True, **kw).rollback_reason is None
    assert judge_effect(step_ms_after=150.0, may_roll_back=False, **kw).rollback_reason is None


def test_without_a_before_there_is_no_gain_and_no_rollback():
    e = judge_effect(version=1, step_ms_before=None, step_ms_after=50.0,
                     rollback_threshold=0.0, may_roll_back=True)
    assert (e.step_ms_after, e.measured_gain, e.rollback_reason) == (50.0, None, None)


def test_the_first_ack_of_a_rank_is_kept():
    assert merge_acks({"0": 10}, {0: 12, 1: 11}) == {"0": 10, "1": 11}
    assert merge_acks(None, {2: 5}) == {"2": 5}


def _live_with(per_sample: dict[int, list[float]], shares=(16, 16)):
    from backend.live.state import LiveState
    from rebalancer_wire.protocol import Hello, Metrics, StepRecord

    live = LiveState()
    for r in range(len(shares)):
        live.register(Hello(job="j", rank=r, world_size=len(shares), global_batch_size=sum(shares)))
        for k, c in enumerate(per_sample[r]):
            rec = StepRecord(batch_index=k, local_batch_size=shares[r], placement_version=0,
                             data_wait_ms=0.0, compute_ms=c * shares[r], sync_wait_ms=0.0,
                             optimizer_ms=0.0, step_ms=40.0, t=1000.0 + k)
            live.add_metrics(Metrics(job="j", rank=r, steps=[rec]))
    return live


def test_a_rank_that_slowed_on_its_own_scales_what_the_old_split_would_have_taken():
    from backend.control.effect import speed_factor

    live = _live_with({0: [1.0] * 22, 1: [1.0] * 10 + [2.0] * 12})
    f = speed_factor(live, "j", shares=(16, 16), before=(0, 9), after=(12, 21))
    assert f == 2.0
    # A change that took the step from 20 to 30 ms is no worse than the old split at the
    # new speeds (40 ms): it stays. Without the factor it would go back.
    kw = {"version": 4, "step_ms_before": 20.0, "step_ms_after": 30.0,
          "rollback_threshold": 0.05, "may_roll_back": True}
    assert judge_effect(speed_factor=f, **kw).rollback_reason is None
    assert judge_effect(**kw).rollback_reason is not None
    # Wobbles under 20% (per-sample cost moves with the batch size too) count as none.
    live = _live_with({0: [1.0] * 22, 1: [1.0] * 10 + [1.1] * 12})
    assert speed_factor(live, "j", shares=(16, 16), before=(0, 9), after=(12, 21)) == 1.0
    assert speed_factor(None, "j", shares=(16, 16), before=(0, 9), after=(12, 21)) == 1.0


def test_with_a_cost_longer_batches_are_not_a_slower_split():
    # Issue 23: two equally fast ranks (1 ms per token). The 10 batches after a change drew
    # longer samples (150 tokens a batch against 100) in fewer, longer sequences per rank.
    # Per sample the ranks look 6x slower; per token nothing changed. The step went from 50
    # to 70 ms: the old split would have taken 75 on those batches, so the change stays.
    from backend.control.effect import speed_factor, work_factor
    from backend.live.state import LiveState
    from rebalancer_wire.protocol import Hello, Metrics, StepRecord

    live = LiveState()
    for r in range(2):
        live.register(Hello(job="j", rank=r, world_size=2, global_batch_size=32))
        for k in range(22):
            n, work = (16, 50.0) if k < 10 else (4, 75.0)
            rec = StepRecord(batch_index=k, local_batch_size=n, placement_version=0, data_wait_ms=0.0,
                             compute_ms=work, sync_wait_ms=0.0, optimizer_ms=0.0, step_ms=work,
                             t=1000.0 + k, work=work, batch_work=2 * work)
            live.add_metrics(Metrics(job="j", rank=r, steps=[rec]))
    windows = {"before": (0, 9), "after": (12, 21)}
    assert speed_factor(live, "j", shares=(16, 16), **windows) == 1.0
    assert work_factor(live, "j", world_size=2, **windows) == 1.5
    kw = {"version": 2, "step_ms_before": 50.0, "step_ms_after": 70.0, "rollback_threshold": 0.05,
          "may_roll_back": True}
    assert judge_effect(speed_factor=1.5, **kw).rollback_reason is None
    assert judge_effect(**kw).rollback_reason == "measured step time rose from 50.0 ms to 70.0 ms after version 2; rolling back"
    # Without a cost (no work on the steps), nothing to scale by.
    assert work_factor(_live_with({0: [1.0] * 22, 1: [1.0] * 22}), "j", world_size=2, **windows) == 1.0
    assert work_factor(None, "j", world_size=2, **windows) == 1.0
