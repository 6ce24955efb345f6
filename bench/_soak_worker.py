"""torchrun target of the soak: one small hooked CPU job per launch path.

Usage: ``python -m bench._soak_worker --mode MODE [options]`` under torchrun, gloo on
loopback. ``REBALANCER_SERVER`` (if set) is the backend; unset runs offline.

Modes: ``ddp`` (native DDP), ``accum`` (DDP with gradient accumulation under
``no_sync``), ``accelerate``, ``hf`` (the HF Trainer), ``fsdp2`` (``fully_shard`` with
the loss-scaling path), ``elastic`` (rank 1 dies on the first attempt; torchrun restarts
every rank). ``--end`` picks how the script ends: ``close`` (close, then
``destroy_process_group``), ``close-after-destroy``, ``no-close`` (the interpreter's
exit closes the hook), ``exception`` (every rank raises from the loop at the same step:
the run must end with the user's error, exit code 1), ``interrupt`` (KeyboardInterrupt
from the loop). At exit the worker prints ``SOAK-THREADS-LEFT`` if any thread other than
the main thread is still alive: the harness counts that as an abnormal end.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

MODES = ("ddp", "accum", "accelerate", "hf", "fsdp2", "elastic")
ENDS = ("close", "close-after-destroy", "no-close", "exception", "interrupt")
GLOBAL_BATCH = 16


class SoakUserError(RuntimeError):
    """The error a user's loop raises in ``--end exception``."""


class Data(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x[:, :1] * 0.5 + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Net(torch.nn.Module):
    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def _report_threads() -> None:
    """Registered before the hook exists, so it runs after the hook's own exit handler."""
    left = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    # torch's own pools are C++ threads, invisible here; Python threads left are ours or a user's.
    if left:
        names = ", ".join(sorted(f"{t.name}{'(daemon)' if t.daemon else ''}" for t in left))
        print(f"SOAK-THREADS-LEFT rank {os.environ.get('RANK')}: {names}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench._soak_worker")
    p.add_argument("--mode", choices=MODES, default="ddp")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--mp-context", choices=("fork", "forkserver", "spawn"), default=None)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--end", choices=ENDS, default="close")
    p.add_argument("--fail-at", type=int, default=10, help="step of --end exception/interrupt")
    p.add_argument("--kill-backend-at", type=int, default=None,
                   help="rank 0 SIGKILLs the backend (pid in REBALANCER_SOAK_BACKEND_PID) at this step")
    p.add_argument("--delay-ms", type=float, default=2.0, help="injected compute per step")
    args = p.parse_args(argv)
    if args.steps < 1 or args.accum < 1 or args.num_workers < 0:
        p.error("--steps and --accum must be >= 1, --num-workers >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    atexit.register(_report_threads)
    if args.mode == "hf":
        return _hf(args)
    if args.mode == "accelerate":
        return _accelerate(args)
    dist.init_process_group("gloo")
    from trainer_hook import RebalanceHook

    lookahead = 2 + 2 * args.num_workers
    hook = RebalanceHook(global_batch_size=GLOBAL_BATCH, exchange_every=4, exchange_lag=1, lookahead=lookahead,
                         total_steps=args.steps)
    inner = Net(args.delay_ms / 1e3)
    model: torch.nn.Module
    if args.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(inner)  # type: ignore[assignment]
        hook.attach(model, gradients="loss_scale")
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(inner)
        hook.attach(model)
    data = Data()
    loader = DataLoader(data, batch_sampler=hook.batch_sampler(data, shuffle=True, seed=1),
                        num_workers=args.num_workers, multiprocessing_context=args.mp_context)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    micro = args.accum if args.mode == "accum" else 1
    while hook.batch_index < args.steps:
        for batch in loader:
            with hook.step() as k:
                _maybe_fail(args, hook, k, attempt)
                if hook.rank == 0 and k == 6:
                    hook.request_placement([10, 6] if hook.world_size == 2 else _skewed(hook.world_size))
                x, y = batch["x"], batch["labels"]
                chunks = list(zip(x.chunk(micro), y.chunk(micro), strict=True)) if len(x) >= micro else [(x, y)]
                for i, (xc, yc) in enumerate(chunks):
                    last = i == len(chunks) - 1
                    ctx: Any = model.no_sync() if (not last and hasattr(model, "no_sync")) else _null()
                    with ctx:
                        loss = model(xc, yc)["loss"] * (len(xc) / len(x)) * hook.loss_weight()
                        loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if hook.batch_index >= args.steps:
                break
    return _end(args, hook)


def _skewed(world: int) -> list[int]:
    shares = [GLOBAL_BATCH // world] * world
    shares[0] += GLOBAL_BATCH - sum(shares)
    shares[0] += 1
    shares[-1] -= 1
    return shares


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _maybe_fail(args: argparse.Namespace, hook: Any, k: int, attempt: int) -> None:
    if args.kill_backend_at is not None and k == args.kill_backend_at and hook.rank == 0 and attempt == 0:
        pid = int(os.environ["REBALANCER_SOAK_BACKEND_PID"])
        os.kill(pid, signal.SIGKILL)
        print(f"[soak] rank 0 killed the backend (pid {pid}) at step {k}", flush=True)
    if args.mode == "elastic" and attempt == 0 and hook.rank == 1 and k == args.fail_at:
        os._exit(17)  # a hard crash: no clean-up, like a killed worker
    if k == args.fail_at and args.end == "exception":
        raise SoakUserError(f"the user's loop failed at step {k}")
    if k == args.fail_at and args.end == "interrupt":
        raise KeyboardInterrupt


def _end(args: argparse.Namespace, hook: Any) -> int:
    if args.end == "close":
        hook.close()
        dist.destroy_process_group()
    elif args.end == "close-after-destroy":
        dist.destroy_process_group()
        hook.close()
    else:  # no-close: the interpreter's exit closes the hook and the process group stays
        pass
    if hook.rank == 0:
        print(f"[soak] done: {hook.batch_index} steps, placement v{hook.placement_version} {hook.shares}", flush=True)
    return 0


def _accelerate(args: argparse.Namespace) -> int:
    from accelerate import Accelerator

    from trainer_hook import RebalanceHook
    from trainer_hook.integrations.accelerate import prepare_with_rebalancer

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accum)
    hook = RebalanceHook(global_batch_size=GLOBAL_BATCH, exchange_every=4, exchange_lag=1,
                         lookahead=2 + 2 * args.num_workers, total_steps=args.steps)
    model = Net(args.delay_ms / 1e3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = prepare_with_rebalancer(accelerator, hook, model, opt, Data(), shuffle=True, seed=1,
                                                 num_workers=args.num_workers)
    attempt = 0
    while hook.batch_index < args.steps:
        for batch in loader:
            with hook.step() as k, accelerator.accumulate(model):
                _maybe_fail(args, hook, k, attempt)
                if hook.rank == 0 and k == 6:
                    hook.request_placement([10, 6])
                out = model(batch["x"], batch["labels"])
                accelerator.backward(out["loss"] * hook.loss_weight())
                opt.step()
                opt.zero_grad()
            if hook.batch_index >= args.steps:
                break
    return _end(args, hook)


def _hf(args: argparse.Namespace) -> int:
    import tempfile

    from transformers import TrainingArguments

    from trainer_hook import RebalanceHook
    from trainer_hook.integrations.hf_trainer import RebalancingTrainer

    dist.init_process_group("gloo")
    hook = RebalanceHook(global_batch_size=GLOBAL_BATCH, exchange_every=4, exchange_lag=1,
                         lookahead=1 + args.accum + 2 * args.num_workers)
    model = Net(args.delay_ms / 1e3)
    with tempfile.TemporaryDirectory(prefix="soak-hf-") as out:
        targs = TrainingArguments(
            output_dir=out, use_cpu=True, max_steps=args.steps, gradient_accumulation_steps=args.accum,
            report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_pin_memory=False, dataloader_num_workers=args.num_workers,
            ddp_find_unused_parameters=False, seed=3, data_seed=7,
        )
        trainer = RebalancingTrainer(rebalance_hook=hook, model=model, args=targs, train_dataset=Data(),
                                     data_collator=_collate)
        trainer.train()
    return _end(args, hook)


def _collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


if __name__ == "__main__":
    sys.exit(main())
