"""StepTimer: splits each step into data-wait, compute, sync-wait and optimizer time.

Data-wait is the gap between the end of the previous step and the start of this one
(the loader's turn), less the hook's own collectives on entry (the placement exchange, the
lookahead's agreement): those are sync wait (docs/design.md invariant 11). Compute ends when the last gradient bucket is handed to the comm
hook (local gradients ready); sync-wait runs from there until the last reduction
completes; the rest until the step ends is the optimizer (docs/design.md invariant 4).
Waits for peers before the gradients are ready (FSDP's unshard all-gathers, blocking
reductions before the last: ``GradientState.wait_s``/``wait_events``) move from compute
to sync-wait. The record also carries the step's communication: ``comm_bytes`` handed to
gradient collectives and ``comm_ms``, the time one was in flight (overlapped with compute
or not; ``sync_wait_ms`` is the exposed part), None where not measured. With a
``PhaseClock`` it carries the GC pauses, host and checkpoint time of the step too.

On a device torch offers timing events for (CUDA, XPU, MPS: ``gradients.timing_event``)
the hook records events instead of timestamps; they are read one step later with
``Event.query()`` so the training thread never synchronises the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rebalancer_wire.protocol import StepRecord
from trainer_hook.gradients import GradientState, _recorded_event
from trainer_hook.phases import PhaseClock

__all__ = ["StepTimer", "split_step"]


def split_step(
    t0: float, t_end: float, t_grad: float | None, t_done: float | None, wait: float = 0.0
) -> tuple[float, float, float]:
    """(compute_s, sync_wait_s, optimizer_s) of one step from its timestamps (seconds) and
    the time ``wait`` spent waiting for peers before the gradients were ready."""
    if t_grad is None or t_grad < t0 or t_grad > t_end:
        compute, sync, opt = t_end - t0, 0.0, 0.0
    elif t_done is None or t_done < t_grad:
        compute, sync, opt = t_grad - t0, 0.0, t_end - t_grad
    else:
        t_done = min(t_done, t_end)
        compute, sync, opt = t_grad - t0, t_done - t_grad, t_end - t_done
    wait = min(max(wait, 0.0), compute)
    return compute - wait, sync + wait, opt


class StepTimer:
    """Timestamps one step at a time; ``finish`` returns the StepRecord (or None, with
    events, until the events of an earlier step are complete)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
        phases: PhaseClock | None = None,
    ) -> None:
        self._clock = clock
        self._phases = phases  # GC pauses, loader and checkpoint time (trainer_hook.phases)
        self._wall = wall
        self._prev_end: float | None = None
        self._t0 = 0.0
        self._meta: tuple[int, int, int] = (0, 0, 0)
        self._data_wait = 0.0
        self._events: Any = None
        self._start_event: Any = None
        self._pending_events: list[tuple[Any, ...]] = []
        self._pre_sync = 0.0

    @property
    def clock(self) -> Callable[[], float]:
        """The host clock the timer reads (``time.perf_counter`` unless a test froze it)."""
        return self._clock

    def start(self, batch_index: int, local_batch_size: int, placement_version: int, *, events: Any = None,
              waited: float = 0.0) -> None:
        """A step starts; ``events``: the device's timing event class (``GradientState.events``),
        None for host timestamps; ``waited``: seconds the hook's own collectives took on entry
        (the placement exchange, the lookahead's agreement), sync wait rather than data wait."""
        t0 = self._clock()
        self._t0 = t0
        prev = self._prev_end
        gap = 0.0 if prev is None or t0 < prev else t0 - prev
        pre = min(max(waited, 0.0), gap)
        self._pre_sync = pre
        self._data_wait = gap - pre
        self._meta = (batch_index, local_batch_size, placement_version)
        self._events = events
        self._start_event = None if events is None else _recorded_event(events)

    def finish(self, grads: GradientState | None) -> StepRecord | None:
        t_end = self._clock()
        self._prev_end = t_end
        k, local, version = self._meta
        phases = self._phases
        if self._start_event is not None and grads is not None and grads.grad_event is not None:
            end_ev = _recorded_event(self._events)
            taken = phases.take(self._data_wait, self._data_wait + t_end - self._t0) if phases is not None else None
            self._pending_events.append(
                (self._start_event, grads.grad_event, grads.done_event, end_ev, grads.wait_events, k, local,
                 version, self._data_wait, t_end - self._t0, self._wall(), grads.comm_bytes or None, self._pre_sync, taken)
            )
            return self._read_events()
        t0 = self._t0
        comm_bytes: int | None = None
        comm_ms: float | None = None
        if grads is None:
            t_grad = t_done = None
            wait = 0.0
        else:
            t_grad, t_done, wait = grads.last_bucket_t, grads.last_done_t, grads.wait_s
            if grads.comm_bytes:
                comm_bytes = grads.comm_bytes
                comm_s = grads.comm_s
                if comm_s is not None:
                    comm_ms = comm_s * 1e3
        # split_step(), inlined: this runs on the training thread every step.
        if t_grad is None or t_grad < t0 or t_grad > t_end:
            compute, sync, opt = t_end - t0, 0.0, 0.0
        elif t_done is None or t_done < t_grad:
            compute, sync, opt = t_grad - t0, 0.0, t_end - t_grad
        else:
            if t_done > t_end:
                t_done = t_end
            compute, sync, opt = t_grad - t0, t_done - t_grad, t_end - t_done
        if wait > 0.0:
            if wait > compute:
                wait = compute
            compute -= wait
            sync += wait
        data_wait = self._data_wait
        pre = self._pre_sync
        rec = StepRecord(
            batch_index=k, local_batch_size=local, placement_version=version,
            data_wait_ms=data_wait * 1e3, compute_ms=compute * 1e3, sync_wait_ms=(sync + pre) * 1e3,
            optimizer_ms=opt * 1e3, step_ms=(data_wait + pre + t_end - t0) * 1e3, t=self._wall(),
            comm_bytes=comm_bytes, comm_ms=comm_ms,
        )
        if phases is not None:
            rec.host_ms, rec.ckpt_ms, rec.gc_ms = phases.take(data_wait, data_wait + t_end - t0)
        return rec

    def _read_events(self) -> StepRecord | None:
        # Oldest pending step whose end event has completed; query() never blocks.
        if not self._pending_events[0][3].query():
            if len(self._pending_events) > 8:
                self._pending_events.pop(0)  # the device is far behind; give up on the oldest
            return None
        start, grad, done, end, waits, k, local, version, data_wait, cpu_s, t, comm_bytes, pre, taken = self._pending_events.pop(0)
        total = start.elapsed_time(end)
        compute = start.elapsed_time(grad)
        sync = grad.elapsed_time(done) if done is not None and done.query() else 0.0
        sync = max(0.0, min(sync, total - compute))
        if waits:  # recorded on the compute stream before the end event: complete too
            wait = min(max(0.0, sum(a.elapsed_time(b) for a, b in waits)), max(0.0, compute))
            compute -= wait
            sync += wait
        rec = StepRecord(
            batch_index=k, local_batch_size=local, placement_version=version,
            data_wait_ms=data_wait * 1e3, compute_ms=max(0.0, compute), sync_wait_ms=sync + pre * 1e3,
            optimizer_ms=max(0.0, total - compute - sync),
            step_ms=(data_wait + pre) * 1e3 + max(total, cpu_s * 1e3), t=t, comm_bytes=comm_bytes,
        )
        if taken is not None:  # host-timed at the step's end: within its data wait and host time
            rec.host_ms, rec.ckpt_ms, rec.gc_ms = taken
        return rec
