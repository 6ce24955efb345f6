"""A synthetic CPU DDP (or FSDP2) job whose ranks compute at different, injected speeds.

Run under torchrun (one process per rank)::

    torchrun --nproc-per-node 4 -m trainer_hook.demo_worker --server http://127.0.0.1:8000 \\
        --job demo --steps 200 --global-batch-size 64 --speeds 1,1,0.5,0.25 --per-sample-ms 2.0

Each rank's forward sleeps ``fixed_ms + local_batch * per_sample_ms / speed`` (times any
``--slowdown``/``--drift`` factor) to model heterogeneous devices, then runs a tiny MLP
on synthetic data, wrapped in DDP or, with ``--wrap fsdp2``, sharded with ``fully_shard``
(each Linear, then the whole model), or with ``--wrap dp_tp`` run as a DP x TP device mesh
(docs/meshes.md). Without ``--server`` (and no ``REBALANCER_SERVER``) it runs offline.
``--steps 0`` (the default) runs until killed. ``--result PATH``: rank 0 writes a JSON
file with every rank's per-step times and the placement timeline.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from trainer_hook.hook import RebalanceHook

__all__ = ["main", "parse_args", "delay_ms"]


class _Stop(Exception):
    pass


def _speeds(text: str) -> list[float]:
    try:
        speeds = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--speeds expects numbers like 1,1,0.5,0.25, got {text!r}.") from None
    if not speeds or any(not (s > 0) for s in speeds):
        raise argparse.ArgumentTypeError(f"--speeds must be positive numbers like 1,1,0.5,0.25, got {text!r}.")
    return speeds


def _triple(flag: str, example: str) -> Any:
    def parse(text: str) -> tuple[int, int, float]:
        parts = text.split(":")
        try:
            if len(parts) != 3:
                raise ValueError
            rank, step, value = int(parts[0]), int(parts[1]), float(parts[2])
            if rank < 0 or step < 0:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} expects RANK:STEP:VALUE like {example}, got {text!r}.") from None
        return rank, step, value

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer_hook.demo_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default=None, help="backend URL; omitted (and no REBALANCER_SERVER) = offline")
    p.add_argument("--job", default=None, help="job name (default: REBALANCER_JOB or 'demo')")
    p.add_argument("--token", default=None, help="hook token (default: REBALANCER_TOKEN)")
    p.add_argument("--steps", type=int, default=0, help="steps to run; 0 = until killed")
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--speeds", type=_speeds, default=None, help="relative speed per rank, e.g. 1,1,0.5,0.25")
    p.add_argument("--per-sample-ms", type=float, default=2.0)
    p.add_argument("--fixed-ms", type=float, default=1.0)
    p.add_argument("--slowdown", action="append", default=[], type=_triple("--slowdown", "2:100:3.0"),
                   help="RANK:STEP:FACTOR: from STEP on, RANK takes FACTOR times longer (repeatable)")
    p.add_argument("--drift", action="append", default=[], type=_triple("--drift", "1:50:0.5"),
                   help="RANK:START_STEP:PCT_PER_STEP: RANK slows by PCT percent more each step (repeatable)")
    p.add_argument("--wrap", choices=("ddp", "fsdp2", "dp_tp"), default="ddp",
                   help="data parallelism with several ranks: DistributedDataParallel, FSDP2 (fully_shard), or "
                        "a DP x TP mesh of TP groups of 2 ranks (FSDP2 over 'dp', Colwise/Rowwise over 'tp'; "
                        "shares are per replica, a replica as slow as its slowest member)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--result", default=None, help="rank 0 writes a JSON result here")
    p.add_argument("--exchange-every", type=int, default=None, help="HookConfig.exchange_every")
    p.add_argument("--lookahead", type=int, default=None, help="HookConfig.lookahead")
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error(f"--steps must be >= 0, got {args.steps}.")
    if args.per_sample_ms < 0 or args.fixed_ms < 0:
        p.error("--per-sample-ms and --fixed-ms must be >= 0.")
    if args.num_workers < 0:
        p.error(f"--num-workers must be >= 0, got {args.num_workers}.")
    return args


def delay_ms(args: argparse.Namespace, rank: int, step: int, local_batch: int) -> float:
    """The injected compute time of ``rank`` for ``local_batch`` samples at ``step``."""
    speeds = args.speeds or [1.0]
    speed = speeds[rank] if rank < len(speeds) else speeds[-1]
    factor = 1.0
    for r, start, f in args.slowdown:
        if r == rank and step >= start:
            factor *= f
    for r, start, pct in args.drift:
        if r == rank and step >= start:
            factor *= max(0.0, 1.0 + pct / 100.0 * (step - start))
    return (args.fixed_ms + local_batch * args.per_sample_ms / speed) * factor


class _SlowMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.delay_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s > 0:
            time.sleep(self.delay_s)  # the injected device speed
        return self.net(x)  # type: ignore[no-any-return]


def _init_process_group() -> None:
    timeout = timedelta(seconds=60)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # One key prefix per restart attempt in torchrun's store: with plain env:// a
        # restarted worker could read the dead attempt's gloo addresses (torch 2.13).
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"demo_worker/attempt{attempt}", store),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        _init_process_group()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    if args.speeds is not None and len(args.speeds) not in (1, world):
        print(f"--speeds gives {len(args.speeds)} values but the job has {world} ranks; "
              f"give one per rank or a single value.", file=sys.stderr)
        return 2
    stop = {"now": False}

    def on_signal(signum: int, _frame: Any) -> None:
        stop["now"] = True
        raise _Stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    torch.manual_seed(args.seed)
    b = args.global_batch_size
    n = max(8 * b, 512)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(n, 16, generator=gen)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=gen)
    dataset = TensorDataset(x, y)
    extra: dict[str, Any] = {"exchange_every": args.exchange_every} if args.exchange_every else {}
    if args.lookahead is not None:
        extra["lookahead"] = args.lookahead
    if args.steps:
        extra["total_steps"] = args.steps  # the dashboard's ETA
    job = args.job or os.environ.get("REBALANCER_JOB") or "demo"
    mesh: Any = None
    if args.wrap == "dp_tp":
        if not distributed or world % 2:
            print(f"--wrap dp_tp needs an even number of ranks (TP groups of 2), got {world}.", file=sys.stderr)
            return 2
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        extra["dp_mesh"] = mesh["dp"]
        extra["history"] = max(256, args.steps + 8)  # a leader's records arrive combined, late: kept whole
    hook = RebalanceHook(server=args.server, job=job, global_batch_size=b, token=args.token, **extra)
    inner = _SlowMLP()
    model: torch.nn.Module = inner
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        parallelize_module(inner.net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(inner, mesh=mesh["dp"])
    elif distributed and args.wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in inner.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(inner)  # the same object, now an FSDPModule: model and delay_s still apply
    elif distributed:
        model = DDP(inner)
    hook.attach(model)
    sampler = hook.batch_sampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=args.num_workers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    records: list[dict[str, Any]] = []
    started = time.time()
    interrupted = False
    try:
        while not stop["now"] and (args.steps == 0 or hook.batch_index < args.steps):
            for xb, yb in loader:
                with hook.step() as k:
                    inner.delay_s = delay_ms(args, rank, k, sampler.local_size(k)) / 1e3
                    loss = torch.nn.functional.mse_loss(model(xb), yb)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                if hook.last_step is not None and args.result and mesh is None:
                    records.append(asdict(hook.last_step))
                if rank == 0 and k % 100 == 0:
                    print(f"[demo_worker] step {k} shares {hook.shares}", flush=True)
                if stop["now"] or (args.steps and hook.batch_index >= args.steps):
                    break
    except _Stop:
        interrupted = True
    finally:
        hook.close(wait_for_peers=not interrupted)
    if interrupted:
        return 0
    if mesh is not None:  # every step's record, the replica's pace on a leader, once close() combined the last
        records = [asdict(r) for r in hook.history]
    if args.result:
        _write_result(args, hook, records, world, time.time() - started, distributed)
    if distributed:
        dist.barrier()  # nobody tears down gloo pairs while a peer still uses them
        dist.destroy_process_group()
    return 0


def _write_result(args: argparse.Namespace, hook: RebalanceHook, records: list[dict[str, Any]],
                  world: int, wall_s: float, distributed: bool) -> None:
    gathered: list[Any] = [None] * world
    if distributed:
        dist.all_gather_object(gathered, records)
    else:
        gathered = [records]
    if (dist.get_rank() if distributed else 0) != 0:  # with a mesh, hook.rank is the replica's
        return
    result = {
        "world_size": world,
        "global_batch_size": args.global_batch_size,
        "steps": len(records),
        "wall_s": wall_s,
        "step_ms": [r["step_ms"] for r in records],
        "records": gathered,
        "placements": [
            {"version": p.version, "start_batch": p.start_batch, "shares": list(p.shares)}
            for p in hook.schedule.timeline()
        ],
        "acks": hook.acks,
        "rejections": hook.rejections,
    }
    tmp = args.result + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.result)


if __name__ == "__main__":
    sys.exit(main())
