"""The one line a hook says at start (rank 0): where it reports and as which job, with the
job's dashboard, or that it is offline and why."""

from __future__ import annotations

import logging
import sys
from urllib.parse import quote

from trainer_hook.config import ENV_SERVER, HookConfig

__all__ = ["say_start", "start_line"]

log = logging.getLogger("trainer_hook")


def start_line(cfg: HookConfig, world_size: int, unit: str = "ranks") -> str:
    """What the hook says once at start: where it reports and as which job, or that it is
    offline and why."""
    if cfg.offline:
        return ("rebalancer: offline, nothing is reported (no server: pass RebalanceHook(server=...) or set "
                f"{ENV_SERVER}); steps are still timed and request_placement() still changes the split")
    server = (cfg.server or "").split(",")[0].strip().rstrip("/")
    mode = f"starting in mode {cfg.mode}" if cfg.mode else "the backend's default mode"
    return (f"rebalancer: reporting to {server} as job {cfg.job_name!r} ({world_size} {unit}, {mode}); "
            f"dashboard {server}/job/{quote(cfg.job_name, safe='')}")


def say_start(line: str) -> None:
    """Through logging where the program configured it (INFO), else on stderr: a library's
    INFO record goes nowhere by default, and this line is the one a user must see."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("%s", line)
    else:
        print(line, file=sys.stderr, flush=True)
