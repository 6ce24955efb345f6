"""GPU step overhead: one training step on a CUDA device with and without RebalanceHook.

One process, a one-rank process group (NCCL on CUDA), DDP over an MLP whose step keeps the
device busy for a few milliseconds. Baseline and hooked blocks of ``--steps`` steps
alternate (``--rounds`` pairs); each block is timed between two device synchronisations.
Reported: the step time of each (median over blocks), the overhead ratio, and the
training-thread time of ``hook.step()``'s enter and exit (median, microseconds), the
hot-path budget (<= 50 us). Without CUDA (``--device cpu``, the rehearsal) the same loop
runs on the CPU over gloo: the figures then say nothing about a GPU.

    python -m bench.gpu_step [--device cuda|cpu] [--steps 100] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bench._report import RESULTS_DIR, write_json
from trainer_hook import RebalanceHook

__all__ = ["main", "run"]


def _model(width: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # a CPU-GPU sync point: the block's ends only


def _block(device: torch.device, model: torch.nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor,
           steps: int, hook: RebalanceHook | None, enter_exit_s: list[float]) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        if hook is None:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            continue
        ctx = hook.step()
        a = time.perf_counter()
        ctx.__enter__()
        b = time.perf_counter()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        c = time.perf_counter()
        ctx.__exit__(None, None, None)
        enter_exit_s.append(b - a + time.perf_counter() - c)
    _sync(device)
    return (time.perf_counter() - t0) / steps


def run(device_name: str, steps: int, rounds: int, width: int, batch: int) -> dict[str, Any]:
    for var in ("REBALANCER_SERVER", "REBALANCER_JOB", "REBALANCER_TOKEN"):
        os.environ.pop(var, None)
    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(batch, width, generator=gen).to(device)
        y = torch.randn(batch, 1, generator=gen).to(device)
        ids = [device.index] if device.type == "cuda" else None
        base = DDP(_model(width, device), device_ids=ids)
        base_opt = torch.optim.SGD(base.parameters(), lr=1e-4)
        hook = RebalanceHook(global_batch_size=batch)
        hooked = hook.attach(DDP(_model(width, device), device_ids=ids))
        hooked_opt = torch.optim.SGD(hooked.parameters(), lr=1e-4)
        enter_exit: list[float] = []
        _block(device, base, base_opt, x, y, 10, None, [])  # warm-up both
        _block(device, hooked, hooked_opt, x, y, 10, hook, [])
        base_s, hooked_s = [], []
        for _ in range(rounds):
            base_s.append(_block(device, base, base_opt, x, y, steps, None, []))
            hooked_s.append(_block(device, hooked, hooked_opt, x, y, steps, hook, enter_exit))
        last = hook.last_step
        hook.close()
    finally:
        dist.destroy_process_group()
    b, h = statistics.median(base_s), statistics.median(hooked_s)
    return {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (rehearsal: no GPU figures)",
        "torch": torch.__version__, "steps": steps, "rounds": rounds, "width": width, "batch": batch,
        "baseline_step_ms": b * 1e3, "hooked_step_ms": h * 1e3, "overhead_pct": (h / b - 1) * 100,
        "step_enter_exit_us_median": statistics.median(enter_exit) * 1e6 if enter_exit else None,
        "gradients": hook.gradients,
        "last_record": None if last is None else {
            "compute_ms": last.compute_ms, "sync_wait_ms": last.sync_wait_ms,
            "optimizer_ms": last.optimizer_ms, "step_ms": last.step_ms},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu" / "gpu_step.json")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False; use --device cpu for the rehearsal.")
    for name in ("steps", "rounds", "width", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}.")
    result = run(args.device, args.steps, args.rounds, args.width, args.batch)
    write_json(args.out, {"benchmark": "gpu_step", **result})
    print(f"gpu_step on {result['device']}: baseline {result['baseline_step_ms']:.3f} ms, hooked "
          f"{result['hooked_step_ms']:.3f} ms ({result['overhead_pct']:+.2f}%), step() enter+exit "
          f"{result['step_enter_exit_us_median']:.1f} us -> {args.out}")


if __name__ == "__main__":
    main()
