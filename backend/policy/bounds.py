"""Per-rank bounds from operator constraints, and checking a placement against them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .types import Constraints, InfeasibleError

__all__ = ["NO_CONSTRAINTS", "Bounds", "rank_bounds", "check_placement"]

NO_CONSTRAINTS = Constraints()


@dataclass(frozen=True, slots=True)
class Bounds:
    """Per-rank share bounds derived from constraints (granularity applied to free ranks)."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]
    fixed: frozenset[int]  # pinned or drained ranks: lo == hi, exempt from granularity
    granularity: int


def _ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def rank_bounds(world_size: int, global_batch_size: int, constraints: Constraints) -> Bounds:
    """Check constraints against each other and turn them into per-rank bounds.

    Raises ``ValueError`` for malformed constraints (rank out of range, negative values)
    and :class:`InfeasibleError` naming the constraint that breaks.
    """
    n, b_total, g = world_size, global_batch_size, constraints.granularity
    if not isinstance(g, int) or g < 1:
        raise ValueError(f"granularity must be an integer >= 1, got {g!r}.")
    for label, mapping in (("pin", constraints.pins), ("cap", constraints.caps),
                           ("floor", constraints.floors)):
        for rank, value in mapping.items():
            if not isinstance(rank, int) or not 0 <= rank < n:
                raise ValueError(
                    f"{label} for rank {rank!r}, but the job has {n} ranks (0-{n - 1})."
                )
            if not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"{label} for rank {rank} must be an integer >= 0, got {value!r}."
                )
    for rank in constraints.drains:
        if not isinstance(rank, int) or not 0 <= rank < n:
            raise ValueError(f"drain of rank {rank!r}, but the job has {n} ranks (0-{n - 1}).")

    lo = [0] * n
    hi = [b_total] * n
    fixed: set[int] = set()
    for rank in range(n):
        pin = constraints.pins.get(rank)
        cap = constraints.caps.get(rank)
        floor = constraints.floors.get(rank, 0)
        if rank in constraints.drains:
            if pin not in (None, 0):
                raise InfeasibleError(f"rank {rank} is both drained and pinned to {pin}.")
            if floor > 0:
                raise InfeasibleError(f"rank {rank} is drained but has a floor of {floor}.")
            lo[rank] = hi[rank] = 0
            fixed.add(rank)
            continue
        if pin is not None:
            if cap is not None and pin > cap:
                raise InfeasibleError(f"rank {rank} is pinned to {pin} above its cap of {cap}.")
            if pin < floor:
                raise InfeasibleError(f"rank {rank} is pinned to {pin} below its floor of {floor}.")
            if pin > b_total:
                raise InfeasibleError(
                    f"rank {rank} is pinned to {pin}, more than the global batch {b_total}."
                )
            lo[rank] = hi[rank] = pin
            fixed.add(rank)
            continue
        if cap is not None and floor > cap:
            raise InfeasibleError(f"rank {rank} has a floor of {floor} above its cap of {cap}.")
        lo[rank] = floor
        hi[rank] = min(b_total, cap) if cap is not None else b_total

    pinned_total = sum(lo[r] for r in fixed)
    if pinned_total > b_total:
        raise InfeasibleError(f"pins sum to {pinned_total} > global batch {b_total}.")
    remaining = b_total - pinned_total
    free = [r for r in range(n) if r not in fixed]
    if not free:
        if remaining:
            raise InfeasibleError(
                f"pins and drains leave 0 free ranks but {remaining} samples remain."
            )
        return Bounds(tuple(lo), tuple(hi), frozenset(fixed), g)
    if g > 1:
        rem = remaining % g
        for r in free:
            lo_g = -(-lo[r] // g) * g
            hi_g = hi[r] // g * g
            # The remainder rank may hold r + k*g, so a rank whose window has no multiple
            # of g is only a problem when it cannot hold the remainder either.
            if lo_g > hi_g and not (rem and _has_residue(lo[r], hi[r], g, rem)):
                raise InfeasibleError(
                    f"rank {r}: floor {lo[r]} and cap {hi[r]} admit no multiple of "
                    f"granularity {g}."
                )
    hi_sum = sum(hi[r] for r in free)
    if hi_sum < remaining:
        what = "caps" if constraints.caps else "bounds"
        left = "global batch" if not fixed else "samples left after pins and drains"
        raise InfeasibleError(
            f"{what} sum to {hi_sum} < {left} {remaining} on ranks {_ranks_text(free)}."
        )
    lo_sum = sum(lo[r] for r in free)
    if lo_sum > remaining:
        left = "global batch" if not fixed else "samples left after pins and drains"
        raise InfeasibleError(f"floors sum to {lo_sum} > {left} {remaining}.")
    return Bounds(tuple(lo), tuple(hi), frozenset(fixed), g)


def _has_residue(lo: int, hi: int, g: int, rem: int) -> bool:
    first = lo + (rem - lo) % g
    return first <= hi


def check_placement(shares: Sequence[int], global_batch_size: int,
                    constraints: Constraints = NO_CONSTRAINTS) -> str | None:
    """Why ``shares`` breaks the constraints, or ``None`` if it satisfies them."""
    n = len(shares)
    if sum(shares) != global_batch_size:
        return f"shares sum to {sum(shares)}, not the global batch {global_batch_size}"
    try:
        bounds = rank_bounds(n, global_batch_size, constraints)
    except ValueError as exc:
        return str(exc).rstrip(".")
    for r, s in enumerate(shares):
        if s < bounds.lo[r] or s > bounds.hi[r]:
            if r in constraints.drains:
                return f"rank {r} is drained but has {s} samples"
            if r in constraints.pins:
                return f"rank {r} is pinned to {constraints.pins[r]} but has {s} samples"
            return f"rank {r} has {s} samples outside its bounds {bounds.lo[r]}-{bounds.hi[r]}"
    g = bounds.granularity
    if g > 1:
        odd = [r for r, s in enumerate(shares) if r not in bounds.fixed and s % g]
        if len(odd) > 1 or (odd and sum(s for r, s in enumerate(shares)
                                        if r not in bounds.fixed) % g == 0):
            return f"rank {odd[0]} has {shares[odd[0]]} samples, not a multiple of granularity {g}"
    return None

