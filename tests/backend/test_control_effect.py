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
