"""Small stand-ins for the controller's unit tests: a hook socket and a frozen clock."""

from __future__ import annotations

from typing import Any

from backend.control.controller import Controller
from backend.control.policy_runs import PolicyRunner
from backend.parts import Parts
from rebalancer_wire.protocol import Placement, decode


class PlacementSocket:
    """Takes the place of a hook's websocket; keeps every placement sent to it."""

    def __init__(self) -> None:
        self.sent: list[Placement] = []

    async def send_text(self, text: str) -> None:
        msg = decode(text)
        assert isinstance(msg, Placement)
        self.sent.append(msg)


class FrozenClock:
    """A clock that moves only when a test sets ``t``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def policy_tick(ctl: Controller, job: str) -> int:
    """New metrics for ``job``, then one step of the policy ticker, awaited."""
    ctl.on_metrics(job)
    return await ctl.run_due()


def restarted(parts: Parts, **kw: Any) -> Controller:
    """A new controller on the same database and live state: a backend restart."""
    return Controller(settings=parts.settings, sql=parts.sql, live=parts.live,
                      connections=parts.connections, notify=lambda job: None,
                      policy=PolicyRunner(process=False), **kw)
