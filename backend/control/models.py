"""Pydantic models of a job's policy settings: the limits come from the one table
(``backend.policy.limits``), and a bad value becomes one sentence that names the setting,
what it must be and what arrived.

``PolicyChanges`` is the body of ``PUT /api/v1/jobs/{job}/policy`` and what
``Controller.set_policy`` checks its changes with; defaults come from ``Settings`` (a field
left out keeps its value, an explicit null returns it to the backend default).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from backend.control.errors import InvalidError
from backend.policy.limits import POLICY_LIMITS, limit_text
from rebalancer_wire.protocol import MAX_GLOBAL_BATCH_SIZE, MAX_WORLD_SIZE

__all__ = ["Overrides", "PolicyChanges", "WORKLOADS", "Workload", "check_policy_changes", "policy_sentence"]

def _whole(v: Any) -> Any:
    # JSON Schema's integer includes 434.0: take a whole float as the integer it is.
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**53 else v


# The keys of pins, caps and floors are rank numbers (JSON object keys are strings).
_RANK_KEYS: dict[str, Any] = {"propertyNames": {"pattern": "^[0-9]{1,5}$"}}

Workload = Literal["llm", "vision", "diffusion", "recsys", "custom"]
WORKLOADS: tuple[str, ...] = get_args(Workload)


def _range(key: str) -> Any:
    """A policy setting's ``Field`` limits, from the one table (``POLICY_LIMITS``)."""
    kind, lo, hi = POLICY_LIMITS[key]
    if kind is int:
        return Field(ge=int(lo), le=int(hi), strict=True)
    return Field(ge=lo, le=hi, strict=True, allow_inf_nan=False)


class PolicyChanges(BaseModel):
    """Policy settings an admin may change (fields left out keep their value)."""

    model_config = ConfigDict(extra="forbid")

    strategy: str | None = Field(default=None, description="a registered strategy: static, profiled, predictive",
                                 json_schema_extra=lambda s: _strategy_enum(s))
    workload: Workload | None = Field(default=None, description="llm | vision | diffusion | recsys | custom")
    custom_weights: dict[str, Any] | None = Field(
        default=None, description="device type -> weight > 0, for workload custom",
        json_schema_extra={"additionalProperties": {"type": "number", "exclusiveMinimum": 0}})
    params: dict[str, Any] | None = Field(default=None, description="strategy-specific numbers",
                                          json_schema_extra={"additionalProperties": {"type": "number"}})
    min_gain: Annotated[float, _range("min_gain")] | None = Field(default=None, description="propose only above this predicted gain")
    cooldown_steps: Annotated[int, _range("cooldown_steps"), BeforeValidator(_whole)] | None = Field(default=None, description="steps to wait after each change")
    min_steps: Annotated[int, _range("min_steps"), BeforeValidator(_whole)] | None = Field(default=None, description="valid steps per rank before measuring strategies propose")
    window_steps: Annotated[int, _range("window_steps"), BeforeValidator(_whole)] | None = Field(default=None, description="recent steps used for a fit")
    max_move_fraction: Annotated[float, _range("max_move_fraction")] | None = Field(default=None, description="auto mode: most of B one change moves a rank")
    horizon_steps: Annotated[int, _range("horizon_steps"), BeforeValidator(_whole)] | None = Field(default=None, description="predictive: steps to forecast ahead")
    rollback_threshold: Annotated[float, _range("rollback_threshold")] | None = Field(default=None, description="auto mode: roll back when steps get this much slower")
    effect_window_steps: Annotated[int, _range("effect_window_steps"), BeforeValidator(_whole)] | None = Field(default=None, description="steps before/after a change to measure its effect")
    proposal_ttl_s: Annotated[float, _range("proposal_ttl_s")] | None = Field(default=None, description="seconds a proposal stays approvable")
    proposal_margin: Annotated[float, _range("proposal_margin")] | None = Field(default=None, description="a new proposal replaces the pending one only when its predicted step is this much shorter (plus the fit's noise)")
    proposal_min_age_s: Annotated[float, _range("proposal_min_age_s")] | None = Field(default=None, description="seconds a pending proposal stays before a better one may replace it")
    memory_headroom: Annotated[float, _range("memory_headroom")] | None = Field(default=None, description="fraction of device memory the memory caps keep free")

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


def _strategy_enum(schema: dict[str, Any]) -> None:
    # The document lists the strategies registered when it is built; the validator above
    # keeps its own sentence for any other name.
    from backend.policy import available_strategies

    schema["enum"] = [*available_strategies(), None]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


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
    if key in POLICY_LIMITS:
        return f"{key} must be {limit_text(key)}, got {got!r}."
    return f"{key or 'policy'}: {err['msg']}."


def check_policy_changes(changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` checked (InvalidError with the sentence); returns them unchanged."""
    try:
        PolicyChanges.model_validate(changes)
    except ValidationError as exc:
        raise InvalidError(exc.errors()[0]["msg"]) from None
    return changes


# --- overrides ------------------------------------------------------------------------------

Samples = Annotated[int, Field(ge=0, le=MAX_GLOBAL_BATCH_SIZE, strict=True), BeforeValidator(_whole)]
Rank = Annotated[int, Field(ge=0, lt=MAX_WORLD_SIZE)]


class Overrides(BaseModel):
    """A job's operator overrides: the body of ``PUT /api/v1/jobs/{job}/overrides`` (PUT
    replaces; empty values clear) and what the controller stores and the solver obeys.

    The ``Field``s hold the limits every job shares. A job's own (its ranks, its global
    batch ``B``) come in the validation context, ``{"world_size": n, "global_batch_size":
    B}``, as the controller validates; the first problem becomes one sentence naming the
    entry and the rule, the same whether the REST edge or the controller finds it.
    """

    model_config = ConfigDict(extra="forbid")

    pins: dict[Rank, Samples] = Field(default_factory=dict, description="rank -> exact share",
                                     json_schema_extra=_RANK_KEYS)
    caps: dict[Rank, Samples] = Field(default_factory=dict, description="rank -> most samples",
                                     json_schema_extra=_RANK_KEYS)
    floors: dict[Rank, Samples] = Field(default_factory=dict, description="rank -> fewest samples",
                                     json_schema_extra=_RANK_KEYS)
    drains: list[Rank] = Field(default_factory=list, max_length=MAX_WORLD_SIZE,
                               description="ranks that get no samples")
    granularity: Annotated[int, Field(ge=1, le=MAX_GLOBAL_BATCH_SIZE, strict=True), BeforeValidator(_whole)] = Field(
        default=1, description="shares are multiples of this (one rank may carry the remainder)")

    @model_validator(mode="wrap")
    @classmethod
    def _one_sentence(cls, data: Any, handler: Any, info: ValidationInfo) -> Any:
        ctx = info.context
        if ctx is None and isinstance(data, dict):
            # The REST edge, where the job is not known yet: the entries are kept as sent
            # for the controller, which validates them with the job's ranks and batch (the
            # sentences name the job's limits); only the other fields are checked here.
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise PydanticCustomError("policy", _unknown_override(unknown[0]))
            out = handler({k: v for k, v in data.items() if k not in Overrides.model_fields})
            for key in Overrides.model_fields:
                if key in data:
                    object.__setattr__(out, key, data[key])
            return out
        ctx = ctx or {}
        sentence = overrides_problem(data, world_size=ctx.get("world_size"),
                                     global_batch_size=ctx.get("global_batch_size"))
        if sentence is not None:
            raise PydanticCustomError("policy", sentence)
        try:
            return handler(data)
        except ValidationError as exc:  # a shape the checks above do not name (rare)
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise PydanticCustomError("policy", f"{where or 'overrides'}: {err['msg']}.") from None

    def entries(self) -> dict[str, Any]:
        """The override fields as they are (as sent, at the REST edge)."""
        return {key: getattr(self, key) for key in Overrides.model_fields}

    def normalised(self) -> dict[str, Any]:
        """The controller's dict: int rank keys, sorted distinct drains."""
        return {"pins": dict(self.pins), "caps": dict(self.caps), "floors": dict(self.floors),
                "drains": sorted(set(self.drains)), "granularity": self.granularity}


def _unknown_override(key: str) -> str:
    return f"Unknown override {key!r}; known: {', '.join(Overrides.model_fields)}."


def overrides_problem(o: Any, *, world_size: int | None, global_batch_size: int | None) -> str | None:
    """The first thing wrong with overrides ``o`` for a job of ``world_size`` ranks and
    global batch ``global_batch_size`` (None: not known here, the limits every job shares
    apply), as one sentence; None when they are valid."""
    n = world_size if world_size is not None else MAX_WORLD_SIZE
    b = global_batch_size if global_batch_size is not None else MAX_GLOBAL_BATCH_SIZE
    ranks = f"the job has ranks 0 to {n - 1}" if world_size is not None else f"a job has at most {n} ranks"
    if not isinstance(o, dict):
        return f"Overrides must be an object with pins, caps, floors, drains and granularity, got {o!r}."
    unknown = sorted(set(o) - set(Overrides.model_fields))
    if unknown:
        return _unknown_override(unknown[0])

    def rank_problem(r: Any, what: str) -> str | None:
        try:
            r = int(r)
        except (TypeError, ValueError):
            return f"{what} keys must be rank numbers, got {r!r}."
        if not 0 <= r < n:
            return f"{what} names rank {r} but {ranks}."
        return None

    for key in ("pins", "caps", "floors"):
        m = o.get(key) or {}
        if not isinstance(m, dict):
            return f"{key} must map ranks to samples, got {m!r}."
        for r, v in m.items():
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= b:
                return f"{key}[{r}] must be an integer between 0 and {b}, got {v!r}."
            if (bad := rank_problem(r, key)) is not None:
                return bad
    drains = o.get("drains") or []
    if not isinstance(drains, list):
        return f"drains must be a list of ranks, got {drains!r}."
    for r in drains:
        if isinstance(r, bool) or not isinstance(r, int):  # int() would take False, 1.5, "2"
            return f"drains must be a list of rank numbers, got {r!r}."
        if (bad := rank_problem(r, "drains")) is not None:
            return bad
    g = o.get("granularity", 1)
    if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= b:
        return f"granularity must be an integer between 1 and {b}, got {g!r}."
    both = sorted({int(r) for r in (o.get("pins") or {})} & {int(r) for r in drains})
    if both:
        return f"Rank {both[0]} is both pinned and drained; choose one."
    return None
