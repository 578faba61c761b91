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

from vskipper.constants import CONSTANTS
from vskipper.serveargs import API_KEY_ENV, operator_owned_strings
from vskipper.skippers.registry import registered
from vskipper.switch import Policy

GROUP = "vskipper.io"
VERSION = "v1alpha1"
KIND = "SkipperDeployment"
PLURAL = "skipperdeployments"
SINGULAR = "skipperdeployment"
SHORT_NAMES = ["skd", "skipper"]
API_VERSION = f"{GROUP}/{VERSION}"

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
POLICIES = tuple(p.value for p in Policy)  # the switch's own values, as arms hold them
DTYPES = ("bfloat16", "float16")
ATTENTION_BACKENDS = ("flashinfer", "triton", "fa3", "torch_native")
MODEL_PRESETS = ("llama-3-8b", "qwen3-4b", "qwen3-8b")
# Launch flags the operator sets itself, with every alias the parsers that read them accept (`vskipper serve`:
# --arm-file; SGLang 0.5.21: --model for --model-path, --tensor-parallel-size): serving.extraArgs may not repeat
# them (the API key comes from a Secret, serving.apiKeySecret, never from the spec's text). Declared once in
# `vskipper.serveargs`; `vskipper_operator.flags` checks extraArgs with the parsers themselves.
OWNED_ARGS = operator_owned_strings()
MAX_NAME = 40  # child objects append the GPU class to the resource's name and must stay DNS labels
DRAIN_SECONDS = 15  # preStop: endpoints stop routing to a terminating pod before SGLang gets SIGTERM
# The least grace period a server pod gets: the drain's sleep, then as long again for SGLang's own shutdown (the
# kubelet kills the container when the grace period, which the preStop hook's time counts in, runs out).
MIN_GRACE_SECONDS = 2 * DRAIN_SECONDS
MAX_TOKENS = 10**9  # thresholds above this are typos (no GPU holds a billion resident KV tokens)

# Patterns the API server would otherwise check only when the derived objects are written (RE2 and Python re).
DNS_LABEL_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_1035_RE = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # a Service's name: a letter first
LABEL_VALUE_RE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
LABEL_KEY_RE = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
# distribution/reference: [domain[:port]/]path[:tag][@digest], path components lower case.
_PATH_COMPONENT = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*"
_DOMAIN = r"[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?)*(:[0-9]+)?"
IMAGE_RE = (rf"^({_DOMAIN}/)?{_PATH_COMPONENT}(/{_PATH_COMPONENT})*(:[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
            r"(@sha256:[a-f0-9]{64})?$")
# A non-negative Kubernetes quantity (resource.Quantity's grammar without the sign).
QUANTITY_RE = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[mkMGTPE]|[eE][0-9]+)?$"
# spec.model.path: a directory in the container (the image's, or a mounted volume's), or a Hugging Face Hub repository
# the server pods download before the server starts. Other schemes (s3://, gs://, http://) are refused at admission.
HF_SCHEME = "hf://"
HF_REPO_RE = r"^hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*$"
REVISION_RE = r"^[A-Za-z0-9][-A-Za-z0-9_.]*(/[A-Za-z0-9][-A-Za-z0-9_.]*)*$"
RELATIVE_PATH_RE = r"^[^/]"
DOT_DOT_RE = r"(^|/)\.\.(/|$)"
DNS_SUBDOMAIN_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENV_NAME_RE = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")


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
    return _str(f"{phase} policy (vskipper.switch.Policy): hybrid (route when the roofline rule says it pays), "
                "routed (always), or dense",
                enum=list(POLICIES), default="hybrid")


def _secret_key(description: str, key: str) -> dict:
    return _obj({"name": _str("Secret name (in the resource's namespace)", minLength=1, maxLength=253,
                              pattern=DNS_SUBDOMAIN_RE),
                 "key": _str(f"key in the Secret (default {key})", minLength=1, maxLength=253)},
                required=("name",), description=description)


def _free_form(description: str, max_items: int = 64) -> dict:
    """Kubernetes objects the planned pods carry verbatim (checked by the API server when they are written)."""
    return {"type": "array", "maxItems": max_items, "description": description,
            "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}


def _skipper_params() -> dict:
    """Every registered skipper's parameters, typed with their ranges (a name two skippers share must mean the
    same); which names each skipper takes and requires are CEL rules on `skipper` (SKIPPER_RULES)."""
    props: dict[str, dict] = {}
    for entry in registered().values():
        for key, p in entry.params.items():
            kind = {bool: "boolean", int: "integer", float: "number"}.get(p.kind, "string")
            node: dict[str, Any] = {"type": kind, "description": p.help}
            if p.minimum is not None:
                node["minimum"] = p.minimum
            if p.maximum is not None:
                node["maximum"] = p.maximum
            seen = props.setdefault(key, node)
            if {k: v for k, v in seen.items() if k != "description"} != {k: v for k, v in node.items()
                                                                        if k != "description"}:
                raise ValueError(f"skipper parameter {key!r} has different types or ranges across skippers")
    return _obj(props, description="the skipper's parameters (which apply depends on skipper.name)")


def _quantity(description: str) -> dict:
    return {"x-kubernetes-int-or-string": True, "description": f"{description} (a Kubernetes quantity: 8, 500m, "
            "64Gi)"}


TOLERATION = _obj({
    "key": _str("taint key (empty with operator Exists: every taint)", maxLength=317),
    "operator": _str("Exists or Equal (default Equal)", enum=list(TOLERATION_OPERATORS)),
    "value": _str("taint value (operator Equal)", maxLength=63, pattern=LABEL_VALUE_RE),
    "effect": _str("taint effect to match (empty: every effect)", enum=list(TAINT_EFFECTS)),
    "tolerationSeconds": {"type": "integer", "format": "int64",
                          "description": "how long a NoExecute taint is tolerated"},
}, description="a core/v1 Toleration")


SPEC_SCHEMA: dict = _obj({
    "model": _obj({
        "path": _str("checkpoint directory inside the container (in the image, or where spec.model.storage "
                     "mounts it), or hf://ORG/NAME: downloaded into a cache volume by an init container before "
                     "the server starts; other schemes are refused", minLength=1, maxLength=1024),
        "revision": _str("hf:// only: branch, tag or commit to download (default main)", maxLength=255,
                         pattern=REVISION_RE),
        "storage": _obj({
            "pvc": _obj({"claimName": _str("PersistentVolumeClaim in the resource's namespace", minLength=1,
                                           maxLength=253, pattern=DNS_SUBDOMAIN_RE)},
                        required=("claimName",), description="a PersistentVolumeClaim holding the checkpoint"),
            "hostPath": _obj({"path": _str("directory on the node", minLength=2, maxLength=1024, pattern=r"^/")},
                             required=("path",), description="a directory on every GPU node (pre-staged weights)"),
            "subPath": _str("directory inside the volume", maxLength=1024, pattern=RELATIVE_PATH_RE),
            "readOnly": {"type": "boolean", "description": "mount read-only (default: true for a local path; "
                                                             "an hf:// download writes, so it must be false)"},
        }, description="the volume holding the checkpoint (a local path: mounted at spec.model.path), or the "
                       "download cache (hf://: mounted at /models; default an emptyDir)"),
        "download": _obj({
            "tokenSecret": _secret_key("a Secret holding a Hugging Face token (HF_TOKEN)", "token"),
            "endpoint": _str("the hub's base URL (HF_ENDPOINT), for a mirror", maxLength=512,
                             pattern=r"^https?://[^\s]+$"),
            "cacheSizeLimit": _quantity("size limit of the default emptyDir download cache"),
        }, description="hf:// only: how the init container downloads the checkpoint"),
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
        "name": _str("registered skipper (the built-in ones and the plugins installed where the CRD was "
                     "generated)", enum=sorted(registered())),
        "params": _skipper_params(),
        "skipRatio": _num("declared fraction s of routed decisions that project (default: what the skipper "
                          "declares from its params, as the routed layers carry it out)", minimum=0,
                          exclusiveMinimum=True, maximum=1),
        "routedLayers": _int("routed layers L_r (default: the model's)", 1, 1024),
    }, required=("name",), description="the layer skipper and what the roofline rule assumes of it"),
    "switch": _obj({
        "prefill": _policy("prefill"),
        "decode": _policy("decode"),
        "promotion": _bool("promote running dense decodes when routing turns on", True),
        "tauMsPerRoutedLayer": _num("routed mode's fixed per-step cost per routed layer, ms (default: "
                                    f"vskipper.constants, {CONSTANTS.tau_ms_per_16_layers} ms per "
                                    f"{CONSTANTS.tau_reference_routed_layers} layers)", minimum=0,
                                    exclusiveMinimum=True, maximum=10),
        "prefillFloorTokens": _int("a hybrid prefill routes an admission round from this many prompt tokens (default: "
                                   f"vskipper.constants, {CONSTANTS.prefill_min_prompt_tokens}; where routed prefill "
                                   "pays off is the device's: benchmarks/gpu measures it)", 1, MAX_TOKENS),
        "thresholds": _obj({
            "exitTokens": _int("leave routing at or below this many resident KV tokens", 0, MAX_TOKENS),
            "enterTokens": _int("enter routing at or above this many resident KV tokens", 0, MAX_TOKENS),
        }, required=("exitTokens", "enterTokens"),
            description="fixed thresholds for every GPU class instead of the roofline rule's"),
    }, description="when routed execution is used, per phase"),
    "serving": _obj({
        "image": _str("runtime image (vSkipper on SGLang): [registry[:port]/]path[:tag][@sha256:digest]",
                      minLength=1, maxLength=512, pattern=IMAGE_RE),
        "port": _int("HTTP port of the server", 1, 65535, default=30000),
        "cudaGraphMaxBatchSize": _int("--cuda-graph-max-bs-decode (SGLang 0.5.21: the largest decode batch captured in a graph)", 1, 4096),
        "memFractionStatic": _num("--mem-fraction-static", minimum=0, exclusiveMinimum=True, maximum=1,
                                  exclusiveMaximum=True),
        "attentionBackend": _str("--attention-backend", enum=list(ATTENTION_BACKENDS)),
        "prefixCache": _bool("radix prefix cache (false adds --disable-radix-cache)", True),
        "extraArgs": {"type": "array", "items": {"type": "string", "maxLength": 256}, "maxItems": 64,
                      "description": "further server arguments, appended verbatim"},
        "apiKeySecret": _secret_key("a Secret holding the API key the server requires (SGLang --api-key, "
                                    "passed through the environment)", "api-key"),
        "startupTimeoutSeconds": _int("how long a server may take to load the model and warm up before its "
                                      "liveness probe counts", 60, 7200, default=1800),
        "terminationGracePeriodSeconds": _int("time a server pod gets to drain in-flight requests on shutdown "
                                              f"(the preStop drain's {DRAIN_SECONDS} s included)",
                                              MIN_GRACE_SECONDS, 3600, default=120),
        "networkPolicy": _obj({
            "enabled": _bool("plan a networking.k8s.io/v1 NetworkPolicy admitting only allowFrom to the server "
                             "port (Prometheus included: allow its namespace to scrape /metrics)", False),
            "allowFrom": {"type": "array", "maxItems": 32, "description": "the clients admitted, any of them",
                          "items": _obj({
                              "namespaces": {"type": "array", "minItems": 1, "maxItems": 64,
                                             "x-kubernetes-list-type": "set",
                                             "description": "namespaces by name (default: the resource's own)",
                                             "items": _str("a namespace", minLength=1, maxLength=63,
                                                           pattern=DNS_LABEL_RE)},
                              "podLabels": {"type": "object", "minProperties": 1, "maxProperties": 32,
                                            "description": "labels the client pods carry (default: every pod of "
                                                           "those namespaces)",
                                            "additionalProperties": _str("label value", maxLength=63,
                                                                         pattern=LABEL_VALUE_RE)},
                          }, description="a peer: pods with podLabels in namespaces (both given: both hold)")},
        }, description="an ingress NetworkPolicy for the server pods (off by default)"),
    }, required=("image",), description="the runtime container and the SGLang launch arguments that matter"),
    "pod": _obj({
        "serviceAccountName": _str("ServiceAccount of the server pods", maxLength=253, pattern=DNS_SUBDOMAIN_RE),
        "imagePullSecrets": {"type": "array", "maxItems": 16, "description": "Secrets for pulling the image",
                             "items": _obj({"name": _str("Secret name", minLength=1, maxLength=253,
                                                         pattern=DNS_SUBDOMAIN_RE)}, required=("name",))},
        "priorityClassName": _str("PriorityClass of the server pods", maxLength=253, pattern=DNS_SUBDOMAIN_RE),
        "annotations": {"type": "object", "maxProperties": 64, "description": "extra pod annotations",
                        "additionalProperties": _str("annotation value", maxLength=4096)},
        "labels": {"type": "object", "maxProperties": 32, "description": "extra pod labels",
                   "additionalProperties": _str("label value", maxLength=63, pattern=LABEL_VALUE_RE)},
        "env": _free_form("extra core/v1 EnvVars of the server container"),
        "volumes": _free_form("extra core/v1 Volumes of the server pods", 32),
        "volumeMounts": _free_form("extra core/v1 VolumeMounts of the server container", 32),
    }, description="pod-level settings of the server pods"),
    "placement": _obj({
        "gpuProducts": {"type": "array", "items": _str("a GPU product", minLength=1, maxLength=63,
                                                      pattern=LABEL_VALUE_RE), "maxItems": 64,
                        "x-kubernetes-list-type": "set",
                        "description": "GPU products allowed (nvidia.com/gpu.product values or catalogue "
                                       "names); empty allows every product present"},
        "nodeSelector": {"type": "object", "maxProperties": 64,
                         "additionalProperties": _str("label value", maxLength=63, pattern=LABEL_VALUE_RE),
                         "description": "labels every node must carry"},
        "tolerations": {"type": "array", "maxItems": 64, "items": TOLERATION},
        "scaleFromZero": _bool("plan every GPU class named in gpuProducts even with no node present, so its "
                               "pending pods make a cluster autoscaler add a node", False),
        "nodeLossGraceSeconds": _int("how long a served GPU class whose nodes are all gone keeps its Deployment "
                                     "(a label flap, a pool drained to zero, an upgrade surge)", 0, 86400,
                                     default=600),
    }, description="which nodes serve"),
    "replicas": _int("total server replicas, split across the GPU classes served (scale subresource)", 0,
                     1000, default=1),
    "replicasPerClass": {"type": "object", "maxProperties": 64,
                         "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 1000},
                         "description": "replicas per GPU product, instead of splitting spec.replicas"},
    "resources": _obj({
        "gpus": _int("GPUs per replica (tensor parallel size)", 1, 8, default=1),
        "cpu": _quantity("CPU request"),
        "memory": _quantity("memory request"),
    }, description="per-replica resources"),
    "bandwidthOverrides": {
        "type": "array", "maxItems": 64, "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["product"],
        "description": "memory bandwidth per GPU product, preferred over measurements and the catalogue",
        "items": _obj({
            "product": _str("nvidia.com/gpu.product value", minLength=1, maxLength=63, pattern=LABEL_VALUE_RE),
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

    path: str  # where the rule is attached, relative to spec ("" for spec itself; "a.b[]": each item of a.b)
    cel: str
    message: str
    check: Callable[[Mapping[str, Any]], bool]
    field: str = ""  # the field the message is about, relative to `path` (the CRD's fieldPath)

    def validation(self) -> dict:
        out = {"rule": self.cel, "message": self.message}
        if self.field:
            out["fieldPath"] = "." + self.field
        return out


def _routed_policies(sw: Mapping[str, Any]) -> set[str]:
    return {sw.get(p, "hybrid") for p in ("prefill", "decode")} - {"dense"}


def _cel_str(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _prefixes(flag: str) -> str:
    """A regex matching `flag` and every abbreviation argparse would expand to it (`--p`, `--po`, ...)."""
    body = flag[2:]
    out = re.escape(body[-1])
    for ch in reversed(body[1:-1]):
        out = f"{re.escape(ch)}({out})?"
    return f"{re.escape(body[0])}({out})?" if len(body) > 1 else re.escape(body)


# Any argument that is an owned flag or an abbreviation of one, with or without `=value`. An over-approximation
# of what the parsers resolve (an ambiguous abbreviation is refused too: the parser would fail on it); the
# planner runs extraArgs through the real parsers (vskipper_operator.flags).
OWNED_ARG_RE = "^--(" + "|".join(_prefixes(f) for f in OWNED_ARGS) + ")(=.*)?$"
GPU_PRODUCT_RE = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


def _is_quantity(value: Any) -> bool:
    if isinstance(value, str):
        return re.search(QUANTITY_RE, value) is not None
    return isinstance(value, int) and value >= 0


def _quantity_rule(key: str) -> Rule:
    return Rule("resources", f"!has(self.{key}) || (type(self.{key}) == string ? "
                f"self.{key}.matches({_cel_str(QUANTITY_RE)}) : self.{key} >= 0)",
                "must be a non-negative Kubernetes quantity (8, 500m, 64Gi)",
                lambda r: key not in r or _is_quantity(r[key]), key)


def _skipper_rules() -> tuple[Rule, ...]:
    """Per registered skipper: the parameters it takes, and each one it requires."""
    rules = []
    every = sorted({k for e in registered().values() for k in e.params})
    for name, entry in sorted(registered().items()):
        foreign = [k for k in every if k not in entry.params]
        if foreign:
            rules.append(Rule(
                "skipper", f"self.name != {_cel_str(name)} || !has(self.params) || "
                + " && ".join(f"!has(self.params.{k})" for k in foreign),
                f"skipper {name} takes only {', '.join(entry.params) or 'no parameters'}",
                lambda s, name=name, foreign=foreign: s.get("name") != name
                or not any(k in (s.get("params") or {}) for k in foreign), "params"))
        for key, spec in entry.params.items():
            if spec.required:
                rules.append(Rule(
                    "skipper", f"self.name != {_cel_str(name)} || (has(self.params) && has(self.params.{key}))",
                    f"required by skipper {name} ({spec.help})",
                    lambda s, name=name, key=key: s.get("name") != name or key in (s.get("params") or {}),
                    f"params.{key}"))
    return tuple(rules)


RULES: tuple[Rule, ...] = (
    Rule("model", "has(self.preset) || (has(self.kvHeads) && has(self.headDim) && has(self.routedLayers))",
         "name a preset, or give kvHeads, headDim and routedLayers",
         lambda m: "preset" in m or all(k in m for k in ("kvHeads", "headDim", "routedLayers"))),
    Rule("model", f"self.path.startsWith('/') || self.path.matches({_cel_str(HF_REPO_RE)})",
         "must be an absolute directory in the container or hf://ORG/NAME (a Hugging Face Hub repository); "
         "other schemes (s3://, gs://, http://) are not supported",
         lambda m: m["path"].startswith("/") or re.search(HF_REPO_RE, m["path"]) is not None, "path"),
    Rule("model", "!has(self.revision) || self.path.startsWith('hf://')", "only an hf:// path has a revision",
         lambda m: "revision" not in m or m["path"].startswith(HF_SCHEME), "revision"),
    Rule("model", "!has(self.download) || self.path.startsWith('hf://')", "only an hf:// path is downloaded",
         lambda m: "download" not in m or m["path"].startswith(HF_SCHEME), "download"),
    Rule("model", "!self.path.startsWith('hf://') || !has(self.storage) || !has(self.storage.readOnly) "
         "|| !self.storage.readOnly", "must be false for an hf:// path: the download writes the cache",
         lambda m: not m["path"].startswith(HF_SCHEME) or not (m.get("storage") or {}).get("readOnly"),
         "storage.readOnly"),
    Rule("model.storage", "has(self.pvc) != has(self.hostPath)", "name exactly one of pvc or hostPath",
         lambda st: ("pvc" in st) != ("hostPath" in st)),
    Rule("model.storage", f"!has(self.subPath) || !self.subPath.matches({_cel_str(DOT_DOT_RE)})",
         "must stay inside the volume (no '..')",
         lambda st: re.search(DOT_DOT_RE, st.get("subPath", "")) is None, "subPath"),
    Rule("switch.thresholds", "self.enterTokens >= self.exitTokens",
         "enterTokens must be at least exitTokens", lambda t: t["enterTokens"] >= t["exitTokens"]),
    Rule("switch",
         "(has(self.prefill) ? self.prefill : 'hybrid') == 'dense' || (has(self.decode) ? self.decode : 'hybrid')"
         " == 'dense' || (has(self.prefill) ? self.prefill : 'hybrid') == (has(self.decode) ? self.decode : 'hybrid')",
         "prefill and decode, when both routed, must use the same policy (hybrid or routed)",
         lambda s: len(_routed_policies(s)) <= 1),
    Rule("switch", "!has(self.prefillFloorTokens) || (has(self.prefill) ? self.prefill : 'hybrid') == 'hybrid'",
         "applies to a hybrid prefill only (spec.switch.prefill)",
         lambda s: "prefillFloorTokens" not in s or s.get("prefill", "hybrid") == "hybrid", "prefillFloorTokens"),
    Rule("serving", f"!has(self.extraArgs) || self.extraArgs.all(a, !a.matches({_cel_str(OWNED_ARG_RE)}))",
         "must not set flags the operator owns, abbreviated or aliased ("
         + ", ".join(OWNED_ARGS) + ")",
         lambda s: not any(re.search(OWNED_ARG_RE, a) for a in s.get("extraArgs", [])), "extraArgs"),
    Rule("model.download", "!has(self.cacheSizeLimit) || (type(self.cacheSizeLimit) == string ? "
         f"self.cacheSizeLimit.matches({_cel_str(QUANTITY_RE)}) : self.cacheSizeLimit >= 0)",
         "must be a non-negative Kubernetes quantity (8, 500m, 64Gi)",
         lambda d: "cacheSizeLimit" not in d or _is_quantity(d["cacheSizeLimit"]), "cacheSizeLimit"),
    Rule("pod.env[]", f"has(self.name) && self.name.matches({_cel_str(ENV_NAME_RE)})",
         "must have a name that is a C identifier-like environment variable name",
         lambda e: isinstance(e.get("name"), str) and re.search(ENV_NAME_RE, e["name"]) is not None, "name"),
    Rule("pod.env[]", f"!has(self.name) || !(self.name in ['VSKIPPER_GPU_PRODUCT', '{API_KEY_ENV}'])",
         f"must not set a variable the operator owns (VSKIPPER_GPU_PRODUCT, {API_KEY_ENV})",
         lambda e: e.get("name") not in ("VSKIPPER_GPU_PRODUCT", API_KEY_ENV), "name"),
    Rule("pod.volumes[]", f"has(self.name) && self.name.matches({_cel_str(DNS_LABEL_RE)}) && "
         "!(self.name in ['switch', 'shm', 'model'])",
         "must have a DNS-label name other than the operator's volumes (switch, shm, model)",
         lambda v: isinstance(v.get("name"), str) and re.search(DNS_LABEL_RE, v["name"]) is not None
         and v["name"] not in ("switch", "shm", "model"), "name"),
    Rule("pod.volumeMounts[]", "has(self.name) && has(self.mountPath) && self.mountPath.startsWith('/')",
         "must have a name and an absolute mountPath",
         lambda v: isinstance(v.get("name"), str) and str(v.get("mountPath", "")).startswith("/"), "mountPath"),
    Rule("serving.networkPolicy", "!has(self.enabled) || !self.enabled || (has(self.allowFrom) && "
         "self.allowFrom.size() > 0)", "needs at least one peer when enabled (a policy with none admits no client)",
         lambda n: not n.get("enabled") or bool(n.get("allowFrom")), "allowFrom"),
    Rule("serving.networkPolicy.allowFrom[]", "has(self.namespaces) || has(self.podLabels)",
         "name namespaces, podLabels or both", lambda p: "namespaces" in p or "podLabels" in p),
    Rule("serving.networkPolicy.allowFrom[]", "!has(self.podLabels) || self.podLabels.all(k, k.size() <= 317 && "
         f"k.matches({_cel_str(LABEL_KEY_RE)}))",
         "keys must be label keys ([prefix/]name, name at most 63 characters of [A-Za-z0-9-_.])",
         lambda p: all(len(k) <= 317 and re.search(LABEL_KEY_RE, k) for k in p.get("podLabels") or {}),
         "podLabels"),
    _quantity_rule("cpu"),
    _quantity_rule("memory"),
    Rule("placement.nodeSelector", f"self.all(k, k.size() <= 317 && k.matches({_cel_str(LABEL_KEY_RE)}))",
         "keys must be label keys ([prefix/]name, name at most 63 characters of [A-Za-z0-9-_.])",
         lambda m: all(len(k) <= 317 and re.search(LABEL_KEY_RE, k) for k in m)),
    Rule("placement.tolerations[]", "!has(self.operator) || self.operator != 'Exists' || !has(self.value) "
         "|| self.value == ''", "must be empty when operator is Exists",
         lambda t: t.get("operator") != "Exists" or not t.get("value"), "value"),
    Rule("placement.tolerations[]", "(has(self.key) && self.key != '') || (has(self.operator) && "
         "self.operator == 'Exists')", "an empty key needs operator Exists (it matches every taint)",
         lambda t: bool(t.get("key")) or t.get("operator") == "Exists", "key"),
    Rule("placement.tolerations[]", f"!has(self.key) || self.key == '' || self.key.matches({_cel_str(LABEL_KEY_RE)})",
         "must be a label key ([prefix/]name)", lambda t: not t.get("key") or re.search(LABEL_KEY_RE, t["key"]),
         "key"),
    Rule("placement.tolerations[]", "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
         "needs effect NoExecute", lambda t: "tolerationSeconds" not in t or t.get("effect") == "NoExecute",
         "tolerationSeconds"),
    Rule("replicasPerClass", f"self.all(k, k.size() <= 63 && k.matches({_cel_str(GPU_PRODUCT_RE)}))",
         "keys must be GPU products (nvidia.com/gpu.product values or catalogue names)",
         lambda m: all(len(k) <= 63 and re.search(GPU_PRODUCT_RE, k) for k in m)),
    *_skipper_rules(),
)

# On the resource itself: child objects are named `<name>-<gpu class>`.
NAME_RULE = Rule("", f"self.metadata.name.size() <= {MAX_NAME} && self.metadata.name.matches({_cel_str(DNS_1035_RE)})",
                 f"must be a DNS label that starts with a letter (the Service takes the name), of at most {MAX_NAME} "
                 "characters (child objects append the GPU class)",
                 lambda obj: isinstance(name := (obj.get("metadata") or {}).get("name"), str)
                 and len(name) <= MAX_NAME and re.search(DNS_1035_RE, name) is not None, "metadata.name")


def _node_at(schema: dict, path: str) -> dict:
    node = schema
    for part in filter(None, path.split(".")):
        node = node["properties"][part.removesuffix("[]")]
        if part.endswith("[]"):
            node = node["items"]
    return node


def _attach_rules(schema: dict) -> dict:
    schema = copy.deepcopy(schema)
    for rule in RULES:
        _node_at(schema, rule.path).setdefault("x-kubernetes-validations", []).append(rule.validation())
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
        "product": _str("the GPU product (nvidia.com/gpu.product, or a MIG slice's product label), normalised"),
        "device": _str("catalogue device, if known"),
        "nodes": _int("nodes of this class"),
        "served": {"type": "boolean"},
        "nodeState": _str("Present; AwaitingScaleUp (planned with no node, spec.placement.scaleFromZero); "
                          "NodesLost (nodes gone, kept for spec.placement.nodeLossGraceSeconds)",
                          enum=["Present", "AwaitingScaleUp", "NodesLost"]),
        "nodesLostAt": _str("when the class was first seen without nodes", format="date-time"),
        "labels": {"type": "array", "items": {"type": "string"},
                   "description": "product label values the class's pods are pinned to (nvidia.com/gpu.product, "
                                  "or a MIG slice's nvidia.com/mig-<profile>.product under the mixed strategy)"},
        "resource": _str("the extended resource each pod of the class requests: nvidia.com/gpu, or a MIG slice's "
                         "own (nvidia.com/mig-1g.10gb) under the mixed strategy"),
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
        "type": _str("Ready, ThresholdsDerived, Degraded or ModelAvailable (an hf:// download)"),
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
    }, required=("spec",), **{"x-kubernetes-validations": [NAME_RULE.validation()]})


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
        if len(value) < node.get("minItems", 0):
            raise SpecError(f"{path}: must not be empty" if node["minItems"] == 1
                            else f"{path}: must have at least {node['minItems']} items")
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
    if "maxProperties" in node and len(value) > node["maxProperties"]:
        raise SpecError(f"{path}: must have at most {node['maxProperties']} entries")
    if len(value) < node.get("minProperties", 0):
        raise SpecError(f"{path}: must not be empty" if node["minProperties"] == 1
                        else f"{path}: must have at least {node['minProperties']} entries")
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


def _select(value: Any, parts: list[str], path: str):
    """(value, path) for each node a rule path names in a spec, arrays expanded."""
    if not parts:
        yield value, path
        return
    part, rest = parts[0], parts[1:]
    name = part.removesuffix("[]")
    child = value.get(name) if isinstance(value, dict) else None
    if child is None:
        return
    if part.endswith("[]"):
        for i, item in enumerate(child):
            yield from _select(item, rest, f"{path}.{name}[{i}]")
    else:
        yield from _select(child, rest, f"{path}.{name}")


def check_rules(spec: dict, path: str = "spec") -> None:
    """The CEL rules' Python twins over a defaulted spec; the first failure raises, naming the field."""
    for rule in RULES:
        for node, where in _select(spec, list(filter(None, rule.path.split("."))), path):
            if not rule.check(node):
                raise SpecError(f"{'.'.join(filter(None, (where, rule.field)))}: {rule.message}")


def check_name(resource: Mapping[str, Any]) -> None:
    if not NAME_RULE.check(resource):
        name = (resource.get("metadata") or {}).get("name")
        raise SpecError(f"metadata.name: {NAME_RULE.message}, got {name!r}")


def apply_schema(spec: Any, path: str = "spec") -> dict:
    """Check `spec` against the schema and the CEL rules, returning it with the schema's defaults filled in."""
    if not isinstance(spec, dict):
        raise SpecError(f"{path}: must be an object, got {type(spec).__name__}")
    out = _check_object(SPEC_SCHEMA, spec, path)
    check_rules(out, path)
    return out
