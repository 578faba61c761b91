"""The real operator (Kopf) against the Kubernetes API on loopback (kmock, tests/kube_world.py): model storage and
autoscaled GPU pools. A spec with a PVC, one downloading from hf:// with a token Secret (its download running, then
failing: the status says why), a class named for a pool with no node (planned, its pods pending for the
autoscaler), and a class losing its nodes (kept for the grace period, then removed)."""

from __future__ import annotations

import os

import pytest
from kube_world import wait_for
from operator_fixtures import A100, H100
from test_operator_handlers import DEPLOYMENTS, add_node, add_resource, deployment, operator, status_of

os.environ["VSKIPPER_OPERATOR_RESYNC_SECONDS"] = "1"
os.environ["VSKIPPER_OPERATOR_API_BACKOFFS"] = "0.05,0.1,0.2"

PODS = "/api/v1/namespaces/llm/pods"


@pytest.fixture(autouse=True)
def _no_metrics_server(monkeypatch):
    monkeypatch.setenv("VSKIPPER_OPERATOR_METRICS_PORT", "0")  # served once per process: left to the test that scrapes
HF_MODEL = {"path": "hf://meta-llama/Meta-Llama-3-8B", "preset": "llama-3-8b",
            "download": {"tokenSecret": {"name": "hf-token", "key": "hf_token"}}}


def pod_spec(dep):
    return dep["spec"]["template"]["spec"]


def condition(cluster, kind):
    return next((c for c in status_of(cluster).get("conditions", []) if c["type"] == kind), None)


def test_a_pvc_model_is_mounted_where_the_server_reads_it(cluster):
    add_node(cluster, "a100-0", A100)
    add_resource(cluster, model={"path": "/models/llama", "preset": "llama-3-8b",
                                 "storage": {"pvc": {"claimName": "weights"}, "subPath": "llama-3-8b"}})
    with operator() as runner:
        dep = wait_for(lambda: deployment(cluster, "nvidia-a100-sxm4-80gb"), what="deployment")
        pod = pod_spec(dep)
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
        server = pod["containers"][0]
        assert {"name": "model", "mountPath": "/models/llama", "readOnly": True,
                "subPath": "llama-3-8b"} in server["volumeMounts"]
        assert server["args"][server["args"].index("--model") + 1] == "/models/llama"
        assert "initContainers" not in pod
        assert condition(cluster, "ModelAvailable") is None  # nothing to download
        pdb = cluster.http("GET", "/apis/policy/v1/namespaces/llm/poddisruptionbudgets/llama-nvidia-a100-sxm4-80gb")
        assert pdb["spec"]["selector"] == dep["spec"]["selector"]
    assert runner.exception is None, runner.output


def test_an_hf_download_is_reported_while_it_runs_and_why_it_failed(cluster):
    add_node(cluster, "a100-0", A100)
    add_resource(cluster, model=HF_MODEL)
    with operator() as runner:
        dep = wait_for(lambda: deployment(cluster, "nvidia-a100-sxm4-80gb"), what="deployment")
        (init,) = pod_spec(dep)["initContainers"]
        token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "hf_token"}
        assert init["args"][0] == "hf://meta-llama/Meta-Llama-3-8B"
        assert wait_for(lambda: condition(cluster, "ModelAvailable"), what="condition")["status"] == "Unknown"

        # The kubelet starts the pod's download (no kubelet here: the pod's status is posted as it would report it).
        labels = dep["spec"]["template"]["metadata"]["labels"]
        cluster.http("POST", PODS, {"apiVersion": "v1", "kind": "Pod",
                                    "metadata": {"name": "llama-a100-x1", "namespace": "llm", "labels": labels},
                                    "status": {"initContainerStatuses": [
                                        {"name": "fetch-model", "state": {"running": {}}}]}})
        downloading = wait_for(lambda: (c := condition(cluster, "ModelAvailable")) and c["reason"] == "Downloading"
                               and c, what="Downloading")
        assert "llama-a100-x1" in downloading["message"]
        assert condition(cluster, "Ready")["reason"] == "ModelDownloading"

        # It fails: the fetch step's termination message becomes the condition's message.
        message = ("hf://meta-llama/Meta-Llama-3-8B: access denied (HTTP 401) for the download: give a token that "
                   "can read the repository (spec.model.download.tokenSecret)")
        cluster.http("PATCH", f"{PODS}/llama-a100-x1", {"status": {"initContainerStatuses": [
            {"name": "fetch-model", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
             "lastState": {"terminated": {"exitCode": 1, "message": message}}}]}}, "application/merge-patch+json")
        failed = wait_for(lambda: (c := condition(cluster, "ModelAvailable")) and c["reason"] == "DownloadFailed"
                          and c, what="DownloadFailed")
        assert failed["status"] == "False" and failed["message"].endswith(f"llama-a100-x1: {message}")
        ready = condition(cluster, "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "ModelDownloadFailed")
    assert runner.exception is None, runner.output


def test_a_class_with_no_node_is_planned_for_the_autoscaler(cluster):
    add_node(cluster, "a100-0", A100)
    add_resource(cluster, replicas=2, placement={"gpuProducts": [A100, "H100-SXM"], "scaleFromZero": True})
    with operator() as runner:
        h100 = wait_for(lambda: deployment(cluster, "nvidia-h100-80gb-hbm3"), what="H100 deployment, no H100 node")
        assert h100["spec"]["replicas"] == 1
        terms = pod_spec(h100)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [H100]
        row = wait_for(lambda: next((r for r in status_of(cluster).get("gpuClasses", []) if r["product"] == H100),
                                    None), what="status row")
        assert (row["nodes"], row["nodeState"], row["served"]) == (0, "AwaitingScaleUp", True)
        # The pool scales up: the class's node appears and the same Deployment is kept.
        add_node(cluster, "h100-0", H100)
        wait_for(lambda: next((r["nodeState"] for r in status_of(cluster).get("gpuClasses", [])
                               if r["product"] == H100), None) == "Present", what="node present")
        assert deployment(cluster, "nvidia-h100-80gb-hbm3")["spec"] == h100["spec"]
    assert runner.exception is None, runner.output


def test_a_class_losing_its_nodes_is_kept_for_the_grace_period_then_removed(cluster):
    add_node(cluster, "a100-0", A100)
    add_node(cluster, "h100-0", H100)
    add_resource(cluster, placement={"nodeLossGraceSeconds": 15})  # seconds enough to see the class kept, loaded
    with operator() as runner:
        wait_for(lambda: deployment(cluster, "nvidia-h100-80gb-hbm3"), what="H100 deployment")
        cluster.http("DELETE", "/api/v1/nodes/h100-0")
        row = wait_for(lambda: next((r for r in status_of(cluster).get("gpuClasses", []) if r["product"] == H100
                                     and r.get("nodeState") == "NodesLost"), None), what="NodesLost")
        assert row["nodes"] == 0 and row["nodesLostAt"] and row["served"]
        assert deployment(cluster, "nvidia-h100-80gb-hbm3") is not None  # kept while the grace period runs
        deletes = [r for r in cluster.writes(f"{DEPLOYMENTS}/llama-nvidia-h100-80gb-hbm3") if r.method == "DELETE"]
        assert deletes == []
        wait_for(lambda: deployment(cluster, "nvidia-h100-80gb-hbm3") is None, timeout=60,
                 what="H100 deployment removed after the grace period")
        wait_for(lambda: [r["product"] for r in status_of(cluster).get("gpuClasses", [])] == [A100], what="status")
    assert runner.exception is None, runner.output
