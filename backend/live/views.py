"""What live state hands its readers: immutable-by-contract snapshots of a job and its ranks.

Owns no state: ``LiveState.view`` builds them under its lock (backend/live/state.py) and
readers (REST, dashboard, controller, exporter) share them.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.live.hangs import HungRank
from backend.policy.memory import RankMemory
from rebalancer_wire.protocol import DeviceSample, MeshShape

__all__ = ["RankView", "JobView", "eta_seconds"]


@dataclass(slots=True)
class RankView:
    """A snapshot of one rank with its derived numbers (None until it has sent a step).

    Read-only by contract (views are cached and shared between readers); not ``frozen``
    because a frozen dataclass's ``__init__`` sets each of its 26 fields through
    ``object.__setattr__``: 4x the cost, paid ~4,000 times a second at 2,048 ranks."""

    rank: int
    host: str
    device_type: str
    device_name: str
    mem_total_bytes: int | None
    connected: bool
    first_seen: float
    last_seen: float
    batch_index: int | None
    placement_version: int | None
    local_batch_size: int | None
    compute_ms: float | None
    sync_wait_ms: float | None
    data_wait_ms: float | None
    optimizer_ms: float | None
    step_ms: float | None
    step_rate_hz: float | None
    n_steps: int
    dropped: int
    device: DeviceSample | None
    lost: bool = False  # its socket dropped without a close and it has not come back
    # Peak device memory: how the rank measures it, the fit of its readings and the
    # newest reading (None where the rank sends none).
    memory: RankMemory | None = None
    mem_peak_bytes: int | None = None
    gpu_index: int | None = None
    gpu_uuid: str = ""
    # With a per-sample cost (tokens, say): work per second of compute over the recent
    # steps, and the mean fraction of each global batch's work the rank trained.
    work_per_s: float | None = None
    work_share: float | None = None
    # A mesh job (its ranks here are replicas): the replica's global ranks, and the member
    # slowest in most of its newest steps (None until its leader names one).
    members: tuple[int, ...] = ()
    member_devices: tuple[str, ...] = ()  # each member's host and device, as its hello said
    slowest_rank: int | None = None
    # The window's mean host work, checkpoint writes and GC pauses per step (parts of the
    # times above; docs/causes.md); None where the rank's hook sends no phases.
    host_ms: float | None = None
    ckpt_ms: float | None = None
    gc_ms: float | None = None


@dataclass(frozen=True, slots=True)
class JobView:
    job: str
    world_size: int
    global_batch_size: int
    created_at: float
    last_seen: float
    connected_ranks: int
    batch_index: int | None
    step_ms: float | None
    step_rate_hz: float | None
    imbalance: float | None
    idle_fraction: float | None
    ranks: tuple[RankView, ...]
    total_steps: int | None = None
    lost_ranks: tuple[int, ...] = ()  # ranks whose socket dropped without a close
    mesh: MeshShape | None = None  # a mesh job's shape: its ranks here are replicas
    ended: bool = False  # every rank said goodbye since its hello: the run ended (``LiveState.ended``)
    hung: HungRank | None = None  # the rank a stalled job waits on (backend.live.hangs)
    micro_batches: bool = False  # shares and local batch sizes count micro-batches

    @property
    def share_unit(self) -> str:
        """What a share counts: ``"micro_batch"`` or ``"sample"`` (the job view says it)."""
        return "micro_batch" if self.micro_batches else "sample"

    @property
    def eta_s(self) -> float | None:
        """Seconds to finish: steps left times the recent step time (None if unknown)."""
        return eta_seconds(self.total_steps, self.batch_index, self.step_ms)


def eta_seconds(total_steps: int | None, batch_index: int | None, step_ms: float | None) -> float | None:
    """Steps left after ``batch_index`` (0-based, trained) times ``step_ms``, in seconds."""
    if total_steps is None or not step_ms:
        return None
    done = batch_index + 1 if batch_index is not None else 0
    return max(total_steps - done, 0) * step_ms / 1000.0
