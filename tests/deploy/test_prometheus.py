"""The shipped Prometheus config, alert rules and Grafana queries against the real things:
Debian's Prometheus scrapes a real backend (bearer viewer token from a file, as shipped)
while a real 2-rank torchrun job trains (its NVML is the fake module in
tests/helpers/fake_nvml, read by the real probe code).

The metric contract (backend/metrics_contract.py) is checked metric by metric against the
backend's /metrics, with its labels (device series with dcgm-exporter's, the GPU index and
UUID the hook read from NVML). A metric marked not exported would be an expected failure,
strict, so that the day it is exported the test says to mark it ``exported=True``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from backend.client import Client
from backend.metrics_contract import CONTRACT, MetricSpec, exposed_names
from tests.helpers import prometheus as promh
from tests.helpers.server import Server, running_server
from tests.helpers.torchrun import REPO_ROOT, running_torchrun
from tests.helpers.waiting import wait_until

pytestmark = [
    pytest.mark.multiproc, pytest.mark.timeout(240),
    pytest.mark.skipif(not promh.installed(), reason=promh.INSTALL_HINT),
]

ROOT = Path(REPO_ROOT)
DEPLOY = ROOT / "deploy"
ADMIN = "prom-admin-secret-0123456789"
JOB = "prom-job"
B = 32
FAKE_NVML = ROOT / "tests" / "helpers" / "fake_nvml"


@dataclass
class Scraped:
    server: Server
    prom: promh.Prometheus
    viewer: str


def shipped_config_for(target: str, token_file: Path) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with only the targets, token file, rule path and
    intervals changed for a test."""
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(DEPLOY / "prometheus" / f) for f in cfg["rule_files"]]
    (scrape,) = cfg["scrape_configs"]
    del scrape["dns_sd_configs"]  # the compose service's replicas; here the one test backend
    scrape["static_configs"] = [{"targets": [target]}]
    scrape["authorization"]["credentials_file"] = str(token_file)
    return cfg


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    tmp = tmp_path_factory.mktemp("prom")
    with running_server(tmp, env={"REBALANCER_ADMIN_TOKEN": ADMIN, "REBALANCER_MIN_STEPS": "6"}) as server:
        viewer = Client(server.url, ADMIN).create_token("viewer", name="prometheus")["secret"]
        token_file = tmp / "scrape.token"
        token_file.write_text(viewer + "\n")  # as `rebalancer token create > file` writes it
        env = {"PYTHONPATH": f"{FAKE_NVML}{os.pathsep}{REPO_ROOT}", "REBALANCER_TOTAL_STEPS": "100000"}
        with running_torchrun(2, ["-m", "trainer_hook.demo_worker", "--server", server.url, "--job", JOB,
                                  "--token", ADMIN, "--steps", "0", "--global-batch-size", str(B),
                                  "--speeds", "1,0.25", "--per-sample-ms", "1.0", "--fixed-ms", "1.0"],
                              env=env) as (_, out):
            target = server.url.removeprefix("http://")
            with promh.running_prometheus(tmp, shipped_config_for(target, token_file)) as prom:
                full = subprocess.run([promh.PROMTOOL, "check", "config", str(tmp / "prometheus.yml")],
                                      capture_output=True, text=True)
                assert full.returncode == 0, full.stdout + full.stderr
                logs = lambda: "".join(out[-40:]) + prom.log() + server.log()[-3000:]  # noqa: E731
                wait_until(lambda: len(prom.query(f'rebalancer_rank_compute_seconds{{job="{JOB}"}}')) == 2,
                           "Prometheus to scrape both ranks of the job", 120, interval=0.5, log=logs)
                wait_until(lambda: Client(server.url, ADMIN).proposals(JOB, status="proposed"),
                           "a proposal for the slow rank", 60, log=logs)
                yield Scraped(server=server, prom=prom, viewer=viewer)


def test_prometheus_scrapes_the_jobs_series_with_the_shipped_config(scraped: Scraped):
    prom = scraped.prom
    (up,) = prom.query('up{job="rebalancer"}')
    assert up["value"][1] == "1"
    ranks = prom.query(f'rebalancer_rank_compute_seconds{{job="{JOB}"}}')
    assert sorted(r["metric"]["rank"] for r in ranks) == ["0", "1"]
    assert all(float(r["value"][1]) > 0 for r in ranks)
    # honor_labels: the training job's name stays in `job`; backend-wide series get "rebalancer".
    (conn,) = prom.query(f'rebalancer_connected_ranks{{job="{JOB}"}}')
    assert conn["value"][1] == "2"
    assert prom.query("rebalancer_hook_connections")[0]["metric"]["job"] == "rebalancer"
    assert not prom.query('{exported_job!=""}')


def test_the_shipped_alert_rules_load_and_evaluate(scraped: Scraped):
    groups = scraped.prom.api("rules")["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(rules) == {"RebalancerStragglerUnbalanced", "RebalancerProposalWaiting",
                          "RebalancerPlacementRolledBack", "RebalancerRankLost", "RebalancerBackendDown",
                          "RebalancerBackendAbsent", "RebalancerJobHung"}
    wait_until(lambda: all(r.get("health") == "ok" for g in scraped.prom.api("rules")["groups"] for r in g["rules"]),
               "every rule to evaluate", 20, interval=0.5)
    # The straggler and the waiting proposal are real: both alerts are pending (their `for:` runs).
    want = {"RebalancerStragglerUnbalanced", "RebalancerProposalWaiting"}
    wait_until(lambda: want <= {a["labels"]["alertname"] for a in scraped.prom.api("alerts")["alerts"]
                                if a["labels"].get("job") == JOB and a["state"] == "pending"},
               f"alerts {sorted(want)} to be pending", 30, interval=0.5, log=scraped.prom.log)


def _grafana_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "rebalancer.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"]]
    return exprs


def _substitute(expr: str) -> str:
    return (expr.replace("$job", JOB).replace("$__rate_interval", "1m").replace("$__range", "5m"))


def test_every_grafana_query_returns_the_jobs_data(scraped: Scraped):
    """Each panel's PromQL parses, runs and returns the job's series. A query that filters
    (``rebalancer_rank_connected == 0``: no rank is lost in this job) is checked without its
    filter: the series it filters exist. A panel for some jobs only (pipelined ones) is
    parsed and run; this job has none of its series."""
    exported = {n for m in CONTRACT if m.exported for n in exposed_names(m)}
    scoped = {n for m in CONTRACT if m.scope for n in exposed_names(m)}
    names = re.compile(r"\b(rebalancer_[a-z_]+)\b")
    for expr in _grafana_exprs():
        assert set(names.findall(expr)) <= exported, expr
        query = _substitute(expr)
        scraped.prom.query(query)  # raises on invalid PromQL
        if set(names.findall(expr)) & scoped:
            continue
        unfiltered = re.sub(r"\s*[<>=!]=?\s*\d+(\.\d+)?\s*$", "", query)
        # rate() and increase() need two samples of a series inside their window: a query
        # made right after the first scrape of a new series is empty, so wait for data.
        wait_until(lambda q=unfiltered: scraped.prom.query(q), f"data for {expr!r}", 60, interval=0.5,
                   log=scraped.prom.log)


def _scrape(s: Scraped) -> dict[str, set[frozenset[str]]]:
    """Sample name -> the label-name sets it appears with, from the backend's /metrics."""
    text = _raw_metrics(s)
    seen: dict[str, set[frozenset[str]]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            seen.setdefault(sample.name, set()).add(frozenset(k for k in sample.labels if k != "le"))
    return seen


def _raw_metrics(s: Scraped) -> str:
    req = urllib.request.Request(s.server.url + "/metrics", headers={"Authorization": f"Bearer {s.viewer}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def _contract_params() -> list[Any]:
    return [pytest.param(m, id=m.name, marks=(pytest.mark.skip(
        reason=f"exists for {m.scope} only; this job is not one (tests/backend/test_metrics_export.py feeds one)")
        if m.scope else () if m.exported else pytest.mark.xfail(
        strict=True, reason="issue 14 phase 2: not exported yet"))) for m in CONTRACT]


@pytest.mark.parametrize("spec", _contract_params())
def test_contract_metric_is_exported_with_its_labels(scraped: Scraped, spec: MetricSpec):
    seen = _scrape(scraped)
    for name in exposed_names(spec):
        assert name in seen, f"{name} is not in /metrics"
        assert seen[name] == {frozenset(spec.labels)}, (name, seen[name])
    if spec.exported and "job" in spec.labels:
        assert scraped.prom.query(f'{exposed_names(spec)[0]}{{job="{JOB}"}}'), f"Prometheus has no {spec.name}"


def test_device_series_join_dcgm_exporter_on_its_labels(scraped: Scraped):
    """The fake NVML's GPUs come back with dcgm-exporter's labels: NVML index, UUID, model."""
    import socket

    from tests.helpers.fake_nvml.pynvml import GPUS

    rows = scraped.prom.query(f'rebalancer_device_utilization_ratio{{job="{JOB}"}}')
    got = {r["metric"]["rank"]: (r["metric"]["gpu"], r["metric"]["UUID"], r["metric"]["modelName"],
                                 r["metric"]["Hostname"]) for r in rows}
    assert got == {str(i): (str(i), g.uuid, g.name, socket.gethostname()) for i, g in enumerate(GPUS)}
    active = scraped.prom.query(f'rebalancer_device_throttle_reason{{job="{JOB}",rank="1"}} == 1')
    assert {r["metric"]["reason"] for r in active} == {"sw_thermal", "sw_power_cap"}
