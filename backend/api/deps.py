"""``Annotated`` dependencies: the parts a route uses (``LiveDep``, ``SqlDep``, ...; the
whole container, ``PartsDep``, only for a route that hands it on), the calling actor, role
checks (the decision is ``backend.auth.access.allows``; here it becomes a 401 or a 403).

    @router.post("/things")
    def make(actor: OperatorDep, controller: ControllerDep) -> ...

401 "Missing or invalid bearer token." when no valid token arrives (outside open mode);
403 "This action needs the <role> role." when the token's role is too low.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Path, Request, WebSocket, status
from starlette.requests import HTTPConnection

from backend.auth.access import allows
from backend.auth.sockets import TokenSockets
from backend.auth.tokens import ROLE_LEVEL, Actor, AuthService
from backend.control.controller import Controller
from backend.dashboard.hub import DashboardHub
from backend.live.state import LiveState
from backend.metrics_export import MetricsExporter
from backend.parts import Parts
from backend.peers.connections import HookConnections
from backend.report.collect import RunReports
from backend.settings import Settings, is_loopback
from backend.storage.gateway import SqlGateway
from backend.storage.health import StorageHealth
from backend.storage.writes import WriteBuffer
from rebalancer_wire.protocol import MAX_VERSION

__all__ = [
    "get_parts",
    "get_actor",
    "authenticate",
    "require",
    "check_role",
    "may_scrape",
    "bearer_secret",
    "websocket_actor",
    "PartsDep",
    "SettingsDep",
    "SqlDep",
    "LiveDep",
    "ConnectionsDep",
    "AuthDep",
    "SocketsDep",
    "ControllerDep",
    "HubDep",
    "ReportsDep",
    "ExporterDep",
    "WritesDep",
    "StorageDep",
    "ClusterDep",
    "ForwarderDep",
    "ActorDep",
    "ViewerDep",
    "OperatorDep",
    "AdminDep",
    "RowId",
    "ROW_ID_MAX",
    "ROLE_OF_CHECK",
    "UNAUTHORIZED",
    "forbidden",
]

UNAUTHORIZED = "Missing or invalid bearer token."
# require() registers each role check here, so the edge (backend.api.edge) knows a route's
# role from the route's own dependencies and refuses before reading a body.
ROLE_OF_CHECK: dict[Callable[..., Any], str] = {}


def forbidden(role: str) -> str:
    return f"This action needs the {role} role."


def get_parts(request: Request) -> Parts:
    parts: Parts = request.app.state.parts
    return parts


PartsDep = Annotated[Parts, Depends(get_parts)]


def _part(name: str) -> Callable[[HTTPConnection], Any]:
    def get(conn: HTTPConnection) -> Any:
        return getattr(conn.app.state.parts, name)

    get.__name__ = f"get_{name}"
    return get


# Narrow dependencies: a route names the parts it uses, not the whole wiring object.
SettingsDep = Annotated[Settings, Depends(_part("settings"))]
SqlDep = Annotated[SqlGateway, Depends(_part("sql"))]
LiveDep = Annotated[LiveState, Depends(_part("live"))]
ConnectionsDep = Annotated[HookConnections, Depends(_part("connections"))]
AuthDep = Annotated[AuthService, Depends(_part("auth"))]
SocketsDep = Annotated[TokenSockets, Depends(_part("sockets"))]
ControllerDep = Annotated[Controller, Depends(_part("controller"))]
HubDep = Annotated[DashboardHub, Depends(_part("hub"))]
ReportsDep = Annotated[RunReports, Depends(_part("reports"))]
ExporterDep = Annotated[MetricsExporter, Depends(_part("exporter"))]
WritesDep = Annotated[WriteBuffer, Depends(_part("writes"))]
StorageDep = Annotated[StorageHealth, Depends(_part("storage"))]
ClusterDep = Annotated[Any, Depends(_part("cluster"))]  # JobLeases, or None with one replica
ForwarderDep = Annotated[Any, Depends(_part("forwarder"))]  # Forwarder, or None


def bearer_secret(headers: object, query: object | None = None) -> str | None:
    """The token from ``Authorization: Bearer X``, else from ``?token=X`` when given."""
    auth = headers.get("authorization") if hasattr(headers, "get") else None
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return auth  # a malformed header must fail, not fall back to open mode
    if query is not None and hasattr(query, "get"):
        token = query.get("token")
        if token:
            return str(token)
    return None


async def authenticate(parts: Parts, secret: str | None, address: str | None) -> Actor | None:
    """The caller's actor: from the auth cache, else looked up on the SQL gateway thread."""
    known, actor = parts.auth.cached(secret, address)
    if known:  # 1,024 ranks connecting at once: one lookup, then the cache
        return actor
    return await parts.sql.run(lambda _s: parts.auth.authenticate(secret, address))


async def get_actor(request: Request, parts: PartsDep) -> Actor:
    address = request.client.host if request.client else None
    actor = await authenticate(parts, bearer_secret(request.headers), address)
    if actor is None:
        raise _no_token()
    return actor


def _no_token() -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})


ActorDep = Annotated[Actor, Depends(get_actor)]


def require(role: str) -> Callable[[Actor], Actor]:
    """A dependency that passes actors with at least ``role`` and answers 403 otherwise."""
    if role not in ROLE_LEVEL:
        raise ValueError(f"Unknown role {role!r}; expected one of {sorted(ROLE_LEVEL)}.")

    def check(actor: ActorDep) -> Actor:
        return check_role(actor, role)

    check.__name__ = f"require_{role}"
    ROLE_OF_CHECK[check] = role
    return check


def check_role(actor: Actor | None, role: str) -> Actor:
    """``actor`` when it holds at least ``role``; else 401 (no valid token) or 403."""
    if actor is None:
        raise _no_token()
    if not allows(actor, role):
        raise HTTPException(status.HTTP_403_FORBIDDEN, forbidden(role))
    return actor


def may_scrape(request: Request, parts: Parts) -> None:
    """``GET /metrics`` (``REBALANCER_METRICS_ACCESS``): a viewer token, or with ``loopback``
    no token from this machine. Sync: the route runs on a worker thread."""
    address = request.client.host if request.client else None
    secret = bearer_secret(request.headers)
    if secret is None and parts.settings.metrics_access == "loopback" and address and is_loopback(address):
        return
    check_role(parts.auth.authenticate(secret, address), "viewer")


ViewerDep = Annotated[Actor, Depends(require("viewer"))]
OperatorDep = Annotated[Actor, Depends(require("operator"))]
AdminDep = Annotated[Actor, Depends(require("admin"))]


async def websocket_actor(websocket: WebSocket) -> Actor | None:
    """The actor of a websocket (bearer header or ``?token=``), None when refused. A token
    not in the auth cache is looked up on the SQL gateway thread, off the event loop."""
    parts: Parts = websocket.app.state.parts
    address = websocket.client.host if websocket.client else None
    return await authenticate(parts, bearer_secret(websocket.headers, websocket.query_params), address)


# Integers in paths carry the range of what they name, so a number beyond it is a 422 naming
# the limit, never an overflow in SQL (ids are int32 columns).
ROW_ID_MAX = MAX_VERSION
RowId = Annotated[int, Path(ge=1, le=ROW_ID_MAX, description=f"a row id, 1 .. {ROW_ID_MAX}")]
