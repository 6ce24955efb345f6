"""docker-compose.yml and the Dockerfile, checked with a parser (no Docker engine here), with
`docker compose config` / `docker-compose config` where one of them is installed, and the
stack's scrape-token step run for real against a local backend."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.helpers.server import running_server

ROOT = Path(__file__).resolve().parents[1]
STACK = {"backend", "migrate", "proxy", "redis", "postgres", "scrape-token", "prometheus", "grafana"}
PG_URL = "postgresql://rebalancer:rebalancer@postgres:5432/rebalancer"
COMPOSE_ENV = {"REBALANCER_ADMIN_TOKEN": "compose-admin-secret-0123", "GRAFANA_ADMIN_PASSWORD": "pw"}


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _serve_args(service: dict) -> list[str]:
    """The `rebalancer serve ...` arguments of the backend's shell command."""
    assert service["entrypoint"] == ["sh", "-c"]
    (script,) = service["command"]
    words = shlex.split(script.split("&& exec rebalancer ", 1)[1])
    assert words[0] == "serve"
    return words


def test_services_ports_and_dependency():
    c = _compose()
    assert set(c["services"]) == STACK
    s = c["services"]
    backend, pg, redis, proxy, migrate = s["backend"], s["postgres"], s["redis"], s["proxy"], s["migrate"]
    assert backend["build"] == "." and migrate["build"] == "."
    # `--scale backend=N`: no replica publishes a port (N containers cannot share one); the
    # proxy does, and is the one address users and training hosts know.
    assert "ports" not in backend and backend["expose"] == ["8000"]
    assert proxy["ports"] == ["8000:8000"] and "container_name" not in backend and "hostname" not in backend
    assert backend["depends_on"] == {"migrate": {"condition": "service_completed_successfully"},
                                     "redis": {"condition": "service_healthy"}}
    assert proxy["depends_on"] == {"backend": {"condition": "service_healthy"}}  # the Dockerfile's HEALTHCHECK
    assert "HEALTHCHECK" in (ROOT / "Dockerfile").read_text()
    # The schema is made once, before the replicas start, so that they do not race to make it.
    assert migrate["command"] == ["db", "upgrade", "--db", PG_URL] and "restart" not in migrate
    assert migrate["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert s["scrape-token"]["depends_on"] == {"migrate": {"condition": "service_completed_successfully"}}
    assert pg["image"].startswith("postgres:16")
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert any(v.endswith(":/var/lib/postgresql/data") for v in pg["volumes"])
    assert "pgdata" in c["volumes"]
    assert redis["image"].startswith("redis:7") and redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert backend["environment"]["REBALANCER_REDIS_URL"] == "redis://redis:6379/0"
    assert proxy["image"].startswith("nginx:")
    assert _mounts(proxy)["/etc/nginx/nginx.conf"] == "./deploy/nginx/nginx.conf"
    assert "/healthz" in " ".join(proxy["healthcheck"]["test"])


def test_backend_points_at_the_postgres_service_with_its_credentials():
    c = _compose()
    backend, pg_env = c["services"]["backend"], c["services"]["postgres"]["environment"]
    cmd = _serve_args(backend)
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
    assert 'pip install ".[server,cluster]"' in text  # cluster: the Redis client for replicas
    assert 'ENTRYPOINT ["rebalancer"]' in text
    assert "COPY pyproject.toml" in text
    # Every package the wheel is built from is copied in, or the image's install misses it.
    import tomllib

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for name in (p.rstrip("*") for p in found["include"]):
        assert f"COPY {name} ./{name}" in text and (ROOT / name).is_dir(), name


def _mounts(service: dict) -> dict[str, str]:
    """Container path -> host path (or volume name) of a service's volumes."""
    out = {}
    for v in service.get("volumes", []):
        host, container = v.split(":")[:2]
        out[container] = host
    return out


def test_prometheus_and_grafana_get_the_deploy_files():
    c = _compose()
    prom, graf = c["services"]["prometheus"], c["services"]["grafana"]
    pm, gm = _mounts(prom), _mounts(graf)
    assert pm["/etc/prometheus"] == "./deploy/prometheus"
    cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    (scrape,) = cfg["scrape_configs"]
    # Every replica of the service (Docker's DNS: one A record a container), not one of them.
    assert scrape["dns_sd_configs"] == [{"names": ["backend"], "type": "A", "port": 8000, "refresh_interval": "30s"}]
    assert "static_configs" not in scrape
    token_path = Path(scrape["authorization"]["credentials_file"])
    assert pm[str(token_path.parent)] == "scrape-token"  # the volume the one-shot writes
    assert _mounts(c["services"]["scrape-token"])["/run/rebalancer"] == "scrape-token"
    assert f"/run/rebalancer/{token_path.name}" in c["services"]["scrape-token"]["command"][0]
    assert prom["depends_on"]["scrape-token"] == {"condition": "service_completed_successfully"}
    for rule_file in cfg["rule_files"]:
        assert (ROOT / "deploy/prometheus" / rule_file).is_file()
    assert gm["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/rebalancer.yml").read_text())
    (prov,) = provider["providers"]
    assert gm[prov["options"]["path"]] == "./deploy/grafana/dashboards"
    assert graf["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert {"promdata", "grafana", "scrape-token"} <= set(c["volumes"])
    for svc in c["services"].values():
        for host in _mounts(svc).values():
            if host.startswith("./"):
                assert (ROOT / host).exists(), host


def _compose_commands() -> list[list[str]]:
    cmds = []
    if shutil.which("docker-compose"):
        cmds.append(["docker-compose"])
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        cmds.append(["docker", "compose"])
    return cmds


@pytest.mark.skipif(not _compose_commands(), reason="neither docker-compose nor docker compose is installed")
@pytest.mark.multiproc
def test_compose_config_validates():
    for cmd in _compose_commands():
        got = subprocess.run([*cmd, "config", "--quiet"], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, **COMPOSE_ENV})
        assert got.returncode == 0, (cmd, got.stdout, got.stderr)
        # Without the secrets it refuses, naming the variable.
        env = {k: v for k, v in os.environ.items() if k not in COMPOSE_ENV}
        got = subprocess.run([*cmd, "config", "--quiet"], cwd=ROOT, capture_output=True, text=True, env=env)
        assert got.returncode != 0 and "REBALANCER_ADMIN_TOKEN" in got.stdout + got.stderr, (cmd, got)


@pytest.mark.multiproc
def test_scrape_token_step_makes_a_viewer_token_once(tmp_path: Path):
    """The one-shot's shell command, with a SQLite database and a temporary directory in
    place of PostgreSQL and the volume: it writes a token the backend accepts for /metrics,
    and a second run keeps it."""
    cmd = _compose()["services"]["scrape-token"]["command"][0]
    db = f"sqlite:///{tmp_path / 'rebalancer.db'}"
    cmd = cmd.replace("postgresql://rebalancer:rebalancer@postgres:5432/rebalancer", db)
    cmd = cmd.replace("/run/rebalancer", str(tmp_path))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    tokens = []
    for _ in range(2):
        got = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, env=env, timeout=60)
        assert got.returncode == 0, got
        tokens.append((tmp_path / "scrape.token").read_text())
    token = tokens[0]
    assert token.startswith("rb_") and token.count("\n") == 1 and tokens[1] == token
    with running_server(tmp_path, db_url=db) as server:
        req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {token.strip()}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert b"rebalancer_hook_connections" in r.read()
        status, _ = server.call("POST", "/api/v1/tokens", token.strip(), {"role": "viewer"})
        assert status == 403


def _nginx_replica_route() -> re.Pattern[str]:
    """The proxy's location that reaches one replica, as a Python pattern (PCRE's
    ``(?<name>`` is Python's ``(?P<name>``)."""
    conf = (ROOT / "deploy/nginx/nginx.conf").read_text()
    (regex,) = re.findall(r"location ~ (\^/replica/\S+) \{", conf)
    return re.compile(regex.replace("(?<", "(?P<"))


def _advertised(tmp_path: Path, public_url: str | None, hostname: str) -> str:
    """Run the backend's start command as compose would in a container named ``hostname``
    (``rebalancer`` replaced by a stand-in that prints what it got), returning the
    REBALANCER_ADVERTISE_URL the replica would start with."""
    (script,) = _compose()["services"]["backend"]["command"]
    default = re.search(r"\$\{REBALANCER_PUBLIC_URL:-([^}]+)\}", script)
    assert default is not None, script
    script = script.replace(default.group(0), public_url or default.group(1)).replace("$$", "$")  # compose's interpolation
    (tmp_path / "hostname").write_text(hostname + "\n")
    script = script.replace("/etc/hostname", str(tmp_path / "hostname"))
    script = script.replace("exec rebalancer", f"exec {shlex.quote(sys.executable)} -c "
                            "'import os, sys; print(os.environ[\"REBALANCER_ADVERTISE_URL\"], *sys.argv[1:])'")
    got = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert got.returncode == 0, got
    url, *argv = got.stdout.split()
    assert argv[0] == "serve" and "--db" in argv
    return url


@pytest.mark.multiproc
def test_each_replica_advertises_a_url_the_proxy_routes_to_it(tmp_path: Path):
    """The redirect design: every replica (generated container name, Docker's hostname the
    12-hex short id) advertises PUBLIC_URL/replica/<hostname>; a hook redirected there opens
    PUBLIC_URL/replica/<hostname>/ws/hook, which the proxy sends to that container's /ws/hook."""
    from backend.settings import Settings
    from trainer_hook.transport import hook_ws_url

    route = _nginx_replica_route()
    a, b = "0f3a9c21b7de", "7c1d00e4a5b9"
    url_a = _advertised(tmp_path, None, a)
    assert url_a == f"http://localhost:8000/replica/{a}"  # the default: hooks on the Docker host
    url_b = _advertised(tmp_path, "https://rebalancer.example:8443", b)
    assert url_b == f"https://rebalancer.example:8443/replica/{b}"
    for url, host in ((url_a, a), (url_b, b)):
        assert Settings(advertise_url=url).advertise_url == url  # the replica's start-up check
        ws = hook_ws_url(url)
        assert ws.endswith(f"/replica/{host}/ws/hook")
        path = urlsplit(ws).path
        m = route.fullmatch(path)
        assert m is not None and m["replica"] == host and m["rest"] == "/ws/hook", (route.pattern, path)
        # REST through the same prefix reaches the same replica (an operator action sent to
        # the owner named in a 409).
        m = route.fullmatch(f"/replica/{host}/api/v1/jobs/j/placements")
        assert m is not None and m["rest"] == "/api/v1/jobs/j/placements"
    # Only Docker's short-id form: the proxy is no way to reach other services or hosts.
    for path in ("/replica/postgres/x", "/replica/10.0.0.5/x", "/replica/0f3a9c21b7de.evil/x", "/ws/hook"):
        assert route.fullmatch(path) is None, path
