"""Thin adapters that put one RebalanceHook into popular training frameworks.

- :mod:`trainer_hook.integrations.accelerate`: ``prepare_with_rebalancer`` for
  Hugging Face Accelerate.
- :mod:`trainer_hook.integrations.hf_trainer`: ``RebalancingTrainer`` and
  ``RebalanceCallback`` for the transformers Trainer.
- :mod:`trainer_hook.integrations.lightning`: ``RebalanceLightningCallback`` for
  PyTorch Lightning's ``Trainer``.
- :mod:`trainer_hook.integrations.notebook`: ``notebook_launch`` around
  ``accelerate.notebook_launcher``.

Names are imported lazily so that ``import trainer_hook`` never pulls in accelerate or
transformers or lightning; each adapter needs its framework only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "prepare_with_rebalancer",
    "gradient_mode_for",
    "RebalanceCallback",
    "RebalancingTrainer",
    "notebook_launch",
    "RebalanceLightningCallback",
]

_WHERE = {
    "prepare_with_rebalancer": "accelerate",
    "gradient_mode_for": "accelerate",
    "RebalanceCallback": "hf_trainer",
    "RebalancingTrainer": "hf_trainer",
    "notebook_launch": "notebook",
    "RebalanceLightningCallback": "lightning",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_hook.integrations' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainer_hook.integrations.{module}"), name)
