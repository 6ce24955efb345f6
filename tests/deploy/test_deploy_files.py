"""deploy/ and docs/metrics.md against the metric contract (backend/metrics_contract.py), the
shipped rules and config through promtool (Debian's prometheus package), and the proxy's
nginx config (read here; `nginx -t` where nginx is installed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from backend.metrics_contract import (
    CONTRACT,
    GPU_LABELS,
    THROTTLE_REASONS,
    by_name,
    exposed_names,
    markdown_table,
)
from tests.helpers import prometheus as promh
from trainer_hook.probe import CLOCK_EVENT_NAMES

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "rebalancer.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
NGINX = DEPLOY / "nginx" / "nginx.conf"
EXPOSED = {n for m in CONTRACT for n in exposed_names(m)}
_NAME = re.compile(r"\b(rebalancer_[a-z_]+)\b")
needs_promtool = pytest.mark.skipif(not promh.installed(), reason=promh.INSTALL_HINT)


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels() -> list[dict[str, Any]]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def test_the_placement_counter_names_every_placement_source():
    from backend.metrics_contract import by_name
    from backend.storage.control import PLACEMENT_SOURCES

    help_text = by_name()["rebalancer_placements_total"].help
    assert all(source in help_text for source in PLACEMENT_SOURCES), (help_text, PLACEMENT_SOURCES)


def test_docs_carry_the_contract_table():
    assert markdown_table() in (ROOT / "docs" / "metrics.md").read_text(), (
        "docs/metrics.md must contain backend.metrics_contract.markdown_table() verbatim; regenerate it")


def test_contract_names_follow_prometheus_conventions():
    names = [m.name for m in CONTRACT]
    assert len(names) == len(set(names))
    for m in CONTRACT:
        assert re.fullmatch(r"rebalancer_[a-z][a-z0-9_]*", m.name), m.name
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        if m.unit not in ("1",):
            assert m.name.endswith(f"_{m.unit}") or m.name.endswith(f"_{m.unit}_total"), m.name
        if m.name.startswith("rebalancer_device_"):  # joinable with dcgm-exporter's series
            assert m.labels[:2] == ("job", "rank") and set(GPU_LABELS) <= set(m.labels), m.name
    assert THROTTLE_REASONS == tuple(CLOCK_EVENT_NAMES.values())
    assert GPU_LABELS == ("Hostname", "gpu", "UUID", "modelName")  # dcgm-exporter's spelling


def test_every_grafana_query_names_contract_metrics_only():
    exprs = [t["expr"] for p in _panels() for t in p["targets"]]
    exprs += [a["expr"] for a in _dashboard()["annotations"]["list"]]
    exprs += [v["definition"] for v in _dashboard()["templating"]["list"] if v["type"] == "query"]
    used = set()
    for expr in exprs:
        names = set(_NAME.findall(expr))
        assert names, f"a query names no Rebalancer metric: {expr!r}"
        assert names <= EXPOSED, f"not in the contract: {names - EXPOSED} in {expr!r}"
        used |= names
    # Every metric of the contract has a panel (histograms through their buckets).
    assert {m.name for m in CONTRACT if not set(exposed_names(m)).isdisjoint(used)} == set(by_name())


def test_grafana_dashboard_is_well_formed_and_uses_the_provisioned_datasource():
    dash = _dashboard()
    assert dash["uid"] == "rebalancer" and dash["schemaVersion"] >= 36
    var = {v["name"]: v for v in dash["templating"]["list"]}
    assert var["datasource"]["type"] == "datasource" and var["datasource"]["query"] == "prometheus"
    assert var["job"]["includeAll"] and var["job"]["multi"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in _panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for t in p["targets"]:
            if "rebalancer_" in t["expr"] and not re.search(r"\bjob\b", t["expr"]):
                continue  # backend-wide series
            assert 'job=~"$job"' in t["expr"], (p["title"], t["expr"])
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090" and source["isDefault"]


def test_alert_rules_name_contract_metrics_only():
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {"RebalancerStragglerUnbalanced", "RebalancerProposalWaiting",
                                           "RebalancerPlacementRolledBack", "RebalancerRankLost",
                                           "RebalancerBackendDown", "RebalancerBackendAbsent"}
    for r in rules:
        names = set(_NAME.findall(r["expr"]))
        assert names <= EXPOSED, (r["alert"], names - EXPOSED)
        assert names or r["expr"].startswith(("up{", "absent(up{")), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"]


@needs_promtool
@pytest.mark.multiproc
def test_promtool_accepts_the_shipped_rules_and_config():
    def run(*args: str) -> None:
        got = subprocess.run([promh.PROMTOOL, *args], capture_output=True, text=True, cwd=ROOT)
        assert got.returncode == 0, got.stdout + got.stderr

    run("check", "rules", str(ALERTS))
    # The shipped token file exists only inside the compose stack; the full check (files
    # included) runs on the test's copy in test_prometheus.py.
    run("check", "config", "--syntax-only", str(DEPLOY / "prometheus" / "prometheus.yml"))


@needs_promtool
@pytest.mark.multiproc
def test_alerts_fire_on_the_series_they_are_for():
    """promtool's rule unit tests (tests/deploy/alerts_test.yml): fires, and stays quiet."""
    got = subprocess.run([promh.PROMTOOL, "test", "rules", str(Path(__file__).with_name("alerts_test.yml"))],
                         capture_output=True, text=True)
    assert got.returncode == 0 and "SUCCESS" in got.stdout, got.stdout + got.stderr


@needs_promtool
@pytest.mark.multiproc
def test_promtool_accepts_the_full_config_with_its_files(tmp_path: Path):
    """`promtool check config` without --syntax-only (the rule file loaded, the token file
    read), on a copy whose token path points at a file that exists."""
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (scrape,) = cfg["scrape_configs"]
    (tmp_path / "scrape.token").write_text("rb_viewer-secret\n")
    scrape["authorization"]["credentials_file"] = str(tmp_path / "scrape.token")
    cfg["rule_files"] = [str(DEPLOY / "prometheus" / f) for f in cfg["rule_files"]]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    got = subprocess.run([promh.PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True)
    assert got.returncode == 0 and "SUCCESS" in got.stdout, got.stdout + got.stderr


def _nginx_blocks() -> tuple[str, dict[str, str]]:
    """The server block's own directives, and each location's body by its match."""
    text = "\n".join(line.split("#", 1)[0] for line in NGINX.read_text().splitlines())
    (server,) = re.findall(r"server \{(.*)\n    \}", text, re.S)
    block = r"\n        location (.+?) \{\n(.*?)\n        \}"  # by indentation: a regex has braces
    locations = dict(re.findall(block, server, re.S))
    own = re.sub(block, "", server, flags=re.S)
    return own, locations


def _directives(block: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for stmt in block.split(";"):
        words = stmt.split()
        if words:
            out.setdefault(words[0], []).append(" ".join(words[1:]))
    return out


def test_the_proxy_forwards_websockets_to_every_replica_and_to_one_by_name():
    text = NGINX.read_text()
    own, locations = _nginx_blocks()
    d = _directives(own)
    assert d["listen"] == ["8000"]
    # Websockets: HTTP/1.1, the Upgrade and Connection headers passed on (a map of
    # $http_upgrade), timeouts far longer than a slow step or an open dashboard.
    assert d["proxy_http_version"] == ["1.1"]
    headers = dict(h.split(" ", 1) for h in d["proxy_set_header"])
    assert headers["Upgrade"] == "$http_upgrade" and headers["Connection"] == "$connection_upgrade"
    assert re.search(r"map \$http_upgrade \$connection_upgrade \{\s*default upgrade;\s*'' +close;", text)
    assert headers["Host"] == "$http_host" and "X-Forwarded-For" in headers
    for timeout in ("proxy_read_timeout", "proxy_send_timeout"):
        (value,) = d[timeout]
        assert value.endswith("s") and int(value[:-1]) >= 3600, (timeout, value)
    assert d["proxy_buffering"] == ["off"]
    # Docker's DNS, asked at request time (proxy_pass through variables): replicas that
    # `--scale` adds or that restart with a new address are reached without a reload.
    assert re.search(r"resolver 127\.0\.0\.11 valid=\d+s", text)
    assert set(locations) == {"/", "~ ^/replica/(?<replica>[0-9a-f]{12})(?<rest>/.*)$"}
    rest = _directives(locations["/"])
    assert rest["set"] == ["$backend backend"] and rest["proxy_pass"] == ["http://$backend:8000"]
    (one,) = [body for match, body in locations.items() if match.startswith("~")]
    assert _directives(one)["proxy_pass"] == ["http://$replica:8000$rest$is_args$args"]


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed (the compose stack uses the nginx image)")
@pytest.mark.multiproc
def test_nginx_accepts_the_proxy_config(tmp_path: Path):
    got = subprocess.run(["nginx", "-t", "-c", str(NGINX), "-p", str(tmp_path),
                          "-g", f"pid {tmp_path / 'nginx.pid'}; error_log {tmp_path / 'error.log'};"],
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stdout + got.stderr
