"""The `SkipperDeployment` custom resource, defined once: its OpenAPI schema, CEL rules, printer columns and
subresources live here, and `manifests/crd.yaml` is generated from `crd_manifest()` (`make crd`).

The same schema validates specs outside a cluster: `apply_schema(spec)` fills defaults and checks types,
ranges, enums and required fields the way the API server's structural schema does, and `RULES` pairs each
`x-kubernetes-validations` CEL expression with a Python predicate, so `vskipper-operator plan` refuses what the
API server would refuse, with the field named.

Pure Python: no I/O, no Kubernetes client.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

GROUP = "vskipper.io"
VERSION = "v1alpha1"
KIND = "SkipperDeployment"
PLURAL = "skipperdeployments"
SINGULAR = "skipperdeployment"
SHORT_NAMES = ["skd", "skipper"]
API_VERSION = f"{GROUP}/{VERSION}"

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
POLICIES = ("hybrid", "always-route", "dense")
DTYPES = ("bfloat16", "float16")
ATTENTION_BACKENDS = ("flashinfer", "triton", "fa3", "torch_native")
MODEL_PRESETS = ("llama-3-8b", "qwen3-4b", "qwen3-8b")
# Launch flags the operator sets itself; serving.extraArgs may not repeat them.
OWNED_FLAGS = ("--model", "--arm", "--arm-config", "--enter-tokens", "--exit-tokens", "--host", "--port",
               "--served-model-name", "--tp-size")


class SpecError(ValueError):
    """A SkipperDeployment spec the operator cannot serve; the message starts with the field's path."""


# -- schema building blocks ------------------------------------------------------------------------------------

def _obj(properties: dict, required: tuple[str, ...] = (), description: str = "", **extra: Any) -> dict:
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = list(required)
    if description:
        out["description"] = description
    out.update(extra)
    return out


def _str(description: str, **extra: Any) -> dict:
    return {"type": "string", "description": description, **extra}


def _int(description: str, minimum: int | None = None, maximum: int | None = None, **extra: Any) -> dict:
    out: dict[str, Any] = {"type": "integer", "description": description, **extra}
    if minimum is not None:
        out["minimum"] = minimum
    if maximum is not None:
        out["maximum"] = maximum
    return out


def _num(description: str, **extra: Any) -> dict:
    return {"type": "number", "description": description, **extra}


def _bool(description: str, default: bool) -> dict:
    return {"type": "boolean", "description": description, "default": default}


def _policy(phase: str) -> dict:
    return _str(f"{phase} policy: hybrid (route when the roofline rule says it pays), always-route, or dense",
                enum=list(POLICIES), default="hybrid")


def _untyped(description: str) -> dict:
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


SPEC_SCHEMA: dict = _obj({
    "model": _obj({
        "path": _str("checkpoint directory inside the container, or a URI the runtime image can fetch "
                     "(hf://org/name, s3://bucket/key)", minLength=1, maxLength=1024),
        "servedName": _str("model name the OpenAI-compatible endpoint serves (default: the resource name)",
                           maxLength=253),
        "dtype": _str("weight and KV-cache dtype", enum=list(DTYPES), default="bfloat16"),
        "preset": _str("model facts (depth, routed layers, KV geometry) the thresholds are derived from",
                       enum=list(MODEL_PRESETS)),
        "kvHeads": _int("KV heads, when no preset is named", 1, 1024),
        "headDim": _int("head dimension, when no preset is named", 1, 1024),
        "routedLayers": _int("routed layers L_r, when no preset is named", 1, 1024),
    }, required=("path",), description="the checkpoint and the facts of its architecture"),
    "skipper": _obj({
        "name": _str("registered skipper (flexidepth, qwen3_hard_gate, random_skip, static_depth, or a plugin)",
                     minLength=1, maxLength=63),
        "params": _untyped("the skipper's parameters, validated by the skipper registry"),
        "skipRatio": _num("declared fraction s of routed decisions that project (default: what the skipper "
                          "declares from its params)", minimum=0, exclusiveMinimum=True, maximum=1),
        "routedLayers": _int("routed layers L_r (default: the model's)", 1, 1024),
    }, required=("name",), description="the layer skipper and what the roofline rule assumes of it"),
    "switch": _obj({
        "prefill": _policy("prefill"),
        "decode": _policy("decode"),
        "promotion": _bool("promote running dense decodes when routing turns on", True),
        "tauMsPerRoutedLayer": _num("routed mode's fixed per-step cost per routed layer, ms (default: "
                                    "vskipper.constants, 2.67 ms per 16 layers)", minimum=0,
                                    exclusiveMinimum=True, maximum=10),
        "thresholds": _obj({
            "exitTokens": _int("leave routing at or below this many resident KV tokens", 0),
            "enterTokens": _int("enter routing at or above this many resident KV tokens", 0),
        }, required=("exitTokens", "enterTokens"),
            description="fixed thresholds for every GPU class instead of the roofline rule's"),
    }, description="when routed execution is used, per phase"),
    "serving": _obj({
        "image": _str("runtime image (vSkipper on SGLang)", minLength=1),
        "port": _int("HTTP port of the server", 1, 65535, default=30000),
        "cudaGraphMaxBatchSize": _int("--cuda-graph-max-bs-decode (SGLang 0.5.21: the largest decode batch captured in a graph)", 1, 4096),
        "memFractionStatic": _num("--mem-fraction-static", minimum=0, exclusiveMinimum=True, maximum=1,
                                  exclusiveMaximum=True),
        "attentionBackend": _str("--attention-backend", enum=list(ATTENTION_BACKENDS)),
        "prefixCache": _bool("radix prefix cache (false adds --disable-radix-cache)", True),
        "extraArgs": {"type": "array", "items": {"type": "string", "maxLength": 256}, "maxItems": 64,
                      "description": "further server arguments, appended verbatim"},
    }, required=("image",), description="the runtime container and the SGLang launch arguments that matter"),
    "placement": _obj({
        "gpuProducts": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 64,
                        "x-kubernetes-list-type": "set",
                        "description": "GPU products allowed (nvidia.com/gpu.product values or catalogue "
                                       "names); empty allows every product present"},
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"},
                         "description": "labels every node must carry"},
        "tolerations": {"type": "array", "items": _untyped("a core/v1 Toleration")},
    }, description="which nodes serve"),
    "replicas": _int("total server replicas, split across the GPU classes served (scale subresource)", 0,
                     1000, default=1),
    "replicasPerClass": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0},
                         "description": "replicas per GPU product, instead of splitting spec.replicas"},
    "resources": _obj({
        "gpus": _int("GPUs per replica (tensor parallel size)", 1, 8, default=1),
        "cpu": {"x-kubernetes-int-or-string": True, "description": "CPU request"},
        "memory": {"x-kubernetes-int-or-string": True, "description": "memory request"},
    }, description="per-replica resources"),
    "bandwidthOverrides": {
        "type": "array", "maxItems": 64, "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["product"],
        "description": "memory bandwidth per GPU product, preferred over measurements and the catalogue",
        "items": _obj({
            "product": _str("nvidia.com/gpu.product value", minLength=1),
            "gbps": _num("memory bandwidth, GB/s", minimum=0, exclusiveMinimum=True, maximum=100000),
        }, required=("product", "gbps")),
    },
    "bandwidthProbe": _obj({
        "enabled": _bool("run a copy-bandwidth probe Job per GPU class and prefer its result over the "
                         "catalogue", False),
    }, description="measured bandwidth"),
    "metrics": _obj({
        "enabled": _bool("serve Prometheus metrics from the runtime", True),
        "serviceMonitor": _bool("create a monitoring.coreos.com/v1 ServiceMonitor", False),
        "interval": _str("scrape interval", pattern=r"^[0-9]+(ms|s|m)$", default="30s"),
    }, description="the runtime's metrics"),
}, required=("model", "skipper", "serving"))


@dataclass(frozen=True)
class Rule:
    """One cross-field check: the CEL the API server evaluates and the same check in Python."""

    path: str  # where the rule is attached, relative to spec ("" for spec itself)
    cel: str
    message: str
    check: Callable[[Mapping[str, Any]], bool]


def _routed_policies(sw: Mapping[str, Any]) -> set[str]:
    return {sw.get(p, "hybrid") for p in ("prefill", "decode")} - {"dense"}


RULES: tuple[Rule, ...] = (
    Rule("model", "has(self.preset) || (has(self.kvHeads) && has(self.headDim) && has(self.routedLayers))",
         "name a preset, or give kvHeads, headDim and routedLayers",
         lambda m: "preset" in m or all(k in m for k in ("kvHeads", "headDim", "routedLayers"))),
    Rule("switch.thresholds", "self.enterTokens >= self.exitTokens",
         "enterTokens must be at least exitTokens", lambda t: t["enterTokens"] >= t["exitTokens"]),
    Rule("switch",
         "(has(self.prefill) ? self.prefill : 'hybrid') == 'dense' || (has(self.decode) ? self.decode : 'hybrid')"
         " == 'dense' || (has(self.prefill) ? self.prefill : 'hybrid') == (has(self.decode) ? self.decode : 'hybrid')",
         "prefill and decode, when both routed, must use the same policy (hybrid or always-route)",
         lambda s: len(_routed_policies(s)) <= 1),
    Rule("serving",
         "!has(self.extraArgs) || self.extraArgs.all(a, !" + repr(list(OWNED_FLAGS)).replace('"', "'")
         + ".exists(f, a == f || a.startsWith(f + '=')))",
         "extraArgs must not set flags the operator owns (" + ", ".join(OWNED_FLAGS) + ")",
         lambda s: not any(a == f or a.startswith(f + "=") for a in s.get("extraArgs", []) for f in OWNED_FLAGS)),
)


def _attach_rules(schema: dict) -> dict:
    schema = copy.deepcopy(schema)
    for rule in RULES:
        node = schema
        for part in filter(None, rule.path.split(".")):
            node = node["properties"][part]
        node.setdefault("x-kubernetes-validations", []).append({"rule": rule.cel, "message": rule.message})
    for node in _walk(schema):
        if node.get("x-kubernetes-validations") == []:
            del node["x-kubernetes-validations"]
    return schema


def _walk(node: dict):
    yield node
    for child in node.get("properties", {}).values():
        yield from _walk(child)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _walk(node[key])


def _class_status() -> dict:
    return _obj({
        "product": _str("nvidia.com/gpu.product (normalised)"),
        "device": _str("catalogue device, if known"),
        "nodes": _int("nodes of this class"),
        "served": {"type": "boolean"},
        "reason": _str("why the class is not served"),
        "bandwidthGBps": _num("memory bandwidth the thresholds were derived from"),
        "bandwidthSource": _str("where the bandwidth came from", enum=["catalogue", "override", "measured"]),
        "thresholdSource": _str("roofline or override", enum=["roofline", "override"]),
        "vStarTokens": _num("the crossover V*, resident KV tokens"),
        "exitTokens": _int("exit threshold"),
        "enterTokens": _int("enter threshold"),
        "ridgeRows": _num("ridge point M*, rows"),
        "deployment": _str("the Deployment serving this class"),
        "replicas": _int("desired replicas"),
        "readyReplicas": _int("ready replicas"),
    })


STATUS_SCHEMA: dict = _obj({
    "observedGeneration": {"type": "integer", "format": "int64"},
    "replicas": _int("desired replicas over all classes"),
    "readyReplicas": _int("ready replicas over all classes"),
    "selector": _str("label selector of the server pods (scale subresource)"),
    "gpuClassSummary": _str("served GPU classes and their exit/enter thresholds"),
    "gpuClasses": {"type": "array", "items": _class_status()},
    "conditions": {"type": "array", "items": _obj({
        "type": _str("Ready, ThresholdsDerived or Degraded"),
        "status": _str("True, False or Unknown", enum=["True", "False", "Unknown"]),
        "reason": _str("CamelCase reason"),
        "message": _str("human-readable detail"),
        "lastTransitionTime": _str("when status last changed", format="date-time"),
        "observedGeneration": {"type": "integer", "format": "int64"},
    }, required=("type", "status")), "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
}, **{"x-kubernetes-preserve-unknown-fields": True})


PRINTER_COLUMNS = [
    {"name": "GPU Classes", "type": "string", "jsonPath": ".status.gpuClassSummary"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def openapi_schema() -> dict:
    """The version's full openAPIV3Schema (what the API server validates a resource against)."""
    return _obj({
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": _attach_rules(SPEC_SCHEMA),
        "status": STATUS_SCHEMA,
    }, required=("spec",))


def crd_manifest() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": SHORT_NAMES, "categories": ["vskipper"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema()},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


def render_crd_yaml() -> str:
    import yaml

    header = "# Generated by `vskipper-operator crd` (make crd) from vskipper_operator/crd.py: do not edit.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=110)


# -- validation outside a cluster -------------------------------------------------------------------------------

_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                       "boolean": (bool,), "object": (dict,), "array": (list,)}


def _check(node: dict, value: Any, path: str) -> Any:
    if node.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise SpecError(f"{path}: must be an integer or a string, got {value!r}")
        return value
    kind = node.get("type")
    if kind:
        ok = isinstance(value, _TYPES[kind]) and not (kind != "boolean" and isinstance(value, bool))
        if kind == "integer" and isinstance(value, float) and value.is_integer():
            value, ok = int(value), True
        if not ok:
            raise SpecError(f"{path}: must be of type {kind}, got {value!r}")
    if "enum" in node and value not in node["enum"]:
        raise SpecError(f"{path}: must be one of {', '.join(map(str, node['enum']))}, got {value!r}")
    if kind in ("integer", "number"):
        lo, hi = node.get("minimum"), node.get("maximum")
        lo_open, hi_open = node.get("exclusiveMinimum", False), node.get("exclusiveMaximum", False)
        if (lo is not None and (value <= lo if lo_open else value < lo)) or (
                hi is not None and (value >= hi if hi_open else value > hi)):
            lo_s = "-inf" if lo is None else f"{lo}"
            hi_s = "inf" if hi is None else f"{hi}"
            raise SpecError(f"{path}: must be in {'(' if lo_open else '['}{lo_s}, {hi_s}{')' if hi_open else ']'}"
                            f", got {value!r}")
    if kind == "string":
        if len(value) < node.get("minLength", 0):
            raise SpecError(f"{path}: must not be empty" if node.get("minLength") == 1
                            else f"{path}: must have at least {node['minLength']} characters")
        if "maxLength" in node and len(value) > node["maxLength"]:
            raise SpecError(f"{path}: must have at most {node['maxLength']} characters")
        if "pattern" in node and not re.search(node["pattern"], value):
            raise SpecError(f"{path}: must match {node['pattern']}, got {value!r}")
    if kind == "array":
        if "maxItems" in node and len(value) > node["maxItems"]:
            raise SpecError(f"{path}: must have at most {node['maxItems']} items")
        items = [_check(node["items"], v, f"{path}[{i}]") for i, v in enumerate(value)] if "items" in node else value
        keys = node.get("x-kubernetes-list-map-keys")
        if keys:
            seen = set()
            for i, item in enumerate(items):
                key = tuple(item.get(k) for k in keys)
                if key in seen:
                    raise SpecError(f"{path}[{i}]: duplicate entry for {keys[0]} {key[0]!r}")
                seen.add(key)
        return items
    if kind == "object":
        return _check_object(node, value, path)
    return value


def _check_object(node: dict, value: dict, path: str) -> dict:
    if node.get("x-kubernetes-preserve-unknown-fields") and "properties" not in node:
        return copy.deepcopy(value)
    if "additionalProperties" in node:
        return {k: _check(node["additionalProperties"], v, f"{path}.{k}") for k, v in value.items()}
    props = node.get("properties", {})
    unknown = sorted(set(value) - set(props))
    if unknown and not node.get("x-kubernetes-preserve-unknown-fields"):
        raise SpecError(f"{path}.{unknown[0]}: unknown field (allowed: {', '.join(props)})")
    out = {}
    for key, child in props.items():
        if key in value:
            out[key] = _check(child, value[key], f"{path}.{key}")
        elif "default" in child:
            out[key] = copy.deepcopy(child["default"])
        elif key in node.get("required", ()):
            raise SpecError(f"{path}.{key}: required")
        elif child.get("type") == "object" and any("default" in c for c in child.get("properties", {}).values()):
            out[key] = _check_object(child, {}, f"{path}.{key}")  # the API server defaults nested fields too
    return out


def apply_schema(spec: Any, path: str = "spec") -> dict:
    """Check `spec` against the schema and the CEL rules, returning it with the schema's defaults filled in."""
    if not isinstance(spec, dict):
        raise SpecError(f"{path}: must be an object, got {type(spec).__name__}")
    out = _check_object(SPEC_SCHEMA, spec, path)
    for rule in RULES:
        node: Any = out
        for part in filter(None, rule.path.split(".")):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and not rule.check(node):
            raise SpecError(f"{'.'.join(filter(None, (path, rule.path)))}: {rule.message}")
    return out
