"""A typed Python client for the backend's REST API and dashboard feed (standard library only).

It needs none of the server's packages (FastAPI, pydantic, SQLAlchemy): install plain
``rebalancer`` and it works; ``watch`` also needs ``websockets`` (``rebalancer[client]``).

Example::

    from backend.client import Client, APIError

    rb = Client("http://127.0.0.1:8000", token="rb_...")   # or REBALANCER_SERVER / _TOKEN
    job = rb.job("demo")
    pending = rb.proposals("demo", status="proposed")
    if pending:
        try:
            rb.approve("demo", pending[0]["id"], reason="looks right")
        except APIError as exc:       # exc.status == 409, exc.detail == the server's sentence
            print(exc.detail)

Every method is one HTTP request. The server's refusals raise :class:`APIError` with the
status and the server's ``detail`` sentence; a server that cannot be reached raises
:class:`ServerUnreachable`. Lists come back as Python lists (the server's ``data``).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypedDict, cast

__all__ = [
    "Client", "APIError", "ServerUnreachable", "DEFAULT_SERVER",
    "Job", "Bound", "Mesh", "Replica", "CostModel", "Rank", "Device", "MetricPoint", "MetricsPage", "Forecast", "Summary", "RankMemory", "Memory",
    "Proposal", "Placement", "Effect", "Overrides", "OverridesSet", "AuditRecord", "Token", "TokenCreated", "Health", "WhoAmI",
]

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


# --- resources (the server's JSON, typed for readers and mypy) ---------------------------


class PlacementBrief(TypedDict):
    version: int
    shares: list[int]


class Bound(TypedDict, total=False):
    """What bounds a job's step, with its figures (``GET /api/v1/jobs/{job}``'s ``bound``)."""

    verdict: str  # compute-bound | communication-bound | input-bound | balanced | unknown
    detail: str
    n_steps: int
    kind: str | None
    step_ms: float | None
    compute_ms: float | None
    exposed_comm_ms: float | None
    data_wait_ms: float | None
    compute_share: float | None
    comm_share: float | None
    input_share: float | None
    comm_bytes_per_step: float | None
    transfer_ms: float | None
    algbw_gbps: float | None
    busbw_gbps: float | None


class Mesh(TypedDict):
    """A device-mesh job's shape (``GET /api/v1/jobs/{job}``'s ``mesh``): its ranks are replicas."""

    dp: int
    replica_size: int
    dims: list[str]
    shape: list[int]
    label: str  # e.g. "DP 2 x TP 2"


class Replica(TypedDict):
    """One data-parallel replica of a mesh job (``GET /api/v1/jobs/{job}``'s ``replicas``)."""

    replica: int  # its index: its rank in placements and overrides
    members: list[int]  # its global ranks, leader first
    connected: bool
    compute_ms: float | None  # its slowest member's (live only)
    step_ms: float | None
    slowest_rank: int | None  # the member slowest in most of the newest steps (live only)


class CostModel(TypedDict, total=False):
    """What a sample costs in the split (``GET /api/v1/jobs/{job}``'s ``cost_model``)."""

    model: str  # samples | work (linear) | fitted a*L+b*L^2
    length_sq_weight: float
    length_sq_weight_in_force: float
    r2: float | None
    r2_linear: float | None
    ranks_fitted: int
    ranks_quadratic: int
    detail: str


class Job(TypedDict, total=False):
    job: str
    world_size: int
    global_batch_size: int
    mode: str | None
    strategy: str | None
    status: str  # warming_up | balanced | imbalanced | proposal_pending | idle | degraded
    status_detail: str
    batch_index: int | None
    step_rate_hz: float | None
    step_ms: float | None
    imbalance: float | None
    idle_fraction: float | None
    placement: PlacementBrief | None
    pending_proposal_id: int | None
    connected_ranks: int
    created_at: float | None
    last_seen: float | None
    total_steps: int | None
    eta_s: float | None
    cost_per_hour: float | None
    idle_cost_per_hour: float | None
    bound: Bound | None
    mesh: Mesh | None
    replicas: list[Replica] | None
    cost_model: CostModel | None


class Device(TypedDict, total=False):
    t: float | None
    source: str | None
    util_pct: float | None
    mem_used_bytes: int | None
    mem_total_bytes: int | None
    power_w: float | None
    temp_c: float | None
    sm_clock_mhz: float | None
    sm_clock_max_mhz: float | None
    throttle_reasons: list[str]
    cpu_pct: float | None
    rss_bytes: int | None
    nic_tx_bytes_per_s: float | None
    nic_rx_bytes_per_s: float | None
    ib_tx_bytes_per_s: float | None
    ib_rx_bytes_per_s: float | None
    pcie_tx_bytes_per_s: float | None
    pcie_rx_bytes_per_s: float | None
    nvlink_tx_bytes_per_s: float | None
    nvlink_rx_bytes_per_s: float | None


class Rank(TypedDict, total=False):
    rank: int
    host: str
    device_type: str
    device_name: str
    connected: bool
    share: int | None
    batch_index: int | None
    placement_version: int | None
    compute_ms: float | None
    sync_wait_ms: float | None
    data_wait_ms: float | None
    optimizer_ms: float | None
    step_ms: float | None
    step_rate_hz: float | None
    local_batch_size: float | None
    n_steps: int
    device: Device | None
    dropped: int
    last_seen: float | None
    price_per_hour: float | None
    hook_version: str
    work_per_s: float | None
    work_share: float | None
    comm_bytes_per_step: float | None
    comm_ms: float | None
    wait_ms: float | None
    busbw_gbps: float | None


class MetricPoint(TypedDict):
    rank: int
    batch_index: int
    batch_index_start: int
    n_steps: int
    t: float
    placement_version: int
    local_batch_size: float
    compute_ms: float
    sync_wait_ms: float
    data_wait_ms: float
    optimizer_ms: float
    step_ms: float
    comm_bytes: float | None  # history: mean per step over the window (None: no counters)
    comm_ms: float | None


class MetricsPage(TypedDict):
    data: list[MetricPoint]
    count: int
    source: str  # live | history


class Forecast(TypedDict):
    job: str
    batch_index: int | None
    total_steps: int | None
    remaining_steps: int | None
    step_ms: float | None
    eta_s: float | None
    cost_per_hour: float | None
    unpriced_ranks: int
    cost_to_finish: float | None


class Summary(TypedDict):
    job: str
    batch_index: int | None
    total_steps: int | None
    measured_s: float  # wall time of the closed batches
    uniform_s: float  # what they would have taken under the uniform split
    saved_s: float
    saved_cost: float | None
    cost_per_hour: float | None
    step_ms: float | None
    imbalance: float | None
    placement_version: int | None
    updated_at: float


class RankMemory(TypedDict):
    rank: int
    source: str  # cuda | rocm | xpu; empty: not measured (no cap)
    status: str  # fitted | measuring | unmeasured
    share: int | None
    readings: int
    last_peak_bytes: int | None
    total_bytes: int | None
    fixed_bytes: float | None  # m0 of the fit peak = m0 + m * local_batch
    per_sample_bytes: float | None  # m
    method: str | None
    batch_sizes: int
    predicted_peak_bytes: float | None
    limit_bytes: float | None
    cap: int | None


class Memory(TypedDict):
    data: list[RankMemory]
    count: int
    memory_headroom: float


class Proposal(TypedDict):
    id: int
    job: str
    status: str  # proposed | approved | applied | rejected | superseded | failed | expired
    source: str
    strategy: str
    base_version: int
    shares: list[int]
    current_shares: list[int]
    predicted_step_ms_before: float | None
    predicted_step_ms_after: float | None
    predicted_gain: float | None
    explanation: dict[str, Any] | None
    reason: str
    created_by: str
    created_at: float
    expires_at: float | None
    decided_by: str | None
    decided_at: float | None
    decision_reason: str | None
    placement_version: int | None
    error: str | None


class Effect(TypedDict):
    step_ms_before: float | None
    step_ms_after: float | None
    predicted_step_ms: float | None
    measured_gain: float | None
    rolled_back: bool


class Placement(TypedDict):
    version: int
    shares: list[int]
    previous_shares: list[int] | None
    source: str
    proposal_id: int | None
    actor: str
    reason: str
    created_at: float
    effective_batch_index: int | None
    acks: dict[str, int]  # rank (a JSON key, so a string) -> batch index
    applied_at: float | None
    failed: bool
    error: str | None
    effect: Effect


class Overrides(TypedDict, total=False):
    pins: dict[str, int]
    caps: dict[str, int]
    floors: dict[str, int]
    drains: list[int]
    granularity: int


class OverridesSet(Overrides, total=False):
    proposal_id: int | None  # a proposal that respects them, when the placement in force does not


class AuditRecord(TypedDict):
    id: int
    time: float
    actor: str
    role: str
    address: str
    action: str
    job: str | None
    params: dict[str, Any]
    reason: str


class Token(TypedDict):
    id: int
    name: str
    role: str
    job: str | None
    hint: str
    created_at: float
    created_by: str
    revoked_at: float | None


class TokenCreated(Token):
    secret: str  # shown once


class Health(TypedDict):
    status: str
    database: str
    open_mode: bool
    jobs: int
    hook_connections: int  # ranks with an open hook websocket
    hook_sockets: int  # open hook websockets (a node connection counts once)
    buffered_windows: int
    dropped_windows: int
    cluster: str  # "off" (one replica), "ok", or "paused: <why>"


class WhoAmI(TypedDict):
    name: str
    role: str
    operator: bool
    open_mode: bool


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

    def fleet(self) -> dict[str, Any]:
        """Every job held in memory, one row each, and the fleet's totals:
        ``{"data": rows, "count": n, "totals": {...}}`` (the home page's figures)."""
        return cast("dict[str, Any]", self.request("GET", "/api/v1/fleet"))

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
            raise ImportError("watch needs the websockets package: pip install 'rebalancer[client]'.") from None
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
