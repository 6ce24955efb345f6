"""A pipelined job's predictions, checked (issue 40 item 3): what the stage model predicts
for a placement, per pipeline and for the job's step, and how far the step measured once the
placement settled is from it.

The prediction is made when a placement is minted (whatever proposed it: the policy, an
operator, a rollback), from the pipelines' times in force: each pipeline's run at its new
count is ``a + c*m`` (``pipeline.fitted_cost``: the stage model plus the pipeline's measured
residual, the rule the ``pipeline`` strategy splits by); a drained pipeline runs nothing.
The job's step is the slowest pipeline's run plus the rest of the step (data wait,
optimizer, exposed communication), which no split changes and which is measured: the
pipelines' step less the slowest one's run. Once the placement has run its effect window
past the settle steps, each pipeline's measured run at its new count and the job's measured
step go beside the predictions: ``error = measured / predicted - 1``, a miss beyond
``tolerance`` (10%) is flagged (``missed``) and said in one sentence (``note``).

What the policy does with a miss: its next decision reads each pipeline's times at the new
count only (``PipelineBook.observation``), so the residual the model leaves out is measured
afresh there and the next prediction is made with it (the re-fit); the controller audits a
miss (``placement.prediction_missed``) so that operators see it.

Pure: data in, data out (no I/O)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TypedDict

from .pipeline import fitted_cost
from .types import PipelineObservation

__all__ = ["PREDICTION_TOLERANCE", "PipelinePrediction", "PredictionRecord", "rest_of_step_ms", "predict",
           "check", "REFIT"]

PREDICTION_TOLERANCE = 0.10  # issue 40: predictions within 10% of the measured step

REFIT = ("the next decision fits each pipeline's residual at its new count from the steps "
         "measured since, so its predictions start from these")


class PipelinePrediction(TypedDict):
    """One pipeline's line of a check: its schedule run at the placement's count."""

    pipeline: int
    n_microbatches: int
    predicted_ms: float | None  # None: the pipeline had no stage times when predicted
    measured_ms: float | None  # None: not measured yet (or not at this count)
    error: float | None  # measured / predicted - 1


class PredictionRecord(TypedDict):
    """A placement's prediction and, once measured, its check (stored with the placement)."""

    predicted_step_ms: float | None  # the slowest pipeline's run plus the rest of the step
    measured_step_ms: float | None
    error: float | None
    rest_ms: float  # the part of a step no split changes, as measured when predicted
    tolerance: float
    missed: bool
    note: str
    pipelines: list[PipelinePrediction]


def rest_of_step_ms(po: PipelineObservation) -> float | None:
    """What a step holds beyond the slowest pipeline's schedule run (the pipelines' median
    step less that run; every pipeline waits for the slowest in the dp all-reduce)."""
    known = [t for t in po.pipelines if t is not None]
    if not known:
        return None
    return max(0.0, statistics.median(t.step_ms for t in known) - max(t.compute_ms for t in known))


def predict(po: PipelineObservation, shares: Sequence[int],
            tolerance: float = PREDICTION_TOLERANCE) -> PredictionRecord | None:
    """The model's prediction for ``shares`` (micro-batches per pipeline); None where no
    pipeline has stage times yet or the shares do not match the pipelines."""
    rest = rest_of_step_ms(po)
    if rest is None or len(shares) != len(po.pipelines):
        return None
    v = max(1, po.stages_per_rank)
    rows: list[PipelinePrediction] = []
    for i, (t, m) in enumerate(zip(po.pipelines, shares, strict=True)):
        pred: float | None = None
        if m <= 0:
            pred = 0.0
        elif t is not None:
            a, c, _ = fitted_cost(t, po.pp_size, v)
            pred = a + c * m
        rows.append({"pipeline": i, "n_microbatches": int(m), "predicted_ms": pred, "measured_ms": None,
                     "error": None})
    runs = [r["predicted_ms"] for r in rows if r["n_microbatches"] > 0]
    known = [x for x in runs if x is not None]
    step = max(known) + rest if known and len(known) == len(runs) else None  # a pipeline unmeasured: unknown
    return {"predicted_step_ms": step, "measured_step_ms": None, "error": None, "rest_ms": rest,
            "tolerance": tolerance, "missed": False, "note": "measured once the placement has run its effect window",
            "pipelines": rows}


def _error(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or predicted is None or predicted <= 0:
        return None
    return measured / predicted - 1.0


def check(record: PredictionRecord, measured: PipelineObservation | None,
          measured_step_ms: float | None) -> PredictionRecord:
    """``record`` with the measurements of the window after the placement: each pipeline's
    mean run at the placement's count (``measured``'s times; another count is no measure of
    this prediction) and the job's step; the errors, whether any misses, and why."""
    rows: list[PipelinePrediction] = []
    for r in record["pipelines"]:
        t = measured.pipelines[r["pipeline"]] if measured is not None and r["pipeline"] < len(measured.pipelines) \
            else None
        got = t.compute_ms if t is not None and t.n_microbatches == r["n_microbatches"] > 0 else None
        rows.append({**r, "measured_ms": got, "error": _error(got, r["predicted_ms"])})
    err = _error(measured_step_ms, record["predicted_step_ms"])
    tol = record["tolerance"]
    misses = [f"pipeline {r['pipeline']} ran {r['measured_ms']:.1f} ms at {r['n_microbatches']} micro-batches "
              f"against {r['predicted_ms']:.1f} predicted ({r['error']:+.0%})"
              for r in rows if r["error"] is not None and abs(r["error"]) > tol
              and r["measured_ms"] is not None and r["predicted_ms"] is not None]
    if err is not None and abs(err) > tol:
        misses.insert(0, f"the step took {measured_step_ms:.1f} ms against {record['predicted_step_ms']:.1f} "
                         f"predicted ({err:+.0%})")
    if misses:
        note = f"missed by more than {tol:.0%}: {'; '.join(misses)}; {REFIT}."
    elif err is None:
        note = "no measured step to check the prediction against"
    else:
        note = f"within {tol:.0%} ({err:+.1%} on the step)"
    return {**record, "measured_step_ms": measured_step_ms, "error": err, "missed": bool(misses), "note": note,
            "pipelines": rows}
