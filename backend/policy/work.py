"""Work units: with a per-sample cost, shares split each batch's work, not its samples.

The hook reports each step's ``work`` (the rank's summed cost, tokens say) and the global
batch's ``batch_work``. A share of ``b`` out of ``B`` means ``b / B`` of a batch's work, so
a step's measured time is fitted against ``work * B / mean batch work``: the rank's work in
share units. The fits, the solver and the guards then run unchanged, and a rank's speed is
judged from work-normalised times: a step that drew long samples is not a slow rank.

With sample lengths (steps carry ``work_sq``, the summed squared lengths), ``job_cost_model``
fits ``time = c + a*sum(L) + b*sum(L^2)`` per rank (``backend.policy.costfit``) and, where
that explains the step times better than the length alone on most ranks, the job's work
becomes ``sum(L) + k*sum(L^2)`` with k the median ``b/a``: the hook's split weighs a sample
``L + k*L^2`` under that model, so shares and fits stay in the units the split uses.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from rebalancer_wire.protocol import MAX_LENGTH_SQ_WEIGHT

from .costfit import (
    MIN_STEPS,
    MODEL_FITTED,
    MODEL_LINEAR,
    MODEL_SAMPLES,
    CostFit,
    CostModel,
    fit_cost,
)
from .types import JobObservation, StepSample

__all__ = ["in_work_units", "mean_batch_work", "job_cost_model", "MIN_FIT_STEPS"]

MIN_FIT_STEPS = 2 * MIN_STEPS  # steps a rank needs before its quadratic term may count
RESIDUAL_MARGIN = 0.2  # the quadratic fit must leave at least 20% less unexplained variance


def _batch_work(s: StepSample, k: float) -> float | None:
    if s.batch_work is None:
        return None
    if k > 0 and s.batch_work_sq is not None:
        return s.batch_work + k * s.batch_work_sq
    return s.batch_work


def _work(s: StepSample, k: float) -> float | None:
    if s.work is None:
        return None
    if k > 0 and s.work_sq is not None:
        return s.work + k * s.work_sq
    return s.work


def mean_batch_work(obs: JobObservation, length_sq_weight: float = 0.0) -> float | None:
    """The mean work of a global batch over the steps seen (None without costs); with
    ``length_sq_weight`` k, a batch's work is ``sum(L) + k*sum(L^2)``."""
    seen: dict[int, float] = {}
    for r in obs.ranks:
        for s in r.steps:
            bw = _batch_work(s, length_sq_weight)
            if bw is not None and math.isfinite(bw) and bw > 0:
                seen[s.batch_index] = bw
    if not seen:
        return None
    return sum(seen.values()) / len(seen)


def in_work_units(obs: JobObservation, length_sq_weight: float = 0.0) -> JobObservation:
    """``obs`` with each step's ``local_batch_size`` in work units where steps carry a
    cost; steps without one are dropped then (units must not mix). Unchanged without costs.
    ``length_sq_weight`` k > 0 (a fitted cost model): a step's work is ``work + k*work_sq``."""
    k = length_sq_weight
    wbar = mean_batch_work(obs, k)
    if wbar is None:
        return obs
    scale = obs.global_batch_size / wbar
    ranks = []
    for r in obs.ranks:
        steps = []
        for s in r.steps:
            w = _work(s, k)
            if w is not None and w > 0:
                steps.append(replace(s, local_batch_size=w * scale))
        ranks.append(replace(r, steps=tuple(steps)))
    return replace(obs, ranks=tuple(ranks))


def job_cost_model(obs: JobObservation) -> CostModel:
    """Which cost model explains the job's step times (``backend.policy.costfit``).

    Without costs: ``samples``. With a cost per sample: ``work (linear)``, with the median
    R^2 of each rank's time against its work. With lengths: each rank's steps are fitted
    to ``c + a*sum(L) + b*sum(L^2)`` (the quadratic term only where identifiable and
    significant, ``fit_cost``). A rank counts for the quadratic model when it has at
    least ``MIN_FIT_STEPS`` steps and its fit leaves at least ``RESIDUAL_MARGIN`` less of
    the variance unexplained than the length alone (a clear margin, not the F test's
    noise); when more than half of the fitted ranks count, the job's model is ``fitted
    a*L+b*L^2`` with k the median of their ``b/a`` (at most the wire's bound: a linear term
    near 0 makes k huge, and past it ``L + k*L^2`` orders samples as ``L^2`` alone does);
    otherwise ``work (linear)``.
    """
    with_work = [[s for s in r.steps if s.work is not None] for r in obs.ranks]
    if not any(with_work):
        return CostModel(MODEL_SAMPLES, detail="no per-sample cost: every sample costs 1")
    lengths = any(s.work_sq is not None for steps in with_work for s in steps)
    fits: list[CostFit] = []
    quad: list[CostFit] = []
    linear_r2: list[float] = []
    for steps in with_work:
        rows = [s for s in steps if not lengths or s.work_sq is not None]
        if len(rows) < MIN_STEPS:
            continue
        s1, t = [float(s.work) for s in rows], [s.compute_ms for s in rows]  # type: ignore[arg-type]
        zeros, window = [0.0] * len(rows), max(MIN_STEPS, len(rows))
        lin = fit_cost(s1, zeros, t, window=window)
        if lin is None:
            continue
        fit = fit_cost(s1, [float(s.work_sq) for s in rows], t, window=window) if lengths else lin  # type: ignore[arg-type]
        fit = fit if fit is not None else lin
        fits.append(fit)
        linear_r2.append(lin.r2)
        if (fit.model == "quadratic" and fit.n_steps >= MIN_FIT_STEPS
                and 1.0 - fit.r2 <= (1.0 - RESIDUAL_MARGIN) * (1.0 - lin.r2)):
            quad.append(fit)
    r2 = statistics.median(f.r2 for f in fits) if fits else None
    if not lengths:
        return CostModel(MODEL_LINEAR, r2=r2, ranks_fitted=len(fits),
                         detail="a cost per sample (sample_cost), weighed as given")
    r2_lin = statistics.median(linear_r2) if linear_r2 else None
    if fits and 2 * len(quad) > len(fits):
        k = statistics.median(min(f.b_ms / f.a_ms, MAX_LENGTH_SQ_WEIGHT) if f.a_ms > 0 else MAX_LENGTH_SQ_WEIGHT
                              for f in quad)
        return CostModel(MODEL_FITTED, length_sq_weight=k, r2=r2, r2_linear=r2_lin, ranks_fitted=len(fits),
                         ranks_quadratic=len(quad),
                         detail=f"{len(quad)} of {len(fits)} ranks fit time = c + a*sum(L) + b*sum(L^2) "
                                f"better than the length alone; a sample of length L costs L + {k:.3g}*L^2")
    why = next((f.note for f in fits if f.note), "") if fits else ""
    detail = (f"lengths weighed as they are: {len(quad)} of {len(fits)} fitted ranks need the "
              f"quadratic term{' (' + why + ')' if why else ''}" if fits else
              f"lengths weighed as they are until {MIN_STEPS} steps per rank allow a fit")
    return CostModel(MODEL_LINEAR, r2=r2_lin, r2_linear=r2_lin, ranks_fitted=len(fits),
                     ranks_quadratic=len(quad), detail=detail)
