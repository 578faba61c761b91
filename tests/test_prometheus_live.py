"""A real Prometheus server (Debian's prometheus 2.x binary) on loopback, with the chart's rules loaded, scrapes the
real operator metrics endpoint and two runtime stand-in endpoints (tests/standin_exporters.py: the SGLang
integration that emits the runtime metrics is not in this tree, so the stand-ins register the names of
vskipper.metrics_names with prometheus_client). Every PromQL expression of the dashboard and of the rules is
evaluated through the HTTP API and must return data: no panel or alert names a metric nothing emits.

Scrape targets carry the labels a ServiceMonitor attaches (namespace, service, pod); the operator job keeps its
own `namespace` label (honor_labels), as the chart's monitors do.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "helm" / "vskipper" / "files" / "prometheus-rules.yaml"
PROMETHEUS = shutil.which("prometheus")

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus missing: run `make tools`")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _query(base: str, expr: str) -> list:
    body = _get(base, "/api/v1/query", query=expr)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    op_port, engaged_port, stuck_port, prom_port = (_free_port() for _ in range(4))
    exporters = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "standin_exporters.py"), "--operator-port", str(op_port),
         "--runtime-port", f"engaged={engaged_port}", "--runtime-port", f"stuck={stuck_port}"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        stdout=subprocess.PIPE, text=True)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "vskipper-operator", "honor_labels": True, "static_configs": [
                {"targets": [f"127.0.0.1:{op_port}"], "labels": {"namespace": "vskipper-system"}}]},
            {"job_name": "vskipper-runtime", "static_configs": [
                {"targets": [f"127.0.0.1:{engaged_port}"],
                 "labels": {"namespace": "llm", "service": "llama", "pod": "llama-a100-80gb-0"}},
                {"targets": [f"127.0.0.1:{stuck_port}"],
                 "labels": {"namespace": "llm", "service": "qwen", "pod": "qwen-h100-0"}}]},
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    server = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "w"))  # noqa: SIM115
    base = f"http://127.0.0.1:{prom_port}"
    try:
        assert exporters.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while True:
            try:
                if len(_query(base, "up == 1")) == 3:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise AssertionError(f"prometheus never scraped 3 targets:\n{(tmp / 'prometheus.log').read_text()}")
            time.sleep(0.5)
        time.sleep(8)  # several scrapes: rate() and increase() need two samples or more
        yield base
    finally:
        for proc in (server, exporters):
            proc.kill()
            proc.wait()


def _instantiate(expr: str) -> str:
    """Grafana's variables as a dashboard viewer would have them: all namespaces, a 30 s rate window."""
    return expr.replace('namespace=~"$namespace"', 'namespace=~".*"').replace("$__rate_interval", "30s")


def _dashboard_exprs() -> list[tuple[str, str]]:
    board = json.loads((ROOT / "helm" / "vskipper" / "files" / "dashboard.json").read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out.append((f"{panel['title']} / {target['refId']}", target["expr"]))
    return out


def _rule_exprs() -> list[tuple[str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(rule.get("record") or rule["alert"], rule["expr"]) for g in groups for rule in g["rules"]]


def test_every_dashboard_query_returns_data(prometheus):
    exprs = _dashboard_exprs()
    assert len(exprs) >= 15
    empty = [title for title, expr in exprs if not _query(prometheus, _instantiate(expr))]
    assert not empty, f"dashboard queries with no data: {empty}"


def test_every_rule_expression_returns_data(prometheus):
    empty = [name for name, expr in _rule_exprs() if not _query(prometheus, expr)]
    assert not empty, f"rule expressions with no data: {empty}"


def test_alerts_pick_the_pathological_server_and_spare_the_healthy_one(prometheus):
    service = {r["metric"]["instance"]: r["metric"].get("service") for r in _query(prometheus, "up")}

    def instances(alert):
        expr = dict(_rule_exprs())[alert]
        return {service[r["metric"]["instance"]] for r in _query(prometheus, expr)}

    assert instances("VskipperRoutingNeverEngages") == {"qwen"}
    assert instances("VskipperMechanismNotExecuted") == {"qwen"}
    assert instances("VskipperSwitchFlapping") == {"llama"}


def test_prometheus_evaluates_the_loaded_rules(prometheus):
    """The server loaded the rules file: recording rules produce series and every alert is pending (for: 5m)."""
    share = _query(prometheus, "vskipper:decode_rows_skipped:ratio_rate5m")
    by_service = {r["metric"]["service"]: float(r["value"][1]) for r in share}
    assert by_service["llama"] == pytest.approx(0.75, abs=0.01)  # 24 of 32 decode row-visits skip
    assert by_service["qwen"] == 0.0
    routed = _query(prometheus, 'vskipper:passes_routed:ratio_rate5m{phase="decode"}')
    assert {r["metric"]["service"]: float(r["value"][1]) for r in routed} == {"llama": 1.0, "qwen": 0.0}
    pending = {r["metric"]["alertname"] for r in _query(prometheus, 'ALERTS{alertstate="pending"}')}
    assert pending == {"VskipperRoutingNeverEngages", "VskipperSwitchFlapping", "VskipperMechanismNotExecuted",
                       "VskipperOperatorReconcileErrors"}


def test_operator_gauges_keep_the_resource_namespace_and_gpu_class(prometheus):
    enter = _query(prometheus, "vskipper_operator_enter_tokens")
    classes = {r["metric"]["gpu_product"]: float(r["value"][1]) for r in enter}
    assert {r["metric"]["namespace"] for r in enter} == {"llm"}  # the resource's, not the operator pod's
    assert len(classes) >= 2 and all(v > 0 for v in classes.values())
