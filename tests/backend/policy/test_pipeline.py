"""The pipeline model, strategy (backend.policy.pipeline), views and stage-split advice
(backend.policy.pipeline_advice), with real numbers worked by hand in each test."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from backend.policy import Constraints, JobObservation, NoProposal, PolicyConfig, Proposal, decide
from backend.policy.pipeline import (
    PipelineObservation,
    PipelineTimes,
    allowed_counts,
    bubble_share,
    floor_problem,
    linear_cost,
    quantize_counts,
    replay_ms,
    schedule_ms,
    theory_bubble,
)
from backend.policy.pipeline_advice import assess, split_layers, stage_split_advice
from backend.policy.types import RankObservation, StepSample


def _times(i: int, stage: list[float], m: int, *, residual: float = 0.0, rest: float = 2.0,
           layer_ms: tuple[float, ...] = (), steps: int = 20) -> PipelineTimes:
    """Pipeline ``i`` whose stages take ``stage`` ms per micro-batch (a third forward)."""
    fwd = tuple(t / 3 for t in stage)
    bwd = tuple(t - f for t, f in zip(stage, fwd, strict=True))
    compute = schedule_ms(stage, m) + residual
    idle = tuple(compute - m * t for t in stage)
    return PipelineTimes(dp_index=i, n_steps=steps, n_microbatches=m, fwd_ms=fwd, bwd_ms=bwd,
                         send_wait_ms=(0.0,) * len(stage), recv_wait_ms=(0.0,) * len(stage), bubble_ms=idle,
                         compute_ms=compute, step_ms=compute + rest, layer_ms=layer_ms)


def _observe(pipes: list[PipelineTimes], *, schedule: str = "1f1b", floor: int = 1,
             layers: tuple[int, ...] = (), names: tuple[str, ...] = (), version: int = 1,
             v: int = 1) -> JobObservation:
    shares = tuple(t.n_microbatches for t in pipes)
    ranks = tuple(RankObservation(rank=t.dp_index, steps=tuple(
        StepSample(k, t.n_microbatches, t.compute_ms) for k in range(t.n_steps))) for t in pipes)
    po = PipelineObservation(schedule=schedule, pp_size=len(pipes[0].fwd_ms), stages_per_rank=v, tp_size=1,
                             min_microbatches=floor, pipelines=tuple(pipes), layers_per_stage=layers,
                             layer_names=names)
    return JobObservation(job="pp", world_size=len(pipes), global_batch_size=sum(shares), batch_index=40,
                          shares=shares, placement_version=version, steps_since_change=40, ranks=ranks,
                          pipeline=po)


def test_the_schedule_model_is_the_textbook_bubble_for_equal_stages():
    assert schedule_ms([10.0] * 4, 8) == 110.0  # (m + p - 1) * t
    assert bubble_share([10.0] * 4, 8) == pytest.approx(3 / 11) == pytest.approx(theory_bubble(4, 8))
    # a heavy last stage: the fill crosses every stage once, then the slowest sets the pace
    assert schedule_ms([10.0, 10.0, 10.0, 20.0], 8) == 50.0 + 7 * 20.0
    assert bubble_share([10.0, 10.0, 10.0, 20.0], 8) == pytest.approx(1 - 8 * 12.5 / 190)
    # interleaved 1F1B, 2 model stages per rank: (m + (p-1)/v) * t
    assert schedule_ms([10.0] * 4, 8, stages_per_rank=2) == pytest.approx(95.0)
    assert theory_bubble(4, 8, 2) == pytest.approx(1.5 / 9.5)
    assert schedule_ms([10.0] * 4, 0) == 0.0
    a, c = linear_cost([5.0, 5.0, 5.0, 5.0])
    assert (a, c) == (15.0, 5.0) and all(a + c * m == schedule_ms([5.0] * 4, m) for m in range(1, 9))


def test_a_slow_pipeline_gets_fewer_micro_batches_and_its_larger_bubble_is_priced():
    """PP4 x DP2, 16 micro-batches: pipeline 1's stages take 10 ms, pipeline 0's 5 ms.
    T0(m) = 15 + 5m, T1(m) = 30 + 10m. Uniform (8, 8): 55 and 110. A split by speed alone
    (2:1, ignoring the bubble) gives (11, 5): 70 and 80. The model's best is (12, 4): 75 and
    70, a step of 75 ms, the slow pipeline's bubble share up from 3/11 to 3/7."""
    obs = _observe([_times(0, [5.0] * 4, 8), _times(1, [10.0] * 4, 8)])
    got = decide(obs, PolicyConfig(strategy="profiled", min_steps=10))
    assert isinstance(got, Proposal), got
    assert got.shares == (12, 4)
    ex = got.explanation
    assert ex.strategy == "pipeline"
    assert ex.step_ms_before == pytest.approx(110.0) and ex.step_ms_after == pytest.approx(75.0)
    assert [r.compute_ms_after for r in ex.ranks] == pytest.approx([75.0, 70.0])
    assert bubble_share([10.0] * 4, 4) == pytest.approx(3 / 7)
    assert ex.evidence["pipeline"]["pipelines"][1]["bottleneck_stage"] == 0


def test_never_fewer_micro_batches_than_the_schedule_allows():
    """The same job with min_microbatches 5: (11, 5), 80 ms, the best the floor admits."""
    obs = _observe([_times(0, [5.0] * 4, 8), _times(1, [10.0] * 4, 8)], floor=5)
    got = decide(obs, PolicyConfig(min_steps=10))
    assert isinstance(got, Proposal) and got.shares == (11, 5)
    assert got.explanation.step_ms_after == pytest.approx(80.0)
    # an operator's drain of a pipeline the schedule cannot drain has no placement
    drained = decide(obs, PolicyConfig(min_steps=10), Constraints(drains=frozenset({1})))
    assert isinstance(drained, NoProposal) and drained.status == "infeasible"


def test_interleaved_counts_are_multiples_of_their_rounds():
    """torch 2.13's ScheduleInterleaved1F1B plays max(1, m // p) rounds of equal size."""
    assert allowed_counts("interleaved1f1b", 4, 0, 30) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 16, 20, 24, 28]
    assert allowed_counts("interleaved1f1b", 2, 0, 12) == [0, 1, 2, 3, 4, 6, 8, 10, 12]
    assert allowed_counts("1f1b", 4, 0, 6) == [0, 4, 5, 6] and allowed_counts("gpipe", 4, 0, 3) == [0, 1, 2, 3]
    assert floor_problem(0, "interleaved1f1b", [17, 7], 4) == (
        "this job's interleaved1f1b schedule with 4 ranks per pipeline runs a count that is a multiple of its "
        "rounds (count // 4), but the placement gives pipeline 0 (17; nearby: [15, 16, 20]).")
    assert floor_problem(0, "interleaved1f1b", [16, 8], 4) is None
    assert floor_problem(0, "interleaved1f1b", [17, 7]) is None  # no pp_size: the floor only


def test_an_interleaved_split_is_quantized_to_counts_the_schedule_takes_keeping_the_global_count():
    """PP4 x DP2, interleaved with 2 model stages per rank, 24 micro-batches: pipeline 0's ranks
    take 5 ms a micro-batch (its two model stages), pipeline 1's 10 ms. With v = 2 the fill is
    half as long: T0 = 15/2 + 5m, T1 = 30/2 + 10m. The continuous best is (17, 7): 92.5 and
    85 ms, but 17 is no multiple of its rounds (4); of the counts it takes, (16, 8) is best:
    87.5 and 95 ms (uniform (12, 12): 67.5 and 135)."""
    pipes = []
    for i, t in enumerate((5.0, 10.0)):
        base = _times(i, [t] * 4, 12)
        compute = schedule_ms([t] * 4, 12, stages_per_rank=2)
        pipes.append(dataclasses.replace(base, compute_ms=compute, step_ms=compute + 2.0))
    obs = _observe(pipes, schedule="interleaved1f1b", floor=0, v=2)
    got = decide(obs, PolicyConfig(min_steps=10))
    assert isinstance(got, Proposal), got
    assert got.shares == (16, 8)
    ex = got.explanation
    assert ex.step_ms_before == pytest.approx(135.0) and ex.step_ms_after == pytest.approx(95.0)
    assert ex.evidence["quantized_to_schedule_counts"] == [16, 8]
    # by hand: pins stay, the sum is kept, and no split at all is an error naming the rule
    assert quantize_counts([17, 7], [7.5, 15.0], [5.0, 10.0], [0, 0], [24, 24], frozenset(), "interleaved1f1b",
                           4) == (16, 8)
    # equal pipelines, pipeline 1 pinned at 4: the most even split of the other 20 the rule takes
    assert quantize_counts([17, 4, 3], [0.0] * 3, [1.0] * 3, [0] * 3, [24] * 3, frozenset({1}),
                           "interleaved1f1b", 4) == (10, 4, 10)
    with pytest.raises(ValueError, match="no split of 35 micro-batches over 2 pipelines"):
        quantize_counts([17, 18], [0.0] * 2, [1.0] * 2, [17, 17], [18, 18], frozenset(), "interleaved1f1b", 4)


def test_what_the_model_leaves_out_is_measured_per_pipeline():
    """Pipeline 1 measures 12 ms more than its model at 8 micro-batches (sends and receives):
    12/11 ms for each of its run's 11 slots, T1(m) = 30 + 10m + 12/11 (m + 3). (12, 4): 75
    and 77.6 ms; (13, 3): 80 ms. The bare model would predict 75 ms for (12, 4)."""
    obs = _observe([_times(0, [5.0] * 4, 8), _times(1, [10.0] * 4, 8, residual=12.0)])
    got = decide(obs, PolicyConfig(min_steps=10))
    assert isinstance(got, Proposal) and got.shares == (12, 4)
    assert got.explanation.step_ms_before == pytest.approx(122.0)
    assert got.explanation.step_ms_after == pytest.approx(70.0 + 12.0 / 11 * 7)


def test_a_residual_measured_at_one_count_predicts_another_per_slot():
    """One run of bench.pipeline's sweep (numbers copied here; PP2 1F1B, pipeline 1's stages 60
    ms a micro-batch, the step bound by it): 700 ms at 10 micro-batches, 322 ms at 4. The
    residual at 10 (40 ms over T = 660) predicts 4 as 300 + 40 = 340 ms if constant (5.6%
    high), 300 + 40 * 5/11 = 318 ms spread per slot (1.2% low)."""
    at10 = _times(1, [60.0, 60.0], 10, residual=699.7 - 660.0, rest=0.0)
    obs = _observe([_times(0, [30.0, 30.0], 2), at10])
    got = decide(obs, PolicyConfig(min_steps=10))
    ev = got.evidence if not isinstance(got, Proposal) else got.explanation.evidence
    row = ev["pipeline"]["pipelines"][1]
    predicted = row["model_a_ms"] + row["residual_per_slot_ms"] * 1 + (row["c_ms"] + row["residual_per_slot_ms"]) * 4
    assert abs(predicted - 321.9) / 321.9 < 0.02
    assert abs(60.0 + 60.0 * 4 + 699.7 - 660.0 - 321.9) / 321.9 > 0.05  # a constant residual


def test_warming_up_until_every_pipeline_has_stage_times():
    obs = _observe([_times(0, [5.0] * 4, 8, steps=4), _times(1, [10.0] * 4, 8)])
    got = decide(obs, PolicyConfig(min_steps=10))
    assert isinstance(got, NoProposal) and got.status == "warming_up"
    assert got.detail == "warming up: 6 more steps with stage times needed on pipeline 0"


def test_balanced_pipelines_get_no_proposal():
    obs = _observe([_times(0, [5.0] * 4, 8), _times(1, [5.0] * 4, 8)])
    got = decide(obs, PolicyConfig(min_steps=10))
    assert isinstance(got, NoProposal) and got.status == "balanced"


def test_the_observation_pickles_compactly_to_the_policy_process():
    obs = _observe([_times(0, [5.0] * 4, 8), _times(1, [10.0] * 4, 8)])
    assert pickle.loads(pickle.dumps(obs)) == obs


def test_split_layers_minimises_the_largest_stage():
    assert split_layers([3, 3, 3, 3, 3, 3, 3, 9], 4) == (3, 3, 1, 1)
    assert split_layers([1, 1, 1, 1, 4], 2) == (4, 1)
    assert split_layers([1.0] * 8, 4) == (2, 2, 2, 2)
    assert split_layers([5, 1, 1, 1], 4) == (1, 1, 1, 1)
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 stages"):
        split_layers([1, 1, 1], 4)


NAMES = ("tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "output")


def test_a_heavy_last_stage_in_every_pipeline_gets_a_new_layer_split():
    """PP4, 2 layers a stage, 8 micro-batches; the output layer costs 9 ms, the others 3:
    stages [6, 6, 6, 12], T = 30 + 7*12 = 114 ms (+2 ms of optimizer). Split (3, 3, 1, 1):
    stages [9, 9, 3, 9], T = 30 + 7*9 = 93 ms: 95 vs 116, 18.1% faster."""
    layer_ms = (3.0,) * 7 + (9.0,)
    pipes = [_times(0, [6.0, 6.0, 6.0, 12.0], 8, layer_ms=layer_ms),
             _times(1, [6.6, 6.6, 6.6, 13.2], 8, layer_ms=tuple(x * 1.1 for x in layer_ms))]
    po = _observe(pipes, layers=(2, 2, 2, 2), names=NAMES).pipeline
    assert po is not None
    advice, note = stage_split_advice(po)
    assert advice is not None, note
    assert advice.bottleneck_stage == 3 and advice.source == "layer_ms"
    assert advice.layers_per_stage == (3, 3, 1, 1)
    assert advice.module_names_per_stage == (("tok_embeddings", "layers.0", "layers.1"),
                                             ("layers.2", "layers.3", "layers.4"), ("layers.5",), ("output",))
    # the slower pipeline (x1.1) sets the step: 30*1.1 + 7*13.2 + 2 before, 30*1.1 + 7*9.9 + 2 after
    assert advice.step_ms_before == pytest.approx(33.0 + 92.4 + 2.0)
    assert advice.step_ms_after == pytest.approx(33.0 + 69.3 + 2.0)
    assert advice.gain == pytest.approx(1 - 104.3 / 127.4)
    assert advice.stage_ms_after == pytest.approx((9.45, 9.45, 3.15, 9.45))
    assert "layers [2, 2, 2, 2] -> [3, 3, 1, 1] per stage" in note


def test_stage_times_alone_spread_over_a_stages_layers():
    """Without layer_ms a stage's time is spread evenly over its layers: [6, 6, 6, 12] with
    2 layers each is [3]*6 + [6, 6]: the best max is 9 (3+3+3 | 3+3 | 3+6 | 6), so
    (3, 2, 2, 1), stages [9, 6, 9, 6]. Replayed in 1F1B's order the third stage never idles:
    5 ms to reach it (forwards of 3 and 2), 8 x 9, 10 ms back (backwards of 4 and 6) = 87 ms,
    where T(m) = 30 + 7*9 = 93 would overstate it."""
    po = _observe([_times(0, [6.0, 6.0, 6.0, 12.0], 8)], layers=(2, 2, 2, 2)).pipeline
    assert po is not None
    advice, _ = stage_split_advice(po)
    assert advice is not None and advice.source == "stage_ms" and advice.module_names_per_stage == ()
    assert max(advice.stage_ms_after) == pytest.approx(9.0)
    assert advice.step_ms_after == pytest.approx(87.0 + 2.0) and advice.step_ms_before == pytest.approx(116.0)


@pytest.mark.parametrize(("pipes", "layers", "schedule", "note"), [
    ([_times(0, [6.0, 12.0], 8), _times(1, [12.0, 6.0], 8)], (2, 2), "1f1b",
     "no one stage bounds every pipeline (stages 0, 1 do): the micro-batch split over pipelines is the remedy"),
    ([_times(0, [6.0, 12.0], 8)], (), "1f1b",
     "stage 1 bounds every pipeline; say 'pipeline.layers_per_stage' in the hello (RebalanceHook) to get a "
     "layer split"),
    ([_times(0, [10.0, 10.5], 8)], (2, 2), "1f1b",
     "stage 1 bounds every pipeline, but the best layer split ([2, 2]) gains 0.0%, below 5%"),
])
def test_no_advice_says_why(pipes: list[PipelineTimes], layers: tuple[int, ...], schedule: str, note: str):
    po = _observe(pipes, layers=layers, schedule=schedule).pipeline
    assert po is not None
    assert stage_split_advice(po) == (None, note)


def test_the_assessment_names_the_bottleneck_the_slowest_pipeline_and_the_bubble():
    pipes = [_times(0, [5.0, 5.0, 5.0, 8.0], 8), _times(1, [10.0, 10.0, 10.0, 16.0], 4)]
    a = assess(_observe(pipes).pipeline)  # type: ignore[arg-type]
    assert a.bottleneck_stage == 3 and a.slowest_pipeline == 1
    row = a.rows[1]
    assert row is not None and row.compute_ms == pytest.approx(46.0 + 3 * 16.0)
    # measured bubble: the stages' mean idle over the run, the model's at m = 4
    assert row.bubble_share == pytest.approx(1 - 4 * 11.5 / 94.0)
    assert row.model_bubble_share == pytest.approx(row.bubble_share)
    assert a.bubble_share == pytest.approx((a.rows[0].bubble_share + row.bubble_share) / 2)  # type: ignore[union-attr]


def test_a_pipelined_job_whose_hooks_send_no_stage_times_is_split_by_its_measured_runs():
    """No stage lists (an older hook): the configured strategy fits each pipeline's run
    against its micro-batch count, and the schedule's floor still holds."""
    obs = _observe([_times(0, [5.0] * 4, 8), _times(1, [10.0] * 4, 8)], floor=6)
    po = obs.pipeline
    assert po is not None
    blind = dataclasses.replace(obs, pipeline=dataclasses.replace(po, pipelines=(None, None)))
    got = decide(blind, PolicyConfig(strategy="profiled", min_steps=10))
    assert isinstance(got, Proposal) and got.explanation.strategy == "profiled"
    assert got.shares == (10, 6)  # (11, 5) by speed, held at the floor of 6


def test_1f1b_replay_predicts_a_heavy_upstream_stage_from_the_bench_s_measured_times():
    """One run of bench.pipeline --part advice (its numbers copied here): a 2-stage 1F1B
    pipeline of 6 micro-batches measured stages of 22.0 / 58.7 ms per micro-batch (a third
    forward) on split 2,2, 393 ms a step; on the advised 3,1 the stages are 51.3 / 29.3 ms
    and the step measured 327 ms, 0.832 of before. T(m) rates the new split 0.902 of before:
    with only 2 forwards in flight the heavy first stage waits a round trip for its first
    backward, but then never idles, which the op-by-op replay sees (0.856)."""
    before, after = [21.99, 58.67], [51.32, 29.34]

    def replay(stage: list[float]) -> float:
        return replay_ms([t / 3 for t in stage], [2 * t / 3 for t in stage], 6, "1f1b")

    measured = 327.2 / 393.1
    assert replay(before) == pytest.approx(schedule_ms(before, 6))  # the last stage bounds it: T(m) is exact
    assert abs(replay(after) / replay(before) - measured) / measured < 0.05
    assert abs(schedule_ms(after, 6) / schedule_ms(before, 6) - measured) / measured > 0.05
    # GPipe runs every forward first: the same replay, another order.
    assert replay_ms([1.0, 1.0], [2.0, 2.0], 4, "gpipe") == pytest.approx(schedule_ms([3.0, 3.0], 4))
