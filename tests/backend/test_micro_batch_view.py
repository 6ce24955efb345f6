"""Micro-batch placements in the backend (issue 41): the hello says shares count
micro-batches, the job resource and the dashboard summary say so, memory caps treat a
rank's peak as independent of its count, and the policy splits whole micro-batches."""

from __future__ import annotations

from fastapi.testclient import TestClient

from backend.policy.memory import MemoryReading, fit_memory, memory_cap
from rebalancer_wire.protocol import Hello, decode, encode
from tests.backend._app import hello, make_app, metrics, sync


def test_the_hello_carries_micro_batches_only_when_set() -> None:
    plain = encode(Hello(job="j", rank=0, world_size=2, global_batch_size=8))
    assert '"micro_batches"' not in plain and decode(plain).micro_batches is False  # type: ignore[union-attr]
    micro = encode(Hello(job="j", rank=0, world_size=2, global_batch_size=8, micro_batches=True))
    assert decode(micro).micro_batches is True  # type: ignore[union-attr]
    assert '"micro_batches"' not in encode(Hello(job="j", rank=0, world_size=2, global_batch_size=8,
                                                 micro_batches=True), 1)


def test_a_flat_memory_fit_caps_nothing_while_the_peak_fits_and_drains_when_it_does_not() -> None:
    gib = 1 << 30
    readings = [MemoryReading(2, 30 * gib, 80 * gib), MemoryReading(5, 31 * gib, 80 * gib),
                MemoryReading(9, 30 * gib, 80 * gib)]
    flat = fit_memory(readings, flat=True)
    assert flat is not None and flat.method == "flat" and flat.m_bytes == 0 and flat.m0_bytes == 31 * gib
    assert memory_cap(flat, 80 * gib) is None  # any count: the peak is one micro-batch's
    assert memory_cap(flat, 32 * gib) == 0  # even one micro-batch does not fit
    sampled = fit_memory(readings)
    assert sampled is not None and memory_cap(sampled, 80 * gib) is not None  # samples: a cap


def test_the_policy_splits_whole_micro_batches_by_time_per_micro_batch() -> None:
    from backend.policy.solver import solve

    # 40 ms a micro-batch on three ranks, 80 on the fourth: 28 micro-batches split 8, 8, 8, 4.
    assert solve([2.0] * 4, [40.0, 40.0, 40.0, 80.0], 28) == (8, 8, 8, 4)


def test_the_job_view_says_shares_count_micro_batches(tmp_path) -> None:
    with TestClient(make_app(tmp_path)) as c:
        with c.websocket_connect("/ws/hook") as a, c.websocket_connect("/ws/hook") as b:
            for rank, ws in enumerate((a, b)):
                ws.send_text(hello(job="mb", rank=rank, global_batch_size=8, micro_batches=True))
                assert ws.receive_json()["shares"] == [4, 4]
                ws.send_text(metrics(job="mb", rank=rank, n=6, local_batch_size=4))
                sync(ws, hello(job="mb", rank=rank, global_batch_size=8, micro_batches=True))
        with c.websocket_connect("/ws/hook") as other:
            other.send_text(hello(job="plain", rank=0, global_batch_size=8))
            other.receive_json()
            job = c.get("/api/v1/jobs/mb").json()
            assert job["share_unit"] == "micro_batch" and job["global_batch_size"] == 8
            assert c.get("/api/v1/jobs/plain").json()["share_unit"] == "sample"
