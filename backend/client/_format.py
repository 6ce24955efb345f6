"""Text helpers the client's commands share: a number or a dash, a duration, a table."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["num", "duration", "table"]


def num(v: Any, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)
