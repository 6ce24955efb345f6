"""Several configurations in one torchrun job: a job's start (the launcher and every rank
import torch, then the gloo rendezvous: 4-10 s on a loaded 2-core machine) costs more than
a short test run, so a test file that runs a worker in several configurations shares one
job between them. Each configuration still gets a fresh model and hook, its own output
folder and its own test (the file's module fixture reads ``cfgN``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["worker_main", "read_ranks", "run_configs"]


def worker_main(p: argparse.ArgumentParser, train: Callable[[argparse.Namespace, str], None],
                argv: Sequence[str] | None = None) -> None:
    """A worker's ``main``: ``p`` must take ``--out``; ``--configs '[[args...], ...]'`` (added
    here) runs ``train(args, out/cfgN)`` for each argument list, with the others' arguments as
    given, one after the other in one process group; without it ``train(args, out)`` once."""
    p.add_argument("--configs", default="", help="a JSON list of argument lists, run one after the other")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if not args.configs:
        train(args, args.out)
    else:
        cut = argv.index("--configs")
        base = argv[:cut] + argv[cut + 2:]
        for i, extra in enumerate(json.loads(args.configs)):
            out = os.path.join(args.out, f"cfg{i}")
            os.makedirs(out, exist_ok=True)
            print(f"rank {dist.get_rank()}: configuration {i}: {' '.join(extra)}", flush=True)
            train(p.parse_args([*base, *extra]), out)
    dist.barrier()  # nobody tears down gloo pairs while a peer still uses them
    dist.destroy_process_group()


def read_ranks(out: Path, nproc: int) -> list[dict[str, Any]]:
    """Every rank's ``rankN.json`` in ``out``."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def run_configs(nproc: int, target: Sequence[str], out: Path, configs: list[list[str]], *,
                timeout: float) -> list[list[dict[str, Any]]]:
    """One torchrun job of ``target`` (with ``--out out``) for every configuration: each one's ranks' results."""
    from tests.helpers.torchrun import run_torchrun

    run_torchrun(nproc, [*target, "--out", str(out), "--configs", json.dumps(configs)], timeout=timeout)
    return [read_ranks(out / f"cfg{i}", nproc) for i in range(len(configs))]
