"""Every object the planner emits is a valid Kubernetes 1.29 object (the OpenAPI schemas `kubernetes-validate`
bundles, strict: no unknown fields) and every pod it plans passes the PodSecurity `restricted` profile
(tests/pod_security.py); the server pods carry what a production rollout needs (probes sized for a model load,
requests, a rollout that needs no spare GPU, a drain, a PodDisruptionBudget) and the spec's pod knobs."""

from __future__ import annotations

import copy

import kubernetes_validate
import monitoring_schemas
import pytest
from operator_fixtures import A100, H100, mig_mixed_node, node, resource
from pod_security import pod_templates, violations

from vskipper_operator.plan import FETCH_CONTAINER, MODEL_CACHE, plan

KUBE_VERSION = "1.29.0"
MIG = "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb"
IMG = "ghcr.io/vskipper/vskipper-runtime:0.1.0"
POOL_LABEL = {"example.com/pool": "gpu"}
POOL = [node("a100-0", A100, **POOL_LABEL), node("h100-0", H100, **POOL_LABEL),
        mig_mixed_node("mig-0", A100, {"1g.10gb": 7}, **POOL_LABEL)]

SPECS = {
    "plain": {},
    "pvc": {"model": {"path": "/models/llama", "preset": "llama-3-8b",
                      "storage": {"pvc": {"claimName": "weights"}, "subPath": "llama-3-8b"}}},
    "hf-download-with-every-knob": {
        "model": {"path": "hf://meta-llama/Meta-Llama-3-8B", "preset": "llama-3-8b", "revision": "main",
                  "download": {"tokenSecret": {"name": "hf-token"}, "cacheSizeLimit": "40Gi",
                               "endpoint": "https://hf-mirror.example.com"}},
        "serving": {"image": IMG, "apiKeySecret": {"name": "llama-api"}, "startupTimeoutSeconds": 900,
                    "networkPolicy": {"enabled": True, "allowFrom": [
                        {"namespaces": ["gateway"], "podLabels": {"app.kubernetes.io/name": "envoy"}},
                        {"namespaces": ["monitoring"]}, {"podLabels": {"role": "client"}}]}},
        "resources": {"gpus": 1, "cpu": "8", "memory": "64Gi"},
        "placement": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                      "nodeSelector": {"example.com/pool": "gpu"}},
        "pod": {"serviceAccountName": "llm", "imagePullSecrets": [{"name": "regcred"}],
                "priorityClassName": "inference", "annotations": {"example.com/team": "llm"},
                "labels": {"team": "llm"}, "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                "volumes": [{"name": "extra", "emptyDir": {}}],
                "volumeMounts": [{"name": "extra", "mountPath": "/extra"}]},
        "bandwidthProbe": {"enabled": True},
        "metrics": {"serviceMonitor": True},
    },
    "hf-download-on-a-pvc-cache": {
        "model": {"path": "hf://Qwen/Qwen3-8B", "preset": "qwen3-8b",
                  "storage": {"pvc": {"claimName": "hf-cache"}, "subPath": "cache", "readOnly": False}},
        "skipper": {"name": "qwen3_hard_gate", "params": {"skip_ratio": 0.5}},
    },
    "mig-slice-with-a-bandwidth-override-and-probes": {
        "bandwidthOverrides": [{"product": MIG, "gbps": 280}], "bandwidthProbe": {"enabled": True}},
    "scale-from-zero": {"placement": {"gpuProducts": [A100, "H200"], "scaleFromZero": True}},
}


def planned(changes: dict, nodes=POOL):
    return plan(resource(uid="uid-llama", **copy.deepcopy(changes)), nodes)


def deployment(result, product):
    return next(o for o in result.objects if o["kind"] == "Deployment"
                and o["metadata"]["annotations"]["vskipper.io/gpu-product"] == product)


@pytest.mark.parametrize("name", SPECS)
def test_every_planned_object_validates_against_the_kubernetes_1_29_schemas(name):
    objects = planned(SPECS[name]).objects
    assert {"Deployment", "PodDisruptionBudget", "Service", "ConfigMap"} <= {o["kind"] for o in objects}
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            if monitoring_schemas.MISSING is None:
                assert monitoring_schemas.validate([obj]) == [[]]
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("name", SPECS)
def test_every_planned_pod_passes_the_restricted_pod_security_profile(name):
    pods = list(pod_templates(planned(SPECS[name]).objects))
    assert pods
    for obj, pod, notes in pods:
        assert violations(pod, notes) == [], f"{obj['kind']} {obj['metadata']['name']}"


def test_a_host_path_model_is_the_one_thing_restricted_refuses():
    """hostPath volumes are refused by `baseline` and `restricted` namespaces: the spec allows them for clusters
    that stage weights on the nodes, and this is what such a namespace would say."""
    result = planned({"model": {"path": "/models/llama", "preset": "llama-3-8b",
                                "storage": {"hostPath": {"path": "/mnt/weights"}}}})
    for _obj, pod, notes in pod_templates(o for o in result.objects if o["kind"] == "Deployment"):
        found = violations(pod, notes)
        assert len(found) == 1 and found[0].endswith(".hostPath: hostPath volumes are not allowed"), found


def test_the_restricted_checker_refuses_what_the_profile_refuses():
    pod = {"hostNetwork": True, "volumes": [{"name": "x", "nfs": {"server": "s", "path": "/"}}],
           "securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]},
           "initContainers": [{"name": "i", "securityContext": {"allowPrivilegeEscalation": False,
                                                                "runAsNonRoot": True, "runAsUser": 0,
                                                                "seccompProfile": {"type": "RuntimeDefault"},
                                                                "capabilities": {"drop": ["ALL"]}}}],
           "containers": [{"name": "c", "ports": [{"containerPort": 80, "hostPort": 80}],
                           "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]},
                                               "seccompProfile": {"type": "Unconfined"}}}]}
    found = violations(pod, {"container.apparmor.security.beta.kubernetes.io/c": "unconfined"})
    for expected in ("spec.hostNetwork", "spec.volumes[0]: volume type nfs", "spec.securityContext.sysctls",
                     "spec.initContainers[0].securityContext.runAsUser", "spec.containers[0].ports[0].hostPort",
                     "spec.containers[0].securityContext.privileged",
                     "spec.containers[0].securityContext.allowPrivilegeEscalation",
                     "spec.containers[0].securityContext.runAsNonRoot",
                     "spec.containers[0].securityContext.seccompProfile.type: must not be Unconfined",
                     "spec.containers[0].securityContext.capabilities.drop",
                     "spec.containers[0].securityContext.capabilities.add",
                     "metadata.annotations[container.apparmor"):
        assert any(line.startswith(expected) for line in found), (expected, found)
    assert not any(line.startswith("spec.initContainers[0].securityContext.allowPrivilegeEscalation")
                   for line in found)


def test_server_pods_are_production_objects():
    result = planned(SPECS["hf-download-with-every-knob"])
    dep = deployment(result, A100)
    spec, pod = dep["spec"], dep["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    # A 900 s budget for loading the model and warming up, then liveness on a generation, readiness on /ready.
    startup = server["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900
    assert server["livenessProbe"]["httpGet"]["path"] == "/health_generate"
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert server["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] == 120
    assert server["resources"]["requests"] == {"cpu": "8", "memory": "64Gi"}
    assert deployment(planned({}), A100)["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] == {
        "cpu": "4", "memory": "32Gi"}
    # The pod knobs.
    assert pod["serviceAccountName"] == "llm" and pod["priorityClassName"] == "inference"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert dep["spec"]["template"]["metadata"]["annotations"]["example.com/team"] == "llm"
    assert dep["spec"]["template"]["metadata"]["labels"]["team"] == "llm"
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in server["env"]
    assert {"name": "extra", "emptyDir": {}} in pod["volumes"]
    assert {"name": "extra", "mountPath": "/extra"} in server["volumeMounts"]
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu" and pod["nodeSelector"] == {"example.com/pool": "gpu"}
    # The API key from its Secret, in the environment alone: no argument names it (a process list or the
    # entrypoint's printed command would show it)
    key = next(e for e in server["env"] if e["name"] == "VSKIPPER_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "llama-api", "key": "api-key"}
    assert not [a for a in server["args"] if "api-key" in a or "VSKIPPER_API_KEY" in a]
    # One PodDisruptionBudget per class, selecting exactly that class's pods.
    budgets = {o["metadata"]["name"]: o for o in result.objects if o["kind"] == "PodDisruptionBudget"}
    assert budgets[dep["metadata"]["name"]]["spec"] == {"maxUnavailable": 1, "selector": spec["selector"]}
    assert len(budgets) == len([o for o in result.objects if o["kind"] == "Deployment"])


def test_network_policy_admits_only_the_listed_peers_to_the_server_port_and_is_off_by_default():
    assert not [o for o in planned(SPECS["plain"]).objects if o["kind"] == "NetworkPolicy"]
    off = {"serving": {"image": IMG, "networkPolicy": {"enabled": False, "allowFrom": [{"namespaces": ["x"]}]}}}
    assert not [o for o in planned(off).objects if o["kind"] == "NetworkPolicy"]
    result = planned(SPECS["hf-download-with-every-knob"])
    (policy,) = [o for o in result.objects if o["kind"] == "NetworkPolicy"]
    service = next(o for o in result.objects if o["kind"] == "Service")
    assert policy["metadata"]["name"] == "llama" and policy["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    # Every server pod of the resource (each GPU class), the pods the Service sends to; no probe Job pod.
    assert policy["spec"]["podSelector"] == {"matchLabels": service["spec"]["selector"]}
    for dep in (o for o in result.objects if o["kind"] == "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    for job in (o for o in result.objects if o["kind"] == "Job"):
        assert not policy["spec"]["podSelector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"][
            "labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 30000}]

    def by_name(*names):
        return {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": list(names)}]}

    assert rule["from"] == [
        {"namespaceSelector": by_name("gateway"), "podSelector": {"matchLabels": {"app.kubernetes.io/name": "envoy"}}},
        {"namespaceSelector": by_name("monitoring")},
        {"podSelector": {"matchLabels": {"role": "client"}}}]


def test_model_storage_reaches_the_server_pod():
    pvc = deployment(planned(SPECS["pvc"]), A100)["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pvc["volumes"]
    mount = next(m for m in pvc["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models/llama", "readOnly": True, "subPath": "llama-3-8b"}
    assert "initContainers" not in pvc
    args = pvc["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/llama"

    hf = deployment(planned(SPECS["hf-download-with-every-knob"]), A100)["spec"]["template"]["spec"]
    (init,) = hf["initContainers"]
    assert init["name"] == FETCH_CONTAINER and init["command"] == ["python", "-m", "vskipper.fetch"]
    folder = f"{MODEL_CACHE}/hf/meta-llama/Meta-Llama-3-8B/main"
    assert init["args"] == ["hf://meta-llama/Meta-Llama-3-8B", "--revision", "main", "--out", folder]
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.example.com"
    assert init["volumeMounts"] == [{"name": "model", "mountPath": MODEL_CACHE, "readOnly": False}]
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert {"name": "model", "emptyDir": {"sizeLimit": "40Gi"}} in hf["volumes"]
    server = hf["containers"][0]
    assert server["args"][server["args"].index("--model") + 1] == folder
    assert {"name": "model", "mountPath": MODEL_CACHE, "readOnly": True} in server["volumeMounts"]
    assert hf["securityContext"]["fsGroup"] == 10001  # the runtime image's user writes the cache

    cache = deployment(planned(SPECS["hf-download-on-a-pvc-cache"]), A100)["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "hf-cache", "readOnly": False}} in cache["volumes"]
    assert cache["initContainers"][0]["volumeMounts"][0]["subPath"] == "cache"


def test_probe_jobs_schedule_like_their_class_and_request_the_mig_slice():
    # the slice's bandwidth unknown: a probe measures it (an override would leave it none to measure)
    probed = planned(SPECS["hf-download-with-every-knob"])
    jobs = {o["metadata"]["annotations"]["vskipper.io/gpu-product"]: o["spec"]["template"]["spec"]
            for o in probed.objects if o["kind"] == "Job"}
    assert set(jobs) == {A100, H100, MIG}
    result = planned(SPECS["hf-download-with-every-knob"] | {"bandwidthOverrides": [{"product": MIG, "gbps": 280}]})
    assert MIG not in {o["metadata"]["annotations"]["vskipper.io/gpu-product"] for o in result.objects
                       if o["kind"] == "Job"}
    for product, pod in jobs.items():
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu", product
        assert pod["nodeSelector"] == {"example.com/pool": "gpu"}
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert jobs[MIG]["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-1g.10gb": "1"}
    assert jobs[A100]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    mig = deployment(result, MIG)["spec"]["template"]["spec"]
    assert mig["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-1g.10gb": "1"}
    # pinned by the slice type's own product label: the card's nvidia.com/gpu.product names the whole A100
    assert mig["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": "nvidia.com/mig-1g.10gb.product", "operator": "In", "values": [MIG]}]}]
    assert jobs[MIG]["affinity"] == mig["affinity"]
    # Under the `single` strategy a slice is advertised as nvidia.com/gpu.
    single = planned({"bandwidthOverrides": [{"product": MIG, "gbps": 280}]},
                     [node("mig-0", MIG, **{"nvidia.com/mig.strategy": "single"})])
    assert deployment(single, MIG)["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": "1"}
