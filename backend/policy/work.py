"""Work units: with a per-sample cost, shares split each batch's work, not its samples.

The hook reports each step's ``work`` (the rank's summed cost, tokens say) and the global
batch's ``batch_work``. A share of ``b`` out of ``B`` means ``b / B`` of a batch's work, so
a step's measured time is fitted against ``work * B / mean batch work``: the rank's work in
share units. The fits, the solver and the guards then run unchanged, and a rank's speed is
judged from work-normalised times: a step that drew long samples is not a slow rank.

With sample lengths (steps carry ``work_sq``, the summed squared lengths), ``job_cost_model``
fits ``time = c + a*sum(L) + b*sum(L^2)`` per rank (``backend.policy.costfit``) and, where
that explains the step times better than the length alone on most ranks, the job's work
becomes ``sum(L) + k*sum(L^2)`` with k fitted over those ranks at once: the hook's split
weighs a sample ``L + k*L^2`` under that model, so shares and fits stay in the units the split uses.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from .costfit import (
    MIN_STEPS,
    MODEL_FITTED,
    MODEL_LINEAR,
    MODEL_SAMPLES,
    CostFit,
    CostModel,
    fit_cost,
    shared_length_sq_weight,
)
from .types import JobObservation, StepSample

__all__ = ["in_work_units", "mean_batch_work", "job_cost_model", "split_shift", "MIN_FIT_STEPS"]

MIN_FIT_STEPS = 2 * MIN_STEPS  # steps a rank needs before its quadratic term may count
RESIDUAL_MARGIN = 0.5  # to adopt it, the quadratic fit must leave at most half the unexplained variance


def _fit(s1: list[float], s2: list[float] | None, t: list[float]) -> CostFit | None:
    """``fit_cost`` over all the rows (the linear model alone where ``s2`` is None)."""
    return fit_cost(s1, s2 if s2 is not None else [0.0] * len(s1), t, window=max(MIN_STEPS, len(s1)))


def _clear(fit: CostFit, lin: CostFit) -> bool:
    """The quadratic fit leaves at most ``1 - RESIDUAL_MARGIN`` of the linear one's unexplained variance."""
    return 1.0 - fit.r2 <= (1.0 - RESIDUAL_MARGIN) * (1.0 - lin.r2)


def _clear_without_slowest(s1: list[float], s2: list[float], t: list[float], lin: CostFit) -> bool:
    """The quadratic term still clears the margin with the step furthest above the linear fit left out."""
    worst = max(range(len(t)), key=lambda i: t[i] - lin.step_ms(s1[i], 0.0))
    keep = [i for i in range(len(t)) if i != worst]
    s1k, s2k, tk = [s1[i] for i in keep], [s2[i] for i in keep], [t[i] for i in keep]
    lin_k, fit_k = _fit(s1k, None, tk), _fit(s1k, s2k, tk)
    return (lin_k is not None and fit_k is not None and fit_k.model == "quadratic"
            and _clear(fit_k, lin_k))


def _cost(work: float | None, work_sq: float | None, k: float) -> float | None:
    """sum(L) + k * sum(L^2); sum(L) alone when k is 0 or the squares are not reported."""
    if work is None:
        return None
    if k > 0 and work_sq is not None:
        return work + k * work_sq
    return work


def _batch_work(s: StepSample, k: float) -> float | None:
    return _cost(s.batch_work, s.batch_work_sq, k)


def _work(s: StepSample, k: float) -> float | None:
    return _cost(s.work, s.work_sq, k)


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
    significant, ``fit_cost``). Which ranks count for the quadratic model depends on the
    model in force (``obs.length_sq_weight``), so noise near the threshold switches nothing:

    - to adopt it (the length in force), a rank needs at least ``MIN_FIT_STEPS`` steps and
      a fit that leaves at most ``1 - RESIDUAL_MARGIN`` of the length alone's unexplained
      variance, also with its slowest step (the largest residual against the length alone)
      left out: the F test alone, asked at every look, found a term in a loaded machine's
      noise on about one linear job in fourteen, and one stalled step on a long batch makes one;
    - to keep it (a fitted k in force), the F test is enough.

    The model named is the one the hooks should split by: a kept k is named ``fitted`` (the
    job view once said ``work (linear)`` while one rank of two kept the k in force).

    When more than half of the fitted ranks count (at least half, to keep a k in force),
    the job's model is ``fitted a*L+b*L^2`` with k fitted once over the ranks that count
    (``shared_length_sq_weight``: one cost shape, each rank its own speed, the steps the
    machine slowed left out; at most the wire's bound, past which ``L + k*L^2`` orders
    samples as ``L^2`` alone does); otherwise ``work (linear)``. Each rank's own ``b/a`` is not used: its linear term is small beside
    a loaded machine's noise, and that ratio swung from 0.002 to the bound between windows.
    """
    with_work = [[s for s in r.steps if s.work is not None] for r in obs.ranks]
    if not any(with_work):
        return CostModel(MODEL_SAMPLES, detail="no per-sample cost: every sample costs 1")
    lengths = any(s.work_sq is not None for steps in with_work for s in steps)
    keeping = obs.length_sq_weight > 0
    fits: list[CostFit] = []
    quad: list[tuple[list[float], list[float], list[float]]] = []  # the rows of ranks that count
    linear_r2: list[float] = []
    for steps in with_work:
        rows = [s for s in steps if not lengths or s.work_sq is not None]
        if len(rows) < MIN_STEPS:
            continue
        s1, t = [float(s.work) for s in rows], [s.compute_ms for s in rows]  # type: ignore[arg-type]
        lin = _fit(s1, None, t)
        if lin is None:
            continue
        s2 = [float(s.work_sq) for s in rows] if lengths else None  # type: ignore[arg-type]
        fit = (_fit(s1, s2, t) if s2 is not None else None) or lin
        fits.append(fit)
        linear_r2.append(lin.r2)
        if fit.model != "quadratic" or fit.n_steps < MIN_FIT_STEPS or s2 is None:
            continue
        if keeping or (_clear(fit, lin) and _clear_without_slowest(s1, s2, t, lin)):
            quad.append((s1, s2, t))
    r2 = statistics.median(f.r2 for f in fits) if fits else None
    if not lengths:
        return CostModel(MODEL_LINEAR, r2=r2, ranks_fitted=len(fits),
                         detail="a cost per sample (sample_cost), weighed as given")
    r2_lin = statistics.median(linear_r2) if linear_r2 else None
    if fits and 2 * len(quad) >= len(fits) + (0 if keeping else 1):  # keep: half; adopt: more than half
        k = shared_length_sq_weight(quad)
        return CostModel(MODEL_FITTED, length_sq_weight=k, r2=r2, r2_linear=r2_lin, ranks_fitted=len(fits),
                         ranks_quadratic=len(quad), split_shift=split_shift(with_work, obs.length_sq_weight, k),
                         detail=f"{len(quad)} of {len(fits)} ranks fit time = c + a*sum(L) + b*sum(L^2) "
                                f"better than the length alone; a sample of length L costs L + {k:.3g}*L^2")
    why = next((f.note for f in fits if f.note), "") if fits else ""
    detail = (f"lengths weighed as they are: {len(quad)} of {len(fits)} fitted ranks need the "
              f"quadratic term{' (' + why + ')' if why else ''}" if fits else
              f"lengths weighed as they are until {MIN_STEPS} steps per rank allow a fit")
    return CostModel(MODEL_LINEAR, r2=r2_lin, r2_linear=r2_lin, ranks_fitted=len(fits),
                     ranks_quadratic=len(quad), split_shift=split_shift(with_work, obs.length_sq_weight, 0.0),
                     detail=detail)


def split_shift(steps: list[list[StepSample]], k_from: float, k_to: float) -> float | None:
    """How far weighing samples ``L + k_to*L^2`` instead of ``L + k_from*L^2`` moves a rank's
    share of its batch's work: the median over the ranks' steps (with lengths) of the
    relative change of ``work / batch_work``. None without such steps."""
    changes = []
    for rows in steps:
        for s in rows:
            if s.work_sq is None or s.batch_work_sq is None:
                continue  # no lengths: k changes nothing
            before, after = _work_share(s, k_from), _work_share(s, k_to)
            if before is not None and after is not None and before > 0:
                changes.append(abs(after / before - 1.0))
    return statistics.median(changes) if changes else None


def _work_share(s: StepSample, k: float) -> float | None:
    """A step's share of its batch's work, samples weighed ``L + k*L^2``."""
    w, bw = _work(s, k), _batch_work(s, k)
    return w / bw if w is not None and bw else None
