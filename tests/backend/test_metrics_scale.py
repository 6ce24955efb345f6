"""/metrics at scale: per-rank series only for each job's slowest ranks (and every rank that
is gone) by default, every rank with REBALANCER_METRICS_RANK_SERIES=all; per-job aggregates
cover every rank either way. In process: real parts, live state filled directly."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from backend.parts import Parts, build_parts
from backend.settings import Settings
from rebalancer_wire.protocol import DeviceSample, Hello, Metrics, StepRecord

RANKS = 256


def _parts(tmp_path: Path, **kw: object) -> Iterator[Parts]:
    parts = build_parts(Settings(db=f"sqlite:///{tmp_path}/m.db", policy_process=False, **kw))  # type: ignore[arg-type]
    try:
        yield parts
    finally:
        parts.sql.close()
        parts.engine.dispose()


def _fill(parts: Parts, job: str = "big", ranks: int = RANKS) -> None:
    now = time.time()
    for r in range(ranks):
        parts.live.register(Hello(job=job, rank=r, world_size=ranks, global_batch_size=8 * ranks,
                                  host=f"node{r // 8}", device_type="H100", device_name="NVIDIA H100 80GB HBM3",
                                  gpu_index=r % 8, gpu_uuid=f"GPU-{r:08d}"))
        # rank r computes 10 + r % 100 ms: ranks 99, 199 (and 98, 198, ...) are the slowest
        recs = [StepRecord(batch_index=b, local_batch_size=8, placement_version=0, data_wait_ms=0.1,
                           compute_ms=10.0 + r % 100, sync_wait_ms=1.0, optimizer_ms=0.5, step_ms=120.0,
                           t=now - (4 - b) * 0.12) for b in range(5)]
        dev = DeviceSample(t=now, source="nvml", util_pct=90.0, power_w=500.0)
        parts.live.add_metrics(Metrics(job=job, rank=r, steps=recs, device=[dev]))


def _ranks_of(text: str, metric: str) -> set[int]:
    return {int(s.labels["rank"]) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == metric}


def _value(text: str, metric: str) -> float:
    (v,) = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == metric]
    return v


@pytest.fixture
def default_parts(tmp_path: Path) -> Iterator[Parts]:
    yield from _parts(tmp_path)


def test_default_keeps_the_slowest_ranks_and_aggregates_every_rank(default_parts: Parts):
    _fill(default_parts)
    text = default_parts.exporter.exposition()
    # compute 10 + r % 100: 109 ms for ranks 99 and 199, 108 ms for 98 and 198, ...
    want = {99, 199, 98, 198, 97, 197, 96, 196}
    assert _ranks_of(text, "rebalancer_rank_compute_seconds") == want
    assert _ranks_of(text, "rebalancer_device_power_watts") == want
    assert _value(text, "rebalancer_rank_series_omitted") == RANKS - 8
    assert _value(text, "rebalancer_max_compute_seconds") == pytest.approx(0.109)
    mean = sum(10.0 + r % 100 for r in range(RANKS)) / RANKS / 1000
    assert _value(text, "rebalancer_mean_compute_seconds") == pytest.approx(mean)
    assert _value(text, "rebalancer_lost_ranks") == 0.0
    assert _value(text, "rebalancer_connected_ranks") == RANKS


def _series(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def test_all_exports_every_rank_and_the_default_scrape_is_a_fraction_of_it(default_parts: Parts, tmp_path: Path):
    _fill(default_parts)
    small = default_parts.exporter.exposition()
    (tmp_path / "all").mkdir()
    for parts in _parts(tmp_path / "all", metrics_rank_series="all"):
        _fill(parts)
        every = parts.exporter.exposition()
    assert _ranks_of(every, "rebalancer_rank_compute_seconds") == set(range(RANKS))
    assert _value(every, "rebalancer_rank_series_omitted") == 0.0
    assert _value(every, "rebalancer_max_compute_seconds") == _value(small, "rebalancer_max_compute_seconds")
    # 8 of 256 ranks' series (~25 each) plus the per-job and backend ones
    assert _series(small) * 10 < _series(every)


def test_rank_series_settings_are_checked():
    with pytest.raises(ValidationError, match="metrics_rank_series"):
        Settings(metrics_rank_series="some")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="metrics_slowest_ranks"):
        Settings(metrics_slowest_ranks=0)
    with pytest.raises(ValidationError, match="metrics_gone_ranks"):
        Settings(metrics_gone_ranks=-1)
    with pytest.raises(ValidationError, match="metrics_cache_s"):
        Settings(metrics_cache_s=-0.5)


def test_ranks_that_are_gone_keep_their_series(default_parts: Parts):
    _fill(default_parts)
    default_parts.live.set_connected("big", 5, False, lost=True)  # died
    default_parts.live.set_connected("big", 6, False)  # left cleanly while the job runs
    text = default_parts.exporter.exposition()
    assert {5, 6} <= _ranks_of(text, "rebalancer_rank_connected")
    assert _ranks_of(text, "rebalancer_rank_lost") == {5, 6, 99, 199, 98, 198, 97, 197, 96, 196}
    assert _value(text, "rebalancer_lost_ranks") == 1.0
    assert _value(text, "rebalancer_rank_series_omitted") == RANKS - 10


def test_a_small_job_keeps_every_rank(default_parts: Parts):
    _fill(default_parts, job="small", ranks=4)
    text = default_parts.exporter.exposition()
    assert _ranks_of(text, "rebalancer_rank_compute_seconds") == {0, 1, 2, 3}
    assert _value(text, "rebalancer_rank_series_omitted") == 0.0


def test_gone_ranks_with_series_are_bounded_and_counted_in_full(tmp_path: Path):
    # A job that lost half its nodes: before, every lost rank kept its ~27 series (16,384
    # ranks: 215,648 series, 32 MB); now at most metrics_gone_ranks of them, lost first.
    for parts in _parts(tmp_path, metrics_gone_ranks=4):
        _fill(parts)
        for r in range(128):
            parts.live.set_connected("big", r, False, lost=True)
        parts.live.set_connected("big", 200, False)  # left while the job runs: after the lost ones
        text = parts.exporter.exposition()
        slowest = {99, 199, 98, 198, 97, 197, 96, 196}
        assert _ranks_of(text, "rebalancer_rank_lost") == slowest | {0, 1, 2, 3}
        assert _ranks_of(text, "rebalancer_device_utilization_ratio") == slowest | {0, 1, 2, 3}
        assert _value(text, "rebalancer_lost_ranks") == 128.0
        assert _value(text, "rebalancer_rank_series_omitted") == RANKS - 12


def _samples(text: str, metric: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == metric}


def test_per_job_aggregates_cover_every_rank(tmp_path: Path):
    for parts in _parts(tmp_path):
        now = time.time()
        for r in range(RANKS):
            parts.live.register(Hello(job="big", rank=r, world_size=RANKS, global_batch_size=8 * RANKS,
                                      host=f"node{r // 8}", device_type="H100", gpu_index=r % 8,
                                      gpu_uuid=f"GPU-{r:08d}"))
            recs = [StepRecord(batch_index=b, local_batch_size=8, placement_version=0, compute_ms=10.0 + r, data_wait_ms=0.1, optimizer_ms=0.5,
                               sync_wait_ms=1.0, step_ms=300.0, comm_bytes=1000 + r, comm_ms=2.0,
                               t=now - (4 - b) * 0.3) for b in range(5)]
            dev = DeviceSample(t=now, source="nvml", power_w=100.0 + r, temp_c=60.0,
                               throttle_reasons=["sw_power_cap"] if r < 10 else [],
                               nic_tx_bytes_per_s=1e9 * (1 + r))
            parts.live.add_metrics(Metrics(job="big", rank=r, steps=recs, device=[dev]))
        text = parts.exporter.exposition()
        power = _samples(text, "rebalancer_job_device_power_watts")
        assert power == {(("job", "big"), ("stat", "min")): 100.0,
                         (("job", "big"), ("stat", "median")): 100.0 + (RANKS - 1) / 2,
                         (("job", "big"), ("stat", "max")): 100.0 + RANKS - 1}
        compute = _samples(text, "rebalancer_job_rank_compute_seconds")
        assert compute[(("job", "big"), ("stat", "max"))] == pytest.approx((10.0 + RANKS - 1) / 1000)
        throttled = _samples(text, "rebalancer_job_device_throttled_ranks")
        assert throttled[(("job", "big"), ("reason", "sw_power_cap"))] == 10.0
        assert throttled[(("job", "big"), ("reason", "hw_slowdown"))] == 0.0
        nic = _samples(text, "rebalancer_job_rank_link_bytes_per_second")
        assert nic[(("direction", "tx"), ("job", "big"), ("link", "nic"), ("stat", "max"))] == 1e9 * RANKS
        comm = _samples(text, "rebalancer_job_rank_comm_bytes")
        assert comm[(("job", "big"), ("stat", "min"))] == 1000.0
        # per-rank communication and link series: the slowest 8 only (not every rank)
        slowest = set(range(RANKS - 8, RANKS))
        assert _ranks_of(text, "rebalancer_rank_comm_bytes") == slowest
        assert _ranks_of(text, "rebalancer_rank_link_bytes_per_second") == slowest


def test_the_scrape_body_is_reused_within_the_cache_time(tmp_path: Path):
    clock = [100.0]
    for parts in _parts(tmp_path, metrics_cache_s=1.0):
        parts.exporter.clock = lambda: clock[0]
        _fill(parts, ranks=4)
        first = parts.exporter.body()
        parts.live.set_connected("big", 0, False, lost=True)
        clock[0] += 0.5
        assert parts.exporter.body() is first  # within 1 s: the same text
        clock[0] += 0.6
        again = parts.exporter.body()
        assert again != first and b'rebalancer_lost_ranks{job="big"} 1.0' in again


def test_without_a_cache_time_every_scrape_is_built(tmp_path: Path):
    for parts in _parts(tmp_path, metrics_cache_s=0.0):
        _fill(parts, ranks=4)
        parts.exporter.body()
        parts.live.set_connected("big", 0, False, lost=True)
        assert b'rebalancer_lost_ranks{job="big"} 1.0' in parts.exporter.body()
