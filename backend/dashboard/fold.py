"""Folding live state into one job's dashboard feed (``Feed``): per-batch series, heatmap
columns, per-rank columns, control state, summary and the fleet row.

The hub owns the feeds (one per job, on the event loop) and calls these on its tick, once
per job whatever the number of viewers. They do no I/O and read no clock and no live
state: the hub hands them the view, the step rows, the control snapshot, the cost fit and
the time; each updates the feed it is given. The hub's frames (``backend.dashboard.hub``)
are cut from the feeds.

Above ``RANKS_FULL_RATE_MAX`` ranks the per-rank columns are rebuilt at most once every
``RANKS_EVERY_S`` (``ranks_due``), and so are the heatmap columns; the ``ranks`` and
``control`` JSON is encoded once per change and shared by every client's frame.

One module, over 400 lines on purpose: a feed is built in one pass per tick, every field of it
here; split, one feed's fields would be folded in two places that must agree.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from backend.control.status import status_of
from backend.live.fleet import FleetJob, balance_gap_ms
from backend.live.forecast import forecast, goodput, savings
from backend.live.replicas import replica_rows
from backend.live.rows import STEP_BATCH, STEP_COMPUTE, STEP_FIELDS, STEP_MS, STEP_VERSION, StepRow
from backend.live.state import JobView
from backend.policy.comm import Communication
from backend.policy.memory import DEFAULT_HEADROOM, memory_cap
from rebalancer_wire.protocol import STEP_TIMES, uniform_shares

__all__ = ["Feed", "CostFit", "PriceRead", "SERIES_MAX", "SERIES_FIELDS", "RANK_COLUMNS",
           "steps_wanted", "fold_steps", "fold_heat", "ranks_due", "fold_ranks", "set_control",
           "summary", "fleet_job", "refill", "feed_savings", "summary_values", "HEAT_ROW_PHASES", "HEAT_VIEW_PHASES"]

# Per-rank (a_ms, c_ms) of compute_ms = a + c * local_batch_size: the policy's own fit, from
# its last decision (the controller keeps it); None before the policy has fitted the job.
CostFit = tuple[tuple[float, ...], tuple[float, ...]]
PriceRead = Callable[[str, str], "float | None"]  # (device_type, device_name) -> price per hour

log = logging.getLogger(__name__)

SERIES_MAX = 3000  # per-batch points kept per job (the page's sliding window is smaller)
_HEAT_MAX = 240  # heatmap columns kept per job (one per tick with new data)
_LAG_LIMIT = 256  # a batch a connected rank never sent closes once the newest is this far on
# The heatmap's phases (docs/dashboard.md): from each batch's step rows, and from the rank's
# view (its window's mean: the hook sends these beside the step, not in the row).
HEAT_ROW_PHASES = ("compute", "data_wait", "sync_wait", "optimizer", "step")
_HEAT_ROW_COLS = (STEP_COMPUTE, STEP_FIELDS.index("data_wait_ms"), STEP_FIELDS.index("sync_wait_ms"),
                  STEP_FIELDS.index("optimizer_ms"), STEP_MS)
HEAT_VIEW_PHASES = ("host", "ckpt", "gc")
RANKS_FULL_RATE_MAX = 128  # up to this many ranks, per-rank columns go out every tick
RANKS_EVERY_S = 1.0  # above it, at most this often
_RANK_FIELDS = (*STEP_TIMES,
                "batch_index", "local_batch_size", "placement_version", "step_rate_hz",
                "work_per_s", "work_share", "host_ms", "ckpt_ms", "gc_ms")
_DEVICE_FIELDS = ("util_pct", "mem_used_bytes", "mem_total_bytes", "power_w", "temp_c",
                  "sm_clock_mhz", "sm_clock_max_mhz", "cpu_pct", "rss_bytes", "source")
# Peak-memory fit per rank (backend.policy.memory): newest peak, m0, m per sample, the cap.
_MEMORY_COLUMNS = ("mem_peak_bytes", "mem_fixed_bytes", "mem_per_sample_bytes", "mem_fit",
                   "mem_cap", "memory_source")
SERIES_FIELDS = ("b", "step_ms", "max_compute_ms", "mean_compute_ms", "throughput",
                 "uniform_step_ms", "version")


RANK_COLUMNS = ("rank", "host", "device_type", "device_name", "connected", "share", "dropped",
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
    """One rank's values in ``RANK_COLUMNS`` order."""
    d = rv.device
    dev = [round(v, 2) if type(v) is float else v for v in (_device_fields(d) if d is not None else _NO_DEVICE)]
    if d is not None and dev[_MEM_TOTAL] is None:
        dev[_MEM_TOTAL] = rv.mem_total_bytes
    return (rv.rank, rv.host, rv.device_type, rv.device_name, rv.connected, share, rv.dropped,
            *[round(v, 3) if type(v) is float else v for v in _rank_fields(rv)], *dev,
            list(d.throttle_reasons) if d is not None else [], price, *_memory_row(rv, headroom))


@dataclass(eq=False)
class Feed:
    """What the hub keeps for one job between ticks."""

    job: str
    series: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=SERIES_MAX))
    markers: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=200))
    heat: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=_HEAT_MAX))
    heat_seq: int = 0
    # rank -> [steps, then the sum of each HEAT_ROW_PHASES column]
    heat_acc: dict[int, list[Any]] = field(default_factory=dict)
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
    fold_s: float = 0.0  # what the last fold of this job cost (CPU of the hub's thread, wall)
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


# --- the per-batch series and the heatmap -----------------------------------------------


def steps_wanted(feed: Feed, view: JobView, step_buffer: int) -> dict[int, tuple[int, int]]:
    """``rank -> (newest batch index read, rows to read)`` for the ranks that sent steps
    since the last tick (``LiveState.steps_after``'s argument); marks them read."""
    after: dict[int, tuple[int, int]] = {}
    for rv in view.ranks:
        last = feed.seen.get(rv.rank, -1)
        if rv.batch_index is None or rv.batch_index <= last:
            continue
        after[rv.rank] = (last, min(rv.batch_index - last, step_buffer) + 8)
        feed.seen[rv.rank] = rv.batch_index
    return after


def fold_steps(feed: Feed, view: JobView, new_rows: dict[int, list[StepRow]], fit: CostFit | None) -> None:
    """Fold the step rows read since the last tick (``steps_wanted``) into the series, the
    markers, the savings and the heatmap's accumulator."""
    pending: dict[int, dict[int, Any]] = {}  # batch index -> rank -> step row
    closed = feed.closed
    for rank, rows in new_rows.items():
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
        point = _point(b, list(recs.values()), gbs, pred)
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
    # Every rank's phases over the batches read since the last heat column.
    acc = feed.heat_acc
    for got in pending.values():
        for r, row in got.items():
            a = acc.get(r)
            if a is None:
                acc[r] = [1, *(row[i] for i in _HEAT_ROW_COLS)]
            else:
                a[0] += 1
                for j, i in enumerate(_HEAT_ROW_COLS, 1):
                    a[j] += row[i]
    feed.heat_b = max(feed.heat_b, max(pending))


def fold_heat(feed: Feed, view: JobView, now: float) -> None:
    """One heatmap column: every rank's mean of each step phase over the batches read since
    the previous one (``HEAT_ROW_PHASES``), the window's mean host work, checkpoint writes
    and GC pauses (``HEAT_VIEW_PHASES``, from the rank's view; absent where no rank sends
    them), and its device utilisation. One per tick with new data; above
    ``RANKS_FULL_RATE_MAX`` ranks at most one every ``RANKS_EVERY_S`` (the page keeps
    120 columns: two minutes of a big job instead of 12 s, and a tenth of the bytes)."""
    world = view.world_size
    if not feed.heat_acc or (world > RANKS_FULL_RATE_MAX and now - feed.heat_at < RANKS_EVERY_S):
        return
    acc, feed.heat_acc, feed.heat_at = feed.heat_acc, {}, now
    last = feed.heat[-1] if feed.heat else {}
    column: dict[str, Any] = {"seq": feed.heat_seq + 1, "b": feed.heat_b}
    for j, name in enumerate(HEAT_ROW_PHASES, 1):
        # A rank whose metrics batch has not arrived keeps its previous value.
        prev = last.get(name) or [None] * world
        column[name] = [round(a[j] / a[0], 3) if (a := acc.get(r)) else prev[r] for r in range(world)]
    for name in HEAT_VIEW_PHASES:
        vals: list[float | None] = [None] * world
        for rv in view.ranks:
            v = getattr(rv, name + "_ms")
            if v is not None and rv.rank < world:
                vals[rv.rank] = round(v, 3)
        if any(v is not None for v in vals):
            column[name] = vals
    util: list[float | None] = [None] * world
    for rv in view.ranks:
        if rv.device is not None and rv.rank < world:
            d = rv.device  # CPU ranks (psutil) have no device utilisation: use CPU %
            util[rv.rank] = d.util_pct if d.util_pct is not None else d.cpu_pct
    column["util"] = util
    feed.heat_seq += 1
    feed.heat.append(column)


def _point(b: int, recs: list[Any], gbs: int, pred: float | None) -> dict[str, Any]:
    step_ms = max(s[STEP_MS] for s in recs)
    max_c = max(s[STEP_COMPUTE] for s in recs)
    mean_c = sum(s[STEP_COMPUTE] for s in recs) / len(recs)
    uniform = None
    version = max(s[STEP_VERSION] for s in recs)
    if version == 0:
        # Version 0 is the uniform split: this step is the uniform split's own, not a
        # prediction of it (whose fit error made "saved" negative on runs never rebalanced).
        uniform = round(step_ms, 3)
    elif pred is not None:
        # Sync and overheads stay; only the slowest rank's compute changes with the split.
        uniform = round(max(step_ms - max_c + pred, 0.0), 3)
    return {
        "b": b, "step_ms": round(step_ms, 3), "max_compute_ms": round(max_c, 3),
        "mean_compute_ms": round(mean_c, 3),
        "throughput": round(gbs * 1000.0 / step_ms, 2) if step_ms > 0 else None,
        "uniform_step_ms": uniform, "version": version,
    }


# --- per-rank columns, control state, summary ---------------------------------------------


def ranks_due(feed: Feed, view: JobView, now: float) -> bool:
    """Whether the per-rank columns are rebuilt this tick (every tick up to
    ``RANKS_FULL_RATE_MAX`` ranks, at most every ``RANKS_EVERY_S`` above)."""
    return (len(view.ranks) <= RANKS_FULL_RATE_MAX or now - feed.ranks_at >= RANKS_EVERY_S
            or not feed.ranks_seq)


def fold_ranks(feed: Feed, view: Any, price: PriceRead) -> None:
    """Rebuild the per-rank columns (rows of unchanged ranks reused) and encode them once."""
    shares = (feed.control.get("placement") or {}).get("shares") or []
    headroom = (feed.control.get("policy") or {}).get("memory_headroom", DEFAULT_HEADROOM)
    cache, rows = feed.rows, []
    for rv in view.ranks:
        share = shares[rv.rank] if rv.rank < len(shares) else rv.local_batch_size
        hit = cache.get(rv.rank)
        if hit is not None and hit[0] is rv and hit[1] == (share, headroom):
            rows.append(hit[2])
            continue
        row = _rank_row(rv, share, price(rv.device_type, rv.device_name), headroom)
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
    feed.ranks = ({k: list(col) for k, col in zip(RANK_COLUMNS, zip(*rows, strict=True), strict=True)}
                  if rows else {k: [] for k in RANK_COLUMNS})
    try:
        feed.ranks_json = json.dumps(feed.ranks, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a non-finite number; browsers cannot parse NaN in JSON
        log.exception("per-rank columns of %s not serialisable; sent empty", feed.job)
        feed.ranks_json = "{}"
    feed.ranks_seq += 1


def set_control(feed: Feed, control: dict[str, Any]) -> bool:
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


def summary(feed: Feed, view: JobView, *, wall: Callable[[], float], stale_after_s: float,
            price: PriceRead, comm: Communication | None) -> dict[str, Any]:
    """The job's summary row (home page, job header, fleet): status, step, ETA and cost."""
    ctl = feed.control
    placement = ctl.get("placement") or {}
    if ctl.get("status"):
        status, detail = ctl["status"], ctl.get("status_detail", "")
    else:  # not known to the controller (yet): the status rule on live numbers alone
        status, detail = status_of(view, None, now=wall(), stale_after_s=stale_after_s)
    fc = forecast(view, price)
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
        "last_seen": view.last_seen, "age_s": _r(max(wall() - view.last_seen, 0.0)),
        "cost_per_hour": _r(fc.cost_per_hour), "total_steps": fc.total_steps,
        "remaining_steps": fc.remaining_steps, "eta_s": _r(fc.eta_s),
        "cost_to_finish": _r(fc.cost_to_finish),
        # What bounds the step (backend.policy.comm, cached per new step); None until known.
        "bound": bound if bound != "unknown" else None,
        "mesh": view.mesh.as_view() if view.mesh else None,  # its ranks are replicas
        "replicas": replica_rows(view),  # with their members and slowest member
        "share_unit": view.share_unit,  # "micro_batch": shares count micro-batches
    }


def fleet_job(feed: Feed, view: JobView, fit: CostFit | None) -> FleetJob:
    """The job's row of the fleet summary (``backend.live.fleet``), from its summary."""
    s, ctl = feed.summary, feed.control
    version = (ctl.get("placement") or {}).get("version")
    if fit is None:
        feed.gap_key, feed.gap_ms = (None, None), None
    elif not (feed.gap_key[0] is fit and feed.gap_key[1] == version):
        # One exact solve per new fit or placement (the policy refits every few seconds).
        shares = (ctl.get("placement") or {}).get("shares") or []
        feed.gap_key = (fit, version)
        feed.gap_ms = balance_gap_ms(fit[0], fit[1], shares, view.global_batch_size)
    saved = feed_savings(feed)
    pending = ctl.get("pending_proposal") or {}
    return FleetJob(
        job=feed.job, status=s["status"], status_detail=s["status_detail"], mode=s["mode"],
        world_size=view.world_size, connected_ranks=view.connected_ranks, devices=feed.devices,
        step_ms=view.step_ms, balance_gap_ms=feed.gap_ms, wasted_ms=feed.wasted_ms,
        saved_s=saved.get("saved_s"), saved_cost=saved.get("saved_cost"),
        cost_per_hour=s["cost_per_hour"], imbalance=view.imbalance, eta_s=s["eta_s"],
        batch_index=view.batch_index, bound=s.get("bound", ctl.get("bound")),
        # Waiting for an operator only where the status says so: never in observe mode (shown,
        # never sent) nor once the run ended.
        pending_proposal_id=pending.get("id") if pending.get("status") == "proposed"
        and s["status"] == "proposal_pending" else None,
        goodput=goodput(view))


# --- history: what a restarted backend refills the feed from; what is stored --------------


def refill(feed: Feed, points: list[dict[str, Any]], stored: dict[str, Any] | None) -> None:
    """Start a new feed from the stored points and summary of its job."""
    for p in points:
        feed.series.append(p)
    if points:
        feed.closed = points[-1]["b"]
        feed.last_version = points[-1]["version"]
    if stored is not None:
        feed.measured_ms = 1000.0 * stored["measured_s"]
        feed.uniform_ms = 1000.0 * stored["uniform_s"]
        feed.saved_ms = 1000.0 * stored["saved_s"]


def feed_savings(feed: Feed) -> dict[str, float | None]:
    """The job's savings against the uniform split so far."""
    return savings(measured_ms=feed.measured_ms, uniform_ms=feed.uniform_ms,
                   saved_ms=feed.saved_ms,
                   cost_per_hour=feed.summary.get("cost_per_hour")).as_dict()


def summary_values(feed: Feed) -> dict[str, Any]:
    """What is stored of the job's summary (``backend.storage.summaries``)."""
    s = feed.summary
    return {**feed_savings(feed), "batch_index": s.get("batch_index"),
            "total_steps": s.get("total_steps"), "cost_per_hour": s.get("cost_per_hour"),
            "step_ms": s.get("step_ms"), "imbalance": s.get("imbalance"),
            "placement_version": s.get("placement_version")}


def _r(v: float | None, nd: int = 4) -> float | None:
    return None if v is None else round(v, nd)
