"""Connection: where this rank's records and messages leave. Owns the step history, the
transport (websocket or the node's agent), the device probe and the hang watchdog; offline
(no server, or a replica member that is not its leader) it keeps the history and sends nothing."""

from __future__ import annotations

import logging
import os
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rebalancer_wire.protocol import Hello, Message, StepRecord
from trainer_hook.config import HookConfig
from trainer_hook.watchdog import Watchdog, Where, nccl_dump_here

log = logging.getLogger("trainer_hook")
HOOK_VERSION = "0.1.0"


class Connection:
    """The hook's outward side: ``report`` a step record, ``send_control`` a message."""

    def __init__(self, config: HookConfig) -> None:
        self._config = config
        self.history: deque[StepRecord] = deque(maxlen=config.history)
        self.transport: Any = None
        self.probe: Any = None
        self.watchdog: Watchdog | None = None
        self._hello: Callable[[], Hello] | None = None

    def start(self, *, hello: Callable[[], Hello], on_message: Callable[[Message], None],
              where: Where, training_thread: int) -> None:
        """Connect to the backend and start the probe and the watchdog (daemon threads)."""
        from trainer_hook.node_agg import make_transport
        from trainer_hook.probe import DeviceProbe

        cfg = self._config
        self._hello = hello
        device_index = None
        if torch.cuda.is_available():
            device_index = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        self.transport = make_transport(  # through the node's agent where torchrun runs several ranks
            job=cfg.job_name, url=cfg.server or "", token=cfg.token, hello=hello,
            on_message=on_message, max_queue=cfg.max_queue, flush_interval_s=cfg.flush_interval_s,
            flush_on_deviation=cfg.flush_on_deviation,
        )
        self.probe = DeviceProbe(
            interval_s=cfg.probe_interval_s, device_index=device_index, on_sample=self.transport.put_device
        )
        self.transport.total_steps = cfg.total_steps
        self.transport.start()
        self.probe.start()
        if cfg.hang_after_s > 0:
            self.watchdog = Watchdog(where=where, report=self.transport.put_hang,
                                     after_s=cfg.hang_after_s, thread_id=training_thread,
                                     nccl_dump=nccl_dump_here)
            self.watchdog.start()

    @property
    def connected(self) -> bool:
        return bool(self.transport is not None and self.transport.connected)

    @property
    def dropped(self) -> int:
        return int(self.transport.dropped) if self.transport is not None else 0

    def set_total_steps(self, total_steps: int | None) -> None:
        if self.transport is not None:
            self.transport.total_steps = total_steps

    def report(self, rec: StepRecord) -> None:
        self.history.append(rec)
        if self.transport is not None:
            self.transport.put_step(rec)

    def report_many(self, recs: Sequence[StepRecord]) -> None:
        """The pace thread: a replica's combined records (deque appends are thread-safe)."""
        for rec in recs:
            self.report(rec)

    def send_control(self, msg: Any) -> None:
        if self.transport is not None:
            self.transport.send_control(msg)

    def flush_control(self, timeout_s: float) -> bool:
        return self.transport.flush_control(timeout_s) if self.transport is not None else True

    def resend_hello(self) -> None:
        """The hello sent on connecting could not say what attach() learnt since."""
        if self.transport is not None and self._hello is not None:
            self.transport.send_control(self._hello())

    def describe_device(self) -> tuple[str, str, int | None, int | None, str]:
        """(type, name, memory bytes, GPU index, GPU uuid) from the probe; a CPU without one."""
        device_type, device_name, mem_total = "CPU", "", None
        gpu_index, gpu_uuid = None, ""
        if self.probe is not None:
            try:
                device_type, device_name, mem_total = self.probe.describe()
                gpu_index, gpu_uuid = self.probe.identity()
            except Exception:  # a probe failure must not stop the connection
                log.debug("device probe describe() failed", exc_info=True)
        return device_type, device_name, mem_total, gpu_index, gpu_uuid

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.probe is not None:
            self.probe.stop()
        if self.transport is not None:
            self.transport.close()

    def after_fork_in_child(self) -> None:
        if self.probe is not None:
            self.probe.after_fork_in_child()
        if self.transport is not None:
            self.transport.after_fork_in_child()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def host_facts() -> dict[str, Any]:
    """What a hello says about the process itself."""
    return {"local_rank": local_rank(), "host": socket.gethostname(), "pid": os.getpid(),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "hook_version": HOOK_VERSION}
