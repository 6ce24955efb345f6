"""The rebalancing policy: pure functions from observations to proposals.

No I/O, no torch, no FastAPI. The controller calls :func:`decide`; overrides are checked
with :func:`solve` / :func:`check_placement`; benchmarks and tests drive
:class:`JobSimulator`.
"""

from . import types
from .bounds import NO_CONSTRAINTS, check_placement, rank_bounds
from .costfit import CostModel, cost_model_moved
from .devices import (
    DEVICE_TABLE,
    SLOWDOWN_REASONS,
    WORKLOAD_PROFILES,
    DeviceSpec,
    device_weights,
    normalize_device,
)
from .engine import decide, limit_moves, memory_caps, with_caps
from .memory import (
    DEFAULT_HEADROOM,
    MemoryFit,
    MemoryReading,
    RankMemory,
    fit_memory,
    memory_bounds,
    memory_cap,
    memory_violations,
)
from .simulator import SCENARIOS, JobSimulator, SimRank, SimResult
from .solver import predicted_step_ms, solve
from .stability import gain_over, replaces_pending
from .strategies import (
    Estimate,
    Strategy,
    available_strategies,
    get_strategy,
    register_strategy,
    static_shares,
)
from .types import *  # noqa: F403  (observations, config, proposals: types.__all__)

__all__ = [
    "CostModel",
    "cost_model_moved",
    "DEFAULT_HEADROOM",
    "DEVICE_TABLE",
    "MemoryFit",
    "MemoryReading",
    "RankMemory",
    "fit_memory",
    "memory_bounds",
    "memory_cap",
    "memory_violations",
    "NO_CONSTRAINTS",
    "SCENARIOS",
    "SLOWDOWN_REASONS",
    "WORKLOAD_PROFILES",
    "DeviceSpec",
    "Estimate",
    "JobSimulator",
    "SimRank",
    "SimResult",
    "Strategy",
    "available_strategies",
    "check_placement",
    "decide",
    "device_weights",
    "gain_over",
    "get_strategy",
    "limit_moves",
    "memory_caps",
    "normalize_device",
    "predicted_step_ms",
    "rank_bounds",
    "register_strategy",
    "replaces_pending",
    "solve",
    "static_shares",
    "with_caps",
    *types.__all__,
]
