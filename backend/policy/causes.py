"""Why a job is slow: its recent steps replayed with one cause removed at a time (pure).

The replay (docs/causes.md). In synchronous data parallelism a step waits for the rank
that reaches the gradient collective last. Step ``k`` on rank ``i`` is its wait before the
step ``d`` (the loader's, its host work ``h`` and checkpoint writes ``w``), its compute
``c``, its wait inside the collective ``s`` and its optimizer ``o``. The rank that arrived
last waits only for the transfer, so the step's transfer is ``x_k = min_i s_ik`` and

    T_k = max_i (d_ik + c_ik) + x_k + median_i o_ik

(ByteDance's what-if, OSDI'25, replays a trace the same way: each part of the step set to
what it would be without a cause). Each cause rewrites the parts it owns and the step is
computed again; the gain is the mean of ``T_k`` minus the mean of the rewritten ``T_k``:

- ``slow_rank``: the rank slowest per unit of work computes at the median speed (a rank's
  speed is its compute without its GC pauses, which the ``gc`` cause owns).
- ``placement``: the best split of the global batch (``solver.solve`` on each rank's fit);
  not replayed for steps split by work (``sample_cost=``): there a share is a share of
  work and a long sample cannot be split, which the count-based fit cannot price.
- ``sample_cost_skew``: every rank's work per step is an even share of the step's work
  (each rank at its own speed; with a per-sample cost only: the steps' ``work``), what
  packing sequences to even lengths gives.
- ``data_wait``: the loader's wait is zero.
- ``gc``: every garbage-collection pause is gone (taken out of the rank's arrival).
- ``host``: the training loop's own host work between steps is zero.
- ``checkpoint``: checkpoint writes take no time.
- ``communication``: every transfer at the best bandwidth the window measured.

A GC pause may fall in any part of a step; the replay takes it out of the arrival (where
a rank's pause holds every other rank back), never below zero.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .solver import solve
from .types import InfeasibleError

__all__ = ["CauseStep", "Cause", "CauseReport", "attribute", "CAUSES", "GC_HINT_SHARE"]

CAUSES = ("slow_rank", "placement", "sample_cost_skew", "data_wait", "gc", "host", "checkpoint", "communication")
GC_HINT_SHARE = 0.02  # the job page hints at the GC settings above this share of the step
_MIN_GAIN_SHARE = 0.002  # a cause worth less than 0.2% of the step is not listed
_MAX_RANKS_NAMED = 8


@dataclass(frozen=True, slots=True)
class CauseStep:
    """One step of one rank, as the replay reads it (ms; work in the job's cost units)."""

    batch_index: int
    local_batch_size: int
    data_wait_ms: float
    compute_ms: float
    sync_wait_ms: float
    optimizer_ms: float
    step_ms: float
    host_ms: float = 0.0
    ckpt_ms: float = 0.0
    gc_ms: float = 0.0
    comm_bytes: int | None = None
    comm_ms: float | None = None
    work: float | None = None

    @property
    def loader_ms(self) -> float:
        return max(0.0, self.data_wait_ms - self.host_ms - self.ckpt_ms)


@dataclass(frozen=True, slots=True)
class Cause:
    cause: str
    ranks: tuple[int, ...]
    ms_per_step: float
    share_of_step: float
    gpu_hours_lost: float
    predicted_step_ms_without: float
    remedy: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class CauseReport:
    """``causes`` largest first; ``step_ms`` the measured mean step of the replayed steps,
    ``replayed_step_ms`` the replay's with nothing removed (their gap is the model's error)."""

    causes: tuple[Cause, ...]
    steps: int
    step_ms: float | None
    replayed_step_ms: float | None
    gc_share: float  # GC pauses of the slowest-arriving rank, as a share of the step


_Steps = dict[int, dict[int, CauseStep]]  # batch index -> rank -> step
_Arrivals = Callable[[int, Mapping[int, CauseStep]], dict[int, float]]
_Transfer = Callable[[int, Mapping[int, CauseStep]], float]


def _aligned(steps: Mapping[int, Sequence[CauseStep]], window: int) -> _Steps:
    """The newest ``window`` batch indices every rank has a step of (warm-up steps with no
    work left out), each as rank -> step."""
    by_rank = {r: {s.batch_index: s for s in rows} for r, rows in steps.items() if rows}
    if not by_rank:
        return {}
    common = set.intersection(*(set(m) for m in by_rank.values()))
    keep = sorted(common)[-window:] if window > 0 else sorted(common)
    return {k: {r: m[k] for r, m in by_rank.items()} for k in keep}


def _step(rows: Mapping[int, CauseStep], arrival: Mapping[int, float], transfer: float) -> float:
    opt = statistics.median(s.optimizer_ms for s in rows.values())
    return max(arrival.values()) + transfer + opt


def _arrivals(rows: Mapping[int, CauseStep]) -> dict[int, float]:
    return {r: s.data_wait_ms + s.compute_ms for r, s in rows.items()}


def _transfer(rows: Mapping[int, CauseStep]) -> float:
    return min(s.sync_wait_ms for s in rows.values())


def _device_ms(s: CauseStep) -> float:
    """The step's compute without its GC pauses: a rank the collector holds is not a slow
    device (the ``gc`` cause owns the pauses)."""
    return max(0.0, s.compute_ms - s.gc_ms)


def _unit_cost(s: CauseStep) -> float | None:
    units = s.work if s.work is not None else float(s.local_batch_size)
    return _device_ms(s) / units if units > 0 else None


def _rank_speeds(aligned: _Steps) -> dict[int, float]:
    """Each rank's median compute per unit of work (per sample without a cost)."""
    per: dict[int, list[float]] = {}
    for rows in aligned.values():
        for r, s in rows.items():
            u = _unit_cost(s)
            if u is not None:
                per.setdefault(r, []).append(u)
    return {r: statistics.median(v) for r, v in per.items() if v}


def _fit(aligned: _Steps, rank: int) -> tuple[float, float] | None:
    """``compute = c * b`` through the origin (median per sample), the solver's input."""
    per = [s.compute_ms / s.local_batch_size for rows in aligned.values()
           if (s := rows[rank]).local_batch_size > 0]
    return (0.0, statistics.median(per)) if per else None


def _top(values: Mapping[int, float], *, share: float = 0.5) -> tuple[int, ...]:
    """The ranks holding the larger values: each at least ``share`` of the largest."""
    if not values:
        return ()
    hi = max(values.values())
    if hi <= 0:
        return ()
    named = sorted((r for r, v in values.items() if v >= share * hi), key=lambda r: (-values[r], r))
    return tuple(sorted(named[:_MAX_RANKS_NAMED]))


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _fmt(ms: float) -> str:
    return f"{ms:.1f} ms" if ms >= 1 else f"{ms:.2f} ms"


def attribute(steps: Mapping[int, Sequence[CauseStep]], *, global_batch_size: int, steps_done: int,
              devices_per_rank: int = 1, window: int = 64) -> CauseReport:
    """The job's causes of lost time, largest first, from each rank's recent ``steps``.

    ``steps_done`` (the steps the run trained) and ``devices_per_rank`` (a mesh replica's
    size) price the time lost per step in GPU-hours so far: the cause's ``ms_per_step``
    times the steps done times every device of the job (each waits for the step)."""
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}.")
    if steps_done < 0 or devices_per_rank < 1:
        raise ValueError(f"steps_done must be >= 0 and devices_per_rank >= 1, got {steps_done} and {devices_per_rank}.")
    aligned = _aligned(steps, window)
    if not aligned:
        return CauseReport((), 0, None, None, 0.0)
    n_ranks = len(next(iter(aligned.values())))  # ranks with steps (all, once each has sent)
    ks = list(aligned)
    base = [_step(aligned[k], _arrivals(aligned[k]), _transfer(aligned[k])) for k in ks]
    base_mean = _mean(base)
    measured = _mean([statistics.median(s.step_ms for s in aligned[k].values()) for k in ks])
    gpu_h = steps_done * n_ranks * devices_per_rank / 3.6e6  # GPU-hours per ms of each step

    found: list[Cause] = []

    def add(cause: str, ranks: tuple[int, ...], replayed: list[float], remedy: str, detail: str = "") -> None:
        without = _mean(replayed)
        gain = base_mean - without
        if base_mean <= 0 or gain < _MIN_GAIN_SHARE * base_mean:
            return
        found.append(Cause(cause, ranks, gain, gain / base_mean, gain * gpu_h, without, remedy, detail))

    def replay(arrival_of: _Arrivals | None = None, transfer_of: _Transfer | None = None) -> list[float]:
        out = []
        for k in ks:
            rows = aligned[k]
            arr = arrival_of(k, rows) if arrival_of is not None else _arrivals(rows)
            x = transfer_of(k, rows) if transfer_of is not None else _transfer(rows)
            out.append(_step(rows, arr, x))
        return out

    # The slowest rank at the median speed.
    speeds = _rank_speeds(aligned)
    if len(speeds) >= 2:
        slow = max(speeds, key=lambda r: (speeds[r], -r))
        median = statistics.median(speeds.values())
        if speeds[slow] > median > 0:
            ratio = median / speeds[slow]

            def slow_arrivals(k: int, rows: Mapping[int, CauseStep]) -> dict[int, float]:
                arr = _arrivals(rows)
                arr[slow] -= _device_ms(rows[slow]) * (1.0 - ratio)
                return arr

            add("slow_rank", (slow,), replay(slow_arrivals),
                f"Rank {slow} computes {speeds[slow] / median:.2f}x the median time per sample: approve the "
                "policy's placement (it gives the rank less work), or check its device (throttling, a noisy neighbour).",
                f"rank {slow}: {speeds[slow]:.3g} ms per unit of work, median {median:.3g}")

    # The best placement for the ranks' measured speeds.
    order = sorted(aligned[ks[0]])
    fitted = [f for r in order if (f := _fit(aligned, r)) is not None]
    by_work = all(s.work is not None for rows in aligned.values() for s in rows.values())
    if len(order) >= 2 and len(fitted) == len(order) and not by_work:
        a = dict(zip(order, (f[0] for f in fitted), strict=True))
        slope = dict(zip(order, (f[1] for f in fitted), strict=True))
        try:
            best = dict(zip(order, solve([a[r] for r in order], [slope[r] for r in order], global_batch_size),
                            strict=True))
        except (InfeasibleError, ValueError):
            best = {}
        if best:
            def placed(k: int, rows: Mapping[int, CauseStep]) -> dict[int, float]:
                arr = _arrivals(rows)
                for r, s in rows.items():
                    now, then = a[r] + slope[r] * s.local_batch_size, a[r] + slope[r] * best[r]
                    # the step's own noise kept: its compute scaled by the modelled change
                    arr[r] += (s.compute_ms * then / now if now > 0 else then) - s.compute_ms
                return arr

            moved = {r: float(abs(best[r] - aligned[ks[-1]][r].local_batch_size)) for r in order}
            add("placement", _top(moved), replay(placed),
                f"The split {[best[r] for r in order]} balances the measured speeds: approve the policy's "
                "proposal (or set mode auto).")

    # Sample costs balanced: each rank's work per step an even share of the step's work.
    if by_work:
        even = {k: sum(s.work or 0.0 for s in aligned[k].values()) / len(aligned[k]) for k in ks}

        def balanced(k: int, rows: Mapping[int, CauseStep]) -> dict[int, float]:
            arr = _arrivals(rows)
            for r, s in rows.items():
                if s.work and s.work > 0:
                    arr[r] += s.compute_ms * (even[k] / s.work - 1.0)
            return arr

        skew = {r: _mean([max(0.0, (aligned[k][r].work or 0.0) - even[k]) for k in ks]) for r in aligned[ks[0]]}
        add("sample_cost_skew", _top(skew), replay(balanced),
            "Steps differ in work (sequence lengths): give the loader sample_length= (or sample_cost=) so each "
            "batch is split by work, or pack sequences to even lengths.")

    # The phases between and around the compute.
    def without(part: str) -> _Arrivals:
        def arrivals(k: int, rows: Mapping[int, CauseStep]) -> dict[int, float]:
            arr = _arrivals(rows)
            for r, s in rows.items():
                cut = {"data_wait": s.loader_ms, "host": s.host_ms, "checkpoint": s.ckpt_ms, "gc": s.gc_ms}[part]
                arr[r] -= min(cut, arr[r])
            return arr
        return arrivals

    def per_rank(part: str) -> dict[int, float]:
        get = {"data_wait": lambda s: s.loader_ms, "host": lambda s: s.host_ms,
               "checkpoint": lambda s: s.ckpt_ms, "gc": lambda s: s.gc_ms}[part]
        return {r: _mean([get(aligned[k][r]) for k in ks]) for r in aligned[ks[0]]}

    remedies = {
        "data_wait": "The loader keeps ranks waiting: more DataLoader workers (num_workers), pin_memory=True, a "
                     "larger prefetch_factor, or faster storage; check the named ranks' input pipeline.",
        "gc": "Python's garbage collector pauses steps: HookConfig(gc_freeze=True, gc_collect_every=N) freezes the "
              "heap after setup and collects on all ranks at once.",
        "host": "The training loop's own work between steps (logging, .item(), evaluation) holds the step: log "
                "every N steps and move the rest off the step path.",
        "checkpoint": "Checkpoint writes hold training: write asynchronously "
                      "(torch.distributed.checkpoint.async_save) or less often.",
    }
    for part, remedy in remedies.items():
        add(part, _top(per_rank(part)), replay(without(part)), remedy)

    # Communication at its best measured bandwidth.
    rates = [s.comm_ms / s.comm_bytes for rows in aligned.values() for s in rows.values()
             if s.comm_bytes and s.comm_ms]
    if rates:
        best_rate = min(rates)  # ms per byte at the best bandwidth

        def fastest(k: int, rows: Mapping[int, CauseStep]) -> float:
            last = min(rows.values(), key=lambda s: s.sync_wait_ms)  # the rank that arrived last
            x = last.sync_wait_ms
            if last.comm_bytes and last.comm_ms:
                return x * min(1.0, best_rate * last.comm_bytes / last.comm_ms)
            return x

        add("communication", tuple(order[:_MAX_RANKS_NAMED]), replay(transfer_of=fastest),
            "Transfers run below the best bandwidth this job measured: check the links (congestion, a slow NIC), "
            "larger gradient buckets (bucket_cap_mb), or overlap more communication with compute.")

    found.sort(key=lambda c: (-c.ms_per_step, CAUSES.index(c.cause)))
    # The GC share of the step (the job page's hint): the arriving-last rank's pauses.
    gc_share = 0.0
    if base_mean > 0:
        gc_share = _mean([max(rows.values(), key=lambda s: s.data_wait_ms + s.compute_ms).gc_ms
                          for rows in aligned.values()]) / base_mean
    for i, c in enumerate(found):
        if not c.detail:
            found[i] = Cause(c.cause, c.ranks, c.ms_per_step, c.share_of_step, c.gpu_hours_lost,
                             c.predicted_step_ms_without, c.remedy, f"{_fmt(c.ms_per_step)} of every step")
    return CauseReport(tuple(found), len(ks), measured, base_mean, gc_share)
