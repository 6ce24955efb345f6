"""Replicas for the cluster tests (tests/backend/cluster): the real Redis at 127.0.0.1:6379
under a key prefix of the test's own, and ``running_replicas``, two real ``rebalancer serve``
processes on one PostgreSQL schema of their own (a module starts one pair and shares it)."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from tests.helpers.ports import free_port
from tests.helpers.require import unavailable

__all__ = ["REDIS_URL", "Replicas", "key_prefix", "redis_or_skip", "redis_under_prefix", "running_replicas"]

REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_or_skip() -> ModuleType:
    """The ``redis`` package, once the server answers; else the calling module is skipped
    (failed under REBALANCER_REQUIRE_ALL=1). Call it at module level, before importing what
    needs it."""
    try:
        import redis
    except ImportError:
        unavailable("the redis package is not installed (pip install 'torch-rebalancer[cluster]')", module=True)
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except (redis.RedisError, OSError) as exc:
        unavailable(f"Redis at {REDIS_URL} is unreachable: {exc}", module=True)
    return redis


def key_prefix() -> str:
    """A Redis key prefix nobody else uses."""
    return f"rebalancer-test-{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def redis_under_prefix() -> Iterator[tuple[str, Any]]:
    """A key prefix nobody else uses and a Redis client; every key under the prefix is
    deleted at the end."""
    import redis

    prefix = key_prefix()
    client = redis.Redis.from_url(REDIS_URL)
    try:
        yield prefix, client
    finally:
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()


@dataclass
class Replicas:
    """Replica A (started first) and B, sharing ``db_url`` and the Redis ``prefix``."""

    a: Any  # tests.helpers.server.Server
    b: Any
    db_url: str
    prefix: str
    redis: Any  # redis.Redis

    def lease(self, job: str) -> str | None:
        """The replica id holding ``job``'s lease, or None."""
        rid = self.redis.get(f"{self.prefix}:lease:{job}")
        return rid.decode() if rid is not None else None

    def owner_url(self, job: str) -> str | None:
        """The advertised URL of the replica holding ``job``'s lease, or None."""
        rid = self.lease(job)
        url = self.redis.get(f"{self.prefix}:replica:{rid}") if rid is not None else None
        return url.decode() if url is not None else None

    def log(self) -> str:
        return f"--- A ---\n{self.a.log()[-3000:]}\n--- B ---\n{self.b.log()[-3000:]}"


@contextlib.contextmanager
def running_replicas(tmp: Path, env: dict[str, str], *, ttl_s: float) -> Iterator[Replicas]:
    """Two replicas with ``env`` (the admin token, modes, intervals) and a ``ttl_s`` lease,
    each advertising its own URL. On exit a replica the test paused is resumed (a stopped one
    cannot shut down), and neither replica's log may hold a traceback (one the test killed too:
    what it logged before)."""
    from tests.helpers.postgres import pg_schema
    from tests.helpers.server import running_server

    port_a, port_b = free_port(), free_port()

    def replica_env(prefix: str, port: int) -> dict[str, str]:
        return {**env, "REBALANCER_REDIS_URL": REDIS_URL, "REBALANCER_REDIS_PREFIX": prefix,
                "REBALANCER_LEASE_TTL_S": f"{ttl_s:g}", "REBALANCER_ADVERTISE_URL": f"ws://127.0.0.1:{port}"}

    with redis_under_prefix() as (prefix, client), pg_schema() as db_url, \
            running_server(tmp, db_url=db_url, port=port_a, env=replica_env(prefix, port_a)) as a, \
            running_server(tmp, db_url=db_url, port=port_b, env=replica_env(prefix, port_b)) as b:
        try:
            yield Replicas(a=a, b=b, db_url=db_url, prefix=prefix, redis=client)
        finally:
            for server in (a, b):
                if server.proc.poll() is None:
                    os.kill(server.proc.pid, signal.SIGCONT)
        for server in (a, b):
            assert "Traceback" not in server.log(), server.log()[-5000:]
