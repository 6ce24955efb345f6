"""The Prometheus exposition of live state (``GET /metrics`` serves it), built at scrape time.

Each app has its own ``MetricsExporter``; nothing is updated on the ingest path. Names,
labels and help texts come from the contract (backend/metrics_contract.py); figures come
from their owners: live state (times, devices, the step histogram),
``backend.live.forecast`` (ETA, cost), the dashboard hub (savings against the uniform
split, and the fleet totals of ``backend.live.fleet``) and the controller's snapshot (mode,
placement, proposals, and the counters, which count stored rows so that they survive a
restart). It lives beside the other parts, not under the routes, so that the wiring
(``backend.parts``) builds it without importing a route.

Per-rank series (time split, communication, links, the device's NVML gauges): by default
only each job's ``REBALANCER_METRICS_SLOWEST_RANKS`` slowest ranks, up to
``REBALANCER_METRICS_GONE_RANKS`` ranks that are gone, the rank a hung job waits on, and
every rank of a job of up to ``REBALANCER_METRICS_ALL_RANKS_UP_TO`` ranks
(``REBALANCER_METRICS_RANK_SERIES=all``: every rank). Per-job aggregates (min, median and
max of each per-rank gauge, throttled-rank counts) cover every rank, so a scrape's series
do not grow with ranks and its cost is one pass over them. ``body()`` reuses the text for
``REBALANCER_METRICS_CACHE_S`` (several scrapers build it once).

The text is written directly (Prometheus text format 0.0.4), each rank's label set
rendered once per scrape: at 1,024 GPU ranks (~25,000 series) prometheus_client's
families and ``generate_latest`` took about three times the CPU (bench.capacity --scrape-only).

One module, over 400 lines on purpose: one writer per part of the contract, all sharing a
job's bounded rank set and its one pass over the ranks; split, each part would redo both.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from backend.live.forecast import forecast, goodput
from backend.live.state import JobView, RankView
from backend.metrics_contract import (
    CONTRACT,
    STATS,
    STEP_BUCKETS_S,
    THROTTLE_REASONS,
    MetricSpec,
    job_stats_name,
)
from backend.modes import MODES
from backend.policy.comm import BOUNDS
from rebalancer_wire.protocol import LINK_FIELDS

if TYPE_CHECKING:
    from backend.cluster import Forwarder, LiveFanout
    from backend.control.controller import Controller
    from backend.dashboard.hub import DashboardHub
    from backend.live.state import LiveState
    from backend.peers.connections import HookConnections
    from backend.settings import Settings
    from backend.storage.health import StorageHealth
    from backend.storage.writes import WriteBuffer

__all__ = ["MetricsExporter", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BOUNDS = [*(f"{b:g}" for b in STEP_BUCKETS_S), "+Inf"]


def _esc(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return v


def _labels(**kv: Any) -> str:
    return ",".join(f'{k}="{_esc(str(v))}"' for k, v in kv.items())


def _num(v: float) -> str:
    return repr(float(v))


def _stats(fam: _Family, labels: str, values: list[float]) -> None:
    """min, median and max of ``values`` (none: no sample)."""
    if not values:
        return
    values.sort()
    n = len(values)
    mid = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2.0
    for stat, v in zip(STATS, (values[0], mid, values[-1]), strict=True):
        fam.add(f'{labels},stat="{stat}"', v)


class _Family:
    """One metric family's lines; ``add`` takes its rendered labels (``k="v",...``)."""

    __slots__ = ("spec", "lines")

    def __init__(self, spec: MetricSpec):
        self.spec = spec
        self.lines: list[str] = []

    def add(self, labels: str, value: float, name: str | None = None) -> None:
        n = name or self.spec.name
        self.lines.append(f"{n}{{{labels}}} {_num(value)}" if labels else f"{n} {_num(value)}")

    def render(self) -> str:
        s = self.spec
        help_ = s.help.replace("\\", "\\\\").replace("\n", "\\n")
        head = f"# HELP {s.name} {help_}\n# TYPE {s.name} {s.kind}\n"
        return head + "".join(line + "\n" for line in self.lines)


# Per-rank families: (metric, RankView attribute in ms).
_RANK_TIMES = (("rebalancer_rank_compute_seconds", "compute_ms"),
               ("rebalancer_rank_sync_wait_seconds", "sync_wait_ms"),
               ("rebalancer_rank_data_wait_seconds", "data_wait_ms"))
# Per-rank communication families: (metric, RankComm attribute, to the base unit).
_COMM: tuple[tuple[str, str, Callable[[float], float]], ...] = (
    ("rebalancer_rank_comm_bytes", "comm_bytes_per_step", float),
    ("rebalancer_rank_comm_seconds", "comm_ms", lambda ms: ms / 1000.0),
    ("rebalancer_rank_comm_wait_seconds", "wait_ms", lambda ms: ms / 1000.0),
    ("rebalancer_rank_bus_bandwidth_bytes_per_second", "busbw_gbps", lambda gbps: gbps * 1e9),
)
# Per-device gauges: (metric, DeviceSample attribute, factor to the base unit).
_DEVICE = (("rebalancer_device_utilization_ratio", "util_pct", 0.01),
           ("rebalancer_device_memory_used_bytes", "mem_used_bytes", 1.0),
           ("rebalancer_device_memory_total_bytes", "mem_total_bytes", 1.0),
           ("rebalancer_device_power_watts", "power_w", 1.0),
           ("rebalancer_device_temperature_celsius", "temp_c", 1.0),
           ("rebalancer_device_sm_clock_hertz", "sm_clock_mhz", 1e6),
           ("rebalancer_device_sm_clock_max_hertz", "sm_clock_max_mhz", 1e6))


class MetricsExporter:
    """Writes every exported metric of the contract for one app."""

    def __init__(self, *, live: LiveState, connections: HookConnections, controller: Controller,
                 hub: DashboardHub, settings: Settings,
                 writes: WriteBuffer, storage: StorageHealth, fanout: LiveFanout | None = None,
                 forwarder: Forwarder | None = None, clock: Callable[[], float] = time.monotonic):
        self.live = live
        self.connections = connections
        self.controller = controller
        self.hub = hub
        self.settings = settings
        self.writes = writes
        self.storage = storage
        self.fanout = fanout  # None: one replica (the counters stay 0)
        self.forwarder = forwarder
        self.clock = clock
        self._built: tuple[float, bytes] | None = None
        self._build_lock = threading.Lock()  # concurrent scrapes wait for one build

    def body(self) -> bytes:
        """The scrape as served: the text built less than ``metrics_cache_s`` ago, or a new one."""
        ttl = self.settings.metrics_cache_s
        with self._build_lock:
            built = self._built
            if built is not None and self.clock() - built[0] < ttl:
                return built[1]
            started = self.clock()
            text = self.exposition().encode()
            self._built = (started, text) if ttl > 0 else None
            return text

    def exposition(self) -> str:
        """The whole scrape, as Prometheus text (built now)."""
        fams = {m.name: _Family(m) for m in CONTRACT if m.exported}
        for job in self.live.jobs():
            view = self.live.view(job)
            if view is None:
                continue
            control = self.controller.job_control(job)
            exported = self._exported_ranks(view)
            keep = {r.rank for r in exported}
            self._comm(fams, view, keep)
            self._ranks(fams, view, control, exported)
            self._job(fams, view, control)
            self._control(fams, job, control)
            self._pipeline(fams, view, exported)
        fams["rebalancer_ingest_messages_total"].add("", self.live.messages_total)
        fams["rebalancer_ingest_records_total"].add("", self.live.records_total)
        refused = {(f, r): 0 for f in ("metrics", "node_metrics") for r in ("malformed", "too_big")}
        for (frame, reason), n in sorted({**refused, **self.live.refused()}.items()):
            fams["rebalancer_ingest_refused_frames_total"].add(_labels(frame=frame, reason=reason), n)
        fams["rebalancer_dropped_records_total"].add("", self.live.dropped_total)
        fams["rebalancer_hook_connections"].add("", self.connections.count())
        fams["rebalancer_persist_dropped_windows_total"].add("", self.writes.dropped_total)
        fams["rebalancer_persist_buffered_windows"].add("", len(self.writes))
        fams["rebalancer_database_writable"].add("", 0 if (self.storage.problem or self.writes.fault) else 1)
        fams["rebalancer_live_jobs"].add("", self.live.job_count())
        fwd = self.forwarder
        for outcome, n in (("answered", fwd.answered if fwd else 0), ("failed", fwd.failed if fwd else 0)):
            fams["rebalancer_forwarded_requests_total"].add(_labels(outcome=outcome), n)
        fan = self.fanout
        for outcome, n in (("stored", fan.published if fan else 0), ("applied", fan.applied if fan else 0),
                           ("refused", fan.refused if fan else 0)):
            fams["rebalancer_fanout_snapshots_total"].add(_labels(outcome=outcome), n)
        self._fleet(fams)
        return "".join(f.render() for f in fams.values() if f.lines)

    def _fleet(self, fams: dict[str, _Family]) -> None:
        t = self.hub.fleet(own=True)["totals"]  # the home page's totals over this replica's own jobs
        for name, value in (("rebalancer_fleet_jobs", t["jobs"]), ("rebalancer_fleet_ranks", t["ranks"]),
                            ("rebalancer_fleet_running_jobs", t["running"]),
                            ("rebalancer_fleet_wasted_gpu_seconds", t["wasted_gpu_hours"] * 3600.0),
                            ("rebalancer_fleet_saved_seconds", t["saved_s"]),
                            ("rebalancer_fleet_saved_dollars", t["saved_cost"]),
                            ("rebalancer_fleet_pending_proposals", t["pending_proposals"])):
            if value is not None:
                fams[name].add("", value)

    def _exported_ranks(self, view: JobView) -> tuple[RankView, ...]:
        """The ranks with per-rank series: all, or (``slowest``, the default) the k with the
        longest compute, up to ``metrics_gone_ranks`` ranks that are gone (lost ones first,
        lowest rank first) while others of its job still run, and the rank a hung job waits
        on; every rank of a small job."""
        st = self.settings
        k = st.metrics_slowest_ranks
        ranks = view.ranks
        if st.metrics_rank_series == "all" or len(ranks) <= max(k, st.metrics_all_ranks_up_to):
            return ranks
        running = view.connected_ranks > 0
        lost = [r for r in ranks if r.lost]
        gone = (lost + [r for r in ranks if running and not r.connected and not r.lost])[:st.metrics_gone_ranks]
        timed = [r for r in ranks if r.compute_ms is not None]
        slowest = heapq.nlargest(k, timed, key=lambda r: (r.compute_ms, -r.rank))
        if len(slowest) < k:  # ranks without steps yet fill the rest, lowest first
            slowest += [r for r in ranks if r.compute_ms is None][:k - len(slowest)]
        keep = {r.rank for r in slowest} | {r.rank for r in gone} | ({view.hung.rank} if view.hung else set())
        return tuple(r for r in ranks if r.rank in keep)

    def _ranks(self, fams: dict[str, _Family], view: JobView, control: dict[str, Any],
               exported: tuple[RankView, ...]) -> None:
        job, gbs = _esc(view.job), view.global_batch_size
        self._rank_stats(fams, view)
        fams["rebalancer_rank_series_omitted"].add(_labels(job=view.job), len(view.ranks) - len(exported))
        fams["rebalancer_lost_ranks"].add(_labels(job=view.job), len(view.lost_ranks))
        compute = [r.compute_ms for r in view.ranks if r.compute_ms is not None]
        if compute:
            fams["rebalancer_max_compute_seconds"].add(_labels(job=view.job), max(compute) / 1000.0)
            fams["rebalancer_mean_compute_seconds"].add(_labels(job=view.job), sum(compute) / len(compute) / 1000.0)
        shares = (control.get("placement") or {}).get("shares") or []
        times = [(fams[name], attr) for name, attr in _RANK_TIMES]
        device = [(fams[name], attr, k) for name, attr, k in _DEVICE]
        connected = fams["rebalancer_rank_connected"]
        lost = fams["rebalancer_rank_lost"]
        local, ratio = fams["rebalancer_rank_local_batch_size"], fams["rebalancer_rank_batch_share_ratio"]
        throttle = fams["rebalancer_device_throttle_reason"]
        hung, hung_on, hung_s = view.hung, fams["rebalancer_job_hung"], fams["rebalancer_job_hung_seconds"]
        waited_s = max(0.0, time.time() - hung.since) if hung is not None else 0.0
        for r in exported:
            labels = f'job="{job}",rank="{r.rank}"'
            connected.add(labels, 1.0 if r.connected else 0.0)
            lost.add(labels, 1.0 if r.lost else 0.0)
            on = hung is not None and r.rank == hung.rank  # 0 for the ranks the job does not wait on
            hung_on.add(labels, 1.0 if on else 0.0)
            hung_s.add(labels, waited_s if on else 0.0)
            for fam, attr in times:
                ms = getattr(r, attr)
                if ms is not None:
                    fam.add(labels, ms / 1000.0)
            share = shares[r.rank] if r.rank < len(shares) else r.local_batch_size
            if share is not None:
                local.add(labels, share)
                ratio.add(labels, share / gbs)
            d = r.device
            if d is None or d.source != "nvml":
                continue  # CPU ranks have no GPU series
            # dcgm-exporter's labels (GPU_LABELS)
            dev = labels + "," + _labels(Hostname=r.host, gpu="" if r.gpu_index is None else r.gpu_index,
                                         UUID=r.gpu_uuid, modelName=r.device_name)
            for fam, attr, k in device:
                v = getattr(d, attr)
                if v is not None:
                    fam.add(dev, v * k)
            active = set(d.throttle_reasons)
            for reason in THROTTLE_REASONS:
                throttle.add(f'{dev},reason="{reason}"', 1.0 if reason in active else 0.0)

    def _rank_stats(self, fams: dict[str, _Family], view: JobView) -> None:
        """Per-job aggregates of the time split, links and device gauges over every rank: a
        column at a time (a list comprehension per field, about 10 ms at 16,384 ranks)."""
        labels = _labels(job=view.job)
        ranks = view.ranks
        for name, attr in _RANK_TIMES:
            _stats(fams[job_stats_name(name)], labels,
                   [ms / 1000.0 for ms in map(attrgetter(attr), ranks) if ms is not None])
        devices = [d for d in map(attrgetter("device"), ranks) if d is not None]
        link_fam = fams["rebalancer_job_rank_link_bytes_per_second"]
        for f in LINK_FIELDS:
            link, direction = f.split("_")[:2]
            _stats(link_fam, f'{labels},link="{link}",direction="{direction}"',
                   [v for v in map(attrgetter(f), devices) if v is not None])
        gpus = [d for d in devices if d.source == "nvml"]
        if not gpus:
            return
        for name, attr, k in _DEVICE:
            _stats(fams[job_stats_name(name)], labels,
                   [v * k for v in map(attrgetter(attr), gpus) if v is not None])
        throttled = Counter(chain.from_iterable(map(attrgetter("throttle_reasons"), gpus)))
        fam = fams["rebalancer_job_device_throttled_ranks"]
        for reason in THROTTLE_REASONS:
            fam.add(f'{labels},reason="{reason}"', throttled[reason])

    def _comm(self, fams: dict[str, _Family], view: JobView, keep: set[int]) -> None:
        comm = self.live.communication(view.job)
        if comm is None:
            return
        job = _esc(view.job)
        labels = _labels(job=view.job)
        if comm.exposed_comm_ms is not None:
            fams["rebalancer_exposed_comm_seconds"].add(labels, comm.exposed_comm_ms / 1000.0)
        for b in BOUNDS:
            fams["rebalancer_bound"].add(f'{labels},bound="{b}"', 1.0 if b == comm.bound else 0.0)
        shown = [rc for rc in comm.ranks if rc.rank in keep]
        for name, attr, unit in _COMM:
            _stats(fams[job_stats_name(name)], labels,
                   [unit(v) for v in map(attrgetter(attr), comm.ranks) if v is not None])
            fam, get = fams[name], attrgetter(attr)
            for rc in shown:
                v = get(rc)
                if v is not None:
                    fam.add(f'job="{job}",rank="{rc.rank}"', unit(v))
        links = fams["rebalancer_rank_link_bytes_per_second"]
        for r in view.ranks:
            d = r.device
            if d is None or r.rank not in keep:
                continue
            rank = f'job="{job}",rank="{r.rank}"'
            for f in LINK_FIELDS:
                v = getattr(d, f)
                if v is not None:
                    link, direction = f.split("_")[:2]
                    links.add(f'{rank},link="{link}",direction="{direction}"', v)

    def _job(self, fams: dict[str, _Family], view: JobView, control: dict[str, Any]) -> None:
        labels = _labels(job=view.job)
        _add_known(fams, labels, (("rebalancer_step_seconds", _s(view.step_ms)),
                                  ("rebalancer_imbalance_ratio", view.imbalance),
                                  ("rebalancer_connected_ranks", view.connected_ranks),
                                  ("rebalancer_world_size", view.world_size),
                                  ("rebalancer_global_batch_size", view.global_batch_size)))
        hist = self.live.step_histogram(view.job)
        if hist is not None:
            cumulative, total_s = hist
            fam, base = fams["rebalancer_step_duration_seconds"], "rebalancer_step_duration_seconds"
            for le, n in zip(_BOUNDS, cumulative, strict=True):
                fam.add(f'{labels},le="{le}"', n, f"{base}_bucket")
            fam.add(labels, cumulative[-1], f"{base}_count")
            fam.add(labels, total_s, f"{base}_sum")
        fc = forecast(view, self.settings.price_for)
        _add_known(fams, labels, (("rebalancer_goodput_ratio", goodput(view)),
                                  ("rebalancer_eta_seconds", fc.eta_s),
                                  ("rebalancer_hourly_cost_dollars", fc.cost_per_hour),
                                  ("rebalancer_cost_to_finish_dollars", fc.cost_to_finish)))
        saved = self.hub.savings(view.job)
        if saved is not None:
            fams["rebalancer_savings_seconds"].add(labels, saved["saved_s"] or 0.0)
            if saved["saved_cost"] is not None:
                fams["rebalancer_savings_dollars"].add(labels, saved["saved_cost"])
        mode = control.get("mode")
        if mode is not None:
            for m in MODES:
                fams["rebalancer_mode"].add(f'{labels},mode="{m}"', 1.0 if m == mode else 0.0)
        version = (control.get("placement") or {}).get("version")
        if version is not None:
            fams["rebalancer_placement_version"].add(labels, version)

    def _pipeline(self, fams: dict[str, _Family], view: JobView, exported: tuple[RankView, ...]) -> None:
        """A pipelined job's series (docs/pipelines.md): the grid for the ranks (pipelines)
        with per-rank series, the job's bottleneck stage and the advice's gain."""
        book = self.live.pipelines
        a = book.assessment(view.job) if book.shape(view.job) is not None else None
        if a is None:
            return
        job, labels = _esc(view.job), _labels(job=view.job)
        if a.bottleneck_stage is not None:
            fams["rebalancer_pipeline_bottleneck_stage"].add(labels, a.bottleneck_stage)
        fams["rebalancer_pipeline_stage_split_gain_ratio"].add(labels, a.advice.gain if a.advice else 0.0)
        stage, bubble, idle = (fams["rebalancer_pipeline_stage_seconds"], fams["rebalancer_pipeline_bubble_ratio"],
                               fams["rebalancer_rank_bubble_seconds"])
        for r in exported:
            row = a.rows[r.rank] if r.rank < len(a.rows) else None
            if row is None:
                continue
            rank = f'job="{job}",rank="{r.rank}"'
            for s, ms in enumerate(row.stage_ms):
                stage.add(f'{rank},stage="{s}"', ms / 1000.0)
            if row.bubble_share is not None:
                bubble.add(rank, row.bubble_share)
            bubble_ms = book.rank_fields(view.job, r.rank).get("bubble_ms")
            if bubble_ms is not None:
                idle.add(rank, bubble_ms / 1000.0)

    def _control(self, fams: dict[str, _Family], job: str, control: dict[str, Any]) -> None:
        if not control:
            return  # the controller does not know the job (yet)
        labels = _labels(job=job)
        for st, n in sorted(self.controller.proposal_counts(job).items()):
            fams["rebalancer_proposals"].add(f'{labels},status="{_esc(st)}"', n)
        counts = self.controller.activity_counts(job)
        if not counts:
            return
        for source, n in counts["proposals"].items():
            fams["rebalancer_proposals_created_total"].add(f'{labels},source="{_esc(source)}"', n)
        for source, n in counts["placements"].items():
            fams["rebalancer_placements_total"].add(f'{labels},source="{_esc(source)}"', n)
        fams["rebalancer_placement_failures_total"].add(labels, counts["failed"][""])


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def _add_known(fams: dict[str, _Family], labels: str, values: Iterable[tuple[str, float | None]]) -> None:
    """One sample per (family, value) whose value is known; an unknown one is left out."""
    for name, value in values:
        if value is not None:
            fams[name].add(labels, value)
