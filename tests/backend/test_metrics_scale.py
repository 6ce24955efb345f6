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
