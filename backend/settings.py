"""Backend configuration: one ``Settings`` object, read from ``REBALANCER_*`` variables.

Validators refuse unsafe or nonsensical values at start-up, with a message that names the
variable, says what arrived and what is expected.
"""

from __future__ import annotations

import ipaddress
import math
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from backend.modes import Mode
from backend.policy.limits import limit_problem
from backend.policy.types import PolicyConfig
from rebalancer_wire.devices import device_key
from rebalancer_wire.protocol import MAX_MESSAGE_BYTES

__all__ = ["Settings", "DEFAULT_DEVICE_PRICES", "is_loopback"]

# The policy owns its defaults (PolicyConfig's fields); the backend-wide defaults of the same
# settings below are read from it, so the two cannot differ.
_POLICY = PolicyConfig()

# Settings that are the backend's defaults of per-job policy settings, and the setting each
# is (its range: backend.policy.limits, the one table PUT /policy reads too).
_POLICY_FIELDS = {
    "min_gain": "min_gain", "cooldown_steps": "cooldown_steps", "min_steps": "min_steps",
    "policy_window_steps": "window_steps", "horizon_steps": "horizon_steps",
    "auto_max_move_fraction": "max_move_fraction", "rollback_threshold": "rollback_threshold",
    "effect_window_steps": "effect_window_steps", "proposal_ttl_s": "proposal_ttl_s",
    "proposal_margin": "proposal_margin", "proposal_min_age_s": "proposal_min_age_s",
    "memory_headroom": "memory_headroom",
}

# The cluster's periods (seconds) and their ranges: the fan-out's copy interval, how long a
# forwarded operator action may take, and a job lease's time to live.
_CLUSTER_SECONDS = {"fanout_interval_s": (0.1, 60.0), "forward_timeout_s": (1.0, 120.0),
                    "lease_ttl_s": (1.0, 300.0)}

# On-demand cloud list prices, USD per accelerator-hour (rounded, 2025). Override with
# REBALANCER_DEVICE_PRICES='{"H100": 2.5}'. Keys are matched case-insensitively against the
# device's key (rebalancer_wire.devices.device_key) and its family, then the rank's device_type,
# then as a substring of its device_name (longest key wins): see Settings.price_for.
DEFAULT_DEVICE_PRICES: dict[str, float] = {
    "H200": 3.8,
    "H100": 3.0,
    "A100-80GB": 1.9,
    "A100": 1.6,
    "L40S": 1.4,
    "A10G": 1.0,
    "L4": 0.8,
    "V100": 0.9,
    "T4": 0.5,
    "MI300X": 3.5,
    "cpu": 0.05,
}


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Everything the backend needs to start. Environment: ``REBALANCER_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="REBALANCER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    db: str = "sqlite:///./.rebalancer/rebalancer.db"
    # Bootstrap: when set, an admin token with exactly this secret exists after start-up.
    admin_token: SecretStr | None = None
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    # Live state: every step of every rank stays in memory this long (ring buffers).
    step_buffer: int = 2048
    device_buffer: int = 600
    # Derived numbers (compute_ms, step rate, imbalance) use this many recent steps.
    window_steps: int = 20
    # History: per-rank aggregates of the steps seen in each interval go to SQL.
    persist_interval_s: float = 1.0
    # Windows kept in memory while the database refuses writes (oldest dropped past it).
    persist_buffer_windows: int = 100_000
    # How often the database is probed for writability (and a SQLite file for deletion).
    health_interval_s: float = 5.0
    # A rank with no message for this long counts as stale in the job's status.
    stale_after_s: float = 30.0
    # uvicorn's frame limit; above the protocol's so the app itself answers with 1009.
    ws_max_bytes: int = 4 * MAX_MESSAGE_BYTES
    # The largest request body a route accepts (REST bodies are small: a placement for 1,024
    # ranks is under 10 KB); a larger one is answered 413 before it is read.
    max_body_bytes: Annotated[int, Field(ge=1024, le=64 * 1024 * 1024)] = 256 * 1024
    # Proxies whose X-Forwarded-For / X-Forwarded-Proto are believed (uvicorn's
    # --forwarded-allow-ips: comma-separated addresses or networks, "*" for any). Empty: none,
    # so the audit log records the address that connected, which no client can forge.
    forwarded_allow_ips: str = ""

    # Several replicas (docs/scale-out.md): off unless a Redis URL is set; then job leases live
    # there under the prefix. advertise_url: where this replica's hooks should connect.
    redis_url: str | None = None
    redis_prefix: str = "rebalancer"
    lease_ttl_s: float = 6.0
    advertise_url: str = ""
    # Live fan-out between replicas: the owner stores a watched job's dashboard snapshot on
    # Redis at most once per interval; other replicas' dashboards pull it. Operator actions
    # at a non-owner are forwarded to the owner over HTTP (off: answered 409 with its URL).
    fanout_interval_s: float = 1.0
    forward_actions: bool = True
    forward_timeout_s: float = 10.0
    # Keepalive pings to hooks and dashboards. A training node at 100% CPU (or 1,024 ranks
    # connecting at once) can answer late; the hook reconnects when it is dropped anyway.
    ws_ping_interval_s: float = 20.0
    ws_ping_timeout_s: float = 60.0

    # Who may scrape /metrics: "token" (a bearer token, viewer role or above; give the
    # scraper a dedicated viewer token) or "loopback" (callers on this machine need none).
    metrics_access: Literal["token", "loopback"] = "token"
    # Per-rank series of /metrics (the time split, communication, links, the device's NVML
    # gauges): "slowest" keeps, per job, the metrics_slowest_ranks ranks with the longest
    # compute plus at most metrics_gone_ranks ranks that are gone while their job runs (what
    # the rank-lost alert reads; rebalancer_lost_ranks counts them all), and every rank of a
    # job of at most metrics_all_ranks_up_to ranks; "all" exports every rank (16,384 GPU
    # ranks: ~440,000 series, 32 MB). Per-job aggregates (min/median/max of each per-rank
    # gauge, throttled-rank counts) cover every rank either way.
    metrics_rank_series: Literal["slowest", "all"] = "slowest"
    metrics_slowest_ranks: Annotated[int, Field(ge=1, le=100_000)] = 8
    metrics_gone_ranks: Annotated[int, Field(ge=0, le=100_000)] = 32
    metrics_all_ranks_up_to: Annotated[int, Field(ge=0, le=100_000)] = 16
    # A scrape's text may be reused for this long (several Prometheus replicas scraping one
    # large backend build it once). 0, the default, builds it for every scrape: a counter read
    # right after the event that moved it shows the event.
    metrics_cache_s: Annotated[float, Field(ge=0.0, le=60.0)] = 0.0

    dashboard_max_hz: float = 10.0
    device_prices: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_DEVICE_PRICES))

    # Control loop defaults (the controller reads these; per-job settings override them).
    # Those the policy reads default to PolicyConfig's (backend.policy.types).
    default_mode: Mode = "approve"
    default_strategy: str = _POLICY.strategy
    default_workload: str = _POLICY.workload
    proposal_ttl_s: float = 300.0
    # A pending proposal stays until a new one predicts a step this much shorter than it
    # (plus the fit's noise) and it has been up this many seconds (issue 39).
    proposal_margin: float = 0.05
    proposal_min_age_s: float = 30.0
    controller_tick_s: float = 1.0
    min_gain: float = _POLICY.min_gain
    cooldown_steps: int = _POLICY.cooldown_steps
    min_steps: int = _POLICY.min_steps
    policy_window_steps: int = _POLICY.window_steps
    # predictive strategy: steps to forecast ahead (PolicyConfig.horizon_steps says why)
    horizon_steps: int = _POLICY.horizon_steps
    auto_max_move_fraction: float = 0.25
    rollback_threshold: float = 0.05
    effect_window_steps: int = 20
    # Policy runs: a job whose metrics changed is decided on the next tick of this period,
    # at most every policy_min_interval_s once warmed up; decisions run in a worker process
    # of their own when policy_process is on, so 1,024-rank decisions never stall the loop.
    policy_tick_s: Annotated[float, Field(ge=0.005, le=10.0)] = 0.05
    policy_min_interval_s: Annotated[float, Field(ge=0.0, le=600.0)] = 0.5
    policy_process: bool = True
    # Set by a program that starts the backend for its own lifetime (`rebalancer demo`, the
    # benchmarks, the tests): the backend shuts down by itself once that process is gone,
    # even when it was killed with SIGKILL and ran no cleanup.
    exit_with_parent: Annotated[int, Field(ge=1, le=2**22)] | None = None
    # Metric history: per-second windows older than this many days are deleted, checked
    # every retention_interval_s.
    retention_days: Annotated[float, Field(gt=0.0, le=3650.0)] = 7.0
    retention_interval_s: Annotated[float, Field(ge=1.0, le=86400.0)] = 3600.0
    # Live memory: a job with no connected rank leaves memory after this long (its history
    # stays in SQL); at most this many jobs are live at once (a hello for one more is
    # refused with 1013 when none of them can make room).
    forget_job_after_s: Annotated[float, Field(ge=1.0, le=30 * 86400.0)] = 900.0
    max_live_jobs: Annotated[int, Field(ge=1, le=100_000)] = 1000
    # Python's cyclic GC walks every object the backend holds; freezing the start-up heap
    # keeps those out of each collection (shorter pauses at 1,024 ranks).
    gc_freeze: bool = True
    # Full garbage collections run this often (seconds) instead of whenever the heap grows,
    # and young ones every 100,000 allocations (backend.heap); 0: Python's own schedule.
    gc_full_interval_s: Annotated[float, Field(ge=0.0, le=86400.0, allow_inf_nan=False)] = 600.0
    # Memory caps keep this fraction of each device's memory free (docs/design.md, invariant 8).
    memory_headroom: float = _POLICY.memory_headroom

    @field_validator("port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 0 <= v <= 65535:
            raise ValueError(f"REBALANCER_PORT must be between 0 and 65535, got {v}.")
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"REBALANCER_REDIS_URL must be a redis://host:port/db URL, got {v!r}.")
        return v

    @field_validator("advertise_url")
    @classmethod
    def _advertise_url(cls, v: str) -> str:
        # Hooks are redirected to it: refuse here what they would refuse there.
        from urllib.parse import urlsplit

        if v and (urlsplit(v).scheme not in ("ws", "wss", "http", "https") or not urlsplit(v).hostname
                  or "," in v):
            raise ValueError(f"REBALANCER_ADVERTISE_URL must be a URL like 'ws://10.0.0.5:8000' (scheme ws, "
                             f"wss, http or https and a host) that the training hosts can reach, got {v!r}.")
        return v

    @field_validator(*_CLUSTER_SECONDS)
    @classmethod
    def _cluster_seconds(cls, v: float, info) -> float:  # type: ignore[no-untyped-def]
        low, high = _CLUSTER_SECONDS[info.field_name]
        if not low <= v <= high:
            raise ValueError(f"REBALANCER_{info.field_name.upper()} must be between {low:g} and {high:g} "
                             f"seconds, got {v}.")
        return v

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("REBALANCER_HOST must not be empty; use 127.0.0.1 or 0.0.0.0.")
        return v.strip()

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _forwarded(cls, v: str) -> str:
        items = [x.strip() for x in v.split(",") if x.strip()]
        for item in items:
            if item == "*" or item.startswith("unix:"):
                continue
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(
                    f"REBALANCER_FORWARDED_ALLOW_IPS must list proxy addresses or networks "
                    f"(e.g. 10.0.0.5,10.1.0.0/16), or '*', got {item!r}.") from None
        return ",".join(items)

    @field_validator("db")
    @classmethod
    def _db(cls, v: str) -> str:
        if not v.startswith(("sqlite:", "postgresql:", "postgresql+psycopg:", "postgres:")):
            raise ValueError(
                f"REBALANCER_DB must be a sqlite:///path or postgresql://user@host/db URL, got {v!r}."
            )
        return v

    @field_validator("admin_token")
    @classmethod
    def _admin_token(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 16:
            raise ValueError(
                "REBALANCER_ADMIN_TOKEN must be at least 16 characters; "
                "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'."
            )
        return v

    @field_validator("step_buffer", "device_buffer", "window_steps", "persist_buffer_windows")
    @classmethod
    def _positive_int(cls, v: int, info) -> int:  # type: ignore[no-untyped-def]
        if v < 1 or v > 1_000_000:
            raise ValueError(
                f"REBALANCER_{info.field_name.upper()} must be between 1 and 1000000, got {v}."
            )
        return v

    @field_validator("persist_interval_s", "stale_after_s", "controller_tick_s",
                     "ws_ping_interval_s", "ws_ping_timeout_s", "health_interval_s")
    @classmethod
    def _positive_seconds(cls, v: float, info) -> float:  # type: ignore[no-untyped-def]
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"REBALANCER_{info.field_name.upper()} must be a positive number of seconds, got {v}.")
        return v

    @field_validator(*_POLICY_FIELDS)
    @classmethod
    def _policy_range(cls, v: float, info) -> float:  # type: ignore[no-untyped-def]
        # The backend's default of a per-job policy setting: the same range PUT /policy takes.
        problem = limit_problem(_POLICY_FIELDS[info.field_name], v)
        if problem is not None:
            raise ValueError(f"REBALANCER_{info.field_name.upper()} {problem}.")
        return v

    @field_validator("dashboard_max_hz")
    @classmethod
    def _hz(cls, v: float) -> float:
        if not math.isfinite(v) or not 0 < v <= 10:
            raise ValueError(
                f"REBALANCER_DASHBOARD_MAX_HZ must be above 0 and at most 10 pushes a second, got {v}."
            )
        return v

    @field_validator("device_prices")
    @classmethod
    def _prices(cls, v: dict[str, float]) -> dict[str, float]:
        for k, p in v.items():
            if not k.strip() or not math.isfinite(p) or p < 0:
                raise ValueError(
                    f"REBALANCER_DEVICE_PRICES must map device types to prices >= 0 USD/h, got {k!r}: {p}."
                )
        return v

    @model_validator(mode="after")
    def _ws_limit(self) -> Settings:
        if self.ws_max_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(
                f"REBALANCER_WS_MAX_BYTES must exceed the protocol limit of {MAX_MESSAGE_BYTES} bytes "
                f"so oversized frames get a clear error, got {self.ws_max_bytes}."
            )
        if self.device_buffer < 1 or self.step_buffer < self.window_steps:
            raise ValueError(
                f"REBALANCER_STEP_BUFFER ({self.step_buffer}) must be at least "
                f"REBALANCER_WINDOW_STEPS ({self.window_steps})."
            )
        if self.policy_window_steps < self.min_steps:  # the policy's own rule (check_config)
            raise ValueError(
                f"REBALANCER_POLICY_WINDOW_STEPS ({self.policy_window_steps}) must be at least "
                f"REBALANCER_MIN_STEPS ({self.min_steps}): the policy fits each rank over that window."
            )
        return self

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    def price_for(self, device_type: str, device_name: str = "") -> float | None:
        """USD per hour for one accelerator, or None when no key matches.

        The reported type first (the probe sends the device key), then the device named by
        the one device-key rule (``rebalancer_wire.devices.device_key``): its key, then the
        key's family (``A100-40GB`` -> ``A100``); a key of the operator's own (a device the table lacks) is
        matched as a substring of the driver's name, the longest key winning."""
        lowered = {k.lower(): p for k, p in self.device_prices.items()}
        key = device_key(device_name) or device_key(device_type)
        for candidate in [device_type] + ([key, key.split("-")[0]] if key else []):
            if candidate and candidate.lower() in lowered:
                return lowered[candidate.lower()]
        name = device_name.lower()
        best = max((k for k in lowered if k in name), key=len, default=None)
        return lowered[best] if best is not None else None
