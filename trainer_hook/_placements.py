"""Placement switching: offers from rank 0 or the backend are checked and queued, the
placement in force at start-up is agreed, and each new version is acked (or rejected)."""

from __future__ import annotations

import logging
from typing import Any

from rebalancer_wire.protocol import Ack, Error, Message, Placement, Reject, check_shares
from trainer_hook._hook_base import HookBase
from trainer_hook.channel import PendingPlacement
from trainer_hook.placement import ScheduledPlacement

log = logging.getLogger("trainer_hook")


class PlacementSwitch(HookBase):
    """Offers, the start-up placement, acks and rejects of a RebalanceHook."""

    def _on_new_version(self, p: ScheduledPlacement, k: int) -> None:
        if self._gradients_mode is None and self._world_size > 1 and len(set(p.shares)) > 1:
            log.warning(
                "placement version %d splits the batch unevenly but attach() was never called: "
                "gradients are not weighted by share, so training math changes. Call "
                "hook.attach(ddp_model) (or use gradients='loss_scale' with hook.loss_weight()).",
                p.version,
            )
        first = self._trained_version is None
        self._trained_version = p.version
        if first and p.version == 0:
            return
        self.acks.append((p.version, k))
        if self._transport is not None:
            self._transport.send_control(Ack(job=self.config.job_name, rank=self._rank, version=p.version, batch_index=k))

    def _offer(self, version: int, shares: Any, reason: str, global_batch_size: int,
               length_sq_weight: float = 0.0) -> str | None:
        """Validate and queue a placement; on failure record and report a reject."""
        error: str | None = None
        checked: list[int] = []
        with self._lock:
            latest = self._schedule.latest
            pending = self._channel.pending
            newest = max(latest.version, pending.version if pending else -1)
            if global_batch_size != self.config.global_batch_size:
                error = (
                    f"placement version {version} is for global batch size {global_batch_size}, "
                    f"but this job trains with {self.config.global_batch_size}."
                )
            else:
                try:
                    checked = check_shares(shares, world_size=self._world_size, global_batch_size=global_batch_size)
                except ValueError as exc:
                    error = f"placement version {version} is invalid: {exc}"
                    if (self._members > 1 and isinstance(shares, (list, tuple))
                            and len(shares) == self._world_size * self._members):
                        error = (
                            f"placement version {version} is invalid: it has one share per rank "
                            f"({len(shares)}), but with dp_mesh shares are per data-parallel replica: "
                            f"this job has {self._world_size} replicas of {self._members} ranks each; "
                            f"give {self._world_size} shares."
                        )
            if error is None and version <= newest:
                known = pending if pending is not None and pending.version == version else None
                if version == latest.version and tuple(checked) == latest.shares:
                    return None  # the placement in force again (a reconnect's hello reply)
                if known is not None and known.shares == tuple(checked):
                    return None
                error = f"placement version {version} is not newer than version {newest} already in force or pending."
            if error is None:
                self._channel.offer(PendingPlacement(version, tuple(checked), reason, length_sq_weight))
                return None
        self.rejections.append((version, error))
        log.warning("rejected placement: %s", error)
        if self._transport is not None:
            self._transport.send_control(Reject(job=self.config.job_name, rank=self._rank, version=version, reason=error))
        return error

    def _newest_version(self) -> int:
        with self._lock:
            pending = self._channel.pending
            return max(self._schedule.latest.version, pending.version if pending else -1)

    def _on_message(self, msg: Message) -> None:
        """Transport thread: a backend ``placement`` (rank 0 acts on it) or ``error``."""
        if isinstance(msg, Placement):
            if not self._root:
                return  # rank 0 decides for everyone; the exchange brings it here
            if msg.epoch < self._epoch_seen and msg.version <= self._newest_version():
                # From a replica that lost the job (paused past its lease): ignored, not
                # rejected, since a reject would mark that version failed in the store.
                log.warning("ignored placement version %d from a backend replica that no longer owns the job "
                            "(lease epoch %d < %d)", msg.version, msg.epoch, self._epoch_seen)
                return
            self._epoch_seen = msg.epoch  # (a newer version under a lower epoch: the backend's store was replaced)
            with self._lock:
                startup = not self._started
            if startup:
                self._initial = PendingPlacement(msg.version, tuple(msg.shares), msg.reason,
                                                 msg.length_sq_weight)
                self._initial_event.set()
                return
            self._offer(msg.version, msg.shares, msg.reason, msg.global_batch_size, msg.length_sq_weight)
        elif isinstance(msg, Error):
            self.last_error = msg
            log.warning("backend error %s: %s", msg.code, msg.message)

    def _ensure_started(self) -> None:
        """Once, on every rank: resume the placement in force (rank 0's view) before batch 0."""
        if self._started:
            return
        self._init_distributed("the first batch")
        version: int | None = None
        shares: list[int] | None = None
        length_sq_weight = 0.0
        if self._root and self._transport is not None:
            self._initial_event.wait(self.config.startup_wait_s)
            with self._lock:
                initial, self._initial = self._initial, None
            if initial is not None and initial.version > 0:
                try:
                    shares = check_shares(
                        list(initial.shares), world_size=self._world_size,
                        global_batch_size=self.config.global_batch_size,
                    )
                    version = initial.version
                    length_sq_weight = initial.length_sq_weight
                except ValueError as exc:
                    self._reject(initial.version, f"placement version {initial.version} is invalid: {exc}")
        if version is not None and version <= self._schedule.latest.version:
            version = shares = None  # a resumed checkpoint's placement is as new or newer
        if not self.config.offline:
            self._channel.sync_initial(version, shares, length_sq_weight)
        with self._lock:
            self._started = True
            self._trained = self._schedule.at(self._next_batch)
            late, self._initial = self._initial, None
        if late is not None:  # arrived after the wait: takes the ordinary path
            self._offer(late.version, list(late.shares), late.reason, self.config.global_batch_size)

    def _reject(self, version: int, reason: str) -> None:
        self.rejections.append((version, reason))
        log.warning("rejected placement: %s", reason)
        if self._transport is not None:
            self._transport.send_control(Reject(job=self.config.job_name, rank=self._rank, version=version, reason=reason))
