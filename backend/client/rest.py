"""The REST client: :class:`Client` (one HTTP request a method, the dashboard feed as an
iterator) and its two errors. Standard library only; ``watch`` imports ``websockets``."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

from backend.client.resources import (
    AuditRecord,
    Causes,
    Fleet,
    Forecast,
    Health,
    Job,
    Memory,
    MetricsPage,
    Overrides,
    OverridesSet,
    Pipeline,
    Placement,
    Proposal,
    Rank,
    Summary,
    Token,
    TokenCreated,
    WhoAmI,
)

__all__ = ["Client", "APIError", "ServerUnreachable", "DEFAULT_SERVER"]

DEFAULT_SERVER = "http://127.0.0.1:8000"


# --- errors -----------------------------------------------------------------------------


class APIError(Exception):
    """The server answered with an error: ``status`` (4xx/5xx) and its ``detail`` sentence."""

    def __init__(self, status: int, detail: str, *, method: str = "", path: str = "") -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail
        self.method = method
        self.path = path


class ServerUnreachable(ConnectionError):
    """No answer from the server (refused, unknown host, timed out)."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"Cannot reach the Rebalancer server at {url}: {reason}.")
        self.url = url
        self.reason = reason


# --- the client ---------------------------------------------------------------------------


def _q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def _detail(body: bytes, fallback: str) -> str:
    """The server's ``detail`` as one sentence (FastAPI's 422 lists become 'where: what')."""
    try:
        payload = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()
        return text[:300] if text else fallback
    detail = payload.get("detail") if isinstance(payload, dict) else None
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        parts = []
        for err in detail:
            if isinstance(err, dict):
                loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
                parts.append(f"{loc}: {err.get('msg', '')}" if loc else str(err.get("msg", "")))
        if parts:
            return "; ".join(parts)
    return fallback


class Client:
    """One backend. ``server`` and ``token`` default to ``REBALANCER_SERVER`` and
    ``REBALANCER_TOKEN`` (then http://127.0.0.1:8000 and no token: open mode)."""

    def __init__(self, server: str | None = None, token: str | None = None, *, timeout: float = 10.0) -> None:
        url = (server or os.environ.get("REBALANCER_SERVER") or DEFAULT_SERVER).strip().rstrip("/")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"server must be an http(s) URL like {DEFAULT_SERVER}, got {url!r}.")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}.")
        self.server = url
        self.token = token if token is not None else (os.environ.get("REBALANCER_TOKEN") or None)
        self.timeout = float(timeout)

    def __repr__(self) -> str:
        return f"Client({self.server!r}, token={'set' if self.token else None})"

    # --- transport ---------------------------------------------------------------------

    def request(self, method: str, path: str, *, params: Mapping[str, Any] | None = None,
                body: Any = None) -> Any:
        """One call to ``path`` (e.g. ``/api/v1/jobs``); returns the decoded JSON answer."""
        raw = self._send(method, path, params=params, body=body, accept="application/json")
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise APIError(502, f"The answer from {self.server + path} is not JSON; is {self.server} "
                           "a Rebalancer backend?", method=method, path=path) from None

    def _send(self, method: str, path: str, *, params: Mapping[str, Any] | None = None,
              body: Any = None, accept: str) -> bytes:
        url = self.server + path
        if params:
            pairs: list[tuple[str, str]] = []
            for key, value in params.items():
                if value is None:
                    continue
                values = value if isinstance(value, (list, tuple)) else [value]
                pairs += [(key, str(v).lower() if isinstance(v, bool) else str(v)) for v in values]
            if pairs:
                url += "?" + urllib.parse.urlencode(pairs)
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Accept", accept)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read()  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            raise APIError(exc.code, _detail(raw, exc.reason or f"HTTP {exc.code}"),
                           method=method, path=path) from None
        except urllib.error.URLError as exc:
            raise ServerUnreachable(self.server, str(exc.reason)) from None
        except (TimeoutError, ConnectionError) as exc:  # raised while reading the answer
            raise ServerUnreachable(self.server, str(exc) or type(exc).__name__) from None

    def _job(self, job: str) -> str:
        if not job:
            raise ValueError("job must be a non-empty job name.")
        return f"/api/v1/jobs/{_q(job)}"

    # --- reads ---------------------------------------------------------------------------

    def health(self) -> Health:
        """``GET /healthz``; a 503 (database down) raises APIError."""
        return cast(Health, self.request("GET", "/healthz"))

    def whoami(self) -> WhoAmI:
        return cast(WhoAmI, self.request("GET", "/api/v1/whoami"))

    def jobs(self) -> list[Job]:
        return cast("list[Job]", self.request("GET", "/api/v1/jobs")["data"])

    def fleet(self) -> Fleet:
        """Every job held in memory, one row each, and the fleet's totals:
        ``{"data": rows, "count": n, "totals": {...}}`` (the home page's figures)."""
        return cast(Fleet, self.request("GET", "/api/v1/fleet"))

    def job(self, job: str) -> Job:
        return cast(Job, self.request("GET", self._job(job)))

    def ranks(self, job: str) -> list[Rank]:
        return cast("list[Rank]", self.request("GET", self._job(job) + "/ranks")["data"])

    def metrics(self, job: str, *, ranks: Sequence[int] | None = None, batch_from: int | None = None,
                batch_to: int | None = None, source: str = "auto", limit: int | None = None) -> MetricsPage:
        """Step metrics: live single steps or stored per-window means (``source``)."""
        params = {"rank": list(ranks) if ranks is not None else None, "batch_from": batch_from,
                  "batch_to": batch_to, "source": source, "limit": limit}
        return cast(MetricsPage, self.request("GET", self._job(job) + "/metrics", params=params))

    def forecast(self, job: str, *, total_steps: int | None = None) -> Forecast:
        return cast(Forecast, self.request("GET", self._job(job) + "/forecast",
                                           params={"total_steps": total_steps}))

    def summary(self, job: str) -> Summary:
        """Time and cost saved against the uniform split so far (404 before the first closed batches)."""
        return cast(Summary, self.request("GET", self._job(job) + "/summary"))

    def memory(self, job: str) -> Memory:
        """Each rank's peak-memory fit and the cap it gives, with the job's headroom."""
        return cast(Memory, self.request("GET", self._job(job) + "/memory"))

    def pipeline(self, job: str) -> Pipeline:
        """A pipelined job's stages x pipelines grid, bottleneck stage, bubble share, slowest
        pipeline and stage-split advice (docs/pipelines.md)."""
        return cast(Pipeline, self.request("GET", self._job(job) + "/pipeline"))

    def causes(self, job: str) -> Causes:
        """Why the job is slow: each cause's cost per step and in GPU-hours, largest first."""
        return cast(Causes, self.request("GET", self._job(job) + "/causes"))

    def policy(self, job: str) -> dict[str, Any]:
        return cast("dict[str, Any]", self.request("GET", self._job(job) + "/policy"))

    def proposals(self, job: str, *, status: str | None = None, limit: int | None = None) -> list[Proposal]:
        """Newest first."""
        got = self.request("GET", self._job(job) + "/proposals", params={"status": status, "limit": limit})
        return cast("list[Proposal]", got["data"])

    def proposal(self, job: str, proposal_id: int) -> Proposal:
        return cast(Proposal, self.request("GET", f"{self._job(job)}/proposals/{int(proposal_id)}"))

    def overrides(self, job: str) -> Overrides:
        return cast(Overrides, self.request("GET", self._job(job) + "/overrides"))

    def report(self, job: str, *, compare: str | None = None) -> dict[str, Any]:
        """The job's end-of-run report (stored when it finished, else built now); with
        ``compare``, ``{"data": [this, other], "count": 2}``."""
        return cast("dict[str, Any]", self.request("GET", self._job(job) + "/report",
                                                   params={"compare": compare}))

    def report_html(self, job: str, *, compare: str | None = None) -> str:
        """The report as one self-contained HTML page (plotly.js inlined; opens offline)."""
        raw = self._send("GET", self._job(job) + "/report", params={"format": "html", "compare": compare},
                         accept="text/html")
        return raw.decode("utf-8")

    def store_report(self, job: str) -> dict[str, Any]:
        """Build and store the job's report now (operator)."""
        return cast("dict[str, Any]", self.request("POST", self._job(job) + "/report"))

    def placements(self, job: str, *, limit: int | None = None) -> list[Placement]:
        """Placement history, newest first."""
        got = self.request("GET", self._job(job) + "/placements", params={"limit": limit})
        return cast("list[Placement]", got["data"])

    def audit(self, job: str, *, limit: int | None = None) -> list[AuditRecord]:
        """The job's audit records, newest first (viewer)."""
        got = self.request("GET", self._job(job) + "/audit", params={"limit": limit})
        return cast("list[AuditRecord]", got["data"])

    def audit_log(self, *, job: str | None = None, action: str | None = None,
                  limit: int | None = None) -> list[AuditRecord]:
        """The whole audit log, token actions included (admin)."""
        got = self.request("GET", "/api/v1/audit", params={"job": job, "action": action, "limit": limit})
        return cast("list[AuditRecord]", got["data"])

    def tokens(self, *, include_revoked: bool = False) -> list[Token]:
        got = self.request("GET", "/api/v1/tokens", params={"include_revoked": include_revoked or None})
        return cast("list[Token]", got["data"])

    # --- actions -------------------------------------------------------------------------

    def set_mode(self, job: str, mode: str, *, reason: str | None = None) -> dict[str, Any]:
        """observe | approve | auto; returns the job's control state."""
        return cast("dict[str, Any]", self.request(
            "PUT", self._job(job) + "/mode", body={"mode": mode, "reason": reason}))

    def set_policy(self, job: str, changes: Mapping[str, Any], *, reason: str | None = None) -> dict[str, Any]:
        """Change policy settings (admin); a None value returns that field to the default."""
        body = {**changes, "reason": reason}
        return cast("dict[str, Any]", self.request("PUT", self._job(job) + "/policy", body=body))

    def submit_placement(self, job: str, shares: Sequence[int], *, reason: str | None = None,
                         apply: bool = False, force: bool = False,
                         length_sq_weight: float | None = None) -> Proposal:
        """A placement by hand; with ``apply`` it is approved in the same call. One that
        breaks a memory cap is refused (400) unless ``force`` (audited). ``length_sq_weight``
        (k in [0, 1e6]) sends a cost model with it for a job that gives sample lengths."""
        body: dict[str, Any] = {"shares": list(shares), "reason": reason, "apply": apply}
        if force:
            body["force"] = True
        if length_sq_weight is not None:
            body["length_sq_weight"] = length_sq_weight
        return cast(Proposal, self.request("POST", self._job(job) + "/proposals", body=body))

    def approve(self, job: str, proposal_id: int, *, reason: str | None = None) -> Proposal:
        return cast(Proposal, self.request(
            "POST", f"{self._job(job)}/proposals/{int(proposal_id)}/approve", body={"reason": reason}))

    def reject(self, job: str, proposal_id: int, *, reason: str | None = None) -> Proposal:
        return cast(Proposal, self.request(
            "POST", f"{self._job(job)}/proposals/{int(proposal_id)}/reject", body={"reason": reason}))

    def set_overrides(self, job: str, *, pins: Mapping[int, int] | None = None,
                      caps: Mapping[int, int] | None = None, floors: Mapping[int, int] | None = None,
                      drains: Sequence[int] | None = None, granularity: int = 1,
                      reason: str | None = None) -> OverridesSet:
        """Replace every override (leave all out to clear them)."""
        body = {
            "pins": {str(k): v for k, v in (pins or {}).items()},
            "caps": {str(k): v for k, v in (caps or {}).items()},
            "floors": {str(k): v for k, v in (floors or {}).items()},
            "drains": list(drains or []), "granularity": granularity, "reason": reason,
        }
        return cast(OverridesSet, self.request("PUT", self._job(job) + "/overrides", body=body))

    def rollback(self, job: str, *, reason: str | None = None) -> Placement:
        """Go back to exactly the shares in force before the current placement."""
        return cast(Placement, self.request("POST", self._job(job) + "/rollback", body={"reason": reason}))

    def create_token(self, role: str, *, name: str = "", job: str | None = None,
                     reason: str = "") -> TokenCreated:
        """A new token (admin); its ``secret`` is shown only in this answer."""
        body = {"role": role, "name": name, "job": job, "reason": reason}
        return cast(TokenCreated, self.request("POST", "/api/v1/tokens", body=body))

    def revoke_token(self, token_id: int, *, reason: str = "") -> Token:
        return cast(Token, self.request("DELETE", f"/api/v1/tokens/{int(token_id)}",
                                        params={"reason": reason or None}))

    # --- the dashboard feed ------------------------------------------------------------

    def watch(self, job: str, *, open_timeout: float = 10.0) -> Iterator[dict[str, Any]]:
        """Frames of ``/ws/dashboard?job=`` as dicts, first a full snapshot, then deltas
        (see docs/dashboard.md). Needs the ``websockets`` package. A refused token raises
        APIError (401/403 from the close code); a lost connection ends the iteration."""
        try:
            from websockets.exceptions import ConnectionClosed, InvalidHandshake
            from websockets.sync.client import connect
        except ImportError:
            raise ImportError("watch needs the websockets package: pip install 'torch-rebalancer[client]'.") from None
        if not job:
            raise ValueError("job must be a non-empty job name.")
        ws_url = "ws" + self.server[4:] + "/ws/dashboard?" + urllib.parse.urlencode({"job": job})
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            conn = connect(ws_url, additional_headers=headers, open_timeout=open_timeout)
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            raise ServerUnreachable(self.server, str(exc) or type(exc).__name__) from None
        with conn:
            try:
                for text in conn:
                    yield json.loads(text)
            except ConnectionClosed as exc:
                rcvd = exc.rcvd
                if rcvd is not None and rcvd.code in (4401, 4403):
                    raise APIError(401 if rcvd.code == 4401 else 403, rcvd.reason,
                                   method="WS", path="/ws/dashboard") from None
            # A clean close (1000, or the server going away) just ends the iteration.
