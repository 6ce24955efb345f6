"""A loaded machine on demand: processes that spin on the CPUs beside a benchmark."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator

__all__ = ["busy_loops"]


def _spin() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2**31


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """``n`` processes that spin until the block ends; killed and reaped then, none left."""
    procs = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join()
