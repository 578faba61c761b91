"""Invalid SkipperDeployments are refused before anything is derived from them, naming the field.

Each case is checked twice: against the generated CRD the way the API server admits a resource
(tests/admission.py: the CRD's schema with jsonschema, its CEL rules with cel-python; what that cannot model is
listed there), and by the operator's planner (`plan`), which a reconcile runs first and which answers a spec error
with a Warning Event, a `Ready=False InvalidSpec` condition and `kopf.PermanentError` (no retry loop). A few cases
need facts only the planner has (the real flag parsers, the GPU catalogue); those are marked `planner`.
"""

from __future__ import annotations

import copy

import pytest
import yaml
from admission import ROOT, admit
from operator_fixtures import A100, mixed_pool, resource

from vskipper_operator.crd import SpecError
from vskipper_operator.plan import plan

IMG = "ghcr.io/vskipper/vskipper-runtime:0.1.0"


def serving(**changes):
    return {"serving": {"image": IMG, **changes}}


def args(*extra):
    return serving(extraArgs=list(extra))


def model(**changes):
    return {"model": {"path": "/models/llama", "preset": "llama-3-8b", **changes}}


def tolerations(*items):
    return {"placement": {"tolerations": list(items)}}


# (id, spec changes or a metadata change, the field the refusal must name, where it is refused)
CASES = [
    # Image references: the kubelet would fail the pull (or the Deployment write would be refused).
    ("image-not-a-reference", serving(image="not a valid image!!"), "spec.serving.image", "both"),
    ("image-upper-case-path", serving(image="ghcr.io/VSkipper/runtime:0.1.0"), "spec.serving.image", "both"),
    ("image-empty-tag", serving(image="ghcr.io/vskipper/runtime:"), "spec.serving.image", "both"),
    ("image-leading-space", serving(image=" ghcr.io/vskipper/runtime:0.1.0"), "spec.serving.image", "both"),
    ("image-short-digest", serving(image="ghcr.io/vskipper/runtime@sha256:abc"), "spec.serving.image", "both"),
    # Quantities: the Deployment write would be refused, every resync.
    ("memory-lots", {"resources": {"memory": "lots"}}, "spec.resources.memory", "both"),
    ("cpu-negative", {"resources": {"cpu": -4}}, "spec.resources.cpu", "both"),
    ("cpu-with-unit-words", {"resources": {"cpu": "1.5 cores"}}, "spec.resources.cpu", "both"),
    ("memory-a-list", {"resources": {"memory": [64]}}, "spec.resources.memory", "both"),
    ("gpus-nine", {"resources": {"gpus": 9}}, "spec.resources.gpus", "both"),
    # Tolerations: core/v1's schema and its validation.
    ("toleration-untyped", tolerations({"key": 1, "operator": "Maybe"}), "spec.placement.tolerations[0].key", "both"),
    ("toleration-operator", tolerations({"key": "gpu", "operator": "Maybe"}),
     "spec.placement.tolerations[0].operator", "both"),
    ("toleration-exists-with-value", tolerations({"key": "gpu", "operator": "Exists", "value": "x"}),
     "spec.placement.tolerations[0].value", "both"),
    ("toleration-empty-key-equal", tolerations({"operator": "Equal", "value": "x"}),
     "spec.placement.tolerations[0].key", "both"),
    ("toleration-seconds-without-noexecute", tolerations({"key": "gpu", "effect": "NoSchedule",
                                                           "tolerationSeconds": 30}),
     "spec.placement.tolerations[0].tolerationSeconds", "both"),
    ("toleration-bad-key", tolerations({"key": "bad key!", "operator": "Exists"}),
     "spec.placement.tolerations[0].key", "both"),
    ("toleration-effect", tolerations({"key": "gpu", "effect": "Sometimes"}),
     "spec.placement.tolerations[0].effect", "both"),
    ("toleration-unknown-field", tolerations({"key": "gpu", "operater": "Exists"}),
     "spec.placement.tolerations[0].operater", "both"),
    # nodeSelector: label keys and values.
    ("node-selector-bad-key", {"placement": {"nodeSelector": {"bad key!": "x"}}}, "spec.placement.nodeSelector",
     "both"),
    ("node-selector-two-slashes", {"placement": {"nodeSelector": {"a/b/c": "x"}}}, "spec.placement.nodeSelector",
     "both"),
    ("node-selector-bad-value", {"placement": {"nodeSelector": {"zone": "not a value!"}}},
     "spec.placement.nodeSelector.zone", "both"),
    ("gpu-products-bad-value", {"placement": {"gpuProducts": ["not a product!"]}},
     "spec.placement.gpuProducts[0]", "both"),
    # replicasPerClass: keys must name a GPU product.
    ("replicas-per-class-bad-key", {"replicasPerClass": {"no such gpu!": 1}}, "spec.replicasPerClass", "both"),
    ("replicas-per-class-unknown-product", {"replicasPerClass": {"NVIDIA-NOPE-9000": 1}},
     "spec.replicasPerClass.NVIDIA-NOPE-9000", "planner"),
    ("replicas-per-class-negative", {"replicasPerClass": {A100: -1}}, f"spec.replicasPerClass.{A100}", "both"),
    # Thresholds: maxima keep CEL's int64 comparison in range.
    ("thresholds-1e19", {"switch": {"thresholds": {"exitTokens": 10**19, "enterTokens": 10**19}}},
     "spec.switch.thresholds.exitTokens", "both"),
    ("thresholds-int64-max", {"switch": {"thresholds": {"exitTokens": 1, "enterTokens": 2**63 - 1}}},
     "spec.switch.thresholds.enterTokens", "both"),
    ("thresholds-negative", {"switch": {"thresholds": {"exitTokens": -1, "enterTokens": 5}}},
     "spec.switch.thresholds.exitTokens", "both"),
    ("thresholds-inverted", {"switch": {"thresholds": {"exitTokens": 9, "enterTokens": 8}}},
     "spec.switch.thresholds", "both"),
    # Owned flags, abbreviated or aliased as the parsers that read them accept them.
    ("extra-args-enter-exit-abbreviated", args("--enter", "0", "--exit", "0"), "spec.serving.extraArgs", "both"),
    ("extra-args-port-abbreviated", args("--po", "9999"), "spec.serving.extraArgs", "both"),
    ("extra-args-port-equals", args("--port=1"), "spec.serving.extraArgs", "both"),
    ("extra-args-tensor-parallel-size", args("--tensor-parallel-size", "4"), "spec.serving.extraArgs", "both"),
    ("extra-args-model-path", args("--model-path", "/other"), "spec.serving.extraArgs", "both"),
    ("extra-args-arm-file", args("--arm-file", "/x.json"), "spec.serving.extraArgs", "both"),
    ("extra-args-host-abbreviated", args("--hos", "1.2.3.4"), "spec.serving.extraArgs", "both"),
    ("extra-args-served-name", args("--served-model-name=other"), "spec.serving.extraArgs", "both"),
    ("extra-args-after-separator", args("--", "--tensor-parallel", "2"), "spec.serving.extraArgs", "both"),
    ("extra-args-dry-run", args("--dry-run"), "spec.serving.extraArgs", "planner"),
    ("extra-args-config-file", args("--config", "/etc/more.yaml"), "spec.serving.extraArgs", "planner"),
    ("extra-args-unknown-flag", args("--colour", "blue"), "spec.serving.extraArgs", "planner"),
    # Skippers: the registered names, each with its own parameters.
    ("skipper-unknown", {"skipper": {"name": "nope"}}, "spec.skipper.name", "both"),
    ("skipper-missing-required-param", {"skipper": {"name": "random_skip", "params": {"d": 0.5}}},
     "spec.skipper.params.r", "both"),
    ("skipper-foreign-param", {"skipper": {"name": "flexidepth", "params": {"r": 0.5}}}, "spec.skipper.params",
     "both"),
    ("skipper-param-out-of-range", {"skipper": {"name": "random_skip", "params": {"r": 1.5, "d": 0.5}}},
     "spec.skipper.params.r", "both"),
    ("skipper-param-unknown", {"skipper": {"name": "flexidepth", "params": {"temperature": 2}}},
     "spec.skipper.params.temperature", "both"),
    ("skipper-param-type", {"skipper": {"name": "flexidepth", "params": {"skip_ratio": "half"}}},
     "spec.skipper.params.skip_ratio", "both"),
    ("static-depth-without-ratio", {"skipper": {"name": "static_depth"}}, "spec.skipper.params.ratio", "both"),
    # A tail under one of the preset's routed layers: the count comes from the preset table, which the CRD lacks.
    ("static-depth-ratio-below-one-layer", {"skipper": {"name": "static_depth", "params": {"ratio": 0.05}}},
     "spec.skipper.params.ratio", "planner"),
    # metadata.name: the children's names append the GPU class.
    ("name-too-long", {"metadata.name": "a" * 41}, "metadata.name", "both"),
    ("name-not-a-dns-label", {"metadata.name": "Llama_8B"}, "metadata.name", "both"),
    ("name-starting-with-a-digit", {"metadata.name": "3b-demo"}, "metadata.name", "both"),  # the Service's name
    ("grace-shorter-than-the-drain", {"serving": {"image": "x", "terminationGracePeriodSeconds": 20}},
     "spec.serving.terminationGracePeriodSeconds", "both"),
    # The rest of the spec.
    ("replicas-negative", {"replicas": -1}, "spec.replicas", "both"),
    ("model-without-geometry", {"model": {"path": "/m"}}, "spec.model", "both"),
    ("switch-mixed-policies", {"switch": {"prefill": "routed", "decode": "hybrid"}}, "spec.switch", "both"),
    ("override-zero-bandwidth", {"bandwidthOverrides": [{"product": A100, "gbps": 0}]},
     "spec.bandwidthOverrides[0].gbps", "both"),
    ("override-duplicate-product", {"bandwidthOverrides": [{"product": A100, "gbps": 1}, {"product": A100, "gbps": 2}]},
     "spec.bandwidthOverrides[1]", "both"),
    ("override-bad-product", {"bandwidthOverrides": [{"product": "bad product!", "gbps": 1}]},
     "spec.bandwidthOverrides[0].product", "both"),
    ("metrics-interval", {"metrics": {"interval": "soon"}}, "spec.metrics.interval", "both"),
    ("port-out-of-range", serving(port=70000), "spec.serving.port", "both"),
    ("unknown-field", {"colour": "blue"}, "spec.colour", "both"),
    # Model storage: a directory in the container (the image's or a mounted volume's) or an hf:// repository.
    ("model-s3-scheme", model(path="s3://bucket/llama"), "spec.model.path", "both"),
    ("model-https-url", model(path="https://huggingface.co/meta-llama/Meta-Llama-3-8B"), "spec.model.path", "both"),
    ("model-relative-path", model(path="models/llama"), "spec.model.path", "both"),
    ("model-hf-without-name", model(path="hf://meta-llama"), "spec.model.path", "both"),
    ("model-revision-for-a-local-path", model(revision="v1"), "spec.model.revision", "both"),
    ("model-download-for-a-local-path", model(download={}), "spec.model.download", "both"),
    ("model-storage-two-volumes", model(storage={"pvc": {"claimName": "w"}, "hostPath": {"path": "/w"}}),
     "spec.model.storage", "both"),
    ("model-storage-no-volume", model(storage={"subPath": "llama"}), "spec.model.storage", "both"),
    ("model-subpath-escapes", model(storage={"pvc": {"claimName": "w"}, "subPath": "a/../../etc"}),
     "spec.model.storage.subPath", "both"),
    ("model-subpath-absolute", model(storage={"pvc": {"claimName": "w"}, "subPath": "/etc"}),
     "spec.model.storage.subPath", "both"),
    ("model-claim-name", model(storage={"pvc": {"claimName": "Weights_PVC"}}),
     "spec.model.storage.pvc.claimName", "both"),
    ("model-host-path-relative", model(storage={"hostPath": {"path": "weights"}}),
     "spec.model.storage.hostPath.path", "both"),
    ("model-hf-read-only-cache", model(path="hf://meta-llama/Meta-Llama-3-8B",
                                       storage={"pvc": {"claimName": "w"}, "readOnly": True}),
     "spec.model.storage.readOnly", "both"),
    ("model-token-secret-name", model(path="hf://a/b", download={"tokenSecret": {"name": "HF Token"}}),
     "spec.model.download.tokenSecret.name", "both"),
    ("model-cache-size", model(path="hf://a/b", download={"cacheSizeLimit": "lots"}),
     "spec.model.download.cacheSizeLimit", "both"),
    ("model-endpoint-not-a-url", model(path="hf://a/b", download={"endpoint": "hub.example.com"}),
     "spec.model.download.endpoint", "both"),
    # The API key comes from a Secret, never as text in the spec; pod knobs do not collide with the operator's.
    ("extra-args-api-key", args("--api-key", "sk-in-the-spec"), "spec.serving.extraArgs", "both"),
    ("api-key-secret-without-name", serving(apiKeySecret={"key": "k"}), "spec.serving.apiKeySecret", "both"),
    ("pod-env-owned-variable", {"pod": {"env": [{"name": "VSKIPPER_API_KEY", "value": "x"}]}},
     "spec.pod.env[0].name", "both"),
    ("pod-volume-named-like-the-operators", {"pod": {"volumes": [{"name": "model", "emptyDir": {}}]}},
     "spec.pod.volumes[0].name", "both"),
    ("pod-mount-relative", {"pod": {"volumeMounts": [{"name": "x", "mountPath": "x"}]}},
     "spec.pod.volumeMounts[0].mountPath", "both"),
    ("pod-service-account", {"pod": {"serviceAccountName": "Not A Name"}}, "spec.pod.serviceAccountName", "both"),
    # The NetworkPolicy: a policy that admits nobody, a peer that names nobody, selectors the API server refuses.
    ("network-policy-without-peers", serving(networkPolicy={"enabled": True}), "spec.serving.networkPolicy.allowFrom",
     "both"),
    ("network-policy-empty-peer", serving(networkPolicy={"enabled": True, "allowFrom": [{}]}),
     "spec.serving.networkPolicy.allowFrom[0]", "both"),
    ("network-policy-namespace-not-a-name",
     serving(networkPolicy={"enabled": True, "allowFrom": [{"namespaces": ["Not_A_Namespace"]}]}),
     "spec.serving.networkPolicy.allowFrom[0].namespaces[0]", "both"),
    ("network-policy-no-namespaces",
     serving(networkPolicy={"enabled": True, "allowFrom": [{"namespaces": []}]}),
     "spec.serving.networkPolicy.allowFrom[0].namespaces", "both"),
    ("network-policy-no-labels", serving(networkPolicy={"enabled": True, "allowFrom": [{"podLabels": {}}]}),
     "spec.serving.networkPolicy.allowFrom[0].podLabels", "both"),
    ("network-policy-label-key", serving(networkPolicy={"enabled": True, "allowFrom": [{"podLabels": {"a b": "c"}}]}),
     "spec.serving.networkPolicy.allowFrom[0].podLabels", "both"),
    ("network-policy-label-value",
     serving(networkPolicy={"enabled": True, "allowFrom": [{"podLabels": {"role": "not a value"}}]}),
     "spec.serving.networkPolicy.allowFrom[0].podLabels.role", "both"),
    ("placement-grace-negative", {"placement": {"nodeLossGraceSeconds": -1}}, "spec.placement.nodeLossGraceSeconds",
     "both"),
]


def _resource(change: dict) -> dict:
    change = copy.deepcopy(change)
    name = change.pop("metadata.name", "llama")
    return resource(name=name, uid="uid-llama", **change)


def test_the_table_holds_every_case_the_issue_lists_and_more():
    assert len(CASES) >= 48
    assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize(("change", "field", "where"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_spec_is_refused_naming_the_field(change, field, where):
    doc = _resource(change)
    errors = admit(doc)
    if where == "both":
        assert any(e.startswith(field) for e in errors), f"admitted or another field: {errors}"
    else:
        assert not errors, "the CRD refuses it: mark the case 'both'"
    with pytest.raises(SpecError) as err:
        plan(doc, mixed_pool())
    assert str(err.value).startswith(field), str(err.value)


def test_valid_resources_and_the_examples_are_admitted():
    assert admit(_resource({})) == []
    rich = _resource({
        "serving": {"image": "registry.example.com:5000/team/vskipper-runtime:0.1.0@sha256:" + "a" * 64,
                    "extraArgs": ["--max-running-requests", "8", "--", "--schedule-policy", "lpm"]},
        "resources": {"gpus": 2, "cpu": "8", "memory": "64Gi"},
        "placement": {"nodeSelector": {"example.com/pool": "gpu"}, "gpuProducts": [A100],
                      "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                      {"operator": "Exists"}]},
        "replicasPerClass": {A100: 2},
        "skipper": {"name": "random_skip", "params": {"r": 0.5, "d": 0.5, "seed": 3}},
        "switch": {"thresholds": {"exitTokens": 100_000, "enterTokens": 120_000}},
    })
    assert admit(rich) == []
    plan(rich, mixed_pool())
    for storage in ({"model": {"path": "/models/llama", "preset": "llama-3-8b",
                               "storage": {"pvc": {"claimName": "weights"}, "subPath": "llama-3-8b"}}},
                    {"model": {"path": "/models/llama", "preset": "llama-3-8b",
                               "storage": {"hostPath": {"path": "/mnt/weights"}, "readOnly": True}}},
                    {"model": {"path": "hf://meta-llama/Meta-Llama-3-8B", "preset": "llama-3-8b", "revision": "main",
                               "storage": {"pvc": {"claimName": "hf-cache"}, "readOnly": False},
                               "download": {"tokenSecret": {"name": "hf-token", "key": "token"},
                                            "endpoint": "https://hf-mirror.example.com", "cacheSizeLimit": "40Gi"}},
                     "serving": {"image": IMG, "apiKeySecret": {"name": "llama-api"},
                                 "networkPolicy": {"enabled": True, "allowFrom": [
                                     {"namespaces": ["gateway", "monitoring"]},
                                     {"podLabels": {"app.kubernetes.io/name": "envoy"}}]}},
                     "pod": {"serviceAccountName": "llm", "imagePullSecrets": [{"name": "regcred"}],
                             "priorityClassName": "inference", "annotations": {"example.com/team": "llm"},
                             "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                             "volumes": [{"name": "extra", "emptyDir": {}}],
                             "volumeMounts": [{"name": "extra", "mountPath": "/extra"}]}}):
        doc = _resource(storage)
        assert admit(doc) == [], storage
        plan(doc, mixed_pool())
    for path in sorted((ROOT / "manifests" / "examples").glob("*.yaml")):
        assert admit(yaml.safe_load(path.read_text())) == [], path.name
