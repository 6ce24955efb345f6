"""The server's JSON answers, typed for readers and mypy: GENERATED from the OpenAPI
document by ``python -m backend.client_types`` (do not edit: change the route's
response model and regenerate). Each type is named as the client calls it.

One module, over 400 lines on purpose: generated, one ``TypedDict`` a REST shape, as
``backend.client`` exports them."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

__all__ = [
    "AuditRecord", "Audits", "Bound", "Cause", "Causes", "CostModel", "Device", "Effect",
    "Fleet", "FleetDevice", "FleetJob", "FleetTotals", "Forecast", "Health", "Job", "Jobs",
    "Memory", "Mesh", "MetricPoint", "MetricsPage", "Overrides", "OverridesSet", "Owner",
    "Pipeline", "PipelineBrief", "PipelinePrediction", "PipelineRow", "Placement",
    "PlacementBrief", "Placements", "PredictionCheck", "Proposal", "Proposals", "Rank",
    "RankMemory", "Ranks", "Replica", "StageCell", "StageSplitAdvice", "Summary", "Token",
    "TokenCreated", "Tokens", "WhoAmI",
]


class AuditRecord(TypedDict):
    """``AuditPublic``."""

    action: str
    actor: str
    address: str
    id: int
    job: str | None
    params: dict[str, Any]
    reason: str
    role: str
    time: float


class Audits(TypedDict):
    """``AuditsPublic``."""

    count: int
    data: list[AuditRecord]


class Bound(TypedDict, total=False):
    """``BoundPublic``: What bounds the job's step, with the figures behind it
    (``backend.policy.comm``)."""

    algbw_gbps: float | None
    busbw_gbps: float | None  # algbw x 2(n-1)/n (all-reduce) or (n-1)/n (reduce-scatter).
    comm_bytes_per_step: float | None
    comm_share: float | None
    compute_ms: float | None  # The slowest rank's compute time.
    compute_share: float | None
    data_wait_ms: float | None  # The longest data wait.
    detail: str
    exposed_comm_ms: float | None  # The last arriver's sync wait: communication no compute hid.
    input_share: float | None
    kind: str | None  # The gradient collective: all_reduce or reduce_scatter.
    n_steps: int  # Steps assessed (the newest every rank reported).
    step_ms: float | None
    transfer_ms: float | None  # The last arriver's time inside the collectives.
    verdict: Literal["compute-bound", "communication-bound", "input-bound", "balanced", "unknown"]


class Cause(TypedDict, total=False):
    """``CausePublic``."""

    cause: str  # One of slow_rank, placement, sample_cost_skew, data_wait, gc, host, checkpoint, communication.
    cost_lost: float | None  # What it has cost so far at the job's hourly price (null without prices).
    detail: str
    gpu_hours_lost: float  # ms_per_step times the steps done times every device of the job, in GPU-hours.
    ms_per_step: float  # Time it costs each step, ms: the replay's step without it subtracted from the replay's step.
    predicted_step_ms_without: float  # The replay's mean step time with the cause removed, ms.
    ranks: list[int]  # The ranks the cause sits on (all ranks for communication).
    remedy: str  # What removes it: a placement, a setting, advice.
    share_of_step: float  # ms_per_step over the replayed step time (0..1).


class Causes(TypedDict, total=False):
    """``CausesPublic``."""

    count: int
    data: list[Cause]
    gc_share: float  # GC pauses of the rank arriving last, as a share of the step.
    hint: str | None  # A one-line hint when GC pauses cost more than 2% of the step.
    replayed_step_ms: float | None  # The replay's with nothing removed (its gap to step_ms is the model's error).
    step_ms: float | None  # Their measured mean step time, ms.
    window_steps: int  # Steps replayed (the newest every rank sent).


class CostModel(TypedDict, total=False):
    """``CostModelPublic``: The job's cost model (``backend.policy.work.job_cost_model``):
    ``samples`` (no cost), ``work (linear)`` (a cost per sample, or lengths as they are) or
    ``fitted a*L+b*L^2`` (lengths, a sample costing ``L + k*L^2``)."""

    detail: str
    length_sq_weight: float  # k of L + k*L^2 as fitted (b/a); 0 unless fitted.
    length_sq_weight_in_force: float  # The k the hooks split by (the placement's).
    model: Literal["samples", "work (linear)", "fitted a*L+b*L^2"]
    r2: float | None  # Median over fitted ranks of the step-time variance the model explains.
    r2_linear: float | None  # The same for the length alone (jobs that give lengths).
    ranks_fitted: int
    ranks_quadratic: int  # Ranks that count for the quadratic term: by a clear margin (slowest step left out) to adopt it, by its F test to keep a fitted k in force.
    split_shift: float | None  # How far the model's k would move a rank's share of a batch's work from the k in force (median relative change over recent steps); a new k is sent past 0.025. Null without lengths.


class Device(TypedDict, total=False):
    """``DeviceSample``: One device reading (about 1 Hz). Fields the source cannot read are
    None."""

    cpu_pct: float | None
    ib_rx_bytes_per_s: float | None
    ib_tx_bytes_per_s: float | None
    mem_total_bytes: int | None
    mem_used_bytes: int | None
    nic_rx_bytes_per_s: float | None
    nic_tx_bytes_per_s: float | None
    nvlink_rx_bytes_per_s: float | None
    nvlink_tx_bytes_per_s: float | None
    pcie_rx_bytes_per_s: float | None
    pcie_tx_bytes_per_s: float | None
    power_w: float | None
    rss_bytes: int | None
    sm_clock_max_mhz: float | None
    sm_clock_mhz: float | None
    source: str
    t: float
    temp_c: float | None
    throttle_reasons: list[str]
    util_pct: float | None


class Effect(TypedDict, total=False):
    """``EffectPublic``."""

    measured_gain: float | None
    predicted_step_ms: float | None
    prediction: PredictionCheck | None  # A pipelined job: the stage model's predicted step per pipeline and for the job, and the measured ones once the placement settled; null otherwise.
    rolled_back: bool
    step_ms_after: float | None
    step_ms_before: float | None


class Fleet(TypedDict):
    """``FleetPublic``."""

    count: int
    data: list[FleetJob]
    totals: FleetTotals


class FleetDevice(TypedDict):
    """``FleetDevice``."""

    count: int
    kind: str  # device name the hooks reported (or its type)


class FleetJob(TypedDict, total=False):
    """``FleetJobPublic``."""

    balanced_step_ms: float | None  # The step with the slowest rank's predicted compute replaced by the oracle split's (the policy's per-rank fit); null until the policy has fitted the job.
    batch_index: int | None
    bound: str | None  # compute, communication or input; null: not known.
    connected_ranks: int
    cost_per_hour: float | None
    devices: list[FleetDevice]
    efficiency: float | None  # balanced_step_ms / step_ms (1: balanced); null: n/a.
    eta_s: float | None
    imbalance: float | None
    job: str
    mode: str | None
    pending_proposal_id: int | None
    pending_proposals: int  # Proposals waiting for an operator (approve on the job page).
    saved_cost: float | None  # saved_s priced at the job's hourly cost.
    saved_s: float | None  # Time saved against the uniform split so far.
    status: str
    status_detail: str
    step_ms: float | None
    wasted_gpu_hours: float  # Rank-hours spent waiting for the slowest rank's compute so far.
    world_size: int


class FleetTotals(TypedDict, total=False):
    """``FleetTotals``."""

    by_status: dict[str, int]
    connected_ranks: int
    efficiency: float | None  # Rank-weighted mean over jobs with a figure.
    jobs: int
    pending_proposals: int
    ranks: int
    running: int  # Jobs whose status is not idle.
    saved_cost: float | None
    saved_s: float
    wasted_gpu_hours: float


class Forecast(TypedDict):
    """``ForecastPublic``: ETA and cost to finish (``backend.live.forecast``: the figures the
    job resource, the fleet and the dashboard show)."""

    batch_index: int | None  # The newest batch the job closed.
    cost_per_hour: float | None  # The ranks' hourly prices summed (settings' prices).
    cost_to_finish: float | None  # eta_seconds priced at cost_per_hour.
    eta_s: float | None  # Deprecated name of eta_seconds (the same value).
    eta_seconds: float | None  # Seconds to finish: remaining_steps x step_ms.
    idle_cost_per_hour: float | None  # cost_per_hour x the job's idle fraction.
    job: str
    remaining_steps: int | None  # Steps left after the newest batch.
    step_ms: float | None  # The recent step time the ETA assumes.
    total_steps: int | None  # Steps in all: the query's, else what the hooks reported.
    unpriced_ranks: int  # Ranks whose device has no price (left out of the cost).


class Health(TypedDict, total=False):
    """``HealthPublic``."""

    buffered_windows: int  # metric windows waiting in memory for the database
    cluster: str  # "off" (one replica), "ok", or "paused: <why>" while Redis is unreachable (control pauses; ingest, dashboards and training go on)
    database: str  # "ok", or why not (one sentence)
    dropped_windows: int  # metric windows dropped since start (refused rows, full buffer)
    hook_connections: int  # ranks with an open hook websocket
    hook_sockets: int  # open hook websockets (a node connection carries the ranks of one node: it counts once)
    jobs: int
    jobs_owned: int  # jobs this replica controls: with several replicas, the jobs whose lease it holds (0 while Redis is down); with one, every live job
    open_mode: bool
    replica_id: str  # this replica's id with several replicas; "" with one
    status: str  # "ok", or "degraded" while the database does not take writes


class Job(TypedDict, total=False):
    """``JobPublic``: A job; keys from the controller's job_control (policy, overrides, ...) are
    merged in."""

    batch_index: int | None
    bound: Bound | None  # What bounds the step (live jobs only).
    connected_ranks: int
    cost_model: CostModel | None  # What a sample costs in the split, and how well that explains the step times.
    cost_per_hour: float | None
    created_at: float | None
    eta_s: float | None  # Deprecated: the job's forecast says it, as eta_seconds (GET /api/v1/jobs/{job}/forecast); the same figure, kept here for existing readers.
    global_batch_size: int
    goodput: float | None  # Useful compute over paid device time, 0..1 (docs/causes.md).
    hung_batch_index: int | None  # The batch it is stuck in (or before).
    hung_nccl_dump: str | None  # On CUDA, where its NCCL flight recorder dump is written when the collective times out.
    hung_phase: str | None  # data_wait, compute, sync_wait, optimizer; unknown: it sent no report.
    hung_rank: int | None  # With status hung: the rank the job waits on (docs/causes.md).
    hung_since: float | None  # Unix time of that rank's last step end.
    hung_stack: str | None  # Its training thread's Python stack, innermost last (at most 16 KiB).
    idle_cost_per_hour: float | None
    idle_fraction: float | None
    imbalance: float | None
    job: str
    last_seen: float | None
    lost_cost_per_hour: float | None  # cost_per_hour * (1 - goodput): what the rest costs an hour.
    mesh: Mesh | None  # A device-mesh job's shape; null for plain data parallel.
    mode: str | None
    owner: Owner | None  # With several replicas: the replica that controls the job (its lease holder); null with one replica, or while no replica holds the job.
    pending_proposal_id: int | None
    pipeline: PipelineBrief | None  # A pipelined job's shape, bottleneck stage, bubble share and slowest pipeline (GET /api/v1/jobs/{job}/pipeline has the grid); null without pipelines.
    placement: PlacementBrief | None
    replicas: list[Replica] | None  # A mesh job's replicas with their members, time and slowest member; null for plain data parallel.
    share_unit: Literal["sample", "micro_batch"]  # What a share counts: samples, or fixed-shape micro-batches (RebalanceHook(micro_batches=M): global_batch_size is M; docs/streaming.md).
    status: str
    status_detail: str
    step_ms: float | None
    step_rate_hz: float | None
    strategy: str | None
    total_steps: int | None  # Steps the run takes in all, as its hooks reported.
    world_size: int


class Jobs(TypedDict):
    """``JobsPublic``."""

    count: int
    data: list[Job]


class Memory(TypedDict):
    """``MemoryPublic``."""

    count: int
    data: list[RankMemory]
    memory_headroom: float


class Mesh(TypedDict):
    """``MeshPublic``: A device-mesh job's shape, as its hooks said it (docs/meshes.md): its
    ranks here are its data-parallel replicas."""

    dims: list[str]  # The mesh's dimension names, e.g. ['dp', 'tp'].
    dp: int  # Data-parallel replicas: the job's world_size.
    label: str  # How people read it, e.g. 'DP 2 x TP 2'.
    replica_size: int  # Ranks per replica (its tensor/context-parallel group).
    shape: list[int]  # One size per name in dims.


class MetricPoint(TypedDict, total=False):
    """``MetricPoint``: Live: one step (n_steps 1). History: the mean over
    batch_index_start..batch_index."""

    batch_index: int  # The step's batch (history: the window's last).
    batch_index_start: int  # The window's first batch (live: batch_index).
    comm_bytes: float | None
    comm_ms: float | None
    compute_ms: float  # Until the rank's gradients were ready, less the wait inside their sync.
    data_wait_ms: float  # Waiting for the DataLoader.
    local_batch_size: float  # Samples (or micro-batches) the rank trained: its share.
    n_steps: int  # Steps in the point: 1 live, the window's in history.
    optimizer_ms: float  # In the optimizer step.
    placement_version: int  # The placement the step ran under.
    rank: int
    step_ms: float  # Wall time of the whole step.
    sync_wait_ms: float  # Waiting inside gradient synchronisation.
    t: float  # Unix time the step (the window) ended.


class MetricsPage(TypedDict):
    """``MetricsPublic``."""

    count: int
    data: list[MetricPoint]
    source: Literal["live", "history"]


class Overrides(TypedDict, total=False):
    """``OverridesIn`` without reason."""

    caps: dict[str, int]  # rank -> most samples
    drains: list[int]  # ranks that get no samples
    floors: dict[str, int]  # rank -> fewest samples
    granularity: int  # shares are multiples of this (one rank may carry the remainder)
    pins: dict[str, int]  # rank -> exact share


class OverridesSet(Overrides, total=False):
    """``OverridesIn`` without reason, with proposal_id."""

    proposal_id: int | None


class Owner(TypedDict, total=False):
    """``OwnerPublic``: The backend replica that controls a job (docs/scale-out.md): its id and
    the URL it advertises to hooks (REBALANCER_ADVERTISE_URL; "" when it advertises none)."""

    replica_id: str
    url: str


class PipelineBrief(TypedDict, total=False):
    """``PipelineBrief``: A pipelined job's shape and what bounds it (the job view's
    ``pipeline``)."""

    advice_gain: float | None  # The stage-split advice's predicted step gain; null without advice.
    advice_note: str  # What the advice says, or why there is none.
    bottleneck_stage: int | None  # The stage slowest per micro-batch in every measured pipeline; null when they differ.
    bubble_ms: float | None  # Mean over pipelines of their idle time a step (each the mean of its stages').
    bubble_share: float | None  # Mean over pipelines of the stages' idle share of the run, 0..1.
    label: str  # How people read it, e.g. 'PP 4, 1f1b'.
    layers_per_stage: list[int]  # Layers per model stage, as the hooks said.
    min_microbatches: int  # The fewest micro-batches a pipeline may run (0: it may be drained).
    n_stages: int  # Model stages over a pipeline (pp_size x stages per rank).
    pipelines: int  # Data-parallel pipelines: the job's world_size; shares count micro-batches per pipeline.
    pp_size: int  # Pipeline ranks (stages on ranks) per pipeline.
    pp_stage: int  # The stage of the rank that speaks for each pipeline (its leader's).
    schedule: str  # gpipe, 1f1b or interleaved1f1b.
    slowest_pipeline: int | None  # The pipeline (dp index) with the longest measured schedule run.
    stages_per_rank: int
    tp_size: int


class Pipeline(PipelineBrief, total=False):
    """``PipelinePublic``: The brief, the grid (one row per pipeline, one cell per stage), the
    advice and the placement in force's prediction check."""

    advice: StageSplitAdvice | None
    prediction: PredictionCheck | None  # The placement in force's stage-model prediction and, once it settled, the measured step beside it; null before any placement was made with stage times.
    rows: list[PipelineRow]


class PipelinePrediction(TypedDict):
    """``PipelinePredictionPublic``: One pipeline's line of a prediction check: its schedule run
    at the placement's count."""

    error: float | None  # measured_ms / predicted_ms - 1.
    measured_ms: float | None  # The measured run at that count over the effect window; null until measured.
    n_microbatches: int  # Its micro-batches under the placement.
    pipeline: int  # The dp index.
    predicted_ms: float | None  # The stage model's run (a + c*m); null: no stage times when predicted.


class PipelineRow(TypedDict, total=False):
    """``PipelineRowPublic``."""

    bottleneck_stage: int | None
    bubble_share: float | None  # Measured: the stages' mean idle time over the run.
    compute_ms: float | None  # The schedule's run, measured.
    model_bubble_share: float | None  # The model's at this count ((p-1)/(m+p-1) for equal stages).
    model_ms: float | None  # The model's run at this count: sum(t) + (m-1) max(t); interleaved, v stages per rank: sum(t)/v + (m - 1/v) max(t) (docs/pipelines.md).
    n_microbatches: int | None
    pipeline: int  # The dp index: the pipeline's rank in placements.
    stages: list[StageCell]  # Empty until it sends stage times.


class Placement(TypedDict):
    """``PlacementPublic``."""

    acks: dict[str, int]
    actor: str
    applied_at: float | None
    created_at: float
    effect: Effect
    effective_batch_index: int | None
    error: str | None
    failed: bool
    previous_shares: list[int] | None
    proposal_id: int | None
    reason: str
    shares: list[int]
    source: str
    version: int


class PlacementBrief(TypedDict):
    """``PlacementBrief``."""

    shares: list[int]
    version: int


class Placements(TypedDict):
    """``PlacementsPublic``."""

    count: int
    data: list[Placement]


class PredictionCheck(TypedDict):
    """``PredictionCheckPublic``: A pipelined job's placement: the stage model's predicted step,
    made when the placement was, and the step measured once it settled
    (``backend.policy.pipeline_check``)."""

    error: float | None  # measured_step_ms / predicted_step_ms - 1.
    measured_step_ms: float | None  # The mean step over the effect window after the settle steps; null until measured.
    missed: bool  # The step or a pipeline's run missed by more than the tolerance (audited as placement.prediction_missed).
    note: str  # What the check found, and what the policy does about a miss.
    pipelines: list[PipelinePrediction]
    predicted_step_ms: float | None  # The slowest pipeline's predicted run plus rest_ms.
    rest_ms: float  # What a step holds beyond the slowest pipeline's run (data wait, optimizer, exposed communication), measured when predicted.
    tolerance: float  # A miss beyond it (relative) is flagged.


class Proposal(TypedDict):
    """``ProposalPublic``."""

    base_version: int
    created_at: float
    created_by: str
    current_shares: list[int]
    decided_at: float | None
    decided_by: str | None
    decision_reason: str | None
    error: str | None
    expires_at: float | None
    explanation: dict[str, Any] | None
    id: int
    job: str
    placement_version: int | None
    predicted_gain: float | None
    predicted_step_ms_after: float | None
    predicted_step_ms_before: float | None
    reason: str
    shares: list[int]
    source: str
    status: str
    strategy: str


class Proposals(TypedDict):
    """``ProposalsPublic``."""

    count: int
    data: list[Proposal]


class Rank(TypedDict, total=False):
    """``RankPublic``."""

    batch_index: int | None
    bottleneck_stage: int | None  # Its stage slowest per micro-batch.
    bubble_ms: float | None  # The pipeline's idle time a step (mean of its stages').
    busbw_gbps: float | None  # Bus bandwidth, GB/s (nccl-tests definition).
    ckpt_ms: float | None  # Of data_wait_ms, checkpoint writes.
    comm_bytes_per_step: float | None  # Bytes handed to gradient collectives a step.
    comm_ms: float | None  # Time a step with a gradient collective in flight.
    compute_ms: float | None
    connected: bool
    data_wait_ms: float | None
    device: Device | None  # The newest reading of its device (live only).
    device_name: str
    device_type: str
    dropped: int
    gc_ms: float | None  # Python GC pauses a step (within the other times).
    hook_version: str
    host: str
    host_ms: float | None  # Of data_wait_ms, the loop's own host work (docs/causes.md).
    last_seen: float | None
    local_batch_size: float | None
    n_steps: int
    optimizer_ms: float | None
    placement_version: int | None
    pp_size: int | None  # Stages of this pipeline; null without pipelines.
    pp_stage: int | None  # The pipeline stage of the rank that speaks for this row.
    price_per_hour: float | None
    rank: int
    share: int | None
    step_ms: float | None
    step_rate_hz: float | None
    sync_wait_ms: float | None
    wait_ms: float | None  # Of comm_ms, the wait for peers (the rest is transfer).
    work_per_s: float | None
    work_share: float | None


class RankMemory(TypedDict, total=False):
    """``RankMemoryPublic``."""

    batch_sizes: int
    cap: int | None  # most samples the policy gives this rank
    fixed_bytes: float | None  # m0 of the fit
    last_peak_bytes: int | None
    limit_bytes: float | None  # (1 - memory_headroom) * total
    method: str | None  # linear (two or more batch sizes) | proportional (one) | flat (micro-batch shares: the peak does not grow with the count)
    per_sample_bytes: float | None  # m of the fit
    predicted_peak_bytes: float | None  # at the share in force
    rank: int
    readings: int
    share: int | None
    source: str  # what the hook reads memory with: cuda, rocm, xpu; empty: none (no cap)
    status: str  # fitted | measuring (may only lose work) | unmeasured (no cap)
    total_bytes: int | None


class Ranks(TypedDict):
    """``RanksPublic``."""

    count: int
    data: list[Rank]


class Replica(TypedDict, total=False):
    """``ReplicaPublic``: One data-parallel replica of a mesh job (its row here;
    docs/meshes.md)."""

    compute_ms: float | None  # The replica's compute time: its slowest member's (live only).
    connected: bool
    member_devices: list[str]  # Each member's host and device, in the order of members (live only; empty when unknown).
    members: list[int]  # The global ranks of its members (its TP/CP group), leader first.
    replica: int  # The replica index: its rank in this job's placements and overrides.
    slowest_rank: int | None  # The member slowest in most of the newest steps (a global rank; live only).
    step_ms: float | None


class StageCell(TypedDict):
    """``StageCellPublic``: One cell of the grid: a stage of a pipeline, means over its newest
    steps."""

    bubble_ms: float  # Per step: the stage's idle time.
    bwd_ms: float
    fwd_ms: float
    recv_wait_ms: float  # Per step.
    send_wait_ms: float  # Per step.
    stage: int
    stage_ms: float  # fwd_ms + bwd_ms: the stage's time per micro-batch.


class StageSplitAdvice(TypedDict, total=False):
    """``StageSplitAdvicePublic``."""

    bottleneck_stage: int
    current_layers_per_stage: list[int]
    gain: float  # (before - after) / before.
    layers_per_stage: list[int]  # The proposed layer count of each stage.
    module_names_per_stage: list[list[str]]  # torchtitan's module names per stage, when the hooks named the layers.
    source: str  # layer_ms (measured per layer) or stage_ms (a stage's time spread over its layers).
    stage_ms_after: list[float]
    stage_ms_before: list[float]
    step_ms_after: float
    step_ms_before: float


class Summary(TypedDict, total=False):
    """``SummaryPublic``: A run's summary: savings against the uniform split and its latest
    figures. Live while the job is in memory, else the stored one (it survives a restart)."""

    batch_index: int | None
    cost_per_hour: float | None
    imbalance: float | None
    job: str
    measured_s: float  # Wall time of the closed batches, seconds.
    placement_version: int | None
    saved_cost: float | None  # saved_s priced at the job's hourly cost.
    saved_s: float  # uniform_s - measured_s.
    step_ms: float | None
    total_steps: int | None
    uniform_s: float  # What those batches would have taken under the uniform split.
    updated_at: float


class Token(TypedDict):
    """``TokenPublic``."""

    created_at: float
    created_by: str
    hint: str
    id: int
    job: str | None
    name: str
    revoked_at: float | None
    role: str


class TokenCreated(Token):
    """``TokenCreated``."""

    secret: str


class Tokens(TypedDict):
    """``TokensPublic``."""

    count: int
    data: list[Token]


class WhoAmI(TypedDict):
    """``WhoAmIPublic``."""

    name: str  # The token's name (the audit log's actor).
    open_mode: bool  # True while the server is on loopback with no active token: every caller is admin.
    operator: bool  # Whether the role may take operator actions (approve, mode, ...).
    role: str  # viewer, operator, admin or hook.
