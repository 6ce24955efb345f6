"""``GET /metrics``: Prometheus text exposition, read from live state at scrape time.

Each app has its own ``CollectorRegistry`` (tests build many apps in one process), with one
custom collector; nothing is updated on the ingest path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backend.api.deps import PartsDep, ViewerDep

if TYPE_CHECKING:
    from backend.control.controller import Controller
    from backend.ingest.connections import HookConnections
    from backend.live.state import LiveState

__all__ = ["router", "RebalancerCollector", "make_registry"]

log = logging.getLogger("rebalancer.prom")
router = APIRouter()


class RebalancerCollector(Collector):
    """Exports per-job and per-rank gauges and the ingest counters of one app. Control
    figures come from the controller's snapshots (memory, no SQL)."""

    def __init__(self, *, live: LiveState, connections: HookConnections, controller: Controller):
        self.live = live
        self.connections = connections
        self.controller = controller

    def collect(self) -> Iterator[Metric]:
        s = self
        compute = GaugeMetricFamily(
            "rebalancer_rank_compute_seconds",
            "Mean time until a rank's gradients are ready, over its recent steps.", labels=["job", "rank"])
        step = GaugeMetricFamily(
            "rebalancer_step_seconds", "Median wall time of one step over the job's ranks.", labels=["job"])
        imbalance = GaugeMetricFamily(
            "rebalancer_imbalance_ratio", "max/mean rank compute time minus 1.", labels=["job"])
        version = GaugeMetricFamily(
            "rebalancer_placement_version", "Version of the placement in force.", labels=["job"])
        connected = GaugeMetricFamily(
            "rebalancer_connected_ranks", "Ranks with an open hook connection.", labels=["job"])
        proposals = GaugeMetricFamily(
            "rebalancer_proposals", "Proposals by status.", labels=["job", "status"])
        for job in s.live.jobs():
            view = s.live.view(job)
            if view is None:
                continue
            for r in view.ranks:
                if r.compute_ms is not None:
                    compute.add_metric([job, str(r.rank)], r.compute_ms / 1000.0)
            if view.step_ms is not None:
                step.add_metric([job], view.step_ms / 1000.0)
            if view.imbalance is not None:
                imbalance.add_metric([job], view.imbalance)
            connected.add_metric([job], view.connected_ranks)
            ctl = s.controller
            try:
                placement = ctl.job_control(job).get("placement") or {}
                if "version" in placement:
                    version.add_metric([job], placement["version"])
                for status, n in sorted(ctl.proposal_counts(job).items()):
                    proposals.add_metric([job, status], n)
            except Exception:  # a scrape must still answer with what live state has
                log.exception("reading control state of job %s for /metrics failed", job)
        yield from (compute, step, imbalance, version, connected, proposals)
        yield CounterMetricFamily(
            "rebalancer_ingest_messages", "Hook messages ingested.", value=s.live.messages_total)
        yield CounterMetricFamily(
            "rebalancer_ingest_records", "Step and device records ingested.", value=s.live.records_total)
        yield CounterMetricFamily(
            "rebalancer_dropped_records", "Records the hooks reported as dropped.", value=s.live.dropped_total)
        yield GaugeMetricFamily(
            "rebalancer_hook_connections", "Open hook websockets.", value=s.connections.count())


def make_registry(*, live: LiveState, connections: HookConnections,
                  controller: Controller) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RebalancerCollector(live=live, connections=connections, controller=controller))
    return registry


@router.get("/metrics", include_in_schema=False)
def metrics(_actor: ViewerDep, parts: PartsDep) -> Response:
    """Prometheus exposition of live state; scrapers send a viewer token as a bearer."""
    return Response(generate_latest(parts.registry), media_type=CONTENT_TYPE_LATEST)
