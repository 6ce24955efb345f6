"""The Prometheus metric contract: every series ``/metrics`` exports (or will), in one list.

docs/metrics.md embeds ``markdown_table()``; the Grafana dashboard and the alert rules in
deploy/ may only name metrics listed here; tests check all three against this list and
check that each metric marked ``exported`` really appears in a real backend's ``/metrics``.
Pure data and the standard library only (with the hook's standard-library device rules): the
client, the docs check and the exporter all import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rebalancer_wire.devices import CLOCK_EVENT_NAMES

__all__ = [
    "MetricSpec", "CONTRACT", "GPU_LABELS", "THROTTLE_REASONS", "STEP_BUCKETS_S", "STATS", "JOB_STATS_OF",
    "job_stats_name",
    "by_name", "exposed_names", "markdown_table",
]

Kind = Literal["gauge", "counter", "histogram"]

# dcgm-exporter's label names, so that a rank's series join its DCGM series
# (``on(UUID)``, or ``on(Hostname, gpu)``).
GPU_LABELS: tuple[str, ...] = ("Hostname", "gpu", "UUID", "modelName")
_RANK = ("job", "rank")
_DEVICE = (*_RANK, *GPU_LABELS)
_PIPELINED = "pipelined jobs"

# Every clock-event (throttle) reason NVML reports, one series each; the one list is the
# hook's (rebalancer_wire.devices.CLOCK_EVENT_NAMES).
THROTTLE_REASONS: tuple[str, ...] = tuple(CLOCK_EVENT_NAMES.values())

# The per-job aggregates of a per-rank gauge: its min, median and max over the job's ranks
# (label ``stat``), so that every rank counts while per-rank series stay bounded.
STATS: tuple[str, ...] = ("min", "median", "max")

# Buckets of the per-job step-time histogram, in seconds.
STEP_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric family. ``name`` is as scraped (counters end in ``_total``; a histogram's
    name is its base, exposed as ``_bucket``, ``_sum`` and ``_count``)."""

    name: str
    kind: Kind
    labels: tuple[str, ...]
    unit: str  # base unit ("seconds", "bytes", ...) or "1" for ratios and counts
    help: str
    exported: bool  # True once the backend's /metrics carries it
    scope: str = ""  # the jobs it exists for when not every job ("pipelined jobs")


CONTRACT: tuple[MetricSpec, ...] = (
    # --- per rank: time split of a step ----------------------------------------------
    MetricSpec("rebalancer_rank_compute_seconds", "gauge", _RANK, "seconds",
               "Mean time until the rank's gradients are ready, over its recent steps.", True),
    MetricSpec("rebalancer_rank_sync_wait_seconds", "gauge", _RANK, "seconds",
               "Mean time the rank waits inside gradient synchronisation, over its recent steps.", True),
    MetricSpec("rebalancer_rank_data_wait_seconds", "gauge", _RANK, "seconds",
               "Mean time the rank waits for its next batch from the data loader.", True),
    MetricSpec("rebalancer_rank_local_batch_size", "gauge", _RANK, "1",
               "Samples of the global batch the rank trains per step (its share in the placement in force).",
               True),
    MetricSpec("rebalancer_rank_batch_share_ratio", "gauge", _RANK, "1",
               "The rank's share divided by the global batch size (0 to 1).", True),
    MetricSpec("rebalancer_rank_connected", "gauge", _RANK, "1",
               "1 while the rank's hook is connected, 0 once it is gone.", True),
    MetricSpec("rebalancer_rank_lost", "gauge", _RANK, "1",
               "1 while the rank's hook connection is gone without a close (its process died?) and it has "
               "not said hello again; 0 otherwise (a clean close, the job finished, is not a loss).", True),
    # --- pipelined jobs (docs/pipelines.md): a rank is a pipeline (its dp index) ------
    MetricSpec("rebalancer_rank_bubble_seconds", "gauge", _RANK, "seconds",
               "A pipeline's idle time per step (the mean of its stages' bubbles), mean of recent steps.", True,
               _PIPELINED),
    MetricSpec("rebalancer_pipeline_stage_seconds", "gauge", (*_RANK, "stage"), "seconds",
               "A stage's time per micro-batch (forward + backward) in the pipeline this rank is, mean of "
               "recent steps.", True, _PIPELINED),
    MetricSpec("rebalancer_pipeline_bubble_ratio", "gauge", _RANK, "1",
               "The pipeline's bubble: its stages' mean idle time over the schedule's run (0 to 1).", True,
               _PIPELINED),
    MetricSpec("rebalancer_pipeline_bottleneck_stage", "gauge", ("job",), "1",
               "The stage slowest per micro-batch in every pipeline; absent when the pipelines disagree.", True,
               _PIPELINED),
    MetricSpec("rebalancer_pipeline_stage_split_gain_ratio", "gauge", ("job",), "1",
               "The step gain the stage-split advice predicts for a new layer split (0 without advice).", True,
               _PIPELINED),
    # --- per rank: communication (absent where the hook does not measure it) ---------
    MetricSpec("rebalancer_rank_comm_bytes", "gauge", _RANK, "bytes",
               "Bytes the rank hands to gradient collectives per step (DDP: its buckets; FSDP: its reduce-scatters, and FSDP2's parameter all-gathers), mean of recent steps.",
               True),
    MetricSpec("rebalancer_rank_comm_seconds", "gauge", _RANK, "seconds",
               "Time per step with a gradient collective of the rank in flight (overlapped or not).", True),
    MetricSpec("rebalancer_rank_comm_wait_seconds", "gauge", _RANK, "seconds",
               "Of the rank's collective time, the wait for peers: its time less the last arriver's.", True),
    MetricSpec("rebalancer_rank_bus_bandwidth_bytes_per_second", "gauge", _RANK, "bytes_per_second",
               "Bus bandwidth of the rank's gradient collectives (nccl-tests: algbw x 2(n-1)/n for "
               "all-reduce, (n-1)/n for reduce-scatter), over the transfer time.", True),
    MetricSpec("rebalancer_rank_link_bytes_per_second", "gauge", (*_RANK, "link", "direction"),
               "bytes_per_second",
               "Throughput of the rank's node over a link (link: nic, ib, pcie, nvlink; direction: tx, rx), "
               "where the hardware has a counter.", True),
    # --- per rank: its device (NVML); absent for CPU ranks ---------------------------
    MetricSpec("rebalancer_device_utilization_ratio", "gauge", _DEVICE, "1",
               "GPU utilisation, 0 to 1 (NVML).", True),
    MetricSpec("rebalancer_device_memory_used_bytes", "gauge", _DEVICE, "bytes",
               "Device memory in use.", True),
    MetricSpec("rebalancer_device_memory_total_bytes", "gauge", _DEVICE, "bytes",
               "Device memory in all.", True),
    MetricSpec("rebalancer_device_power_watts", "gauge", _DEVICE, "watts",
               "Average power draw since the previous sample (energy counter).", True),
    MetricSpec("rebalancer_device_temperature_celsius", "gauge", _DEVICE, "celsius",
               "GPU temperature.", True),
    MetricSpec("rebalancer_device_sm_clock_hertz", "gauge", _DEVICE, "hertz",
               "SM clock.", True),
    MetricSpec("rebalancer_device_sm_clock_max_hertz", "gauge", _DEVICE, "hertz",
               "Highest SM clock the device allows.", True),
    MetricSpec("rebalancer_device_throttle_reason", "gauge", (*_DEVICE, "reason"), "1",
               "1 for each clock-event (throttle) reason active now, 0 for the others.", True),
    # --- per job -----------------------------------------------------------------------
    MetricSpec("rebalancer_step_seconds", "gauge", ("job",), "seconds",
               "Median wall time of one step over the job's ranks.", True),
    MetricSpec("rebalancer_step_duration_seconds", "histogram", ("job",), "seconds",
               "Wall time of each step as rank 0 measured it (every rank of a synchronous job "
               "sees the same step), buckets STEP_BUCKETS_S.", True),
    MetricSpec("rebalancer_exposed_comm_seconds", "gauge", ("job",), "seconds",
               "Communication per step no compute hid: the last arriver's sync wait (no split changes it).",
               True),
    MetricSpec("rebalancer_bound", "gauge", ("job", "bound"), "1",
               "1 for what bounds the job's step (compute-bound, communication-bound, input-bound, "
               "balanced, unknown), 0 for the others.", True),
    MetricSpec("rebalancer_imbalance_ratio", "gauge", ("job",), "1",
               "Slowest rank's compute time over the mean, minus 1 (0 = balanced).", True),
    MetricSpec("rebalancer_placement_version", "gauge", ("job",), "1",
               "Version of the placement in force.", True),
    MetricSpec("rebalancer_max_compute_seconds", "gauge", ("job",), "seconds",
               "The slowest rank's compute time (over its recent steps), whichever ranks have series.", True),
    MetricSpec("rebalancer_mean_compute_seconds", "gauge", ("job",), "seconds",
               "Mean compute time over the job's ranks.", True),
    MetricSpec("rebalancer_lost_ranks", "gauge", ("job",), "1",
               "Ranks whose hook connection is gone without a close and that have not come back.", True),
    MetricSpec("rebalancer_goodput_ratio", "gauge", ("job",), "1",
               "Useful compute over paid device time: the ranks' mean compute over the job's step (0 to 1).", True),
    MetricSpec("rebalancer_job_hung", "gauge", ("job", "rank"), "1",
               "1 for the rank a hung job waits on (its ranks are connected but stopped stepping; "
               "docs/causes.md: its phase and Python stack are in the job's REST resource), 0 for its other ranks with per-rank series (the hung rank always has them).", True),
    MetricSpec("rebalancer_job_hung_seconds", "gauge", ("job", "rank"), "seconds",
               "Seconds since the hung rank's last step ended; 0 for the ranks the job does not wait on.", True),
    MetricSpec("rebalancer_rank_series_omitted", "gauge", ("job",), "1",
               "Ranks of the job left out of the per-rank series (REBALANCER_METRICS_RANK_SERIES=slowest "
               "keeps the REBALANCER_METRICS_SLOWEST_RANKS slowest, up to REBALANCER_METRICS_GONE_RANKS "
               "ranks that are gone, and every rank of a job of up to REBALANCER_METRICS_ALL_RANKS_UP_TO); "
               "0 with all.",
               True),
    MetricSpec("rebalancer_connected_ranks", "gauge", ("job",), "1",
               "Ranks with an open hook connection.", True),
    MetricSpec("rebalancer_world_size", "gauge", ("job",), "1",
               "Ranks the job has.", True),
    MetricSpec("rebalancer_global_batch_size", "gauge", ("job",), "1",
               "Samples per step over all ranks (fixed for the job).", True),
    MetricSpec("rebalancer_mode", "gauge", ("job", "mode"), "1",
               "1 for the job's mode (observe, approve, auto), 0 for the others.", True),
    MetricSpec("rebalancer_eta_seconds", "gauge", ("job",), "seconds",
               "Time to finish: steps left times the recent step time (needs total_steps from the hook).", True),
    MetricSpec("rebalancer_hourly_cost_dollars", "gauge", ("job",), "dollars",
               "What the job's accelerators cost per hour (REBALANCER_DEVICE_PRICES).", True),
    MetricSpec("rebalancer_cost_to_finish_dollars", "gauge", ("job",), "dollars",
               "Cost of the time left: ETA times the hourly cost.", True),
    MetricSpec("rebalancer_savings_seconds", "gauge", ("job",), "seconds",
               "Training time saved so far against the uniform split (negative when it lost).", True),
    MetricSpec("rebalancer_savings_dollars", "gauge", ("job",), "dollars",
               "The saved time priced at the job's hourly cost.", True),
    MetricSpec("rebalancer_proposals", "gauge", ("job", "status"), "1",
               "Proposals of the job by status (proposed, approved, applied, rejected, ...).", True),
    MetricSpec("rebalancer_proposals_created_total", "counter", ("job", "source"), "1",
               "Proposals made, by source (policy, manual, override); every source from 0.", True),
    MetricSpec("rebalancer_placements_total", "counter", ("job", "source"), "1",
               "Placement versions issued, by source (initial, policy, auto, manual, override, "
               "rollback, cost_model); every source from 0.", True),
    MetricSpec("rebalancer_placement_failures_total", "counter", ("job",), "1",
               "Placements a rank's hook rejected.", True),
    # --- the fleet: every job held in memory (backend.live.fleet, the home page's totals) --
    MetricSpec("rebalancer_fleet_jobs", "gauge", (), "1",
               "Jobs held in memory (the fleet view's rows); with several replicas, the jobs this "
               "replica folds itself, so the sum over replicas counts each job once.", True),
    MetricSpec("rebalancer_fleet_ranks", "gauge", (), "1",
               "Ranks of those jobs in all (their world sizes summed).", True),
    MetricSpec("rebalancer_fleet_running_jobs", "gauge", (), "1",
               "Jobs whose status is not idle.", True),
    MetricSpec("rebalancer_fleet_wasted_gpu_seconds", "gauge", (), "seconds",
               "Accelerator time spent waiting for the slowest rank's compute, summed over ranks and "
               "closed batches of those jobs since the backend took them in (divide by 3600: GPU-hours).", True),
    MetricSpec("rebalancer_fleet_saved_seconds", "gauge", (), "seconds",
               "Training time saved against the uniform split, summed over those jobs.", True),
    MetricSpec("rebalancer_fleet_saved_dollars", "gauge", (), "dollars",
               "The saved time priced at each job's hourly cost, summed over the priced jobs.", True),
    MetricSpec("rebalancer_fleet_pending_proposals", "gauge", (), "1",
               "Proposals waiting for an operator, over all jobs.", True),
    # --- the backend -------------------------------------------------------------------
    MetricSpec("rebalancer_ingest_messages_total", "counter", (), "1",
               "Hook messages ingested.", True),
    MetricSpec("rebalancer_ingest_records_total", "counter", (), "1",
               "Step and device records ingested.", True),
    MetricSpec("rebalancer_ingest_refused_frames_total", "counter", ("frame", "reason"), "1",
               "Hook frames refused at the edge, by kind (node_metrics, metrics, other) and error code "
               "(malformed, too_big, ...); a node frame's rank refused alone counts once.", True),
    MetricSpec("rebalancer_dropped_records_total", "counter", (), "1",
               "Records the hooks reported as dropped.", True),
    MetricSpec("rebalancer_hook_connections", "gauge", (), "1",
               "Open hook websockets.", True),
    MetricSpec("rebalancer_persist_dropped_windows_total", "counter", (), "1",
               "Metric windows never stored: rows the database refused, or the oldest past the "
               "write buffer's bound (REBALANCER_PERSIST_BUFFER_WINDOWS).", True),
    MetricSpec("rebalancer_persist_buffered_windows", "gauge", (), "1",
               "Metric windows waiting in memory for the database.", True),
    MetricSpec("rebalancer_database_writable", "gauge", (), "1",
               "1 while the database takes writes, 0 while /healthz says degraded.", True),
    MetricSpec("rebalancer_live_jobs", "gauge", (), "1",
               "Jobs held in memory (REBALANCER_MAX_LIVE_JOBS at most).", True),
    MetricSpec("rebalancer_forwarded_requests_total", "counter", ("outcome",), "1",
               "Requests about a job another replica controls, sent on to that replica (docs/scale-out.md): "
               "outcome answered (its answer went back) or failed (unreachable, or no answer in time); "
               "0 with one replica.", True),
    MetricSpec("rebalancer_fanout_snapshots_total", "counter", ("outcome",), "1",
               "Dashboard snapshots between replicas: stored (of a job this replica controls, for others), "
               "applied (another owner's, shown here) or refused (failed its check); 0 with one replica.", True),
)


# Per-rank gauges with per-job aggregates ``rebalancer_job_<name without rebalancer_>``.
JOB_STATS_OF: tuple[str, ...] = (
    "rebalancer_rank_compute_seconds", "rebalancer_rank_sync_wait_seconds", "rebalancer_rank_data_wait_seconds",
    "rebalancer_rank_comm_bytes", "rebalancer_rank_comm_seconds", "rebalancer_rank_comm_wait_seconds",
    "rebalancer_rank_bus_bandwidth_bytes_per_second", "rebalancer_rank_link_bytes_per_second",
    "rebalancer_device_utilization_ratio", "rebalancer_device_memory_used_bytes",
    "rebalancer_device_memory_total_bytes", "rebalancer_device_power_watts",
    "rebalancer_device_temperature_celsius", "rebalancer_device_sm_clock_hertz",
    "rebalancer_device_sm_clock_max_hertz",
)


def job_stats_name(per_rank: str) -> str:
    """The per-job aggregate's name of a per-rank gauge."""
    return "rebalancer_job_" + per_rank.removeprefix("rebalancer_")


def _job_stats() -> tuple[MetricSpec, ...]:
    specs = {m.name: m for m in CONTRACT}
    out = []
    for name in JOB_STATS_OF:
        m = specs[name]
        extra = tuple(label for label in m.labels if label not in (*_RANK, *GPU_LABELS))
        out.append(MetricSpec(job_stats_name(name), "gauge", ("job", *extra, "stat"), m.unit,
                              f"{name} over every rank of the job that reports it: stat min, median or max "
                              "(per-rank series cover only some ranks).", True, m.scope))
    out.append(MetricSpec("rebalancer_job_device_throttled_ranks", "gauge", ("job", "reason"), "1",
                          "GPU ranks of the job with each clock-event (throttle) reason active now (every "
                          "reason from 0).", True))
    return tuple(out)


CONTRACT = CONTRACT + _job_stats()


def by_name() -> dict[str, MetricSpec]:
    return {m.name: m for m in CONTRACT}


def exposed_names(spec: MetricSpec) -> tuple[str, ...]:
    """The sample names a scrape shows for ``spec``."""
    if spec.kind == "histogram":
        return (f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count")
    return (spec.name,)


def markdown_table() -> str:
    """The contract as the Markdown table docs/metrics.md carries (a test compares them)."""
    rows = ["| metric | type | labels | unit | meaning | exported |",
            "|---|---|---|---|---|---|"]
    for m in CONTRACT:
        labels = ", ".join(f"`{label}`" for label in m.labels) or "-"
        scope = f" ({m.scope})" if m.scope else ""
        rows.append(f"| `{m.name}` | {m.kind} | {labels} | {m.unit} | {m.help} | "
                    f"{'yes' if m.exported else 'planned'}{scope} |")
    return "\n".join(rows) + "\n"
