"""torchrun target for the TorchElastic restart test: native DDP + RebalanceHook + backend.

Attempt 0 trains (slowly) until the placement the operator approved has been in force
for a few steps, then rank 1 crashes. Attempt 1 (after torchrun restarts every worker)
records the placement its hook applied at its first batch and trains a few steps.

Usage (env REBALANCER_SERVER, REBALANCER_JOB, REBALANCER_TOKEN set):
python -m tests.integrations._elastic_job OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from tests.integrations._common import GLOBAL_BATCH, IndexedData, TinyNet, make_optimizer
from trainer_hook import RebalanceHook

CRASH_AFTER = 3  # steps trained under a non-uniform placement before rank 1 crashes
MAX_STEPS = 3000  # a guard: attempt 0 waits at most this long for the operator
AFTER_RESTART = 6


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    # startup_wait_s: a ceiling, not a delay; generous because the test machine is shared.
    hook = RebalanceHook(
        global_batch_size=GLOBAL_BATCH, exchange_every=2, exchange_lag=1, lookahead=2, startup_wait_s=10.0
    )
    model = DDP(TinyNet())
    hook.attach(model)
    optimizer = make_optimizer(model)
    data = IndexedData()
    loader = DataLoader(data, batch_sampler=hook.batch_sampler(data, shuffle=True, seed=7))
    trained: list[dict] = []
    under_new = 0
    while True:
        for batch in loader:
            with hook.step() as k:
                loss = model(batch["x"], batch["labels"])["loss"]
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            trained.append({"k": k, "version": hook.placement_version, "shares": hook.shares,
                            "local": len(batch["labels"])})
            if attempt == 0:
                under_new += hook.placement_version > 0
                if under_new >= CRASH_AFTER and hook.rank == 1:
                    (out / "crash.json").write_text(json.dumps({"acks": hook.acks, "trained": trained}))
                    os._exit(17)  # a hard crash: no clean-up, like a killed worker
                if len(trained) >= MAX_STEPS:
                    raise SystemExit("the approved placement never arrived")
                time.sleep(0.02)  # leave time for the operator's REST calls
            elif len(trained) >= AFTER_RESTART:
                break
        else:
            continue
        break
    result = {"attempt": attempt, "trained": trained, "acks": hook.acks, "rejections": hook.rejections}
    (out / f"rank{hook.rank}.attempt{attempt}.json").write_text(json.dumps(result))
    hook.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
