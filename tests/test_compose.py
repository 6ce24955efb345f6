"""docker-compose.yml and the Dockerfile, checked with a parser (no Docker engine here)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_ports_and_dependency():
    c = _compose()
    assert set(c["services"]) == {"backend", "postgres"}
    backend, pg = c["services"]["backend"], c["services"]["postgres"]
    assert backend["build"] == "."
    assert backend["ports"] == ["8000:8000"]
    assert backend["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert pg["image"].startswith("postgres:16")
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert any(v.endswith(":/var/lib/postgresql/data") for v in pg["volumes"])
    assert "pgdata" in c["volumes"]


def test_backend_points_at_the_postgres_service_with_its_credentials():
    c = _compose()
    backend, pg_env = c["services"]["backend"], c["services"]["postgres"]["environment"]
    cmd = backend["command"]
    assert cmd[0] == "serve"
    args = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    assert args["--host"] == "0.0.0.0" and args["--port"] == "8000"
    m = re.fullmatch(r"postgresql://([^:]+):([^@]+)@postgres:5432/(\w+)", args["--db"])
    assert m is not None, args["--db"]
    assert m.groups() == (pg_env["POSTGRES_USER"], pg_env["POSTGRES_PASSWORD"], pg_env["POSTGRES_DB"])
    # Bound to 0.0.0.0 the backend refuses to start without a token, so compose demands one.
    assert backend["environment"]["REBALANCER_ADMIN_TOKEN"].startswith("${REBALANCER_ADMIN_TOKEN:?")


def test_dockerfile_installs_the_server_extra_and_runs_the_cli():
    text = (ROOT / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert 'pip install -e ".[server]"' in text
    assert 'ENTRYPOINT ["rebalancer"]' in text
    for path in ("backend", "trainer_hook", "frontend", "pyproject.toml"):
        assert path in text and (ROOT / path).exists()
