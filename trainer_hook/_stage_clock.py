"""StageClock: one pipeline rank's times inside its schedule (trainer_hook.pipeline owns the
schedule; this only measures it).

Per step: forward and backward time per micro-batch (host clock: CPU jobs; on a device these
are launch times), the time blocked in the schedule's sends and in its receives, and the
bubble, the time in the schedule neither computing nor in the data-parallel gradient
reduction (docs/protocol.md, a pipeline leader's record). The stage's methods are wrapped
on the instance; the schedules' p2p helpers, which they call by module name, are swapped
for the schedule call only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from trainer_hook.gradients import GradientState

__all__ = ["StageClock", "StageTimes"]


@dataclass(slots=True)
class StageTimes:
    """One pipeline rank's step inside the schedule (milliseconds). ``fwd_ms``/``bwd_ms`` are
    per micro-batch (the last stage's loss counts as forward; an interleaved rank's model
    stages summed); ``send_wait_ms``/``recv_wait_ms`` the time blocked in sends and in
    receives; ``bubble_ms`` the time in the schedule neither computing nor in the
    data-parallel gradient reduction; ``schedule_ms`` the whole call."""

    batch_index: int
    stage: int
    micro_batches: int
    fwd_ms: float
    bwd_ms: float
    send_wait_ms: float
    recv_wait_ms: float
    bubble_ms: float
    schedule_ms: float
    dp_wait_ms: float = 0.0  # the data-parallel gradient reduction's wait inside the last backward

    def columns(self) -> tuple[float, float, float, float, float]:
        """The five per-stage numbers of a pipeline leader's record, in PIPELINE_STAGE_FIELDS order."""
        return (self.fwd_ms, self.bwd_ms, self.send_wait_ms, self.recv_wait_ms, self.bubble_ms)


class _StepLog:
    """Host timestamps of one schedule call: compute windows and the p2p waits."""

    __slots__ = ("fwd", "bwd", "send_s", "recv_s", "t0", "t1", "n_fwd", "n_bwd", "kinds")

    def __init__(self) -> None:
        self.fwd: list[tuple[float, float]] = []
        self.bwd: list[tuple[float, float]] = []
        self.send_s = self.recv_s = 0.0
        self.t0 = self.t1 = 0.0
        self.n_fwd = self.n_bwd = 0
        self.kinds: dict[int, bool] = {}  # id of a work list -> it holds a receive


class StageClock:
    """Times the schedule calls of this rank's stages."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._log = _StepLog()
        self._wrapped: set[int] = set()
        self.last: StageTimes | None = None

    def watch(self, stage: Any) -> None:
        """Time this stage's forward and backward chunks (once per stage)."""
        if id(stage) in self._wrapped:
            return
        self._wrapped.add(id(stage))
        clock = self._clock

        def timed(method: Callable[..., Any], forward: bool, counts: bool) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                t = clock()
                try:
                    return method(*args, **kwargs)
                finally:
                    log = self._log
                    if forward:
                        log.fwd.append((t, clock()))
                        log.n_fwd += counts
                    else:
                        log.bwd.append((t, clock()))
                        log.n_bwd += counts
            return run

        # Instance attributes shadow the class's methods: this stage only.
        stage.forward_one_chunk = timed(stage.forward_one_chunk, True, True)
        stage.backward_one_chunk = timed(stage.backward_one_chunk, False, True)
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, False, False)

    def timed_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``loss_fn``, its time counted as the last stage's forward."""
        clock = self._clock

        def loss(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return loss_fn(*args, **kwargs)
            finally:
                self._log.fwd.append((t, clock()))
        return loss

    @contextmanager
    def schedule_call(self) -> Iterator[None]:
        """Around one ``schedule.step``: the wall time and each p2p wait, sends and receives apart."""
        from torch.distributed.pipelining import schedules

        s: Any = schedules
        log = self._log = _StepLog()
        clock = self._clock
        batch, sorted_batch, wait = s._batch_p2p, s._sorted_batch_p2p, s._wait_batch_p2p

        def tagged_batch(ops: list[dist.P2POp], *a: Any, **kw: Any) -> list[dist.Work]:
            works = batch(ops, *a, **kw)
            log.kinds[id(works)] = any(op.op is dist.irecv for op in ops)
            return works

        def tagged_sorted(ops: list[dist.P2POp], *a: Any, **kw: Any) -> dict[int, list[dist.Work]]:
            by_peer = sorted_batch(ops, *a, **kw)
            recv = any(op.op is dist.irecv for op in ops)
            for works in by_peer.values():
                log.kinds[id(works)] = recv
            return by_peer

        def timed_wait(work: list[dist.Work]) -> None:
            t = clock()
            try:
                wait(work)
            finally:
                if log.kinds.get(id(work), True):  # a combined send+receive waits as a receive
                    log.recv_s += clock() - t
                else:
                    log.send_s += clock() - t

        log.t0 = clock()
        s._batch_p2p, s._sorted_batch_p2p, s._wait_batch_p2p = tagged_batch, tagged_sorted, timed_wait
        try:
            yield
        finally:
            s._batch_p2p, s._sorted_batch_p2p, s._wait_batch_p2p = batch, sorted_batch, wait
            log.t1 = clock()

    def finish(self, grads: GradientState, batch_index: int, stages: Sequence[Any], count: int) -> StageTimes | None:
        """The times of the step that ended (after ``grads.collect()``), or None without a schedule call."""
        log, self._log = self._log, _StepLog()
        if log.t1 <= log.t0 or not stages:
            return None
        fwd = sum(b - a for a, b in log.fwd)
        bwd = sum(b - a for a, b in log.bwd)
        # The data-parallel reduction runs inside the last backward: waiting, not computing.
        t_grad, t_done = grads.last_bucket_t, grads.last_done_t
        sync = 0.0
        if t_grad is not None and t_done is not None and t_done > t_grad:
            for a, b in log.bwd:
                sync += max(0.0, min(b, t_done) - max(a, t_grad))
        bwd = max(0.0, bwd - sync)
        wall = log.t1 - log.t0
        bubble = max(0.0, wall - fwd - bwd - sync)
        per = len(stages)  # an interleaved rank: its model stages summed
        self.last = StageTimes(
            batch_index=batch_index, stage=int(stages[0].group_rank), micro_batches=count,
            fwd_ms=1e3 * fwd * per / max(1, log.n_fwd), bwd_ms=1e3 * bwd * per / max(1, log.n_bwd),
            send_wait_ms=1e3 * log.send_s, recv_wait_ms=1e3 * log.recv_s, bubble_ms=1e3 * bubble,
            schedule_ms=1e3 * wall, dp_wait_ms=1e3 * sync)
        return self.last
