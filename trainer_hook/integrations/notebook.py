"""Run a rebalanced training function from a notebook with ``accelerate.notebook_launcher``.

``notebook_launcher`` forks one process per device from the notebook kernel; each runs
the training function, which creates its ``Accelerator`` and ``RebalanceHook`` there
(never in the kernel: Accelerate refuses to fork after its state exists).
``notebook_launch`` adds what the hook needs on top: the backend address and job name in
every process's environment, a free rendezvous port, and CPU mode when the machine has
no GPU (otherwise every forked process would quietly train alone).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from rebalancer_wire.ports import free_port

__all__ = ["notebook_launch"]


@contextlib.contextmanager
def _patched_env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def notebook_launch(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int = 2,
    *,
    server: str | None = None,
    job: str | None = None,
    token: str | None = None,
    use_port: int | str | None = None,
    cpu: bool | None = None,
    **launcher_kwargs: Any,
) -> None:
    """``accelerate.notebook_launcher(function, args, num_processes)`` for the rebalancer.

    ``server``, ``job`` and ``token`` are passed to every process as
    ``REBALANCER_SERVER``, ``REBALANCER_JOB`` and ``REBALANCER_TOKEN`` (where given), so
    ``RebalanceHook(global_batch_size=...)`` inside ``function`` finds the backend.
    ``use_port`` defaults to a free port; ``cpu`` defaults to True when CUDA is absent
    (sets ``ACCELERATE_USE_CPU`` so ``Accelerator()`` joins the gloo group). Other
    keyword arguments (``mixed_precision``, ``max_restarts``, ...) go to
    ``notebook_launcher``. Example, in a notebook cell::

        def train(steps):
            accelerator = Accelerator()
            hook = RebalanceHook(global_batch_size=64)
            model, optimizer, loader = prepare_with_rebalancer(
                accelerator, hook, build_model(), build_optimizer(), dataset)
            ...                               # the loop from prepare_with_rebalancer
            hook.close()

        notebook_launch(train, args=(200,), num_processes=2,
                        server="http://127.0.0.1:8000", job="notebook-run")
    """
    import torch
    from accelerate import notebook_launcher
    from accelerate.state import AcceleratorState

    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an integer >= 1, got {num_processes!r}.")
    if not callable(function):
        raise ValueError(f"function must be callable (the training function), got {type(function).__name__}.")
    if num_processes > 1 and len(AcceleratorState._shared_state) > 0:
        raise RuntimeError(
            "An Accelerator already exists in this kernel, so notebook_launcher cannot fork "
            "training processes. Restart the kernel and create the Accelerator and the "
            "RebalanceHook only inside the training function."
        )
    env: dict[str, str] = {}
    for key, value in (("REBALANCER_SERVER", server), ("REBALANCER_JOB", job), ("REBALANCER_TOKEN", token)):
        if value is not None:
            env[key] = value
    if cpu is None:
        cpu = not torch.cuda.is_available()
    if cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    port = str(use_port) if use_port is not None else str(free_port())
    with _patched_env(env):
        notebook_launcher(function, args=args, num_processes=num_processes, use_port=port, **launcher_kwargs)
