"""Data the policy takes and returns. Pure values: no I/O, no torch, no FastAPI."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Literal

from ._values import Compact
from .comm import Communication
from .costfit import CostModel
from .memory import DEFAULT_HEADROOM, RankMemory

__all__ = [
    "StepSample",
    "DeviceSignals",
    "RankObservation",
    "PipelineTimes",
    "PipelineObservation",
    "JobObservation",
    "ObservationRows",
    "Rollback",
    "Constraints",
    "PolicyConfig",
    "RankExplanation",
    "Explanation",
    "Proposal",
    "NoProposal",
    "Decision",
    "InfeasibleError",
]


@dataclass(frozen=True, slots=True)
class StepSample(Compact):
    """One measured step of one rank: ``compute_ms`` for ``local_batch_size`` samples.

    With a per-sample cost, ``work`` is the rank's summed cost in the step and
    ``batch_work`` the global batch's (None without one); ``decide`` then reads
    ``local_batch_size`` in work units (``backend.policy.work``). With sample lengths,
    ``work`` sums the lengths and ``work_sq`` / ``batch_work_sq`` their squares."""

    batch_index: int
    local_batch_size: float
    compute_ms: float
    work: float | None = None
    batch_work: float | None = None
    work_sq: float | None = None
    batch_work_sq: float | None = None


@dataclass(frozen=True, slots=True)
class DeviceSignals(Compact):
    """Latest device reading of one rank (None where the probe cannot read it)."""

    t: float
    util_pct: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    temp_c: float | None = None
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    power_w: float | None = None
    throttle_reasons: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RankObservation(Compact):
    rank: int
    device_type: str | None = None  # key into the device table, e.g. "H100", "A100-80GB", "CPU"
    mem_total_bytes: int | None = None
    # Recent valid steps (with work), oldest first: the controller keeps the last
    # ``window_steps`` steps in which the rank had samples, so a rank idle at share 0 keeps
    # its last measured cost.
    steps: tuple[StepSample, ...] = ()
    # Device history, oldest first (about 1 Hz), for the predictive strategy.
    device: tuple[DeviceSignals, ...] = ()
    # Peak-memory fit and what the rank measures it with (backend.policy.memory).
    memory: RankMemory = RankMemory()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Steps and device samples travel as plain tuples (pickled in C) and become objects
        # again in the policy process: 80 objects a rank, 80,000 at 1,024 ranks.
        return _rank_observation, (self.rank, self.device_type, self.mem_total_bytes,
                                   tuple(map(_STEP_FIELDS, self.steps)),
                                   tuple(map(_DEVICE_FIELDS, self.device)), self.memory)


_STEP_FIELDS = attrgetter(*StepSample.__slots__)
_DEVICE_FIELDS = attrgetter(*DeviceSignals.__slots__)


def _rank_observation(rank: int, device_type: str | None, mem_total_bytes: int | None,
                      steps: tuple[tuple[Any, ...], ...], device: tuple[tuple[Any, ...], ...],
                      memory: RankMemory) -> RankObservation:
    return RankObservation(rank, device_type, mem_total_bytes,
                           tuple(StepSample(*s) for s in steps), tuple(DeviceSignals(*d) for d in device),
                           memory)


@dataclass(frozen=True, slots=True)
class Rollback(Compact):
    """A placement that was rolled back because the measured step time got worse.

    ``shares_after`` is the placement that was undone, ``shares_before`` the one restored;
    ``batch_index`` the step at which the rollback was decided. The policy does not move a
    rank again the way this change moved it until the rank's measured cost has changed.
    """

    batch_index: int
    shares_before: tuple[int, ...]
    shares_after: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PipelineTimes(Compact):
    """One pipeline's recent measurements: means over its newest steps at the micro-batch
    count in force (per pipeline rank, in stage order)."""

    dp_index: int
    n_steps: int
    n_microbatches: int
    fwd_ms: tuple[float, ...]  # per micro-batch
    bwd_ms: tuple[float, ...]  # per micro-batch
    send_wait_ms: tuple[float, ...]  # per step
    recv_wait_ms: tuple[float, ...]  # per step
    bubble_ms: tuple[float, ...]  # per step: each stage's idle time
    compute_ms: float  # the schedule's run, measured (the record's compute_ms)
    step_ms: float
    rel_noise: float = 0.0  # relative standard error of the bottleneck stage's time
    layer_ms: tuple[float, ...] = ()  # the newest per-layer times (fwd + bwd per micro-batch)

    @property
    def stage_ms(self) -> tuple[float, ...]:
        return tuple(f + b for f, b in zip(self.fwd_ms, self.bwd_ms, strict=True))


@dataclass(frozen=True, slots=True)
class PipelineObservation(Compact):
    """A pipelined job as the policy reads it: its shape and each pipeline's times (None for
    a pipeline without stage times yet), by dp index."""

    schedule: str
    pp_size: int
    stages_per_rank: int
    tp_size: int
    min_microbatches: int
    pipelines: tuple[PipelineTimes | None, ...]
    layers_per_stage: tuple[int, ...] = ()  # per model stage (n_stages = pp_size * stages_per_rank)
    layer_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class JobObservation(Compact):
    job: str
    world_size: int
    global_batch_size: int
    batch_index: int  # latest batch index seen
    shares: tuple[int, ...]  # placement in force
    placement_version: int
    steps_since_change: int  # batch indices since the placement in force took effect
    ranks: tuple[RankObservation, ...]
    # Recent automatic rollbacks, oldest first (the controller keeps a few).
    rollbacks: tuple[Rollback, ...] = ()
    # The job's communication (``backend.policy.comm.assess``): its exposed part is added
    # to every predicted step, since no split changes it. None: unknown, priced as 0.
    comm: Communication | None = None
    # k of ``L + k*L^2`` in force: the hooks split each batch's work by it, so shares are
    # read in its units (0: lengths as they are, or no lengths).
    length_sq_weight: float = 0.0
    # A pipelined job (PP x DP): its shape and stage times; its ranks here are pipelines and
    # the ``pipeline`` strategy splits micro-batches over them (backend.policy.pipeline).
    pipeline: PipelineObservation | None = None


@dataclass(frozen=True, slots=True)
class ObservationRows(Compact):
    """A ``JobObservation`` still in rows: what the backend copies out of its live state on
    its own side, cheaply; ``build()`` makes the objects where the policy runs (its own
    process at scale), so their cost is not paid against the backend's event loop.

    Each entry of ``ranks`` is ``(rank, device_type, mem_total_bytes, step rows, device
    rows, memory)``; a step row is ``StepSample``'s fields in order, a device row
    ``DeviceSignals``'s.
    """

    job: str
    world_size: int
    global_batch_size: int
    batch_index: int
    shares: tuple[int, ...]
    placement_version: int
    steps_since_change: int
    ranks: tuple[tuple[Any, ...], ...]
    rollbacks: tuple[Rollback, ...] = ()
    comm: Communication | None = None
    length_sq_weight: float = 0.0
    pipeline: PipelineObservation | None = None

    def build(self) -> JobObservation:
        return JobObservation(
            job=self.job, world_size=self.world_size, global_batch_size=self.global_batch_size,
            batch_index=self.batch_index, shares=self.shares, placement_version=self.placement_version,
            steps_since_change=self.steps_since_change,
            ranks=tuple(_rank_observation(*r) for r in self.ranks), rollbacks=self.rollbacks,
            comm=self.comm, length_sq_weight=self.length_sq_weight, pipeline=self.pipeline)


@dataclass(frozen=True, slots=True)
class Constraints(Compact):
    """Operator overrides and derived limits. Ranks absent from a map are unconstrained."""

    pins: dict[int, int] = field(default_factory=dict)  # rank -> exact share
    caps: dict[int, int] = field(default_factory=dict)  # rank -> max share
    floors: dict[int, int] = field(default_factory=dict)  # rank -> min share
    drains: frozenset[int] = frozenset()  # ranks with share 0
    granularity: int = 1  # every share a multiple of this (pins and drains excepted)


@dataclass(frozen=True, slots=True)
class PolicyConfig(Compact):
    strategy: str = "profiled"  # a registered strategy name
    workload: str = "llm"  # "llm" | "vision" | "diffusion" | "recsys" | "custom"
    custom_weights: dict[str, float] | None = None  # device type -> weight, for "custom"
    min_gain: float = 0.05  # propose only when predicted step time improves by this fraction
    cooldown_steps: int = 20  # after each applied change
    min_steps: int = 10  # valid steps per rank before profiled/predictive propose
    window_steps: int = 100  # most recent steps used for a fit
    max_move_fraction: float | None = None  # auto mode: cap |new-old|/B per rank per change
    # predictive: how far past the job's batch index to forecast; a placement lives about a
    # cooldown plus the steps it takes to apply, and one aimed at the end of that stays ahead
    # of a drift.
    horizon_steps: int = 30
    params: dict[str, float] = field(default_factory=dict)  # strategy-specific extras
    memory_headroom: float = DEFAULT_HEADROOM  # memory caps keep this fraction free


@dataclass(frozen=True, slots=True)
class RankExplanation(Compact):
    rank: int
    share_before: int
    share_after: int
    compute_ms_before: float  # predicted
    compute_ms_after: float  # predicted
    a_ms: float  # fitted fixed cost
    c_ms: float  # fitted per-sample cost
    fit_r2: float | None = None
    n_steps: int = 0
    rel_error: float | None = None  # relative standard error of c_ms (None: not measured)
    # Predicted peak device memory (None where the rank has no memory fit), the memory
    # cap in samples and the bytes it may use.
    mem_peak_before_bytes: float | None = None
    mem_peak_after_bytes: float | None = None
    mem_cap: int | None = None
    mem_limit_bytes: float | None = None


@dataclass(frozen=True, slots=True)
class Explanation(Compact):
    strategy: str
    # Predicted step: the slowest rank's compute plus the exposed communication (which no
    # split changes; ``evidence["communication"]`` has its figures), with the shares in
    # force and after.
    step_ms_before: float
    step_ms_after: float
    gain: float  # (before - after) / before
    ranks: tuple[RankExplanation, ...]
    evidence: dict[str, object] = field(default_factory=dict)  # steps used, fit quality, signals


@dataclass(frozen=True, slots=True)
class Proposal(Compact):
    shares: tuple[int, ...]
    reason: str  # one sentence for humans
    explanation: Explanation
    cost_model: CostModel | None = None  # the job's (``work.job_cost_model``)


@dataclass(frozen=True, slots=True)
class NoProposal(Compact):
    status: Literal[
        "warming_up", "balanced", "cooldown", "insufficient_gain", "no_data", "infeasible"
    ]
    detail: str  # e.g. "warming up: 7 more steps needed on rank 2"
    steps_remaining: int = 0
    explanation: Explanation | None = None
    cost_model: CostModel | None = None  # the job's (``work.job_cost_model``)


Decision = Proposal | NoProposal


class InfeasibleError(ValueError):
    """The constraints admit no placement; the message names the constraint that breaks."""
