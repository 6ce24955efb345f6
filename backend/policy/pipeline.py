"""Pipelines (PP x DP, docs/pipelines.md): a pipeline's step from its stages' times, the
``pipeline`` strategy that splits micro-batches over pipelines, and stage-split advice.

The model. Stage ``s`` of a pipeline takes ``t_s = fwd_s + bwd_s`` ms per micro-batch (an
interleaved rank's model stages summed). Under GPipe and 1F1B with ``p`` stages and ``m``
micro-batches the first micro-batch crosses every stage once and the others follow at the
pace of the slowest stage:

    T(m) = sum_s t_s + (m - 1) * max_s t_s

which is ``(m + p - 1) * t`` for equal stages, a bubble of ``(p-1)/(m+p-1)``. Interleaved
1F1B with ``v`` model stages per rank fills and drains in chunks of ``1/v``:
``T(m) = sum_s t_s / v + (m - 1/v) * max_s t_s`` (bubble ``((p-1)/v) / (m + (p-1)/v)``).
``T`` is linear in ``m``: ``a + c*m`` with ``c = max_s t_s`` and ``a = (sum_s t_s - max_s
t_s) / v``, so a pipeline given fewer micro-batches is predicted with its larger bubble
share, and the engine's exact min-max solver splits micro-batches over pipelines. What the
model leaves out (send/recv latency, the schedule's own overhead) is measured: each
pipeline's residual, measured compute less ``T`` at the count ``m0`` in force, is spread
over the run's ``m0 + (p-1)/v`` slots (a hop's latency comes once per micro-batch on the
critical path), so ``a`` carries ``(p-1)/v`` slots of it and ``c`` one: measured in
bench.pipeline's sweep, a pipeline's unmodelled time grew with its count (22 ms at 4
micro-batches, 40 at 10), and a constant residual overrates a pipeline given more.
What the views show and the stage-split advice are in ``backend.policy.pipeline_advice``.

Pure: data in, data out (no I/O)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rebalancer_wire.protocol import PIPELINE_SCHEDULES

from .strategies import Estimate
from .types import (
    Constraints,
    InfeasibleError,
    JobObservation,
    NoProposal,
    PipelineObservation,
    PipelineTimes,
    PolicyConfig,
)

__all__ = [
    "PIPELINE_SCHEDULES",
    "PipelineTimes",
    "PipelineObservation",
    "replay_ms",
    "schedule_ms",
    "linear_cost",
    "bubble_share",
    "theory_bubble",
    "residual_ms",
    "fitted_cost",
    "pipeline_strategy",
    "with_pipeline_floors",
    "floor_problem",
    "takes_count",
    "count_problem",
    "allowed_counts",
    "quantize_counts",
]


# --- the model ----------------------------------------------------------------------------

def schedule_ms(stage_ms: Sequence[float], m: int, stages_per_rank: int = 1) -> float:
    """``T(m)``: the schedule's run for ``m`` micro-batches (0 for none; module docstring).

    >>> schedule_ms([10.0, 10.0, 10.0, 10.0], 8)  # (m + p - 1) * t
    110.0
    """
    if m <= 0 or not stage_ms:
        return 0.0
    v = max(1, stages_per_rank)
    return sum(stage_ms) / v + (m - 1.0 / v) * max(stage_ms)


def replay_ms(fwd_ms: Sequence[float], bwd_ms: Sequence[float], m: int, schedule: str) -> float:
    """The run of ``m`` micro-batches replayed op by op in the schedule's order (``gpipe``:
    every forward, then every backward; ``1f1b``: stage ``s`` of ``p`` runs ``min(m, p - s)``
    forwards, then alternates backward and forward, torch's ``Schedule1F1B``), each op
    starting when its stage is free and its input is there (p2p taken as instant).

    Unlike ``schedule_ms`` it sees 1F1B's limited warm-up: an upstream stage slower than the
    ones below it waits a round trip for each backward, so a split whose heavy stage is
    upstream runs shorter or longer than ``T(m)`` says (docs/pipelines.md).

    >>> replay_ms([15, 9], [30, 18], 6, "1f1b")   # T(m) says 297
    282.0
    """
    p = len(fwd_ms)
    if m <= 0 or p == 0:
        return 0.0
    orders: list[list[tuple[bool, int]]] = []
    for s in range(p):
        if schedule == "gpipe":
            orders.append([(True, i) for i in range(m)] + [(False, i) for i in range(m)])
            continue
        warm = min(m, p - s)
        order = [(True, i) for i in range(warm)]
        for i in range(m - warm):
            order += [(False, i), (True, warm + i)]
        order += [(False, i) for i in range(m - warm, m)]
        orders.append(order)
    done: dict[tuple[bool, int, int], float] = {}
    free = [0.0] * p
    at = [0] * p
    left = 2 * m * p
    while left:
        moved = False
        for s in range(p):
            while at[s] < len(orders[s]):
                fwd, i = orders[s][at[s]]
                dep = ((True, s - 1, i) if s else None) if fwd else ((False, s + 1, i) if s < p - 1 else (True, s, i))
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0.0)
                free[s] = done[(fwd, s, i)] = start + (fwd_ms[s] if fwd else bwd_ms[s])
                at[s] += 1
                left -= 1
                moved = True
        if not moved:
            raise ValueError(f"the {schedule} order deadlocked: not a schedule replay_ms knows")
    return max(free)


def linear_cost(stage_ms: Sequence[float], stages_per_rank: int = 1) -> tuple[float, float]:
    """``(a, c)`` with ``T(m) = a + c*m`` for ``m >= 1``."""
    v = max(1, stages_per_rank)
    c = max(stage_ms)
    return (sum(stage_ms) - c) / v, c


def bubble_share(stage_ms: Sequence[float], m: int, stages_per_rank: int = 1) -> float | None:
    """The modelled idle share of the schedule's run: ``1 - m * mean_s t_s / T(m)``."""
    total = schedule_ms(stage_ms, m, stages_per_rank)
    if total <= 0:
        return None
    return max(0.0, 1.0 - m * (sum(stage_ms) / len(stage_ms)) / total)


def theory_bubble(p: int, m: int, stages_per_rank: int = 1) -> float:
    """The textbook bubble of equal stages: ``(p-1)/(m+p-1)``, ``((p-1)/v)/(m+(p-1)/v)``."""
    fill = (p - 1) / max(1, stages_per_rank)
    return fill / (m + fill) if m + fill > 0 else 0.0


def residual_ms(t: PipelineTimes, v: int) -> float:
    """Measured compute less the model at the count in force: what the model leaves out."""
    if t.n_microbatches <= 0 or t.compute_ms <= 0:
        return 0.0
    return t.compute_ms - schedule_ms(t.stage_ms, t.n_microbatches, v)


def fitted_cost(t: PipelineTimes, pp_size: int, v: int) -> tuple[float, float, float]:
    """``(a, c, residual)``: the pipeline's ``T(m) = a + c*m`` with its measured residual
    spread over the run's ``m0 + (p-1)/v`` slots (module docstring). The one rule the
    strategy splits by and a placement's prediction (``pipeline_check``) is made with."""
    ai, ci = linear_cost(t.stage_ms, v)
    res = residual_ms(t, v)
    per_slot = res / (t.n_microbatches + (pp_size - 1) / v) if t.n_microbatches > 0 else 0.0
    return ai + per_slot * (pp_size - 1) / v, ci + per_slot, res


# --- the strategy -------------------------------------------------------------------------

def pipeline_strategy(obs: JobObservation, config: PolicyConfig, constraints: Constraints) -> Estimate | NoProposal:
    """Per pipeline ``a + c*m`` from its stages' times (module docstring). Not a choice in
    the strategy registry: the engine uses it for every pipelined job (``obs.pipeline``).

    Warming up until every pipeline with micro-batches has ``min_steps`` steps with stage
    times; a drained pipeline without any keeps its share (held)."""
    po = obs.pipeline
    if po is None:
        return NoProposal("no_data", "not a pipelined job: its hello said no pipeline")
    v = po.stages_per_rank
    short = [(config.min_steps - (t.n_steps if t else 0), i) for i, t in enumerate(po.pipelines)
             if (t is None or t.n_steps < config.min_steps) and obs.shares[i] > 0
             and i not in constraints.drains and i not in constraints.pins]
    if short:
        missing, i = max(short)
        more = f" ({len(short)} pipelines short)" if len(short) > 1 else ""
        return NoProposal("warming_up", f"warming up: {missing} more steps with stage times needed on "
                                        f"pipeline {i}{more}", steps_remaining=missing)
    known = [t for t in po.pipelines if t is not None]
    if not known:
        return NoProposal("no_data", "no stage times measured on any pipeline yet")
    a: list[float] = []
    c: list[float] = []
    n: list[int] = []
    err: list[float] = []
    hold: list[int] = []
    rows = []
    for i, t in enumerate(po.pipelines):
        if t is None:  # never measured (drained from the start): keep it where it is
            med = statistics.median(linear_cost(k.stage_ms, v)[1] for k in known)
            a.append(0.0)
            c.append(med)
            n.append(0)
            err.append(0.0)
            hold.append(i)
            continue
        ai, ci = linear_cost(t.stage_ms, v)
        fa, fc, res = fitted_cost(t, po.pp_size, v)
        per_slot = fc - ci
        a.append(fa)
        c.append(fc)
        n.append(t.n_steps)
        err.append(t.rel_noise)
        stage = t.stage_ms
        rows.append({"pipeline": i, "stage_ms": [round(x, 4) for x in stage],
                     "bottleneck_stage": stage.index(max(stage)), "model_a_ms": round(ai, 4),
                     "residual_ms": round(res, 4), "residual_per_slot_ms": round(per_slot, 4),
                     "c_ms": round(ci, 4)})
    evidence: dict[str, object] = {"steps_used": n, "pipeline": {
        "schedule": po.schedule, "pp_size": po.pp_size, "stages_per_rank": v,
        "min_microbatches": po.min_microbatches,
        "model": "T(m) = sum(t)/v + (m - 1/v) * max(t) + residual * (m + (p-1)/v) / (m0 + (p-1)/v)", "pipelines": rows}}
    return Estimate(tuple(a), tuple(c), "ms", (), tuple(n), tuple(err), evidence, tuple(hold))


def floor_problem(min_microbatches: int, schedule: str, shares: Sequence[int], pp_size: int = 0) -> str | None:
    """Why a placement gives a pipeline fewer micro-batches than its schedule runs, or a
    count it does not take (None: neither): the sentence an operator's placement is refused
    with. ``pp_size`` (0: not known) lets the interleaved count rule be checked."""
    low = [i for i, m in enumerate(shares) if m < min_microbatches]
    if low:
        which = ", ".join(f"pipeline {i} ({shares[i]})" for i in low)
        return (f"this job's {schedule} schedule runs at least {min_microbatches} micro-batches per pipeline "
                f"(its hooks' min_microbatches), but the placement gives {which} fewer.")
    return count_problem(schedule, pp_size, shares) if pp_size > 0 else None


# --- the counts a schedule takes -----------------------------------------------------------

def takes_count(schedule: str, pp_size: int, n: int) -> bool:
    """Whether ``schedule`` runs ``n`` micro-batches per pipeline of ``pp_size`` ranks (0: a
    drained pipeline, which runs the fewest it takes with weight 0). torch 2.13's
    ``ScheduleInterleaved1F1B`` plays ``max(1, n // pp_size)`` rounds of equal size, so ``n``
    must be a multiple of that (with 4 ranks: 1-8, 10, 12, 15, 16, 20, 24, ...; from
    ``2 * pp_size`` on, about every multiple of it); the hook's ``check_count`` is the same rule."""
    if n < 0:
        return False
    if n == 0:
        return True
    if schedule == "1f1b":
        return n >= pp_size
    if schedule == "interleaved1f1b":
        return n % max(1, n // max(1, pp_size)) == 0
    return True


def allowed_counts(schedule: str, pp_size: int, lo: int, hi: int) -> list[int]:
    """The counts in ``lo..hi`` that ``schedule`` takes, ascending."""
    return [n for n in range(max(0, lo), hi + 1) if takes_count(schedule, pp_size, n)]


def count_problem(schedule: str, pp_size: int, shares: Sequence[int]) -> str | None:
    """Why a placement gives a pipeline a count its schedule does not take (None: it does not)."""
    bad = [i for i, m in enumerate(shares) if not takes_count(schedule, pp_size, int(m))]
    if not bad:
        return None
    which = ", ".join(f"pipeline {i} ({shares[i]}; nearby: {_nearby(schedule, pp_size, int(shares[i]))})"
                      for i in bad)
    return (f"this job's {schedule} schedule with {pp_size} ranks per pipeline runs a count that is a multiple of "
            f"its rounds (count // {pp_size}), but the placement gives {which}.")


def _nearby(schedule: str, pp_size: int, n: int) -> list[int]:
    return [m for m in allowed_counts(schedule, pp_size, n - pp_size, n + pp_size) if m > 0]


def quantize_counts(target: Sequence[int], a_ms: Sequence[float], c_ms: Sequence[float], lo: Sequence[int],
                    hi: Sequence[int], fixed: frozenset[int], schedule: str, pp_size: int) -> tuple[int, ...]:
    """``target`` (the solver's split, which ignores count rules) moved to counts the
    schedule takes, the sum kept: of the counts near each pipeline's target within its
    bounds, the combination with the smallest predicted slowest pipeline (``a + c*m``), then
    the least moved. Fixed (pinned, drained) pipelines keep theirs. A dynamic programme
    over the running sum, a few candidates per pipeline: milliseconds at 64 pipelines.
    Raises InfeasibleError when no combination sums to the global count."""
    if all(takes_count(schedule, pp_size, int(m)) for m in target):
        return tuple(int(m) for m in target)
    total = sum(int(m) for m in target)
    width = 3 * max(1, pp_size) + 3
    best: dict[int, tuple[float, int, tuple[int, ...]]] = {0: (0.0, 0, ())}
    for i, t in enumerate(target):
        t = int(t)
        cands = [t] if i in fixed else allowed_counts(schedule, pp_size, max(lo[i], t - width), min(hi[i], t + width))
        nxt: dict[int, tuple[float, int, tuple[int, ...]]] = {}
        for acc, (worst, moved, picks) in best.items():
            for m in cands:
                s = acc + m
                if s > total:
                    break
                key = (max(worst, a_ms[i] + c_ms[i] * m if m > 0 else 0.0), moved + abs(m - t), picks + (m,))
                if s not in nxt or key[:2] < nxt[s][:2]:
                    nxt[s] = key
        best = nxt
    if total not in best:
        raise InfeasibleError(
            f"no split of {total} micro-batches over {len(target)} pipelines gives each a count the {schedule} "
            f"schedule takes with {pp_size} ranks per pipeline (a multiple of count // {pp_size}) within its bounds.")
    return best[total][2]


def with_pipeline_floors(obs: JobObservation, constraints: Constraints) -> Constraints:
    """``constraints`` with every pipeline at least ``min_microbatches`` (the schedule's
    floor). An operator's drain or pin below it stays, and the bounds then admit no
    placement: the engine says so (``infeasible``) rather than send one the hooks refuse."""
    po = obs.pipeline
    if po is None or po.min_microbatches <= 0:
        return constraints
    floors = dict(constraints.floors)
    for i in range(obs.world_size):
        floors[i] = max(floors.get(i, 0), po.min_microbatches)
    return Constraints(pins=constraints.pins, caps=constraints.caps, floors=floors, drains=constraints.drains,
                       granularity=constraints.granularity)
