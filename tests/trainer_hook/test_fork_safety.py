"""A forked child (a DataLoader worker started by fork) inherits the hook's memory but none
of its threads: locks they held stay held, and the websocket and NVML handle are the
parent's. The child must neither deadlock on those locks nor touch the parent's socket,
and the parent's connection must carry on as if nothing happened.

The server is a real websockets server on a free loopback port that records connections
and frames; the hook is a real one-process hook streaming to it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.sync.server import ServerConnection, serve

from rebalancer_wire.protocol import StepRecord
from tests.helpers.nvml import FakeGpu, FakeNvml
from tests.helpers.ports import free_port
from tests.helpers.waiting import wait_until
from trainer_hook import RebalanceHook
from trainer_hook.probe import DeviceProbe

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


class Recorder:
    """What the websocket server saw: one entry per connection, frame types per connection."""

    def __init__(self) -> None:
        self.connections: list[list[str]] = []
        self.closed: list[int] = []

    def handler(self, ws: ServerConnection) -> None:
        frames: list[str] = []
        self.connections.append(frames)
        n = len(self.connections) - 1
        try:
            for raw in ws:
                frames.append(json.loads(raw)["type"])
        finally:
            self.closed.append(n)


@pytest.fixture
def ws_server() -> Iterator[tuple[str, Recorder]]:
    rec = Recorder()
    port = free_port()
    with serve(rec.handler, "127.0.0.1", port) as server:
        t = threading.Thread(target=server.serve_forever, daemon=True)
        t.start()
        try:
            yield f"http://127.0.0.1:{port}", rec
        finally:
            server.shutdown()
            t.join(5)


def _record(k: int) -> StepRecord:
    return StepRecord(batch_index=k, local_batch_size=8, placement_version=0, data_wait_ms=0.1, compute_ms=1.0,
                      sync_wait_ms=0.1, optimizer_ms=0.1, step_ms=1.5, t=time.time())


def _fork_and_report(child: Any, guard_s: float = 60.0) -> dict[str, Any]:
    """Fork; the child runs ``child()`` -> dict, sent back as JSON. A child still running
    after ``guard_s`` has deadlocked: it is killed and the test fails."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 0
        try:
            os.close(r)
            os.write(w, json.dumps(child()).encode())
        except BaseException as exc:  # noqa: BLE001
            os.write(w, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + guard_s
    chunks: list[bytes] = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([r], [], [], 0.2)
        if ready:
            data = os.read(r, 65536)
            if not data:
                break
            chunks.append(data)
    os.close(r)
    done, status = os.waitpid(pid, os.WNOHANG)
    while done == 0 and time.monotonic() < deadline:  # EOF comes a moment before the exit
        time.sleep(0.05)
        done, status = os.waitpid(pid, os.WNOHANG)
    if done == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the forked child deadlocked (still running after {guard_s:.0f}s); it said {b''.join(chunks)!r}")
    result: dict[str, Any] = json.loads(b"".join(chunks) or b"{}")
    result["exit"] = os.waitstatus_to_exitcode(status)
    return result


def test_fork_while_the_hooks_locks_are_held_child_neither_deadlocks_nor_touches_the_parents_socket(
    ws_server: tuple[str, Recorder],
) -> None:
    url, rec = ws_server
    hook = RebalanceHook(server=url, job="fork", global_batch_size=8, startup_wait_s=0.1)
    try:
        wait_until(lambda: hook.connected and rec.connections and "hello" in rec.connections[0],
                   "the hook to connect", 30)
        transport = hook._conn.transport
        locks = [hook._c.placements._lock, hook._c.channel._lock, transport._lock, hook._conn.probe._lock]
        held, release = threading.Event(), threading.Event()

        def hold() -> None:  # another thread holds every lock across the fork, as the I/O threads may
            for lock in locks:
                lock.acquire()
            held.set()
            release.wait()
            for lock in locks:
                lock.release()

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        assert held.wait(10)

        def child() -> dict[str, Any]:
            from trainer_hook import _lifecycle

            out: dict[str, Any] = {"connected": hook.connected}
            try:
                hook.request_placement([8], reason="from a child")  # takes hook._c.placements._lock
            except RuntimeError as exc:
                out["request"] = str(exc)
            except ValueError as exc:
                out["request"] = f"ValueError: {exc}"
            try:
                with hook.step():
                    pass
            except RuntimeError as exc:
                out["step"] = str(exc)
            hook.set_total_steps(10)
            hook.close()  # the transport's and the control channel's locks
            hook._conn.transport.close()
            hook._conn.probe.stop()
            _lifecycle.close_all()  # what the child's exit would run
            out["closed"] = True
            return out

        try:
            result = _fork_and_report(child)
        finally:
            release.set()
            holder.join(10)
        assert result.get("closed") and result["exit"] == 0, result
        assert "parent process" in result.get("step", ""), result
        assert result["connected"] is False, result

        # The parent's connection is the same one and still carries frames.
        time.sleep(0.5)  # let a wrongly woken reader in the parent act, if it would
        hook._conn.transport.put_step(_record(0))
        wait_until(lambda: "metrics" in rec.connections[0], "metrics on the parent's connection", 30)
        assert hook.connected and transport.connects == 1
        assert len(rec.connections) == 1 and rec.closed == [], (rec.connections, rec.closed)
    finally:
        hook.close()


def test_a_forked_child_forgets_the_nvml_handle_without_shutting_nvml_down() -> None:
    nvml = FakeNvml([FakeGpu()])
    probe = DeviceProbe(nvml=nvml, device_index=0, interval_s=0.05)
    probe.start()
    try:
        from trainer_hook import _lifecycle

        # The child reads the parent's last sample: wait for the first one (the probe's thread
        # takes it; since the link counters, a first sample takes a few ms more).
        wait_until(lambda: probe.latest() is not None, "the probe's first sample", timeout=10.0)

        class Holder:  # the probe as a live hook owns it
            def __init__(self) -> None:
                self.probe = probe

            def _after_fork_in_child(self) -> None:
                self.probe.after_fork_in_child()

            def _close_at_exit(self) -> None:
                pass

        holder = Holder()
        _lifecycle.track(holder)
        probe._lock.acquire()  # held at the fork

        def child() -> dict[str, Any]:
            before = dict(nvml.calls)
            probe.stop()
            sample = probe.latest()  # takes the probe's lock (the parent's last sample)
            return {"handle": probe._handle is None, "backend": probe.source, "sample": sample is not None,
                    "shutdown": nvml.calls.get("nvmlShutdown", 0) - before.get("nvmlShutdown", 0),
                    "nvml_calls_after_fork": sum(nvml.calls.values()) - sum(before.values())}

        try:
            result = _fork_and_report(child)
        finally:
            probe._lock.release()
        assert result == {"handle": True, "backend": "psutil", "sample": True, "shutdown": 0,
                          "nvml_calls_after_fork": 0, "exit": 0}, result
        assert probe._handle is not None and probe.source == "nvml"  # the parent's probe is untouched
    finally:
        probe.stop()
