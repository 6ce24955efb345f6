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
    for attempt in range(10):
        store = tmp_path / f"store{attempt}"
        proc = subprocess.run(
            [sys.executable, "-m", "tests.trainer_hook._exit_race_worker", mode, str(store)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=100,
            # The race is the Python comm hook's (the C++ one hands gloo no Python callback):
            # with the C++ hook attached the race was never reached and the test skipped.
            env={**os.environ, "REBALANCER_NATIVE_COMM_HOOK": "0"},
        )
        if proc.returncode != 3:
            break
    else:
        pytest.skip("the race was not reached in 10 runs (gloo's thread always dropped the callback first)")
    out = proc.stdout + proc.stderr
    assert "terminate called" not in out and proc.returncode == 0, f"exit {proc.returncode}:\n{out[-3000:]}"
