"""Job leases on the real Redis at 127.0.0.1:6379, each test under a key prefix of its own."""

from __future__ import annotations

import asyncio

from tests.helpers.cluster import REDIS_URL, key_prefix, redis_or_skip
from tests.helpers.ports import free_port

redis = redis_or_skip()

from backend.cluster import JobLeases  # noqa: E402


def _replica(prefix: str, name: str, *, url: str = REDIS_URL, ttl_s: float = 1.0) -> JobLeases:
    return JobLeases(url=url, prefix=prefix, advertise_url=f"ws://{name}.example:8000",
                     ttl_s=ttl_s, replica_id=name)


def test_one_owner_at_a_time_and_the_others_find_its_url() -> None:
    async def run() -> None:
        prefix = key_prefix()
        a, b = _replica(prefix, "a"), _replica(prefix, "b")
        await a.start()
        await b.start()
        assert await a.acquire("llama")
        assert not await b.acquire("llama")
        assert await a.acquire("llama")  # the owner may claim again (renews)
        assert a.owns("llama") and not b.owns("llama")
        assert await b.owner("llama") == ("a", "ws://a.example:8000")
        # Held past several TTLs: the renew loop keeps it.
        await asyncio.sleep(2.5)
        assert not await b.acquire("llama") and a.owns("llama")
        await a.stop()  # a clean stop releases at once
        assert await b.acquire("llama")
        assert await b.owner("llama") == ("b", "ws://b.example:8000")
        await b.stop()
    asyncio.run(run())


def test_a_dead_owner_loses_the_job_within_its_ttl() -> None:
    async def run() -> None:
        prefix = key_prefix()
        a, b = _replica(prefix, "a"), _replica(prefix, "b")
        assert await a.acquire("bert")  # a never starts its renew loop: as if SIGKILLed
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        while not await b.acquire("bert"):
            assert loop.time() < deadline, "replica b never took the job of a dead owner"
            await asyncio.sleep(0.1)
        assert await b.owner("bert") == ("b", None)  # b has not advertised (no start())
        await a.renew_all()  # the old owner comes back: it learns it lost the job
        assert not a.owns("bert")
        await a.stop()
        await b.stop()
    asyncio.run(run())


def test_redis_down_pauses_control_with_a_reason() -> None:
    async def run() -> None:
        dead = _replica(key_prefix(), "c", url=f"redis://127.0.0.1:{free_port()}/0")
        await dead.start()
        assert not await dead.acquire("gpt")
        status = dead.status()
        assert status.state == "paused" and status.owned_jobs == 0
        assert status.reason.startswith("Redis unreachable (")
        assert status.reason.endswith("control paused, training continues.")
        await dead.stop()
    asyncio.run(run())


def test_bad_settings_and_job_names_are_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="REBALANCER_LEASE_TTL_S must be between 1 and 300 seconds, got 0.1."):
        _replica(key_prefix(), "d", ttl_s=0.1)

    async def run() -> None:
        leases = _replica(key_prefix(), "e")
        with pytest.raises(ValueError, match="job name must be 1 to 256 characters, got 0."):
            await leases.acquire("")
        await leases.stop()
    asyncio.run(run())


def test_healthz_says_whether_the_cluster_controls(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import pytest
    from fastapi.testclient import TestClient

    from backend.settings import Settings
    from tests.backend._app import make_app

    with TestClient(make_app(tmp_path / "one")) as client:  # the default: one replica, no Redis
        assert client.get("/healthz").json()["cluster"] == "off"
    with TestClient(make_app(tmp_path, redis_url=REDIS_URL, redis_prefix=key_prefix())) as client:
        body = client.get("/healthz").json()
        assert body["cluster"] == "ok" and body["status"] == "ok"
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with TestClient(make_app(tmp_path, redis_url=dead, redis_prefix=key_prefix())) as client:
        reply = client.get("/healthz")
        assert reply.status_code == 200  # ingest and dashboards go on; only control pauses
        assert reply.json()["cluster"].startswith("paused: Redis unreachable (")
    with pytest.raises(ValueError, match="REBALANCER_REDIS_URL must be a redis://host:port/db URL, got 'http://x'."):
        Settings(redis_url="http://x")
    with pytest.raises(ValueError, match="REBALANCER_LEASE_TTL_S must be between 1 and 300 seconds, got 0.5."):
        Settings(lease_ttl_s=0.5)


def test_stop_ends_the_renewals_even_when_a_cancel_lands_mid_command() -> None:
    # redis-py 8.2 swallows a CancelledError that arrives while a command is on the wire;
    # stop() used to hang on the still-renewing task about one time in four.
    import random

    async def run() -> None:
        prefix = key_prefix()
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        for i in range(30):
            a = _replica(prefix, f"r{i}")
            await a.start()
            for k in range(10):
                assert await a.acquire(f"job{i}-{k}")
            await asyncio.sleep(random.uniform(0.0, 0.01))
            await a.stop()
            assert a._task is not None and a._task.done()
        # Every lease released, no renewal after stop; the epoch counters stay (they only rise).
        assert [k for k in await client.keys(f"{prefix}:*") if b":epoch:" not in k] == []
        assert len(await client.keys(f"{prefix}:epoch:*")) == 300
        for key in await client.keys(f"{prefix}:*"):
            await client.delete(key)
        await client.aclose()
    asyncio.run(run())


def test_each_take_over_gets_a_higher_epoch_and_only_the_holder_raises_it() -> None:
    async def run() -> None:
        prefix = key_prefix()
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        a, b = _replica(prefix, "a"), _replica(prefix, "b")
        assert await a.acquire("opt") and a.epoch("opt") == 1
        assert await a.acquire("opt") and a.epoch("opt") == 1  # a renewal keeps the epoch
        assert not await b.acquire("opt") and b.epoch("opt") is None
        await a.release("opt")
        assert await b.acquire("opt") and b.epoch("opt") == 2  # a take-over: the next epoch
        assert a.epoch("opt") is None
        # The store of record holds epoch 9 (say, Redis lost its counter): the holder moves
        # past it; a replica without the lease cannot.
        assert await a.raise_epoch("opt", 9) is None
        assert await b.raise_epoch("opt", 9) == 10 and b.epoch("opt") == 10
        b.fenced("opt")  # the store refused b's epoch: it stops controlling the job
        assert not b.owns("opt") and b.epoch("opt") is None
        for key in await client.keys(f"{prefix}:*"):
            await client.delete(key)
        await client.aclose()
        await a.stop()
        await b.stop()
    asyncio.run(run())
