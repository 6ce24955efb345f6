"""Persistence windows: what one rank sent between two flushes, aggregated for storage.

Owns no state: ``LiveState.take_pending`` hands over the rows (``Pending``) and
``aggregate_windows`` turns them into ``Window``s, pure, so it may run off the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from backend.live.rows import (
    STEP_BATCH,
    STEP_COMPUTE,
    STEP_LOCAL_BATCH,
    STEP_T,
    STEP_VERSION,
    TIME_COLUMNS,
    DeviceRow,
    StepRow,
    device_sample,
)
from rebalancer_wire.protocol import STEP_TIMES, DeviceSample

__all__ = ["Window", "Pending", "aggregate_windows", "work_rates"]


@dataclass(frozen=True, slots=True)
class Window:
    """Aggregate of one rank's steps between two persistence flushes."""

    job: str
    rank: int
    t_start: float
    t_end: float
    batch_index_start: int
    batch_index_end: int
    n_steps: int
    placement_version: int
    local_batch_size: float
    compute_ms: float
    sync_wait_ms: float
    data_wait_ms: float
    optimizer_ms: float
    step_ms: float
    dropped: int
    device: DeviceSample | None
    # Means over the window's steps that carried communication counters (None: none did;
    # absent counters are stored as absent, never as 0).
    comm_bytes: float | None = None
    comm_ms: float | None = None


# What one rank sent since the last persistence flush: (job, rank, steps, device, dropped,
# (comm_bytes, comm_ms) of the steps with communication counters).
Pending = tuple[str, int, list[StepRow], list[DeviceRow], int, list[tuple[int, float | None]]]


def _comm_means(comm: list[tuple[int, float | None]]) -> tuple[float | None, float | None]:
    """Mean comm bytes and comm ms per step over the steps that carried them."""
    if not comm:
        return None, None
    ms = [m for _, m in comm if m is not None]
    return sum(b for b, _ in comm) / len(comm), (sum(ms) / len(ms) if ms else None)


def aggregate_windows(taken: list[Pending]) -> list[Window]:
    """One ``Window`` (means over the steps) per rank of ``take_pending``'s result. Pure:
    it reads only the lists it is given, so it may run off the event loop."""
    out = []
    for job, rank, steps, device, dropped, comm in taken:
        n = len(steps)
        comm_bytes, comm_ms = _comm_means(comm)
        if n == 1:  # one step a flush (large jobs' slow steps): the window is the step
            s = steps[0]
            out.append(Window(
                job=job, rank=rank, t_start=s[STEP_T], t_end=s[STEP_T], batch_index_start=s[STEP_BATCH],
                batch_index_end=s[STEP_BATCH], n_steps=1, placement_version=s[STEP_VERSION],
                local_batch_size=float(s[STEP_LOCAL_BATCH]), compute_ms=s[4], sync_wait_ms=s[5], data_wait_ms=s[3],
                optimizer_ms=s[6], step_ms=s[7], dropped=dropped, device=device_sample(device[-1]) if device else None,
                comm_bytes=comm_bytes, comm_ms=comm_ms))
            continue
        cols = list(zip(*steps, strict=True))
        out.append(Window(
            job=job, rank=rank, t_start=steps[0][STEP_T], t_end=steps[-1][STEP_T],
            batch_index_start=min(cols[STEP_BATCH]), batch_index_end=max(cols[STEP_BATCH]), n_steps=n,
            placement_version=steps[-1][STEP_VERSION], local_batch_size=sum(cols[STEP_LOCAL_BATCH]) / n,
            **{f: sum(cols[i]) / n for f, i in zip(STEP_TIMES, TIME_COLUMNS, strict=True)},
            dropped=dropped, device=device_sample(device[-1]) if device else None,
            comm_bytes=comm_bytes, comm_ms=comm_ms,
        ))
    return out


def work_rates(work: Iterable[tuple[int, float, float, float | None, float | None]], win: list[StepRow]) -> tuple[float | None, float | None]:
    """(work per second of compute, mean work share) over the window's steps that carry work."""
    compute = {row[STEP_BATCH]: row[STEP_COMPUTE] for row in win}
    done = ms = share = 0.0
    n = 0
    for k, w, bw, *_ in work:
        c = compute.get(k)
        if c is None:
            continue
        done += w
        ms += c
        share += w / bw if bw > 0 else 0.0
        n += 1
    if n == 0:
        return None, None
    return (done / (ms / 1000.0) if ms > 0 else None), share / n
