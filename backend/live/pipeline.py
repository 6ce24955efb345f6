"""Pipelined jobs in live state (docs/pipelines.md): each job's pipeline shape, as its
pipeline leaders' hellos said it, and each pipeline's newest per-stage step times.

Owned by ``LiveState`` (its ``pipelines``), which feeds it from the ingest path under its
own lock; this book has a lock of its own and never takes the live state's. Readers get
the policy's ``PipelineObservation`` (``observation``), the figures a ``/ranks`` row
carries (``rank_fields``) and the assessment every view shows (``assessment``: grid,
bottleneck stage, bubble share, slowest pipeline, stage-split advice; one rule, in
``backend.policy.pipeline.assess``)."""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, TypedDict

from backend.policy.pipeline import PipelineObservation, PipelineTimes
from backend.policy.pipeline_advice import PipelineAssessment, PipelineRow, StageSplitAdvice, assess
from rebalancer_wire.protocol import Hello, Metrics, PipelineShape, StepRecord

__all__ = ["PipelineBook", "RankFields", "STAGE_STEPS", "pipeline_view", "same_pipeline", "pipeline_conflict"]

STAGE_STEPS = 256  # steps with stage times kept per pipeline: more than a policy window

# One step's stage lists: (batch_index, n_microbatches, fwd, bwd, send, recv, bubble, compute_ms,
# step_ms, bubble_ms)
_Row = tuple[int, int, tuple[float, ...], tuple[float, ...], tuple[float, ...], tuple[float, ...],
             tuple[float, ...], float, float, float | None]


@dataclass(slots=True)
class _Pipeline:
    rows: deque[_Row] = field(default_factory=lambda: deque(maxlen=STAGE_STEPS))
    layer_ms: tuple[float, ...] = ()  # the newest a record carried
    bubbles: deque[float] = field(default_factory=lambda: deque(maxlen=STAGE_STEPS))  # bubble_ms per step


@dataclass(slots=True)
class _Job:
    shape: PipelineShape
    world_size: int
    pipelines: dict[int, _Pipeline] = field(default_factory=dict)
    speakers: dict[int, int] = field(default_factory=dict)  # dp index -> the stage of the rank that speaks for it


class RankFields(TypedDict, total=False):
    """What a ``/ranks`` row of a pipelined job adds (``PipelineBook.rank_fields``)."""

    pp_stage: int
    pp_size: int
    bubble_ms: float | None
    bottleneck_stage: int | None


def _zeros(n: int) -> tuple[float, ...]:
    return (0.0,) * n


def _row(s: StepRecord, p: int) -> _Row | None:
    if s.stage_fwd_ms is None or s.stage_bwd_ms is None:
        return None
    m = s.n_microbatches if s.n_microbatches is not None else s.local_batch_size
    return (s.batch_index, m, s.stage_fwd_ms, s.stage_bwd_ms, s.stage_send_wait_ms or _zeros(p),
            s.stage_recv_wait_ms or _zeros(p), s.stage_bubble_ms or _zeros(p), s.compute_ms, s.step_ms,
            s.bubble_ms)


def _mean_cols(rows: list[_Row], i: int) -> tuple[float, ...]:
    cols = zip(*(r[i] for r in rows), strict=True)
    return tuple(sum(c) / len(rows) for c in cols)


class PipelineBook:
    """Pipeline shapes and stage times of the live pipelined jobs."""

    def __init__(self, window_steps: int = 20) -> None:
        self.window_steps = window_steps
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}

    # --- writes (LiveState) ----------------------------------------------------------------

    def register(self, hello: Hello, new_run: bool) -> None:
        """A hello: the job's shape is the newest a leader said (its leaders say one; the
        ingest refuses another); a new run or another shape starts the book afresh."""
        with self._lock:
            old = self._jobs.get(hello.job)
            if hello.pipeline is None:
                if old is not None and new_run:
                    del self._jobs[hello.job]
                return
            if old is None or new_run or not same_pipeline(old.shape, hello.pipeline):
                old = self._jobs[hello.job] = _Job(hello.pipeline, hello.world_size)
            else:
                old.shape = hello.pipeline
            old.speakers[hello.rank] = hello.pipeline.pp_stage

    def add(self, msg: Metrics, hello: Hello) -> None:
        """A pipeline leader's records (others are ignored: one test per message)."""
        if hello.pipeline is None or not msg.steps:
            return
        with self._lock:
            j = self._jobs.get(msg.job)
            if j is None:
                return
            pipe = j.pipelines.get(msg.rank)
            if pipe is None:
                pipe = j.pipelines[msg.rank] = _Pipeline()
            p = j.shape.pp_size
            for s in msg.steps:
                row = _row(s, p)
                if row is not None:
                    pipe.rows.append(row)
                if s.bubble_ms is not None:
                    pipe.bubbles.append(s.bubble_ms)
                elif s.stage_bubble_ms is not None:
                    pipe.bubbles.append(sum(s.stage_bubble_ms) / len(s.stage_bubble_ms))
                if s.layer_ms is not None:
                    pipe.layer_ms = s.layer_ms

    def forget(self, job: str) -> None:
        with self._lock:
            self._jobs.pop(job, None)

    # --- reads -----------------------------------------------------------------------------

    def shape(self, job: str) -> PipelineShape | None:
        with self._lock:
            j = self._jobs.get(job)
            return j.shape if j is not None else None

    def rank_fields(self, job: str, rank: int) -> RankFields:
        """What a ``/ranks`` row of a pipelined job adds: the stage of the rank that speaks
        for it, the stage count, the window's mean bubble and its slowest stage; {} for a
        job without pipelines."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return {}
            pipe = j.pipelines.get(rank)
            bubbles = list(islice(reversed(pipe.bubbles), self.window_steps)) if pipe else []
            rows = list(islice(reversed(pipe.rows), self.window_steps)) if pipe else []
            shape, speaker = j.shape, j.speakers.get(rank, j.shape.pp_stage)
        neck = None
        if rows:
            stage = [f + b for f, b in zip(_mean_cols(rows, 2), _mean_cols(rows, 3), strict=True)]
            neck = stage.index(max(stage))
        return {"pp_stage": speaker, "pp_size": shape.pp_size,
                "bubble_ms": sum(bubbles) / len(bubbles) if bubbles else None, "bottleneck_stage": neck}

    def observation(self, job: str, n: int | None = None, *,
                    batches: tuple[int, int] | None = None) -> PipelineObservation | None:
        """The policy's view of the job: per pipeline the means of its newest ``n`` (default
        ``window_steps``) steps run at the micro-batch count in force, or of its steps with
        batch indices in ``batches`` (lo, hi; a placement's effect window) at the newest
        count among them; None for a job without pipelines."""
        n = self.window_steps if n is None else n
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return None
            shape, world = j.shape, j.world_size
            if batches is None:
                taken = {i: (list(islice(reversed(p.rows), n)), p.layer_ms) for i, p in j.pipelines.items()}
            else:
                lo, hi = batches
                taken = {i: ([r for r in reversed(p.rows) if lo <= r[0] <= hi], p.layer_ms)
                         for i, p in j.pipelines.items()}
        pipes: list[PipelineTimes | None] = []
        for i in range(world):
            rows, layer_ms = taken.get(i, ([], ()))
            pipes.append(_times(i, rows, layer_ms) if rows else None)
        return PipelineObservation(
            schedule=shape.schedule, pp_size=shape.pp_size, stages_per_rank=shape.stages_per_rank,
            tp_size=shape.tp_size, min_microbatches=shape.min_microbatches, pipelines=tuple(pipes),
            layers_per_stage=shape.layers_per_stage, layer_names=shape.layer_names)

    def assessment(self, job: str) -> PipelineAssessment | None:
        po = self.observation(job)
        return assess(po) if po is not None else None


def pipeline_view(book: PipelineBook, job: str, prediction: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The one JSON shape of a pipelined job's assessment (REST ``/pipeline`` and the job
    view's brief validate it; the end-of-run report carries it): the shape, the grid of
    stages x pipelines, bottleneck, bubble share, slowest pipeline, advice, and
    ``prediction``, the placement in force's stage-model prediction and its check (the
    controller's; ``policy.pipeline_check``). None without pipelines."""
    shape, a = book.shape(job), book.assessment(job)
    if shape is None or a is None:
        return None
    return {"pp_size": shape.pp_size, "pp_stage": shape.pp_stage, "tp_size": shape.tp_size,
            "schedule": shape.schedule, "n_stages": shape.n_stages, "stages_per_rank": shape.stages_per_rank,
            "min_microbatches": shape.min_microbatches, "layers_per_stage": list(shape.layers_per_stage),
            "label": shape.label, "pipelines": len(a.rows), "bottleneck_stage": a.bottleneck_stage,
            "slowest_pipeline": a.slowest_pipeline, "bubble_share": a.bubble_share,
            "bubble_ms": _mean_bubble_ms(a.rows),
            "advice_gain": a.advice.gain if a.advice is not None else None, "advice_note": a.advice_note,
            "rows": [_row_view(i, r) for i, r in enumerate(a.rows)], "advice": _advice_view(a.advice),
            "prediction": prediction}


def _mean_bubble_ms(rows: tuple[PipelineRow | None, ...]) -> float | None:
    """The pipelines' mean idle time a step (each the mean of its stages')."""
    per = [sum(r.stage_bubble_ms) / len(r.stage_bubble_ms) for r in rows if r is not None and r.stage_bubble_ms]
    return sum(per) / len(per) if per else None


def _row_view(i: int, r: PipelineRow | None) -> dict[str, Any]:
    if r is None:
        return {"pipeline": i, "stages": []}
    cells = [{"stage": s, "stage_ms": r.stage_ms[s], "fwd_ms": r.fwd_ms[s], "bwd_ms": r.bwd_ms[s],
              "send_wait_ms": r.send_wait_ms[s], "recv_wait_ms": r.recv_wait_ms[s], "bubble_ms": r.stage_bubble_ms[s]}
             for s in range(len(r.stage_ms))]
    return {"pipeline": i, "n_microbatches": r.n_microbatches, "compute_ms": r.compute_ms, "model_ms": r.model_ms,
            "bubble_share": r.bubble_share, "model_bubble_share": r.model_bubble_share,
            "bottleneck_stage": r.bottleneck_stage, "stages": cells}


def _advice_view(a: StageSplitAdvice | None) -> dict[str, Any] | None:
    if a is None:
        return None
    return {"bottleneck_stage": a.bottleneck_stage, "current_layers_per_stage": list(a.current_layers_per_stage),
            "layers_per_stage": list(a.layers_per_stage),
            "module_names_per_stage": [list(g) for g in a.module_names_per_stage],
            "stage_ms_before": list(a.stage_ms_before), "stage_ms_after": list(a.stage_ms_after),
            "step_ms_before": a.step_ms_before, "step_ms_after": a.step_ms_after, "gain": a.gain, "source": a.source}


def same_pipeline(a: PipelineShape | None, b: PipelineShape | None) -> bool:
    """Two leaders' shapes agree but for who speaks (its stage and dp index)."""
    if a is None or b is None:
        return a is b
    return (a.pp_size, a.tp_size, a.schedule, a.n_stages, a.min_microbatches, a.layers_per_stage, a.layer_names) == \
        (b.pp_size, b.tp_size, b.schedule, b.n_stages, b.min_microbatches, b.layers_per_stage, b.layer_names)


def _words(p: PipelineShape | None) -> str:
    if p is None:
        return "no pipeline"
    layers = f", layers {list(p.layers_per_stage)}" if p.layers_per_stage else ""
    return f"pipeline {p.label}, at least {p.min_microbatches} micro-batches{layers}"


def pipeline_conflict(hello: Hello, live: PipelineShape | None, others: int) -> str:
    """Why a hello whose pipeline differs from the connected leaders' is refused (4409)."""
    return (f"Job '{hello.job}' runs as {_words(live)} on {others} connected pipeline leader"
            f"{'s' if others != 1 else ''}; this hello says {_words(hello.pipeline)}. Every pipeline leader "
            f"of one job must say the same pipeline shape, or use another job name.")


def _times(i: int, newest_first: list[_Row], layer_ms: tuple[float, ...]) -> PipelineTimes | None:
    """Means over the newest rows at the newest row's micro-batch count (a placement change
    inside the window would mix two counts' compute)."""
    m = newest_first[0][1]
    rows = [r for r in newest_first if r[1] == m][::-1]
    stage_per_step = [max(f + b for f, b in zip(r[2], r[3], strict=True)) for r in rows]
    mean = sum(stage_per_step) / len(rows)
    rel = 0.0
    if len(rows) >= 2 and mean > 0:
        var = sum((x - mean) ** 2 for x in stage_per_step) / (len(rows) - 1)
        rel = math.sqrt(var / len(rows)) / mean
    return PipelineTimes(
        dp_index=i, n_steps=len(rows), n_microbatches=m, fwd_ms=_mean_cols(rows, 2), bwd_ms=_mean_cols(rows, 3),
        send_wait_ms=_mean_cols(rows, 4), recv_wait_ms=_mean_cols(rows, 5), bubble_ms=_mean_cols(rows, 6),
        compute_ms=sum(r[7] for r in rows) / len(rows), step_ms=sum(r[8] for r in rows) / len(rows),
        rel_noise=rel, layer_ms=layer_ms)
