"""Small stand-ins for the controller's unit tests: a hook socket and a frozen clock."""

from __future__ import annotations

from trainer_hook.protocol import Placement, decode


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
