"""The server's JSON answers, typed for readers and mypy (``TypedDict``s named like the
server's response models; tests keep their keys equal to the OpenAPI schema)."""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = [
    "PlacementBrief", "Job", "Bound", "Mesh", "Replica", "CostModel", "Rank", "Device", "MetricPoint",
    "MetricsPage", "Forecast", "Summary", "RankMemory", "Memory", "Cause", "Causes", "Proposal", "Placement", "Effect",
    "Overrides", "OverridesSet", "AuditRecord", "Token", "TokenCreated", "Health", "WhoAmI",
]


class PlacementBrief(TypedDict):
    version: int
    shares: list[int]


class Bound(TypedDict, total=False):
    """What bounds a job's step, with its figures (``GET /api/v1/jobs/{job}``'s ``bound``)."""

    verdict: str  # compute-bound | communication-bound | input-bound | balanced | unknown
    detail: str
    n_steps: int
    kind: str | None
    step_ms: float | None
    compute_ms: float | None
    exposed_comm_ms: float | None
    data_wait_ms: float | None
    compute_share: float | None
    comm_share: float | None
    input_share: float | None
    comm_bytes_per_step: float | None
    transfer_ms: float | None
    algbw_gbps: float | None
    busbw_gbps: float | None


class Mesh(TypedDict):
    """A device-mesh job's shape (``GET /api/v1/jobs/{job}``'s ``mesh``): its ranks are replicas."""

    dp: int
    replica_size: int
    dims: list[str]
    shape: list[int]
    label: str  # e.g. "DP 2 x TP 2"


class Replica(TypedDict):
    """One data-parallel replica of a mesh job (``GET /api/v1/jobs/{job}``'s ``replicas``)."""

    replica: int  # its index: its rank in placements and overrides
    members: list[int]  # its global ranks, leader first
    member_devices: list[str]  # each member's host and device, in that order (live only)
    connected: bool
    compute_ms: float | None  # its slowest member's (live only)
    step_ms: float | None
    slowest_rank: int | None  # the member slowest in most of the newest steps (live only)


class CostModel(TypedDict, total=False):
    """What a sample costs in the split (``GET /api/v1/jobs/{job}``'s ``cost_model``)."""

    model: str  # samples | work (linear) | fitted a*L+b*L^2
    length_sq_weight: float
    length_sq_weight_in_force: float
    r2: float | None
    r2_linear: float | None
    ranks_fitted: int
    ranks_quadratic: int
    split_shift: float | None
    detail: str


class Job(TypedDict, total=False):
    job: str
    world_size: int
    global_batch_size: int
    mode: str | None
    strategy: str | None
    status: str  # warming_up | balanced | imbalanced | proposal_pending | idle | degraded | hung | ended
    status_detail: str
    goodput: float | None  # useful compute / paid device time (docs/causes.md)
    lost_cost_per_hour: float | None
    hung_rank: int | None  # with status hung (docs/causes.md)
    hung_since: float | None
    hung_batch_index: int | None
    hung_phase: str | None
    hung_stack: str | None
    batch_index: int | None
    step_rate_hz: float | None
    step_ms: float | None
    imbalance: float | None
    idle_fraction: float | None
    placement: PlacementBrief | None
    pending_proposal_id: int | None
    connected_ranks: int
    created_at: float | None
    last_seen: float | None
    total_steps: int | None
    eta_s: float | None
    cost_per_hour: float | None
    idle_cost_per_hour: float | None
    bound: Bound | None
    mesh: Mesh | None
    replicas: list[Replica] | None
    cost_model: CostModel | None
    share_unit: str  # "sample", or "micro_batch": shares count fixed-shape micro-batches


class Device(TypedDict, total=False):
    t: float | None
    source: str | None
    util_pct: float | None
    mem_used_bytes: int | None
    mem_total_bytes: int | None
    power_w: float | None
    temp_c: float | None
    sm_clock_mhz: float | None
    sm_clock_max_mhz: float | None
    throttle_reasons: list[str]
    cpu_pct: float | None
    rss_bytes: int | None
    nic_tx_bytes_per_s: float | None
    nic_rx_bytes_per_s: float | None
    ib_tx_bytes_per_s: float | None
    ib_rx_bytes_per_s: float | None
    pcie_tx_bytes_per_s: float | None
    pcie_rx_bytes_per_s: float | None
    nvlink_tx_bytes_per_s: float | None
    nvlink_rx_bytes_per_s: float | None


class Rank(TypedDict, total=False):
    rank: int
    host: str
    device_type: str
    device_name: str
    connected: bool
    share: int | None
    batch_index: int | None
    placement_version: int | None
    compute_ms: float | None
    sync_wait_ms: float | None
    data_wait_ms: float | None
    optimizer_ms: float | None
    step_ms: float | None
    step_rate_hz: float | None
    local_batch_size: float | None
    n_steps: int
    device: Device | None
    dropped: int
    last_seen: float | None
    price_per_hour: float | None
    hook_version: str
    work_per_s: float | None
    work_share: float | None
    comm_bytes_per_step: float | None
    comm_ms: float | None
    wait_ms: float | None
    busbw_gbps: float | None
    host_ms: float | None  # parts of the step (docs/causes.md)
    ckpt_ms: float | None
    gc_ms: float | None


class MetricPoint(TypedDict):
    rank: int
    batch_index: int
    batch_index_start: int
    n_steps: int
    t: float
    placement_version: int
    local_batch_size: float
    compute_ms: float
    sync_wait_ms: float
    data_wait_ms: float
    optimizer_ms: float
    step_ms: float
    comm_bytes: float | None  # history: mean per step over the window (None: no counters)
    comm_ms: float | None


class MetricsPage(TypedDict):
    data: list[MetricPoint]
    count: int
    source: str  # live | history


class Forecast(TypedDict):
    job: str
    batch_index: int | None
    total_steps: int | None
    remaining_steps: int | None
    step_ms: float | None
    eta_s: float | None
    cost_per_hour: float | None
    unpriced_ranks: int
    cost_to_finish: float | None


class Summary(TypedDict):
    job: str
    batch_index: int | None
    total_steps: int | None
    measured_s: float  # wall time of the closed batches
    uniform_s: float  # what they would have taken under the uniform split
    saved_s: float
    saved_cost: float | None
    cost_per_hour: float | None
    step_ms: float | None
    imbalance: float | None
    placement_version: int | None
    updated_at: float


class RankMemory(TypedDict):
    rank: int
    source: str  # cuda | rocm | xpu; empty: not measured (no cap)
    status: str  # fitted | measuring | unmeasured
    share: int | None
    readings: int
    last_peak_bytes: int | None
    total_bytes: int | None
    fixed_bytes: float | None  # m0 of the fit peak = m0 + m * local_batch
    per_sample_bytes: float | None  # m
    method: str | None
    batch_sizes: int
    predicted_peak_bytes: float | None
    limit_bytes: float | None
    cap: int | None


class Memory(TypedDict):
    data: list[RankMemory]
    count: int
    memory_headroom: float


class Cause(TypedDict):
    cause: str  # slow_rank | placement | sample_cost_skew | data_wait | gc | host | checkpoint | communication
    ranks: list[int]
    ms_per_step: float
    share_of_step: float
    gpu_hours_lost: float
    predicted_step_ms_without: float
    remedy: str
    detail: str
    cost_lost: float | None


class Causes(TypedDict):
    data: list[Cause]  # largest first
    count: int
    window_steps: int
    step_ms: float | None
    replayed_step_ms: float | None
    gc_share: float
    hint: str | None


class Proposal(TypedDict):
    id: int
    job: str
    status: str  # proposed | approved | applied | rejected | superseded | failed | expired
    source: str
    strategy: str
    base_version: int
    shares: list[int]
    current_shares: list[int]
    predicted_step_ms_before: float | None
    predicted_step_ms_after: float | None
    predicted_gain: float | None
    explanation: dict[str, Any] | None
    reason: str
    created_by: str
    created_at: float
    expires_at: float | None
    decided_by: str | None
    decided_at: float | None
    decision_reason: str | None
    placement_version: int | None
    error: str | None


class Effect(TypedDict):
    step_ms_before: float | None
    step_ms_after: float | None
    predicted_step_ms: float | None
    measured_gain: float | None
    rolled_back: bool


class Placement(TypedDict):
    version: int
    shares: list[int]
    previous_shares: list[int] | None
    source: str
    proposal_id: int | None
    actor: str
    reason: str
    created_at: float
    effective_batch_index: int | None
    acks: dict[str, int]  # rank (a JSON key, so a string) -> batch index
    applied_at: float | None
    failed: bool
    error: str | None
    effect: Effect


class Overrides(TypedDict, total=False):
    pins: dict[str, int]
    caps: dict[str, int]
    floors: dict[str, int]
    drains: list[int]
    granularity: int


class OverridesSet(Overrides, total=False):
    proposal_id: int | None  # a proposal that respects them, when the placement in force does not


class AuditRecord(TypedDict):
    id: int
    time: float
    actor: str
    role: str
    address: str
    action: str
    job: str | None
    params: dict[str, Any]
    reason: str


class Token(TypedDict):
    id: int
    name: str
    role: str
    job: str | None
    hint: str
    created_at: float
    created_by: str
    revoked_at: float | None


class TokenCreated(Token):
    secret: str  # shown once


class Health(TypedDict):
    status: str
    database: str
    open_mode: bool
    jobs: int
    hook_connections: int  # ranks with an open hook websocket
    hook_sockets: int  # open hook websockets (a node connection counts once)
    buffered_windows: int
    dropped_windows: int
    cluster: str  # "off" (one replica), "ok", or "paused: <why>"


class WhoAmI(TypedDict):
    name: str
    role: str
    operator: bool
    open_mode: bool
