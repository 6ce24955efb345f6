"""Open websockets by the token that opened them, so that revoking a token closes them.

A token is checked when a socket opens; without this a revoked hook or viewer token would
keep its socket (and its metrics feed or dashboard) for as long as the connection lives.
Revocations through the REST API close the sockets at once; those made by another process
(``rebalancer token revoke``) are found by a sweep every few seconds.
"""

from __future__ import annotations

import contextlib
import logging

from starlette.websockets import WebSocket

from backend.auth.tokens import Actor
from rebalancer_wire.protocol import CLOSE_UNAUTHORIZED

__all__ = ["TokenSockets", "REVOKED_REASON"]

log = logging.getLogger("rebalancer.auth")

REVOKED_REASON = "This token was revoked; ask an admin for a new one."


class TokenSockets:
    """token id -> open sockets. Only the event loop's thread touches it."""

    def __init__(self) -> None:
        self._by_token: dict[int, set[WebSocket]] = {}

    def add(self, actor: Actor, ws: WebSocket) -> None:
        """Track ``ws`` under the actor's token (open-mode actors have none: not tracked)."""
        if actor.token_id is not None:
            self._by_token.setdefault(actor.token_id, set()).add(ws)

    def discard(self, actor: Actor, ws: WebSocket) -> None:
        if actor.token_id is None:
            return
        socks = self._by_token.get(actor.token_id)
        if socks is not None:
            socks.discard(ws)
            if not socks:
                del self._by_token[actor.token_id]

    def token_ids(self) -> list[int]:
        return sorted(self._by_token)

    def count(self) -> int:
        return sum(len(s) for s in self._by_token.values())

    async def close_token(self, token_id: int) -> int:
        """Close every socket of ``token_id`` with 4401 and the reason; returns how many."""
        socks = self._by_token.pop(token_id, set())
        for ws in socks:
            with contextlib.suppress(Exception):  # already closing or gone: nothing to do
                await ws.close(CLOSE_UNAUTHORIZED, reason=REVOKED_REASON)
        if socks:
            log.info("closed %d socket(s) of revoked token %d", len(socks), token_id)
        return len(socks)
