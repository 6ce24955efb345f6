"""torchrun target for the what-if test and bench (tests/backend/test_causes_torchrun.py,
``python -m bench.causes``; gloo, CPU).

Three ranks train one small model in phases of ``--phase-steps`` steps each (``--phases``,
in order), writing every step record (``hook.history``, offline) to ``rankN.json``. Each
phase injects one cause for real, and ``clean`` injects none (the cause removed for real):
- ``data_wait``: rank 1's loader sleeps ``--loader-ms`` per batch;
- ``slow_rank``: rank 2 computes twice as long per unit of work;
- ``gc``: rank 1 holds ``--gc-objects`` live lists (what came before frozen) and its garbage
  collector runs a full collection inside every step (a real pause, timed by the hook's ``gc.callbacks``);
- ``sample_cost_skew``: each batch holds one sample of 8 units of work and eleven that
  share 4 (the clean phase's samples are 1 unit each: the same 12 units a batch); the
  loader splits by work (``sample_cost=``), and the long sample cannot be split, so the
  rank holding it computes twice the even share;
- ``communication``: every other step, each rank's gradient all-reduce completes
  ``--comm-ms`` late (a slow link: the transfer's future is held back on gloo's thread).
- ``alloc`` (the GC bench): every rank built ``--setup-objects`` live lists before training
  (a model's and a dataset's Python objects) and each step makes ``--garbage`` cyclic
  objects (rank r a tenth more per rank), so Python's own collections pause ranks at
  different steps; ``--gc-freeze`` and ``--gc-every N`` turn on the hook's GC settings.
Compute is a sleep per unit of work (``--sample-ms``), so a step's parts are known and a
loaded machine's CPU contention moves them little.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from datetime import timedelta
from typing import Any

os.environ["REBALANCER_NATIVE_COMM_HOOK"] = "0"  # the Python comm hook: its all-reduce is slowed below

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from tests.helpers.workers import write_rank_and_exit_group  # noqa: E402
from trainer_hook import RebalanceHook  # noqa: E402

PHASES = ("data_wait", "clean", "slow_rank", "gc", "sample_cost_skew", "communication", "alloc")
GLOBAL_BATCH = 12
LONG_UNITS, SHORT_TOTAL = 8.0, 4.0  # sample_cost_skew: one long sample, eleven sharing 4 units
GRAD_NUMEL = 9  # Linear(8, 1): the one gradient bucket the slowed all-reduce recognises


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, self.x[i]


class SlowLink:
    """Holds back the completion of the gradient all-reduce by ``delay_s`` while ``on``."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.on = False
        self._orig = dist.ProcessGroup.allreduce
        link = self

        def allreduce(pg: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            work = link._orig(pg, tensors, *args, **kwargs)
            if not (link.on and isinstance(tensors, list) and len(tensors) == 1
                    and tensors[0].numel() == GRAD_NUMEL and tensors[0].dtype == torch.float32):
                return work
            return _Held(work, link.delay_s)

        dist.ProcessGroup.allreduce = allreduce  # type: ignore[method-assign]


class _Held:
    def __init__(self, work: Any, delay_s: float) -> None:
        self._work, self._delay_s = work, delay_s

    def get_future(self) -> Any:
        def late(f: Any) -> Any:
            time.sleep(self._delay_s)  # on gloo's completion thread: the transfer ends later
            return f.value()
        return self._work.get_future().then(late)


class _Finalized:
    """A reference cycle whose finalizer takes ``pause_s``: only the collector frees it."""

    def __init__(self, pause_s: float) -> None:
        self.pause_s = pause_s
        self.me = self

    def __del__(self) -> None:
        time.sleep(self.pause_s)


def _garbage(n: int) -> None:
    """``n`` objects in reference cycles: only the collector frees them."""
    for _ in range(n // 2):
        a: list[object] = []
        b: list[object] = [a]
        a.append(b)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--phase-steps", type=int, default=25)
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--loader-ms", type=float, default=40.0)
    p.add_argument("--sample-ms", type=float, default=8.0)
    p.add_argument("--gc-ms", type=float, default=35.0)
    p.add_argument("--comm-ms", type=float, default=60.0)
    p.add_argument("--setup-objects", type=int, default=0)
    p.add_argument("--garbage", type=int, default=20_000)
    p.add_argument("--gc-freeze", action="store_true")
    p.add_argument("--gc-every", type=int, default=0)
    args = p.parse_args()
    phases = args.phases.split(",")
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"unknown phases {sorted(unknown)}; known: {', '.join(PHASES)}")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    link = SlowLink()
    link.delay_s = args.comm_ms / 1e3
    torch.manual_seed(0)
    total = args.phase_steps * len(phases)
    phase_of = {k: phases[k // args.phase_steps] for k in range(total)}
    cost = [1.0] * (GLOBAL_BATCH * total)  # units of work per dataset index (batch k: 12k .. 12k+11)
    for k, ph in phase_of.items():
        if ph == "sample_cost_skew":
            cost[GLOBAL_BATCH * k:GLOBAL_BATCH * (k + 1)] = [LONG_UNITS] + [SHORT_TOTAL / 11] * 11
    setup = [[i] for i in range(args.setup_objects)]  # noqa: F841 - live for the whole run
    hook = RebalanceHook(job="causes", global_batch_size=GLOBAL_BATCH, history=4096,
                         gc_freeze=args.gc_freeze, gc_collect_every=args.gc_every)
    model = DDP(torch.nn.Linear(8, 1))
    hook.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ds = Data(GLOBAL_BATCH * total)
    loader_s = [0.0]

    def collate(items: list[tuple[int, torch.Tensor]]) -> tuple[list[int], torch.Tensor]:
        time.sleep(loader_s[0])  # inside the loader's next(): the hook times it as the loader's
        return [i for i, _ in items], torch.stack([x for _, x in items])

    loader = hook.data_loader(ds, shuffle=False, collate_fn=collate, sample_cost=cost)
    it = iter(loader)
    for k in range(total):
        phase = phase_of[k]
        loader_s[0] = args.loader_ms / 1e3 if phase == "data_wait" and rank == 1 else 0.0
        link.on = phase == "communication" and k % 2 == 1
        idx, x = next(it)  # no workers: batch k is made here, never ahead
        with hook.step():
            per_unit = args.sample_ms * (2.0 if phase == "slow_rank" and rank == 2 else 1.0)
            time.sleep(per_unit * sum(cost[i] for i in idx) / 1e3)
            if phase == "gc" and rank == 1:
                _Finalized(args.gc_ms / 1e3)
                gc.collect(0)  # the young generation holds the new cycle: its finalizer runs inside
            if phase == "alloc":
                _garbage(int(args.garbage * (1.0 + 0.1 * rank)))
            loss = model(x).pow(2).mean() if len(x) else sum(q.sum() for q in model.parameters()) * 0.0
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    hook.close()
    recs = [{**r.to_dict(), "phase": phase_of[r.batch_index]} for r in hook.history]
    write_rank_and_exit_group(args.out, recs)


if __name__ == "__main__":
    main()
