"""The operator's RBAC is what it uses, no more: the real operator (Kopf, watching one namespace as the chart runs it
with `operator.watchNamespaces`) goes through a SkipperDeployment's life against the Kubernetes API on loopback
(kmock, tests/kube_world.py): create with a probe Job, a ServiceMonitor, a NetworkPolicy and an hf:// model, probe
results stored, a spec change that drops the ServiceMonitor and the NetworkPolicy, a GPU class leaving. Every request it makes is mapped to the RBAC
(apiGroup, resource, verb) the API server would authorize, and checked against the chart's rendering
(`helm template` with watchNamespaces): namespaced requests against the Role in that namespace, cluster-scoped
ones against the ClusterRole; and every verb the chart grants was used, or is listed here with the reason the
API server needs it without a request of the operator's own."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from kube_world import wait_for
from operator_fixtures import A100, H100
from test_helm_chart import CHART, HELM, KUBE_VERSION, helm
from test_operator_handlers import DEPLOYMENTS, SKD_PATH, add_node, add_resource, status_of

pytestmark = pytest.mark.skipif(HELM is None, reason="helm missing: run `make tools`")

os.environ["VSKIPPER_OPERATOR_RESYNC_SECONDS"] = "1"
os.environ["VSKIPPER_OPERATOR_API_BACKOFFS"] = "0.05,0.1,0.2"

# Granted without a request of the operator's to show for it.
NEEDED_WITHOUT_A_REQUEST = {
    # OwnerReferencesPermissionEnforcement: setting blockOwnerDeletion on a child needs update on the owner's
    # finalizers subresource.
    ("vskipper.io", "skipperdeployments/finalizers", "update"),
}


def verb(request) -> tuple[str, str, str, str | None]:
    """(apiGroup, resource[/subresource], verb, namespace) as the API server's authorizer sees a request."""
    res = request.resource
    resource = res.plural + (f"/{request.subresource}" if request.subresource else "")
    method = str(request.method).upper().rsplit(".", 1)[-1]
    if method == "GET":
        kind = "get" if request.name else "watch" if str(request.params.get("watch", "")).lower() in (
            "true", "1") else "list"
    else:
        kind = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
    return res.group or "", resource, kind, request.namespace


def granted(rules) -> set[tuple[str, str, str]]:
    return {(group, resource, v) for rule in rules for group in rule["apiGroups"] for resource in rule["resources"]
            for v in rule["verbs"]}


def rendered(tmp_path, namespaces):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"operator": {"watchNamespaces": namespaces}}))
    docs = [d for d in yaml.safe_load_all(helm("template", "vskipper", str(CHART), "--namespace", "vskipper-system",
                                                "--kube-version", KUBE_VERSION, "-f", str(path)).stdout) if d]
    return docs


def _probe_succeeds(cluster, job_name, gbps):
    jobs = "/apis/batch/v1/namespaces/llm/jobs"
    cluster.http("POST", "/api/v1/namespaces/llm/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{job_name}-pod", "namespace": "llm", "labels": {"job-name": job_name}},
        "status": {"containerStatuses": [{"name": "probe", "state": {"terminated": {
            "exitCode": 0, "message": json.dumps({"bandwidth_gbps": gbps, "device": "cuda"})}}}]}})
    cluster.http("PATCH", f"{jobs}/{job_name}", {"status": {"succeeded": 1}}, "application/merge-patch+json")


def test_every_request_is_granted_by_the_scoped_role_and_every_grant_is_used(cluster, tmp_path, monkeypatch):
    from kopf.testing import KopfRunner

    monkeypatch.setenv("VSKIPPER_OPERATOR_METRICS_PORT", "0")
    # Kopf serving named namespaces watches the Namespaces and starts on those that exist.
    cluster.http("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "llm"}})
    add_node(cluster, "a100-0", A100)
    add_node(cluster, "h100-0", H100)
    add_resource(cluster, bandwidthProbe={"enabled": True}, metrics={"serviceMonitor": True},
                 placement={"nodeLossGraceSeconds": 0},
                 serving={"image": "ghcr.io/vskipper/vskipper-runtime:0.1.0", "networkPolicy": {
                     "enabled": True, "allowFrom": [{"namespaces": ["gateway"]}]}},
                 model={"path": "hf://meta-llama/Meta-Llama-3-8B", "preset": "llama-3-8b"})
    args = ["run", "--standalone", "--namespace=llm", "--verbose", "-m", "vskipper_operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        wait_for(lambda: cluster.http("GET", "/apis/batch/v1/namespaces/llm/jobs/llama-probe-nvidia-h100-80gb-hbm3"),
                 what="probe jobs")
        # A probe Job that lost the label it is listed by: the operator's own (owner reference), applied back.
        job = "/apis/batch/v1/namespaces/llm/jobs/llama-probe-nvidia-a100-sxm4-80gb"
        cluster.http("PATCH", job, {"metadata": {"labels": {"app.kubernetes.io/managed-by": None}}},
                     "application/merge-patch+json")
        wait_for(lambda: "app.kubernetes.io/managed-by" in cluster.http("GET", job)["metadata"]["labels"],
                 what="Job label applied back")
        _probe_succeeds(cluster, "llama-probe-nvidia-a100-sxm4-80gb", 1800.0)
        wait_for(lambda: cluster.http("GET", "/api/v1/namespaces/llm/configmaps/vskipper-bandwidth"), what="stored")
        _probe_succeeds(cluster, "llama-probe-nvidia-h100-80gb-hbm3", 3000.0)
        wait_for(lambda: len((cluster.http("GET", "/api/v1/namespaces/llm/configmaps/vskipper-bandwidth") or {})
                             .get("data", {})) == 2, what="second result merged")
        # Drift in a PodDisruptionBudget: applied back.
        pdb = "/apis/policy/v1/namespaces/llm/poddisruptionbudgets/llama-nvidia-a100-sxm4-80gb"
        cluster.http("PATCH", pdb, {"spec": {"maxUnavailable": 3}}, "application/merge-patch+json")
        wait_for(lambda: cluster.http("GET", pdb)["spec"]["maxUnavailable"] == 1, what="PDB drift corrected")
        # A spec change: the Service, the Deployments and the ServiceMonitor are applied anew.
        cluster.http("PATCH", f"{SKD_PATH}/llama", {"spec": {"serving": {"port": 31000}, "metrics": {"interval": "15s"}}},
                     "application/merge-patch+json")
        wait_for(lambda: cluster.http("GET", "/api/v1/namespaces/llm/services/llama")["spec"]["ports"][0]["port"]
                 == 31000, what="Service applied")
        wait_for(lambda: cluster.http("GET", "/apis/monitoring.coreos.com/v1/namespaces/llm/servicemonitors/llama")
                 ["spec"]["endpoints"][0]["interval"] == "15s", what="ServiceMonitor applied")
        policy = "/apis/networking.k8s.io/v1/namespaces/llm/networkpolicies/llama"
        wait_for(lambda: (cluster.http("GET", policy) or {}).get("spec", {}).get("ingress", [{}])[0].get("ports")
                 == [{"protocol": "TCP", "port": 31000}], what="NetworkPolicy applied")
        cluster.http("PATCH", f"{SKD_PATH}/llama", {"spec": {"metrics": {"serviceMonitor": False},
                                                             "serving": {"networkPolicy": {"enabled": False}}}},
                     "application/merge-patch+json")
        wait_for(lambda: cluster.http("GET", "/apis/monitoring.coreos.com/v1/namespaces/llm/servicemonitors/llama")
                 is None, what="ServiceMonitor deleted")
        wait_for(lambda: cluster.http("GET", policy) is None, what="NetworkPolicy deleted")
        cluster.http("DELETE", "/api/v1/nodes/h100-0")
        wait_for(lambda: cluster.http("GET", f"{DEPLOYMENTS}/llama-nvidia-h100-80gb-hbm3") is None,
                 what="H100 class removed")
        wait_for(lambda: status_of(cluster).get("observedGeneration") == 3, what="status")
    assert runner.exception is None, runner.output

    # The operator's requests carry its bearer token; the test's own (cluster.http) carry none.
    used = {verb(r) for r in cluster.requests() if r.resource is not None and r.resource.plural
            and (r.headers or {}).get("Authorization")}
    assert used, "no authenticated request recorded"

    docs = rendered(tmp_path, ["llm"])
    roles = [d for d in docs if d["kind"] == "Role"]
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert [r["metadata"]["namespace"] for r in roles] == ["llm"]
    namespaced, cluster_wide = granted(roles[0]["rules"]), granted(cluster_role["rules"])
    for group, resource, kind, namespace in sorted(used, key=str):
        scope = namespaced if namespace else cluster_wide
        assert (group, resource, kind) in scope, f"{kind} {group}/{resource} (namespace {namespace}) is not granted"
    observed = {(g, r, k) for g, r, k, _ in used}
    unused = (namespaced | cluster_wide) - observed - NEEDED_WITHOUT_A_REQUEST
    assert not unused, f"granted but never used: {sorted(unused)}"
    # No write reaches beyond the watched namespace: the ClusterRole reads only.
    assert {k for _, _, k in cluster_wide} <= {"get", "list", "watch"}
