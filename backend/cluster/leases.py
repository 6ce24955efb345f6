"""``JobLeases``: which replica owns each job's control loop, held as Redis keys with a TTL.

The event loop of one replica owns its ``JobLeases``. A lease is ``{prefix}:lease:{job}`` =
this replica's id, set with ``SET NX PX``; the owner renews it every ``ttl/3`` with a
compare-and-set script, so a replica that dies (SIGKILL) loses its jobs within one TTL and
the next replica that sees the job's hook takes it. Each replica also advertises the URL
its hooks should use (``{prefix}:replica:{id}``), so a non-owner can redirect a hook to the
owner. Each acquisition (not a renewal) also takes the job's next lease epoch,
``{prefix}:epoch:{job}`` (INCR in the same script, so a replica paused between the two can
never get a newer epoch than the replica that took the job after it): the fencing token
every control write of the owner carries (``backend.storage.owners``). Messages between replicas carry ids only (``{prefix}:events``, pub/sub), never data.
With Redis unreachable a replica owns nothing: control pauses (``status().state``) and
training is untouched, because the hook never waits on the backend.

``watch`` connects the leases to the rest of the replica: each renewal pass also claims the
jobs whose hooks are connected here (``wanted``; so control resumes after a Redis outage),
releases the owned jobs whose hooks are gone, and reports each job it gained (``on_gained``:
reload it from the store of record) or lost to another replica (``on_lost``: send its hooks
to the owner).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from redis import asyncio as aioredis
from redis.exceptions import RedisError

from backend.cluster._loop import end, pause

__all__ = ["Claim", "ClusterStatus", "JobLeases"]

log = logging.getLogger("rebalancer.cluster")

# KEYS[1] the lease, ARGV[1] our id, ARGV[2] TTL in ms: extend only a lease we still hold.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
# KEYS[1] the lease, KEYS[2] the job's epoch counter: take a free lease with a new epoch, or
# renew ours with the epoch it has; 0 when another replica holds it.
_ACQUIRE = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return redis.call('incr', KEYS[2]) end
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2])
  return tonumber(redis.call('get', KEYS[2]) or '0')
end
return 0
"""
# The store of record holds an epoch above the counter (Redis lost its data): the holder
# of the lease, and only it, moves the counter past it (ARGV[2]).
_RAISE = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end
local e = redis.call('incr', KEYS[2])
if e <= tonumber(ARGV[2]) then e = tonumber(ARGV[2]) + 1; redis.call('set', KEYS[2], e) end
return e
"""
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"

MAX_JOB_NAME = 256


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """What /healthz reports: ``ok``, or ``paused`` with the reason (control is off)."""

    state: str
    replica_id: str
    owned_jobs: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Claim:
    """What a hello for a job meets on this replica: ``here`` (we own it; ``gained``: just
    now), ``redirect`` (another replica owns it; ``url`` is where its hooks go, "" when that
    replica has not advertised one) or ``paused`` (Redis is down; ``reason`` says so)."""

    outcome: Literal["here", "redirect", "paused"]
    gained: bool = False
    owner: str = ""
    url: str = ""
    reason: str = ""


class JobLeases:
    """Acquire, renew and release job leases; look up a job's owner and its URL."""

    def __init__(self, *, url: str, prefix: str, advertise_url: str, ttl_s: float = 6.0,
                 replica_id: str | None = None):
        if not 1.0 <= ttl_s <= 300.0:
            raise ValueError(f"REBALANCER_LEASE_TTL_S must be between 1 and 300 seconds, got {ttl_s}.")
        if not prefix.strip(":"):
            raise ValueError(f"REBALANCER_REDIS_PREFIX must not be empty, got {prefix!r}.")
        self.prefix = prefix.rstrip(":")
        self.ttl_ms = int(ttl_s * 1000)
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.advertise_url = advertise_url
        self._redis = aioredis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0,
                                        decode_responses=True)
        self._owned: set[str] = set()
        self._acquired_at: dict[str, float] = {}  # monotonic time of the last acquisition
        self._claiming: dict[str, asyncio.Future[Claim]] = {}  # a hello's claim on its way, by job
        self._epochs: dict[str, int] = {}  # the lease epoch of each job we hold
        self._reason = ""
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._wanted: Callable[[], Iterable[str]] | None = None  # None: keep what we take
        self._on_gained: Callable[[str], None] = lambda job: None
        self._on_lost: Callable[[str], None] = lambda job: None

    def watch(self, *, wanted: Callable[[], Iterable[str]], on_gained: Callable[[str], None],
              on_lost: Callable[[str], None]) -> None:
        """``wanted()``: the jobs with hooks connected here; ``on_gained(job)``: this replica
        just took ``job``; ``on_lost(job)``: another replica holds a job we have hooks for."""
        self._wanted, self._on_gained, self._on_lost = wanted, on_gained, on_lost

    def _lease_key(self, job: str) -> str:
        if not job or len(job) > MAX_JOB_NAME:
            raise ValueError(f"job name must be 1 to {MAX_JOB_NAME} characters, got {len(job)}.")
        return f"{self.prefix}:lease:{job}"

    def owns(self, job: str) -> bool:
        """True while this replica holds ``job``'s lease and Redis answers."""
        return not self._reason and job in self._owned

    def epoch(self, job: str) -> int | None:
        """The lease epoch under which this replica holds ``job`` (None: it does not)."""
        return self._epochs.get(job) if self.owns(job) else None

    def fenced(self, job: str) -> None:
        """The store of record refused our epoch of ``job``: another replica took it. Stop
        controlling it here; the next renewal pass finds out who holds the lease."""
        self._owned.discard(job)
        self._epochs.pop(job, None)

    async def raise_epoch(self, job: str, floor: int) -> int | None:
        """A new epoch above ``floor`` while we hold ``job``'s lease (None: we do not)."""
        try:
            got = int(await self._redis.eval(_RAISE, 2, self._lease_key(job), self._epoch_key(job),
                                             self.replica_id, floor))
        except (RedisError, OSError) as exc:
            self._down(exc)
            return None
        if not got:
            self.fenced(job)
            return None
        self._epochs[job] = got
        return got

    def _epoch_key(self, job: str) -> str:
        return f"{self.prefix}:epoch:{job}"

    def owned_jobs(self) -> set[str]:
        """The jobs whose lease this replica holds (none while Redis is down)."""
        return set() if self._reason else set(self._owned)

    def status(self) -> ClusterStatus:
        if self._reason:
            return ClusterStatus("paused", self.replica_id, 0, self._reason)
        return ClusterStatus("ok", self.replica_id, len(self._owned))

    async def acquire(self, job: str) -> bool:
        """Take ``job`` if nobody holds it (or we already do). False: another replica owns it,
        or Redis is down (then ``status()`` says so)."""
        key = self._lease_key(job)
        try:
            epoch = int(await self._redis.eval(_ACQUIRE, 2, key, self._epoch_key(job), self.replica_id,
                                               self.ttl_ms))
        except (RedisError, OSError) as exc:
            self._down(exc)
            return False
        self._reason = ""
        got = epoch > 0
        if not got:
            self.fenced(job)  # another replica holds it now, whatever we thought
        if got:
            if job not in self._owned or self._epochs.get(job, 0) < epoch:
                self._owned.discard(job)  # a new term: taken over again below
            self._epochs[job] = epoch
            self._acquired_at[job] = time.monotonic()
            if job not in self._owned:
                self._owned.add(job)
                self._gained(job)
                await self.publish(job, "owner")
        return bool(got)

    async def claim(self, job: str) -> Claim:
        """Take ``job`` for a hook that said hello here, or say which replica has it. The hellos
        of a job's ranks that arrive while a claim of it is on its way to Redis share that
        claim's answer (one round trip for them, not one each: a job's ranks connect at once)."""
        task = self._claiming.get(job)
        if task is None:
            task = self._claiming[job] = asyncio.ensure_future(self._claim(job))
            task.add_done_callback(lambda _: self._claiming.pop(job, None))
        return await asyncio.shield(task)  # a caller that goes away leaves it to the others

    async def _claim(self, job: str) -> Claim:
        was = job in self._owned
        for _ in range(2):  # the owner's lease may expire between our SET and our GET
            if await self.acquire(job):
                return Claim("here", gained=not was)
            if self._reason:
                return Claim("paused", reason=self._reason)
            rid, url = await self.owner(job)
            if self._reason:
                return Claim("paused", reason=self._reason)
            if rid is not None:
                return Claim("redirect", owner=rid, url=url or "")
        return Claim("redirect")

    def _gained(self, job: str) -> None:
        try:
            self._on_gained(job)
        except Exception:  # the lease is ours either way; the controller logs its own faults
            log.exception("taking over job %s failed", job)

    async def release(self, job: str) -> None:
        self._owned.discard(job)
        self._epochs.pop(job, None)
        self._acquired_at.pop(job, None)
        with contextlib.suppress(RedisError, OSError):
            await self._redis.eval(_RELEASE, 1, self._lease_key(job), self.replica_id)

    async def owner(self, job: str) -> tuple[str | None, str | None]:
        """(replica id, its advertised URL) of ``job``'s owner; (None, None) when unowned."""
        try:
            rid = await self._redis.get(self._lease_key(job))
            if rid is None:
                return None, None
            url = await self._redis.get(f"{self.prefix}:replica:{rid!s}")
        except (RedisError, OSError) as exc:
            self._down(exc)
            return None, None
        return str(rid), (str(url) if url is not None else None)

    async def publish(self, job: str, kind: str) -> None:
        """Tell every replica that something about ``job`` changed (ids only, < 8 KB)."""
        payload = json.dumps({"job": job, "kind": kind, "replica": self.replica_id})
        with contextlib.suppress(RedisError, OSError):
            await self._redis.publish(f"{self.prefix}:events", payload)

    async def renew_all(self) -> None:
        """One renewal pass: keep what we still hold, drop what another replica took, claim
        the jobs whose hooks are here, release the owned jobs whose hooks are gone."""
        lost: list[str] = []
        try:
            await self._redis.set(f"{self.prefix}:replica:{self.replica_id}", self.advertise_url,
                                  px=self.ttl_ms)
            for job in list(self._owned):
                if not await self._redis.eval(_RENEW, 1, self._lease_key(job), self.replica_id, self.ttl_ms):
                    self.fenced(job)
                    self._acquired_at.pop(job, None)
                    log.warning("lost the lease of job %s to another replica", job)
        except (RedisError, OSError) as exc:
            self._down(exc)
            return
        self._reason = ""
        if self._wanted is None:
            return
        wanted = set(self._wanted())
        for job in sorted(wanted - self._owned):
            if not await self.acquire(job):
                if self._reason:
                    return
                lost.append(job)
        # A job acquired for a hello is kept one TTL before its hooks are counted (the
        # hello's socket is registered after the claim).
        settled = time.monotonic() - self.ttl_ms / 1000
        for job in sorted(self._owned - wanted):
            if self._acquired_at.get(job, 0.0) < settled:
                await self.release(job)
        for job in lost:
            try:
                self._on_lost(job)
            except Exception:
                log.exception("handing the hooks of job %s to its owner failed", job)

    def _down(self, exc: BaseException) -> None:
        if not self._reason:
            log.error("Redis unreachable, control paused: %s", exc)
        # Our leases expire on their own; claiming them again after Redis returns is acquire()'s job.
        self._owned.clear()
        self._epochs.clear()
        self._reason = f"Redis unreachable ({type(exc).__name__}: {exc}); control paused, training continues."

    async def start(self) -> None:
        await self.renew_all()
        self._task = asyncio.create_task(self._loop(), name="rebalancer-leases")

    async def _loop(self) -> None:
        # Ends on ``_stopping`` (``backend.cluster._loop``: redis-py may swallow a cancellation).
        period = self.ttl_ms / 3000
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                await self.renew_all()
            except Exception:  # a bug in a callback must not end the renewals
                log.exception("lease renewal pass failed")
            await pause(self._stopping, max(0.05, period - (time.monotonic() - started)))

    async def stop(self) -> None:
        await end(self._stopping, self._task)
        for job in list(self._owned):
            await self.release(job)
        with contextlib.suppress(RedisError, OSError):
            await self._redis.delete(f"{self.prefix}:replica:{self.replica_id}")
        await self._redis.aclose()
