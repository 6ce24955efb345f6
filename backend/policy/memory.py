"""Peak device memory per rank: the fit ``m0 + m * b`` and the caps it implies (docs/design.md
invariant 8). Pure: no I/O, no torch.

The hook reports, every few steps, the peak memory the caching allocator handed out over
those steps at one local batch size (``trainer_hook.memory``). Per rank:

- :func:`fit_memory` keeps the largest recent peak at each batch size (an upper envelope:
  spikes are what run a card out of memory) and fits a line through those points that no
  point lies above. With one batch size only, the fixed part cannot be told from the
  per-sample part; the fit is then proportional (``m0 = 0``), which over-predicts every
  larger batch, so the cap it gives is safe until a second size is seen.
- :func:`memory_cap` is the largest local batch whose predicted peak stays under
  ``(1 - headroom) * total``.
- :func:`memory_bounds` turns the fits of a job into per-rank caps for the solver. A rank
  that measures memory but has no fit yet may only lose work: its cap is its current share.
  A rank that does not measure memory (CPU, an old hook) gets no cap.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from ._values import Compact

__all__ = [
    "DEFAULT_HEADROOM",
    "MemoryReading",
    "MemoryFit",
    "RankMemory",
    "fit_memory",
    "memory_cap",
    "memory_limit_bytes",
    "memory_bounds",
    "memory_violations",
    "format_bytes",
]

DEFAULT_HEADROOM = 0.1  # fraction of device memory the caps keep free
_SIZES_KEPT = 16  # distinct batch sizes the envelope remembers (the most recent ones)


@dataclass(frozen=True, slots=True)
class MemoryReading(Compact):
    """Peak allocated bytes over a few steps at ``local_batch_size`` (warm-up excluded)."""

    local_batch_size: int
    peak_bytes: int
    total_bytes: int | None = None
    reserved_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class MemoryFit(Compact):
    """``peak(b) = m0_bytes + m_bytes * b`` for one rank, fitted from ``n`` readings."""

    m0_bytes: float
    m_bytes: float  # per sample
    total_bytes: int | None
    n: int
    sizes: int  # distinct batch sizes behind the fit
    method: Literal["linear", "proportional", "flat"]
    max_peak_bytes: int  # the largest peak seen
    max_batch: int  # the largest local batch seen

    def predict(self, b: int) -> float:
        """Predicted peak bytes at local batch ``b`` (the fixed part alone at b = 0)."""
        return self.m0_bytes + self.m_bytes * b


@dataclass(frozen=True, slots=True)
class RankMemory(Compact):
    """What the policy knows about one rank's memory.

    ``source`` is what the hook measures with ("cuda", "rocm", "xpu", or "" for nothing:
    no cap). ``fit`` is None until enough readings arrived; ``total_bytes`` is the device's
    memory (from the readings or the hello). ``max_share`` is a hard ceiling from an
    out-of-memory error (the failing share minus one), or None.
    """

    source: str = ""
    fit: MemoryFit | None = None
    total_bytes: int | None = None
    max_share: int | None = None


def fit_memory(readings: Iterable[MemoryReading], *, min_readings: int = 2,
               flat: bool = False) -> MemoryFit | None:
    """Fit ``m0 + m * b`` above every recent per-size peak; None with too few readings.

    ``flat``: micro-batch placements, where b counts micro-batches a rank runs one after
    the other, so its peak does not grow with b: the fit is the largest peak seen
    (``m = 0``), and the cap is none while that fits, 0 (drain) when it does not.

    >>> r = [MemoryReading(8, 5_000), MemoryReading(8, 5_100), MemoryReading(16, 9_000)]
    >>> f = fit_memory(r); (f.method, round(f.m_bytes), round(f.m0_bytes))
    ('linear', 488, 1200)
    """
    peaks: dict[int, int] = {}
    total: int | None = None
    n = 0
    for r in readings:
        if r.local_batch_size <= 0 or r.peak_bytes <= 0:
            continue  # a drained rank's dummy step says nothing about b samples
        n += 1
        b = r.local_batch_size
        # Re-insert, so the dict's order is the order sizes were last seen.
        peaks[b] = max(peaks.pop(b, 0), r.peak_bytes)
        if r.total_bytes:
            total = r.total_bytes
    if n < min_readings or not peaks:
        return None
    if len(peaks) > _SIZES_KEPT:
        peaks = dict(list(peaks.items())[-_SIZES_KEPT:])
    pts = sorted(peaks.items())
    b_max, p_at_max = pts[-1]
    max_peak = max(p for _, p in pts)
    if flat:
        return MemoryFit(float(max_peak), 0.0, total, n, len(pts), "flat", max_peak, b_max)
    if len(pts) >= 2:
        xs = [float(b) for b, _ in pts]
        ys = [float(p) for _, p in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        m = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        if m > 0:
            m0 = max(y - m * x for x, y in zip(xs, ys, strict=True))  # no point above the line
            if m0 >= 0:
                return MemoryFit(m0, m, total, n, len(pts), "linear", max_peak, b_max)
    # One size (or a slope the noise hides): proportional through the largest batch's
    # peak, which over-predicts every larger batch.
    per = max(p / b for b, p in pts)
    return MemoryFit(0.0, per, total, n, len(pts), "proportional", max_peak, b_max)


def memory_limit_bytes(total_bytes: int, headroom: float = DEFAULT_HEADROOM) -> float:
    """Bytes a rank may use: ``(1 - headroom) * total``."""
    _check_headroom(headroom)
    return (1.0 - headroom) * total_bytes


def memory_cap(fit: MemoryFit, total_bytes: int | None, headroom: float = DEFAULT_HEADROOM,
               *, ceiling: int | None = None) -> int | None:
    """Largest local batch whose predicted peak stays under ``(1 - headroom) * total``
    (at most ``ceiling``); None when the total is unknown or nothing bounds it."""
    total = total_bytes or fit.total_bytes
    if not total:
        return None
    limit = memory_limit_bytes(total, headroom)
    if fit.m_bytes <= 0:
        return None if limit >= fit.m0_bytes else 0
    cap = math.floor((limit - fit.m0_bytes) / fit.m_bytes)
    cap = max(0, cap)
    # Guard the float division at the boundary: the cap's own prediction must fit.
    while cap > 0 and fit.predict(cap) > limit:
        cap -= 1
    return cap if ceiling is None else min(cap, ceiling)


def memory_bounds(ranks: Sequence[RankMemory], shares: Sequence[int], global_batch_size: int,
                  headroom: float = DEFAULT_HEADROOM) -> tuple[dict[int, int], dict[int, str]]:
    """Per-rank caps for the solver, and why each one is there.

    A rank with a fit: its :func:`memory_cap`. A rank that measures memory without a fit
    yet: its current share (it may only lose work). An out-of-memory ceiling applies on
    top. Ranks that do not measure memory get no cap.
    """
    _check_headroom(headroom)
    if len(ranks) != len(shares):
        raise ValueError(f"memory has {len(ranks)} ranks but shares has {len(shares)}.")
    caps: dict[int, int] = {}
    why: dict[int, str] = {}
    for i, rm in enumerate(ranks):
        cap: int | None = None
        if rm.fit is not None:
            cap = memory_cap(rm.fit, rm.total_bytes, headroom)
            if cap is not None:
                why[i] = "memory"
        elif rm.source:
            cap, why[i] = shares[i], "memory_unknown"
        if rm.max_share is not None and (cap is None or rm.max_share < cap):
            cap, why[i] = max(0, rm.max_share), "out_of_memory"
        if cap is not None and cap < global_batch_size:
            caps[i] = cap
        else:
            why.pop(i, None)
    return caps, why


def memory_violations(ranks: Sequence[RankMemory], shares: Sequence[int],
                      headroom: float = DEFAULT_HEADROOM) -> list[str]:
    """Sentences naming each rank whose share breaks its memory cap, with the predicted
    peak and the cap (for refusing a manual placement); empty when every rank fits."""
    out: list[str] = []
    for i, (rm, s) in enumerate(zip(ranks, shares, strict=True)):
        if rm.max_share is not None and s > rm.max_share:
            out.append(f"rank {i} ran out of memory at {rm.max_share + 1} samples and may hold "
                       f"at most {rm.max_share}, got {s}")
            continue
        if rm.fit is None or s <= 0:
            continue
        total = rm.total_bytes or rm.fit.total_bytes
        cap = memory_cap(rm.fit, total, headroom)
        if cap is not None and total and s > cap:
            out.append(f"rank {i} would peak at {format_bytes(rm.fit.predict(s))} with {s} samples, "
                       f"above its limit of {format_bytes(memory_limit_bytes(total, headroom))} "
                       f"({1 - headroom:.0%} of {format_bytes(total)}); its memory cap is {cap} samples")
    return out


def format_bytes(n: float) -> str:
    """``1.5 GiB``-style text for reasons and logs."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _check_headroom(headroom: float) -> None:
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) \
            or not 0 <= headroom < 1:
        raise ValueError(f"memory_headroom must be a fraction in [0, 1), got {headroom!r}.")
