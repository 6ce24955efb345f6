"""``/ws/hook``: where training hooks say hello and stream their metrics.

Conversation (docs/protocol.md): the hook authenticates (hook token scoped to the job, or
an admin token; none needed in open mode), sends ``hello`` first and gets the placement in
force back, then streams ``metrics`` and answers placements with ``ack`` or ``reject``.
Any bad frame gets an ``error`` message and a close code; one bad connection never
disturbs the others. The route authenticates; ``backend.ingest.websocket`` holds the rest.
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from backend.api.deps import websocket_actor
from backend.auth.access import SEND_METRICS, allows
from backend.ingest.websocket import converse, refuse
from backend.parts import Parts
from rebalancer_wire.protocol import CLOSE_FORBIDDEN, CLOSE_UNAUTHORIZED

__all__ = ["router", "hook_websocket"]

router = APIRouter()


@router.websocket("/ws/hook")
async def hook_websocket(websocket: WebSocket) -> None:
    """One rank's connection: authenticate, then hand it to the ingest conversation."""
    parts: Parts = websocket.app.state.parts
    await websocket.accept()
    actor = await websocket_actor(websocket)
    if actor is None:
        await refuse(websocket, "unauthorized",
                     "Missing or invalid token; send 'Authorization: Bearer TOKEN' or '?token=TOKEN'.",
                     CLOSE_UNAUTHORIZED)
        return
    if not allows(actor, SEND_METRICS):
        await refuse(websocket, "forbidden",
                     f"A {actor.role} token cannot send metrics; use a hook token for the job or an admin token.",
                     CLOSE_FORBIDDEN)
        return
    await converse(parts, websocket, actor)
