"""The one home of a job's ETA, running cost and savings figures; the jobs routes, the
``/forecast`` route, the dashboard feed and the stored run summary all call these.

- ETA: steps left after the newest batch times the recent step time (``eta_seconds``).
- Cost: the sum of the ranks' hourly prices (settings' ``price_for``); idle cost is that
  times the job's idle fraction; cost to finish is the ETA times the hourly cost.
- Savings: wall time the run took against what the uniform split would have taken, summed
  over closed batches, and that time priced at the job's hourly cost.
- Goodput: useful compute over paid device time, the ranks' mean compute over the job's
  step (``goodput``); the cost of the rest is ``cost_per_hour * (1 - goodput)``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from backend.live.state import JobView, eta_seconds

__all__ = ["Forecast", "forecast", "Savings", "savings", "eta_seconds", "hourly_cost", "goodput"]

PriceFor = Callable[[str, str], "float | None"]


@dataclass(frozen=True, slots=True)
class Forecast:
    batch_index: int | None
    total_steps: int | None
    remaining_steps: int | None
    step_ms: float | None
    eta_s: float | None
    cost_per_hour: float | None
    idle_cost_per_hour: float | None
    unpriced_ranks: int
    cost_to_finish: float | None

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def hourly_cost(price_for: PriceFor, devices: Iterable[tuple[str, str]]) -> tuple[float | None, int]:
    """(USD per hour of the ranks' devices, ranks without a price); None when none has one.
    ``devices`` are (device_type, device_name) per rank."""
    total, priced, unpriced = 0.0, False, 0
    for (device_type, device_name), n in Counter(devices).items():  # a price per kind of device
        p = price_for(device_type, device_name)
        if p is None:
            unpriced += n
        else:
            total, priced = total + p * n, True
    return (total if priced else None), unpriced


def goodput(view: JobView) -> float | None:
    """Useful compute over paid device time (0..1): the mean over ranks with data of their
    compute (forward and backward) over the job's step; None until steps came. What the
    rest costs an hour is ``cost_per_hour * (1 - goodput)``; docs/causes.md says where it goes."""
    compute = [r.compute_ms for r in view.ranks if r.compute_ms is not None]
    if not compute or not view.step_ms:
        return None
    return min(1.0, max(0.0, sum(compute) / len(compute) / view.step_ms))


def forecast(view: JobView, price_for: PriceFor, total_steps: int | None = None) -> Forecast:
    """ETA and cost of ``view``'s job; ``total_steps`` overrides what its hooks reported."""
    total = view.total_steps if total_steps is None else total_steps
    cost_h, unpriced = hourly_cost(price_for, ((r.device_type, r.device_name) for r in view.ranks))
    done = (view.batch_index + 1) if view.batch_index is not None else 0
    eta = eta_seconds(total, view.batch_index, view.step_ms)
    return Forecast(
        batch_index=view.batch_index, total_steps=total,
        remaining_steps=max(total - done, 0) if total is not None else None,
        step_ms=view.step_ms, eta_s=eta, cost_per_hour=cost_h,
        idle_cost_per_hour=(cost_h * view.idle_fraction
                            if cost_h is not None and view.idle_fraction is not None else None),
        unpriced_ranks=unpriced,
        cost_to_finish=eta / 3600.0 * cost_h if eta is not None and cost_h is not None else None,
    )


@dataclass(frozen=True, slots=True)
class Savings:
    measured_s: float
    uniform_s: float
    saved_s: float
    saved_cost: float | None
    faster: float | None  # 1 - measured/uniform: how much faster than the uniform split

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self)


def savings(*, measured_ms: float, uniform_ms: float, saved_ms: float,
            cost_per_hour: float | None) -> Savings:
    """Time (and money, when priced) the run saved against the uniform split."""
    return Savings(
        measured_s=round(measured_ms / 1000, 3), uniform_s=round(uniform_ms / 1000, 3),
        saved_s=round(saved_ms / 1000, 3),
        saved_cost=round(saved_ms / 3.6e6 * cost_per_hour, 6) if cost_per_hour else None,
        faster=round(1.0 - measured_ms / uniform_ms, 6) if uniform_ms > 0 else None,
    )
