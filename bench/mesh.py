"""Balancing a device-mesh job (issue 24, docs/meshes.md): only the data-parallel dimension
takes uneven shares, and a replica is as slow as its slowest member.

One real 4-rank torchrun/gloo CPU job per strategy (``trainer_hook.demo_worker --wrap
dp_tp``): DP 2 x TP 2, FSDP2 over "dp" and Colwise/Rowwise over "tp", the hook given
``dp_mesh=mesh["dp"]``. One member of replica 1 (global rank 3) computes at half speed, so
that replica is 2x slower while its leader (rank 2) is not. Strategies as in
``bench.balance``: uniform (observe), profiled and predictive (auto, from no knowledge) and
the oracle (the best split over replicas for the true speeds, applied by hand). Reported:
steady step time (median of the last 30% of steps), efficiency = oracle / achieved (target
>= 0.95: within 5% of the oracle split over replicas) and the final shares.

    python -m bench.mesh [--tiny] [--steps N]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench._backend import stop_on_sigterm
from bench._report import RESULTS_DIR
from bench.balance import run_balance

__all__ = ["SCENARIO", "run_mesh", "main"]

# Per global rank; replicas are ranks (0, 1) and (2, 3): replica 1 runs at rank 3's speed.
SCENARIO = {"replica 1 at 0.5 (rank 3)": (1.0, 1.0, 1.0, 0.5)}
STRATEGIES = ("uniform", "profiled", "predictive", "oracle")


def run_mesh(*, steps: int = 150, strategies: tuple[str, ...] = STRATEGIES, out_dir: Path = RESULTS_DIR,
             name: str = "mesh") -> dict[str, Any]:
    """Every strategy on the DP 2 x TP 2 job; writes ``<name>.json``."""
    return run_balance(SCENARIO, steps=steps, strategies=strategies, out_dir=out_dir, name=name,
                       plot=False, global_batch_size=64, per_sample_ms=2.0, fixed_ms=2.0, wrap="dp_tp")


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="smoke-test size: uniform and oracle, 20 steps")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    steps, strategies = 150, STRATEGIES
    if args.tiny:
        steps, strategies = 20, ("uniform", "oracle")
    run_mesh(steps=args.steps or steps, strategies=strategies, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
