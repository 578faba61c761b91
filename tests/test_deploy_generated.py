"""Generated deployment files (values schema, CRD copy, RBAC rules, Prometheus rules, Grafana dashboard) stay in
step with their generators, and the dashboard and the metric names are well formed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import monitoring_schemas
import pytest

from vskipper import metrics_names as mn

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "helm" / "vskipper" / "files" / "dashboard.json"

pytest.importorskip("grafana_foundation_sdk")


def test_generated_deploy_files_match_their_generators(cli_env):
    proc = subprocess.run([sys.executable, "-m", "deploy", "--check", "--root", str(ROOT)],
                          capture_output=True, text=True, env=cli_env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_drift_check_names_a_stale_file(tmp_path):
    """The check is not vacuous: a copy of the tree with one edited generated file fails, naming the file."""
    from deploy.__main__ import DASHBOARD_FILE, drifted, generated_files

    for rel, text in generated_files(ROOT).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for rel in ("helm/vskipper/values.yaml", "manifests/operator.yaml"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text())
    assert drifted(tmp_path) == []
    (tmp_path / DASHBOARD_FILE).write_text((tmp_path / DASHBOARD_FILE).read_text().replace("vSkipper", "vskipper"))
    assert drifted(tmp_path) == [DASHBOARD_FILE]


def test_chart_crd_is_the_one_manifests_crd():
    assert (ROOT / "helm/vskipper/crds/skipperdeployments.vskipper.io.yaml").read_text() == \
        (ROOT / "manifests/crd.yaml").read_text()


def _panels(board: dict) -> list[dict]:
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def test_dashboard_has_a_prometheus_datasource_variable_and_every_panel_uses_it():
    board = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["namespace"]["datasource"]["uid"] == "${datasource}"
    for panel in _panels(board):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"


def test_dashboard_panel_ids_are_unique_and_ref_ids_unique_per_panel():
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in _panels(board)]
    assert len(ids) == len(set(ids))
    for panel in _panels(board):
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs))
    assert board["uid"] == "vskipper-overview"


def test_dashboard_covers_routing_switch_serving_pods_and_operator_health():
    board = json.loads(DASHBOARD.read_text())
    exprs = " ".join(t["expr"] for p in _panels(board) for t in p.get("targets", []))
    sglang = [h.replace("sglang:", "sglang[:_]") for h in mn.SGLANG_METRICS]
    for metric in (mn.ROWS.name, mn.PASSES.name, mn.SWITCH_DECISIONS.name, mn.RESIDENT_TOKENS.name,
                   mn.THRESHOLD_TOKENS.name, *sglang, "vskipper_operator_reconciles_total",
                   "vskipper_operator_enter_tokens", "vskipper_operator_exit_tokens",
                   "kube_pod_status_ready", "kube_pod_container_status_restarts_total"):
        assert metric in exprs, metric


def test_every_metric_the_dashboard_and_rules_name_is_declared():
    """Static twin of the live-Prometheus test: each metric name in a query is a runtime metric from
    vskipper.metrics_names, an SGLang histogram, or a metric of the operator's registry."""
    from deploy.dashboard import KUBE_STATE_METRICS
    from deploy.dashboard import all_expressions as dashboard_exprs
    from deploy.rules import all_expressions as rule_exprs
    from vskipper_operator.metrics import REGISTRY

    known = {m.name for m in mn.RUNTIME_METRICS}
    known |= {f"{h}_bucket" for h in mn.SGLANG_HISTOGRAMS} | {*mn.SGLANG_GAUGES, *mn.SGLANG_COUNTERS}
    for family in REGISTRY.collect():
        known |= {s.name for s in family.samples} | {family.name, f"{family.name}_total"}
    for expr in [*dashboard_exprs(), *rule_exprs()]:
        for name in re.findall(r"\b((?:vskipper|sglang|kube)[a-z_:]*)\s*[{\[]", re.sub(r'"[^"]*"', '""', expr)):
            assert name in known | set(KUBE_STATE_METRICS), f"{name} in {expr!r}"
        for pattern in re.findall(r'__name__=~"([^"]+)"', expr):
            assert any(re.fullmatch(pattern, name) for name in known), f"{pattern} in {expr!r}"
    # latency (3 histograms x 2 quantiles), KV usage (max, mean), queue (waiting, running), tokens/s
    assert sum('__name__=~"sglang[:_]' in e for e in dashboard_exprs()) == 11


def test_operator_registers_exactly_the_catalogued_operator_metrics():
    """The operator's registry and vskipper.metrics_names name the same metrics (counters as exposed, `_total`)."""
    from vskipper_operator.metrics import REGISTRY

    registered = set()
    for family in REGISTRY.collect():
        registered.add(f"{family.name}_total" if family.type == "counter" else family.name)
    assert registered == set(mn.OPERATOR_METRICS)
    assert all(name.startswith(mn.OPERATOR_NAMESPACE + "_") for name in mn.OPERATOR_METRICS)


def _sglang_collector_metrics() -> dict[str, str]:
    """{name: Gauge | Counter | Histogram} for every `sglang:` metric the installed SGLang's collector registers,
    read from its source (the collector registers most of them only inside a running scheduler)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("sglang.srt.observability.metrics_collector")
    if spec is None:
        pytest.skip("SGLang is not installed")
    tree = ast.parse(Path(spec.origin).read_text())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            for kw in node.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant) and str(kw.value.value).startswith("sglang:"):
                    out[kw.value.value] = node.func.id
    return out


def test_every_sglang_metric_the_dashboard_reads_is_registered_by_sglangs_collector_with_its_type():
    collector = _sglang_collector_metrics()
    assert len(collector) > 50  # the source was read, not an empty file
    expected = {**dict.fromkeys(mn.SGLANG_HISTOGRAMS, "Histogram"), **dict.fromkeys(mn.SGLANG_GAUGES, "Gauge"),
                **dict.fromkeys(mn.SGLANG_COUNTERS, "Counter")}
    assert {name: collector.get(name) for name in expected} == expected


def test_every_kube_state_metric_the_dashboard_reads_is_listed_once_in_the_generator():
    """kube-state-metrics' series are named only in `KUBE_STATE_METRICS` (its documented pod metrics), and each
    pod panel joins them with the pod's GPU class under the runtime series' label name."""
    from deploy import dashboard

    assert dashboard.KUBE_STATE_METRICS == ("kube_pod_labels", "kube_pod_status_ready",
                                            "kube_pod_container_status_restarts_total")
    assert dashboard.KUBE_GPU_CLASS == "label_vskipper_io_gpu_class"
    pod_panels = [(title, [e for e, _ in targets]) for row, title, _, targets in dashboard._panels()
                  if row.startswith("Server pods")]
    assert [t for t, _ in pod_panels] == ["Server pods by readiness, per GPU class", "Container restarts, per GPU class"]
    for _, exprs in pod_panels:
        for expr in exprs:
            assert f"group_left ({mn.GPU_CLASS})" in expr and f"by (namespace, {mn.GPU_CLASS}" in expr
    source = Path(dashboard.__file__).read_text()
    for name in dashboard.KUBE_STATE_METRICS:
        assert source.count(f'"{name}"') == 1, name


def test_per_class_views_group_by_the_gpu_class_label_the_operator_monitor_copies():
    """Thresholds, routed shares and cohort sizes are shown per GPU class (each class has its own thresholds)."""
    from deploy.dashboard import _panels
    from deploy.rules import recording_rules

    by_title = {title: [expr for expr, _ in targets] for _, title, _, targets in _panels()}
    thresholds = [e for exprs in by_title.values() for e in exprs if mn.THRESHOLD_TOKENS.name in e]
    assert thresholds == [f'max by (namespace, service, {mn.GPU_CLASS}, bound) '
                          f'({mn.THRESHOLD_TOKENS.name}{{namespace=~"$namespace"}})']
    runtime = [e for exprs in by_title.values() for e in exprs if mn.ROWS.name in e or mn.PASSES.name in e]
    assert len(runtime) == 3 and all(f"by (service, {mn.GPU_CLASS}" in e for e in runtime)
    sglang = [e for exprs in by_title.values() for e in exprs if "sglang[:_]" in e]
    assert len(sglang) == 11 and all(f"by (service, {mn.GPU_CLASS})" in e or f"by (le, service, {mn.GPU_CLASS})" in e
                                     for e in sglang)
    assert not [e for exprs in by_title.values() for e in exprs if "model_name" in e]
    for rule in recording_rules():
        assert f"by (namespace, service, {mn.GPU_CLASS}" in rule["expr"], rule["record"]


def test_runtime_metric_names_follow_prometheus_conventions_and_register():
    from prometheus_client import CollectorRegistry, Counter, Gauge

    registry = CollectorRegistry()
    for m in mn.RUNTIME_METRICS:
        assert re.fullmatch(r"vskipper_[a-z_]+", m.name)
        assert m.name.endswith("_total") == (m.type == "counter")
        assert m.name.endswith(("_total", "_tokens"))  # base unit: tokens, or a count
        cls = Counter if m.type == "counter" else Gauge
        metric = cls(m.base_name, m.help, m.label_names, registry=registry)
        for combo in _combos(m.labels):
            child = metric.labels(*combo) if combo else metric
            child.inc()
    samples = {(s.name, tuple(sorted(s.labels.items()))) for f in registry.collect() for s in f.samples}
    for m in mn.RUNTIME_METRICS:
        for combo in _combos(m.labels):
            assert (m.name, tuple(sorted(zip(m.label_names, combo, strict=True)))) in samples
    assert mn.DECISIONS == ("route_on", "route_off", "promote", "prefill_routed", "prefill_dense", "probe")
    assert mn.ACTIONS == ("run", "project_only") and mn.MODES == ("dense", "routed")


def _combos(labels):
    combos = [()]
    for _, values in labels:
        combos = [c + (v,) for c in combos for v in values]
    return combos


def test_plain_monitoring_manifests_carry_the_same_rules_and_dashboard():
    import kubernetes_validate
    import yaml

    rule, config = [d for d in yaml.safe_load_all((ROOT / "manifests" / "monitoring.yaml").read_text()) if d]
    files = ROOT / "helm" / "vskipper" / "files"
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"] == yaml.safe_load((files / "prometheus-rules.yaml").read_text())
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config["data"]["vskipper.json"]) == json.loads(DASHBOARD.read_text())
    kubernetes_validate.validate(config, "1.29.0", strict=True)


@pytest.mark.skipif(monitoring_schemas.MISSING is not None, reason=monitoring_schemas.MISSING or "")
def test_monitoring_objects_in_manifests_validate_against_the_prometheus_operator_schemas():
    import yaml

    docs = [d for path in sorted((ROOT / "manifests").rglob("*.yaml")) for d in yaml.safe_load_all(path.read_text())]
    monitoring = monitoring_schemas.monitoring_objects(docs)
    assert [d["kind"] for d in monitoring] == ["PrometheusRule"]
    assert monitoring_schemas.validate(monitoring) == [[]]
    bad = json.loads(json.dumps(monitoring[0]))
    bad["spec"]["groups"][1]["rules"][0]["for"] = 300
    bad["spec"]["groups"][0]["name"] = ""
    (errors,) = monitoring_schemas.validate([bad])
    assert [e.split(": ")[0] for e in errors] == ["spec.groups[0].name", "spec.groups[1].rules[0].for"]
    assert errors[1].endswith("must be string")
