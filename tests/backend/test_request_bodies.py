"""Control bodies say in /openapi.json what the server enforces (found by the OpenAPI fuzz's
schema-valid-request check): an unknown key is refused, not ignored, and policy params and
custom weights are numbers."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from backend.main import create_app
from backend.settings import Settings
from tests.backend.test_control_api import ADMIN, JOB, h, hooks


def test_unknown_keys_are_refused_and_the_schema_says_so(tmp_path: Path):
    app = create_app(Settings(db=f"sqlite:///{tmp_path / 'r.db'}", admin_token=ADMIN))
    with TestClient(app) as client, hooks(client):
        base = f"/api/v1/jobs/{JOB}"
        mode = client.get(base, headers=h(ADMIN)).json()["mode"]
        other = "auto" if mode != "auto" else "observe"
        r = client.put(f"{base}/mode", json={"mode": other, "reasn": "typo"}, headers=h(ADMIN))
        assert (r.status_code, r.json()["detail"]) == (422, "reasn: Extra inputs are not permitted")
        r = client.post(f"{base}/proposals", json={"shares": [16, 16, 16], "aply": True}, headers=h(ADMIN))
        assert (r.status_code, r.json()["detail"]) == (422, "aply: Extra inputs are not permitted")
        r = client.post(f"{base}/proposals/1/approve", json={"why": "x"}, headers=h(ADMIN))
        assert (r.status_code, r.json()["detail"]) == (422, "why: Extra inputs are not permitted")
        assert client.get(base, headers=h(ADMIN)).json()["mode"] == mode  # nothing applied

        schemas = client.get("/openapi.json").json()["components"]["schemas"]
        for name in ("ModeIn", "ManualPlacementIn", "DecisionIn"):
            assert schemas[name]["additionalProperties"] is False
        policy = schemas["PolicyIn"]["properties"]
        assert policy["params"]["additionalProperties"] == {"type": "number"}
        assert policy["custom_weights"]["additionalProperties"] == {"type": "number", "exclusiveMinimum": 0}
        r = client.put(f"{base}/policy", json={"params": {"alpha": "high"}}, headers=h(ADMIN))
        assert r.status_code == 422
