"""The hook websockets currently open, by job and rank, and delivery of messages to them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from starlette.websockets import WebSocket

from rebalancer_wire.protocol import (
    CLOSE_REDIRECT,
    PROTOCOL_VERSION,
    Error,
    Message,
    Placement,
    encode,
)

__all__ = ["HookConnections", "redirect_reason"]

log = logging.getLogger("rebalancer.connections")


def redirect_reason(url: str, job: str) -> str:
    """The close reason of a redirect: the URL again when it fits the 123 bytes a close
    reason may carry (a hook whose send met the close before it read the error frame uses
    it), else a sentence."""
    return url if len(url.encode()) <= 120 else f"job '{job}' is controlled by another replica"[:120]


class HookConnections:
    """job -> rank -> websocket. Only the event loop's thread touches it."""

    def __init__(self) -> None:
        self._by_job: dict[str, dict[int, WebSocket]] = {}
        self._versions: dict[int, int] = {}  # id(socket) -> protocol version of its hello
        self._refs: dict[int, int] = {}  # id(socket) -> ranks it speaks for (several: a node connection)
        # job -> (the placement last encoded for its hellos, its text per protocol version)
        self._texts: dict[str, tuple[Placement, dict[int, str]]] = {}

    def add(self, job: str, rank: int, ws: WebSocket, version: int = PROTOCOL_VERSION) -> WebSocket | None:
        """Register a rank's socket and the protocol version it speaks; returns the socket
        it replaces (a stale reconnect)."""
        old = self._by_job.setdefault(job, {}).get(rank)
        if old is ws:
            self._versions[id(ws)] = version
            return None
        self._by_job[job][rank] = ws
        self._versions[id(ws)] = version
        self._refs[id(ws)] = self._refs.get(id(ws), 0) + 1
        if old is not None:
            self._unref(old)
        return old

    def _unref(self, ws: WebSocket) -> None:
        n = self._refs.get(id(ws), 0) - 1
        if n > 0:
            self._refs[id(ws)] = n
        else:
            self._refs.pop(id(ws), None)
            self._versions.pop(id(ws), None)

    def serves(self, ws: WebSocket) -> bool:
        """True while ``ws`` speaks for at least one rank (a node connection may for several)."""
        return id(ws) in self._refs

    def remove(self, job: str, rank: int, ws: WebSocket) -> None:
        """Forget a socket, unless a newer connection of the same rank replaced it."""
        ranks = self._by_job.get(job)
        if ranks is not None and ranks.get(rank) is ws:
            del ranks[rank]
            self._unref(ws)
            if not ranks:
                del self._by_job[job]
                self._texts.pop(job, None)

    def current(self, job: str, rank: int) -> WebSocket | None:
        """The socket that speaks for ``rank`` of ``job`` now, if any."""
        return self._by_job.get(job, {}).get(rank)

    async def close_job(self, job: str, code: int, reason: str, *, keep: WebSocket | None = None) -> int:
        """Close every socket of ``job`` but ``keep`` with ``code``; returns how many closed."""
        socks = [ws for ws in self._by_job.get(job, {}).values() if ws is not keep]
        for ws in socks:
            for r, w in list(self._by_job.get(job, {}).items()):
                if w is ws:
                    self.remove(job, r, ws)
            with contextlib.suppress(Exception):
                await ws.close(code, reason=reason[:120])
        return len(socks)

    def jobs(self) -> list[str]:
        """The jobs with at least one open socket."""
        return list(self._by_job)

    async def redirect_job(self, job: str, url: str) -> int:
        """Send every socket of ``job`` to the replica at ``url`` (another replica took the
        job): an ``error`` frame with code ``redirect``, then close 4307."""
        text = encode(Error(code="redirect", message=url))
        socks = list({id(ws): ws for ws in self._by_job.get(job, {}).values()}.values())
        for ws in socks:
            with contextlib.suppress(Exception):
                await ws.send_text(text)
        return await self.close_job(job, CLOSE_REDIRECT, redirect_reason(url, job))

    def ranks(self, job: str) -> list[int]:
        return sorted(self._by_job.get(job, {}))

    def alone(self, job: str, rank: int) -> bool:
        """True when no rank of ``job`` but ``rank`` has an open socket (O(1))."""
        held = self._by_job.get(job, {})
        return len(held) == 0 or (len(held) == 1 and rank in held)

    def text(self, msg: Placement, version: int) -> str:
        """``msg`` encoded in protocol ``version``; the same message object (every rank's hello
        reply while a job's placement stays) is encoded once per job and version."""
        job = msg.job
        cached = self._texts.get(job)
        if cached is not None and cached[0] is msg and version in cached[1]:
            return cached[1][version]
        if cached is None or cached[0] is not msg:
            cached = self._texts[job] = (msg, {})
        text = cached[1][version] = encode(msg, version)
        return text

    def has(self, job: str, rank: int) -> bool:
        """True while ``rank`` of ``job`` has an open socket (O(1): every rank checks on close)."""
        return rank in self._by_job.get(job, {})

    def count(self) -> int:
        """Ranks with an open socket."""
        return sum(len(r) for r in self._by_job.values())

    def sockets(self) -> int:
        """Open hook sockets (a node connection counts once, whatever ranks it carries)."""
        return len(self._refs)

    async def send(self, job: str, msg: Message, ranks: Iterable[int] | None = None) -> int:
        """Send ``msg`` to the job's connected ranks (all, or those in ``ranks``).

        Encodes once per protocol version in use; sockets that fail are dropped. Returns
        how many ranks got it.
        """
        targets = self._by_job.get(job, {})
        wanted = None if ranks is None else set(ranks)
        chosen = [(r, ws) for r, ws in targets.items() if wanted is None or r in wanted]
        if not chosen:
            return 0
        texts: dict[int, str] = {}
        for _, ws in chosen:
            v = self._versions.get(id(ws), PROTOCOL_VERSION)
            if v not in texts:
                texts[v] = encode(msg, v)
        # A node connection carries several ranks: it gets the frame once, for all of them.
        unique = list({id(ws): ws for _, ws in chosen}.values())
        results = await asyncio.gather(
            *(ws.send_text(texts[self._versions.get(id(ws), PROTOCOL_VERSION)]) for ws in unique),
            return_exceptions=True)
        failed = {id(ws) for ws, res in zip(unique, results, strict=True) if isinstance(res, BaseException)}
        sent = 0
        for rank, ws in chosen:
            if id(ws) in failed:
                log.info("dropping dead hook socket job=%s rank=%d", job, rank)
                self.remove(job, rank, ws)
            else:
                sent += 1
        return sent
