"""The hot path of ``hook.step()``: the batch's gradient weight and timers on entry, its
record on exit, the lookahead agreed at the first step, an out-of-memory report."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from rebalancer_wire.protocol import Oom
from trainer_hook._placements import PlacementSwitch

log = logging.getLogger("trainer_hook")
_OOM_FLUSH_S = 2.0  # how long an out-of-memory report may hold the failing step


class _NoExchange:
    """Stands in for the control channel while the lookahead is not agreed yet."""

    due = 1 << 62

    def on_step(self, batch_index: int) -> None:  # never reached: due is unreachable
        pass


_NO_EXCHANGE: Any = _NoExchange()


class StepLoop(PlacementSwitch):
    """Entry and exit of ``hook.step()`` for a RebalanceHook."""

    def _begin_step(self) -> int:
        if self._closed:
            if self._forked:
                raise RuntimeError(
                    "This RebalanceHook belongs to the parent process; a forked child (a DataLoader "
                    "worker) must not train with it. Create hooks in the training process only."
                )
            raise RuntimeError("This RebalanceHook is closed; create a new one to train further.")
        if not self._started:
            self._ensure_started()
        k = self._next_batch
        channel = self._channel
        # In the hook's own collectives: sync wait, not data wait (invariant 11); a replica's
        # pace check at the end of the previous step included.
        waited, self._entry_wait = self._entry_wait, 0.0
        if self._lookahead is None:
            clock = self._timer.clock
            t = clock()
            self._agree_lookahead(k)
            waited = clock() - t
            if self._lookahead is None:  # postponed: no exchange may start a placement yet
                channel = _NO_EXCHANGE
        if k >= channel.due:  # an exchange to collect or launch; otherwise nothing to do
            clock = self._timer.clock
            t = clock()
            channel.on_step(k)
            waited += clock() - t
        p = self._schedule.at(k)
        sampler = self._sampler
        b = self.config.global_batch_size
        if sampler is not None and sampler.has_cost:  # a cost partition: the count varies per batch
            local = sampler.local_size(k)
            weight = local / sampler.batch_length(k)
        elif sampler is None or sampler.batch_length(k) == b:
            # Full batch: this rank's share and weight only change with the placement.
            if p is not self._full_for:
                local = p.shares[self._rank]
                # Micro-batch shares: each micro-batch's gradient is 1/M of the step's.
                micro = self.config.micro_batches is not None
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
        if local == 0 and self._norms:
            self._freeze_norms()
        if p.version != self._trained_version:
            self._on_new_version(p, k)
        self._trained = p
        if self._memory is not None:
            self._memory.begin(local)
        if self._gc_schedule is not None:  # HookConfig gc_freeze / gc_collect_every
            self._gc_schedule.on_step(k)
        self._timer.start(k, local, p.version, events=grads.events, waited=waited)
        self._in_step, self._mb = True, None
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
        sampler = self._sampler
        ahead, truncated = 0, 0
        if sampler is not None:
            ahead = sampler.furthest - k
            per_epoch = len(sampler)
            epoch_end = (k // per_epoch + 1) * per_epoch - 1
            truncated = int(sampler.furthest >= epoch_end and k % per_epoch != 0 and self._agree_at == 0)
        lookahead = max(1, ahead + 1, self._known_lookahead)
        group = self._channel.group
        if group is not None:
            buf = torch.tensor([lookahead, truncated], dtype=torch.int64)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
            lookahead, truncated = (int(v) for v in buf.tolist())
        if truncated and sampler is not None:
            self._agree_at = (k // len(sampler) + 1) * len(sampler)
            return
        self._lookahead = lookahead
        self._channel.set_lookahead(k, lookahead)

    def _freeze_norms(self) -> None:
        # Eval mode for the dummy step: normalise with the running statistics, update none.
        self._frozen = [m for m in self._norms if m.training]
        for m in self._frozen:
            m.train(False)

    def _end_step(self, *, failed: bool) -> None:
        self._in_step = False
        if not failed and self.config.micro_batches is not None:
            self._check_micro_step()  # type: ignore[attr-defined]
        if self._frozen:
            for m in self._frozen:
                m.train(True)
            self._frozen = []
        self._grads.collect()
        rec = self._timer.finish(self._grads)
        if failed:
            return
        self._next_batch += 1
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
        sampler = self._sampler
        if rec is not None and sampler is not None and sampler.has_cost:
            rec.work = sampler.local_work(rec.batch_index) if rec.local_batch_size else 0.0
            rec.batch_work = sampler.batch_work(rec.batch_index)
            sq = sampler.local_work_sq(rec.batch_index)
            if sq is not None:
                rec.work_sq = sq[0] if rec.local_batch_size else 0.0
                rec.batch_work_sq = sq[1]
        pace = self._pace
        if pace is not None:  # the leader reports its replica's pace (the slowest member's times)
            if rec is not None:
                if not pace.leader:
                    self.history.append(rec)  # a member keeps its own; the leader sends
                # Which samples it trained: the replica's members must agree (checked a window on).
                fp = (sampler.samples_fingerprint(rec.batch_index) if sampler is not None
                      else hash((rec.placement_version, rec.local_batch_size)))
                for r in pace.add(rec, fp):  # only a record whose window left already
                    self._report(r)
            clock = self._timer.clock
            t = clock()
            pace.on_step_end(self._next_batch, self._grads.events is not None)  # may wait for the last window
            self._entry_wait = clock() - t
        elif rec is not None:
            self._report(rec)
        if self._grads.repeated_bucket:
            raise RuntimeError(
                "Gradients were all-reduced more than once in one hook.step(): gradient "
                "accumulation must wrap every micro-batch but the last in model.no_sync(), "
                "otherwise each micro-batch is weighted as a whole batch and the math changes."
            )

    def _report_oom(self, exc: BaseException) -> None:
        """Tell the backend this rank ran out of memory, and wait (up to 2 s) until the
        message left: the process is about to die with the job."""
        try:
            k, local, version = self._timer._meta
            meter = self._memory
            oom = Oom(job=self.config.job_name, rank=self._rank, version=version, batch_index=k,
                      local_batch_size=local, mem_peak_bytes=meter.peak_now() if meter else None,
                      mem_total_bytes=meter.source.total_bytes() if meter else None,
                      message=str(exc)[:2000])
            log.error("rank %d ran out of memory at batch %d with %d samples (placement %d); "
                      "reporting it to the backend", self._rank, k, local, version)
            if self._transport is not None:
                self._transport.send_control(oom)
                if not self._transport.flush_control(_OOM_FLUSH_S):
                    log.warning("the out-of-memory report could not be sent within %.0f s", _OOM_FLUSH_S)
        except Exception:  # noqa: BLE001 - never mask the out-of-memory error itself
            log.exception("reporting the out-of-memory error failed")
