"""Zero-code monitoring: what ``rebalancer run -- torchrun ... train.py`` injects into
every worker, through the ``sitecustomize`` in ``trainer_hook/_site`` (docs/integrations.md).

Observe only, and with no collective of its own (a rank whose monitoring fails can never
make its peers wait): each rank streams its steps and device samples to the backend.

- step boundary: the first optimizer that steps (``register_optimizer_step_post_hook``,
  a global hook of torch.optim; DDP, FSDP2, Accelerate and the HF Trainer all step a
  ``torch.optim.Optimizer``); one step ends when that optimizer's ``step()`` returns;
- step time: from the previous step's end (the first step: its first batch) to this one;
- data wait: the time spent in DataLoader iterators (``_BaseDataLoaderIter.__next__``)
  within it, whether the loop fetches its batch first or prefetches (Accelerate, the HF
  Trainer, Lightning); optimizer: the optimizer's ``step()``; compute: the rest, less the sync wait;
- the local batch size: the first dimension of the batch's first tensor; the global batch
  is it times the world size, unless ``REBALANCER_GLOBAL_BATCH_SIZE`` says otherwise;
- sync wait: DDP's, from the step's last gradient accumulation (a post-accumulate-grad
  hook on the optimizer's parameters) to the optimizer's ``step()``, where DDP has waited
  for its all-reduce; FSDP2's, the time blocked inside its reduce-scatters and all-gathers
  (``torch.distributed`` wrapped). CPU parameters only: on an accelerator the host clock
  sees kernel launches, not their end, and the wait stays inside compute;
- device metrics: the hook's DeviceProbe.

A script that makes its own RebalanceHook is left to it (the monitor stands down at the
first optimizer step). Placements from the backend are rejected with a reason saying rebalancing needs the hook's
sampler. Any failure logs one line (``rebalancer: monitoring is off ...``) and switches
this process's monitoring off; training goes on.

One module, over 400 lines on purpose: what the injected sitecustomize does in one worker
(finding the step boundary, timing it, streaming it); it imports nothing it does not need."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import time
from typing import Any

from rebalancer_wire.protocol import StepRecord

__all__ = ["Monitor", "install", "split_step", "ENABLE_LINE", "REJECT_REASON", "HOOK_VERSION_TAG"]

log = logging.getLogger("trainer_hook")

# The hook_version a zero-code rank reports, followed by ": <framework>" (ddp, accelerate,
# hf_trainer, lightning); the job page shows its notice, with that framework's line, on it.
HOOK_VERSION_TAG = "observe-only (rebalancer run)"
ENABLE_LINE = (
    "hook = RebalanceHook(global_batch_size=B); hook.attach(ddp_model); "
    "loader = hook.data_loader(dataset)  # and `with hook.step():` around each step"
)
REJECT_REASON = (
    "this job is monitored by `rebalancer run` without code change: rebalancing needs the "
    "hook's batch sampler and gradient weighting (RebalanceHook.data_loader and attach)."
)
_MAX_ENV_INT = 1 << 31
# What FSDP2 calls through torch.distributed (torch.distributed.fsdp._fully_shard._fsdp_collectives).
_TIMED_COLLECTIVES = ("reduce_scatter_single", "all_gather_single", "reduce_scatter_tensor", "all_gather_into_tensor")


def _say(msg: str) -> None:
    """One line on stderr, whatever logging the script configured."""
    try:
        sys.stderr.write(f"rebalancer: {msg}\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a closed stderr must not stop training
        pass


def _env_int(env: dict[str, str], name: str, default: int, lo: int, hi: int = _MAX_ENV_INT) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if not lo <= value < hi:
        raise ValueError(f"{name}={value} is out of range [{lo}, {hi})")
    return value


def _first_len(batch: Any) -> int | None:
    """The first dimension of the first tensor in a batch (tensor, dict, list, tuple)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    for v in values:
        if isinstance(v, (dict, list, tuple)):
            n = _first_len(v)
            if n is not None:
                return n
    return None


def split_step(
    prev: float, now: float, fetch_s: float, opt_t0: float, grad_t: float, coll_s: float
) -> tuple[float, float, float, float]:
    """One step's ``(step, data, optimizer, sync)`` seconds from its clock readings (compute
    is the rest): it ran from ``prev`` to ``now``, spent ``fetch_s`` in DataLoader
    iterators, entered the optimizer at ``opt_t0``, accumulated its last local gradient at
    ``grad_t`` and blocked ``coll_s`` in FSDP's collectives. Sync wait is those collectives
    plus, after the last gradient, the wait for DDP's all-reduce until the optimizer; a
    reading from before this step (``< prev``) does not count. Each part is clipped to what
    the ones before it left of the step."""
    step = max(0.0, now - prev)
    data = min(max(0.0, fetch_s), step)
    opt = min(max(0.0, now - opt_t0), step - data) if opt_t0 >= prev else 0.0
    sync = max(0.0, coll_s)
    if prev <= grad_t <= opt_t0:
        sync += opt_t0 - grad_t
    return step, data, opt, min(sync, step - data - opt)


def _script_has_hook() -> bool:
    """True when the script made a RebalanceHook itself: it reports this rank already."""
    from trainer_hook import _lifecycle

    return len(_lifecycle._live) > 0


def _framework(streaming: bool = False) -> str:
    """Which adapter's line would enable rebalancing in this script (what it imported);
    ``streaming`` for a loader over an IterableDataset, which none of them can split (the
    page then says what rebalancing needs instead of a line that would refuse it)."""
    if streaming:
        return "streaming"
    mods = sys.modules
    if "pytorch_lightning" in mods or "lightning.pytorch" in mods:
        return "lightning"
    if "transformers.trainer" in mods:
        return "hf_trainer"
    if "accelerate.accelerator" in mods:
        return "accelerate"
    return "ddp"


def _streams(it: Any) -> bool:
    """Whether a DataLoader iterator reads an IterableDataset (a stream: no global order)."""
    try:
        from torch.utils.data import IterableDataset

        return isinstance(getattr(it, "_dataset", None), IterableDataset)
    except Exception:  # noqa: BLE001 - never break the job
        return False


class Monitor:
    """One process's observe-only monitoring (see the module docstring)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._env = dict(os.environ) if env is None else env
        self.rank_text = self._env.get("RANK", "0")
        self.config: Any = None  # read at the first optimizer step: torchrun's agent never gets there
        self._optimizer: int | None = None  # id() of the optimizer whose steps are counted
        self._prev_end: float | None = None  # perf_counter() at the last step's end
        self._fetch_s = 0.0  # DataLoader waits since then
        self._streaming = False  # a DataLoader over an IterableDataset was seen
        self._opt_t0 = -1.0  # perf_counter() when the optimizer's step() began
        self._grad_t = -1.0  # perf_counter() when the last gradient of this step was accumulated
        self._grad_hooks = False
        self._coll_s = 0.0  # time blocked in FSDP's collectives since the last step's end
        self._local = 0
        self._k = 0
        self._transport: Any = None
        self._probe: Any = None
        self.off = False
        self._handles: list[Any] = []

    def _configure(self) -> None:
        """Rank, world size and the backend from the environment (range-checked)."""
        import torch.distributed as dist

        from trainer_hook.config import HookConfig

        env = self._env
        self.world_size = _env_int(env, "WORLD_SIZE", 1, 1)
        self.rank = _env_int(env, "RANK", 0, 0, self.world_size)
        if dist.is_available() and dist.is_initialized():  # mp.spawn scripts set no RANK
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.rank_text = str(self.rank)
        self.local_rank = _env_int(env, "LOCAL_RANK", 0, 0)
        self.global_batch_size = _env_int(env, "REBALANCER_GLOBAL_BATCH_SIZE", 0, 0)
        if 0 < self.global_batch_size < self.world_size:
            raise ValueError(
                f"REBALANCER_GLOBAL_BATCH_SIZE={self.global_batch_size} is below the world size "
                f"({self.world_size})")
        self.config = HookConfig.from_env(env=env, global_batch_size=max(1, self.global_batch_size))
        if not self.config.server:
            raise ValueError("REBALANCER_SERVER is not set")

    # --- installation ----------------------------------------------------------------

    def install(self) -> None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        self._handles.append(register_optimizer_step_pre_hook(self._before_optimizer_step))
        self._handles.append(register_optimizer_step_post_hook(self._after_optimizer_step))
        orig = _BaseDataLoaderIter.__next__
        monitor = self

        def __next__(it: Any) -> Any:  # noqa: N807 - replaces the iterator's own
            if monitor.off:
                return orig(it)
            t = time.perf_counter()
            try:
                batch = orig(it)
            finally:  # StopIteration included: the wait for the end of an epoch counts too
                monitor._fetched(t)
            monitor._batch_ready(batch)
            if not monitor._streaming:
                monitor._streaming = _streams(it)
            return batch

        _BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign,assignment]
        self._time_collectives()
        os.register_at_fork(after_in_child=self._forked)
        atexit.register(self.close)

    def _time_collectives(self) -> None:
        """Time FSDP2's blocking collectives (it calls them through ``torch.distributed``):
        on CPU (gloo) the time inside is the transfer and the wait for the slowest peer."""
        import torch.distributed as dist

        monitor = self
        for name in _TIMED_COLLECTIVES:
            orig = getattr(dist, name, None)
            if orig is None:
                continue

            def timed(*args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
                if monitor.off or kwargs.get("async_op", False):
                    return _orig(*args, **kwargs)
                t = time.perf_counter()
                try:
                    return _orig(*args, **kwargs)
                finally:
                    monitor._coll_s += time.perf_counter() - t

            setattr(dist, name, timed)

    def _fail(self, where: str, exc: BaseException) -> None:
        self.off = True
        _say(f"monitoring is off for rank {self.rank_text} ({where}: {type(exc).__name__}: {exc}); "
             "training goes on unmonitored")
        try:
            for h in self._handles:
                h.remove()
        except Exception:  # noqa: BLE001
            pass

    def _forked(self) -> None:  # a DataLoader worker: never streams (the threads stayed behind)
        self.off = True
        self._transport = self._probe = None

    # --- the training thread -----------------------------------------------------------

    def _fetched(self, t0: float) -> None:
        """A DataLoader iterator returned (or ended) after waiting since ``t0``."""
        if self._prev_end is None:
            self._prev_end = t0  # the first step starts with its first batch
        self._fetch_s += time.perf_counter() - t0

    def _batch_ready(self, batch: Any) -> None:
        try:
            n = _first_len(batch)
            if n is not None:
                self._local = n
        except Exception as exc:  # noqa: BLE001 - never break the job
            self._fail("reading a batch failed", exc)

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.off and (self._optimizer is None or self._optimizer == id(optimizer)):
            self._opt_t0 = time.perf_counter()

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """One step ends: from the previous step's end (or the first batch) until now, of
        which the DataLoader waits are data wait and the optimizer's step() its own part."""
        if self.off:
            return
        now = time.perf_counter()
        if self.config is None:
            try:
                if _script_has_hook():
                    self.off = True
                    if self.rank_text in ("", "0"):
                        _say("the script has its own RebalanceHook: the injected monitoring stands down")
                    return
                self._configure()
            except Exception as exc:  # noqa: BLE001 - never break the job
                self._fail("invalid settings", exc)
                return
        try:
            if self._optimizer is None:
                self._optimizer = id(optimizer)
            elif self._optimizer != id(optimizer):
                return  # a second optimizer (GAN-style loops): one step is the first one's
            k, prev = self._k, self._prev_end
            self._k += 1
            self._prev_end, fetch, self._fetch_s = now, self._fetch_s, 0.0
            coll, self._coll_s = self._coll_s, 0.0
            if prev is None:
                return  # the first step of a loop without a DataLoader: its start is unknown
            step, data, opt, sync = split_step(prev, now, fetch, self._opt_t0, self._grad_t, coll)
            rec = StepRecord(
                batch_index=k, local_batch_size=max(1, self._local or self._batch_guess()),
                placement_version=0, data_wait_ms=data * 1e3, compute_ms=(step - data - opt - sync) * 1e3,
                sync_wait_ms=sync * 1e3, optimizer_ms=opt * 1e3, step_ms=step * 1e3, t=time.time(),
            )
            if not self._grad_hooks:
                self._grad_hooks = True
                self._watch_gradients(optimizer)
            if self._transport is None:
                self._start_io()
            self._transport.put_step(rec)
        except Exception as exc:  # noqa: BLE001 - never break the job
            self._fail("timing a step failed", exc)

    def _watch_gradients(self, optimizer: Any) -> None:
        """Time each step's last gradient accumulation (the end of local compute; DDP's
        reducer waits for its all-reduce after it). Only for CPU tensors with several ranks:
        on an accelerator the host clock sees kernel launches, not their end, and FSDP's
        sharded parameters receive their gradients after the reduce-scatter."""
        import torch

        if self.world_size < 2:
            return
        params = [p for g in optimizer.param_groups for p in g["params"]
                  if type(p) in (torch.Tensor, torch.nn.Parameter) and p.requires_grad]
        if not params or any(p.device.type != "cpu" for p in params):
            return
        monitor = self

        def grad_ready(_p: Any) -> None:
            monitor._grad_t = time.perf_counter()

        for p in params:
            self._handles.append(p.register_post_accumulate_grad_hook(grad_ready))

    def _batch_guess(self) -> int:
        return max(1, self.global_batch_size // self.world_size) if self.global_batch_size else 1

    # --- I/O (once, at the first step's end) -------------------------------------------

    def _start_io(self) -> None:
        import torch

        from trainer_hook.probe import DeviceProbe
        from trainer_hook.transport import Transport

        if not self.global_batch_size:
            self.global_batch_size = max(1, self._local) * self.world_size
        cfg = self.config
        device_index = None
        if torch.cuda.is_available():
            device_index = self.local_rank % max(1, torch.cuda.device_count())
        self._transport = Transport(
            url=cfg.server or "", token=cfg.token, hello=self._hello, on_message=self._on_message,
            max_queue=cfg.max_queue, flush_interval_s=cfg.flush_interval_s,
            flush_on_deviation=cfg.flush_on_deviation,
        )
        self._probe = DeviceProbe(interval_s=cfg.probe_interval_s, device_index=device_index,
                                  on_sample=self._transport.put_device)
        self._transport.start()
        self._probe.start()
        if self.rank == 0:
            _say(f"monitoring job '{cfg.job_name}' ({self.world_size} rank(s), global batch "
                 f"{self.global_batch_size}) on {cfg.server}; observe only")

    def _hello(self) -> Any:
        from rebalancer_wire.protocol import Hello
        from trainer_hook.hook import HOOK_VERSION

        device_type, device_name, mem_total = "CPU", "", None
        gpu_index, gpu_uuid = None, ""
        try:
            device_type, device_name, mem_total = self._probe.describe()
            gpu_index, gpu_uuid = self._probe.identity()
        except Exception:  # noqa: BLE001 - a probe failure must not stop the connection
            log.debug("device probe describe() failed", exc_info=True)
        return Hello(
            job=self.config.job_name, rank=self.rank, world_size=self.world_size,
            global_batch_size=self.global_batch_size, local_rank=self.local_rank,
            host=socket.gethostname(), pid=os.getpid(), device_type=device_type,
            device_name=device_name, mem_total_bytes=mem_total, placement_version=0,
            batch_index=self._k,
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            hook_version=f"{HOOK_VERSION} {HOOK_VERSION_TAG}: {_framework(self._streaming)}", gpu_index=gpu_index, gpu_uuid=gpu_uuid,
        )

    def _on_message(self, msg: Any) -> None:
        from rebalancer_wire.protocol import Error, Placement, Reject

        if isinstance(msg, Placement) and self.rank == 0 and msg.version > 0:
            self._transport.send_control(
                Reject(job=self.config.job_name, rank=self.rank, version=msg.version, reason=REJECT_REASON))
        elif isinstance(msg, Error):
            log.warning("backend error %s: %s", msg.code, msg.message)

    def close(self) -> None:
        """Flush and stop (at interpreter exit); never raises."""
        probe, transport = self._probe, self._transport
        self._probe = self._transport = None
        try:
            if probe is not None:
                probe.stop()
            if transport is not None:
                transport.close()
        except Exception as exc:  # noqa: BLE001
            log.debug("closing the monitor failed: %s", exc)


_installed: Monitor | None = None


def install(env: dict[str, str] | None = None) -> Monitor | None:
    """Start monitoring this process (once); on any failure one line and None."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        monitor = Monitor(env)
        monitor.install()
    except Exception as exc:  # noqa: BLE001 - the injection never breaks a job
        _say(f"monitoring is off ({type(exc).__name__}: {exc}); training goes on unmonitored")
        return None
    _installed = monitor
    return monitor
