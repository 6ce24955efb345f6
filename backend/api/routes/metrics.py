"""``GET /metrics``: Prometheus text exposition, read from live state at scrape time.

Each app has its own ``CollectorRegistry`` (tests build many apps in one process), with one
custom collector; nothing is updated on the ingest path. Names, labels and help texts come
from the contract (backend/metrics_contract.py); figures come from their owners: live state
(times, devices, the step histogram), ``backend.live.forecast`` (ETA, cost), the dashboard
hub (savings against the uniform split) and the controller (mode, placement, proposals, and
the counters, which count stored rows so that they survive a restart).

Access (``REBALANCER_METRICS_ACCESS``): ``token`` asks for a bearer token with at least the
viewer role (create a dedicated one for the scraper); ``loopback`` also answers callers on
this machine without a token (a Prometheus beside the backend), and still asks others for one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, HTTPException, Request, Response, status
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from backend.api.deps import PartsDep, bearer_secret
from backend.auth.tokens import role_allows
from backend.live.forecast import forecast
from backend.live.state import JobView, RankView
from backend.metrics_contract import STEP_BUCKETS_S, THROTTLE_REASONS, by_name
from backend.settings import is_loopback

if TYPE_CHECKING:
    from backend.control.controller import Controller
    from backend.dashboard.hub import DashboardHub
    from backend.ingest.connections import HookConnections
    from backend.live.state import LiveState
    from backend.parts import Parts
    from backend.settings import Settings

__all__ = ["router", "RebalancerCollector", "make_registry"]

log = logging.getLogger("rebalancer.prom")
router = APIRouter()

_SPECS = by_name()
_MODES = ("observe", "approve", "auto")
_BOUNDS = [*(f"{b:g}" for b in STEP_BUCKETS_S), "+Inf"]


def _family(name: str) -> Any:
    spec = _SPECS[name]
    labels = list(spec.labels)
    if spec.kind == "counter":
        return CounterMetricFamily(name, spec.help, labels=labels)
    if spec.kind == "histogram":
        return HistogramMetricFamily(name, spec.help, labels=labels)
    return GaugeMetricFamily(name, spec.help, labels=labels)


# Per-rank families: (metric, RankView attribute in ms).
_RANK_TIMES = (("rebalancer_rank_compute_seconds", "compute_ms"),
               ("rebalancer_rank_sync_wait_seconds", "sync_wait_ms"),
               ("rebalancer_rank_data_wait_seconds", "data_wait_ms"))
# Per-device gauges: (metric, DeviceSample attribute, factor to the base unit).
_DEVICE = (("rebalancer_device_utilization_ratio", "util_pct", 0.01),
           ("rebalancer_device_memory_used_bytes", "mem_used_bytes", 1.0),
           ("rebalancer_device_memory_total_bytes", "mem_total_bytes", 1.0),
           ("rebalancer_device_power_watts", "power_w", 1.0),
           ("rebalancer_device_temperature_celsius", "temp_c", 1.0),
           ("rebalancer_device_sm_clock_hertz", "sm_clock_mhz", 1e6),
           ("rebalancer_device_sm_clock_max_hertz", "sm_clock_max_mhz", 1e6))


class RebalancerCollector(Collector):
    """Exports every exported metric of the contract for one app."""

    def __init__(self, *, live: LiveState, connections: HookConnections, controller: Controller,
                 hub: DashboardHub, settings: Settings):
        self.live = live
        self.connections = connections
        self.controller = controller
        self.hub = hub
        self.settings = settings

    def collect(self) -> Iterator[Metric]:
        fams = {name: _family(name) for name, spec in _SPECS.items() if spec.labels}
        for job in self.live.jobs():
            view = self.live.view(job)
            if view is None:
                continue
            control = self.controller.job_control(job)
            self._ranks(fams, view, control)
            self._job(fams, view, control)
            self._control(fams, job, control)
        yield from fams.values()
        yield CounterMetricFamily("rebalancer_ingest_messages", _SPECS["rebalancer_ingest_messages_total"].help,
                                  value=self.live.messages_total)
        yield CounterMetricFamily("rebalancer_ingest_records", _SPECS["rebalancer_ingest_records_total"].help,
                                  value=self.live.records_total)
        yield CounterMetricFamily("rebalancer_dropped_records", _SPECS["rebalancer_dropped_records_total"].help,
                                  value=self.live.dropped_total)
        yield GaugeMetricFamily("rebalancer_hook_connections", _SPECS["rebalancer_hook_connections"].help,
                                value=self.connections.count())

    def _ranks(self, fams: dict[str, Any], view: JobView, control: dict[str, Any]) -> None:
        job, gbs = view.job, view.global_batch_size
        shares = (control.get("placement") or {}).get("shares") or []
        times = [(fams[name], attr) for name, attr in _RANK_TIMES]
        device = [(fams[name], attr, k) for name, attr, k in _DEVICE]
        connected = fams["rebalancer_rank_connected"]
        local, ratio = fams["rebalancer_rank_local_batch_size"], fams["rebalancer_rank_batch_share_ratio"]
        throttle = fams["rebalancer_device_throttle_reason"]
        for r in view.ranks:
            labels = [job, str(r.rank)]
            connected.add_metric(labels, 1.0 if r.connected else 0.0)
            for fam, attr in times:
                ms = getattr(r, attr)
                if ms is not None:
                    fam.add_metric(labels, ms / 1000.0)
            share = shares[r.rank] if r.rank < len(shares) else r.local_batch_size
            if share is not None:
                local.add_metric(labels, share)
                ratio.add_metric(labels, share / gbs)
            d = r.device
            if d is None or d.source != "nvml":
                continue  # CPU ranks have no GPU series
            dev_labels = [*labels, *_gpu_labels(r)]
            for fam, attr, k in device:
                v = getattr(d, attr)
                if v is not None:
                    fam.add_metric(dev_labels, v * k)
            active = set(d.throttle_reasons)
            for reason in THROTTLE_REASONS:
                throttle.add_metric([*dev_labels, reason], 1.0 if reason in active else 0.0)

    def _job(self, fams: dict[str, Any], view: JobView, control: dict[str, Any]) -> None:
        labels = [view.job]
        for name, value in (("rebalancer_step_seconds", _s(view.step_ms)),
                            ("rebalancer_imbalance_ratio", view.imbalance),
                            ("rebalancer_connected_ranks", view.connected_ranks),
                            ("rebalancer_world_size", view.world_size),
                            ("rebalancer_global_batch_size", view.global_batch_size)):
            if value is not None:
                fams[name].add_metric(labels, value)
        hist = self.live.step_histogram(view.job)
        if hist is not None:
            cumulative, total_s = hist
            fams["rebalancer_step_duration_seconds"].add_metric(
                labels, buckets=list(zip(_BOUNDS, cumulative, strict=True)), sum_value=total_s)
        fc = forecast(view, self.settings.price_for)
        for name, value in (("rebalancer_eta_seconds", fc.eta_s),
                            ("rebalancer_hourly_cost_dollars", fc.cost_per_hour),
                            ("rebalancer_cost_to_finish_dollars", fc.cost_to_finish)):
            if value is not None:
                fams[name].add_metric(labels, value)
        saved = self.hub.savings(view.job)
        if saved is not None:
            fams["rebalancer_savings_seconds"].add_metric(labels, saved["saved_s"])
            if saved["saved_cost"] is not None:
                fams["rebalancer_savings_dollars"].add_metric(labels, saved["saved_cost"])
        mode = control.get("mode")
        if mode is not None:
            for m in _MODES:
                fams["rebalancer_mode"].add_metric([*labels, m], 1.0 if m == mode else 0.0)
        version = (control.get("placement") or {}).get("version")
        if version is not None:
            fams["rebalancer_placement_version"].add_metric(labels, version)

    def _control(self, fams: dict[str, Any], job: str, control: dict[str, Any]) -> None:
        if not control:
            return  # the controller does not know the job (yet)
        for st, n in sorted(self.controller.proposal_counts(job).items()):
            fams["rebalancer_proposals"].add_metric([job, st], n)
        counts = self.controller.activity_counts(job)
        if not counts:
            return
        for source, n in counts["proposals"].items():
            fams["rebalancer_proposals_created_total"].add_metric([job, source], n)
        for source, n in counts["placements"].items():
            fams["rebalancer_placements_total"].add_metric([job, source], n)
        fams["rebalancer_placement_failures_total"].add_metric([job], counts["failed"][""])


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def _gpu_labels(r: RankView) -> list[str]:
    # dcgm-exporter's Hostname, gpu, UUID, modelName (GPU_LABELS order)
    return [r.host, "" if r.gpu_index is None else str(r.gpu_index), r.gpu_uuid, r.device_name]


def make_registry(*, live: LiveState, connections: HookConnections, controller: Controller,
                  hub: DashboardHub, settings: Settings) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RebalancerCollector(live=live, connections=connections, controller=controller,
                                          hub=hub, settings=settings))
    return registry


def _may_scrape(request: Request, parts: Parts) -> None:
    address = request.client.host if request.client else None
    secret = bearer_secret(request.headers)
    if secret is None and parts.settings.metrics_access == "loopback" and address and is_loopback(address):
        return
    actor = parts.auth.authenticate(secret, address)
    if actor is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "Missing or invalid bearer token.",
                            headers={"WWW-Authenticate": "Bearer"})
    if not role_allows(actor.role, "viewer"):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "This action needs the viewer role.")


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request, parts: PartsDep) -> Response:
    """Prometheus exposition of live state; see the module's docstring for who may scrape."""
    _may_scrape(request, parts)
    return Response(generate_latest(parts.registry), media_type=CONTENT_TYPE_LATEST)
