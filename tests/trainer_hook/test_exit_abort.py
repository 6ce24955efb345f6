"""The SIGABRT at exit ("terminate called without an active exception") a hooked gloo job
once ended with, reproduced and fixed.

Cause: the comm hook's ``Future.then`` callback is wrapped in a C++ guard that gloo's
worker thread destroys after running it, taking the GIL to do so. If the main thread keeps
the GIL from the last step to interpreter finalisation, that thread asks for the GIL too
late, CPython ends it with ``pthread_exit`` inside the C++ destructor, and the process
aborts. Rare under normal scheduling (one run in about 45), certain once the race is
reached: the worker holds the GIL (a huge switch interval) and exits right after a step
where gloo's thread still held the callback. Before the fix all 4 such runs aborted,
with or without hook.close() and destroy_process_group().

A second way to the same abort, seen once in CI (no close, Python hook): the future
``then`` makes holds a Python object, and gloo's thread, when it drops the last reference
to one DDP has already replaced, frees it with the GIL after the callback's guard is gone.
The hook now keeps the futures of the last two steps, so that thread never drops the last.
That did not end the abort: it came back in later CI runs (no close, Python hook). The
rest of the cause: the exit handler's registry held hooks weakly, and a garbage collection
after the script's main() returned took its hook away unclosed
(test_exit_dropped_hook.py); the registry now keeps a hook until it is closed.

The race is forced (``_exit_race_worker``: a peer process that joins the all-reduce late,
a second callback holding gloo's thread), one run per mode; without ``release_callbacks``
the no-close run aborts every time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from trainer_hook.gradients import GradientState

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_release_callbacks_waits_until_no_thread_holds_the_callback() -> None:
    state = GradientState()
    held = [state._done_cb]  # what gloo's thread holds until it gets the GIL
    assert state.release_callbacks(timeout_s=0.05) is False
    dropper = threading.Timer(0.1, held.clear)
    dropper.start()
    assert state.release_callbacks(timeout_s=30) is True
    assert held == []
    dropper.join()


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["close", "no-close"])
def test_exit_right_after_a_step_gloo_still_holds_the_callback_does_not_abort(mode: str, tmp_path: Path) -> None:
    # The interleaving is forced, not waited for (the worker's main() says how): one run,
    # and it always reaches the race.
    proc = subprocess.run(
        [sys.executable, "-m", "tests.trainer_hook._exit_race_worker", mode, str(tmp_path / "store")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=200,
        # The race is the Python comm hook's (the C++ one hands gloo no Python callback).
        env={**os.environ, "REBALANCER_NATIVE_COMM_HOOK": "0"},
    )
    out = proc.stdout + proc.stderr
    assert "race reached: callback run by gloo, still held at exit: yes" in proc.stdout, out[-3000:]
    assert "terminate called" not in out and proc.returncode == 0, f"exit {proc.returncode}:\n{out[-3000:]}"


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_the_hook_keeps_the_futures_a_communication_thread_may_still_hold(tmp_path: Path) -> None:
    # The deterministic half of the abort above. DDP requires a Python hook's future to hold
    # a Python object, and whichever thread drops the last reference to that future frees
    # it, taking the GIL. Were it gloo's thread, after release_callbacks() returned, the
    # interpreter could already be finalising (the abort once more). The hook keeps the
    # futures of the last two steps, so gloo's thread never drops the last reference.
    proc = subprocess.run(
        [sys.executable, "-m", "tests.trainer_hook._exit_race_worker", "futures", str(tmp_path / "store")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=100,
        env={**os.environ, "REBALANCER_NATIVE_COMM_HOOK": "0"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "futures kept per step: no no yes yes"
