"""``/ws/hook``: where training hooks say hello and stream their metrics.

Conversation (docs/protocol.md): the hook authenticates (hook token scoped to the job, or
an admin token; none needed in open mode), sends ``hello`` first and gets the placement in
force back, then streams ``metrics`` and answers placements with ``ack`` or ``reject``.
Any bad frame gets an ``error`` message and a close code; one bad connection never
disturbs the others.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from backend.api.deps import websocket_actor
from backend.parts import Parts
from backend.storage.metrics import upsert_hello
from trainer_hook.protocol import (
    CLOSE_FORBIDDEN,
    CLOSE_MALFORMED,
    CLOSE_NORMAL,
    CLOSE_UNAUTHORIZED,
    Ack,
    Error,
    Hello,
    Metrics,
    ProtocolError,
    Reject,
    decode,
    encode,
)

__all__ = ["router", "hook_websocket"]

log = logging.getLogger("rebalancer.ingest")
router = APIRouter()
CLOSE_INTERNAL = 1011


async def _refuse(ws: WebSocket, code: str, message: str, close_code: int) -> None:
    with contextlib.suppress(Exception):
        await ws.send_text(encode(Error(code=code, message=message)))
    with contextlib.suppress(Exception):
        await ws.close(close_code, reason=message[:120])


def _store_hello(hello: Hello, new_run: bool) -> Callable[[Session], None]:
    def work(s: Session) -> None:
        # On the gateway's one thread, so the ranks of a new job saying hello at once
        # never race on its unique name; one retry covers a second backend process.
        for attempt in (1, 2):
            try:
                upsert_hello(s, hello, new_run=new_run)
                s.commit()
                return
            except IntegrityError:
                s.rollback()
                if attempt == 2:
                    raise
    return work


@router.websocket("/ws/hook")
async def hook_websocket(websocket: WebSocket) -> None:
    """One rank's connection: authenticate, hello, then metrics / ack / reject frames."""
    parts: Parts = websocket.app.state.parts
    await websocket.accept()
    actor = await websocket_actor(websocket)
    if actor is None:
        await _refuse(websocket, "unauthorized",
                      "Missing or invalid token; send 'Authorization: Bearer TOKEN' or '?token=TOKEN'.",
                      CLOSE_UNAUTHORIZED)
        return
    if actor.role not in ("hook", "admin"):
        await _refuse(websocket, "forbidden",
                      f"A {actor.role} token cannot send metrics; use a hook token for the job or an admin token.",
                      CLOSE_FORBIDDEN)
        return
    hello: Hello | None = None
    goodbye = False  # the hook closed normally (its close()): this rank is done
    parts.sockets.add(actor, websocket)
    try:
        while True:
            frame = await websocket.receive()
            if frame["type"] == "websocket.disconnect":
                goodbye = frame.get("code") == CLOSE_NORMAL
                break
            raw = frame.get("text")
            if raw is None:
                raw = frame.get("bytes")
            if raw is None:
                continue
            try:
                msg = decode(raw)
            except ProtocolError as exc:
                log.info("closing hook connection from %s: %s", actor.address, exc)
                await _refuse(websocket, exc.code, str(exc), exc.close_code)
                return
            if hello is None or isinstance(msg, Hello):
                if not isinstance(msg, Hello):
                    await _refuse(websocket, "malformed",
                                  f"The first message must be 'hello', got '{msg.TYPE}'.", CLOSE_MALFORMED)
                    return
                if actor.role == "hook" and actor.job != msg.job:
                    await _refuse(websocket, "forbidden",
                                  f"This hook token is for job '{actor.job}'; it may not speak for job '{msg.job}'.",
                                  CLOSE_FORBIDDEN)
                    return
                if hello is not None and (msg.job, msg.rank) != (hello.job, hello.rank):
                    await _refuse(websocket, "malformed",
                                  f"This connection speaks for job '{hello.job}' rank {hello.rank}; "
                                  f"open a new connection for job '{msg.job}' rank {msg.rank}.",
                                  CLOSE_MALFORMED)
                    return
                hello = msg
                await _on_hello(parts, websocket, hello)
                continue
            if not isinstance(msg, (Metrics, Ack, Reject)):
                await _refuse(websocket, "malformed",
                              f"Hooks may not send '{msg.TYPE}' messages; expected metrics, ack or reject.",
                              CLOSE_MALFORMED)
                return
            if (msg.job, msg.rank) != (hello.job, hello.rank):
                await _refuse(websocket, "malformed",
                              f"This connection speaks for job '{hello.job}' rank {hello.rank}; "
                              f"got a '{msg.TYPE}' for job '{msg.job}' rank {msg.rank}.",
                              CLOSE_MALFORMED)
                return
            if isinstance(msg, Metrics):
                parts.live.add_metrics(msg)
                parts.controller.on_metrics(msg.job)
                parts.hub.notify(msg.job)
            elif isinstance(msg, Ack):
                await parts.controller.on_ack(msg)
                parts.hub.notify(msg.job)
            else:
                log.warning("job %s rank %d rejected placement %d: %s", msg.job, msg.rank, msg.version, msg.reason)
                await parts.controller.on_reject(msg)
                parts.hub.notify(msg.job)
    except WebSocketDisconnect:
        pass
    except Exception:  # a bug in one handler must not take the server or other ranks down
        log.exception("hook connection failed (job=%s rank=%s)",
                      hello.job if hello else None, hello.rank if hello else None)
        await _refuse(websocket, "internal", "The backend failed to handle this message; see its log.",
                      CLOSE_INTERNAL)
    finally:
        parts.sockets.discard(actor, websocket)
        if hello is not None:
            parts.connections.remove(hello.job, hello.rank, websocket)
            if not parts.connections.has(hello.job, hello.rank):
                parts.live.set_connected(hello.job, hello.rank, False)
                if goodbye and parts.live.said_goodbye(hello.job, hello.rank):
                    parts.run_ended(hello.job)
            with contextlib.suppress(Exception):
                parts.hub.notify(hello.job)


async def _on_hello(parts: Parts, websocket: WebSocket, hello: Hello) -> None:
    new_run = parts.live.register(hello)
    await parts.sql.run(_store_hello(hello, new_run))
    old = parts.connections.add(hello.job, hello.rank, websocket)
    if old is not None:
        log.info("job %s rank %d reconnected; closing its previous socket", hello.job, hello.rank)
        with contextlib.suppress(Exception):
            await old.close(1000, reason="replaced by a newer connection of the same rank")
    placement = await parts.controller.on_hello(hello)
    await websocket.send_text(encode(placement))
    parts.hub.notify(hello.job)
