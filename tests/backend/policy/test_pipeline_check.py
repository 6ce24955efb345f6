"""A pipelined placement's prediction, checked against what was measured after it
(backend.policy.pipeline_check, issue 40 item 3), with real model objects and numbers worked
by hand.

The job: PP2 x DP2, 1F1B. Pipeline 0's stages take 4 and 8 ms a micro-batch and it measured
6 ms more than its model at 8 micro-batches (68 + 6 = 74); pipeline 1's take 8 and 16 ms
(136 at 8, no residual). Every step took 137.5 ms: the slowest run plus 1.5 ms of rest."""

from __future__ import annotations

import pytest

from backend.policy import JobObservation, PolicyConfig, Proposal, decide
from backend.policy.pipeline import PipelineObservation, PipelineTimes
from backend.policy.pipeline_check import (
    PREDICTION_TOLERANCE,
    REFIT,
    check,
    predict,
    rest_of_step_ms,
)
from backend.policy.types import RankObservation, StepSample

STAGES = {0: [4.0, 8.0], 1: [8.0, 16.0]}


def _times(i: int, m: int, compute: float, step: float) -> PipelineTimes:
    stage = STAGES[i]
    return PipelineTimes(dp_index=i, n_steps=20, n_microbatches=m, fwd_ms=tuple(t / 4 for t in stage),
                         bwd_ms=tuple(3 * t / 4 for t in stage), send_wait_ms=(0.0, 0.0), recv_wait_ms=(0.0, 0.0),
                         bubble_ms=tuple(compute - m * t for t in stage), compute_ms=compute, step_ms=step)


def _po(*pipes: PipelineTimes | None) -> PipelineObservation:
    return PipelineObservation(schedule="1f1b", pp_size=2, stages_per_rank=1, tp_size=1, min_microbatches=2,
                               pipelines=tuple(pipes))


BEFORE = _po(_times(0, 8, 68.0 + 6.0, 137.5), _times(1, 8, 136.0, 137.5))


def test_a_placement_is_predicted_per_pipeline_and_for_the_step():
    """Pipeline 0: T(m) = 4 + 8m, its 6 ms residual spread over 8 + 1 slots: a = 4 + 2/3,
    c = 8 + 2/3, so 11 micro-batches run 100 ms. Pipeline 1: 8 + 16*5 = 88. The step: the
    slowest, 100, plus the 1.5 ms of rest = 101.5."""
    assert rest_of_step_ms(BEFORE) == pytest.approx(1.5)
    got = predict(BEFORE, [11, 5])
    assert got is not None
    assert [r["predicted_ms"] for r in got["pipelines"]] == pytest.approx([100.0, 88.0])
    assert [r["n_microbatches"] for r in got["pipelines"]] == [11, 5]
    assert got["predicted_step_ms"] == pytest.approx(101.5) and got["rest_ms"] == pytest.approx(1.5)
    assert (got["measured_step_ms"], got["error"], got["missed"], got["tolerance"]) == (None, None, False, 0.10)


def test_the_prediction_is_the_strategys_own():
    """What the ``pipeline`` strategy proposes, it predicts with the same fitted cost: its
    explanation's run per pipeline equals the check's prediction for its shares."""
    ranks = tuple(RankObservation(rank=i, steps=tuple(StepSample(k, 8, t.compute_ms) for k in range(20)))
                  for i, t in enumerate(BEFORE.pipelines) if t is not None)
    obs = JobObservation(job="pp", world_size=2, global_batch_size=16, batch_index=40, shares=(8, 8),
                         placement_version=1, steps_since_change=40, ranks=ranks, pipeline=BEFORE)
    got = decide(obs, PolicyConfig(min_steps=10))
    assert isinstance(got, Proposal), got
    mine = predict(BEFORE, list(got.shares))
    assert mine is not None
    assert [r.compute_ms_after for r in got.explanation.ranks] == pytest.approx(
        [r["predicted_ms"] for r in mine["pipelines"]])


def test_a_prediction_measured_within_ten_percent_is_no_miss():
    """After (11, 5): pipeline 0 ran 105 ms (+5%), pipeline 1 88 (0%), steps 106.5 (+4.9%)."""
    pred = predict(BEFORE, [11, 5])
    assert pred is not None
    after = _po(_times(0, 11, 105.0, 106.5), _times(1, 5, 88.0, 106.5))
    got = check(pred, after, 106.5)
    assert [r["measured_ms"] for r in got["pipelines"]] == pytest.approx([105.0, 88.0])
    assert [r["error"] for r in got["pipelines"]] == pytest.approx([0.05, 0.0])
    assert got["measured_step_ms"] == 106.5 and got["error"] == pytest.approx(106.5 / 101.5 - 1)
    assert not got["missed"] and got["note"] == "within 10% (+4.9% on the step)"
    assert pred["measured_step_ms"] is None  # the prediction on record is not changed in place


def test_a_miss_beyond_ten_percent_is_flagged_and_said():
    """Pipeline 0 ran 120 ms at 11 (+20%): its 20 ms more than predicted set the step, 121.5."""
    pred = predict(BEFORE, [11, 5])
    assert pred is not None
    got = check(pred, _po(_times(0, 11, 120.0, 121.5), _times(1, 5, 88.0, 121.5)), 121.5)
    assert got["missed"] and got["error"] == pytest.approx(121.5 / 101.5 - 1)
    assert got["note"] == ("missed by more than 10%: the step took 121.5 ms against 101.5 predicted (+20%); "
                           "pipeline 0 ran 120.0 ms at 11 micro-batches against 100.0 predicted (+20%); "
                           f"{REFIT}.")
    assert PREDICTION_TOLERANCE == 0.10


def test_a_pipeline_measured_at_another_count_or_drained_is_no_measure():
    """A pipeline whose window shows another count (it had not switched) measures nothing of
    this prediction; a drained pipeline is predicted to run nothing and has no error."""
    pred = predict(BEFORE, [11, 5])
    assert pred is not None
    got = check(pred, _po(_times(0, 8, 74.0, 137.5), None), 137.5)
    assert [r["measured_ms"] for r in got["pipelines"]] == [None, None]
    assert got["missed"]  # the step itself: 137.5 against 101.5
    drained = predict(_po(_times(0, 8, 74.0, 137.5), _times(1, 8, 136.0, 137.5)), [16, 0])
    assert drained is not None
    assert [r["predicted_ms"] for r in drained["pipelines"]] == pytest.approx([4 + 2 / 3 + (8 + 2 / 3) * 16, 0.0])
    assert check(drained, None, None)["note"] == "no measured step to check the prediction against"


def test_a_pipeline_without_stage_times_leaves_the_step_unpredicted():
    po = _po(_times(0, 8, 74.0, 137.5), None)
    got = predict(po, [8, 8])
    assert got is not None and got["predicted_step_ms"] is None
    assert [r["predicted_ms"] for r in got["pipelines"]] == [pytest.approx(74.0), None]
    assert predict(_po(None, None), [8, 8]) is None
    assert predict(BEFORE, [16]) is None  # shares for another number of pipelines
