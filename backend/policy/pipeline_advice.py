"""What a pipelined job's views show (the grid of stages x pipelines, the bottleneck
stage, the bubble share, the slowest pipeline) and stage-split advice: when one stage is
the bottleneck in every pipeline, a new contiguous layer split from the measured per-layer
(or per-stage) times, with its predicted step (docs/pipelines.md). Pure: data in, data out.

The advice's model: a layer costs the same wherever it runs within a pipeline (the stages
of a pipeline run on like devices); the split is one for every pipeline, chosen on the
pipelines' mean layer costs; each pipeline keeps its micro-batch count and its measured
residual (``backend.policy.pipeline``), and the step is the slowest pipeline's run plus the
rest of its step (data wait, optimizer)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .pipeline import PipelineObservation, PipelineTimes, bubble_share, replay_ms, schedule_ms

__all__ = ["ADVICE_MIN_GAIN", "PipelineRow", "PipelineAssessment", "StageSplitAdvice", "assess", "split_layers",
           "stage_split_advice"]

ADVICE_MIN_GAIN = 0.05  # advise a new layer split only when it gains at least this much


@dataclass(frozen=True, slots=True)
class PipelineRow:
    """One pipeline in the grid: its stages' times and what bounds it."""

    dp_index: int
    n_microbatches: int
    stage_ms: tuple[float, ...]  # per micro-batch (fwd + bwd)
    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    send_wait_ms: tuple[float, ...]
    recv_wait_ms: tuple[float, ...]
    stage_bubble_ms: tuple[float, ...]
    bottleneck_stage: int
    compute_ms: float  # measured
    model_ms: float  # T(m) of the model, without the residual
    bubble_share: float | None  # measured: mean stage idle / measured compute
    model_bubble_share: float | None  # the model's at this count


@dataclass(frozen=True, slots=True)
class StageSplitAdvice:
    """A new layer split when one stage bounds every pipeline (docs/pipelines.md)."""

    bottleneck_stage: int
    current_layers_per_stage: tuple[int, ...]
    layers_per_stage: tuple[int, ...]
    module_names_per_stage: tuple[tuple[str, ...], ...]  # empty without layer names
    stage_ms_before: tuple[float, ...]  # mean over pipelines, per micro-batch
    stage_ms_after: tuple[float, ...]
    step_ms_before: float
    step_ms_after: float
    gain: float
    source: str  # "layer_ms" (measured per layer) or "stage_ms" (a stage's time spread over its layers)


@dataclass(frozen=True, slots=True)
class PipelineAssessment:
    """What the job page, REST, /metrics and the report show of a pipelined job."""

    schedule: str
    pp_size: int
    stages_per_rank: int
    tp_size: int
    min_microbatches: int
    rows: tuple[PipelineRow | None, ...]  # by dp index
    bottleneck_stage: int | None  # the stage that bounds every measured pipeline, if one does
    slowest_pipeline: int | None  # the pipeline with the longest measured compute
    bubble_share: float | None  # mean over measured pipelines
    advice: StageSplitAdvice | None
    advice_note: str  # why there is no advice, or what the advice says


def assess(po: PipelineObservation, min_gain: float = ADVICE_MIN_GAIN) -> PipelineAssessment:
    """The grid (stages x pipelines), the bottleneck stage, bubble share, slowest pipeline
    and stage-split advice of a pipelined job."""
    v = po.stages_per_rank
    rows: list[PipelineRow | None] = []
    for t in po.pipelines:
        if t is None:
            rows.append(None)
            continue
        stage = t.stage_ms
        m = t.n_microbatches
        idle = sum(t.bubble_ms) / len(t.bubble_ms) if t.bubble_ms else None
        rows.append(PipelineRow(
            dp_index=t.dp_index, n_microbatches=m, stage_ms=stage, fwd_ms=t.fwd_ms, bwd_ms=t.bwd_ms,
            send_wait_ms=t.send_wait_ms, recv_wait_ms=t.recv_wait_ms, stage_bubble_ms=t.bubble_ms,
            bottleneck_stage=stage.index(max(stage)), compute_ms=t.compute_ms,
            model_ms=schedule_ms(stage, m, v),
            bubble_share=min(1.0, idle / t.compute_ms) if idle is not None and t.compute_ms > 0 else None,
            model_bubble_share=bubble_share(stage, m, v)))
    measured = [r for r in rows if r is not None]
    necks = {r.bottleneck_stage for r in measured}
    neck = next(iter(necks)) if len(necks) == 1 else None
    slowest = max(measured, key=lambda r: r.compute_ms).dp_index if measured else None
    shares = [r.bubble_share if r.bubble_share is not None else r.model_bubble_share for r in measured]
    known = [s for s in shares if s is not None]
    advice, note = stage_split_advice(po, min_gain) if measured else (None, "no stage times measured yet")
    return PipelineAssessment(po.schedule, po.pp_size, v, po.tp_size, po.min_microbatches, tuple(rows), neck,
                              slowest, sum(known) / len(known) if known else None, advice, note)


# --- stage-split advice -------------------------------------------------------------------

def split_layers(costs: Sequence[float], parts: int) -> tuple[int, ...]:
    """Layer counts of ``parts`` contiguous stages, each at least one layer, minimising the
    largest stage's summed cost (binary search on that cost; exact to 1e-9 of it).

    >>> split_layers([1, 1, 1, 1, 4], 2)
    (4, 1)
    """
    n = len(costs)
    if parts < 1 or n < parts:
        raise ValueError(f"cannot split {n} layers into {parts} stages of at least one layer each.")

    def cut(limit: float) -> list[int] | None:
        counts: list[int] = []
        acc, k = 0.0, 0
        for i, w in enumerate(costs):
            # Leave at least one layer for each stage still to come.
            if k and (acc + w > limit or n - i < parts - len(counts)):
                counts.append(k)
                acc, k = 0.0, 0
            acc += w
            k += 1
        counts.append(k)
        return counts if len(counts) <= parts else None

    lo, hi = max(costs), float(sum(costs))
    for _ in range(100):
        if hi - lo <= 1e-9 * max(hi, 1e-12):
            break
        mid = (lo + hi) / 2
        if cut(mid) is None:
            lo = mid
        else:
            hi = mid
    counts = cut(hi) or [n - parts + 1] + [1] * (parts - 1)
    while len(counts) < parts:  # fewer stages than asked: split the largest (never raises the max)
        i = max(range(len(counts)), key=lambda j: counts[j])
        counts[i:i + 1] = [counts[i] - counts[i] // 2, counts[i] // 2]
    return tuple(counts)


def _layer_costs(t: PipelineTimes, layers: Sequence[int]) -> tuple[list[float], str]:
    """Per-layer cost of one pipeline: its measured layer times scaled so that each stage's
    sum is the stage's measured time, or the stage's time spread evenly over its layers."""
    out: list[float] = []
    source = "layer_ms" if len(t.layer_ms) == sum(layers) else "stage_ms"
    at = 0
    for s, k in enumerate(layers):
        stage = t.stage_ms[s]
        if k == 0:
            continue
        if source == "layer_ms":
            mine = t.layer_ms[at:at + k]
            total = sum(mine)
            out.extend(w * stage / total if total > 0 else stage / k for w in mine)
        else:
            out.extend([stage / k] * k)
        at += k
    return out, source


def _run_ms(fwd: Sequence[float], total: Sequence[float], m: int, schedule: str) -> float:
    """A pipeline's run: replayed op by op for gpipe and 1f1b, else ``T(m)``."""
    if schedule in ("gpipe", "1f1b"):
        return replay_ms(fwd, [max(0.0, a - f) for f, a in zip(fwd, total, strict=True)], m, schedule)
    return schedule_ms(total, m)


def stage_split_advice(po: PipelineObservation, min_gain: float = ADVICE_MIN_GAIN) -> tuple[StageSplitAdvice | None, str]:
    """(advice, note): a new layer split when one stage is the bottleneck in every pipeline
    and moving layers gains at least ``min_gain`` of the step; else None and why not."""
    measured = [t for t in po.pipelines if t is not None]
    if not measured:
        return None, "no stage times measured yet"
    necks = {t.stage_ms.index(max(t.stage_ms)) for t in measured}
    if len(necks) > 1:
        return None, (f"no one stage bounds every pipeline (stages {', '.join(map(str, sorted(necks)))} do): "
                      f"the micro-batch split over pipelines is the remedy")
    neck = necks.pop()
    if po.stages_per_rank > 1:
        return None, (f"stage {neck} bounds every pipeline; stage-split advice covers gpipe and 1f1b "
                      f"(one model stage per rank), not {po.schedule}")
    layers = po.layers_per_stage
    if not layers:
        return None, (f"stage {neck} bounds every pipeline; say 'pipeline.layers_per_stage' in the hello "
                      f"(RebalanceHook) to get a layer split")
    if sum(layers) < po.pp_size:
        return None, f"stage {neck} bounds every pipeline, but {sum(layers)} layers cannot fill {po.pp_size} stages"
    per = [_layer_costs(t, layers) for t in measured]
    source = "layer_ms" if all(s == "layer_ms" for _, s in per) else "stage_ms"
    mean_cost = [sum(col) / len(col) for col in zip(*(c for c, _ in per), strict=True)]
    counts = split_layers(mean_cost, po.pp_size)

    def regroup(costs: Sequence[float], counts: Sequence[int], keep: Sequence[float]) -> list[float]:
        # A stage with no layers keeps its measured time (its embedding or loss, say).
        out, at = [], 0
        for s, k in enumerate(counts):
            out.append(sum(costs[at:at + k]) if k else keep[s])
            at += k
        return out

    rest = min(t.step_ms - t.compute_ms for t in measured)  # the slowest pipeline's data, optimizer, sync
    before_steps, after_steps, before_st, after_st = [], [], [], []
    for t, (costs, _) in zip(measured, per, strict=True):
        m = t.n_microbatches
        # Each layer keeps its stage's forward share of its time; the run is replayed in the
        # schedule's order (1F1B's warm-up makes a heavy upstream stage wait: replay_ms).
        fwd_share = [f / (f + b) if f + b > 0 else 0.5 for f, b in zip(t.fwd_ms, t.bwd_ms, strict=True)]
        share = [fwd_share[s] for s, k in enumerate(layers) for _ in range(k)]
        old = regroup(costs, layers, t.stage_ms)
        new = regroup(costs, counts, t.stage_ms)
        fwd_costs = [c * f for c, f in zip(costs, share, strict=True)]
        old_f, new_f = regroup(fwd_costs, layers, t.fwd_ms), regroup(fwd_costs, counts, t.fwd_ms)
        res = t.compute_ms - _run_ms(old_f, old, m, po.schedule) if m > 0 and t.compute_ms > 0 else 0.0
        before_steps.append(_run_ms(old_f, old, m, po.schedule) + res)
        after_steps.append(_run_ms(new_f, new, m, po.schedule) + res)
        before_st.append(old)
        after_st.append(new)
    before = max(before_steps) + max(rest, 0.0)
    after = max(after_steps) + max(rest, 0.0)
    gain = (before - after) / before if before > 0 else 0.0
    if counts == tuple(layers) or gain < min_gain:
        return None, (f"stage {neck} bounds every pipeline, but the best layer split "
                      f"({list(counts)}) gains {gain:.1%}, below {min_gain:.0%}")
    names: tuple[tuple[str, ...], ...] = ()
    if po.layer_names:
        at, groups = 0, []
        for k in counts:
            groups.append(tuple(po.layer_names[at:at + k]))
            at += k
        names = tuple(groups)
    mean_of = lambda rows: tuple(sum(col) / len(col) for col in zip(*rows, strict=True))  # noqa: E731
    advice = StageSplitAdvice(
        bottleneck_stage=neck, current_layers_per_stage=tuple(layers), layers_per_stage=counts,
        module_names_per_stage=names, stage_ms_before=mean_of(before_st), stage_ms_after=mean_of(after_st),
        step_ms_before=before, step_ms_after=after, gain=gain, source=source)
    return advice, (f"stage {neck} bounds every pipeline: layers {list(layers)} -> {list(counts)} per stage "
                    f"predict a step of {after:.1f} ms instead of {before:.1f} ms ({gain:.1%} faster); "
                    f"apply it by restarting from a checkpoint with the new split")
