"""Rebalancer's training hook: measures each rank and applies placements in lockstep.

Start with :class:`RebalanceHook`; see its docstring for the training-loop pattern.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer_hook.config import HookConfig
    from trainer_hook.hook import RebalanceHook
    from trainer_hook.microbatch import MicroBatches, StreamEnded
    from trainer_hook.placement import PlacementSchedule, ScheduledPlacement
    from trainer_hook.sampler import RebalanceBatchSampler

# Imported on first use, so that importing the package does not pull in torch: `rebalancer
# run` (backend/run_cmd.py) finds trainer_hook/_site through it where no torch is installed.
_LAZY = {
    "HookConfig": "trainer_hook.config",
    "RebalanceHook": "trainer_hook.hook",
    "PlacementSchedule": "trainer_hook.placement",
    "ScheduledPlacement": "trainer_hook.placement",
    "RebalanceBatchSampler": "trainer_hook.sampler",
    "MicroBatches": "trainer_hook.microbatch",
    "StreamEnded": "trainer_hook.microbatch",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainer_hook' has no attribute {name!r}")

__all__ = [
    "RebalanceHook",
    "HookConfig",
    "PlacementSchedule",
    "ScheduledPlacement",
    "RebalanceBatchSampler",
    "MicroBatches",
    "StreamEnded",
]
