"""Pydantic models of a job's policy settings: the limits live in the ``Field``s, and a bad
value becomes one sentence that names the setting, what it must be and what arrived.

``PolicyChanges`` is the body of ``PUT /api/v1/jobs/{job}/policy`` and what
``Controller.set_policy`` checks its changes with; defaults come from ``Settings`` (a field
left out keeps its value, an explicit null returns it to the backend default).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, get_args

from annotated_types import Ge, Le
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from backend.control.errors import InvalidError

__all__ = ["PolicyChanges", "WORKLOADS", "Workload", "check_policy_changes", "policy_sentence"]

Workload = Literal["llm", "vision", "diffusion", "recsys", "custom"]
WORKLOADS: tuple[str, ...] = get_args(Workload)


class PolicyChanges(BaseModel):
    """Policy settings an admin may change (fields left out keep their value)."""

    model_config = ConfigDict(extra="forbid")

    strategy: str | None = Field(default=None, description="a registered strategy: static, profiled, predictive")
    workload: Workload | None = Field(default=None, description="llm | vision | diffusion | recsys | custom")
    custom_weights: dict[str, Any] | None = Field(default=None, description="device type -> weight > 0, for workload custom")
    params: dict[str, Any] | None = Field(default=None, description="strategy-specific numbers")
    min_gain: Annotated[float, Field(ge=0.0, le=0.99, strict=True, allow_inf_nan=False)] | None = Field(default=None, description="propose only above this predicted gain")
    cooldown_steps: Annotated[int, Field(ge=0, le=1_000_000, strict=True)] | None = Field(default=None, description="steps to wait after each change")
    min_steps: Annotated[int, Field(ge=1, le=1_000_000, strict=True)] | None = Field(default=None, description="valid steps per rank before measuring strategies propose")
    window_steps: Annotated[int, Field(ge=2, le=100_000, strict=True)] | None = Field(default=None, description="recent steps used for a fit")
    max_move_fraction: Annotated[float, Field(ge=0.001, le=1.0, strict=True, allow_inf_nan=False)] | None = Field(default=None, description="auto mode: most of B one change moves a rank")
    horizon_steps: Annotated[int, Field(ge=1, le=100_000, strict=True)] | None = Field(default=None, description="predictive: steps to forecast ahead")
    rollback_threshold: Annotated[float, Field(ge=0.0, le=1.0, strict=True, allow_inf_nan=False)] | None = Field(default=None, description="auto mode: roll back when steps get this much slower")
    effect_window_steps: Annotated[int, Field(ge=2, le=10_000, strict=True)] | None = Field(default=None, description="steps before/after a change to measure its effect")
    proposal_ttl_s: Annotated[float, Field(ge=1.0, le=7 * 86400.0, strict=True, allow_inf_nan=False)] | None = Field(default=None, description="seconds a proposal stays approvable")

    @model_validator(mode="wrap")
    @classmethod
    def _one_sentence(cls, data: Any, handler: Any) -> Any:
        try:
            out = handler(data)
        except ValidationError as exc:
            raise PydanticCustomError("policy", policy_sentence(exc, data)) from None
        for key, what in (("custom_weights", "device types to weights > 0"), ("params", "names to numbers")):
            v = getattr(out, key)
            if v is not None and not all(
                    isinstance(k, str) and _finite(x) and (key == "params" or x > 0) for k, x in v.items()):
                raise PydanticCustomError("policy", f"{key} must map {what}, got {v!r}.")
        if out.strategy is not None:
            from backend.policy import available_strategies

            known = available_strategies()
            if out.strategy not in known:
                raise PydanticCustomError(
                    "policy", f"Unknown strategy {out.strategy!r}; choose one of {', '.join(known)}.")
        return out


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _bound(key: str) -> tuple[str, float, float]:
    info = PolicyChanges.model_fields[key]
    ann = next(a for a in get_args(info.annotation) if a is not type(None))
    kind, *meta = get_args(ann)
    lo = float(next(m.ge for m in meta[0].metadata if isinstance(m, Ge)))  # type: ignore[arg-type]
    hi = float(next(m.le for m in meta[0].metadata if isinstance(m, Le)))  # type: ignore[arg-type]
    return ("an integer" if kind is int else "a number"), lo, hi


def _n(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def policy_sentence(exc: ValidationError, data: Any) -> str:
    """The first error of ``exc`` as the one sentence the API answers with."""
    err = exc.errors()[0]
    key = str(err["loc"][0]) if err["loc"] else ""
    if err["type"] == "extra_forbidden":
        known = ", ".join(["strategy", "workload", "custom_weights", "params",
                           *(k for k in PolicyChanges.model_fields if k not in
                             ("strategy", "workload", "custom_weights", "params"))])
        return f"Unknown policy setting {key!r}; known settings: {known}."
    got = data.get(key) if isinstance(data, dict) else err.get("input")
    if key == "workload":
        return f"workload must be one of {', '.join(WORKLOADS)}; got {got!r}."
    if key in ("custom_weights", "params"):
        what = "device types to weights > 0" if key == "custom_weights" else "names to numbers"
        return f"{key} must map {what}, got {got!r}."
    if key in PolicyChanges.model_fields and key != "strategy":
        noun, lo, hi = _bound(key)
        return f"{key} must be {noun} between {_n(lo)} and {_n(hi)}, got {got!r}."
    return f"{key or 'policy'}: {err['msg']}."


def check_policy_changes(changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` checked (InvalidError with the sentence); returns them unchanged."""
    try:
        PolicyChanges.model_validate(changes)
    except ValidationError as exc:
        raise InvalidError(exc.errors()[0]["msg"]) from None
    return changes
