"""Checkpoints: where the run stands (``state_dict``) and resuming there, read from and
handed back to the step loop (batch index), the placements (in force and pending) and
the micro-batch stream; timing a checkpoint write (``checkpointing``, ``ckpt_ms``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rebalancer_wire.protocol import check_shares
from trainer_hook._connection import Connection
from trainer_hook._micro_steps import MicroSteps
from trainer_hook._placements import Placements
from trainer_hook._ranks import Ranks
from trainer_hook._steps import StepLoop
from trainer_hook.channel import ControlChannel
from trainer_hook.config import HookConfig
from trainer_hook.phases import PhaseClock
from trainer_hook.placement import PlacementSchedule

log = logging.getLogger("trainer_hook")


@contextlib.contextmanager
def checkpointing(phases: PhaseClock) -> Iterator[None]:
    """Times a checkpoint write between steps as the next record's ``ckpt_ms``."""
    clock = phases._clock
    t0 = clock()
    try:
        yield
    finally:
        phases.add_checkpoint(clock() - t0)


class Checkpoints:
    """``state_dict`` and ``load_state_dict`` of a RebalanceHook."""

    def __init__(self, *, config: HookConfig, ranks: Ranks, schedule: PlacementSchedule, channel: ControlChannel,
                 placements: Placements, loop: StepLoop, micro: MicroSteps, connection: Connection) -> None:
        self._config = config
        self._ranks = ranks
        self._schedule = schedule
        self._channel = channel
        self._placements = placements
        self._loop = loop
        self._micro = micro
        self._conn = connection

    def state_dict(self) -> dict[str, Any]:
        """``hook.state_dict``: where the run stands."""
        k = self._loop.next_batch
        current = self._schedule.at(k)
        nxt = self._schedule.latest
        pending = self._channel.undelivered if self._ranks.root else None
        upcoming = pending if pending is not None and pending.version > nxt.version else nxt
        sampler = self._loop.sampler
        state: dict[str, Any] = {
            "format": _STATE_FORMAT,
            "batch_index": k,
            "global_batch_size": self._config.global_batch_size,
            "world_size": self._ranks.world_size,
            "placement": {"version": current.version, "shares": list(current.shares)},
            "next_placement": (
                {"version": upcoming.version, "shares": list(upcoming.shares)}
                if upcoming.version > current.version else None
            ),
            "epoch": k // len(sampler) if sampler is not None else None,
            "batches_per_epoch": len(sampler) if sampler is not None else None,
        }
        if self._config.micro_batches is not None:
            # This rank's stream (what it consumed, the source's own state, what it
            # peeked): per rank, unlike the rest.
            micro = self._micro
            state["stream"] = micro.stream.state_dict() if micro.stream is not None else micro.stream_resume
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``hook.load_state_dict``: resume where a state_dict stood (rank 0's copy decides)."""
        loop = self._loop
        sampler = loop.sampler
        if loop.next_batch != 0 or self._conn.history or (sampler is not None and sampler.furthest >= 0):
            raise RuntimeError(
                "load_state_dict() must come before the first batch is drawn: call it right "
                "after building the model, optimizer and loader, before iterating the loader."
            )
        k, version, shares, nxt = _check_state(state, self._config.global_batch_size, self._ranks.world_size)
        self._micro.stream_resume = _check_stream(state.get("stream"))
        group = self._channel.group
        if group is not None:  # rank 0's copy decides, so ranks cannot disagree
            w = self._ranks.world_size
            buf = torch.full((2 + w,), -1, dtype=torch.int64)
            if self._ranks.root:
                buf[0], buf[1] = k, version if shares is not None else -1
                if shares is not None:
                    buf[2:] = torch.tensor(shares, dtype=torch.int64)
            dist.broadcast(buf, src=0, group=group)
            values = buf.tolist()
            k, version = values[0], values[1]
            shares = values[2:] if version >= 0 else None
        if loop.lookahead is not None:  # given: settle from the resumed batch on
            self._channel.set_lookahead(k, loop.lookahead)
        loop.next_batch = k
        self._placements.resume(k, version, shares, nxt)


_STATE_FORMAT = 1


def _check_stream(entry: Any) -> dict[str, Any] | None:
    """A state_dict's ``stream`` entry (micro-batch placements), checked, or None."""
    if entry is None:
        return None
    consumed = entry.get("consumed") if isinstance(entry, dict) else None
    if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
        raise ValueError(
            f"state_dict stream must be a dict with consumed (an integer >= 0), got {entry!r:.200}.")
    pushback = entry.get("pushback") or []
    if not isinstance(pushback, list):
        raise ValueError(f"state_dict stream pushback must be a list of micro-batches, got {type(pushback).__name__}.")
    return entry


def _check_state(
    state: Any, global_batch_size: int, world_size: int
) -> tuple[int, int, list[int] | None, tuple[int, list[int]] | None]:
    """(batch_index, version, shares or None, next placement or None) from a state_dict."""
    if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
        raise ValueError(f"not a RebalanceHook state_dict (format {_STATE_FORMAT}): got {type(state).__name__}.")
    k = state.get("batch_index")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < (1 << 62):
        raise ValueError(f"state_dict batch_index must be an integer in [0, 2**62), got {k!r}.")
    if state.get("global_batch_size") != global_batch_size:
        raise ValueError(
            f"state_dict is for global_batch_size {state.get('global_batch_size')!r}, but this hook "
            f"trains with {global_batch_size}: resume with the same global batch size."
        )
    if state.get("world_size") != world_size:
        log.warning(
            "state_dict was saved with world size %r, this run has %d: resuming at batch %d "
            "with the uniform split.", state.get("world_size"), world_size, k,
        )
        return k, 0, None, None

    def placement(entry: Any) -> tuple[int, list[int]] | None:
        if entry is None:
            return None
        if not isinstance(entry, dict):
            raise ValueError(f"state_dict placement must be a dict with version and shares, got {entry!r}.")
        v = entry.get("version")
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < (1 << 62):
            raise ValueError(f"state_dict placement version must be an integer >= 0, got {v!r}.")
        raw: Any = entry.get("shares")
        if not isinstance(raw, list):
            raise ValueError(f"state_dict placement shares must be a list, got {raw!r}.")
        return v, check_shares(raw, world_size=world_size, global_batch_size=global_batch_size)

    current = placement(state.get("placement"))
    if current is None:
        raise ValueError("state_dict has no placement.")
    return k, current[0], current[1], placement(state.get("next_placement"))
