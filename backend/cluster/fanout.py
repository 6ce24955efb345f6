"""``LiveFanout``: a job's live dashboard on every replica, not only on its owner (owned by
the event loop of one replica; its Redis connections are its own).

One pass every ``interval_s``:

- **Watcher side**: for each job that dashboards here watch and another replica controls,
  mark ``{prefix}:watch:{job}`` (expires after 3 intervals + 1 s) and, when no snapshot came
  in 3 intervals (a lost message), pull it.
- **Owner side**: for each job this replica controls whose watch key exists and whose feed
  changed since its last snapshot (or half a snapshot TTL ago), store the snapshot at
  ``{prefix}:live:{job}`` (``PX`` TTL: 10 intervals, at least 5 s, so a dead owner's copy
  goes away) and publish ``{"job", "kind": "live", "seq", "replica"}`` on
  ``{prefix}:events`` (ids, under 8,000 bytes). At most one snapshot per job per interval,
  at most ``MAX_SNAPSHOT_BYTES`` each (``backend.dashboard.remote``).

- **Fleet**: each pass the owner writes one entry per job it controls into the hash
  ``{prefix}:fleet`` (the job's fleet row and overview summary, with its wall time) and
  reads the whole hash back: every other owner's jobs go to the hub (``set_remote_fleet``),
  so the home page and ``GET /api/v1/fleet`` list every job of the cluster on every replica.
  An entry not rewritten for ``fleet_ttl_s`` (its owner gone, the job over) is deleted.

Between passes it listens on ``{prefix}:events``: a ``live`` message for a watched job
pulls that job's snapshot at once (at most once per 0.1 s a job; the pass catches the
rest). A snapshot read back is checked (``remote.check``) before the hub takes it; a bad
one is logged and skipped, and touches no other job. With Redis down a watcher keeps the
last copy it had and pulls again when Redis answers; the owner's own dashboards never wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from redis import asyncio as aioredis
from redis.exceptions import RedisError

from backend.cluster._loop import end, pause
from backend.dashboard import remote

__all__ = ["LiveFanout", "FeedSource", "MAX_EVENT_BYTES"]

log = logging.getLogger("rebalancer.cluster.fanout")

MAX_EVENT_BYTES = 8000  # a pub/sub payload: ids only
_MAX_JOB = 256
_MIN_PULL_GAP_S = 0.1


class FeedSource(Protocol):
    """The dashboard hub, as the fan-out sees it."""

    def watched_jobs(self) -> set[str]: ...

    def updated_at(self, job: str) -> float | None: ...

    def snapshot(self, job: str, *, replica: str, seq: int) -> tuple[float, str | None] | None: ...

    def apply_remote(self, job: str, data: dict[str, Any]) -> bool: ...

    def remote_jobs(self) -> set[str]: ...

    def drop_remote(self, job: str) -> None: ...

    def fleet_rows(self, jobs: Iterable[str]) -> dict[str, tuple[Any, dict[str, Any]]]: ...

    def set_remote_fleet(self, rows: dict[str, tuple[Any, dict[str, Any]]]) -> None: ...


class LiveFanout:
    """Stores the owner's snapshots of watched jobs on Redis; pulls other owners' ones."""

    def __init__(self, *, url: str, prefix: str, replica_id: str, interval_s: float, hub: FeedSource,
                 owned: Callable[[], Iterable[str]]):
        if not 0.1 <= interval_s <= 60.0:
            raise ValueError(f"REBALANCER_FANOUT_INTERVAL_S must be between 0.1 and 60 seconds, got {interval_s}.")
        self.prefix = prefix.rstrip(":")
        self.replica_id = replica_id
        self.interval_s = interval_s
        self.snapshot_ttl_ms = int(max(10 * interval_s, 5.0) * 1000)
        self.watch_ttl_ms = int((3 * interval_s + 1.0) * 1000)
        # A fleet entry older than this (by its owner's wall clock) is gone: generous, so that
        # replicas whose clocks differ by a few seconds still show each other's jobs.
        self.fleet_ttl_s = max(10 * interval_s, 15.0)
        self.hub = hub
        self._owned = owned
        self._redis = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=1.0)
        self._seq: dict[str, int] = {}  # owner side: job -> sequence of its last snapshot
        self._published: dict[str, tuple[float, float]] = {}  # job -> (feed time, monotonic time)
        self._pulled: dict[str, float] = {}  # watcher side: job -> monotonic time of the last pull
        self._fleet_refused: set[str] = set()  # jobs whose fleet entry was refused (logged once)
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        # rebalancer_fanout_snapshots_total: stored for others, taken from others, refused
        self.published = 0
        self.applied = 0
        self.refused = 0  # snapshots or messages that failed their check

    @property
    def channel(self) -> str:
        return f"{self.prefix}:events"

    def _key(self, kind: str, job: str) -> str:
        return f"{self.prefix}:{kind}:{job}"

    # --- one pass ------------------------------------------------------------------------

    async def pass_once(self) -> None:
        owned = set(self._owned())
        await self._watch(owned)
        await self._publish(owned)
        await self._share_fleet(owned)

    async def _watch(self, owned: set[str]) -> None:
        watched = self.hub.watched_jobs() - owned
        for job in self.hub.remote_jobs() - watched:
            self.hub.drop_remote(job)  # taken here, or nobody watches it any more
            self._pulled.pop(job, None)
        watched = {j for j in watched if 0 < len(j) <= _MAX_JOB}
        if not watched:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for job in sorted(watched):
                pipe.set(self._key("watch", job), self.replica_id, px=self.watch_ttl_ms)
            await pipe.execute()
        late = time.monotonic() - 3 * self.interval_s
        for job in sorted(watched):
            if self._pulled.get(job, float("-inf")) < late:
                await self.pull(job)

    async def _publish(self, owned: set[str]) -> None:
        now = time.monotonic()
        due = []
        for job in sorted(owned):
            at = self.hub.updated_at(job)
            last = self._published.get(job)
            if at is not None and (last is None or at != last[0] or now - last[1] >= self.snapshot_ttl_ms / 2000):
                due.append(job)
        for job in list(self._published):
            if job not in owned:
                del self._published[job]
        if not due:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for job in due:
                pipe.exists(self._key("watch", job))
            watched = await pipe.execute()
        async with self._redis.pipeline(transaction=False) as pipe:
            stored = 0
            for job, seen in zip(due, watched, strict=True):
                if not seen:
                    continue
                seq = self._seq.get(job, 0) + 1
                snap = self.hub.snapshot(job, replica=self.replica_id, seq=seq)
                if snap is None:
                    continue
                at, text = snap
                self._published[job] = (at, now)
                if text is None:
                    log.warning("the dashboard snapshot of job %s is over %d bytes even without its per-rank "
                                "columns; other replicas keep their last copy", job, remote.MAX_SNAPSHOT_BYTES)
                    continue
                self._seq[job] = seq
                pipe.set(self._key("live", job), text, px=self.snapshot_ttl_ms)
                pipe.publish(self.channel, json.dumps({"job": job, "kind": "live", "seq": seq,
                                                       "replica": self.replica_id}))
                stored += 1
            if stored:
                await pipe.execute()
                self.published += stored

    async def _share_fleet(self, owned: set[str]) -> None:
        key = f"{self.prefix}:fleet"
        now = time.time()
        mine: dict[Any, Any] = {}  # job -> entry (redis-py types its mapping loosely)
        for job, (row, summary) in self.hub.fleet_rows(j for j in owned if 0 < len(j) <= _MAX_JOB).items():
            text = remote.encode_fleet(row, summary, replica=self.replica_id, t=now)
            if text is not None:
                mine[job] = text
        async with self._redis.pipeline(transaction=False) as pipe:
            if mine:
                pipe.hset(key, mapping=mine)
            pipe.hgetall(key)
            got = (await pipe.execute())[-1]
        rows: dict[str, tuple[Any, dict[str, Any]]] = {}
        stale = []
        for raw, text in got.items():
            job = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            if job in owned:
                continue
            try:
                replica, t, row, summary = remote.check_fleet(job, text)
            except (ValueError, TypeError, KeyError, RecursionError) as exc:  # this job's entry only
                if job not in self._fleet_refused:
                    self.refused += 1
                    self._fleet_refused.add(job)
                    log.warning("refused the fleet entry of job %s from Redis: %s", job, exc)
                continue
            self._fleet_refused.discard(job)
            if now - t > self.fleet_ttl_s:
                stale.append(raw)
            elif replica != self.replica_id:  # ours: from before another replica took the job
                rows[job] = (row, summary)
        if stale:
            await self._redis.hdel(key, *stale)
        self.hub.set_remote_fleet(rows)

    async def pull(self, job: str) -> bool:
        """Read ``job``'s snapshot and hand it to the hub; False when none is newer."""
        self._pulled[job] = time.monotonic()
        text = await self._redis.get(self._key("live", job))
        if text is None:
            return False
        try:
            data = remote.check(job, text)
            if data["replica"] == self.replica_id:
                return False  # our own, left from before another replica took the job
            applied = self.hub.apply_remote(job, data)
        except (ValueError, TypeError, KeyError, RecursionError) as exc:  # this job's copy only
            self.refused += 1
            log.warning("refused the dashboard snapshot of job %s from Redis: %s", job, exc)
            return False
        self.applied += applied
        return applied

    def _message(self, raw: Any) -> str | None:
        """The job a ``live`` message names, when it is a job watched here; else None."""
        if not isinstance(raw, (bytes, str)) or len(raw) > MAX_EVENT_BYTES:
            self.refused += 1
            return None
        try:
            msg = json.loads(raw)
        except ValueError:
            self.refused += 1
            return None
        if not isinstance(msg, dict) or msg.get("kind") != "live" or msg.get("replica") == self.replica_id:
            return None  # other kinds ("owner") are for the leases
        job = msg.get("job")
        if not isinstance(job, str) or job not in self.hub.watched_jobs():
            return None
        return job

    # --- the task --------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="rebalancer-fanout")

    async def _loop(self) -> None:
        pubsub: Any = None
        next_pass = 0.0
        down = False
        try:
            while not self._stopping.is_set():
                try:
                    if time.monotonic() >= next_pass:
                        next_pass = time.monotonic() + self.interval_s
                        await self.pass_once()
                    if pubsub is None:
                        pubsub = self._redis.pubsub()
                        await pubsub.subscribe(self.channel)
                    await self._listen(pubsub, max(0.01, next_pass - time.monotonic()))
                    if down:
                        log.info("live fan-out: Redis answers again")
                    down = False
                except (RedisError, OSError) as exc:
                    if not down:
                        log.error("live fan-out paused, Redis unreachable: %s", exc)
                    down = True
                    if pubsub is not None:
                        with contextlib.suppress(Exception):
                            await pubsub.aclose()
                        pubsub = None
                    await self._pause()
                except Exception:  # a bug must not end the fan-out of every job
                    log.exception("live fan-out pass failed")
                    await self._pause()
        finally:
            if pubsub is not None:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _listen(self, pubsub: Any, wait_s: float) -> None:
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait_s)
        if msg is not None and (job := self._message(msg.get("data"))) is not None:
            if time.monotonic() - self._pulled.get(job, float("-inf")) >= _MIN_PULL_GAP_S:
                await self.pull(job)

    async def _pause(self) -> None:
        await pause(self._stopping, self.interval_s)

    async def stop(self) -> None:
        await end(self._stopping, self._task)
        with contextlib.suppress(RedisError, OSError):
            await self._redis.aclose()
