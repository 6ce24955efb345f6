"""Communication of a job, derived per step from what its ranks measured: the one home of
transfer time, wait for peers, bus bandwidth, exposed communication and the verdict.

Per step (batch index) over the ranks that reported it:

- transfer time: the collective time of the rank that arrived last (the smallest
  ``comm_ms``): it waited for nobody, so its time inside the collectives is moving bytes
  (DeepSpeed's straggler report: latency minus the all-reduce's minimum);
- wait for peers of a rank: its ``comm_ms`` minus that transfer time;
- exposed communication: the last arriver's ``sync_wait_ms`` (the part of its collective
  time no compute hid); the smallest sync wait of the step, which no split changes;
- algbw = bytes / transfer time; busbw = algbw x the nccl-tests factor: 2(n-1)/n for
  all-reduce, (n-1)/n for reduce-scatter and all-gather.

The verdict splits the step (the median rank's ``step_ms``) into the slowest rank's
compute, the exposed communication and the longest data wait: a part at or above
``BOUND_SHARE`` of the step names the job compute-, communication- or input-bound; none:
``balanced``. ``unknown`` until a step was seen. Counters a rank did not report stay
None, never 0.

Pure: no I/O, no torch; everything that shows or prices communication calls ``assess``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

__all__ = ["BOUND_SHARE", "BOUNDS", "CommStep", "RankComm", "Communication", "assess", "bus_factor",
           "bandwidth_gbps", "comm_bound_text"]

BOUND_SHARE = 0.5  # a part of the step at least this large names what the job is bound by
BOUNDS = ("compute-bound", "communication-bound", "input-bound", "balanced", "unknown")
_KINDS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True, slots=True)
class CommStep:
    """One rank's step as ``assess`` reads it (``comm_*`` None where not measured)."""

    batch_index: int
    compute_ms: float
    sync_wait_ms: float
    data_wait_ms: float
    step_ms: float
    comm_bytes: int | None = None
    comm_ms: float | None = None


@dataclass(frozen=True, slots=True)
class RankComm:
    """One rank's communication, means over the steps assessed (None: not measured)."""

    rank: int
    comm_bytes_per_step: float | None
    comm_ms: float | None  # time with a collective in flight
    wait_ms: float | None  # of which waiting for peers
    exposed_ms: float | None  # its sync wait: the part no compute hid (waits included)
    busbw_gbps: float | None


@dataclass(frozen=True, slots=True)
class Communication:
    """A job's communication and what bounds its step (``assess``)."""

    kind: str  # the collective (Hello.comm_kind); "" unknown
    world_size: int
    n_steps: int  # steps assessed
    bound: str  # one of BOUNDS
    step_ms: float | None
    compute_ms: float | None  # the slowest rank's compute
    exposed_comm_ms: float | None  # the last arriver's sync wait
    data_wait_ms: float | None  # the longest data wait
    bytes_per_step: float | None
    transfer_ms: float | None  # the last arriver's time inside the collectives
    algbw_gbps: float | None
    busbw_gbps: float | None
    compute_share: float | None
    comm_share: float | None
    input_share: float | None
    ranks: tuple[RankComm, ...] = ()
    detail: str = ""
    # The rest of the last arriver's step (optimizer, framework): neither compute, nor
    # communication, nor data wait, and no split changes it.
    other_ms: float | None = None

    def figures(self) -> dict[str, object]:
        """The verdict with its figures, as the REST ``bound`` object carries them."""
        return {
            "verdict": self.bound, "detail": self.detail, "n_steps": self.n_steps, "kind": self.kind or None,
            "step_ms": self.step_ms, "compute_ms": self.compute_ms, "exposed_comm_ms": self.exposed_comm_ms,
            "data_wait_ms": self.data_wait_ms, "compute_share": self.compute_share,
            "comm_share": self.comm_share, "input_share": self.input_share,
            "comm_bytes_per_step": self.bytes_per_step, "transfer_ms": self.transfer_ms,
            "algbw_gbps": self.algbw_gbps, "busbw_gbps": self.busbw_gbps,
        }


def bus_factor(kind: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth factor: 2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter
    and all-gather."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {', '.join(_KINDS)}, got {kind!r}.")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}.")
    n = world_size
    return 2.0 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def bandwidth_gbps(nbytes: float, ms: float, kind: str, world_size: int) -> tuple[float, float] | None:
    """(algbw, busbw) in GB/s (1e9 bytes) of ``nbytes`` moved in ``ms``; None for no time."""
    if not (math.isfinite(nbytes) and nbytes >= 0):
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}.")
    factor = bus_factor(kind, world_size)
    if not (math.isfinite(ms) and ms > 0):
        return None
    alg = nbytes / (ms / 1e3) / 1e9
    return alg, alg * factor


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _verdict(compute: float, exposed: float, data: float, step: float) -> str:
    if step <= 0:
        return "unknown"
    parts = {"compute-bound": compute / step, "communication-bound": exposed / step, "input-bound": data / step}
    name, share = max(parts.items(), key=lambda p: p[1])
    return name if share >= BOUND_SHARE else "balanced"


def comm_bound_text(c: Communication) -> str:
    """What the communication costs the step, in figures (a clause of the verdict)."""
    if c.comm_share is None:
        return ""
    what = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter"}.get(c.kind, "communication")
    text = f"{c.comm_share:.0%} of the step is exposed {what}"
    if c.busbw_gbps is not None:
        text += f" at {c.busbw_gbps:.3g} GB/s busbw"
    return text


def assess(kind: str, world_size: int, steps: Mapping[int, Sequence[CommStep]],
           window: int = 20) -> Communication:
    """The job's communication over the newest ``window`` batch indices that every rank in
    ``steps`` (rank -> its steps, oldest first) reported."""
    if kind not in ("", *_KINDS):
        raise ValueError(f"kind must be one of {', '.join(_KINDS)} or empty, got {kind!r}.")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}.")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}.")
    by_rank = {r: {s.batch_index: s for s in ss} for r, ss in steps.items() if ss}
    common: set[int] = set.intersection(*(set(m) for m in by_rank.values())) if by_rank else set()
    ks = sorted(common)[-window:]
    ranks = sorted(by_rank)
    if not ks:
        return Communication(kind, world_size, 0, "unknown", None, None, None, None, None, None, None, None,
                             None, None, None, tuple(RankComm(r, None, None, None, None, None) for r in sorted(steps)),
                             "no step reported by every rank yet")
    step_l, compute_l, exposed_l, data_l, other_l = [], [], [], [], []
    transfer_l: list[float] = []
    bytes_l: list[float] = []
    waits: dict[int, list[float]] = {r: [] for r in ranks}
    comms: dict[int, list[float]] = {r: [] for r in ranks}
    rbytes: dict[int, list[float]] = {r: [] for r in ranks}
    rbus: dict[int, list[float]] = {r: [] for r in ranks}
    exposed_r: dict[int, list[float]] = {r: [] for r in ranks}
    n = world_size
    for k in ks:
        row = [by_rank[r][k] for r in ranks]
        step_l.append(statistics.median(s.step_ms for s in row))
        compute_l.append(max(s.compute_ms for s in row))
        exposed_l.append(min(s.sync_wait_ms for s in row))
        data_l.append(max(s.data_wait_ms for s in row))
        last = min(row, key=lambda s: s.sync_wait_ms)  # the last to arrive at the collective
        other_l.append(max(0.0, last.step_ms - last.compute_ms - last.sync_wait_ms - last.data_wait_ms))
        for r, s in zip(ranks, row, strict=True):
            exposed_r[r].append(s.sync_wait_ms)
            if s.comm_bytes is not None:
                rbytes[r].append(float(s.comm_bytes))
        timed = [s.comm_ms for s in row if s.comm_ms is not None]
        if len(timed) != len(row):
            continue
        transfer = min(timed)
        transfer_l.append(transfer)
        sent = [s.comm_bytes for s in row if s.comm_bytes is not None]
        if sent:
            bytes_l.append(statistics.median(sent))
        for r, s in zip(ranks, row, strict=True):
            assert s.comm_ms is not None
            comms[r].append(s.comm_ms)
            waits[r].append(s.comm_ms - transfer)
            if kind and s.comm_bytes is not None and transfer > 0:
                bw = bandwidth_gbps(s.comm_bytes, transfer, kind, n)
                if bw is not None:
                    rbus[r].append(bw[1])
    step, compute, exposed, data = (_mean(x) for x in (step_l, compute_l, exposed_l, data_l))
    assert step is not None and compute is not None and exposed is not None and data is not None
    transfer_ms = _mean(transfer_l)
    bytes_per_step = _mean(bytes_l) if bytes_l else None
    algbw = busbw = None
    if kind and bytes_per_step is not None and transfer_ms is not None:
        bw = bandwidth_gbps(bytes_per_step, transfer_ms, kind, n)
        if bw is not None:
            algbw, busbw = bw
    shares = (compute / step, exposed / step, data / step) if step > 0 else (None, None, None)
    bound = _verdict(compute, exposed, data, step)
    rank_comm = tuple(
        RankComm(r, _mean(rbytes[r]), _mean(comms[r]), _mean(waits[r]), _mean(exposed_r[r]), _mean(rbus[r]))
        for r in ranks)
    c = Communication(kind, world_size, len(ks), bound, step, compute, exposed, data, bytes_per_step,
                      transfer_ms, algbw, busbw, shares[0], shares[1], shares[2], rank_comm,
                      other_ms=_mean(other_l))
    return _with_detail(c)


def _with_detail(c: Communication) -> Communication:
    assert c.step_ms is not None and c.compute_share is not None and c.input_share is not None
    if c.bound == "unknown":
        return c
    step = f"{c.step_ms:.3g} ms step"
    figures = [f"compute {c.compute_share:.0%}", comm_bound_text(c), f"data wait {c.input_share:.0%}"]
    head = {"compute-bound": "compute-bound", "communication-bound": "communication-bound",
            "input-bound": "input-bound", "balanced": "balanced"}[c.bound]
    return replace(c, detail=f"{head}: {step}; " + "; ".join(f for f in figures if f))

