"""``GET /api/v1/jobs/{job}/pipeline``: a pipelined job's shape, its grid of stages x
pipelines, the bottleneck stage, the bubble share, the slowest pipeline and stage-split
advice (viewer role; docs/pipelines.md). The job view carries the brief (``PipelineBrief``).

The figures are live state's (``LiveState.pipelines``), assessed by the one rule in
``backend.policy.pipeline_advice.assess``, in the one JSON shape of
``backend.live.pipeline.pipeline_view``, which these models validate."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response
from pydantic import BaseModel, Field

from backend.api.deps import PartsDep, ViewerDep
from backend.api.forwarding import from_owner
from backend.live.pipeline import PipelineBook, pipeline_view

__all__ = ["router", "PipelineBrief", "PipelinePublic", "PipelineRowPublic", "StageCellPublic",
           "StageSplitAdvicePublic", "PipelinePredictionPublic", "PredictionCheckPublic", "pipeline_brief"]

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])


class PipelineBrief(BaseModel):
    """A pipelined job's shape and what bounds it (the job view's ``pipeline``)."""

    pp_size: int = Field(description="Pipeline ranks (stages on ranks) per pipeline.")
    pp_stage: int = Field(default=0, description="The stage of the rank that speaks for each pipeline (its leader's).")
    tp_size: int = 1
    schedule: str = Field(description="gpipe, 1f1b or interleaved1f1b.")
    n_stages: int = Field(description="Model stages over a pipeline (pp_size x stages per rank).")
    stages_per_rank: int = 1
    min_microbatches: int = Field(description="The fewest micro-batches a pipeline may run (0: it may be drained).")
    layers_per_stage: list[int] = Field(default_factory=list, description="Layers per model stage, as the hooks said.")
    label: str = Field(description="How people read it, e.g. 'PP 4, 1f1b'.")
    pipelines: int = Field(description="Data-parallel pipelines: the job's world_size; shares count micro-batches per pipeline.")
    bottleneck_stage: int | None = Field(default=None, description="The stage slowest per micro-batch in every measured pipeline; null when they differ.")
    slowest_pipeline: int | None = Field(default=None, description="The pipeline (dp index) with the longest measured schedule run.")
    bubble_share: float | None = Field(default=None, description="Mean over pipelines of the stages' idle share of the run, 0..1.")
    bubble_ms: float | None = Field(default=None, description="Mean over pipelines of their idle time a step (each the mean of its stages').")
    advice_gain: float | None = Field(default=None, description="The stage-split advice's predicted step gain; null without advice.")
    advice_note: str = Field(default="", description="What the advice says, or why there is none.")


class StageCellPublic(BaseModel):
    """One cell of the grid: a stage of a pipeline, means over its newest steps."""

    stage: int
    stage_ms: float = Field(description="fwd_ms + bwd_ms: the stage's time per micro-batch.")
    fwd_ms: float
    bwd_ms: float
    send_wait_ms: float = Field(description="Per step.")
    recv_wait_ms: float = Field(description="Per step.")
    bubble_ms: float = Field(description="Per step: the stage's idle time.")


class PipelineRowPublic(BaseModel):
    pipeline: int = Field(description="The dp index: the pipeline's rank in placements.")
    n_microbatches: int | None = None
    compute_ms: float | None = Field(default=None, description="The schedule's run, measured.")
    model_ms: float | None = Field(default=None, description="The model's run at this count: sum(t) + (m-1) max(t); interleaved, v stages per rank: sum(t)/v + (m - 1/v) max(t) (docs/pipelines.md).")
    bubble_share: float | None = Field(default=None, description="Measured: the stages' mean idle time over the run.")
    model_bubble_share: float | None = Field(default=None, description="The model's at this count ((p-1)/(m+p-1) for equal stages).")
    bottleneck_stage: int | None = None
    stages: list[StageCellPublic] = Field(default_factory=list, description="Empty until it sends stage times.")


class StageSplitAdvicePublic(BaseModel):
    bottleneck_stage: int
    current_layers_per_stage: list[int]
    layers_per_stage: list[int] = Field(description="The proposed layer count of each stage.")
    module_names_per_stage: list[list[str]] = Field(
        default_factory=list, description="torchtitan's module names per stage, when the hooks named the layers.")
    stage_ms_before: list[float]
    stage_ms_after: list[float]
    step_ms_before: float
    step_ms_after: float
    gain: float = Field(description="(before - after) / before.")
    source: str = Field(description="layer_ms (measured per layer) or stage_ms (a stage's time spread over its layers).")


class PipelinePredictionPublic(BaseModel):
    """One pipeline's line of a prediction check: its schedule run at the placement's count."""

    pipeline: int = Field(description="The dp index.")
    n_microbatches: int = Field(description="Its micro-batches under the placement.")
    predicted_ms: float | None = Field(description="The stage model's run (a + c*m); null: no stage times when predicted.")
    measured_ms: float | None = Field(description="The measured run at that count over the effect window; null until measured.")
    error: float | None = Field(description="measured_ms / predicted_ms - 1.")


class PredictionCheckPublic(BaseModel):
    """A pipelined job's placement: the stage model's predicted step, made when the placement
    was, and the step measured once it settled (``backend.policy.pipeline_check``)."""

    predicted_step_ms: float | None = Field(description="The slowest pipeline's predicted run plus rest_ms.")
    measured_step_ms: float | None = Field(description="The mean step over the effect window after the settle steps; null until measured.")
    error: float | None = Field(description="measured_step_ms / predicted_step_ms - 1.")
    rest_ms: float = Field(description="What a step holds beyond the slowest pipeline's run (data wait, optimizer, exposed communication), measured when predicted.")
    tolerance: float = Field(description="A miss beyond it (relative) is flagged.")
    missed: bool = Field(description="The step or a pipeline's run missed by more than the tolerance (audited as placement.prediction_missed).")
    note: str = Field(description="What the check found, and what the policy does about a miss.")
    pipelines: list[PipelinePredictionPublic]


class PipelinePublic(PipelineBrief):
    """The brief, the grid (one row per pipeline, one cell per stage), the advice and the
    placement in force's prediction check."""

    rows: list[PipelineRowPublic]
    advice: StageSplitAdvicePublic | None = None
    prediction: PredictionCheckPublic | None = Field(
        default=None, description="The placement in force's stage-model prediction and, once it settled, the "
                                  "measured step beside it; null before any placement was made with stage times.")


def pipeline_brief(book: PipelineBook, job: str) -> PipelineBrief | None:
    """The job view's ``pipeline``; None for a job without pipelines."""
    view = pipeline_view(book, job)
    if view is None:
        return None
    return PipelineBrief(**{k: v for k, v in view.items() if k in PipelineBrief.model_fields})


@router.get("/{job}/pipeline", response_model=PipelinePublic, summary="A pipelined job's stages x pipelines")
async def get_pipeline(job: str, _actor: ViewerDep, parts: PartsDep, request: Request) -> PipelinePublic | Response:
    """The grid of stages x pipelines with each cell's time, the bottleneck stage, the bubble
    share, the slowest pipeline and stage-split advice (live jobs; from the job's owner with
    several replicas). 404 for an unknown job or one whose hooks said no pipeline."""
    if (owners := await from_owner(request, parts, job)) is not None:
        return owners
    view = pipeline_view(parts.live.pipelines, job, parts.controller.job_control(job).get("pipeline_prediction"))
    if view is None:
        if job in parts.live:
            raise HTTPException(404, f"Job '{job}' is not pipelined: its hooks said no pipeline.")
        raise HTTPException(404, f"Job '{job}' not found.")
    return PipelinePublic(**view)
