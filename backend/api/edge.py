"""The HTTP edge: one ASGI middleware (``Edge``) that owns what every request meets before a
route runs, and the security headers of every answer.

In order, for each HTTP request:

1. When a route starts reading a request body, the caller's token is checked against the
   route's role first: 401 / 403 before one byte of the body is read.
2. Its body is limited (``REBALANCER_MAX_BODY_BYTES``): a ``Content-Length`` above the
   limit is answered 413 without reading; a chunked body is counted while it streams and
   answered 413 as soon as it passes the limit.
3. NUL characters (``\\u0000``) in the path, the query or any JSON string are refused with
   422 on every database (PostgreSQL's text cannot hold them; SQLite's could).
4. HEAD is answered as GET without the body (health checkers and proxies use it).
5. Every answer gets ``X-Frame-Options: DENY``, ``X-Content-Type-Options: nosniff``,
   ``Referrer-Policy: no-referrer`` and, unless the route set its own, ``CSP``.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable
from typing import Any

from fastapi import HTTPException
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend.api.deps import ROLE_OF_CHECK, authenticate, bearer_secret, check_role

__all__ = [
    "Edge",
    "csp",
    "sha256_source",
    "CSP",
    "NUL_SENTENCE",
    "BODY_KEY",
    "too_large",
]

# The body a route read, kept in the scope so that a request a non-owner replica forwards to
# a job's owner (backend.api.forwarding) is sent on byte for byte.
BODY_KEY = "rebalancer.body"
NUL_SENTENCE = "Text may not contain the NUL character (\\u0000); remove it and try again."


def too_large(limit: int) -> str:
    return (f"The request body is larger than {limit} bytes, the limit of this server "
            f"(REBALANCER_MAX_BODY_BYTES); send less.")


def sha256_source(text: str) -> str:
    """A CSP source that allows exactly one inline script or style with this content."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode() + "'"


def csp(scripts: Iterable[str] = (), styles: Iterable[str] = ()) -> str:
    """The Content-Security-Policy: everything from this origin only, no inline script,
    nothing may frame a page; ``scripts`` / ``styles`` are extra sources (hashes) a page's
    own inline code needs (the run report, Swagger UI)."""
    script_src = " ".join(["'self'", *scripts])
    style_src = " ".join(["'self'", *styles])
    return (f"default-src 'self'; script-src {script_src}; style-src {style_src}; "
            "img-src 'self' data: blob:; connect-src 'self'; frame-src 'self'; object-src 'none'; "
            "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


CSP = csp()
_HEADERS = [(b"x-frame-options", b"DENY"), (b"x-content-type-options", b"nosniff"),
            (b"referrer-policy", b"no-referrer")]


def _json_has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_json_has_nul(k) or _json_has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_json_has_nul(v) for v in value)
    return False


def _body_has_nul(body: bytes) -> bool:
    if b"\\u0000" not in body and b"\x00" not in body:
        return False  # the common case: no parse
    if b"\x00" in body:
        return True
    try:
        return _json_has_nul(json.loads(body))
    except ValueError:
        return False  # not JSON: the route's own validation answers


class Edge:
    """The middleware; ``create_app`` adds it once with the settings' body limit."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_headers(send)
        if scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
            send = _without_body(send)
        if "\x00" in scope["path"] or b"%00" in scope["query_string"] or b"\x00" in scope["query_string"]:
            await _answer(send, 422, NUL_SENTENCE)
            return
        await self.app(scope, _Body(scope, receive, self.max_body_bytes), send)


class _Body:
    """The ``receive`` a route gets. Its first call is where a route starts reading the body,
    after routing has put the route in the scope: the caller's token is checked against the
    route's role there, then the body is read (bounded) and checked for NUL. Refusals are
    ``HTTPException``s, which FastAPI passes on to the app's handlers."""

    def __init__(self, scope: Scope, receive: Receive, limit: int) -> None:
        self.scope = scope  # the dict routing fills in (``route``)
        self.receive = receive
        self.limit = limit
        self.pending: list[Message] | None = None

    async def __call__(self) -> Message:
        if self.pending is None:
            self.pending = await self._first()
        if self.pending:
            return self.pending.pop(0)
        return await self.receive()

    async def _first(self) -> list[Message]:
        route = self.scope.get("route")
        role = _required_role(route) if isinstance(route, APIRoute) else None
        if role is not None:
            await _authorize(self.scope, role)
        length = Headers(scope=self.scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            raise HTTPException(413, too_large(self.limit), headers={"Connection": "close"})
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] != "http.request":
                return [message]  # the client left: the route sees it
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:  # a chunked body: counted while it streams
                raise HTTPException(413, too_large(self.limit), headers={"Connection": "close"})
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if _body_has_nul(body):
            raise HTTPException(422, NUL_SENTENCE)
        self.scope[BODY_KEY] = body
        return [{"type": "http.request", "body": body, "more_body": False}]


async def _authorize(scope: Scope, role: str) -> None:
    client = scope.get("client")
    actor = await authenticate(scope["app"].state.parts, bearer_secret(Headers(scope=scope)),
                               client[0] if client else None)
    check_role(actor, role)


def _with_headers(send: Send) -> Send:
    async def with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            names = {k.lower() for k, _ in headers}
            headers += [(k, v) for k, v in _HEADERS if k not in names]
            if b"content-security-policy" not in names:
                headers.append((b"content-security-policy", CSP.encode()))
            message = {**message, "headers": headers}
        await send(message)

    return with_headers


def _required_role(route: APIRoute) -> str | None:
    stack = list(route.dependant.dependencies)
    while stack:
        dep = stack.pop()
        role = ROLE_OF_CHECK.get(dep.call) if dep.call is not None else None
        if role is not None:
            return role
        stack.extend(dep.dependencies)
    return None


def _without_body(send: Send) -> Send:
    async def head(message: Message) -> None:
        if message["type"] == "http.response.body":
            if message.get("more_body", False):
                return
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await send(message)

    return head


async def _answer(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})
