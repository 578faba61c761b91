"""The SkipperDeployment CRD: generated from one Python definition, checked with real validators.

No kube-apiserver runs here, so the schema is checked piecewise with real implementations: `jsonschema`'s
Draft 4 validator (Kubernetes' OpenAPI v3 schemas use Draft 4's boolean exclusiveMinimum/Maximum) for the
structural part, and `cel-python` (a CEL interpreter) for the `x-kubernetes-validations` rules; the Kubernetes
structural-schema constraints themselves are asserted by walking the schema.
"""

from __future__ import annotations

import copy
from pathlib import Path

import celpy
import jsonschema
import pytest
import yaml
from operator_fixtures import A100, resource

from vskipper_operator.crd import (
    NAME_RULE,
    RULES,
    SpecError,
    apply_schema,
    crd_manifest,
    openapi_schema,
    render_crd_yaml,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))


def validator():
    return jsonschema.Draft4Validator(openapi_schema())


def walk(node, path="spec"):
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from walk(node[key], f"{path}[]")


def test_committed_crd_matches_the_generator():
    committed = (ROOT / "manifests" / "crd.yaml").read_text()
    assert committed == render_crd_yaml(), "manifests/crd.yaml is stale: run `make crd`"


def test_crd_has_status_and_scale_subresources_and_printer_columns():
    version = crd_manifest()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert "status" in version["subresources"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["GPU Classes", "Replicas", "Ready", "Age"]


def test_schema_is_structural():
    """Kubernetes' structural-schema rules: every node typed (or int-or-string / preserve-unknown), map-list
    keys required, set-lists of scalars, CEL rules only on typed nodes."""
    spec = openapi_schema()["properties"]["spec"]
    for path, node in walk(spec):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        if node.get("x-kubernetes-list-type") == "map":
            assert set(node["x-kubernetes-list-map-keys"]) <= set(node["items"]["required"]), path
        if node.get("x-kubernetes-list-type") == "set":
            assert node["items"]["type"] in ("string", "integer", "number", "boolean"), path
        if node.get("x-kubernetes-validations"):
            assert node["type"] == "object", path


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_against_the_schema(path):
    doc = yaml.safe_load(path.read_text())
    validator().validate(doc)
    apply_schema(doc["spec"])


@pytest.mark.parametrize(("change", "field"), [
    ({"replicas": -1}, "replicas"),
    ({"replicas": "two"}, "replicas"),
    ({"serving": {}}, "serving"),
    ({"switch": {"decode": "sometimes"}}, "decode"),
    ({"skipper": {"name": "flexidepth", "skipRatio": 0}}, "skipRatio"),
    ({"skipper": {"name": "flexidepth", "skipRatio": 1.5}}, "skipRatio"),
    ({"bandwidthOverrides": [{"product": A100}]}, "bandwidthOverrides"),
    ({"resources": {"gpus": 9}}, "gpus"),
    ({"serving": {"image": "x", "memFractionStatic": 1}}, "memFractionStatic"),
])
def test_invalid_resources_fail_both_the_schema_and_the_operator_naming_the_field(change, field):
    doc = resource(**change)
    errors = list(validator().iter_errors(doc))
    assert errors, f"the schema accepted {change}"
    assert any(field in "/".join(map(str, e.absolute_path)) or field in e.message for e in errors)
    with pytest.raises(SpecError, match=field):
        apply_schema(doc["spec"])


def cel(rule_expr: str, value) -> bool:
    env = celpy.Environment()
    return bool(env.program(env.compile(rule_expr)).evaluate({"self": celpy.json_to_cel(value)}))


# Values for the nodes each rule is attached to; every rule must see both outcomes among its path's values.
CEL_CASES = {
    "model": [{"path": "/m", "preset": "llama-3-8b"}, {"path": "/m"},
              {"path": "/m", "kvHeads": 8, "headDim": 128, "routedLayers": 16},
              {"path": "/m", "kvHeads": 8, "headDim": 128},
              {"path": "hf://Qwen/Qwen3-8B", "preset": "qwen3-8b", "revision": "v1",
               "download": {"tokenSecret": {"name": "hf"}}, "storage": {"readOnly": False}},
              {"path": "s3://bucket/llama", "preset": "llama-3-8b"}, {"path": "models/llama", "preset": "llama-3-8b"},
              {"path": "hf://Qwen", "preset": "qwen3-8b"}, {"path": "/m", "preset": "llama-3-8b", "revision": "v1"},
              {"path": "/m", "preset": "llama-3-8b", "download": {}},
              {"path": "hf://a/b", "preset": "qwen3-8b", "storage": {"readOnly": True}}],
    "model.storage": [{"pvc": {"claimName": "w"}}, {"hostPath": {"path": "/w"}, "subPath": "llama/8b"},
                      {"pvc": {"claimName": "w"}, "hostPath": {"path": "/w"}}, {},
                      {"pvc": {"claimName": "w"}, "subPath": "a/../../etc"}],
    "model.download": [{}, {"cacheSizeLimit": "100Gi"}, {"cacheSizeLimit": 5}, {"cacheSizeLimit": "lots"}],
    "serving.networkPolicy": [{"enabled": False}, {"enabled": True}, {"enabled": True, "allowFrom": []},
                              {"enabled": True, "allowFrom": [{"namespaces": ["monitoring"]}]}, {}],
    "serving.networkPolicy.allowFrom[]": [{"namespaces": ["gateway"]}, {"podLabels": {"role": "client"}}, {},
                                          {"namespaces": ["gateway"], "podLabels": {"example.com/role": "client"}},
                                          {"podLabels": {"a b": "client"}}],
    "pod.env[]": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"value": "x"}, {"name": "1BAD"},
                  {"name": "VSKIPPER_API_KEY", "value": "x"}],
    "pod.volumes[]": [{"name": "extra", "emptyDir": {}}, {"name": "model", "emptyDir": {}}, {"name": "Bad_Name"}],
    "pod.volumeMounts[]": [{"name": "extra", "mountPath": "/extra"}, {"name": "extra", "mountPath": "extra"},
                           {"mountPath": "/x"}],
    "switch.thresholds": [{"exitTokens": 1, "enterTokens": 2}, {"exitTokens": 3, "enterTokens": 2},
                          {"exitTokens": 2, "enterTokens": 2}],
    "switch": [{}, {"prefill": "dense", "decode": "routed"}, {"prefill": "routed", "decode": "hybrid"},
               {"prefill": "routed"}, {"prefill": "hybrid", "decode": "hybrid"}, {"prefillFloorTokens": 2048},
               {"prefill": "hybrid", "decode": "dense", "prefillFloorTokens": 2048},
               {"prefill": "dense", "decode": "hybrid", "prefillFloorTokens": 2048}],
    "serving": [{"image": "x"}, {"image": "x", "extraArgs": ["--max-running-requests", "8"]},
                {"image": "x", "extraArgs": ["--port=8"]}, {"image": "x", "extraArgs": ["--arm"]},
                {"image": "x", "extraArgs": ["--portal"]}, {"image": "x", "extraArgs": ["--enter", "0"]},
                {"image": "x", "extraArgs": ["--tensor-parallel-size", "2"]}],
    "resources": [{}, {"cpu": 8, "memory": "64Gi"}, {"cpu": "500m"}, {"cpu": -4}, {"memory": "lots"},
                  {"cpu": "1.5"}, {"memory": "1e3"}, {"memory": "64 Gi"}],
    "placement.nodeSelector": [{}, {"zone": "a", "example.com/pool": "gpu"}, {"bad key!": "x"}, {"a/b/c": "x"}],
    "placement.tolerations[]": [{"key": "gpu", "operator": "Exists"}, {"key": "gpu", "operator": "Exists", "value": "x"},
                                {"operator": "Exists"}, {"operator": "Equal", "value": "x"},
                                {"key": "bad key!", "operator": "Exists"},
                                {"key": "g", "effect": "NoExecute", "tolerationSeconds": 30},
                                {"key": "g", "effect": "NoSchedule", "tolerationSeconds": 30}],
    "replicasPerClass": [{}, {A100: 2}, {"no such gpu!": 1}, {"x" * 64: 1}],
    "skipper": [{"name": "flexidepth"}, {"name": "flexidepth", "params": {"skip_ratio": 0.5}},
                {"name": "flexidepth", "params": {"r": 0.5}}, {"name": "random_skip", "params": {"r": 0.5, "d": 0.5}},
                {"name": "random_skip", "params": {"d": 0.5}}, {"name": "random_skip", "params": {"r": 0.5}},
                {"name": "random_skip"}, {"name": "random_skip", "params": {"r": 0.5, "d": 0.5, "skip_ratio": 0.5}},
                {"name": "static_depth", "params": {"ratio": 0.5}}, {"name": "static_depth"},
                {"name": "qwen3_hard_gate", "params": {"ratio": 0.5}},
                {"name": "static_depth", "params": {"ratio": 0.5, "seed": 1}}],
}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.path or 'spec'}:{r.field}:{r.message[:30]}")
def test_cel_rules_evaluate_as_their_python_twins(rule):
    outcomes = set()
    for value in CEL_CASES[rule.path]:
        want = bool(rule.check(value))
        assert cel(rule.cel, value) is want, (rule.cel, value)
        outcomes.add(want)
    assert outcomes == {True, False}, f"the cases for {rule.path} never {'fail' if True in outcomes else 'pass'}"


def test_name_rule_evaluates_as_its_python_twin():
    for name, want in (("llama", True), ("a" * 40, True), ("a" * 41, False), ("Llama_8B", False), ("-a", False)):
        doc = {"metadata": {"name": name}}
        assert cel(NAME_RULE.cel, doc) is want and NAME_RULE.check(doc) is want, name


def test_cel_rules_are_attached_where_they_apply():
    spec = openapi_schema()["properties"]["spec"]
    for rule in RULES:
        node = spec
        for part in filter(None, rule.path.split(".")):
            node = node["properties"][part.removesuffix("[]")]
            node = node["items"] if part.endswith("[]") else node
        assert rule.validation() in node["x-kubernetes-validations"]


def test_schema_defaults_are_filled_as_the_api_server_would():
    spec = apply_schema(copy.deepcopy(resource()["spec"]))
    assert spec["switch"] == {"prefill": "hybrid", "decode": "hybrid", "promotion": True}
    assert spec["serving"]["port"] == 30000 and spec["serving"]["prefixCache"] is True
    assert spec["metrics"] == {"enabled": True, "serviceMonitor": False, "interval": "30s"}
