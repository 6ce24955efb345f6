"""A policy change valid on its own but not with the job's other settings is refused with 400 (the job's state refuses it; the request itself is well formed)
(found by the OpenAPI fuzz: window_steps below min_steps was stored, and every policy run
after it failed with a traceback in the server's log)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from backend.main import create_app
from backend.settings import Settings
from tests.backend.test_control_api import ADMIN, JOB, h, hooks


def test_a_policy_change_that_breaks_the_combined_settings_is_refused(tmp_path: Path):
    app = create_app(Settings(db=f"sqlite:///{tmp_path / 'r.db'}", admin_token=ADMIN))
    with TestClient(app) as client, hooks(client):
        base = f"/api/v1/jobs/{JOB}/policy"
        before = client.get(base, headers=h(ADMIN)).json()
        r = client.put(base, json={"window_steps": 2}, headers=h(ADMIN))
        assert r.status_code == 400
        assert r.json()["detail"] == (
            f"policy.window_steps (2) must be at least policy.min_steps ({before['min_steps']}).")
        r = client.put(base, json={"min_steps": 999_999}, headers=h(ADMIN))
        assert r.status_code == 400
        assert r.json()["detail"] == (
            f"policy.window_steps ({before['window_steps']}) must be at least policy.min_steps (999999).")
        assert client.get(base, headers=h(ADMIN)).json() == before  # nothing stored
        r = client.put(base, json={"window_steps": 12, "min_steps": 12}, headers=h(ADMIN))
        assert r.status_code == 200 and r.json()["window_steps"] == 12


def test_settings_whose_policy_defaults_break_the_combined_rule_are_refused_at_startup():
    # Found in the TorchElastic test: REBALANCER_MIN_STEPS=1000000 with the default policy
    # window (100) started a server whose every policy run failed with a traceback.
    with pytest.raises(ValueError, match=r"REBALANCER_POLICY_WINDOW_STEPS \(100\) must be at least "
                                         r"REBALANCER_MIN_STEPS \(1000000\)"):
        Settings(min_steps=1_000_000)
    assert Settings(min_steps=100, policy_window_steps=100).min_steps == 100
