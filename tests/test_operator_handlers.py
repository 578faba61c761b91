"""The real operator (Kopf, via `kopf.testing.KopfRunner`) against a Kubernetes API on loopback (kmock's emulator,
see tests/kube_world.py). The tests assert what the operator really sends: the objects it creates, server-side
applies, status patches, Events, and its retries after conflicts.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import kmock
import pytest
from kopf.testing import KopfRunner
from kube_world import wait_for
from operator_fixtures import A100, H100, UNKNOWN, mig_mixed_node, node, resource

from vskipper.sglang.launch import free_port
from vskipper_operator.plan import plan

pytestmark = pytest.mark.server  # the operator running against a Kubernetes API on loopback

os.environ["VSKIPPER_OPERATOR_RESYNC_SECONDS"] = "1"
os.environ["VSKIPPER_OPERATOR_API_BACKOFFS"] = "0.05,0.1,0.2"

SKD_PATH = "/apis/vskipper.io/v1alpha1/namespaces/llm/skipperdeployments"
DEPLOYMENTS = "/apis/apps/v1/namespaces/llm/deployments"


def add_node(cluster, name, product):
    cluster.http("POST", "/api/v1/nodes", node(name, product))


def add_resource(cluster, **changes):
    cluster.add_resource(resource(**changes), uid="uid-llama")


def operator(liveness_port=None):
    args = ["run", "--standalone", "--all-namespaces", "--verbose", "-m", "vskipper_operator.handlers"]
    if liveness_port:
        args.append(f"--liveness=http://127.0.0.1:{liveness_port}/healthz")
    return KopfRunner(args, timeout=30)


def handling_records(cluster):
    """The writes that record a handled change of the resource (Kopf's last-handled configuration)."""
    return [r for r in cluster.writes(f"{SKD_PATH}/llama") if isinstance(r.data, dict)
            and "operator.vskipper.io/last-handled-configuration" in
            ((r.data.get("metadata") or {}).get("annotations") or {})]


def status_of(cluster, name="llama"):
    return (cluster.http("GET", f"{SKD_PATH}/{name}") or {}).get("status") or {}


def deployment(cluster, product):
    slug = product.lower()
    return cluster.http("GET", f"{DEPLOYMENTS}/llama-{slug}")


def args_of(dep):
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}


def test_operator_creates_per_class_deployments_and_reports_thresholds_in_status_and_events(cluster):
    for name, product in (("a100-0", A100), ("h100-0", H100), ("proto-0", UNKNOWN), ("cpu-0", None)):
        add_node(cluster, name, product)
    add_resource(cluster)
    port, metrics_port = free_port(), free_port()
    os.environ["VSKIPPER_OPERATOR_METRICS_PORT"] = str(metrics_port)
    with operator(liveness_port=port) as runner:
        status = wait_for(lambda: status_of(cluster).get("gpuClasses") and status_of(cluster), what="status")
        rows = {r["product"]: r for r in status["gpuClasses"]}
        assert (rows[A100]["exitTokens"], rows[A100]["enterTokens"]) == (160_000, 200_000)
        assert (rows[H100]["exitTokens"], rows[H100]["enterTokens"]) == (270_000, 340_000)
        assert rows[A100]["bandwidthSource"] == "catalogue"
        assert not rows[UNKNOWN]["served"] and rows[UNKNOWN]["reason"].startswith("UnknownGPU")
        assert status["observedGeneration"] == 1 and status["selector"].startswith("app.kubernetes.io/instance=llama")
        status_patches = [r.data for r in cluster.requests()
                          if r.method == "PATCH" and r.url.path == f"{SKD_PATH}/llama/status"]
        assert status_patches and status_patches[0]["status"]["gpuClassSummary"] == (
            "A100-SXM4-80GB 160k/200k, H100-SXM 270k/340k")
        conditions = {c["type"]: c for c in status["conditions"]}
        assert conditions["ThresholdsDerived"]["status"] == "True"
        assert conditions["Degraded"]["reason"] == "UnknownGPU"
        assert conditions["Ready"]["status"] == "False"  # no controller here makes pods ready

        # What was created, through the API: one Deployment per known class, a Service, the ConfigMap.
        created = {(r.url.path, r.data["metadata"]["name"]) for r in cluster.requests() if r.method == "POST"
                   and "/namespaces/llm/" in r.url.path and r.data.get("kind") not in ("Event", None)}
        assert {name for _, name in created} >= {"llama-nvidia-a100-sxm4-80gb", "llama-nvidia-h100-80gb-hbm3",
                                                 "llama", "llama-switch"}
        dep = deployment(cluster, "nvidia-h100-80gb-hbm3")
        assert args_of(dep)["--exit-tokens"] == "270000" and args_of(dep)["--arm"] == "hybrid"
        assert dep["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
        assert cluster.http("GET", f"{DEPLOYMENTS}/llama-nvidia-gb300-proto") is None

        # Events: one per derived class, one warning for the unknown GPU.
        events = wait_for(lambda: len([r for r in cluster.requests() if r.method == "POST"
                                       and r.url.path.endswith("/events")]) >= 3
                          and [r.data for r in cluster.requests() if r.method == "POST"
                               and r.url.path.endswith("/events")], what="events")
        derived = {e["message"].split(":")[0] for e in events if (e["type"], e["reason"]) == ("Normal", "ThresholdsDerived")}
        assert derived == {A100, H100}
        assert any((e["type"], e["reason"]) == ("Warning", "UnknownGPU") and UNKNOWN in e["message"] for e in events)
        assert any("exit 160,000 / enter 200,000" in e["message"] for e in events)
        assert all(e["involvedObject"]["uid"] == "uid-llama" for e in events)

        # Liveness endpoint and the operator's own metrics.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            assert resp.status == 200
        scrape = wait_for(lambda: _scrape(metrics_port), what="metrics")
        assert ('vskipper_operator_exit_tokens{gpu_product="NVIDIA-H100-80GB-HBM3",name="llama",namespace="llm"} '
                '270000.0') in scrape
        assert 'vskipper_operator_reconciles_total{result="applied"}' in scrape
    assert runner.exception is None, runner.output


def _scrape(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
        return text if "vskipper_operator_exit_tokens{" in text else None
    except OSError:
        return None


def test_rerunning_changes_nothing_and_drift_is_corrected(cluster):
    add_node(cluster, "a100-0", A100)
    add_resource(cluster)
    with operator() as runner:
        wait_for(lambda: deployment(cluster, "nvidia-a100-sxm4-80gb"), what="deployment")
        time.sleep(2.5)  # resync timer fires (every 1 s here) with nothing to change
        before = len(cluster.writes("/deployments"))
        time.sleep(2.5)
        assert len(cluster.writes("/deployments")) == before, "an idle resync wrote to the Deployment"

        # Someone edits the managed fields; the next resync applies them back.
        cluster.http("PATCH", f"{DEPLOYMENTS}/llama-nvidia-a100-sxm4-80gb",
                     {"spec": {"replicas": 9, "template": {"metadata": {"annotations": {
                         "vskipper.io/exit-tokens": "1"}}}}}, "application/merge-patch+json")
        restored = wait_for(lambda: (d := deployment(cluster, "nvidia-a100-sxm4-80gb"))["spec"]["replicas"] == 2
                            and d, what="drift correction")
        assert restored["spec"]["template"]["metadata"]["annotations"]["vskipper.io/exit-tokens"] == "160000"
        applies = [r for r in cluster.writes("/deployments/llama-nvidia-a100-sxm4-80gb")
                   if r.headers.get("Content-Type") == "application/apply-patch+yaml"]
        assert applies and applies[-1].params == {"fieldManager": "vskipper-operator", "force": "true"}
    assert runner.exception is None, runner.output


def test_scaling_the_resource_reapplies_the_replica_split_and_observes_the_generation(cluster):
    add_node(cluster, "a100-0", A100)
    add_node(cluster, "h100-0", H100)
    add_resource(cluster, replicas=2)
    with operator() as runner:
        wait_for(lambda: deployment(cluster, "nvidia-h100-80gb-hbm3"), what="deployments")
        # the node watch's trigger (the GPU classes' annotation) is a change of its own: counted once handled, so
        # that the scale below is the one change left to handle, however the two handlings fell in time
        wait_for(lambda: "vskipper.io/gpu-classes" in ((cluster.http("GET", f"{SKD_PATH}/llama")["metadata"].get(
            "annotations") or {}).get("operator.vskipper.io/last-handled-configuration") or ""),
            what="the GPU classes' trigger handled")
        handled = len(wait_for(lambda: handling_records(cluster), what="the creation handled"))
        # What `kubectl scale skd/llama --replicas=5` does through the scale subresource.
        cluster.http("PATCH", f"{SKD_PATH}/llama", {"spec": {"replicas": 5}},
                     "application/merge-patch+json")
        wait_for(lambda: deployment(cluster, "nvidia-h100-80gb-hbm3")["spec"]["replicas"] == 3, what="H100 x3")
        assert deployment(cluster, "nvidia-a100-sxm4-80gb")["spec"]["replicas"] == 2
        status = wait_for(lambda: (s := status_of(cluster)).get("observedGeneration") == 2 and s, what="status")
        assert status["replicas"] == 5
        assert {c["observedGeneration"] for c in status["conditions"]} == {2}
        time.sleep(2.5)  # resync timer fires (every 1 s here): the change stays handled
        assert len(handling_records(cluster)) == handled + 1, "the change was handled more than once"
    assert runner.exception is None, runner.output


def test_gpu_class_appearing_and_leaving_is_replanned_through_the_node_watch(cluster):
    add_node(cluster, "a100-0", A100)
    add_resource(cluster, replicas=3, placement={"nodeLossGraceSeconds": 0})
    with operator() as runner:
        wait_for(lambda: deployment(cluster, "nvidia-a100-sxm4-80gb"), what="A100 deployment")
        add_node(cluster, "h100-0", H100)
        h100 = wait_for(lambda: deployment(cluster, "nvidia-h100-80gb-hbm3"), what="H100 deployment")
        assert h100["spec"]["replicas"] == 2  # 3 split, the remainder to the faster class
        wait_for(lambda: deployment(cluster, "nvidia-a100-sxm4-80gb")["spec"]["replicas"] == 1, what="A100 scaled")
        annotations = cluster.http("GET", f"{SKD_PATH}/llama")["metadata"]["annotations"]
        assert annotations["vskipper.io/gpu-classes"] == f"{A100},{H100}"
        cluster.http("DELETE", "/api/v1/nodes/h100-0")
        wait_for(lambda: deployment(cluster, "nvidia-h100-80gb-hbm3") is None, what="H100 deployment deleted")
        wait_for(lambda: [r["product"] for r in status_of(cluster).get("gpuClasses", [])] == [A100], what="status")
    assert runner.exception is None, runner.output


def test_mig_slices_are_served_as_their_own_resource_and_replanned_when_the_card_is_repartitioned(cluster):
    """A node as GFD labels it under the `mixed` strategy: the slice type's Deployment requests the slice, no
    Deployment asks for the partitioned card whole, and a new partition replaces the old slice's Deployment."""
    small, large = f"{A100}-MIG-1g.10gb", f"{A100}-MIG-3g.40gb"
    cluster.http("POST", "/api/v1/nodes", mig_mixed_node("mig-0", A100, {"1g.10gb": 7}))
    add_resource(cluster, placement={"nodeLossGraceSeconds": 0},
                 bandwidthOverrides=[{"product": small, "gbps": 280}, {"product": large, "gbps": 800}])
    with operator() as runner:
        dep = wait_for(lambda: deployment(cluster, small.lower().replace(".", "-")), what="1g.10gb deployment")
        assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
            "nvidia.com/mig-1g.10gb": "1"}
        assert [r["product"] for r in wait_for(lambda: status_of(cluster).get("gpuClasses"), what="status")] == [
            small]
        assert deployment(cluster, "nvidia-a100-sxm4-80gb") is None
        cluster.http("DELETE", "/api/v1/nodes/mig-0")
        cluster.http("POST", "/api/v1/nodes", mig_mixed_node("mig-0", A100, {"3g.40gb": 2}))
        dep = wait_for(lambda: deployment(cluster, large.lower().replace(".", "-")), what="3g.40gb deployment")
        assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
            "nvidia.com/mig-3g.40gb": "1"}
        wait_for(lambda: deployment(cluster, small.lower().replace(".", "-")) is None, what="1g.10gb deployment deleted")
    assert runner.exception is None, runner.output


def test_the_node_trigger_names_each_slice_type_and_a_card_only_while_it_is_whole():
    from vskipper_operator.handlers import _gpu_classes

    def index(*nodes):
        return {n["metadata"]["name"]: [{"labels": n["metadata"]["labels"],
                                         "gpus": int(n.get("status", {}).get("allocatable", {}).get(
                                             "nvidia.com/gpu", 0))}] for n in nodes}

    assert _gpu_classes(index(mig_mixed_node("m", A100, {"1g.10gb": 7}))) == f"{A100}-MIG-1g.10gb"
    assert _gpu_classes(index(mig_mixed_node("m", A100, {"3g.40gb": 1}, whole=1), node("h", H100))) == (
        f"{A100},{A100}-MIG-3g.40gb,{H100}")


def test_api_conflicts_are_retried_with_backoff(cluster):
    add_node(cluster, "a100-0", A100)
    add_resource(cluster)
    # A Deployment left with a drifted replica count; the operator's server-side apply meets two conflicts.
    stale = next(o for o in plan(resource(uid="uid-llama"), [node("a100-0", A100)]).objects if o["kind"] == "Deployment")
    stale["spec"]["replicas"] = 7
    cluster.http("POST", DEPLOYMENTS, stale)
    path = f"{DEPLOYMENTS}/{stale['metadata']['name']}"
    conflicts = cluster.api["patch", kmock.resource("apps/v1/deployments")][:2] << 409
    with operator() as runner:
        wait_for(lambda: status_of(cluster).get("gpuClasses"), what="status")
        applies = wait_for(lambda: len(cluster.writes(path)) >= 3 and cluster.writes(path), what="retried apply")
    assert len(list(conflicts)) == 2
    assert all(r.method == "PATCH" and r.headers["Content-Type"] == "application/apply-patch+yaml"
               for r in applies[:3])
    assert cluster.http("GET", path)["spec"]["replicas"] == 2
    assert runner.exception is None, runner.output


def test_invalid_spec_is_reported_as_a_warning_event_and_status_condition(cluster):
    add_node(cluster, "a100-0", A100)
    add_resource(cluster, skipper={"name": "random_skip", "params": {"r": 1.5, "d": 0.5}})
    with operator() as runner:
        ready = wait_for(lambda: next((c for c in status_of(cluster).get("conditions", [])
                                       if c["type"] == "Ready"), None), what="status")
        assert ready["reason"] == "InvalidSpec"
        assert ready["message"].startswith("spec.skipper.params.r: must be in [0.0, 1.0]")
        warning = wait_for(lambda: next((r.data for r in cluster.requests() if r.method == "POST"
                                         and r.url.path.endswith("/events")
                                         and r.data["reason"] == "InvalidSpec"), None), what="event")
        assert warning["type"] == "Warning" and "spec.skipper.params.r" in warning["message"]
    assert cluster.http("GET", f"{DEPLOYMENTS}/llama-nvidia-a100-sxm4-80gb") is None
    assert runner.exception is None, runner.output


def test_probe_job_result_is_stored_and_preferred_over_the_catalogue(cluster):
    add_node(cluster, "h100-0", H100)
    add_resource(cluster, bandwidthProbe={"enabled": True})
    jobs = "/apis/batch/v1/namespaces/llm/jobs"
    with operator() as runner:
        job = wait_for(lambda: cluster.http("GET", f"{jobs}/llama-probe-nvidia-h100-80gb-hbm3"), what="probe job")
        assert job["spec"]["template"]["spec"]["containers"][0]["command"][-1] == "vskipper_operator.probe"
        # The Job's pod finishes with the probe's JSON as its termination message (no kubelet here: we post it).
        cluster.http("POST", "/api/v1/namespaces/llm/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "probe-pod", "namespace": "llm", "labels": {"job-name": job["metadata"]["name"]}},
            "status": {"containerStatuses": [{"name": "probe", "state": {"terminated": {
                "exitCode": 0, "message": json.dumps({"bandwidth_gbps": 3005.2, "device": "cuda"})}}}]}})
        cluster.http("PATCH", f"{jobs}/{job['metadata']['name']}", {"status": {"succeeded": 1}},
                     "application/merge-patch+json")
        row = wait_for(lambda: next((r for r in status_of(cluster).get("gpuClasses", [])
                                     if r.get("bandwidthSource") == "measured"), None), what="measured status")
        assert row["bandwidthGBps"] == 3005.2 and row["exitTokens"] == 240_000
        stored = cluster.http("GET", "/api/v1/namespaces/llm/configmaps/vskipper-bandwidth")
        assert stored["data"] == {H100: "3005.2"}
        assert args_of(deployment(cluster, "nvidia-h100-80gb-hbm3"))["--exit-tokens"] == "240000"
    assert runner.exception is None, runner.output
