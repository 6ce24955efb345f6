"""Rebalancer's training hook: measures each rank and applies placements in lockstep.

Start with :class:`RebalanceHook`; see its docstring for the training-loop pattern.
"""

from trainer_hook.config import HookConfig
from trainer_hook.hook import RebalanceHook
from trainer_hook.placement import PlacementSchedule, ScheduledPlacement
from trainer_hook.sampler import RebalanceBatchSampler

__all__ = [
    "RebalanceHook",
    "HookConfig",
    "PlacementSchedule",
    "ScheduledPlacement",
    "RebalanceBatchSampler",
]
