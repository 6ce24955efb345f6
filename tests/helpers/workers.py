"""What the torchrun worker scripts of the tests and benchmarks share: the placement plan
they read from the command line, the process group of a restartable (TorchElastic) job,
and the ``rankN.json`` each rank leaves for its test (``configs.read_ranks`` reads them)."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["parse_plan", "init_attempt_group", "write_rank_and_exit_group"]


def parse_plan(text: str) -> dict[int, list[int]]:
    """``"STEP=S0,S1;STEP=..."``: the shares rank 0 requests at each batch index."""
    plan: dict[int, list[int]] = {}
    for item in filter(None, text.split(";")):
        step, shares = item.split("=")
        plan[int(step)] = [int(s) for s in shares.split(",")]
    return plan


def init_attempt_group(prefix: str) -> int:
    """The gloo group of this TorchElastic attempt; this rank.

    Each attempt gets its own key prefix in torchrun's store: with the plain env:// init, a
    restarted worker sometimes read the dead attempt's gloo addresses (torch 2.13,
    "connectFullMesh failed ... Connection refused")."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{prefix}/attempt{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=60))
    return dist.get_rank()


def write_rank_and_exit_group(out: str, result: Any) -> None:
    """Write this rank's ``out/rankN.json``, wait for the others, leave the process group."""
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # nobody tears down gloo pairs while a peer still uses them
    dist.destroy_process_group()
