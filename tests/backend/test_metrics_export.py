"""``GET /metrics`` in process: device series with dcgm-exporter's labels, the step-time
histogram, counters from stored rows (they survive a restart) and who may scrape."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from backend.metrics_contract import CONTRACT, STEP_BUCKETS_S, THROTTLE_REASONS, exposed_names
from rebalancer_wire.protocol import DeviceSample, Metrics, StepRecord, encode
from tests.backend._app import hello, make_app, steps, sync
from tests.helpers.waiting import wait_until

ADMIN = "metrics-admin-secret-0123456789"
UUIDS = ("GPU-11111111-1111-1111-1111-111111111111", "GPU-22222222-2222-2222-2222-222222222222")


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def _gpu_hello(rank: int) -> str:
    return hello(rank=rank, device_type="H100", device_name="NVIDIA H100 80GB HBM3",
                 gpu_index=rank + 2, gpu_uuid=UUIDS[rank], total_steps=1000, comm_kind="all_reduce")


def _with_comm(records: list[StepRecord], comm_ms: float) -> list[StepRecord]:
    return [replace(s, comm_bytes=1 << 20, comm_ms=comm_ms) for s in records]


def _device(t: float, **kw: object) -> DeviceSample:
    base: dict[str, object] = dict(t=t, source="nvml", util_pct=87.0, mem_used_bytes=30 * 2**30,
                                   mem_total_bytes=80 * 2**30, power_w=512.0, temp_c=71.0,
                                   sm_clock_mhz=1755.0, sm_clock_max_mhz=1980.0, throttle_reasons=[])
    base.update(kw)
    return DeviceSample(**base)  # type: ignore[arg-type]


def _feed_two_gpus(client: TestClient) -> None:
    with client.websocket_connect("/ws/hook") as a, client.websocket_connect("/ws/hook") as b:
        for ws, r in ((a, 0), (b, 1)):
            ws.send_text(_gpu_hello(r))
            ws.receive_json()
        a.send_text(encode(Metrics(job="j", rank=0, steps=_with_comm(steps(0, 4, step_ms=20.0, compute_ms=8.0), 11.0),
                                   device=[_device(time.time(), nic_tx_bytes_per_s=1e6)])))
        b.send_text(encode(Metrics(job="j", rank=1, steps=_with_comm(steps(0, 4, step_ms=20.0, compute_ms=16.0), 3.0),
                                   device=[_device(time.time(), throttle_reasons=["sw_thermal", "sw_power_cap"])])))
        sync(a, _gpu_hello(0))
        sync(b, _gpu_hello(1))


def _feed_a_hung_job(client: TestClient) -> None:
    """A second job whose one rank reports a stall (docs/causes.md): the hung series."""
    from rebalancer_wire.protocol import Hang

    with client.websocket_connect("/ws/hook") as ws:
        h = hello(job="stuck", rank=0, world_size=1)
        ws.send_text(h)
        ws.receive_json()
        ws.send_text(encode(Metrics(job="stuck", rank=0, hang=Hang(  # no steps: the histogram stays job j's
            batch_index=3, phase="compute", since=time.time(), stalled_s=6.0))))
        sync(ws, h)


def _feed_a_pipelined_job(client: TestClient) -> None:
    """A third job, PP2 x DP2 (docs/pipelines.md): stages of 4 and 8 ms a micro-batch in
    pipeline 0, 8 and 16 in pipeline 1, 8 micro-batches each, layers [2, 2] whose last is
    heavy (2, 2, 2, 6 ms): the pipeline series and the stage-split advice's gain."""
    from rebalancer_wire.protocol import Hello, MeshShape, PipelineShape

    stages = {0: (4.0, 8.0), 1: (8.0, 16.0)}
    for rank in (0, 1):
        shape = PipelineShape(pp_size=2, pp_stage=0, dp_index=rank, tp_size=1, schedule="1f1b", n_stages=2,
                              min_microbatches=1, layers_per_stage=(2, 2))
        h = encode(Hello(job="pp", rank=rank, world_size=2, global_batch_size=16, host="h", micro_batches=True,
                         mesh=MeshShape(dp=2, replica_size=2, dims=("dp", "pp"), shape=(2, 2)), pipeline=shape))
        t = stages[rank]
        compute = sum(t) + 7 * max(t)
        idle = tuple(compute - 8 * x for x in t)
        recs = [replace(s, compute_ms=compute, step_ms=137.5, sync_wait_ms=137.5 - compute - 1.5, n_microbatches=8,
                        local_batch_size=8, stage_fwd_ms=tuple(x / 4 for x in t), stage_bwd_ms=tuple(3 * x / 4 for x in t),
                        stage_bubble_ms=idle, bubble_ms=sum(idle) / 2, layer_ms=tuple(x * t[0] / 4 for x in (2, 2, 2, 6)))
                for s in steps(0, 4)]
        with client.websocket_connect("/ws/hook") as ws:
            ws.send_text(h)
            ws.receive_json()
            ws.send_text(encode(Metrics(job="pp", rank=rank, steps=recs)))
            sync(ws, h)


def test_every_contract_metric_with_its_labels_and_dcgm_gpu_labels(tmp_path: Path):
    with TestClient(make_app(tmp_path)) as client:
        _feed_two_gpus(client)
        _feed_a_hung_job(client)
        _feed_a_pipelined_job(client)
        # Savings come from the dashboard hub's feed, built on its next tick.
        def with_savings() -> str | None:
            text = client.get("/metrics").text
            return text if "rebalancer_savings_seconds{" in text else None

        text = wait_until(with_savings, "the hub's feed to give the job's savings", 10)
    samples = _samples(text)
    names = {n for n, _ in samples}
    for spec in CONTRACT:
        for name in exposed_names(spec):
            assert name in names, name
            assert {frozenset(k for k, _ in ls if k != "le") for n, ls in samples if n == name} == {
                frozenset(spec.labels)}, name
    gpu1 = dict(job="j", rank="1", Hostname="h", gpu="3", UUID=UUIDS[1], modelName="NVIDIA H100 80GB HBM3")
    assert _value(samples, "rebalancer_device_utilization_ratio", **gpu1) == pytest.approx(0.87)
    assert _value(samples, "rebalancer_device_memory_total_bytes", **gpu1) == 80 * 2**30
    assert _value(samples, "rebalancer_device_sm_clock_hertz", **gpu1) == pytest.approx(1.755e9)
    assert _value(samples, "rebalancer_device_power_watts", **gpu1) == 512.0
    active = {r for r in THROTTLE_REASONS
              if _value(samples, "rebalancer_device_throttle_reason", **gpu1, reason=r) == 1.0}
    assert active == {"sw_thermal", "sw_power_cap"}
    assert _value(samples, "rebalancer_rank_sync_wait_seconds", job="j", rank="0") == pytest.approx(0.012)
    assert _value(samples, "rebalancer_rank_data_wait_seconds", job="j", rank="0") == pytest.approx(0.0005)
    assert _value(samples, "rebalancer_rank_local_batch_size", job="j", rank="1") == 16
    assert _value(samples, "rebalancer_rank_batch_share_ratio", job="j", rank="1") == 0.5
    assert _value(samples, "rebalancer_mode", job="j", mode="approve") == 1.0
    assert _value(samples, "rebalancer_mode", job="j", mode="auto") == 0.0
    # Rank 0's four steps of 20 ms, each counted once (rank 1 sees the same steps).
    assert _value(samples, "rebalancer_step_duration_seconds_count", job="j") == 4
    assert _value(samples, "rebalancer_step_duration_seconds_bucket", job="j", le="0.025") == 4
    assert _value(samples, "rebalancer_step_duration_seconds_bucket", job="j", le="0.01") == 0
    assert len([1 for n, ls in samples if n == "rebalancer_step_duration_seconds_bucket"
                and ("job", "j") in ls]) == len(STEP_BUCKETS_S) + 1
    assert _value(samples, "rebalancer_step_duration_seconds_sum", job="j") == pytest.approx(0.08)
    # Counters start at 0 for every source; the first hello stored placement version 0.
    assert _value(samples, "rebalancer_proposals_created_total", job="j", source="manual") == 0
    assert _value(samples, "rebalancer_placements_total", job="j", source="initial") == 1
    assert _value(samples, "rebalancer_placements_total", job="j", source="rollback") == 0
    # Two H100 at the default price: 6 USD/h; 996 steps left at 20 ms.
    assert _value(samples, "rebalancer_hourly_cost_dollars", job="j") == pytest.approx(6.0)
    assert _value(samples, "rebalancer_eta_seconds", job="j") == pytest.approx(996 * 0.02)
    assert _value(samples, "rebalancer_cost_to_finish_dollars", job="j") == pytest.approx(996 * 0.02 / 3600 * 6)
    # The pipelined job: pipeline 1's stages, its bubble (idle 72 and 8 of a 136 ms run), the
    # stage both pipelines wait on, and the advice's gain ([2, 2] -> [3, 1]: 137.5 -> 109.5 ms).
    assert _value(samples, "rebalancer_pipeline_stage_seconds", job="pp", rank="1", stage="1") == pytest.approx(0.016)
    assert _value(samples, "rebalancer_pipeline_bubble_ratio", job="pp", rank="1") == pytest.approx(40 / 136)
    assert _value(samples, "rebalancer_rank_bubble_seconds", job="pp", rank="1") == pytest.approx(0.040)
    assert _value(samples, "rebalancer_pipeline_bottleneck_stage", job="pp") == 1
    assert _value(samples, "rebalancer_pipeline_stage_split_gain_ratio", job="pp") == pytest.approx(28 / 137.5)
    assert not [n for n, ls in samples if n.startswith("rebalancer_pipeline_") and ("job", "j") in ls]


def test_cpu_ranks_have_no_device_series(tmp_path: Path):
    with TestClient(make_app(tmp_path)) as client, client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello())
        ws.receive_json()
        ws.send_text(encode(Metrics(job="j", rank=0, steps=steps(0, 2),
                                    device=[DeviceSample(t=time.time(), source="psutil", util_pct=50.0)])))
        sync(ws, hello())
        text = client.get("/metrics").text
    assert "rebalancer_rank_compute_seconds{" in text
    assert "rebalancer_device_" not in text.replace("# HELP rebalancer_device_", "").replace(
        "# TYPE rebalancer_device_", "")


def test_counters_count_stored_rows_and_survive_a_restart(tmp_path: Path):
    with TestClient(make_app(tmp_path)) as client, client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello())
        ws.receive_json()
        placed = client.post("/api/v1/jobs/j/proposals", json={"shares": [20, 12], "reason": "test", "apply": True})
        assert placed.status_code in (200, 201), placed.text
        ws.receive_json()  # the placement goes to the hook
    with TestClient(make_app(tmp_path)) as client, client.websocket_connect("/ws/hook") as ws:
        ws.send_text(hello())
        ws.receive_json()
        samples = _samples(client.get("/metrics").text)
    assert _value(samples, "rebalancer_proposals_created_total", job="j", source="manual") == 1
    assert _value(samples, "rebalancer_placements_total", job="j", source="manual") == 1
    assert _value(samples, "rebalancer_placements_total", job="j", source="initial") == 1


def test_scrape_access_token_or_loopback(tmp_path: Path):
    with TestClient(make_app(tmp_path, admin_token=ADMIN)) as admin:
        viewer = admin.post("/api/v1/tokens", json={"role": "viewer", "name": "prometheus"},
                            headers={"Authorization": f"Bearer {ADMIN}"}).json()["secret"]
        hook = admin.post("/api/v1/tokens", json={"role": "hook", "job": "j", "name": "h"},
                          headers={"Authorization": f"Bearer {ADMIN}"}).json()["secret"]
    for access, address, token, code in [
        ("token", "127.0.0.1", None, 401),
        ("token", "127.0.0.1", viewer, 200),
        ("token", "10.1.2.3", hook, 403),
        ("loopback", "127.0.0.1", None, 200),
        ("loopback", "::1", None, 200),
        ("loopback", "10.1.2.3", None, 401),
        ("loopback", "10.1.2.3", viewer, 200),
        ("loopback", "127.0.0.1", "not-a-token", 401),
    ]:
        app = make_app(tmp_path, admin_token=ADMIN, metrics_access=access)
        with TestClient(app, client=(address, 50000)) as client:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            got = client.get("/metrics", headers=headers)
            assert got.status_code == code, (access, address, token, got.text)
            if code != 200:
                assert got.json()["detail"] in ("Missing or invalid bearer token.", "This action needs the viewer role.")


def test_metrics_access_setting_is_checked(tmp_path: Path):
    with pytest.raises(ValueError, match="metrics_access"):
        make_app(tmp_path, metrics_access="anyone")
