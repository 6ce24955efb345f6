"""StepLoop: the hot path of ``hook.step()``. Owns where training stands (the next batch
index), the lookahead agreed at the first step, and each step's entry (the exchange when
due, the batch's gradient weight, the timers) and exit (its record, to the Connection or
the replica's pace); also where the watchdog finds training, and the out-of-memory report.
No network or file I/O and no device sync here."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rebalancer_wire.protocol import Oom
from trainer_hook._connection import Connection
from trainer_hook._micro_steps import MicroSteps
from trainer_hook._placements import Placements
from trainer_hook._weights import Weighting
from trainer_hook.channel import ControlChannel
from trainer_hook.config import HookConfig
from trainer_hook.gradients import GradientState
from trainer_hook.memory import MemoryMeter, MemoryReading, is_out_of_memory
from trainer_hook.mesh import ReplicaPace
from trainer_hook.phases import GcSchedule
from trainer_hook.pipeline import PipelineSchedules
from trainer_hook.placement import PlacementSchedule, ScheduledPlacement
from trainer_hook.sampler import RebalanceBatchSampler
from trainer_hook.timing import StepTimer

log = logging.getLogger("trainer_hook")
_OOM_FLUSH_S = 2.0  # how long an out-of-memory report may hold the failing step


class Steps(Protocol):
    """What a step's context calls: a StepLoop (or, before the process group, the hook's
    stand-in that builds the components first)."""

    def begin(self) -> int: ...

    def end(self, *, failed: bool) -> None: ...

    def report_oom(self, exc: BaseException) -> None: ...


class StepContext:
    """The object ``hook.step()`` returns; reused every step to keep the hot path small."""

    __slots__ = ("steps",)

    def __init__(self, steps: Steps) -> None:
        self.steps = steps

    def __enter__(self) -> int:
        return self.steps.begin()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        steps = self.steps
        if exc_type is not None and is_out_of_memory(exc):
            steps.report_oom(exc)  # before the exception reaches the training loop
        steps.end(failed=exc_type is not None)


def refuse_closed(forked: bool) -> RuntimeError:
    if forked:
        return RuntimeError(
            "This RebalanceHook belongs to the parent process; a forked child (a DataLoader "
            "worker) must not train with it. Create hooks in the training process only."
        )
    return RuntimeError("This RebalanceHook is closed; create a new one to train further.")


class _NoExchange:
    """Stands in for the control channel while the lookahead is not agreed yet."""

    due = 1 << 62

    def on_step(self, batch_index: int) -> None:  # never reached: due is unreachable
        pass


_NO_EXCHANGE: Any = _NoExchange()


class StepLoop:
    """Entry and exit of ``hook.step()`` for a RebalanceHook."""

    def __init__(self, *, config: HookConfig, rank: int, schedule: PlacementSchedule, channel: ControlChannel,
                 placements: Placements, weighting: Weighting, micro: MicroSteps | None,
                 connection: Connection, grads: GradientState, timer: StepTimer,
                 memory: MemoryMeter | None, gc_schedule: GcSchedule | None, pace: ReplicaPace | None,
                 pipeline: PipelineSchedules | None = None) -> None:
        self._config = config
        self._rank = rank
        self._schedule = schedule
        self._channel = channel
        self._placements = placements
        self._weighting = weighting
        self._micro = micro
        self._conn = connection
        self._grads = grads
        self._timer = timer
        self._memory = memory
        self._gc_schedule = gc_schedule
        self._pace = pace
        self._pipeline = pipeline  # PP x DP: the step's schedule and its stage times (trainer_hook.pipeline)
        self.next_batch = 0  # the global batch index the next step trains
        self.sampler: RebalanceBatchSampler | None = None  # the sampler created last (hook.batch_sampler)
        # The lookahead in force: given, or measured at the first step (None until then).
        self.lookahead: int | None = config.lookahead if isinstance(config.lookahead, int) else None
        self.known_lookahead = 0  # what hook.data_loader() knows its loader needs
        self._agree_at = 0  # the batch index at which to measure and agree on it
        self.closed = False
        self.forked = False
        self._started = False
        self._entry_wait = 0.0  # seconds the pace check after the last step waited (sync wait)
        self._full_for: ScheduledPlacement | None = None  # placement self._full was computed for
        self._full: tuple[int, float] = (0, 0.0)  # (local samples, weight) of a full batch under it
        self._frozen: list[torch.nn.Module] = []
        self._mem_pending: MemoryReading | None = None

    def begin(self) -> int:
        if self.closed:
            raise refuse_closed(self.forked)
        if not self._started:
            self._placements.ensure_started(self.next_batch)
            self._started = True
        k = self.next_batch
        channel = self._channel
        # In the hook's own collectives: sync wait, not data wait (invariant 11); a replica's
        # pace check at the end of the previous step included.
        waited, self._entry_wait = self._entry_wait, 0.0
        if self.lookahead is None:
            clock = self._timer.clock
            t = clock()
            self._agree_lookahead(k)
            waited = clock() - t
            if self.lookahead is None:  # postponed: no exchange may start a placement yet
                channel = _NO_EXCHANGE
        if k >= channel.due:  # an exchange to collect or launch; otherwise nothing to do
            clock = self._timer.clock
            t = clock()
            channel.on_step(k)
            waited += clock() - t
        p = self._schedule.at(k)
        sampler = self.sampler
        b = self._config.global_batch_size
        if sampler is not None and sampler.has_cost:  # a cost partition: the count varies per batch
            local = sampler.local_size(k)
            weight = local / sampler.batch_length(k)
        elif sampler is None or sampler.batch_length(k) == b:
            # Full batch: this rank's share and weight only change with the placement.
            if p is not self._full_for:
                local = p.shares[self._rank]
                # Micro-batch shares: each micro-batch's gradient is 1/M of the step's.
                micro = self._micro is not None
                self._full = (local, (1.0 / b if local else 0.0) if micro else local / b)
                self._full_for = p
            local, weight = self._full
        else:  # an epoch's short last batch, split in proportion by the sampler
            n = sampler.batch_length(k)
            lo, hi = sampler.local_bounds(k)
            local = hi - lo
            weight = local / n
        grads = self._grads
        grads.reset()
        grads.weight = weight
        if local == 0 and self._weighting.norms:
            self._freeze_norms(self._weighting.norms)
        placements = self._placements
        if p is not placements.trained or p.version != placements.trained_version:
            placements.enter(p, k)  # a new version: acked
        if self._memory is not None:
            self._memory.begin(local)
        if self._gc_schedule is not None:  # HookConfig gc_freeze / gc_collect_every
            self._gc_schedule.on_step(k)
        self._timer.start(k, local, p.version, events=grads.events, waited=waited)
        if self._pipeline is not None:
            self._pipeline.step_begins(k, p.shares)
        if self._micro is not None:
            self._micro.step_begins(k, p)
        return k

    def _agree_lookahead(self, k: int) -> None:
        """How far the loader asks the sampler ahead of training, agreed across ranks.

        At the first step, one blocking all-reduce (MAX) on the control group of
        ``[ahead + 1, truncated]``. Every batch asked for so far is at most ``k +
        lookahead - 1``, and the first exchange's placement starts at ``k + lag +
        lookahead`` or later, so nothing a loader holds can change. A loader can only run
        ahead to the end of its epoch; when a run starts (resumes) so near the end that
        the sampler ran out, the measure is short, so it is taken again at the first
        step of the next epoch, with no exchange before (placements wait, a few steps).
        """
        if k < self._agree_at:
            return
        sampler = self.sampler
        ahead, truncated = 0, 0
        if sampler is not None:
            ahead = sampler.furthest - k
            per_epoch = len(sampler)
            epoch_end = (k // per_epoch + 1) * per_epoch - 1
            truncated = int(sampler.furthest >= epoch_end and k % per_epoch != 0 and self._agree_at == 0)
        lookahead = max(1, ahead + 1, self.known_lookahead)
        group = self._channel.group
        if group is not None:
            buf = torch.tensor([lookahead, truncated], dtype=torch.int64)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
            lookahead, truncated = (int(v) for v in buf.tolist())
        if truncated and sampler is not None:
            self._agree_at = (k // len(sampler) + 1) * len(sampler)
            return
        self.lookahead = lookahead
        self._channel.set_lookahead(k, lookahead)

    def _freeze_norms(self, norms: list[torch.nn.Module]) -> None:
        # Eval mode for the dummy step: normalise with the running statistics, update none.
        self._frozen = [m for m in norms if m.training]
        for m in self._frozen:
            m.train(False)

    def end(self, *, failed: bool) -> None:
        micro, pipeline = self._micro, self._pipeline
        if pipeline is not None:  # the step ran its pipeline schedule, not hook.micro_batches()
            pipeline.step_ends()
            if not failed:
                pipeline.check_step()
        elif micro is not None:
            micro.step_ends()
            if not failed:
                micro.check_step()
        if self._frozen:
            for m in self._frozen:
                m.train(True)
            self._frozen = []
        self._grads.collect()
        rec = self._timer.finish(self._grads)
        if failed:
            return
        self.next_batch += 1
        if self._memory is not None:
            reading = self._memory.end()
            if reading is not None:
                self._mem_pending = reading
            pending = self._mem_pending
            # On CUDA the record comes a step or more late: it carries the reading when it
            # trained at the same local batch size (a newer reading replaces one that waits).
            if pending is not None and rec is not None and rec.local_batch_size == pending.local_batch_size:
                rec.mem_peak_bytes, rec.mem_reserved_bytes, rec.mem_total_bytes = pending[1:]
                self._mem_pending = None
        sampler = self.sampler
        if rec is not None and sampler is not None and sampler.has_cost:
            rec.work = sampler.local_work(rec.batch_index) if rec.local_batch_size else 0.0
            rec.batch_work = sampler.batch_work(rec.batch_index)
            sq = sampler.local_work_sq(rec.batch_index)
            if sq is not None:
                rec.work_sq = sq[0] if rec.local_batch_size else 0.0
                rec.batch_work_sq = sq[1]
        stage_ms: tuple[float, ...] | None = None
        if pipeline is not None and rec is not None:  # this stage's times, for its pipeline's leader
            stage_ms = pipeline.stage_columns(self._grads, rec.batch_index, rec.compute_ms)
        pace = self._pace
        if pace is not None:  # the leader reports its replica's pace (the slowest member's times)
            if rec is not None:
                if not pace.leader:
                    self._conn.history.append(rec)  # a member keeps its own; the leader sends
                # Which samples it trained: the replica's members must agree (checked a window on).
                fp = (sampler.samples_fingerprint(rec.batch_index) if sampler is not None
                      else hash((rec.placement_version, rec.local_batch_size)))
                for r in pace.add(rec, fp, stage_ms):  # only a record whose window left already
                    self._conn.report(r)
            clock = self._timer.clock
            t = clock()
            pace.on_step_end(self.next_batch, self._grads.events is not None)  # may wait for the last window
            self._entry_wait = clock() - t
        elif rec is not None:
            self._conn.report(rec)
        if self._grads.repeated_bucket:
            raise RuntimeError(
                "Gradients were all-reduced more than once in one hook.step(): gradient "
                "accumulation must wrap every micro-batch but the last in model.no_sync(), "
                "otherwise each micro-batch is weighted as a whole batch and the math changes."
            )

    def where(self) -> tuple[int, str, float, float] | None:
        """The watchdog's thread: where training is (``trainer_hook.watchdog.Where``)."""
        t = self._timer
        prev = t._prev_end
        if prev is None:
            return None
        history = self._conn.history
        last = history[-1] if history else None
        step_s = last.step_ms / 1e3 if last is not None else 0.0
        if t._t0 > prev:  # inside hook.step()
            g = self._grads
            phase = "compute" if g.last_bucket_t is None else "sync_wait" if g.last_done_t is None else "optimizer"
            return t._meta[0], phase, prev, step_s
        return self.next_batch, "data_wait", prev, step_s

    def report_oom(self, exc: BaseException) -> None:
        """Tell the backend this rank ran out of memory, and wait (up to 2 s) until the
        message left: the process is about to die with the job."""
        try:
            k, local, version = self._timer._meta
            meter = self._memory
            oom = Oom(job=self._config.job_name, rank=self._rank, version=version, batch_index=k,
                      local_batch_size=local, mem_peak_bytes=meter.peak_now() if meter else None,
                      mem_total_bytes=meter.source.total_bytes() if meter else None,
                      message=str(exc)[:2000])
            log.error("rank %d ran out of memory at batch %d with %d samples (placement %d); "
                      "reporting it to the backend", self._rank, k, local, version)
            if self._conn.transport is not None:
                self._conn.send_control(oom)
                if not self._conn.flush_control(_OOM_FLUSH_S):
                    log.warning("the out-of-memory report could not be sent within %.0f s", _OOM_FLUSH_S)
        except Exception:  # noqa: BLE001 - never mask the out-of-memory error itself
            log.exception("reporting the out-of-memory error failed")
