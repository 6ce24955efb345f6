"""A training job whose samples are given by length (issue 23, item 2): one process, or
one per rank under torchrun (gloo; rank 0's exchange carries the placements).

A step's compute takes ``1 + a * sum(L) + b * sum(L^2)`` ms over the rank's samples (``--a-ms``
is a, ``--b-ms`` b; 0 models a cost linear in length), so the backend sees lengths that explain
the step times with or without the quadratic term. The hook times the step on a clock that
moves by exactly that cost (times a seeded 1% jitter, the same every run), while the worker
sleeps it in real time for the pace: a loaded machine's late wake-ups, which made the fit's
outcome differ from run to run, never reach the step times (the policy's handling of that
noise is tested by replaying it, tests/backend/policy/test_costfit.py). The hook streams
to ``--server`` as job ``--job``; ``--result`` (``.RANK`` appended) gets the placements
the rank scheduled.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from datetime import timedelta

import torch.distributed as dist

from trainer_hook import RebalanceHook
from trainer_hook.timing import StepTimer

N_SAMPLES = 512
JITTER = 0.01  # relative, Gaussian


class StepClock:
    """Seconds that move only when told to: the hook's step timer reads it."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def length(i: int) -> int:
    """Chat turns (20-200 tokens) and every fifth sample a long document (1,000-3,000)."""
    return 1000 + (i * 389) % 2000 if i % 5 == 0 else 20 + (i * 37) % 180


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--a-ms", type=float, required=True)
    p.add_argument("--b-ms", type=float, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--result", required=True)
    args = p.parse_args()
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    lengths = [length(i) for i in range(N_SAMPLES)]
    hook = RebalanceHook(server=args.server, job=args.job, global_batch_size=8)
    clock, rng = StepClock(), random.Random(int(os.environ.get("RANK", "0")))
    hook._c.loop._timer = StepTimer(clock=clock)  # the step's cost exactly, not what a sleep took
    sampler = hook.batch_sampler(N_SAMPLES, shuffle=True, seed=3, sample_length=lengths)
    while hook.batch_index < args.steps:
        for indices in sampler:
            lens = [lengths[i] for i in indices]
            cost_s = (1.0 + args.a_ms * sum(lens) + args.b_ms * sum(v * v for v in lens)) / 1000.0
            with hook.step():
                clock.t += cost_s * (1.0 + rng.gauss(0.0, JITTER))
                time.sleep(cost_s)
            if hook.batch_index >= args.steps:
                break
    timeline = [{"version": e.version, "start_batch": e.start_batch, "length_sq_weight": e.length_sq_weight}
                for e in hook.schedule.timeline()]
    hook.close()
    with open(f"{args.result}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump({"timeline": timeline}, f)


if __name__ == "__main__":
    main()
