"""``decide``: readiness, cooldown, hysteresis, guardrails and the explanation.

One module, over 400 lines on purpose: decide's rules in the order they apply, each with
the sentence that explains it; split, the order and the explanations would drift apart."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ._guards import rollback_blocks
from .comm import Communication, comm_bound_text
from .costfit import MODEL_SAMPLES
from .limits import limit_problem
from .memory import DEFAULT_HEADROOM, format_bytes, memory_bounds, memory_limit_bytes
from .pipeline import pipeline_strategy, quantize_counts, with_pipeline_floors
from .solver import (
    NO_CONSTRAINTS,
    TIE_TOLERANCE,
    check_placement,
    even_ties,
    predicted_step_ms,
    rank_bounds,
    solve,
)
from .strategies import Estimate, Strategy, get_strategy, static_strategy
from .types import (
    Constraints,
    Decision,
    Explanation,
    InfeasibleError,
    JobObservation,
    NoProposal,
    PolicyConfig,
    Proposal,
    RankExplanation,
)
from .work import in_work_units, job_cost_model, mean_batch_work

__all__ = ["check_config", "decide", "memory_caps", "limit_moves", "with_caps", "exposed_comm_ms", "other_step_ms"]

log = logging.getLogger(__name__)


def memory_caps(obs: JobObservation, headroom: float = DEFAULT_HEADROOM) -> dict[int, int]:
    """Most samples each rank can hold under ``(1 - headroom)`` of its memory; a rank that
    measures memory without a fit yet is held at its current share; ranks that measure
    nothing get no cap (see ``backend.policy.memory``)."""
    return memory_bounds([r.memory for r in obs.ranks], obs.shares, obs.global_batch_size,
                         headroom)[0]


def with_caps(constraints: Constraints, caps: dict[int, int]) -> Constraints:
    """``constraints`` with each rank's cap lowered to ``caps[rank]`` where that is tighter."""
    merged = dict(constraints.caps)
    for rank, cap in caps.items():
        merged[rank] = min(cap, merged.get(rank, cap))
    return Constraints(pins=constraints.pins, caps=merged, floors=constraints.floors,
                       drains=constraints.drains, granularity=constraints.granularity)


def limit_moves(current: Sequence[int], target: Sequence[int], max_move: int,
                constraints: Constraints = NO_CONSTRAINTS) -> tuple[int, ...]:
    """Move each rank at most ``max_move`` samples from ``current`` towards ``target``.

    Keeps ``sum == B`` and the constraints. Ranks wanting the largest change move first.
    A constraint beats the guardrail: a rank outside its bounds (say, newly drained) goes
    to its nearest bound whatever the distance, and if the others cannot absorb that within
    ``max_move``, ``target`` is returned unchanged.
    """
    if len(current) != len(target):
        raise ValueError(
            f"current and target must have one share per rank, got {len(current)} and "
            f"{len(target)}."
        )
    if not isinstance(max_move, int) or max_move < 0:
        raise ValueError(f"max_move must be an integer >= 0, got {max_move!r}.")
    total = sum(target)
    if sum(current) != total:
        raise ValueError(f"current sums to {sum(current)} but target sums to {total}.")
    bounds = rank_bounds(len(target), total, constraints)
    g = bounds.granularity
    step = g
    if g > 1 and any((c - t) % g for c, t in zip(current, target, strict=True)):
        return tuple(target)  # the remainder rank changes: no move in whole units exists
    m = max_move // step * step
    lo_w, hi_w, out = [], [], []
    for i, (cur, tgt) in enumerate(zip(current, target, strict=True)):
        lo, hi = bounds.lo[i], bounds.hi[i]
        if i in bounds.fixed:
            lo_w.append(lo)
            hi_w.append(hi)
            out.append(lo)
            continue
        w_lo = min(max(cur - m, lo), hi)
        w_hi = max(min(cur + m, hi), lo)
        lo_w.append(w_lo)
        hi_w.append(w_hi)
        out.append(min(max(tgt, w_lo), w_hi))
    diff = total - sum(out)
    order = sorted(range(len(out)), key=lambda i: (-abs(target[i] - out[i]), i))
    direction = 1 if diff > 0 else -1
    # Round-robin in whole steps, so the correction is spread thin: first ranks that want
    # to move that way, then ranks taking back part of their own move, then any rank.
    for rule in ("toward_target", "toward_current", "any"):
        moved = True
        while diff != 0 and moved:
            moved = False
            for i in order:
                if diff == 0:
                    break
                if i in bounds.fixed:
                    continue
                goal = target[i] if rule == "toward_target" else current[i]
                if rule != "any" and (goal - out[i]) * direction <= 0:
                    continue
                nxt = out[i] + direction * step
                if lo_w[i] <= nxt <= hi_w[i] and abs(diff) >= step:
                    out[i] = nxt
                    diff -= direction * step
                    moved = True
    if diff != 0 or check_placement(out, total, constraints) is not None:
        return tuple(target)
    return tuple(out)


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    if len(runs) > 3:
        return f"{len(ranks)} ranks"
    parts = [f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs]
    return "ranks " + ", ".join(parts)


def _ms(x: float, units: str = "ms") -> str:
    if units != "ms":
        return f"{x:.3g} units"
    return f"{x:.0f} ms" if x >= 100 else f"{x:.1f} ms"


def _reason(est: Estimate, current: Sequence[int], target: Sequence[int], before: float,
            after: float, gain: float, strategy: str, violation: str | None,
            unit: str = "sample") -> str:
    delta = [t - c for c, t in zip(current, target, strict=True)]
    donors = [i for i, d in enumerate(delta) if d < 0]
    takers = [i for i, d in enumerate(delta) if d > 0]
    moved = sum(d for d in delta if d > 0)
    times = [a + c * b for a, c, b in zip(est.a_ms, est.c_ms, current, strict=True)]
    working = [i for i, b in enumerate(current) if b > 0] or list(range(len(current)))
    slowest = max(working, key=lambda i: (times[i], -i))
    med_c = float(np.median([est.c_ms[i] for i in working]))
    ratio = est.c_ms[slowest] / med_c if med_c > 0 else 1.0
    if violation:
        lead = f"the placement in force breaks a constraint ({violation})"
    elif strategy == "static" and est.units == "relative":
        lead = "device power differs across ranks"
    elif ratio >= 1.05:
        forecasts = est.evidence.get("forecasts")
        forecast = isinstance(forecasts, list) and any(
            isinstance(f, dict) and f.get("rank") == slowest and "c_forecast" in f
            for f in forecasts)
        verb = "is forecast to be" if forecast else "is"
        lead = f"rank {slowest} {verb} {ratio:.1f}x slower per {unit} than the median"
    else:
        lead = f"rank {slowest} has the longest predicted compute ({_ms(times[slowest], est.units)})"
    src = f" from {_ranks_text(donors)}" if donors and len(donors) <= 3 else ""
    dst = _ranks_text(takers) if takers else "no rank"
    if est.units == "ms":
        effect = f"cuts the predicted step from {_ms(before)} to {_ms(after)} ({gain:.0%})"
    else:
        effect = f"cuts the predicted step by {gain:.0%}"
    return f"{lead}; moving {moved} samples{src} to {dst} {effect}"


def exposed_comm_ms(obs: JobObservation, units: str = "ms") -> float:
    """The exposed communication every predicted step adds (0 where unknown, or where the
    estimate is not in milliseconds)."""
    c = obs.comm
    if units != "ms" or c is None or c.exposed_comm_ms is None:
        return 0.0
    return max(0.0, c.exposed_comm_ms)


def other_step_ms(obs: JobObservation, units: str = "ms") -> float:
    """The rest of the step every predicted step adds besides compute and exposed
    communication (the optimizer, the framework: the last arriver's step less its compute,
    sync wait and data wait); 0 where unknown or not in milliseconds."""
    c = obs.comm
    if units != "ms" or c is None or c.other_ms is None:
        return 0.0
    return max(0.0, c.other_ms)


def _comm_evidence(c: Communication | None, exposed: float) -> dict[str, object]:
    if c is None or c.n_steps == 0:
        return {}
    return {"communication": {"exposed_comm_ms": exposed, "other_ms": c.other_ms, "comm_share": c.comm_share,
                              "bound": c.bound,
                              "busbw_gbps": c.busbw_gbps, "comm_bytes_per_step": c.bytes_per_step,
                              "transfer_ms": c.transfer_ms, "kind": c.kind or None}}


def _explain(est: Estimate, strategy: str, current: Sequence[int], target: Sequence[int],
             evidence_extra: dict[str, object], obs: JobObservation,
             mem_caps: dict[int, int], headroom: float) -> Explanation:
    # A step is the slowest rank's compute plus the exposed communication and the rest of
    # the step (optimizer, framework), which no split changes but which every prediction
    # must include (ignoring the communication promised 31 ms on a job that then took 62;
    # ignoring the rest, 56 ms on a communication-heavy job that took 65).
    exposed = exposed_comm_ms(obs, est.units)
    unsplit = exposed + other_step_ms(obs, est.units)
    before = predicted_step_ms(est.a_ms, est.c_ms, current) + unsplit
    after = predicted_step_ms(est.a_ms, est.c_ms, target) + unsplit
    gain = (before - after) / before if before > 0 else 0.0
    mem = [_memory_fields(obs, i, current[i], target[i], headroom) for i in range(len(current))]
    ranks = tuple(
        RankExplanation(
            rank=i, share_before=current[i], share_after=target[i],
            compute_ms_before=est.a_ms[i] + est.c_ms[i] * current[i],
            compute_ms_after=est.a_ms[i] + est.c_ms[i] * target[i],
            a_ms=est.a_ms[i], c_ms=est.c_ms[i],
            fit_r2=est.fit_r2[i] if est.fit_r2 else None,
            n_steps=est.n_steps[i] if est.n_steps else 0,
            rel_error=_finite_or_none(est.rel_error[i]) if est.rel_error else None,
            mem_peak_before_bytes=mem[i][0], mem_peak_after_bytes=mem[i][1],
            mem_cap=mem_caps.get(i), mem_limit_bytes=mem[i][2],
        )
        for i in range(len(current))
    )
    evidence = {"units": est.units, **est.evidence, **evidence_extra, **_comm_evidence(obs.comm, exposed)}
    return Explanation(strategy, before, after, gain, ranks, evidence)


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _comm_clause(obs: JobObservation, expl: Explanation) -> str:
    """How much of the predicted step is communication (a clause of the reason)."""
    c = obs.comm
    exposed = exposed_comm_ms(obs, str(expl.evidence.get("units", "ms")))
    if c is None or exposed <= 0 or expl.step_ms_before <= 0:
        return ""
    what = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter"}.get(c.kind, "communication")
    bw = f" at {c.busbw_gbps:.3g} GB/s busbw" if c.busbw_gbps is not None else ""
    return (f"communication is {exposed / expl.step_ms_after:.0%} of the predicted step "
            f"({_ms(exposed)} of exposed {what}{bw})")


def _comm_bound_detail(obs: JobObservation, expl: Explanation, threshold: float) -> str | None:
    """The advice line for a job whose split would clear the gain threshold on compute
    alone but not once the exposed communication is counted; None otherwise."""
    c = obs.comm
    exposed = exposed_comm_ms(obs, str(expl.evidence.get("units", "ms")))
    if c is None or exposed <= 0:
        return None
    unsplit = exposed + other_step_ms(obs, str(expl.evidence.get("units", "ms")))
    compute_before, compute_after = expl.step_ms_before - unsplit, expl.step_ms_after - unsplit
    if compute_before <= 0 or (compute_before - compute_after) / compute_before < threshold:
        return None  # the split is not worth it even without communication
    head = "communication-bound" if c.bound == "communication-bound" else "communication eats the gain"
    figures = comm_bound_text(c) or f"{exposed / expl.step_ms_before:.0%} of the step is exposed communication"
    return f"{head}: {figures}; the best split gains at most {max(expl.gain, 0.0):.0%}"


def _memory_fields(obs: JobObservation, i: int, before: int, after: int,
                   headroom: float) -> tuple[float | None, float | None, float | None]:
    """(predicted peak before, after, bytes the rank may use) of rank ``i``."""
    rm = obs.ranks[i].memory
    fit = rm.fit
    if fit is None:
        return None, None, None
    total = rm.total_bytes or fit.total_bytes
    return (fit.predict(before), fit.predict(after),
            memory_limit_bytes(total, headroom) if total else None)


def _memory_note(obs: JobObservation, est: Estimate, target: Sequence[int], plan_c: Sequence[float],
                 plan_cons: Constraints, operator_cons: Constraints, mem_caps: dict[int, int],
                 why: dict[int, str], headroom: float) -> tuple[str, list[dict[str, object]]]:
    """Ranks held at their memory cap below the share speed alone would give them: one
    clause for the reason and the evidence."""
    binding = [i for i, cap in mem_caps.items() if target[i] == cap]
    if not binding:
        return "", []
    # The same solve without the memory caps: what speed alone asks for.
    free_cons = Constraints(pins=plan_cons.pins, caps=operator_cons.caps, floors=operator_cons.floors,
                            drains=operator_cons.drains, granularity=operator_cons.granularity)
    try:
        speed = solve(est.a_ms, plan_c, obs.global_batch_size, free_cons)
    except InfeasibleError:
        return "", []
    held = [i for i in binding if speed[i] > target[i]]
    notes: list[str] = []
    evidence: list[dict[str, object]] = []
    for i in held:
        rm = obs.ranks[i].memory
        item: dict[str, object] = {"rank": i, "cap": mem_caps[i], "speed_share": speed[i],
                                   "why": why.get(i, "memory")}
        total = rm.total_bytes or (rm.fit.total_bytes if rm.fit else None)
        if why.get(i) == "memory" and rm.fit is not None and total:
            limit = memory_limit_bytes(total, headroom)
            peak = rm.fit.predict(mem_caps[i])
            item.update({"predicted_peak_bytes": peak, "limit_bytes": limit})
            notes.append(f"rank {i} is capped at {mem_caps[i]} samples by memory (predicted peak "
                         f"{format_bytes(peak)} of a {format_bytes(limit)} limit; speed alone "
                         f"would give it {speed[i]})")
        elif why.get(i) == "memory_unknown":
            notes.append(f"rank {i} stays at {mem_caps[i]} samples until its memory is measured "
                         f"(speed alone would give it {speed[i]})")
        elif why.get(i) == "out_of_memory":
            notes.append(f"rank {i} is capped at {mem_caps[i]} samples since it ran out of memory "
                         f"(speed alone would give it {speed[i]})")
        evidence.append(item)
    return "; ".join(notes), evidence


def _held_ranks(est: Estimate, obs: JobObservation, cfg: PolicyConfig,
                cons: Constraints) -> list[int]:
    """Ranks whose estimate is still too noisy to move: relative standard error above half
    the gain threshold, and fewer than 3 x min_steps steps seen."""
    if not est.rel_error or not est.n_steps:
        return []
    return [i for i in range(obs.world_size)
            if i not in cons.pins and i not in cons.drains
            and 0 < est.n_steps[i] < 3 * cfg.min_steps
            and est.rel_error[i] > 0.5 * cfg.min_gain]


# Steps after a switch that still pay its one-off costs (as the controller's effect window).
_SETTLE = 2
# Steps into a placement before a significant trend may end its cooldown: the switch has
# settled and the rank's first frame from under the new split (metrics go out every 5
# steps) is in.
_TREND_SETTLE = 5


def _shifted_since(est: Estimate | NoProposal, batch_index: int) -> list[int]:
    """Ranks whose fit restarted at a level shift that began at or after ``batch_index``."""
    if isinstance(est, NoProposal):
        return []
    shifts = est.evidence.get("shift_at")
    if not isinstance(shifts, dict):
        return []
    return sorted(int(r) for r, k in shifts.items() if isinstance(k, int) and k >= batch_index)


def _trending(est: Estimate | NoProposal) -> list[int]:
    """Ranks whose forecast follows a significant trend of their cost (``predictive``)."""
    if isinstance(est, NoProposal):
        return []
    forecasts = est.evidence.get("forecasts")
    if not isinstance(forecasts, list):
        return []
    return sorted(int(f["rank"]) for f in forecasts
                  if isinstance(f, dict) and "trend_per_step" in f and "rank" in f)


def _trending_through(obs: JobObservation, est: Estimate | NoProposal, effective: int,
                      strategy: Strategy, config: PolicyConfig, cons: Constraints) -> list[int]:
    """Ranks trending now that were trending before the placement took at ``effective``.

    A trend must not be the placement's own doing: a rank whose share fell from 32 to 10
    pays its fixed cost over fewer samples, and a line through the switch looks like a
    drift. One seen on the steps before the switch as well is the card's.
    """
    now = _trending(est)
    if not now:
        return []
    past = replace(obs, batch_index=effective - 1, ranks=tuple(
        replace(r, steps=tuple(s for s in r.steps if s.batch_index < effective))
        for r in obs.ranks))
    before = set(_trending(strategy(past, config, cons)))
    return [i for i in now if i in before]


def check_config(cfg: PolicyConfig) -> None:
    """ValueError naming the setting when ``cfg`` is not one ``decide`` can run with (the
    ranges: ``limits.POLICY_LIMITS``, the table PUT /policy and Settings read too)."""
    for key in ("min_gain", "cooldown_steps", "min_steps", "window_steps", "horizon_steps"):
        problem = limit_problem(key, getattr(cfg, key))
        if problem is not None:
            raise ValueError(f"policy.{key} {problem}.")
    if cfg.window_steps < cfg.min_steps:
        raise ValueError(f"policy.window_steps ({cfg.window_steps}) must be at least "
                         f"policy.min_steps ({cfg.min_steps}).")
    if cfg.max_move_fraction is not None:
        problem = limit_problem("max_move_fraction", cfg.max_move_fraction)
        if problem is not None:
            raise ValueError(f"policy.max_move_fraction {problem} (or None).")


def decide(obs: JobObservation, config: PolicyConfig,
           constraints: Constraints = NO_CONSTRAINTS) -> Decision:
    """Propose a better placement for the job, or say why not.

    Pure: the same observation, config and constraints give the same decision. Memory caps
    derived from the observation (:func:`memory_caps`, ``config.memory_headroom``) are
    added to ``constraints``; a rank held at its memory cap below the share its speed
    would earn is named in the reason.
    In order:

    - the placement in force breaks a constraint: propose a fix at once (no cooldown;
      static weights stand in while measurements are missing);
    - ``cooldown`` while ``steps_since_change < cooldown_steps`` (not at version 0), unless
      a rank's cost shifted (a confirmed level shift, see ``_fit.detect_shift``) after the
      placement took effect: the explanation then says ``cooldown_ended_by_shift``; or
      unless, ``_TREND_SETTLE`` steps into the placement, a rank's cost follows a
      significant trend (``predictive``) that it followed before the placement as well:
      ``cooldown_ended_by_trend``. A drifting card
      moves on while the cooldown runs; an early answer on a young trend that understated
      it would otherwise stand until the split is 10% behind;
    - the strategy's ``warming_up`` / ``no_data`` until every working rank has
      ``min_steps`` valid steps;
    - solve with each cost two standard errors high (``params["plan_margin_se"]``), holding
      ranks still too noisy to trust at their share; cap moves by ``max_move_fraction``;
    - ``balanced`` if that is the placement in force; ``insufficient_gain`` unless the
      predicted gain clears ``min_gain`` plus twice the largest relative standard error;
    - otherwise a :class:`Proposal` with a one-sentence reason and the explanation.

    ``infeasible`` when the constraints admit no placement. Bad observations or config
    raise ``ValueError`` naming what is wrong.

    >>> d = decide(obs, PolicyConfig(strategy="profiled"))   # doctest: +SKIP
    >>> d.reason if isinstance(d, Proposal) else d.detail    # doctest: +SKIP
    'rank 3 is 2.0x slower per sample than the median; moving 24 samples ...'

    A decision on a job with costs carries its cost model (``work.job_cost_model``; None
    without costs: samples). With sample lengths and a fitted ``a*L + b*L^2`` in force
    (``obs.length_sq_weight``), work is ``sum(L) + k*sum(L^2)`` throughout: the hooks split
    by the k in force, so shares mean its units; a newly fitted k goes to the hooks first
    (the controller) and the next decision reads shares in it.
    """
    model = job_cost_model(obs)
    decision = _decide(obs, config, constraints, obs.length_sq_weight)
    return decision if model.model == MODEL_SAMPLES else replace(decision, cost_model=model)


def _decide(obs: JobObservation, config: PolicyConfig, constraints: Constraints,
            length_sq_weight: float) -> Decision:
    n, b_total = obs.world_size, obs.global_batch_size
    if len(obs.ranks) != n or len(obs.shares) != n:
        raise ValueError(
            f"observation of job {obs.job!r} has world_size {n} but {len(obs.ranks)} ranks "
            f"and {len(obs.shares)} shares; send one of each per rank."
        )
    if sum(obs.shares) != b_total:
        raise ValueError(
            f"observation of job {obs.job!r}: shares sum to {sum(obs.shares)}, not the "
            f"global batch {b_total}."
        )
    check_config(config)
    # With a per-sample cost, shares and fits are in work units, and the reason says so.
    unit = "unit of work" if mean_batch_work(obs) is not None else "sample"
    obs = in_work_units(obs, length_sq_weight)
    strategy: Strategy = get_strategy(config.strategy)
    if obs.pipeline is not None:  # a pipelined job: never below the schedule's floor, and ...
        constraints = with_pipeline_floors(obs, constraints)
        if any(t is not None for t in obs.pipeline.pipelines):  # ... by the stage model once stages report
            config = replace(config, strategy="pipeline")
            strategy = pipeline_strategy
    headroom = config.memory_headroom
    mem_caps, mem_why = memory_bounds([r.memory for r in obs.ranks], obs.shares, b_total,
                                      headroom)
    eff = with_caps(constraints, mem_caps)
    try:
        rank_bounds(n, b_total, eff)
    except InfeasibleError as exc:
        caps_text = ", ".join(f"rank {r} <= {c}" for r, c in sorted(mem_caps.items()))
        caps_note = f" (memory caps: {caps_text})" if mem_caps else ""
        return NoProposal("infeasible", f"{exc}{caps_note}")
    violation = check_placement(obs.shares, b_total, eff)

    cooling = violation is None and obs.placement_version > 0 and \
        obs.steps_since_change < config.cooldown_steps
    est = strategy(obs, config, eff)
    extra: dict[str, object] = {}
    if cooling:
        # A confirmed level shift that began after the placement took effect (not the
        # placement's own doing) ends the cooldown: waiting it out is paid at the slow pace.
        # So does a significant trend once the placement has settled; the gain threshold
        # below still decides whether the forecast is worth a move.
        effective = obs.batch_index - obs.steps_since_change
        shifted = _shifted_since(est, effective + _SETTLE)
        trending = _trending_through(obs, est, effective, strategy, config, eff) \
            if obs.steps_since_change >= _TREND_SETTLE else []
        if trending and not shifted:
            extra["cooldown_ended_by_trend"] = trending
        elif not shifted:
            left = config.cooldown_steps - obs.steps_since_change
            return NoProposal("cooldown",
                              f"cooldown: {left} more steps after placement v{obs.placement_version}",
                              steps_remaining=left)
        else:
            extra["cooldown_ended_by_shift"] = shifted
    if isinstance(est, NoProposal):
        if violation is None:
            return est
        # Constraints must hold now: fall back to device weights until measurements exist.
        est = static_strategy(obs, config, eff)
    strategy_name = config.strategy
    plan_cons = eff
    held = _held_ranks(est, obs, config, eff) if violation is None else []
    # No evidence (an idle rank never measured): keep it where it is.
    held += [i for i in est.hold if i not in held] if violation is None else []
    blocks = rollback_blocks(obs, est.a_ms, config.window_steps) if violation is None else {}
    if held or blocks:
        # Too noisy to trust yet, or unknown: keep these ranks where they are and balance
        # the rest. A rank whose earlier move was rolled back may only move the other way.
        pins = dict(eff.pins)
        pins.update({i: obs.shares[i] for i in held})
        caps, floors = dict(eff.caps), dict(eff.floors)
        for i, d in blocks.items():
            if d > 0:
                caps[i] = min(caps.get(i, obs.shares[i]), obs.shares[i])
            else:
                floors[i] = max(floors.get(i, obs.shares[i]), obs.shares[i])
        plan_cons = Constraints(pins=pins, caps=caps, floors=floors, drains=eff.drains,
                                granularity=eff.granularity)
    try:
        # Plan with each rank's cost two standard errors high: a rank whose estimate is
        # shaky (few steps, heavy noise) should not be handed extra work on a lucky streak.
        k_se = float(config.params.get("plan_margin_se", 2.0))
        plan_c = [c * (1.0 + k_se * e) for c, e in zip(est.c_ms, est.rel_error, strict=True)] \
            if est.rel_error else list(est.c_ms)
        # Ranks the fit cannot tell apart plan with one cost: split evenly, never by the
        # noise of the last window (which flips mirror images between runs).
        tie_a, tie_c = even_ties(est.a_ms, plan_c, b_total, est.rel_error,
                                 float(config.params.get("tie_tolerance", TIE_TOLERANCE)))
        target = solve(tie_a, tie_c, b_total, plan_cons)
    except InfeasibleError as exc:
        return NoProposal("infeasible", str(exc))
    if config.max_move_fraction is not None and violation is None:
        max_move = max(eff.granularity, int(config.max_move_fraction * b_total))
        limited = limit_moves(obs.shares, target, max_move, eff)
        if limited != target:
            extra["limited_by_max_move"] = max_move
            target = limited
    if obs.pipeline is not None:  # only counts the schedule takes (interleaved 1F1B: multiples of its rounds)
        try:
            bnd = rank_bounds(n, b_total, plan_cons)
            counts = quantize_counts(target, tie_a, plan_c, bnd.lo, bnd.hi, bnd.fixed, obs.pipeline.schedule,
                                     obs.pipeline.pp_size)
        except InfeasibleError as exc:
            return NoProposal("infeasible", str(exc))
        if counts != tuple(target):
            extra["quantized_to_schedule_counts"] = list(counts)
            target = counts
    noisy = [i for i in held if i not in est.hold]
    if noisy:
        extra["held_noisy_ranks"] = noisy
    if blocks:
        extra["rolled_back_directions"] = {str(i): "up" if d > 0 else "down"
                                           for i, d in sorted(blocks.items())}
    note, capped = _memory_note(obs, est, target, plan_c, plan_cons, constraints, mem_caps,
                                mem_why, headroom)
    if capped:
        extra["memory_capped"] = capped
    expl = _explain(est, strategy_name, obs.shares, target, extra, obs, mem_caps, headroom)
    if target == tuple(obs.shares):
        return NoProposal("balanced", f"balanced: the {strategy_name} split equals the "
                          "placement in force", explanation=expl)
    # Held ranks keep their share: their noise does not make the others' gain uncertain.
    working = [i for i in range(n) if (obs.shares[i] > 0 or target[i] > 0) and i not in held]
    noise = 2.0 * max((est.rel_error[i] for i in working), default=0.0) if est.rel_error else 0.0
    threshold = config.min_gain + noise
    if violation is None and expl.gain < threshold:
        margin = f" (+{noise:.1%} for measurement noise)" if noise >= 0.0005 else ""
        comm_bound = _comm_bound_detail(obs, expl, threshold)
        if comm_bound is not None:
            return NoProposal("insufficient_gain", comm_bound, explanation=expl)
        return NoProposal(
            "insufficient_gain",
            f"predicted gain {expl.gain:.1%} is below the {config.min_gain:.0%} "
            f"threshold{margin}",
            explanation=expl,
        )
    reason = _reason(est, obs.shares, target, expl.step_ms_before, expl.step_ms_after,
                     expl.gain, strategy_name, violation, unit)
    if note:
        reason = f"{reason}; {note}"
    comm = _comm_clause(obs, expl)
    if comm:
        reason = f"{reason}; {comm}"
    log.debug("job %s: proposing %s (%s)", obs.job, target, reason)
    return Proposal(shares=target, reason=reason, explanation=expl)
