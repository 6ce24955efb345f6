"""The benchmarks run in tiny mode and write what they promise. No timing is asserted:
these are smoke tests of the benchmark code, run against the real backend and job."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench._analysis import (
    excess_ms,
    rolling_median,
    split_excess_ms,
    steady_ms,
    steps_until_within,
)
from bench._backend import Backend, running_backend
from bench._report import markdown_table, table_lines
from bench.reaction import cost_at
from bench.run_all import summary_markdown


def test_steady_ms_is_the_median_of_the_tail() -> None:
    times = [100.0] * 70 + [50.0] * 29 + [900.0]  # one scheduling spike at the end
    assert steady_ms(times) == 50.0
    with pytest.raises(ValueError, match="at least one step time"):
        steady_ms([])


def test_steps_until_within_ignores_one_spike_but_not_a_bad_split() -> None:
    times = [100.0] * 20 + [50.0] * 40
    assert steps_until_within(times, 50.0, 0.05, window=5) == 18  # first all-good median
    spiky = list(times)
    spiky[40] = 500.0
    assert steps_until_within(spiky, 50.0, 0.05, window=5) == 18
    assert steps_until_within([100.0] * 30, 50.0, 0.05) is None
    assert steps_until_within(times, lambda k: 50.0, 0.05, start=30, window=5) == 0
    assert rolling_median([1.0, 3.0, 2.0, 5.0], 3) == [2.0, 3.0]


def test_excess_counts_only_time_above_the_reference() -> None:
    assert excess_ms([10.0, 12.0, 8.0, 15.0], 10.0) == 7.0
    assert excess_ms([10.0, 12.0, 8.0, 15.0], lambda k: 10.0 + k, start=1) == 1.0 + 2.0


def test_split_excess_is_the_model_time_above_the_best_split() -> None:
    def costs(k: int) -> tuple[list[float], list[float]]:
        return [0.0, 0.0], [1.0, 1.0 if k < 2 else 3.0]  # rank 1 three times slower from step 2

    timeline = [{"version": 0, "start_batch": 0, "shares": [4, 4]},
                {"version": 1, "start_batch": 3, "shares": [6, 2]}]
    # At step 2, [4, 4] takes 12 where the best split, [6, 2], takes 6; from step 3 it is in force.
    assert split_excess_ms(timeline, costs, 5, 8) == 6.0
    assert split_excess_ms(timeline, costs, 5, 8, start=3) == 0.0


def test_reaction_costs_follow_the_demo_worker() -> None:
    from argparse import Namespace

    from bench._jobs import JobSpec
    from trainer_hook.demo_worker import delay_ms

    spec = JobSpec(job="x", speeds=(1.0, 0.5), steps=10, per_sample_ms=2.0, fixed_ms=1.0,
                   slowdown="1:4:2", drift="0:2:10")
    args = Namespace(speeds=[1.0, 0.5], fixed_ms=1.0, per_sample_ms=2.0,
                     slowdown=[(1, 4, 2.0)], drift=[(0, 2, 10.0)])
    for step in (0, 3, 4, 9):
        a, c = cost_at(spec, step)
        for rank in (0, 1):
            assert a[rank] + c[rank] * 8 == pytest.approx(delay_ms(args, rank, step, 8))


def test_tables_render() -> None:
    lines = table_lines(["a", "bb"], [[1, 2.345], [None, "x"]])
    assert lines[0].split() == ["a", "bb"] and lines[3].split() == ["-", "x"]
    assert markdown_table(["a"], [[0.5]]).splitlines()[2] == "| 0.5 |"
    md = summary_markdown({"quick": True, "machine": {"cpus": 2}, "started": "now", "benchmarks": {
        "policy": {"ok": False, "seconds": 1.0, "error": "boom"},
        "balance": {"ok": True, "seconds": 1.0, "result": {"rows": [
            {"scenario": "1,1", "strategy": "uniform", "efficiency": 0.5, "steady_ms": 80.0,
             "steps_to_within_5pct": None}]}},
    }})
    assert "## policy: FAILED" in md and "0.50 (80 ms; -)" in md


def test_update_docs_rewrites_only_the_generated_blocks(tmp_path: Path) -> None:
    from bench.run_all import update_docs

    page = tmp_path / "performance.md"
    page.write_text("intro\n<!-- bench:headline -->\nold\n<!-- /bench:headline -->\nprose\n")
    summary = {"quick": False, "machine": {"cpus": 2, "load_avg_1m": 1.0}, "started": "today",
               "benchmarks": {"hook_overhead": {"ok": True, "seconds": 1.0, "result": {
                   "overhead_ratio_median": 0.004, "overhead_ratio_mean": 0.005,
                   "training_thread_added_us_per_step": 31.0,
                   "baseline_step_ms": {"median": 21.0}, "hooked_step_ms": {"median": 21.1}}}}}
    assert update_docs(summary, page) and update_docs(summary, page)
    text = page.read_text()
    assert text.startswith("intro\n<!-- bench:headline -->\n*Full run of today")
    assert "| hook overhead on a 20 ms step (median) | +0.40 % | <= 1 % |" in text
    assert "old" not in text and text.endswith("<!-- /bench:headline -->\nprose\n")


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    with running_backend(tmp_path_factory.mktemp("backend")) as b:
        yield b


@pytest.mark.timeout(60)
@pytest.mark.multiproc
def test_capacity_tiny_loses_nothing(tmp_path: Path, backend: Backend) -> None:
    from bench.capacity import run_capacity

    [res] = run_capacity([3], seconds=1.0, warmup=0.5, out_dir=tmp_path, backend=backend, plot=False)
    assert res.errors == []
    assert res.records_sent > 0
    assert res.records_lost == 0, res
    assert res.latency_samples > 0 and res.dashboard_frames > 0
    # /metrics carries every rank's GPU series: 3 ranks of NVML-like samples
    assert res.scrape_series is not None and res.scrape_series > 3 * 20 and res.scrape_bytes
    data = json.loads((tmp_path / "capacity.json").read_text())
    assert data["results"][0]["ranks"] == 3 and "machine" in data


@pytest.mark.timeout(120)
@pytest.mark.multiproc
def test_capacity_over_two_replicas_splits_the_jobs_and_loses_nothing(tmp_path: Path) -> None:
    # Two real backends on a fresh PostgreSQL schema and Redis prefix: job j's node
    # connections go to replica j % 2, which owns it (no redirect), and every record sent
    # to either is counted by one of them.
    redis = pytest.importorskip("redis")
    from tests.helpers.postgres import pg_schema

    try:
        redis.Redis.from_url("redis://127.0.0.1:6379/0", socket_connect_timeout=1).ping()
    except redis.exceptions.ConnectionError as exc:
        pytest.skip(f"Redis at 127.0.0.1:6379 is unreachable: {exc}")
    with pg_schema():  # skips with the reason when PostgreSQL is unreachable
        pass
    from bench.capacity import run_capacity

    [res] = run_capacity([8], seconds=1.0, warmup=0.5, out_dir=tmp_path, plot=False, node_size=2, replicas=2,
                         name="cluster")
    assert res.errors == [] and res.records_sent > 0 and res.records_lost == 0, res
    assert (res.replicas, res.jobs, res.replica_sockets) == (2, 2, [2, 2]), res  # 4 ranks a job, 2 a socket
    assert res.frames == "node", res  # one node_metrics frame per socket per flush, as the node agent sends
    assert len(res.replica_cpu_pct) == 2 and all(c > 0 for c in res.replica_cpu_pct), res
    assert res.redis_cpu_pct is not None and res.postgres_cpu_pct is not None
    assert res.latency_samples > 0
    data = json.loads((tmp_path / "cluster.json").read_text())
    assert (data["replicas"], data["jobs"]) == (2, 2)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_balance_tiny_runs_a_real_job_under_the_oracle_split(tmp_path: Path, backend: Backend) -> None:
    from bench.balance import run_balance

    out = run_balance({"1,0.5": (1.0, 0.5)}, steps=20, strategies=("oracle",), out_dir=tmp_path,
                      backend=backend)
    [row] = out["rows"]
    assert row["final_shares"] == [43, 21]  # solve([2, 2], [2, 4], 64): the oracle reached the job
    assert len(out["step_ms"]["1,0.5"]["oracle"]) == 20
    assert (tmp_path / "balance.png").stat().st_size > 0


def test_a_mesh_jobs_split_is_over_replicas_at_their_slowest_members_speed() -> None:
    from types import SimpleNamespace

    from bench._analysis import oracle_shares
    from bench._jobs import JobSpec, _worker_args
    from bench.mesh import SCENARIO

    backend: Any = SimpleNamespace(url="http://127.0.0.1:1")  # only its url is read

    speeds = next(iter(SCENARIO.values()))
    spec = JobSpec(job="m", speeds=speeds, steps=10, per_sample_ms=2.0, fixed_ms=2.0, wrap="dp_tp")
    assert spec.replica_speeds == [1.0, 0.5]  # ranks (0, 1) and (2, 3): rank 3's half speed
    assert (spec.a_ms, spec.c_ms) == ([2.0, 2.0], [2.0, 4.0])
    assert oracle_shares(spec.a_ms, spec.c_ms, 64) == [43, 21]
    assert _worker_args(spec, backend, Path("r.json"))[-2:] == ["--wrap", "dp_tp"]
    plain = JobSpec(job="p", speeds=speeds, steps=10)
    assert plain.replica_speeds == list(speeds) and "--wrap" not in _worker_args(plain, backend, Path("r"))


def test_busy_loops_spin_while_the_block_runs_and_leave_no_process() -> None:
    import multiprocessing
    import os

    from bench._load import busy_loops

    before = {p.pid for p in multiprocessing.active_children()}
    with busy_loops(2):
        spinning = [p for p in multiprocessing.active_children() if p.pid not in before]
        assert len(spinning) == 2 and all(p.is_alive() for p in spinning)
    assert not [p for p in spinning if p.is_alive()]
    for p in spinning:
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)  # reaped, not a zombie


def test_the_causes_bench_measures_a_phase_by_its_interquartile_mean() -> None:
    from backend.policy.causes import CauseStep
    from bench.causes import mean_step_ms

    def steps(times: list[float]) -> dict[int, list[CauseStep]]:
        return {r: [CauseStep(batch_index=k, local_batch_size=4, data_wait_ms=0.0, compute_ms=t, sync_wait_ms=0.0,
                              optimizer_ms=0.0, step_ms=t) for k, t in enumerate(times)] for r in range(3)}

    # A phase that alternates slow and fast steps keeps its mean; one late wake-up is cut.
    assert mean_step_ms(steps([40.0, 100.0] * 8)) == pytest.approx(70.0)
    assert mean_step_ms(steps([40.0] * 15 + [400.0])) == pytest.approx(40.0)
    # The ranks' median step of each batch: one rank's outlier does not move it.
    odd = steps([40.0] * 16)
    odd[2] = [CauseStep(batch_index=k, local_batch_size=4, data_wait_ms=0.0, compute_ms=90.0, sync_wait_ms=0.0,
                        optimizer_ms=0.0, step_ms=90.0) for k in range(16)]
    assert mean_step_ms(odd) == pytest.approx(40.0)
