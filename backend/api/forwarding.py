"""Requests about a job another replica controls, sent on to that replica (the owner).

- An operator action (approve, reject, override, mode, policy, rollback, a placement) that
  the controller refuses here with ``ElsewhereError`` is forwarded once to the owner with
  the caller's bearer token, and the caller gets the owner's answer. It is answered 409 with
  the owner's URL, as without forwarding, when ``REBALANCER_FORWARD_ACTIONS`` is off, when
  the request carries no bearer token (the owner could not check who sent it), or when it
  was itself forwarded (one hop at most). An owner that cannot be reached: 503 with why.
- A live read (``GET /api/v1/jobs/{job}``, its ``/ranks``, ``/summary`` and ``/report``)
  and ``POST .../report`` (built from live state) are answered by the owner, so every
  replica serves the live numbers; when the owner does not answer within
  ``READ_TIMEOUT_S``, the replica answers from what it holds.
"""

from __future__ import annotations

import logging

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from backend.api.deps import bearer_secret
from backend.api.edge import BODY_KEY
from backend.control.errors import ElsewhereError
from backend.parts import Parts

__all__ = ["answer_elsewhere", "from_owner", "READ_TIMEOUT_S"]

log = logging.getLogger("rebalancer.api")

READ_TIMEOUT_S = 3.0  # a live read waits this long for the owner, then answers from here
_FORWARDED_BY = "x-rebalancer-forwarded-by"  # backend.cluster.forward.FORWARDED_BY


def _path(request: Request) -> tuple[str, str]:
    raw = request.scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else request.url.path
    return path, request.scope.get("query_string", b"").decode("latin-1")


async def answer_elsewhere(request: Request, exc: Exception) -> Response:
    """The app's handler of ``ElsewhereError``: the owner's answer, or 409 / 503 with why."""
    assert isinstance(exc, ElsewhereError)
    parts: Parts = request.app.state.parts
    authorization = request.headers.get("authorization")
    if (parts.forwarder is None or not exc.url or authorization is None
            or bearer_secret(request.headers) is None or request.headers.get(_FORWARDED_BY)):
        return JSONResponse({"detail": exc.detail}, status_code=409)
    from backend.cluster import ForwardError

    path, query = _path(request)
    try:
        reply = await parts.forwarder.send(job=exc.job, owner=exc.owner, url=exc.url, method=request.method,
                                           path=path, query=query, authorization=authorization,
                                           body=request.scope.get(BODY_KEY, b""))
    except ForwardError as err:
        log.warning("forwarding %s %s to replica %s failed: %s", request.method, path, exc.owner, err.detail)
        return JSONResponse({"detail": err.detail}, status_code=err.status_code)
    return Response(reply.body, status_code=reply.status, media_type=reply.content_type,
                    headers={**reply.headers, "X-Rebalancer-Forwarded-To": exc.owner})


async def from_owner(request: Request, parts: Parts, job: str) -> Response | None:
    """The owner's answer to this request about ``job``'s live state; None: answer it here
    (one replica, this replica owns the job, nobody does, no token to forward, or the owner
    did not answer 200)."""
    cluster, forwarder = parts.cluster, parts.forwarder
    authorization = request.headers.get("authorization")
    if (cluster is None or forwarder is None or cluster.owns(job) or authorization is None
            or request.headers.get(_FORWARDED_BY)):
        return None
    owner, url = await cluster.owner(job)
    if owner is None or owner == cluster.replica_id or not url:
        return None
    from backend.cluster import ForwardError

    path, query = _path(request)
    try:
        reply = await forwarder.send(job=job, owner=owner, url=url, method=request.method, path=path,
                                     query=query, authorization=authorization, timeout_s=READ_TIMEOUT_S)
    except ForwardError as err:
        log.warning("reading job %s from replica %s failed; answered from here: %s", job, owner, err.detail)
        return None
    if reply.status != 200:
        return None  # e.g. the owner has not stored the job yet: answer from here
    return Response(reply.body, status_code=200, media_type=reply.content_type,
                    headers={**reply.headers, "X-Rebalancer-Forwarded-To": owner})
