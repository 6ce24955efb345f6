"""What the controller hands the policy: constraints, settings and override checks."""

from __future__ import annotations

import pytest

from backend.control.errors import InvalidError
from backend.control.inputs import (
    check_overrides,
    constraints_from,
    knob,
    policy_config,
    policy_settings,
    validate_overrides,
)
from backend.settings import Settings


def test_policy_config_caps_moves_in_auto_mode_only():
    settings = Settings(auto_max_move_fraction=0.2, min_gain=0.1)
    assert policy_config({}, "auto", settings).max_move_fraction == 0.2
    assert policy_config({}, "approve", settings).max_move_fraction is None
    assert policy_config({"min_gain": 0.3}, "auto", settings).min_gain == 0.3
    assert policy_config({}, "auto", settings).min_gain == 0.1
    assert policy_settings({}, "approve", settings)["max_move_fraction"] == 0.2


# Settings field -> the PolicyConfig field whose default it takes (one owner: the policy).
POLICY_DEFAULTS = {"default_strategy": "strategy", "default_workload": "workload", "min_gain": "min_gain",
                   "cooldown_steps": "cooldown_steps", "min_steps": "min_steps",
                   "policy_window_steps": "window_steps", "horizon_steps": "horizon_steps",
                   "memory_headroom": "memory_headroom"}


def test_the_backend_defaults_of_policy_settings_are_the_policys():
    from dataclasses import fields

    from backend.policy.types import PolicyConfig

    settings, cfg = Settings(), PolicyConfig()
    assert {k: getattr(settings, k) for k in POLICY_DEFAULTS} == {k: getattr(cfg, v) for k, v in POLICY_DEFAULTS.items()}
    # Every PolicyConfig field with a default the backend also sets is in the table above.
    shared = {f.name for f in fields(PolicyConfig)} - {"custom_weights", "max_move_fraction", "params"}
    assert shared == set(POLICY_DEFAULTS.values())
    # A job with no settings of its own runs the policy's defaults (outside auto mode).
    assert policy_config({}, "approve", settings) == cfg


def test_knobs_default_to_the_settings_of_the_same_name():
    assert knob({}, Settings(proposal_ttl_s=120.0), "proposal_ttl_s") == 120.0
    assert knob({"rollback_threshold": 0.2}, Settings(), "rollback_threshold") == 0.2
    with pytest.raises(ValueError, match="Unknown controller knob 'min_gain'"):
        knob({}, Settings(), "min_gain")


def test_one_table_holds_the_ranges_of_the_policy_settings():
    """PUT /policy, the backend's defaults and the policy itself read one table (issue 37
    found min_gain 0..1 in one place and 0..0.99 in another)."""
    from dataclasses import replace

    from pydantic import ValidationError

    from backend.control.models import PolicyChanges, check_policy_changes
    from backend.policy.engine import check_config
    from backend.policy.limits import POLICY_LIMITS
    from backend.policy.types import PolicyConfig
    from backend.settings import _POLICY_FIELDS

    numeric = set(PolicyChanges.model_fields) - {"strategy", "workload", "custom_weights", "params"}
    assert numeric == set(POLICY_LIMITS) == set(_POLICY_FIELDS.values())
    for setting, key in _POLICY_FIELDS.items():
        kind, lo, hi = POLICY_LIMITS[key]
        step = 1 if kind is int else 0.001
        assert check_policy_changes({key: kind(lo)}) and check_policy_changes({key: kind(hi)})
        for bad in (lo - step, hi + step):
            with pytest.raises(InvalidError, match=f"^{key} must be "):
                check_policy_changes({key: kind(bad)})
            with pytest.raises(ValidationError, match=f"REBALANCER_{setting.upper()} must be "):
                Settings(**{setting: kind(bad)})
            if key in ("min_gain", "cooldown_steps", "min_steps", "horizon_steps", "max_move_fraction"):
                with pytest.raises(ValueError, match=f"^policy.{key} must be "):
                    check_config(replace(PolicyConfig(), **{key: kind(bad)}))
    # The REST schema (what /openapi.json and the client show) states the same bounds.
    schema = PolicyChanges.model_json_schema()["properties"]
    for key, (kind, lo, hi) in POLICY_LIMITS.items():
        (bounds,) = [a for a in schema[key]["anyOf"] if a["type"] != "null"]
        assert (bounds["type"], bounds["minimum"], bounds["maximum"]) == (
            "integer" if kind is int else "number", lo, hi), key


def test_overrides_validate_and_become_constraints():
    ov = validate_overrides({"pins": {"0": 8}, "drains": [2], "granularity": 4},
                            world_size=3, global_batch_size=48)
    assert ov == {"pins": {0: 8}, "caps": {}, "floors": {}, "drains": [2], "granularity": 4}
    cons = constraints_from(ov)
    assert cons.pins == {0: 8} and cons.drains == frozenset({2}) and cons.granularity == 4
    check_overrides(ov, [8, 40, 0], global_batch_size=48)
    with pytest.raises(InvalidError, match="rank 2 is drained but gets 4 samples"):
        check_overrides(ov, [8, 36, 4], global_batch_size=48)


def test_overrides_name_the_bad_entry():
    with pytest.raises(InvalidError, match=r"drains names rank 3 but the job has ranks 0 to 2\."):
        validate_overrides({"drains": [3]}, world_size=3, global_batch_size=48)
    with pytest.raises(InvalidError, match="Rank 1 is both pinned and drained; choose one."):
        validate_overrides({"pins": {1: 0}, "drains": [1]}, world_size=3, global_batch_size=48)


def test_overrides_model_checks_the_jobs_limits_from_its_context_and_documents_the_shared_ones():
    from pydantic import ValidationError

    from backend.api.routes.control import OverridesIn
    from backend.control.models import Overrides

    job = {"world_size": 3, "global_batch_size": 48}
    ok = Overrides.model_validate({"pins": {"0": 8}, "drains": [2, 2], "granularity": 4}, context=job)
    assert ok.normalised() == {"pins": {0: 8}, "caps": {}, "floors": {}, "drains": [2], "granularity": 4}
    for bad, sentence in [
        ({"caps": {"1": 49}}, "caps[1] must be an integer between 0 and 48, got 49."),
        ({"floors": {"7": 1}}, "floors names rank 7 but the job has ranks 0 to 2."),
        ({"drains": ["1"]}, "drains must be a list of rank numbers, got '1'."),
        ({"drains": [1.0]}, "drains must be a list of rank numbers, got 1.0."),
        ({"weights": {}}, "Unknown override 'weights'; known: pins, caps, floors, drains, granularity."),
    ]:
        with pytest.raises(ValidationError) as got:
            Overrides.model_validate(bad, context=job)
        assert got.value.errors()[0]["msg"] == sentence
    # At the REST edge the job is unknown: entries pass as sent (the controller checks them
    # with the job's limits), unknown keys and the reason are checked at once.
    edge = OverridesIn.model_validate({"caps": {"1": 99}, "reason": "why"})
    assert edge.entries()["caps"] == {"1": 99} and edge.reason == "why"
    with pytest.raises(ValidationError):
        OverridesIn.model_validate({"cap": {}})
    with pytest.raises(ValidationError):
        OverridesIn.model_validate({"reason": "x" * 5000})
    schema = Overrides.model_json_schema()["properties"]
    assert schema["caps"]["additionalProperties"] == {"maximum": 16777216, "minimum": 0, "type": "integer"}
    assert schema["granularity"]["minimum"] == 1
