"""What happens to live hooks when the process forks or exits.

Fork (a DataLoader worker started by ``fork``, or any ``os.fork()``): the child inherits
the hook's memory but none of its threads, so a lock one of them held at the fork stays
held for good, and the websocket, its shutdown socketpair and the NVML handle are copies
of the parent's. In the child every live hook is made inert at once (``os.register_at_fork``):
fresh locks, closed, its transport closes only the child's copies of the file
descriptors (never a shutdown or a close frame, which would end the parent's
connection), the probe forgets its NVML handle without ``nvmlShutdown``, and the gloo
groups are dropped without being touched. A worker never uses the hook, so nothing is lost.

Exit: a hook the script never closed is closed at interpreter exit (``atexit``, registered
when the first hook is made, so after ``init_process_group`` and before any handler
torch registered earlier runs), while the interpreter is whole. Left to finalisation,
its daemon threads and its gloo group would be torn down with the interpreter half gone,
which is where ``terminate called without an active exception`` (SIGABRT) comes from.
The registry holds each hook until it is closed, so a hook the script dropped (the locals
of a ``main()`` that returned) is still closed.

Then the handler lets gloo's threads settle. A collective's tensors made in Python (those
of ``all_gather_object``, say) are still referenced by gloo's worker thread for a moment
after ``wait()`` returns; if the script has dropped them by then, that thread frees the
last reference, which takes the GIL to free the Python object. A thread that asks for the
GIL once finalisation has begun is ended inside that C++ destructor, and the process aborts
with ``terminate called without an active exception``: a script that ends with
``all_gather_object``, ``barrier`` and ``destroy_process_group`` and returns reaches
finalisation in time for it when the machine is busy. So the handler releases the GIL in
short sleeps until no gloo thread has been runnable for a few polls (at most
``REBALANCER_EXIT_SETTLE_S`` seconds, default 2; 0 turns the wait off; Linux's
``/proc/self/task``; elsewhere one short sleep).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any

__all__ = ["track", "forget", "close_all", "settle_communication_threads"]

log = logging.getLogger("trainer_hook")

# Strong references: a hook the script dropped without close() (the locals of a main()
# that returned) must still be here when the atexit handler runs. Held weakly, a garbage
# collection between the script's end and the handler took it away unclosed, its comm
# hook's callback still held by gloo's thread: the exit aborted (issue 26, item 10).
_live: set[Any] = set()
_registered = False
_guard = threading.Lock()


def track(hook: Any) -> None:
    """Remember a live hook: closed at exit, made inert in a forked child."""
    global _registered
    with _guard:
        _live.add(hook)
        if not _registered:
            atexit.register(close_all)
            _registered = True


def forget(hook: Any) -> None:
    """A hook closed: nothing left to do for it at exit."""
    with _guard:
        _live.discard(hook)


def close_all() -> None:
    """Close every hook still open (the atexit handler), then let gloo's threads settle;
    errors are logged, never raised."""
    for hook in list(_live):
        try:
            hook._close_at_exit()
        except BaseException as exc:  # noqa: BLE001 - an exit handler must not fail the exit
            log.warning("closing a RebalanceHook at exit failed: %s: %s", type(exc).__name__, exc)
    try:
        settle_communication_threads(_settle_max_s())
    except BaseException as exc:  # noqa: BLE001
        log.warning("waiting for gloo's threads at exit failed: %s: %s", type(exc).__name__, exc)


# Names of the native threads of torch's gloo process groups (ProcessGroupGloo's worker
# threads, gloo's TCP event loop).
_COMM_THREAD_PREFIXES = ("pt_gloo", "gloo_")
_SETTLE_POLL_S = 0.005
_SETTLE_QUIET_POLLS = 3
_SETTLE_MAX_S = 2.0
SETTLE_ENV = "REBALANCER_EXIT_SETTLE_S"


def _settle_max_s() -> float:
    raw = os.environ.get(SETTLE_ENV, "")
    try:
        value = float(raw) if raw.strip() else _SETTLE_MAX_S
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 600.0:  # NaN fails both comparisons
        log.warning("%s=%r is not a number of seconds from 0 to 600; using %s", SETTLE_ENV, raw, _SETTLE_MAX_S)
        return _SETTLE_MAX_S
    return value


def runnable_comm_threads(task_dir: str = "/proc/self/task") -> list[str] | None:
    """Names of this process's gloo threads that are running or runnable now (state R);
    None where the thread table cannot be read (not Linux)."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    busy = []
    for tid in tids:
        try:
            with open(os.path.join(task_dir, tid, "stat"), encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        state = stat[stat.rfind(")") + 2 : stat.rfind(")") + 3]
        if name.startswith(_COMM_THREAD_PREFIXES) and state == "R":
            busy.append(name)
    return busy


def settle_communication_threads(max_s: float = _SETTLE_MAX_S, task_dir: str = "/proc/self/task") -> bool:
    """Release the GIL in short sleeps until no gloo thread was runnable for
    ``_SETTLE_QUIET_POLLS`` polls in a row: a thread blocked on the GIL gets it during the
    first sleep and is runnable until it is done. True when they settled within ``max_s``."""
    if max_s <= 0:
        return True  # turned off
    deadline = time.monotonic() + max_s
    quiet = 0
    while quiet < _SETTLE_QUIET_POLLS:
        time.sleep(_SETTLE_POLL_S)
        busy = runnable_comm_threads(task_dir)
        if busy is None:
            return True  # nothing to read: the one sleep above is all we do
        quiet = 0 if busy else quiet + 1
        if time.monotonic() >= deadline:
            return False
    return True


def _after_fork_in_child() -> None:
    global _guard
    _guard = threading.Lock()  # the parent may have held it at the fork
    hooks = list(_live)
    _live.clear()  # the child's exit closes nothing
    for hook in hooks:
        try:
            hook._after_fork_in_child()
        except Exception:  # noqa: BLE001 - never fail a fork
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
