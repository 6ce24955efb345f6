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
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any

__all__ = ["track", "forget", "close_all"]

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
    """Close every hook still open (the atexit handler); errors are logged, never raised."""
    for hook in list(_live):
        try:
            hook._close_at_exit()
        except BaseException as exc:  # noqa: BLE001 - an exit handler must not fail the exit
            log.warning("closing a RebalanceHook at exit failed: %s: %s", type(exc).__name__, exc)


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
