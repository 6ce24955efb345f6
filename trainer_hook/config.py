"""HookConfig: every knob of the training hook, validated at construction.

Defaults are meant to work untouched (docs/design.md: over-tuning is a pitfall). ``server``,
``job``, ``token`` and ``total_steps`` also come from the environment
(``REBALANCER_SERVER``, ``REBALANCER_JOB``, ``REBALANCER_TOKEN``,
``REBALANCER_TOTAL_STEPS``) so that a launcher can set them for every rank.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any

from rebalancer_wire.protocol import HELLO_MODES, MAX_GLOBAL_BATCH_SIZE

__all__ = ["HookConfig", "MEASURED", "ENV_SERVER", "ENV_JOB", "ENV_TOKEN", "ENV_TOTAL_STEPS", "check_total_steps"]

ENV_SERVER = "REBALANCER_SERVER"
ENV_JOB = "REBALANCER_JOB"
ENV_TOKEN = "REBALANCER_TOKEN"
ENV_TOTAL_STEPS = "REBALANCER_TOTAL_STEPS"
_OFFLINE_JOB = "local"
MEASURED = "measured"


def _positive_int(name: str, value: Any, *, lo: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}.")


def check_total_steps(value: Any) -> None:
    """``total_steps`` is a whole number of steps >= 1, or None (unknown)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"total_steps must be an integer >= 1 or None, got {value!r}.")


def _positive_float(name: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}.")


@dataclass(kw_only=True, slots=True)
class HookConfig:
    """Settings of one RebalanceHook. Errors name the key that is wrong.

    - ``server``: backend URL (``http://host:port``), or several replicas' URLs separated
      by commas (tried in turn; docs/scale-out.md); None and no ``REBALANCER_SERVER``
      means offline: no network, placements only from ``request_placement``.
    - ``job``: the job name the backend files this run under (required with a server).
    - ``global_batch_size``: B, fixed for the job.
    - ``mode``: the control mode the job starts in, ``"observe"``, ``"approve"`` or
      ``"auto"`` (sent in the hello; the backend applies it to a job it has not seen yet,
      and a preset an operator stored first, ``rebalancer mode JOB auto``, wins); None:
      the backend's default (``approve``).
    - ``total_steps``: how many steps (global batches) the run takes in all, if known;
      the backend shows the job's ETA and cost to finish from it. Optional; the HF
      Trainer callback fills it from ``max_steps``, ``hook.set_total_steps(n)`` changes it.
    - ``exchange_every`` (K): ranks exchange placements every K steps. A new placement
      takes effect ``L + lookahead`` to ``K + L + lookahead`` batches after it reaches
      rank 0 (10 to 14 by default); each exchange is one async broadcast of a few ints.
    - ``exchange_lag`` (L): an exchange launched at step s is collected at step s + L
      (L < K), so no step blocks on a collective that has not had time to finish.
    - ``lookahead``: how many batches a placement's start leaves for the sampler to run
      ahead of training. ``"measured"`` (default): at the first step the hook measures
      how far the loader has asked the sampler ahead, every rank agrees on the largest,
      and that plus one is used (1 without workers, ``num_workers * prefetch_factor + 1``
      with them; ``hook.data_loader`` knows it up front). An integer fixes it instead and
      must cover the loader's prefetch plus what the loop holds.
    - ``startup_wait_s``: how long rank 0 waits at start for the backend's placement.
    - ``probe_interval_s``: device sampling period (about 1 Hz; NVML serialises).
    - ``max_queue``, ``flush_interval_s``: the transport's bounded queue and send period
      (0.5 s, or sooner once 5 steps wait: a backend pays mostly per frame, and the
      dashboard still moves at least twice a second).
    - ``flush_on_deviation``: a step whose time per sample is this fraction off the rank's
      recent median (0.2: 20%) is sent at once and marked urgent, so the backend answers a
      slowdown within a few steps; 0 turns it off. The first 20 steps go out one by one.
    - ``history``: how many recent StepRecords the hook keeps locally (``hook.history``).
    - ``memory_every``: read the peak device memory once every this many steps (the peak
      over those steps; ``trainer_hook.memory``).
    - ``gc_freeze``: at the first step, collect once and ``gc.freeze()`` what setup built,
      so no later collection walks it (off by default; docs/causes.md).
    - ``gc_collect_every``: N > 0 stops Python's automatic full collections and has every
      rank collect before each batch whose index is a multiple of N, all at once with no
      collective (0, the default: Python's own schedule). Generations 0 and 1 stay automatic.
    - ``hang_after_s``: with a backend, a rank whose steps stop for this many seconds (or
      five of its recent steps, if longer) reports where it is, with its Python stack
      (``trainer_hook.watchdog``; 0 turns it off).
    - ``micro_batches``: micro-batch placements (docs/streaming.md): the number M of
      fixed-shape micro-batches every optimizer step trains over all ranks. Shares then
      count micro-batches (``global_batch_size`` is M; give one or both, equal), rank r
      runs ``shares[r]`` of them per step through ``hook.micro_batches(source)``, and a
      placement changes only those counts, never a shape. None (default): shares count samples.
    """

    server: str | None = None
    job: str | None = None
    global_batch_size: int
    token: str | None = None
    total_steps: int | None = None
    mode: str | None = None
    exchange_every: int = 4
    exchange_lag: int = 2
    lookahead: int | str = "measured"
    startup_wait_s: float = 2.0
    probe_interval_s: float = 1.0
    max_queue: int = 10000
    flush_interval_s: float = 0.5
    flush_on_deviation: float = 0.2
    history: int = 256
    memory_every: int = 8
    gc_freeze: bool = False
    gc_collect_every: int = 0
    hang_after_s: float = 5.0
    micro_batches: int | None = None

    def __post_init__(self) -> None:
        if self.server is not None and (not isinstance(self.server, str) or not self.server.strip()):
            raise ValueError(f"server must be a URL string or None, got {self.server!r}.")
        if self.server is not None:
            from trainer_hook.transport import hook_ws_urls

            hook_ws_urls(self.server)  # raises with a clear message
            if not self.job:
                raise ValueError(
                    "job is required when a server is set: pass RebalanceHook(job='name') "
                    "or set REBALANCER_JOB."
                )
        if self.job is not None:
            if not isinstance(self.job, str) or not self.job.strip() or len(self.job) > 128:
                raise ValueError(f"job must be a non-empty name of at most 128 characters, got {self.job!r}.")
            if any(c in self.job for c in "/?#\\") or self.job != self.job.strip():
                raise ValueError(f"job may not contain '/', '?', '#', '\\' or surrounding spaces, got {self.job!r}.")
        if self.token is not None and not isinstance(self.token, str):
            raise ValueError(f"token must be a string or None, got {type(self.token).__name__}.")
        _positive_int("global_batch_size", self.global_batch_size)
        if self.global_batch_size > MAX_GLOBAL_BATCH_SIZE:
            raise ValueError(
                f"global_batch_size must be at most {MAX_GLOBAL_BATCH_SIZE} (the protocol's limit), "
                f"got {self.global_batch_size}.")
        check_total_steps(self.total_steps)
        if self.mode is not None and self.mode not in HELLO_MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, HELLO_MODES))} or None (the "
                             f"backend's default), got {self.mode!r}.")
        _positive_int("exchange_every", self.exchange_every)
        _positive_int("exchange_lag", self.exchange_lag, lo=0)
        if self.exchange_lag >= self.exchange_every:
            raise ValueError(
                f"exchange_lag must be smaller than exchange_every (one exchange in flight at a "
                f"time), got exchange_lag={self.exchange_lag}, exchange_every={self.exchange_every}."
            )
        if self.lookahead != MEASURED:
            if isinstance(self.lookahead, str):
                raise ValueError(f"lookahead must be an integer >= 0 or {MEASURED!r}, got {self.lookahead!r}.")
            _positive_int("lookahead", self.lookahead, lo=0)
        _positive_float("startup_wait_s", self.startup_wait_s, allow_zero=True)
        _positive_float("probe_interval_s", self.probe_interval_s)
        _positive_int("max_queue", self.max_queue)
        _positive_float("flush_interval_s", self.flush_interval_s)
        fod = self.flush_on_deviation
        if isinstance(fod, bool) or not isinstance(fod, (int, float)) or not 0 <= fod <= 10:
            raise ValueError(f"flush_on_deviation must be a number between 0 and 10 (0 turns it "
                             f"off), got {fod!r}.")
        _positive_int("history", self.history)
        _positive_int("memory_every", self.memory_every)
        if not isinstance(self.gc_freeze, bool):
            raise ValueError(f"gc_freeze must be True or False, got {self.gc_freeze!r}.")
        _positive_int("gc_collect_every", self.gc_collect_every, lo=0)
        _positive_float("hang_after_s", self.hang_after_s, allow_zero=True)
        if self.micro_batches is not None:
            _positive_int("micro_batches", self.micro_batches)
            if self.micro_batches != self.global_batch_size:
                raise ValueError(
                    f"micro_batches ({self.micro_batches}) and global_batch_size ({self.global_batch_size}) "
                    "differ: with micro-batch placements the global batch counts micro-batches. Pass "
                    "micro_batches=M alone (or both equal).")

    @property
    def offline(self) -> bool:
        """True when no backend is configured: nothing touches the network."""
        return self.server is None

    @property
    def job_name(self) -> str:
        """The job name, or ``'local'`` for an offline run without one."""
        return self.job or _OFFLINE_JOB

    @classmethod
    def from_env(cls, *, env: dict[str, str] | None = None, **kwargs: Any) -> HookConfig:
        """Build a config from keyword arguments, filling server/job/token from the env.

        Explicit arguments win over the environment. Unknown keys raise a ValueError that
        lists the known ones.
        """
        env = dict(os.environ) if env is None else env
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"Unknown hook setting(s) {unknown}; known settings: {sorted(known)}.")
        for key, var in (("server", ENV_SERVER), ("job", ENV_JOB), ("token", ENV_TOKEN)):
            if kwargs.get(key) is None and env.get(var):
                kwargs[key] = env[var]
        if kwargs.get("total_steps") is None and env.get(ENV_TOTAL_STEPS):
            raw = env[ENV_TOTAL_STEPS].strip()
            try:
                kwargs["total_steps"] = int(raw)
            except ValueError:
                raise ValueError(f"{ENV_TOTAL_STEPS} must be a whole number of steps, got {raw!r}.") from None
        if kwargs.get("global_batch_size") is None and kwargs.get("micro_batches") is not None:
            kwargs["global_batch_size"] = kwargs["micro_batches"]
        if "global_batch_size" not in kwargs or kwargs["global_batch_size"] is None:
            raise ValueError("global_batch_size is required: RebalanceHook(global_batch_size=256).")
        return cls(**kwargs)
