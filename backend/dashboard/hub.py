"""DashboardHub: the data feed of ``/ws/dashboard``, coalesced to at most N pushes a second.

Ingest and the controller call ``notify(job)`` (``JobChanges.mark``), which only adds the
job to a dirty set. Control state comes from the controller's published snapshot
(``control(job)``: memory, no SQL); ETA, cost and savings from ``backend.live.forecast``. A ticker runs ``dashboard_max_hz`` times a second: it folds what arrived for the
dirty jobs into per-job feeds (per-batch aggregates, heatmap columns, placement markers,
a summary and the control state), once per job whatever the number of viewers, then wakes
the clients that watch those jobs. Each client has its own sender task with a cursor into
the feeds: a slow client only delays itself, and whatever piled up while it was busy goes
out as one frame (latest wins, nothing of the series is lost while it stays buffered).

Frames (JSON text):
- ``{"type": "overview", "t", "jobs": [summary, ...], "fleet": {"data", "count", "totals"}}``
  for clients without a job: the fleet summary (``backend.live.fleet``), rebuilt and
  encoded once per tick in which a job changed, the same text for every overview client;
- ``{"type": "job", "full": bool, "job", "t", "summary", "control", "ranks", "series",
  "markers", "heat", "savings"}`` for ``?job=NAME``: the first frame is a full snapshot
  (``full: true``), later ones carry only the series points and heatmap columns added since
  the client's previous frame. ``ranks`` and ``series`` are columnar (dict of lists).
  Above ``_RANKS_FULL_RATE_MAX`` ranks the per-rank columns are rebuilt and sent at most
  once every ``_RANKS_EVERY_S`` (the page redraws per-rank panels no faster): a frame
  without them carries ``positions`` (``{"rank": [...], "batch_index": [...]}``), every
  rank's newest batch index, and the page keeps the last ``ranks`` it got. At 1,024 ranks
  the columns are ~160 kB of JSON; ``positions`` ~7 kB.
  The ``ranks`` JSON is encoded once per rebuild and spliced into every client's frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from backend.control.status import job_status
from backend.ingest.budget import (
    DASHBOARD_FRAMES_BURST,
    DASHBOARD_FRAMES_PER_S,
    DASHBOARD_MAX_FRAME_BYTES,
    FrameBudget,
)
from backend.live.fleet import FleetJob, balance_gap_ms, fleet_summary
from backend.live.forecast import forecast, savings
from backend.live.state import (
    STEP_BATCH,
    STEP_COMPUTE,
    STEP_MS,
    STEP_VERSION,
    JobView,
    LiveState,
)
from backend.policy.memory import DEFAULT_HEADROOM, memory_cap
from backend.settings import Settings
from trainer_hook.protocol import CLOSE_RATE_LIMITED, STEP_TIMES, uniform_shares

__all__ = ["DashboardHub", "JobChanges", "CostFit"]

ControlRead = Callable[[str], dict[str, Any]]
# Per-rank (a_ms, c_ms) of compute_ms = a + c * local_batch_size: the policy's own fit, from
# its last decision (the controller keeps it); None before the policy has fitted the job.
CostFit = tuple[tuple[float, ...], tuple[float, ...]]
CostFitRead = Callable[[str], "CostFit | None"]

log = logging.getLogger(__name__)

_SERIES_MAX = 3000  # per-batch points kept per job (the page's sliding window is smaller)
_HEAT_MAX = 240  # heatmap columns kept per job (one per tick with new data)
_LAG_LIMIT = 256  # a batch a connected rank never sent closes once the newest is this far on
_IDLE_REFRESH_S = 1.0  # watched jobs refresh this often even without metrics (stale flag)
_RANKS_FULL_RATE_MAX = 128  # up to this many ranks, per-rank columns go out every tick
_RANKS_EVERY_S = 1.0  # above it, at most this often
_FLEET_READER_S = 60.0  # after a REST or /metrics read of the fleet, keep every job fresh this long
_RANK_FIELDS = (*STEP_TIMES,
                "batch_index", "local_batch_size", "placement_version", "step_rate_hz",
                "work_per_s", "work_share")
_DEVICE_FIELDS = ("util_pct", "mem_used_bytes", "mem_total_bytes", "power_w", "temp_c",
                  "sm_clock_mhz", "sm_clock_max_mhz", "cpu_pct", "rss_bytes", "source")
# Peak-memory fit per rank (backend.policy.memory): newest peak, m0, m per sample, the cap.
_MEMORY_COLUMNS = ("mem_peak_bytes", "mem_fixed_bytes", "mem_per_sample_bytes", "mem_fit",
                   "mem_cap", "memory_source")
_SERIES_FIELDS = ("b", "step_ms", "max_compute_ms", "mean_compute_ms", "throughput",
                  "uniform_step_ms", "version")


_RANK_COLUMNS = ("rank", "host", "device_type", "device_name", "connected", "share", "dropped",
                 *_RANK_FIELDS, *_DEVICE_FIELDS, "throttle_reasons", "price_per_hour",
                 *_MEMORY_COLUMNS)


_rank_fields = attrgetter(*_RANK_FIELDS)
_device_fields = attrgetter(*_DEVICE_FIELDS)
_NO_DEVICE = (None,) * len(_DEVICE_FIELDS)
_MEM_TOTAL = _DEVICE_FIELDS.index("mem_total_bytes")


def _memory_row(rv: Any, headroom: float) -> tuple[Any, ...]:
    rm = rv.memory
    fit = rm.fit if rm is not None else None
    if fit is None:
        return (rv.mem_peak_bytes, None, None, None, None, rm.source if rm is not None else "")
    return (rv.mem_peak_bytes, round(fit.m0_bytes), round(fit.m_bytes), fit.method,
            memory_cap(fit, rm.total_bytes, headroom), rm.source)


def _rank_row(rv: Any, share: Any, price: float | None, headroom: float = DEFAULT_HEADROOM) -> tuple[Any, ...]:
    """One rank's values in ``_RANK_COLUMNS`` order."""
    d = rv.device
    dev = [round(v, 2) if type(v) is float else v for v in (_device_fields(d) if d is not None else _NO_DEVICE)]
    if d is not None and dev[_MEM_TOTAL] is None:
        dev[_MEM_TOTAL] = rv.mem_total_bytes
    return (rv.rank, rv.host, rv.device_type, rv.device_name, rv.connected, share, rv.dropped,
            *[round(v, 3) if type(v) is float else v for v in _rank_fields(rv)], *dev,
            list(d.throttle_reasons) if d is not None else [], price, *_memory_row(rv, headroom))


@dataclass(eq=False)
class _Feed:
    """What the hub keeps for one job between ticks."""

    job: str
    series: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=_SERIES_MAX))
    markers: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=200))
    heat: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=_HEAT_MAX))
    heat_seq: int = 0
    heat_acc: dict[int, list[Any]] = field(default_factory=dict)  # rank -> [compute sum, steps]
    heat_b: int = -1  # newest batch index read into heat_acc
    heat_at: float = float("-inf")  # when the last column was made
    closed: int = -1  # highest batch index folded into the series
    last_version: int | None = None
    seen: dict[int, int] = field(default_factory=dict)  # rank -> newest batch index read
    open: dict[int, dict[int, Any]] = field(default_factory=dict)  # batches missing ranks
    # rank -> (the RankView, its share, its row of the ``ranks`` columns): rows of ranks
    # whose view did not change are reused.
    rows: dict[int, tuple[Any, Any, tuple[Any, ...]]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    ranks: dict[str, list[Any]] = field(default_factory=dict)
    ranks_json: str = "{}"  # ``ranks`` encoded once per rebuild, shared by every client
    ranks_seq: int = 0  # bumped on every rebuild of ``ranks``
    ranks_at: float = float("-inf")
    positions: dict[str, list[Any]] = field(default_factory=dict)
    control: dict[str, Any] = field(default_factory=dict)
    control_json: str = "{}"  # like ranks_json: encoded once per change
    control_seq: int = 0
    saved_ms: float = 0.0
    measured_ms: float = 0.0
    uniform_ms: float = 0.0
    unsaved: list[dict[str, Any]] = field(default_factory=list)  # points not yet stored
    # The fleet view's figures (backend.live.fleet): rank-ms spent waiting for the slowest
    # rank's compute, device kinds, and the oracle's gap for (cost fit, placement version).
    wasted_ms: float = 0.0
    devices: tuple[tuple[str, int], ...] = ()
    gap_key: tuple[Any, Any] = (None, None)
    gap_ms: float | None = None
    fleet_job: FleetJob | None = None
    updated_at: float = float("-inf")


@dataclass(eq=False)
class _Client:
    send: Callable[[str], Any]  # async callable taking one text frame
    job: str | None
    actor: Any = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    full_sent: bool = False
    series_cursor: int = -1  # last batch index sent
    heat_cursor: int = 0  # last heat column seq sent
    marker_cursor: int = -1
    ranks_cursor: int = 0  # ranks_seq last sent
    control_cursor: int = 0  # control_seq last sent
    frames: int = 0


class JobChanges:
    """Jobs whose feed is due for the next tick (a set; marking is one add)."""

    __slots__ = ("_jobs",)

    def __init__(self) -> None:
        self._jobs: set[str] = set()

    def mark(self, job: str) -> None:
        self._jobs.add(job)

    def take(self) -> set[str]:
        jobs, self._jobs = self._jobs, set()
        return jobs


class DashboardHub:
    """Feeds dashboard websockets from live state and the controller's control snapshots."""

    def __init__(self, *, settings: Settings, live: LiveState, control: ControlRead,
                 cost_fit: CostFitRead, changes: JobChanges,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.settings = settings
        self.live = live
        self.control = control
        self.cost_fit = cost_fit
        self.changes = changes
        self._clock = clock
        self._wall = wall
        self.interval_s = 1.0 / settings.dashboard_max_hz
        self.series_max = _SERIES_MAX
        self._feeds: dict[str, _Feed] = {}
        self._clients: set[_Client] = set()
        self._task: asyncio.Task[None] | None = None
        self._last_refresh = float("-inf")
        self._prices: dict[tuple[str, str], float | None] = {}  # settings are fixed at start
        # job -> (stored points, stored summary): what a restarted backend refills charts from
        self._history: dict[str, tuple[list[dict[str, Any]], dict[str, Any] | None]] = {}
        self.ticks = 0
        # The fleet summary (backend.live.fleet): rebuilt at most once per tick, only when a
        # job changed, and its overview frame encoded once for every overview client.
        self._fleet: dict[str, Any] | None = None
        self._fleet_dirty = True
        self._fleet_read_at = float("-inf")
        self._overview_text = ""

    # --- called by ingest and the controller ------------------------------------------

    def notify(self, job: str) -> None:
        """Mark ``job`` as changed; the next tick pushes it. Cheap: one set add."""
        self.changes.mark(job)

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the ticker (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="rebalancer-dashboard-hub")

    async def stop(self) -> None:
        """Stop the ticker; connected clients are closed by the server's shutdown."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick()
            except Exception:  # one bad job must not stop every dashboard
                log.exception("dashboard tick failed")

    @property
    def client_count(self) -> int:
        return len(self._clients)

    # --- one tick -----------------------------------------------------------------------

    def tick(self) -> int:
        """Fold the dirty jobs into their feeds and wake their clients; returns #woken."""
        self.ticks += 1
        dirty = self.changes.take()
        now = self._clock()
        if now - self._last_refresh >= _IDLE_REFRESH_S:
            # Control changes and staleness show even when no metrics arrive.
            self._last_refresh = now
            dirty |= {c.job for c in self._clients if c.job is not None}
            if any(c.job is None for c in self._clients) or now - self._fleet_read_at < _FLEET_READER_S:
                dirty |= set(self._live_jobs())
        if not dirty:
            return 0
        for job in dirty:
            try:
                self._update(job, now)
            except Exception:  # one job's bad state must not freeze the others' dashboards
                log.exception("dashboard update of job %s failed", job)
        if any(c.job is None for c in self._clients):
            self._publish_fleet()  # once per tick, whatever the number of overview clients
        woken = 0
        for c in self._clients:
            if c.job is None or c.job in dirty:
                c.wake.set()
                woken += 1
        return woken

    def _live_jobs(self) -> list[str]:
        return list(self.live.jobs())

    def _update(self, job: str, now: float) -> None:
        view = self.live.view(job)
        if view is None:
            if self._feeds.pop(job, None) is not None:
                self._fleet_dirty = True
            return
        feed = self._feeds.get(job)
        if feed is None or feed.summary.get("world_size") not in (None, view.world_size):
            feed = self._feeds[job] = _Feed(job)
            self._refill(feed)
        self._fold_steps(feed, view)
        self._fold_heat(feed, view, now)
        _set_control(feed, self.control(job))
        if (len(view.ranks) <= _RANKS_FULL_RATE_MAX or now - feed.ranks_at >= _RANKS_EVERY_S
                or not feed.ranks_seq):
            feed.ranks_at = now
            self._fold_ranks(feed, view)
        feed.positions = {"rank": [rv.rank for rv in view.ranks],
                          "batch_index": [rv.batch_index for rv in view.ranks]}
        feed.summary = self._summary(feed, view)
        feed.fleet_job = self._fleet_job(feed, view)
        feed.updated_at = now
        self._fleet_dirty = True


    def _fold_steps(self, feed: _Feed, view: JobView) -> None:
        live = self.live
        after: dict[int, tuple[int, int]] = {}  # ranks that sent something since the last tick
        for rv in view.ranks:
            last = feed.seen.get(rv.rank, -1)
            if rv.batch_index is None or rv.batch_index <= last:
                continue
            after[rv.rank] = (last, min(rv.batch_index - last, live.step_buffer) + 8)
            feed.seen[rv.rank] = rv.batch_index
        if not after:
            return
        pending: dict[int, dict[int, Any]] = {}  # batch index -> rank -> step row
        closed = feed.closed
        for rank, rows in live.steps_after(feed.job, after).items():
            for s in rows:
                if s[STEP_BATCH] > closed:
                    pending.setdefault(s[STEP_BATCH], {})[rank] = s
        # Batches read earlier but still waiting for a rank stay open in feed.open.
        for b, got in pending.items():
            feed.open.setdefault(b, {}).update(got)
        if not pending:
            return
        newest = max(feed.open)
        world = view.world_size
        live_seen = [feed.seen.get(rv.rank, -1) for rv in view.ranks if rv.connected]
        ready = min(live_seen) if live_seen and len(view.ranks) == world else -1
        gbs = view.global_batch_size
        pred: float | None = None  # slowest rank's compute under the uniform split (fits)
        fit = self.cost_fit(feed.job)
        if fit is not None and gbs >= world and len(fit[0]) == len(fit[1]) == world:
            uni = uniform_shares(world, gbs)
            pred = max(a + c * b for a, c, b in zip(fit[0], fit[1], uni, strict=True))
        for b in sorted(feed.open):
            recs = feed.open[b]
            # Wait for every rank: ranks send in batches at their own moments. A batch closes
            # without a rank only when that rank is gone, or when it already sent later batches
            # (its record for this one was dropped), or when it fell hopelessly behind.
            if len(recs) < world and b > ready and b > newest - _LAG_LIMIT:
                break
            del feed.open[b]
            if b <= feed.closed:
                continue
            point = self._point(b, list(recs.values()), gbs, pred)
            feed.series.append(point)
            feed.unsaved.append(point)
            feed.closed = b
            if feed.last_version is not None and point["version"] != feed.last_version:
                feed.markers.append({"b": b, "version": point["version"]})
            feed.last_version = point["version"]
            feed.measured_ms += point["step_ms"]
            top = max(s[STEP_COMPUTE] for s in recs.values())
            feed.wasted_ms += sum(top - s[STEP_COMPUTE] for s in recs.values())
            if point["uniform_step_ms"] is not None:
                feed.uniform_ms += point["uniform_step_ms"]
                feed.saved_ms += point["uniform_step_ms"] - point["step_ms"]
        # Every rank's compute over the batches read since the last heat column.
        acc = feed.heat_acc
        for got in pending.values():
            for r, row in got.items():
                a = acc.get(r)
                if a is None:
                    acc[r] = [row[STEP_COMPUTE], 1]
                else:
                    a[0] += row[STEP_COMPUTE]
                    a[1] += 1
        feed.heat_b = max(feed.heat_b, max(pending))

    def _fold_heat(self, feed: _Feed, view: JobView, now: float) -> None:
        """One heatmap column: every rank's mean compute over the batches read since the
        previous one, and its device utilisation. One per tick with new data; above
        ``_RANKS_FULL_RATE_MAX`` ranks at most one every ``_RANKS_EVERY_S`` (the page keeps
        120 columns: two minutes of a big job instead of 12 s, and a tenth of the bytes)."""
        world = view.world_size
        if not feed.heat_acc or (world > _RANKS_FULL_RATE_MAX and now - feed.heat_at < _RANKS_EVERY_S):
            return
        acc, feed.heat_acc, feed.heat_at = feed.heat_acc, {}, now
        # A rank whose metrics batch has not arrived keeps its previous value.
        prev = feed.heat[-1]["compute"] if feed.heat else [None] * world
        col = [round(a[0] / a[1], 3) if (a := acc.get(r)) else prev[r] for r in range(world)]
        util: list[float | None] = [None] * world
        for rv in view.ranks:
            if rv.device is not None and rv.rank < world:
                d = rv.device  # CPU ranks (psutil) have no device utilisation: use CPU %
                util[rv.rank] = d.util_pct if d.util_pct is not None else d.cpu_pct
        feed.heat_seq += 1
        feed.heat.append({"seq": feed.heat_seq, "b": feed.heat_b, "compute": col, "util": util})

    @staticmethod
    def _point(b: int, recs: list[Any], gbs: int, pred: float | None) -> dict[str, Any]:
        step_ms = max(s[STEP_MS] for s in recs)
        max_c = max(s[STEP_COMPUTE] for s in recs)
        mean_c = sum(s[STEP_COMPUTE] for s in recs) / len(recs)
        uniform = None
        if pred is not None:
            # Sync and overheads stay; only the slowest rank's compute changes with the split.
            uniform = round(max(step_ms - max_c + pred, 0.0), 3)
        return {
            "b": b, "step_ms": round(step_ms, 3), "max_compute_ms": round(max_c, 3),
            "mean_compute_ms": round(mean_c, 3),
            "throughput": round(gbs * 1000.0 / step_ms, 2) if step_ms > 0 else None,
            "uniform_step_ms": uniform, "version": max(s[STEP_VERSION] for s in recs),
        }

    def _fold_ranks(self, feed: _Feed, view: Any) -> None:
        shares = (feed.control.get("placement") or {}).get("shares") or []
        headroom = (feed.control.get("policy") or {}).get("memory_headroom", DEFAULT_HEADROOM)
        cache, rows = feed.rows, []
        for rv in view.ranks:
            share = shares[rv.rank] if rv.rank < len(shares) else rv.local_batch_size
            hit = cache.get(rv.rank)
            if hit is not None and hit[0] is rv and hit[1] == (share, headroom):
                rows.append(hit[2])
                continue
            row = _rank_row(rv, share, self._price(rv.device_type, rv.device_name), headroom)
            cache[rv.rank] = (rv, (share, headroom), row)
            rows.append(row)
        if len(cache) > len(rows):  # ranks gone from the view (a new run of the job)
            keep = {rv.rank for rv in view.ranks}
            for r in [r for r in cache if r not in keep]:
                del cache[r]
        kinds: dict[str, int] = {}
        for rv in view.ranks:
            kind = rv.device_name or rv.device_type or "unknown"
            kinds[kind] = kinds.get(kind, 0) + 1
        feed.devices = tuple(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
        feed.ranks = ({k: list(col) for k, col in zip(_RANK_COLUMNS, zip(*rows, strict=True), strict=True)}
                      if rows else {k: [] for k in _RANK_COLUMNS})
        try:
            feed.ranks_json = json.dumps(feed.ranks, separators=(",", ":"), allow_nan=False)
        except ValueError:  # a non-finite number; browsers cannot parse NaN in JSON
            log.exception("per-rank columns of %s not serialisable; sent empty", feed.job)
            feed.ranks_json = "{}"
        feed.ranks_seq += 1

    def _price(self, device_type: str, device_name: str) -> float | None:
        key = (device_type, device_name)
        if key not in self._prices:
            self._prices[key] = self.settings.price_for(device_type, device_name)
        return self._prices[key]

    def _summary(self, feed: _Feed, view: JobView) -> dict[str, Any]:
        ctl = feed.control
        placement = ctl.get("placement") or {}
        if ctl.get("status"):
            status, detail = ctl["status"], ctl.get("status_detail", "")
        else:  # not known to the controller (yet): the status rule on live numbers alone
            status, detail = job_status(
                verdict="warming_up", detail="waiting for the first steps", pending=None,
                connected_ranks=view.connected_ranks,
                metrics_age_s=max(self._wall() - view.last_seen, 0.0),
                stale_after_s=self.settings.stale_after_s, lost_ranks=view.lost_ranks,
                world_size=view.world_size)
        fc = forecast(view, self._price)
        comm = self.live.communication(feed.job)
        bound = comm.bound if comm is not None else None
        return {
            "job": view.job, "world_size": view.world_size,
            "global_batch_size": view.global_batch_size,
            "status": status, "status_detail": detail,
            "mode": ctl.get("mode"), "strategy": ctl.get("strategy"),
            "batch_index": view.batch_index, "step_ms": _r(view.step_ms),
            "step_rate_hz": _r(view.step_rate_hz), "imbalance": _r(view.imbalance),
            "idle_fraction": _r(view.idle_fraction), "connected_ranks": view.connected_ranks,
            "placement_version": placement.get("version"),
            "pending_proposal_id": ctl.get("pending_proposal_id"),
            "last_seen": view.last_seen, "age_s": _r(max(self._wall() - view.last_seen, 0.0)),
            "cost_per_hour": _r(fc.cost_per_hour), "total_steps": fc.total_steps,
            "remaining_steps": fc.remaining_steps, "eta_s": _r(fc.eta_s),
            "cost_to_finish": _r(fc.cost_to_finish),
            # What bounds the step (backend.policy.comm, cached per new step); None until known.
            "bound": bound if bound != "unknown" else None,
            "mesh": view.mesh.as_view() if view.mesh else None,  # its ranks are replicas
        }

    # --- the fleet: every job's row and the totals (backend.live.fleet) -----------------------

    def _fleet_job(self, feed: _Feed, view: JobView) -> FleetJob:
        s, ctl = feed.summary, feed.control
        fit = self.cost_fit(feed.job)
        version = (ctl.get("placement") or {}).get("version")
        if fit is None:
            feed.gap_key, feed.gap_ms = (None, None), None
        elif not (feed.gap_key[0] is fit and feed.gap_key[1] == version):
            # One exact solve per new fit or placement (the policy refits every few seconds).
            shares = (ctl.get("placement") or {}).get("shares") or []
            feed.gap_key = (fit, version)
            feed.gap_ms = balance_gap_ms(fit[0], fit[1], shares, view.global_batch_size)
        saved = self.savings(feed.job) or {}
        pending = ctl.get("pending_proposal") or {}
        return FleetJob(
            job=feed.job, status=s["status"], status_detail=s["status_detail"], mode=s["mode"],
            world_size=view.world_size, connected_ranks=view.connected_ranks, devices=feed.devices,
            step_ms=view.step_ms, balance_gap_ms=feed.gap_ms, wasted_ms=feed.wasted_ms,
            saved_s=saved.get("saved_s"), saved_cost=saved.get("saved_cost"),
            cost_per_hour=s["cost_per_hour"], imbalance=view.imbalance, eta_s=s["eta_s"],
            batch_index=view.batch_index, bound=s.get("bound", ctl.get("bound")),
            pending_proposal_id=pending.get("id") if pending.get("status") == "proposed" else None)

    def _publish_fleet(self) -> dict[str, Any]:
        """Rebuild the fleet summary and the overview frame if a job changed since the last."""
        if self._fleet is not None and not self._fleet_dirty:
            return self._fleet
        self._fleet_dirty = False
        feeds = list(self._feeds.values())
        fleet = fleet_summary(f.fleet_job for f in feeds if f.fleet_job is not None)
        jobs = [f.summary for f in sorted(feeds, key=attrgetter("job")) if f.summary]
        try:
            self._overview_text = json.dumps({"type": "overview", "t": self._wall(), "jobs": jobs, "fleet": fleet},
                                             separators=(",", ":"), allow_nan=False)
        except ValueError:  # a non-finite number; browsers cannot parse NaN in JSON
            log.exception("overview frame not serialisable; kept the previous one")
        self._fleet = fleet
        return fleet

    def fleet(self, *, refresh: bool = False) -> dict[str, Any]:
        """The fleet summary (``{data, count, totals}``) that the home page, ``GET
        /api/v1/fleet`` and ``/metrics`` show. ``refresh`` (event loop only) first updates
        jobs whose feed is older than a second; a read keeps every job refreshed once a
        second for the next minute, so the next read is fresh without it."""
        now = self._clock()
        self._fleet_read_at = now
        if refresh:
            for job in self._live_jobs():
                feed = self._feeds.get(job)
                if feed is None or now - feed.updated_at >= _IDLE_REFRESH_S:
                    with contextlib.suppress(Exception):
                        self._update(job, now)
        return self._publish_fleet()

    # --- history: stored by the parts' persist loop, read back after a restart -------------

    def preload(self, job: str, points: list[dict[str, Any]], summary: dict[str, Any] | None) -> None:
        """Stored points and summary of ``job``; its feed starts from them."""
        self._history[job] = (points, summary)

    def _refill(self, feed: _Feed) -> None:
        points, summary = self._history.pop(feed.job, ([], None))
        for p in points:
            feed.series.append(p)
        if points:
            feed.closed = points[-1]["b"]
            feed.last_version = points[-1]["version"]
        if summary is not None:
            feed.measured_ms = 1000.0 * summary["measured_s"]
            feed.uniform_ms = 1000.0 * summary["uniform_s"]
            feed.saved_ms = 1000.0 * summary["saved_s"]

    def take_unsaved(self) -> list[tuple[str, list[dict[str, Any]], dict[str, Any]]]:
        """(job, new points, summary values) of every job with points not stored yet."""
        out = []
        for job, feed in self._feeds.items():
            if not feed.unsaved:
                continue
            points, feed.unsaved = feed.unsaved, []
            out.append((job, points, self._summary_values(feed)))
        return out

    def _summary_values(self, feed: _Feed) -> dict[str, Any]:
        s = feed.summary
        return {**(self.savings(feed.job) or {}), "batch_index": s.get("batch_index"),
                "total_steps": s.get("total_steps"), "cost_per_hour": s.get("cost_per_hour"),
                "step_ms": s.get("step_ms"), "imbalance": s.get("imbalance"),
                "placement_version": s.get("placement_version")}

    def run_summary(self, job: str) -> dict[str, Any] | None:
        """The run's summary from the live feed (None if the hub has no feed for it)."""
        feed = self._feeds.get(job)
        if feed is None or not feed.summary:
            return None
        return {"job": job, **self._summary_values(feed), "updated_at": self._wall()}

    def savings(self, job: str) -> dict[str, float | None] | None:
        """The job's savings against the uniform split so far (None if no feed)."""
        feed = self._feeds.get(job)
        if feed is None:
            return None
        return savings(measured_ms=feed.measured_ms, uniform_ms=feed.uniform_ms,
                       saved_ms=feed.saved_ms,
                       cost_per_hour=feed.summary.get("cost_per_hour")).as_dict()

    # --- clients ------------------------------------------------------------------------

    def _frame(self, c: _Client) -> dict[str, Any]:
        t = self._wall()
        if c.job is None:  # _encode sends the shared overview frame instead
            return {"type": "overview", "t": t}
        feed = self._feeds.get(c.job)
        if feed is None:
            return {"type": "job", "full": True, "job": c.job, "t": t, "summary": None,
                    "control": {}, "ranks": {}, "series": {k: [] for k in _SERIES_FIELDS},
                    "markers": [], "heat": [], "savings": None}
        full = not c.full_sent
        pts = [p for p in feed.series if full or p["b"] > c.series_cursor]
        heat = [h for h in feed.heat if full or h["seq"] > c.heat_cursor]
        markers = [m for m in feed.markers if full or m["b"] > c.marker_cursor]
        if pts:
            c.series_cursor = pts[-1]["b"]
        if heat:
            c.heat_cursor = heat[-1]["seq"]
        if markers:
            c.marker_cursor = markers[-1]["b"]
        c.full_sent = True
        # ``ranks`` and ``control`` go out when the client has not seen their newest version
        # (_encode splices in their shared JSON); a frame without ``ranks`` has ``positions``.
        with_ranks = full or c.ranks_cursor != feed.ranks_seq
        with_control = full or c.control_cursor != feed.control_seq
        c.ranks_cursor, c.control_cursor = feed.ranks_seq, feed.control_seq
        return {
            "type": "job", "full": full, "job": c.job, "t": t, "summary": feed.summary,
            **({"control": _CONTROL} if with_control else {}),
            **({"ranks": _RANKS} if with_ranks else {"positions": feed.positions}),
            "series": {k: [p[k] for p in pts] for k in _SERIES_FIELDS},
            "markers": markers, "heat": heat,
            "savings": self.savings(c.job),
        }

    def _encode(self, c: _Client) -> str:
        """The client's next frame as JSON text (ValueError if a number is not finite)."""
        if c.job is None:
            self._publish_fleet()
            if not self._overview_text:
                raise ValueError("no overview frame could be encoded")
            return self._overview_text
        frame = self._frame(c)
        shared = [(k, v) for k, v in (("ranks", _RANKS), ("control", _CONTROL)) if frame.get(k) is v]
        if not shared:
            return json.dumps(frame, separators=(",", ":"), allow_nan=False)
        feed = self._feeds[frame["job"]]
        for k, _ in shared:
            del frame[k]
        head = json.dumps(frame, separators=(",", ":"), allow_nan=False)
        tail = "".join(f',"{k}":{feed.ranks_json if v is _RANKS else feed.control_json}' for k, v in shared)
        return f"{head[:-1]}{tail}}}"

    async def attach(self, send: Callable[[str], Any], job: str | None, actor: Any = None) -> None:
        """Push frames through ``send`` until it raises or the task is cancelled."""
        c = _Client(send=send, job=job, actor=actor)
        if job is not None and job not in self._feeds:
            with contextlib.suppress(Exception):
                self._update(job, self._clock())
        if job is None:
            for j in self._live_jobs():
                if j not in self._feeds:
                    with contextlib.suppress(Exception):
                        self._update(j, self._clock())
        self._clients.add(c)
        try:
            c.wake.set()  # the snapshot goes out at once
            while True:
                await c.wake.wait()
                c.wake.clear()
                try:
                    text = self._encode(c)
                except ValueError:  # a non-finite number; browsers cannot parse NaN in JSON
                    log.exception("dashboard frame for %s not serialisable; skipped", c.job)
                    continue
                await send(text)
                c.frames += 1
        finally:
            self._clients.discard(c)

    async def serve(self, websocket: Any, job: str | None, actor: Any = None) -> None:
        """Run one accepted dashboard websocket until it closes; clients only listen."""
        sender = asyncio.create_task(self.attach(websocket.send_text, job, actor))
        receiver = asyncio.create_task(_drain(websocket))
        try:
            await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, receiver):
                task.cancel()
            for task in (sender, receiver):
                with contextlib.suppress(BaseException):
                    await task


async def _drain(websocket: Any) -> None:
    # Reading is how a disconnect shows up; the dashboard sends nothing that matters, so a
    # client that floods it or sends a big frame is closed (budgets in backend.ingest.budget).
    budget = FrameBudget(frames_per_s=DASHBOARD_FRAMES_PER_S, frames_burst=DASHBOARD_FRAMES_BURST,
                         bytes_per_s=DASHBOARD_FRAMES_PER_S * DASHBOARD_MAX_FRAME_BYTES,
                         bytes_burst=DASHBOARD_FRAMES_BURST * DASHBOARD_MAX_FRAME_BYTES)
    with contextlib.suppress(Exception):
        while True:
            msg = await websocket.receive()
            if msg.get("type") == "websocket.disconnect":
                return
            data = msg.get("text") or msg.get("bytes") or ""
            if len(data) > DASHBOARD_MAX_FRAME_BYTES:
                await websocket.close(1009, f"Dashboard frames are at most {DASHBOARD_MAX_FRAME_BYTES} bytes.")
                return
            over = budget.take(len(data))
            if over is not None:
                await websocket.close(CLOSE_RATE_LIMITED, over[:120])
                return


_RANKS: Any = object()  # placeholders in a frame dict for the feed's shared JSON
_CONTROL: Any = object()


def _set_control(feed: _Feed, control: dict[str, Any]) -> bool:
    """Keep a job's control state; re-encode it (at 1,024 ranks a pending proposal makes it
    ~250 kB of JSON) and bump its version only when it changed. True if it changed."""
    if control == feed.control and feed.control_seq:
        return False
    try:
        text = json.dumps(control, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a non-finite number; browsers cannot parse NaN in JSON
        log.exception("control state of %s not serialisable; kept the previous one", feed.job)
        return False
    feed.control, feed.control_json = control, text
    feed.control_seq += 1
    return True


def _r(v: float | None, nd: int = 4) -> float | None:
    return None if v is None else round(v, nd)
