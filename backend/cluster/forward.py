"""``Forwarder``: an HTTP request that reached a replica which does not control its job,
sent once to the replica that does, with the caller's own bearer token (the owner checks it
and the role again against the shared database).

One try, never a retry: a request that may have reached the owner is never sent twice. A
forwarded request carries ``X-Rebalancer-Forwarded-By: <replica id>``; a replica never
forwards such a request again (one hop at most, no loops between replicas that disagree
about the owner for a moment).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

__all__ = ["FORWARDED_BY", "FORWARDED_TO", "MAX_REPLY_BYTES", "ForwardError", "Forwarder", "Reply", "http_base"]

FORWARDED_BY = "x-rebalancer-forwarded-by"
FORWARDED_TO = "x-rebalancer-forwarded-to"
MAX_REPLY_BYTES = 16 * 1024 * 1024
# Headers of the owner's answer that the caller gets too (a report's CSP, a 503's Retry-After).
PASSED_HEADERS = ("content-security-policy", "retry-after")
_SCHEMES = {"ws": "http", "wss": "https", "http": "http", "https": "https"}


def http_base(url: str) -> str | None:
    """The HTTP base of a replica's advertised URL (``ws://h:p/x`` -> ``http://h:p/x``);
    None when it is not a ws, wss, http or https URL with a host."""
    parts = urlsplit(url)
    scheme = _SCHEMES.get(parts.scheme)
    if scheme is None or not parts.hostname or parts.query or parts.fragment or "," in url:
        return None
    return f"{scheme}://{parts.netloc}{parts.path.rstrip('/')}"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    content_type: str
    headers: dict[str, str]


class ForwardError(Exception):
    """The owner could not answer: ``status_code`` (503) and the sentence for the caller."""

    def __init__(self, status_code: int, detail: str):
        super().__init__(detail)
        self.status_code, self.detail = status_code, detail


class Forwarder:
    """Sends requests to other replicas (one ``httpx.AsyncClient``, owned by the event loop)."""

    def __init__(self, *, replica_id: str, timeout_s: float):
        if not 1.0 <= timeout_s <= 120.0:
            raise ValueError(f"REBALANCER_FORWARD_TIMEOUT_S must be between 1 and 120 seconds, got {timeout_s}.")
        self.replica_id = replica_id
        self.timeout_s = timeout_s
        # No proxy from the environment and no redirects: the owner's URL is the only target.
        self._client = httpx.AsyncClient(timeout=timeout_s, follow_redirects=False, trust_env=False)
        self.answered = 0  # requests the owner answered (any status)
        self.failed = 0  # requests with no answer: ForwardError

    async def send(self, *, job: str, owner: str, url: str, method: str, path: str, query: str,
                   authorization: str, body: bytes = b"", timeout_s: float | None = None) -> Reply:
        """``method path?query`` at the owner ``url`` with the caller's ``Authorization``;
        the owner's answer, or ``ForwardError`` saying why there is none."""
        base = http_base(url)
        where = f"Job '{job}' is controlled by replica {owner} at {url}"
        if base is None:
            raise ForwardError(409, f"{where}, which is no URL a request can be forwarded to; send this action "
                                    "to that replica.")
        target = f"{base}{path}" + (f"?{query}" if query else "")
        headers = {"authorization": authorization, FORWARDED_BY: self.replica_id}
        if body:
            headers["content-type"] = "application/json"
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return await self._send(method, target, headers, body, timeout, where, job)
        except ForwardError:
            self.failed += 1
            raise

    async def _send(self, method: str, target: str, headers: dict[str, str], body: bytes, timeout: float,
                    where: str, job: str) -> Reply:
        try:
            async with self._client.stream(method, target, headers=headers, content=body,
                                           timeout=timeout) as reply:
                chunks, size = [], 0
                async for chunk in reply.aiter_bytes():
                    size += len(chunk)
                    if size > MAX_REPLY_BYTES:
                        raise ForwardError(502, f"{where}, whose answer is over {MAX_REPLY_BYTES} bytes; ask "
                                                "that replica directly.")
                    chunks.append(chunk)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ForwardError(503, f"{where}, which cannot be reached ({type(exc).__name__}); nothing was "
                                    "applied. Try again: once its lease expires (REBALANCER_LEASE_TTL_S) "
                                    "another replica takes the job.") from exc
        except httpx.HTTPError as exc:
            # Reached, then no answer: it timed out, or it dropped the connection (reset,
            # killed or restarted mid-request). Either way it may have applied the action.
            what = (f"did not answer within {timeout:g} s ({type(exc).__name__})"
                    if isinstance(exc, httpx.TimeoutException)
                    else f"dropped the connection before answering ({type(exc).__name__}: {exc or 'no detail'})")
            raise ForwardError(503, f"{where}, which {what}; the action may have been applied there: read the "
                                    f"job's audit (GET /api/v1/jobs/{job}/audit) before sending it again.") from exc
        self.answered += 1
        passed = {k: reply.headers[k] for k in PASSED_HEADERS if k in reply.headers}
        return Reply(reply.status_code, b"".join(chunks), reply.headers.get("content-type", "application/json"),
                     passed)

    async def aclose(self) -> None:
        await self._client.aclose()
