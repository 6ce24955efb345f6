"""Placements: the placement in force and the ones on their way. Owns the offers (rank 0's
request_placement, a backend ``placement``), the placement agreed at start-up, the switch
to a new version at a step boundary and its ack (or reject), under one lock shared with
the transport thread. The schedule and the control channel carry the agreed placements
to every rank; a placement reaches a rank as: Connection (transport thread) ->
``on_message`` -> ``offer`` -> ControlChannel.offer -> the exchange (StepLoop.begin ->
ControlChannel.on_step) -> PlacementSchedule -> StepLoop.begin -> ``enter`` (ack)."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rebalancer_wire.protocol import (
    MAX_LENGTH_SQ_WEIGHT,
    Ack,
    Error,
    Message,
    Placement,
    Reject,
    check_shares,
    next_placement_version,
)
from trainer_hook._connection import Connection
from trainer_hook._ranks import Ranks
from trainer_hook._weights import Weighting
from trainer_hook.channel import ControlChannel, PendingPlacement
from trainer_hook.config import HookConfig
from trainer_hook.placement import PlacementSchedule, ScheduledPlacement

log = logging.getLogger("trainer_hook")


def check_length_sq_weight(value: object) -> float:
    """A cost model's k (of ``L + k*L^2``) as a float, or ValueError naming the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"length_sq_weight must be a number in [0, {MAX_LENGTH_SQ_WEIGHT:g}] (k of L + k*L^2), "
                         f"got {value!r}.")
    k = float(value)
    if not (math.isfinite(k) and 0.0 <= k <= MAX_LENGTH_SQ_WEIGHT):
        raise ValueError(f"length_sq_weight must be a number in [0, {MAX_LENGTH_SQ_WEIGHT:g}] (k of L + k*L^2), "
                         f"got {k}.")
    return k


class Placements:
    """Offers, the start-up placement, the placement in force, acks and rejects."""

    def __init__(self, *, config: HookConfig, ranks: Ranks, schedule: PlacementSchedule,
                 channel: ControlChannel, connection: Connection, weighting: Weighting,
                 share_rule: Callable[[Sequence[int]], str | None] | None = None) -> None:
        self._config = config
        self._ranks = ranks
        self._schedule = schedule
        self._channel = channel
        self._conn = connection
        self._weighting = weighting
        self._share_rule = share_rule  # a pipeline schedule's counts (trainer_hook.pipeline)
        self._lock = threading.Lock()
        self.acks: list[tuple[int, int]] = []
        self.rejections: list[tuple[int, str]] = []
        self.last_error: Error | None = None
        self.started = False
        self.trained: ScheduledPlacement = schedule.at(0)  # the placement of the batch trained last
        self.trained_version: int | None = None  # the version acked last (None: no step yet)
        self._initial: PendingPlacement | None = None
        self._initial_event = threading.Event()
        self._epoch_seen = 0  # the highest lease epoch of a backend placement (rank 0)

    # --- the training thread -----------------------------------------------------------

    def enter(self, p: ScheduledPlacement, k: int) -> None:
        """Batch k trains under ``p`` (StepLoop.begin, when it is not the one trained last)."""
        if p.version != self.trained_version:
            self._on_new_version(p, k)
        self.trained = p

    def _on_new_version(self, p: ScheduledPlacement, k: int) -> None:
        if self._weighting.mode is None and self._ranks.world_size > 1 and len(set(p.shares)) > 1:
            log.warning(
                "placement version %d splits the batch unevenly but attach() was never called: "
                "gradients are not weighted by share, so training math changes. Call "
                "hook.attach(ddp_model) (or use gradients='loss_scale' with hook.loss_weight()).",
                p.version,
            )
        first = self.trained_version is None
        self.trained_version = p.version
        if first and p.version == 0:
            return
        self.acks.append((p.version, k))
        self._conn.send_control(Ack(job=self._config.job_name, rank=self._ranks.rank, version=p.version,
                                    batch_index=k))

    def request(self, shares: list[int], reason: str, version: int | None,
                length_sq_weight: float | None) -> int:
        """Rank 0's ``request_placement``: the version given or the next one; ValueError if refused."""
        if not self._ranks.root:
            raise RuntimeError(
                f"request_placement() was called on rank {self._ranks.rank}; only rank 0 decides "
                "placements. Call it on rank 0 (the others learn it at the next exchange)."
            )
        if length_sq_weight is not None:
            length_sq_weight = check_length_sq_weight(length_sq_weight)
        with self._lock:
            pending = self._channel.undelivered
            if version is None:
                version = next_placement_version(self._schedule.latest.version,
                                                 pending.version if pending else None)
            if length_sq_weight is None:
                newest = pending if pending is not None else self._schedule.latest
                length_sq_weight = newest.length_sq_weight
        error = self.offer(version, shares, reason, self._config.global_batch_size, length_sq_weight)
        if error is not None:
            raise ValueError(error)
        return version

    def offer(self, version: int, shares: Any, reason: str, global_batch_size: int,
              length_sq_weight: float = 0.0) -> str | None:
        """Validate and queue a placement; on failure record and report a reject."""
        error: str | None = None
        checked: list[int] = []
        ranks = self._ranks
        with self._lock:
            latest = self._schedule.latest
            pending = self._channel.pending
            newest = max(latest.version, pending.version if pending else -1)
            if global_batch_size != self._config.global_batch_size:
                error = (
                    f"placement version {version} is for global batch size {global_batch_size}, "
                    f"but this job trains with {self._config.global_batch_size}."
                )
            else:
                try:
                    checked = check_shares(shares, world_size=ranks.world_size, global_batch_size=global_batch_size)
                except ValueError as exc:
                    error = f"placement version {version} is invalid: {exc}"
                    if (ranks.members > 1 and isinstance(shares, (list, tuple))
                            and len(shares) == ranks.world_size * ranks.members):
                        error = (
                            f"placement version {version} is invalid: it has one share per rank "
                            f"({len(shares)}), but with dp_mesh shares are per data-parallel replica: "
                            f"this job has {ranks.world_size} replicas of {ranks.members} ranks each; "
                            f"give {ranks.world_size} shares."
                        )
            if error is None and self._share_rule is not None:
                why = self._share_rule(checked)
                if why is not None:
                    error = f"placement version {version} is invalid: {why}"
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
        self._reject(version, error)
        return error

    def _reject(self, version: int, reason: str) -> None:
        self.rejections.append((version, reason))
        log.warning("rejected placement: %s", reason)
        self._conn.send_control(Reject(job=self._config.job_name, rank=self._ranks.rank, version=version,
                                       reason=reason))

    def _newest_version(self) -> int:
        with self._lock:
            pending = self._channel.pending
            return max(self._schedule.latest.version, pending.version if pending else -1)

    # --- the transport thread ----------------------------------------------------------

    def on_message(self, msg: Message) -> None:
        """Transport thread: a backend ``placement`` (rank 0 acts on it) or ``error``."""
        if isinstance(msg, Placement):
            if not self._ranks.root:
                return  # rank 0 decides for everyone; the exchange brings it here
            if msg.epoch < self._epoch_seen and msg.version <= self._newest_version():
                # From a replica that lost the job (paused past its lease): ignored, not
                # rejected, since a reject would mark that version failed in the store.
                log.warning("ignored placement version %d from a backend replica that no longer owns the job "
                            "(lease epoch %d < %d)", msg.version, msg.epoch, self._epoch_seen)
                return
            self._epoch_seen = msg.epoch  # (a newer version under a lower epoch: the backend's store was replaced)
            with self._lock:
                startup = not self.started
            if startup:
                self._initial = PendingPlacement(msg.version, tuple(msg.shares), msg.reason,
                                                 msg.length_sq_weight)
                self._initial_event.set()
                return
            self.offer(msg.version, msg.shares, msg.reason, msg.global_batch_size, msg.length_sq_weight)
        elif isinstance(msg, Error):
            self.last_error = msg
            log.warning("backend error %s: %s", msg.code, msg.message)

    # --- start-up and resume -----------------------------------------------------------

    def ensure_started(self, next_batch: int) -> None:
        """Once, on every rank: resume the placement in force (rank 0's view) before batch 0."""
        if self.started:
            return
        config = self._config
        version: int | None = None
        shares: list[int] | None = None
        length_sq_weight = 0.0
        if self._ranks.root and self._conn.transport is not None:
            self._initial_event.wait(config.startup_wait_s)
            with self._lock:
                initial, self._initial = self._initial, None
            if initial is not None and initial.version > 0:
                try:
                    shares = check_shares(
                        list(initial.shares), world_size=self._ranks.world_size,
                        global_batch_size=config.global_batch_size,
                    )
                    version = initial.version
                    length_sq_weight = initial.length_sq_weight
                except ValueError as exc:
                    self._reject(initial.version, f"placement version {initial.version} is invalid: {exc}")
        if version is not None and version <= self._schedule.latest.version:
            version = shares = None  # a resumed checkpoint's placement is as new or newer
        if not config.offline:
            self._channel.sync_initial(version, shares, length_sq_weight)
        with self._lock:
            self.started = True
            self.trained = self._schedule.at(next_batch)
            late, self._initial = self._initial, None
        if late is not None:  # arrived after the wait: takes the ordinary path
            self.offer(late.version, list(late.shares), late.reason, config.global_batch_size)

    def resume(self, k: int, version: int, shares: list[int] | None,
               upcoming: tuple[int, list[int]] | None) -> None:
        """A checkpoint's placement (agreed by every rank) in force from batch k on."""
        with self._lock:
            if shares is not None and version > self._schedule.latest.version:
                self._schedule.replace_initial(version, shares)
            self.trained = self._schedule.at(k)
        if upcoming is not None and self._ranks.root and upcoming[0] > self._schedule.latest.version:
            self._channel.offer(PendingPlacement(upcoming[0], tuple(upcoming[1]), "resumed from a checkpoint"))

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._initial_event = threading.Event()
