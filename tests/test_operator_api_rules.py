"""The real operator against an API server that keeps a real kube-apiserver's rules (tests/kube_world.py's
`ApiServer`): immutable Job templates (422), canonical quantities, expired tokens (401), names held by objects the
resource does not own (409). Each test asserts the operator converges: the objects right, no write on a later
resync, the status saying what is wrong.
"""

from __future__ import annotations

import time

import pytest
from kube_world import Cluster, operator_process, wait_for
from operator_fixtures import A100, H100, node, resource
from test_operator_handlers import (
    DEPLOYMENTS,
    SKD_PATH,
    add_node,
    add_resource,
    deployment,
    operator,
    status_of,
)

from vskipper.sglang.launch import free_port
from vskipper_operator import metrics

pytestmark = pytest.mark.server  # the operator running against a Kubernetes API on loopback

JOBS = "/apis/batch/v1/namespaces/llm/jobs"
CONFIG_MAPS = "/api/v1/namespaces/llm/configmaps"


@pytest.fixture(autouse=True)
def gauges_in_process(monkeypatch):
    monkeypatch.setenv("VSKIPPER_OPERATOR_METRICS_PORT", "0")  # the gauges are read in-process, not scraped


def condition(cluster, kind):
    return next((c for c in status_of(cluster).get("conditions", []) if c["type"] == kind), None)


def late_writes(cluster, path_part, seconds=2.5):
    """The writes under `path_part` in the next `seconds` (the resync runs every second here), briefly."""
    before = len(cluster.writes(path_part))
    time.sleep(seconds)
    return [(str(r.method), r.url.path, str(r.data)[:160]) for r in cluster.writes(path_part)[before:]]


def test_canonicalized_quantities_are_not_reapplied_on_every_resync(cluster):
    add_node(cluster, "a100-0", A100)
    add_resource(cluster, resources={"cpu": "1000m", "memory": "65536Mi"})
    with operator() as runner:
        dep = wait_for(lambda: deployment(cluster, "nvidia-a100-sxm4-80gb"), what="deployment")
        assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "1", "memory": "64Gi"}
        time.sleep(1.5)

        def derived():
            return len([r for r in cluster.requests() if r.method == "POST" and r.url.path.endswith("/events")
                        and r.data.get("reason") == "ThresholdsDerived"])
        before = derived()
        assert late_writes(cluster, "/deployments") == []
        assert derived() == before, "a resync posted ThresholdsDerived again"
    assert runner.exception is None, runner.output


def _owning_upgrade(request) -> bool:
    """The JSON patch that makes a created object's fields the operator's Apply (`Kube.own_as_applied`)."""
    return isinstance(request.data, list) and any(op.get("path") == "/metadata/managedFields" for op in request.data)


def test_what_the_operator_creates_it_holds_as_applied_so_a_later_apply_can_remove_a_field(cluster):
    """A create is a POST, which the API server records as the operator's Update of every field it sent, and
    server-side apply never removes a field another operation owns: right after each create the operator makes
    its entry the Apply one. (The fields each entry owns, and the pruning itself, are not modelled here:
    tests/kube_world.py.)"""
    add_node(cluster, "a100-0", A100)
    add_resource(cluster)
    with operator() as runner:
        wait_for(lambda: deployment(cluster, "nvidia-a100-sxm4-80gb"), what="deployment")

        def holders(obj):
            return [(e["manager"], e["operation"]) for e in obj["metadata"].get("managedFields") or []]

        wait_for(lambda: holders(deployment(cluster, "nvidia-a100-sxm4-80gb")) == [("vskipper-operator", "Apply")],
                 what="the Deployment held as the operator's Apply")
        service = cluster.http("GET", "/api/v1/namespaces/llm/services/llama")
        assert holders(service) == [("vskipper-operator", "Apply")]
        upgrades = [r for r in cluster.writes("/deployments/") if _owning_upgrade(r)]
        assert upgrades and upgrades[0].data[0]["op"] == "test"  # only at the version the POST returned
    assert runner.exception is None, runner.output


def test_a_probe_job_whose_template_changes_is_replaced_not_patched(cluster):
    add_node(cluster, "h100-0", H100)
    add_resource(cluster, bandwidthProbe={"enabled": True})
    job_path = f"{JOBS}/llama-probe-nvidia-h100-80gb-hbm3"
    with operator() as runner:
        wait_for(lambda: cluster.http("GET", job_path), what="probe job")
        new_image = "ghcr.io/vskipper/vskipper-runtime:0.2.0"
        cluster.http("PATCH", f"{SKD_PATH}/llama", {"spec": {"serving": {"image": new_image}}},
                     "application/merge-patch+json")
        wait_for(lambda: (j := cluster.http("GET", job_path)) and
                 j["spec"]["template"]["spec"]["containers"][0]["image"] == new_image, what="replaced job")
        wait_for(lambda: (s := status_of(cluster)).get("observedGeneration") == 2 and s, what="status")
        image = deployment(cluster, "nvidia-h100-80gb-hbm3")["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == new_image
        # the Job itself was deleted, never patched: its one other write made the operator's create its Apply
        assert {r.method for r in cluster.writes(job_path) if not _owning_upgrade(r)} == {"DELETE"}
        assert not [r for r in cluster.api.refused if r.url.path.startswith(JOBS)], "a Job template was patched"
        assert late_writes(cluster, "/jobs") == [] and late_writes(cluster, "/deployments") == []
    assert runner.exception is None, runner.output


def test_a_name_held_by_a_foreign_object_is_reported_not_adopted(cluster):
    add_node(cluster, "a100-0", A100)
    foreign = {"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "llama-switch", "namespace": "llm", "labels": {"team": "search"},
                            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "search",
                                                 "uid": "uid-search", "controller": True}]},
               "data": {"settings": "theirs"}}
    cluster.http("POST", CONFIG_MAPS, foreign)
    add_resource(cluster)
    with operator() as runner:
        degraded = wait_for(lambda: (c := condition(cluster, "Degraded")) and c["reason"] == "NameTaken" and c,
                            what="NameTaken condition")
        assert "ConfigMap llm/llama-switch" in degraded["message"] and "Deployment search" in degraded["message"]
        assert condition(cluster, "Ready")["status"] == "False"
        warning = wait_for(lambda: next((r.data for r in cluster.requests() if r.method == "POST"
                                         and r.url.path.endswith("/events") and r.data.get("reason") == "NameTaken"),
                                        None), what="NameTaken event")
        assert warning["type"] == "Warning" and "llama-switch" in warning["message"]
        assert wait_for(lambda: deployment(cluster, "nvidia-a100-sxm4-80gb"), what="deployment")
        held = cluster.http("GET", f"{CONFIG_MAPS}/llama-switch")
        assert held["data"] == {"settings": "theirs"} and held["metadata"]["ownerReferences"][0]["uid"] == "uid-search"
        assert not [r for r in cluster.writes(f"{CONFIG_MAPS}/llama-switch")], "the operator wrote the foreign object"
        assert late_writes(cluster, CONFIG_MAPS) == [] and late_writes(cluster, "/deployments") == []
    assert runner.exception is None, runner.output


def test_the_client_rereads_its_credentials_after_a_401(cluster, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    add_node(cluster, "a100-0", A100)
    add_node(cluster, "h100-0", H100)
    add_resource(cluster, replicas=2)
    with operator() as runner:
        wait_for(lambda: deployment(cluster, "nvidia-h100-80gb-hbm3"), what="deployments")
        # The token rotates: the file holds a new one, the old one is refused from now on.
        kubeconfig.write_text(kubeconfig.read_text().replace('"token": "token"', '"token": "rotated"'))
        cluster.api.expired_tokens.add("token")
        cluster.http("PATCH", f"{SKD_PATH}/llama", {"spec": {"replicas": 5}},
                     "application/merge-patch+json")
        wait_for(lambda: deployment(cluster, "nvidia-h100-80gb-hbm3")["spec"]["replicas"] == 3, what="H100 x3")
        wait_for(lambda: status_of(cluster).get("observedGeneration") == 2, what="status")
        assert any(r.headers.get("Authorization") == "Bearer token" for r in cluster.api.refused), "no 401 was met"
        late = [r for r in cluster.writes(DEPLOYMENTS) if r.headers.get("Authorization") == "Bearer rotated"]
        assert late, "no write with the re-read token"
        time.sleep(1.5)
        assert late_writes(cluster, DEPLOYMENTS) == [] and late_writes(cluster, CONFIG_MAPS) == []
    assert runner.exception is None, runner.output


def test_gauges_of_a_deleted_resource_are_removed(cluster):
    add_node(cluster, "a100-0", A100)
    add_resource(cluster)

    def exported():
        return [labels for labels in metrics.EXIT_TOKENS._metrics if labels[:2] == ("llm", "llama")]
    with operator() as runner:
        wait_for(lambda: status_of(cluster).get("gpuClasses"), what="status")
        wait_for(lambda: cluster.http("GET", f"{SKD_PATH}/llama")["metadata"].get("finalizers"), what="finalizer")
        assert exported()
        cluster.http("DELETE", f"{SKD_PATH}/llama")
        wait_for(lambda: cluster.http("GET", f"{SKD_PATH}/llama") is None, what="resource gone")
        # the operator's thread removes them gauge by gauge: the test waits for the last as well as the first
        wait_for(lambda: not exported() and not [k for k in metrics.GPU_CLASSES._metrics if k[:2] == ("llm", "llama")],
                 what="gauges removed")
    assert runner.exception is None, runner.output


def test_the_resync_finalizer_is_documented_and_released_on_delete(cluster):
    """Kopf's timers need a finalizer on every SkipperDeployment (README: the uninstall order)."""
    add_node(cluster, "a100-0", A100)
    add_resource(cluster)
    with operator() as runner:
        finalizers = wait_for(lambda: cluster.http("GET", f"{SKD_PATH}/llama")["metadata"].get("finalizers"),
                              what="finalizer")
        cluster.http("DELETE", f"{SKD_PATH}/llama")
        wait_for(lambda: cluster.http("GET", f"{SKD_PATH}/llama") is None, what="deletion released")
    assert runner.exception is None, runner.output
    readme = (Cluster.__module__ and __import__("kube_world").ROOT / "operator" / "README.md").read_text()
    assert all(f in readme for f in finalizers) and "uninstall" in readme.lower()


def test_a_failed_node_trigger_is_retried_on_the_next_node_event(cluster, tmp_path):
    """With the resync out of reach (an hour), a GPU class appearing while the trigger PATCH fails still gets served:
    only the next Node event can write the trigger, so the waits can be as long as a loaded host needs."""
    add_node(cluster, "a100-0", A100)
    add_resource(cluster)
    failing = cluster.api.fail("PATCH", f"{SKD_PATH}/llama", times=4, when=lambda data: (  # one call: 4 attempts
        ((data.get("metadata") or {}).get("annotations") or {}).get("vskipper.io/gpu-classes") == f"{A100},{H100}"))
    with operator_process(tmp_path / "kubeconfig", tmp_path / "operator.log", free_port(), free_port(),
                          resync_seconds=3600):
        wait_for(lambda: deployment(cluster, "nvidia-a100-sxm4-80gb"), what="A100 deployment")
        add_node(cluster, "h100-0", H100)
        wait_for(lambda: failing["hits"] >= 4, what="the trigger failing")
        add_node(cluster, "cpu-0", None)  # any later Node event
        wait_for(lambda: cluster.http("GET", f"{SKD_PATH}/llama")["metadata"]["annotations"].get(
            "vskipper.io/gpu-classes") == f"{A100},{H100}", what="the trigger written")
        wait_for(lambda: deployment(cluster, "nvidia-h100-80gb-hbm3"), what="H100 deployment")


def test_gpu_nodes_without_product_labels_say_gpu_feature_discovery_is_missing(cluster):
    add_node(cluster, "a100-0", A100)
    bare = node("gpu-1", None)
    bare["status"] = {"allocatable": {"nvidia.com/gpu": "8"}, "capacity": {"nvidia.com/gpu": "8"}}
    cluster.http("POST", "/api/v1/nodes", bare)
    add_resource(cluster)
    with operator() as runner:
        degraded = wait_for(lambda: (c := condition(cluster, "Degraded")) and c["reason"] != "AllClassesServed" and c,
                            what="Degraded")
        assert degraded["reason"] == "GpuFeatureDiscoveryMissing" and "gpu-1" in degraded["message"]
    assert runner.exception is None, runner.output


def test_admission_refuses_an_invalid_resource_before_the_operator_sees_it(tmp_path, monkeypatch):
    with Cluster(admission=True) as c:
        monkeypatch.setenv("KUBECONFIG", str(c.write_kubeconfig(tmp_path / "kubeconfig")))
        bad = resource(uid="uid-llama", serving={"image": "not a valid image!!"})
        with pytest.raises(Exception, match="422"):
            c.add_resource(bad, uid="uid-llama")
        assert c.http("GET", f"{SKD_PATH}/llama") is None
        c.add_resource(resource(), uid="uid-llama")
        assert c.http("GET", f"{SKD_PATH}/llama")["spec"]["serving"]["image"].startswith("ghcr.io/")
