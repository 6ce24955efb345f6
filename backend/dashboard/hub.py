"""DashboardHub: the data feed of ``/ws/dashboard``, coalesced to at most N pushes a second
(owns the per-job feeds and the clients, on the event loop).

Ingest and the controller call ``notify(job)`` (``JobChanges.mark``), which only adds the
job to a dirty set. Control state comes from the controller's published snapshot
(``control(job)``: memory, no SQL); ETA, cost and savings from ``backend.live.forecast``.
A ticker runs ``dashboard_max_hz`` times a second: it folds what arrived for the dirty
jobs into per-job feeds (``backend.dashboard.fold``: per-batch aggregates, heatmap
columns, placement markers, a summary and the control state), once per job whatever the
number of viewers, then wakes the clients that watch those jobs. Each client has its own
sender task with a cursor into the feeds: a slow client only delays itself, and whatever
piled up while it was busy goes out as one frame (latest wins, nothing of the series is
lost while it stays buffered).

Frames (JSON text):
- ``{"type": "overview", "t", "jobs": [summary, ...], "fleet": {"data", "count", "totals"}}``
  for clients without a job: the fleet summary (``backend.live.fleet``), rebuilt and
  encoded once per tick in which a job changed, the same text for every overview client;
- ``{"type": "job", "full": bool, "job", "t", "summary", "control", "ranks", "series",
  "markers", "heat", "savings"}`` for ``?job=NAME``: the first frame is a full snapshot
  (``full: true``), later ones carry only the series points and heatmap columns added since
  the client's previous frame. ``ranks`` and ``series`` are columnar (dict of lists).
  Above ``fold.RANKS_FULL_RATE_MAX`` ranks the per-rank columns are rebuilt and sent at most
  once every ``fold.RANKS_EVERY_S`` (the page redraws per-rank panels no faster): a frame
  without them carries ``positions`` (``{"rank": [...], "batch_index": [...]}``), every
  rank's newest batch index, and the page keeps the last ``ranks`` it got. At 1,024 ranks
  the columns are ~160 kB of JSON; ``positions`` ~7 kB.
  The ``ranks`` JSON is encoded once per rebuild and spliced into every client's frame.

One module, over 400 lines on purpose: the hub's state on the event loop (feeds, clients,
the fleet, other replicas' copies); the pure folding is fold.py's, the remote snapshots'
checks remote.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from backend.dashboard import fold, remote
from backend.dashboard.fold import CostFit, Feed
from backend.live.fleet import FleetJob, fleet_summary
from backend.live.state import JobView, LiveState
from backend.peers.budget import (
    DASHBOARD_FRAMES_BURST,
    DASHBOARD_FRAMES_PER_S,
    DASHBOARD_MAX_FRAME_BYTES,
    FrameBudget,
)
from backend.settings import Settings
from backend.tasks import cancel_and_wait
from rebalancer_wire.protocol import CLOSE_RATE_LIMITED

__all__ = ["DashboardHub", "JobChanges", "ControlRead", "CostFitRead"]

ControlRead = Callable[[str], dict[str, Any]]
CostFitRead = Callable[[str], "CostFit | None"]  # fold.CostFit: the policy's per-rank fit

log = logging.getLogger(__name__)

_IDLE_REFRESH_S = 1.0  # watched jobs refresh this often even without metrics (stale flag)
# A job whose fold costs more than a tenth of the tick interval (thousands of ranks) is folded
# again only once FOLD_REUSE times its cost has passed, and at least every FOLD_MAX_GAP_S: the
# dashboard of one job then takes at most about a tenth of a core, and a step reaches the
# screen within half a second plus a fold (at 8,192 ranks a fold took 30 to 230 ms here, and
# ten of them a second were most of a replica's CPU at 1 step/s).
FOLD_REUSE = 10.0
FOLD_MAX_GAP_S = 0.5
_FLEET_READER_S = 60.0  # after a REST or /metrics read of the fleet, keep every job fresh this long


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

    def __contains__(self, job: object) -> bool:
        """Whether ``job`` was marked since the last ``take`` (the mark stays)."""
        return job in self._jobs


class DashboardHub:
    """Feeds dashboard websockets from live state and the controller's control snapshots."""

    def __init__(self, *, settings: Settings, live: LiveState, control: ControlRead,
                 cost_fit: CostFitRead, changes: JobChanges, owner: dict[str, str] | None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.settings = settings
        # With several replicas: this replica's id and advertised URL, put in the summary of
        # every job it folds (it owns them), so that the job and fleet views say who controls
        # each job; None: one replica.
        self.owner = owner
        self.live = live
        self.control = control
        self.cost_fit = cost_fit
        self.changes = changes
        self._clock = clock
        self._wall = wall
        self.interval_s = 1.0 / settings.dashboard_max_hz
        self.series_max = fold.SERIES_MAX
        self._feeds: dict[str, Feed] = {}
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
        self._own_fleet: dict[str, Any] = {}  # the same over this replica's own jobs only
        self._fleet_dirty = True
        self._fleet_read_at = float("-inf")
        self._overview_text = ""
        # Jobs another replica controls whose feed here is a copy of its (``apply_remote``):
        # job -> (owner replica id, sequence of the snapshot applied).
        self._remote: dict[str, tuple[str, int]] = {}
        # Jobs other replicas control, as their owners' fleet rows and overview summaries say
        # (``set_remote_fleet``): job -> (row, summary). A job folded here is shown from here.
        self._remote_fleet: dict[str, tuple[FleetJob, dict[str, Any]]] = {}
        # Points a feed of our own had not stored when a copy replaced it (take_unsaved).
        self._orphaned: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = []

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
        await cancel_and_wait(task)

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
        for job in list(dirty):
            feed = self._feeds.get(job)
            gap = min(FOLD_REUSE * feed.fold_s, FOLD_MAX_GAP_S) if feed is not None else 0.0
            if feed is not None and gap > self.interval_s and now - feed.updated_at < gap:
                dirty.discard(job)  # a big job: folded again once its last fold is paid for
                self.changes.mark(job)
                continue
            started = self._clock()  # the hub's clock: a test's frozen one makes every fold free
            try:
                self._update(job, now)
            except Exception:  # one job's bad state must not freeze the others' dashboards
                log.exception("dashboard update of job %s failed", job)
            if (feed := self._feeds.get(job)) is not None:
                feed.fold_s = self._clock() - started
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
        if job in self._remote:
            return  # the owner folds it; apply_remote brings its snapshots here
        view = self.live.view(job)
        if view is None:
            if self._feeds.pop(job, None) is not None:
                self._fleet_dirty = True
            return
        feed = self._feeds.get(job)
        if feed is None or feed.summary.get("world_size") not in (None, view.world_size):
            feed = self._feeds[job] = Feed(job)
            fold.refill(feed, *self._history.pop(job, ([], None)))
        fit = self.cost_fit(job)
        after = fold.steps_wanted(feed, view, self.live.step_buffer)
        if after:
            fold.fold_steps(feed, view, self.live.steps_after(job, after), fit)
        fold.fold_heat(feed, view, now)
        fold.set_control(feed, self.control(job))
        if fold.ranks_due(feed, view, now):
            feed.ranks_at = now
            fold.fold_ranks(feed, view, self._price)
        feed.positions = {"rank": [rv.rank for rv in view.ranks],
                          "batch_index": [rv.batch_index for rv in view.ranks]}
        feed.summary = self._summary(feed, view)
        feed.fleet_job = fold.fleet_job(feed, view, fit)
        feed.updated_at = now
        self._fleet_dirty = True

    def _price(self, device_type: str, device_name: str) -> float | None:
        key = (device_type, device_name)
        if key not in self._prices:
            self._prices[key] = self.settings.price_for(device_type, device_name)
        return self._prices[key]

    def _summary(self, feed: Feed, view: JobView) -> dict[str, Any]:
        out = fold.summary(feed, view, wall=self._wall, stale_after_s=self.settings.stale_after_s,
                           price=self._price, comm=self.live.communication(feed.job))
        if self.owner is not None:
            out["owner"] = self.owner
        return out

    # --- the fleet: every job's row and the totals (backend.live.fleet) -----------------------

    def _publish_fleet(self) -> dict[str, Any]:
        """Rebuild the fleet summary and the overview frame if a job changed since the last."""
        if self._fleet is not None and not self._fleet_dirty:
            return self._fleet
        self._fleet_dirty = False
        feeds = list(self._feeds.values())
        rows = {f.job: f.fleet_job for f in feeds if f.fleet_job is not None}
        summaries = {f.job: f.summary for f in feeds if f.summary}
        own = fleet_summary(rows.values())
        for job, (row, summary) in self._remote_fleet.items():  # other owners' jobs
            rows.setdefault(job, row)
            summaries.setdefault(job, summary)
        fleet = fleet_summary(rows.values()) if self._remote_fleet else own
        jobs = [summaries[job] for job in sorted(summaries)]
        try:
            self._overview_text = json.dumps({"type": "overview", "t": self._wall(), "jobs": jobs, "fleet": fleet},
                                             separators=(",", ":"), allow_nan=False)
        except ValueError:  # a non-finite number; browsers cannot parse NaN in JSON
            log.exception("overview frame not serialisable; kept the previous one")
        self._fleet, self._own_fleet = fleet, own
        return fleet

    def fleet(self, *, refresh: bool = False, own: bool = False) -> dict[str, Any]:
        """The fleet summary (``{data, count, totals}``) that the home page and ``GET
        /api/v1/fleet`` show: with several replicas, every job of the cluster. ``own``: the
        jobs this replica folds itself only (``/metrics``, so that summing the replicas'
        series counts each job once). ``refresh`` (event loop only) first updates jobs whose
        feed is older than a second; a read keeps every job refreshed once a second for the
        next minute, so the next read is fresh without it."""
        now = self._clock()
        self._fleet_read_at = now
        if refresh:
            for job in self._live_jobs():
                feed = self._feeds.get(job)
                if feed is None or now - feed.updated_at >= _IDLE_REFRESH_S:
                    with contextlib.suppress(Exception):
                        self._update(job, now)
        fleet = self._publish_fleet()
        return self._own_fleet if own else fleet

    def fleet_rows(self, jobs: Iterable[str]) -> dict[str, tuple[FleetJob, dict[str, Any]]]:
        """(fleet row, overview summary) of each of ``jobs`` that this replica folds itself:
        what ``backend.cluster.fanout`` shares with the other replicas."""
        out: dict[str, tuple[FleetJob, dict[str, Any]]] = {}
        for job in jobs:
            feed = self._feeds.get(job)
            if feed is not None and job not in self._remote and feed.fleet_job is not None and feed.summary:
                out[job] = (feed.fleet_job, feed.summary)
        return out

    def remote_fleet_row(self, job: str) -> FleetJob | None:
        """The fleet row another replica shared for ``job`` (None: none, or folded here)."""
        got = self._remote_fleet.get(job)
        return None if got is None or job in self._feeds else got[0]

    def set_remote_fleet(self, rows: dict[str, tuple[FleetJob, dict[str, Any]]]) -> None:
        """The jobs other replicas control, as their owners last shared them (checked by
        ``remote.check_fleet``); replaces the previous set. The home page and ``GET
        /api/v1/fleet`` list them beside this replica's own jobs."""
        changed = {job for job in rows.keys() | self._remote_fleet.keys()
                   if rows.get(job) != self._remote_fleet.get(job)}
        if not changed:
            return
        self._remote_fleet = dict(rows)
        self._fleet_dirty = True
        for job in changed:  # wakes the overview clients at the next tick
            self.changes.mark(job)

    # --- history: stored by the parts' persist loop, read back after a restart -------------

    def preload(self, job: str, points: list[dict[str, Any]], summary: dict[str, Any] | None) -> None:
        """Stored points and summary of ``job``; its feed starts from them."""
        self._history[job] = (points, summary)

    def take_unsaved(self) -> list[tuple[str, list[dict[str, Any]], dict[str, Any]]]:
        """(job, new points, summary values) of every job with points not stored yet."""
        out, self._orphaned = self._orphaned, []
        for job, feed in self._feeds.items():
            if not feed.unsaved:
                continue
            points, feed.unsaved = feed.unsaved, []
            out.append((job, points, fold.summary_values(feed)))
        return out

    def run_summary(self, job: str) -> dict[str, Any] | None:
        """The run's summary from the live feed (None if the hub has no feed for it)."""
        feed = self._feeds.get(job)
        if feed is None or not feed.summary:
            return None
        return {"job": job, **fold.summary_values(feed), "updated_at": self._wall()}

    def savings(self, job: str) -> dict[str, float | None] | None:
        """The job's savings against the uniform split so far (None if no feed)."""
        feed = self._feeds.get(job)
        return fold.feed_savings(feed) if feed is not None else None

    # --- other replicas: a job's feed copied from its owner (backend.cluster.fanout) -------

    def watched_jobs(self) -> set[str]:
        """The jobs that dashboard clients here watch."""
        return {c.job for c in self._clients if c.job is not None}

    def snapshot(self, job: str, *, replica: str, seq: int) -> tuple[float, str | None] | None:
        """(when the feed last changed, its snapshot as JSON or None when too big) of a job
        whose feed this replica folds; None when it has none."""
        feed = self._feeds.get(job)
        if feed is None or job in self._remote:
            return None
        return feed.updated_at, remote.encode(feed, replica=replica, seq=seq)

    def updated_at(self, job: str) -> float | None:
        """When this replica last folded ``job``'s feed (None: no feed of its own)."""
        feed = self._feeds.get(job)
        return None if feed is None or job in self._remote else feed.updated_at

    def apply_remote(self, job: str, data: dict[str, Any]) -> bool:
        """Take a checked snapshot (``remote.check``) of a job another replica controls;
        False when it is not newer than the one applied."""
        replica, seq = data["replica"], data["seq"]
        had = self._remote.get(job)
        if had is not None and had[0] == replica and seq <= had[1]:
            return False
        feed = self._feeds.get(job)
        if had is None or had[0] != replica or feed is None:
            if had is None and feed is not None and feed.unsaved:  # folded here, not stored yet
                self._orphaned.append((job, feed.unsaved, fold.summary_values(feed)))
            feed = self._feeds[job] = fold.Feed(job)  # a new owner: its own sequences
            self._restart_clients(job)
        self._remote[job] = (replica, seq)
        remote.merge(feed, data)
        self._fleet_dirty = True
        self.changes.mark(job)
        return True

    def remote_jobs(self) -> set[str]:
        return set(self._remote)

    def drop_remote(self, job: str) -> None:
        """Stop showing the copy of ``job`` (this replica took it, or nobody watches it)."""
        if self._remote.pop(job, None) is not None:
            self._feeds.pop(job, None)
            self._fleet_dirty = True
            self._restart_clients(job)
            self.changes.mark(job)

    def _restart_clients(self, job: str) -> None:
        for c in self._clients:
            if c.job == job:  # their next frame is a full one, cut from the new feed
                c.full_sent, c.series_cursor, c.heat_cursor, c.marker_cursor = False, -1, 0, -1

    # --- clients ------------------------------------------------------------------------

    def _frame(self, c: _Client) -> dict[str, Any]:
        t = self._wall()
        if c.job is None:  # _encode sends the shared overview frame instead
            return {"type": "overview", "t": t}
        feed = self._feeds.get(c.job)
        if feed is None:
            return {"type": "job", "full": True, "job": c.job, "t": t, "summary": None,
                    "control": {}, "ranks": {}, "series": {k: [] for k in fold.SERIES_FIELDS},
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
            "series": {k: [p[k] for p in pts] for k in fold.SERIES_FIELDS},
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
        # A new client's snapshot is as new as REST: fold what ingest marked since the last
        # tick first (the marks stay, so the next tick still wakes the other clients).
        for j in [job] if job is not None else self._live_jobs():
            if j not in self._feeds or j in self.changes:
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
    # client that floods it or sends a big frame is closed (budgets in backend.peers.budget).
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

