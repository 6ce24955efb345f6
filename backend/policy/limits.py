"""The one table of the policy settings' ranges: what ``PUT /api/v1/jobs/{job}/policy``
accepts (``backend.control.models.PolicyChanges``), what the backend's defaults may be
(``backend.settings.Settings``) and what ``decide`` runs with (``engine.check_config``).
Each reads its limits here, so the three cannot disagree (issue 37 found min_gain
0..1 in one and 0..0.99 in another). Both bounds are inclusive."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["POLICY_LIMITS", "limit_problem", "limit_text"]

# setting -> (int or float, lowest, highest)
POLICY_LIMITS: dict[str, tuple[type, float, float]] = {
    "min_gain": (float, 0.0, 0.99),
    "cooldown_steps": (int, 0, 1_000_000),
    "min_steps": (int, 1, 1_000_000),
    "window_steps": (int, 2, 100_000),
    "max_move_fraction": (float, 0.001, 1.0),
    "horizon_steps": (int, 1, 100_000),
    "rollback_threshold": (float, 0.0, 1.0),
    "effect_window_steps": (int, 2, 10_000),
    "proposal_ttl_s": (float, 1.0, 7 * 86400.0),
    "proposal_margin": (float, 0.0, 0.5),
    "proposal_min_age_s": (float, 0.0, 3600.0),
    "memory_headroom": (float, 0.0, 0.9),
}


def _n(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def limit_text(key: str) -> str:
    """``"an integer between 1 and 100000"``: what ``key`` must be."""
    kind, lo, hi = POLICY_LIMITS[key]
    return f"{'an integer' if kind is int else 'a number'} between {_n(lo)} and {_n(hi)}"


def limit_problem(key: str, value: Any) -> str | None:
    """``"must be ... got ..."`` when ``value`` is out of ``key``'s range or of the wrong
    kind (a whole float counts as an integer); None when it is fine."""
    kind, lo, hi = POLICY_LIMITS[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (kind is float or float(value).is_integer()) and lo <= value <= hi
    return None if ok else f"must be {limit_text(key)}, got {value!r}"
