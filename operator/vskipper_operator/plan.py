"""Pure planning: a SkipperDeployment and the cluster's nodes in, the objects the operator applies out.

`plan(resource, nodes, measured)` groups the nodes by GPU class (`offers`: `nvidia.com/gpu.product`, with GPU
Feature Discovery's `-SHARED` suffix stripped, and under MIG's `mixed` strategy each slice type's own
`nvidia.com/mig-<profile>.product`), picks each class's memory bandwidth (spec override, then a measured probe
result, then the device catalogue), derives that class's switching thresholds with the roofline rule
(`vskipper.roofline.derive_thresholds`) and returns one Deployment per served class, pinned to the class by node
affinity and launched with its own thresholds, plus a Service, a ConfigMap holding the switch constants and the
arm, optionally a ServiceMonitor (which copies each server pod's GPU-class label onto its series) and bandwidth
probe Jobs, and a status row per class. Unknown products (not in the catalogue, MIG slices) get no Deployment
unless their bandwidth is overridden; their row says why.

`diff(desired, applied)` says what applying a plan would change; a plan of the applied state changes nothing.

Pure Python: no torch, no I/O, no Kubernetes client.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from vskipper.arms import ARMS, Arm
from vskipper.constants import CONSTANTS, attestation
from vskipper.metrics_names import GPU_CLASS_POD_LABEL as CLASS_LABEL
from vskipper.modelspec import DTYPE_BYTES, PRESETS
from vskipper.roofline import (
    Device,
    Thresholds,
    derive_thresholds,
    find_device,
    kv_bytes_per_token_layer,
    normalize_product,
)
from vskipper.serveargs import API_KEY_ENV, serve_argv
from vskipper.skippers.registry import SkipperConfigError, get_entry
from vskipper_operator.crd import (
    API_VERSION,
    DRAIN_SECONDS,
    GPU_PRODUCT_LABEL,
    HF_SCHEME,
    KIND,
    SpecError,
    apply_schema,
    check_name,
)
from vskipper_operator.flags import check_extra_args

MANAGER = "vskipper-operator"
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
PRODUCT_ANNOTATION = "vskipper.io/gpu-product"
NODES_LOST_ANNOTATION = "vskipper.io/nodes-lost-at"
# Each planned object's digest of itself: `contains` sees a field the plan no longer sets (a nodeSelector key or a
# pod annotation removed from the spec) only through it, since the applied object keeps every field it was given
# until an apply that leaves one out removes it.
PLAN_HASH_ANNOTATION = "vskipper.io/plan-hash"
CONFIG_DIR = "/etc/vskipper"
ARM_FILE = f"{CONFIG_DIR}/arm.json"
PROBE_MODULE = "vskipper_operator.probe"


GPU_RESOURCE = "nvidia.com/gpu"
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"
# Under the `mixed` strategy GPU Feature Discovery keeps nvidia.com/gpu.product as the whole card's name and labels
# each slice type apart: `nvidia.com/mig-1g.10gb.product` (`<card>-MIG-1g.10gb`) and `.count`, while the device
# plugin advertises the slices as their own resource (`nvidia.com/mig-1g.10gb`) and only the cards left whole as
# nvidia.com/gpu. A slice's labels are its resource's name with `.product`, `.count` etc. after it.
MIG_SLICE_PRODUCT_RE = re.compile(r"^(nvidia\.com/mig-[0-9]+g\.[0-9]+gb)\.product$")
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every Namespace by the API server (1.22+)
MODEL_CACHE = "/models"  # where an hf:// download's cache volume is mounted
FETCH_CONTAINER = "fetch-model"
FETCH_MODULE = "vskipper.fetch"
RUNTIME_UID = 10001  # the runtime image's user (images/runtime.Dockerfile: USER 10001:10001)
DEFAULT_CPU = "4"  # per replica, when spec.resources.cpu is not given
DEFAULT_MEMORY = "32Gi"  # host memory for loading the weights and the tokenizer workers
PROBE_PERIOD = 10
PROGRESS_MARGIN_S = 900  # beyond the start's timeout: the image's pull and the model's download
# PodSecurity `restricted` (tests/pod_security.py checks every planned pod against it): non-root, the runtime's
# default seccomp profile, no privilege escalation, every capability dropped.
POD_SECURITY = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


@dataclass(frozen=True)
class Node:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    gpus: int = 0  # allocatable nvidia.com/gpu (the device plugin's count, with or without GFD labels)

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> Node:
        meta = obj.get("metadata") or {}
        return cls(meta.get("name", ""), dict(meta.get("labels") or {}), node_gpus(obj.get("status")))


def node_gpus(status: Mapping[str, Any] | None) -> int:
    status = status or {}
    value = (status.get("allocatable") or status.get("capacity") or {}).get(GPU_RESOURCE, 0)
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def offers(node: Node) -> list[tuple[str, str]]:
    """The GPU products a node offers a pod, each as (product label value, the extended resource a pod requests
    for it). A whole card is `nvidia.com/gpu.product` with `nvidia.com/gpu`, and so is a slice under the `single`
    strategy (`<card>-MIG-1g.10gb` in gpu.product). Under `mixed` each slice type with a nonzero count is its own
    offer, and the card's own label counts only while the node still has whole cards allocatable."""
    labels = node.labels
    raw = labels.get(GPU_PRODUCT_LABEL)
    if labels.get(MIG_STRATEGY_LABEL) != "mixed":
        return [(raw, GPU_RESOURCE)] if raw else []
    out = [(raw, GPU_RESOURCE)] if raw and node.gpus > 0 else []
    for key, value in sorted(labels.items()):
        match = MIG_SLICE_PRODUCT_RE.match(key)
        if match and value and labels.get(f"{match[1]}.count", "1") not in ("0", ""):
            out.append((value, match[1]))
    return out


def label_key(resource: str) -> str:
    """The node label holding the product of the offer whose pods request `resource`."""
    return GPU_PRODUCT_LABEL if resource == GPU_RESOURCE else f"{resource}.product"


def nodes_from_document(doc: Any) -> list[Node]:
    """Nodes from a `kubectl get nodes -o json` document (a List), a single Node, or a list of either."""
    if isinstance(doc, Mapping) and "items" in doc:
        doc = doc["items"]
    if isinstance(doc, Mapping):
        doc = [doc]
    if not isinstance(doc, list):
        raise SpecError("nodes: expected a `kubectl get nodes -o json` document")
    return [n if isinstance(n, Node) else Node.from_object(n) for n in doc]


# -- the resolved spec ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Resolved:
    name: str
    namespace: str
    uid: str | None
    spec: dict  # defaults filled in
    arm: Arm
    skip_ratio: float
    routed_layers: int
    kv_bytes: int
    constants: Any  # vskipper.constants.SwitchConstants, tau possibly overridden


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "", normalize_product(text).lower())


def _arm_from_spec(name: str, spec: dict) -> Arm:
    skipper, sw = spec["skipper"], spec["switch"]
    entry = get_entry(skipper["name"], where="spec.skipper.name")
    params = entry.validate_params(skipper.get("params"), where="spec.skipper.params")
    # The spec's switch policies are the arm's own (vskipper.switch.Policy values): no translation.
    routes = sw["prefill"] != "dense" or sw["decode"] != "dense"
    fields = {"skipper": entry.name if routes else None, "params": params if routes else {},
              "prefill": sw["prefill"], "decode": sw["decode"], "promotion": sw["promotion"]}
    for arm in ARMS.values():  # a named arm when the spec is one, so the server attests a familiar name
        if {k: v for k, v in arm.fields().items() if k != "name"} == fields:
            return arm
    try:
        return Arm.from_dict({"name": name, **fields})
    except SkipperConfigError as exc:
        raise SpecError(f"spec.switch: {exc}") from None


def resolve(resource: Mapping[str, Any]) -> Resolved:
    if not isinstance(resource, Mapping):
        raise SpecError("resource: must be an object")
    api, kind = resource.get("apiVersion"), resource.get("kind")
    if api not in (None, API_VERSION) or kind not in (None, KIND):
        raise SpecError(f"apiVersion/kind: expected {API_VERSION} {KIND}, got {api} {kind}")
    meta = resource.get("metadata") or {}
    check_name(resource)
    name = meta["name"]
    spec = apply_schema(resource.get("spec"))
    check_extra_args(spec["serving"].get("extraArgs", []))
    try:
        arm = _arm_from_spec(name, spec)
    except SkipperConfigError as exc:
        raise SpecError(str(exc)) from None

    model, skipper = spec["model"], spec["skipper"]
    preset = PRESETS.get(model.get("preset", ""))
    dtype_bytes = DTYPE_BYTES[model["dtype"]]
    kv_heads = model.get("kvHeads") or preset.num_kv_heads
    head_dim = model.get("headDim") or preset.head_dim
    routed_layers = skipper.get("routedLayers") or model.get("routedLayers") or preset.num_routed_layers
    s = skipper.get("skipRatio")
    entry = get_entry(skipper["name"])
    params = entry.validate_params(skipper.get("params"), "spec.skipper.params")
    # A routing arm serves the params whatever skipRatio says: they must be able to skip on these routed layers.
    try:
        layer_s = entry.declared_skip_ratio(params, int(routed_layers) if arm.skipper else None,
                                            "spec.skipper.params")
    except SkipperConfigError as exc:
        raise SpecError(str(exc)) from None
    if s is None:
        s = layer_s
        if s is None:
            raise SpecError(f"spec.skipper.skipRatio: required: skipper {skipper['name']!r} declares no skip ratio")
        if not 0 < s <= 1:
            raise SpecError(f"spec.skipper.skipRatio: must be in (0, 1]: the params declare s = {s}; "
                            "with no skipping routing never pays")
    constants = CONSTANTS
    tau = spec["switch"].get("tauMsPerRoutedLayer")
    if tau is not None:
        constants = dataclasses.replace(constants, tau_ms_per_16_layers=tau * CONSTANTS.tau_reference_routed_layers)
    floor = spec["switch"].get("prefillFloorTokens")
    if floor is not None:
        constants = dataclasses.replace(constants, prefill_min_prompt_tokens=floor)
    return Resolved(name, meta.get("namespace") or "default", meta.get("uid"), spec, arm, float(s),
                    int(routed_layers), kv_bytes_per_token_layer(kv_heads, head_dim, dtype_bytes), constants)


# -- per-class rows ---------------------------------------------------------------------------------------------

@dataclass
class GpuClass:
    product: str  # normalised nvidia.com/gpu.product
    labels: tuple[str, ...]  # raw label values seen (with and without -SHARED)
    nodes: int
    device: Device | None = None
    served: bool = False
    reason: str = ""
    bandwidth_gbps: float | None = None
    bandwidth_source: str | None = None  # catalogue | override | measured
    thresholds: Thresholds | None = None
    exit_tokens: int | None = None
    enter_tokens: int | None = None
    threshold_source: str | None = None  # roofline | override
    deployment: str | None = None
    replicas: int = 0
    resource: str = GPU_RESOURCE  # what a pod requests: nvidia.com/gpu, or a slice's own under `mixed` MIG
    node_state: str = "Present"  # Present | AwaitingScaleUp (no node yet) | NodesLost (kept for the grace period)
    nodes_lost_at: str | None = None  # when a served class was first seen without nodes

    @property
    def label_key(self) -> str:
        """The node label the class's pods are pinned by (`offers`)."""
        return label_key(self.resource)

    @property
    def is_mig(self) -> bool:
        return "-MIG-" in self.product.upper()

    def as_status(self, ready: int = 0) -> dict:
        row: dict[str, Any] = {"product": self.product, "nodes": self.nodes, "served": self.served,
                               "nodeState": self.node_state}
        if self.nodes_lost_at:
            row["nodesLostAt"] = self.nodes_lost_at
        if self.served:
            row.update(labels=list(self.labels), resource=self.resource)
        if self.device:
            row["device"] = self.device.name
        if self.reason:
            row["reason"] = self.reason
        if self.bandwidth_gbps is not None:
            row.update(bandwidthGBps=self.bandwidth_gbps, bandwidthSource=self.bandwidth_source)
        if self.thresholds is not None:
            row["vStarTokens"] = round(self.thresholds.v_star_tokens, 1)
            if self.thresholds.ridge_rows is not None:
                row["ridgeRows"] = round(self.thresholds.ridge_rows, 1)
        if self.exit_tokens is not None:
            row.update(exitTokens=self.exit_tokens, enterTokens=self.enter_tokens,
                       thresholdSource=self.threshold_source)
        if self.deployment:
            row.update(deployment=self.deployment, replicas=self.replicas, readyReplicas=ready)
        return row

    @property
    def display(self) -> str:
        return self.device.name if self.device else self.product


@dataclass
class PlanResult:
    resolved: Resolved
    classes: list[GpuClass]
    objects: list[dict]  # desired objects, in apply order
    unmatched: list[str] = field(default_factory=list)  # spec.replicasPerClass keys asking for replicas no class serves
    unlabelled: list[str] = field(default_factory=list)  # GPU nodes without a product label (no GPU Feature Discovery)

    @property
    def name(self) -> str:
        return self.resolved.name

    @property
    def namespace(self) -> str:
        return self.resolved.namespace

    @property
    def served(self) -> list[GpuClass]:
        return [c for c in self.classes if c.served]

    @property
    def selector(self) -> str:
        return f"{INSTANCE_LABEL}={self.name},{COMPONENT_LABEL}=server"

    def events(self) -> list[tuple[GpuClass, str, str, str]]:
        """(class, type, reason, message): the thresholds derived for each served class, and why each class present
        is not served (an unknown GPU, a MIG slice the spec cannot use), unless the spec left it out."""
        out = []
        for c in self.classes:
            if c.served:
                t = c.thresholds
                vstar = f"V* {t.v_star_tokens:,.0f} tokens, " if t else ""
                out.append((c, "Normal", "ThresholdsDerived",
                            f"{c.product}: {c.bandwidth_gbps:g} GB/s ({c.bandwidth_source}), {vstar}"
                            f"exit {c.exit_tokens:,} / enter {c.enter_tokens:,} tokens ({c.threshold_source}) "
                            f"-> {c.deployment} x{c.replicas}"))
            elif c.reason and not c.reason.startswith("NotAllowed"):
                out.append((c, "Warning", c.reason.split(":")[0], f"{c.product}: {c.reason}"))
        return out

    def new_events(self, previous_status: Mapping[str, Any], changed: Iterable[str]) -> list[tuple[str, str, str]]:
        """(type, reason, message) worth posting after an apply: a served class's thresholds when its Deployment
        (named in `changed`) was just written, a class not served for a reason the resource's status does not show
        for it yet. A resync
        that changes nothing posts nothing."""
        changed = set(changed)
        shown = {(r["product"], r.get("reason", "").split(":")[0]) for r in previous_status.get("gpuClasses", [])}
        return [(kind, reason, message) for c, kind, reason, message in self.events()
                if (c.served and c.deployment in changed) or (not c.served and (c.product, reason) not in shown)]

    def status(self, ready: Mapping[str, int] | None = None, generation: int | None = None,
               now: str = "", previous: Iterable[Mapping[str, Any]] = (), conflicts: Iterable[str] = (),
               pods: Iterable[Mapping[str, Any]] = ()) -> dict:
        """The resource's status, given ready replicas per Deployment name (`now` stamps changed conditions),
        the planned objects whose names other objects hold (`conflicts`, one line each) and the server pods
        (their download init containers' state: the ModelAvailable condition)."""
        conflicts = list(conflicts)
        ready = dict(ready or {})
        rows = [c.as_status(ready.get(c.deployment or "", 0)) for c in self.classes]
        want = sum(c.replicas for c in self.served)
        have = sum(min(ready.get(c.deployment, 0), c.replicas) for c in self.served)
        unknown = [c.product for c in self.classes if c.reason.startswith("UnknownGPU")]
        problems = [(reason, message) for reason, message, present in (
            ("NameTaken", "; ".join(conflicts), conflicts),
            ("UnknownGPU", f"not served (unknown bandwidth): {', '.join(unknown)}", unknown),
            *((c.reason.split(":")[0], f"{c.product} not served: {c.reason.split(': ', 1)[-1]}", True)
              for c in self.classes if c.reason.startswith("Mig")),
            ("GpuFeatureDiscoveryMissing", f"GPU nodes without a {GPU_PRODUCT_LABEL} label (is GPU Feature "
             f"Discovery running?): {', '.join(self.unlabelled)}", self.unlabelled),
            ("ReplicasPerClassUnmatched", f"spec.replicasPerClass asks for replicas of {', '.join(self.unmatched)}, "
             "which no served GPU class present matches", self.unmatched)) if present]
        degraded = (problems[0][0], "; ".join(m for _, m in problems)) if problems else (
            "AllClassesServed", "every allowed GPU class present is served")
        blocked = "NameTaken" if conflicts else "ReplicasPerClassUnmatched" if self.unmatched else ""
        ready = bool(self.served) and have >= want and not blocked
        model = model_condition(self.resolved, pods)
        if not blocked and model and model["reason"] in ("Downloading", "DownloadFailed"):
            blocked = "ModelDownloadFailed" if model["reason"] == "DownloadFailed" else "ModelDownloading"
        conditions = [
            _condition("ThresholdsDerived", bool(self.served), "Derived" if self.served else "NoServableGPU",
                       "; ".join(f"{c.display}: exit {c.exit_tokens}, enter {c.enter_tokens}" for c in self.served)
                       or "no node offers a GPU class with a known bandwidth"),
            _condition("Degraded", degraded[0] != "AllClassesServed", *degraded),
            _condition("Ready", ready, "ReplicasReady" if ready else
                       ("NoServableGPU" if not self.served else blocked or "ReplicasNotReady"),
                       f"{have}/{want} replicas ready"),
        ] + ([model] if model else [])
        prev = {c.get("type"): c for c in previous or ()}
        for cond in conditions:
            old = prev.get(cond["type"])
            keep = old and old.get("status") == cond["status"] and old.get("lastTransitionTime")
            if keep or now:
                cond["lastTransitionTime"] = old["lastTransitionTime"] if keep else now
            if generation is not None:
                cond["observedGeneration"] = generation
        status: dict[str, Any] = {
            "replicas": want, "readyReplicas": have, "selector": self.selector,
            "gpuClassSummary": ", ".join(f"{c.display} {_k(c.exit_tokens)}/{_k(c.enter_tokens)}"
                                         for c in self.served) or "none",
            "gpuClasses": rows, "conditions": conditions,
        }
        if generation is not None:
            status["observedGeneration"] = generation
        return status


def model_condition(r: Resolved, pods: Iterable[Mapping[str, Any]]) -> dict | None:
    """The ModelAvailable condition of a resource whose checkpoint is downloaded (None otherwise), from its server
    pods' `fetch-model` init containers: DownloadFailed (with the container's termination message) when one
    failed, Downloading while one runs, Downloaded when every pod's finished, Unknown before any pod has one."""
    if not downloads(r):
        return None
    states = []
    for pod in pods:
        for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
            if cs.get("name") == FETCH_CONTAINER:
                states.append(((pod.get("metadata") or {}).get("name", "?"), cs))
    failures, running, done = [], [], 0
    for pod_name, cs in states:
        state, last = cs.get("state") or {}, cs.get("lastState") or {}
        finished = state.get("terminated") or {}
        failed = finished if finished.get("exitCode") not in (None, 0) else last.get("terminated") or {}
        if finished.get("exitCode") == 0:
            done += 1
        elif failed.get("exitCode") not in (None, 0):
            message = (failed.get("message") or failed.get("reason") or "").strip().splitlines()
            failures.append(f"{pod_name}: {message[-1] if message else 'exit code ' + str(failed['exitCode'])}")
        elif "running" in state:
            running.append(pod_name)
    uri = f"{r.spec['model']['path']}@{r.spec['model'].get('revision', 'main')}"
    if failures:
        return _condition("ModelAvailable", False, "DownloadFailed", f"{uri}: " + "; ".join(failures))
    if running:
        return _condition("ModelAvailable", False, "Downloading", f"{uri}: downloading in {', '.join(running)}")
    if states and done == len(states):
        return _condition("ModelAvailable", True, "Downloaded", f"{uri}: downloaded and checked in {done} pod(s)")
    return {**_condition("ModelAvailable", False, "Pending", f"{uri}: no server pod has started its download"),
            "status": "Unknown"}


def _k(tokens: int | None) -> str:
    return f"{tokens // 1000}k" if tokens is not None and tokens % 1000 == 0 else str(tokens)


def _condition(kind: str, ok: bool, reason: str, message: str) -> dict:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message}


# -- the plan ---------------------------------------------------------------------------------------------------

def _allowed(product: str, allowed: list[str]) -> bool:
    if not allowed:
        return True
    device = find_device(product)
    for entry in allowed:
        if _key(entry) == _key(product) or (device is not None and find_device(entry) is device):
            return True
    return False


def _lookup(table: Mapping[str, Any], product: str) -> Any:
    key = _key(product)
    for name, value in table.items():
        if _key(name) == key:
            return value
    return None


def _classes(nodes: Iterable[Node | Mapping[str, Any]], spec: dict, unlabelled: list[str]) -> list[GpuClass]:
    selector = spec.get("placement", {}).get("nodeSelector") or {}
    groups: dict[str, tuple[set[str], set[str], set[str]]] = {}  # product: (label values, resources, node names)
    for node in nodes:
        node = node if isinstance(node, Node) else Node.from_object(node)
        if any(node.labels.get(k) != v for k, v in selector.items()):
            continue
        if not node.labels.get(GPU_PRODUCT_LABEL):
            if node.gpus > 0:
                unlabelled.append(node.name)
            continue
        for raw, resource in offers(node):
            seen, resources, names = groups.setdefault(normalize_product(raw), (set(), set(), set()))
            seen.add(raw)
            resources.add(resource)
            names.add(node.name)
    out = []
    for product, (seen, resources, names) in sorted(groups.items()):
        c = GpuClass(product, tuple(sorted(seen)), len(names), resource=min(resources))
        if len(resources) > 1:
            c.reason = (f"MigStrategyMismatch: nodes offer {product!r} as {' and as '.join(sorted(resources))} "
                        f"(their {MIG_STRATEGY_LABEL} labels differ); one Deployment can pin only one of them: "
                        "select one set with spec.placement.nodeSelector")
        out.append(c)
    return out


def _parse_time(text: str | None) -> datetime.datetime | None:
    try:
        return datetime.datetime.strptime(text or "", "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        return None


def served_rows(applied: Iterable[Mapping[str, Any]]) -> list[dict]:
    """What the applied Deployments say was served: per class, its product, the product labels its pods are pinned
    to and, for a class already seen without nodes, since when (the Deployment's `vskipper.io/nodes-lost-at`).
    Read from the objects themselves, listed anew on every reconcile, so no stale status can drop a class early."""
    rows = []
    for obj in applied:
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        if obj.get("kind") != "Deployment" or PRODUCT_ANNOTATION not in annotations:
            continue
        terms = ((((obj.get("spec") or {}).get("template") or {}).get("spec") or {}).get("affinity") or {}).get(
            "nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])
        pins = [(e["key"], v) for t in terms for e in t.get("matchExpressions", [])
                if e.get("key") == GPU_PRODUCT_LABEL or MIG_SLICE_PRODUCT_RE.match(e.get("key") or "")
                for v in e.get("values", [])]
        resource = next((m[1] for key, _ in pins if (m := MIG_SLICE_PRODUCT_RE.match(key))), GPU_RESOURCE)
        row = {"product": annotations[PRODUCT_ANNOTATION], "served": True, "labels": [v for _, v in pins],
               "resource": resource}
        if annotations.get(NODES_LOST_ANNOTATION):
            row.update(nodeState="NodesLost", nodesLostAt=annotations[NODES_LOST_ANNOTATION])
        rows.append(row)
    return rows


def _absent_classes(present: list[GpuClass], spec: dict, previous: Iterable[Mapping[str, Any]],
                    now: str) -> list[GpuClass]:
    """Classes with no node that are planned anyway: those named in spec.placement.gpuProducts when
    spec.placement.scaleFromZero (their pending pods are what a cluster autoscaler scales a node pool up for), and
    classes served before (`previous`: status rows or `served_rows` of the applied Deployments) whose nodes are
    gone, for spec.placement.nodeLossGraceSeconds from when that was first seen (a label flap, a pool drained to
    zero, an upgrade surge)."""
    placement = spec["placement"]
    have = {_key(c.product) for c in present}
    out: list[GpuClass] = []
    if placement["scaleFromZero"]:
        for entry in placement.get("gpuProducts") or []:
            device = find_device(entry)
            labels = tuple(sorted(device.gfd_products)) if device and device.gfd_products else (entry,)
            product = labels[0] if device and device.gfd_products else normalize_product(entry)
            if _key(product) in have or any(_key(lab) in have for lab in labels):
                continue
            have.add(_key(product))
            out.append(GpuClass(product, labels, 0, node_state="AwaitingScaleUp"))
    grace = datetime.timedelta(seconds=placement["nodeLossGraceSeconds"])
    current = _parse_time(now)
    for row in previous or ():
        product = str(row.get("product", ""))
        if not product or not row.get("served") or _key(product) in have:
            continue
        lost_at = row.get("nodesLostAt") if row.get("nodeState") == "NodesLost" else now
        since = _parse_time(lost_at)
        if current is None or since is None or current - since >= grace:
            continue
        have.add(_key(product))
        labels = tuple(row.get("labels") or (product,))
        out.append(GpuClass(product, labels, 0, resource=row.get("resource") or GPU_RESOURCE,
                            node_state="NodesLost", nodes_lost_at=lost_at))
    return out


def plan(resource: Mapping[str, Any], nodes: Iterable[Node | Mapping[str, Any]],
         measured: Mapping[str, float] | None = None, previous: Iterable[Mapping[str, Any]] = (),
         now: str = "") -> PlanResult:
    """The desired objects and status rows for one SkipperDeployment on the given nodes (see module docstring).

    `measured` maps GPU products to probe-measured bandwidths (GB/s); a spec override still wins over them.
    `previous` says which classes were served (the resource's `status.gpuClasses`, or `served_rows` of the applied
    Deployments) and `now` is the current time (`%Y-%m-%dT%H:%M:%SZ`): together they keep a served class whose
    nodes are gone for the grace period.
    """
    r = resolve(resource)
    spec = r.spec
    allowed = spec.get("placement", {}).get("gpuProducts") or []
    overrides = {o["product"]: float(o["gbps"]) for o in spec.get("bandwidthOverrides", [])}
    fixed = spec["switch"].get("thresholds")
    unlabelled: list[str] = []
    classes = _classes(nodes, spec, unlabelled)
    classes = sorted(classes + _absent_classes(classes, spec, previous, now), key=lambda c: c.product)
    for c in classes:
        c.device = find_device(c.product)
        if not _allowed(c.product, allowed):
            c.reason = "NotAllowed: not in spec.placement.gpuProducts"
            continue
        if c.reason:
            continue
        if c.is_mig and spec["resources"]["gpus"] > 1:
            # A CUDA process enumerates one MIG device whatever CUDA_VISIBLE_DEVICES lists, so tensor parallelism
            # over slices would start one rank per slice that each see the same, first one.
            c.reason = (f"MigSliceTensorParallel: a process sees one MIG slice, and spec.resources.gpus is "
                        f"{spec['resources']['gpus']}; serve {c.product!r} from a SkipperDeployment with gpus: 1")
            continue
        for source, value in (("override", _lookup(overrides, c.product)),
                              ("measured", _lookup(measured or {}, c.product)),
                              ("catalogue", c.device.bandwidth_gbps if c.device else None)):
            if value is not None:
                c.bandwidth_gbps, c.bandwidth_source = float(value), source
                break
        else:
            kind = "a MIG slice gets only part of the card's bandwidth" if "-MIG-" in c.product.upper() \
                else "not in the device catalogue"
            c.reason = (f"UnknownGPU: {kind}; set spec.bandwidthOverrides for {c.product!r}"
                        + (" or enable spec.bandwidthProbe" if not spec["bandwidthProbe"]["enabled"] else ""))
            continue
        c.thresholds = derive_thresholds(c.bandwidth_gbps, r.skip_ratio, r.routed_layers, r.kv_bytes,
                                         c.device.dense_tflops if c.device else None, r.constants)
        if fixed:
            c.exit_tokens, c.enter_tokens, c.threshold_source = fixed["exitTokens"], fixed["enterTokens"], "override"
        else:
            c.exit_tokens, c.enter_tokens = c.thresholds.exit_tokens, c.thresholds.enter_tokens
            c.threshold_source = "roofline"
        c.served = True
        c.deployment = _child_name(r.name, c.product)
    _split_replicas([c for c in classes if c.served], spec)
    return PlanResult(r, classes, _objects(r, classes, measured or {}),
                      _unmatched(spec, classes, allowed, overrides), sorted(unlabelled))


def _unmatched(spec: dict, classes: list[GpuClass], allowed: list[str], overrides: Mapping[str, float]) -> list[str]:
    """spec.replicasPerClass keys with replicas that no served class takes. A key that names no GPU product at
    all (not catalogued, not allowed by name, not overridden, no such nodes) is a spec error."""
    out = []
    for key, count in (spec.get("replicasPerClass") or {}).items():
        known = (find_device(key) is not None or any(_key(key) == _key(a) for a in allowed)
                 or _lookup(overrides, key) is not None or any(_key(key) == _key(c.product) for c in classes))
        if not known:
            raise SpecError(f"spec.replicasPerClass.{key}: names no GPU product (not in the device catalogue, "
                            "spec.placement.gpuProducts, spec.bandwidthOverrides or the nodes' "
                            f"{GPU_PRODUCT_LABEL} labels)")
        if count and not any(c.served and _key(key) == _key(c.product) for c in classes):
            out.append(key)
    return out


def _split_replicas(served: list[GpuClass], spec: dict) -> None:
    per_class = spec.get("replicasPerClass")
    if per_class is not None:
        for c in served:
            c.replicas = int(_lookup(per_class, c.product) or 0)
        return
    total = spec["replicas"]
    # Even split; the remainder goes to the fastest classes first (highest bandwidth, then name).
    order = sorted(served, key=lambda c: (-(c.bandwidth_gbps or 0), c.product))
    for i, c in enumerate(order):
        c.replicas = total // len(order) + (1 if i < total % len(order) else 0)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _child_name(base: str, product: str, prefix: str = "") -> str:
    name = f"{base}-{prefix}{_slug(product)}"
    if len(name) > 63:
        digest = hashlib.sha256(product.encode()).hexdigest()[:8]
        name = f"{name[:54].rstrip('-')}-{digest}"
    return name


def _labels(name: str, component: str = "server") -> dict:
    return {NAME_LABEL: "vskipper", INSTANCE_LABEL: name, COMPONENT_LABEL: component, MANAGED_BY_LABEL: MANAGER}


def _meta(r: Resolved, name: str, labels: dict, annotations: dict | None = None) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": r.namespace, "labels": labels}
    if annotations:
        meta["annotations"] = annotations
    if r.uid:
        meta["ownerReferences"] = [{"apiVersion": API_VERSION, "kind": KIND, "name": r.name, "uid": r.uid,
                                    "controller": True, "blockOwnerDeletion": True}]
    return meta


def _affinity(c: GpuClass) -> dict:
    term = {"matchExpressions": [{"key": c.label_key, "operator": "In", "values": list(c.labels)}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def arm_config(arm: Arm) -> dict:
    """The arm as `Arm.from_dict` reads it back (the server's --arm-config file)."""
    return arm.fields()


def server_args(r: Resolved, c: GpuClass) -> list[str]:
    """The server container's arguments for one GPU class: `vskipper serve` flags (the class's thresholds, the
    attested arm, SGLang flags). The container sets no `command`: the runtime image's entrypoint
    (images/runtime/entrypoint.py) checks them and execs `vskipper serve` with them."""
    spec, serving = r.spec, r.spec["serving"]
    args = serve_argv({"model": model_dir(r), "arm": r.arm.name, "arm_file": ARM_FILE,
                       "exit_tokens": c.exit_tokens, "enter_tokens": c.enter_tokens,
                       "prefill_floor_tokens": spec["switch"].get("prefillFloorTokens"),
                       "host": "0.0.0.0", "port": serving["port"],
                       "served_model_name": spec["model"].get("servedName") or r.name,
                       "tp_size": spec["resources"]["gpus"], "dtype": spec["model"]["dtype"],
                       "cuda_graph_max_bs_decode": serving.get("cudaGraphMaxBatchSize"),
                       "mem_fraction_static": serving.get("memFractionStatic"),
                       "attention_backend": serving.get("attentionBackend"),
                       "disable_radix_cache": not serving["prefixCache"],
                       # the API key comes from the Secret-backed variable (API_KEY_ENV), not from an argument
                       "enable_metrics": spec["metrics"]["enabled"]})
    return args + list(serving.get("extraArgs", []))


def status_patch(previous: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
    """The status fields that differ from what the resource shows (an unchanged resource gets an empty patch)."""
    return {key: value for key, value in status.items() if previous.get(key) != value}


def new_conflicts(previous_status: Mapping[str, Any], conflicts: Iterable[str]) -> list[str]:
    """Names held by other objects that the resource's Degraded condition does not report yet."""
    known = next((c.get("message", "") for c in previous_status.get("conditions", []) if c.get("type") == "Degraded"),
                 "")
    return [c for c in conflicts if c not in known]


# -- model storage ----------------------------------------------------------------------------------------------

def downloads(r: Resolved) -> bool:
    return r.spec["model"]["path"].startswith(HF_SCHEME)


def model_dir(r: Resolved) -> str:
    """Where the server reads the checkpoint: spec.model.path, or for hf:// the download's folder in the cache
    volume (`/models/hf/ORG/NAME/REVISION`, a revision's slashes as `--`)."""
    model = r.spec["model"]
    if not downloads(r):
        return model["path"]
    revision = model.get("revision", "main").replace("/", "--")
    return f"{MODEL_CACHE}/hf/{model['path'][len(HF_SCHEME):]}/{revision}"


def _model_volume(r: Resolved) -> dict | None:
    storage = r.spec["model"].get("storage")
    if storage and "pvc" in storage:
        return {"name": "model", "persistentVolumeClaim": {"claimName": storage["pvc"]["claimName"],
                                                            "readOnly": _model_read_only(r)}}
    if storage and "hostPath" in storage:
        return {"name": "model", "hostPath": {"path": storage["hostPath"]["path"], "type": "Directory"
                                              if not downloads(r) else "DirectoryOrCreate"}}
    if downloads(r):
        limit = (r.spec["model"].get("download") or {}).get("cacheSizeLimit")
        return {"name": "model", "emptyDir": {"sizeLimit": str(limit)} if limit is not None else {}}
    return None


def _model_read_only(r: Resolved) -> bool:
    storage = r.spec["model"].get("storage") or {}
    return storage.get("readOnly", not downloads(r))


def _model_mount(r: Resolved, writable: bool = False) -> dict:
    storage = r.spec["model"].get("storage") or {}
    mount = {"name": "model", "mountPath": MODEL_CACHE if downloads(r) else r.spec["model"]["path"],
             "readOnly": not writable}
    if storage.get("subPath"):
        mount["subPath"] = storage["subPath"]
    return mount


def _fetch_container(r: Resolved) -> dict:
    """The init container that downloads an hf:// checkpoint into the cache volume (`python -m vskipper.fetch`,
    which checks config.json and the weights after the download and skips a finished one)."""
    model = r.spec["model"]
    download = model.get("download") or {}
    env = [{"name": "HF_HOME", "value": f"{MODEL_CACHE}/.hf-home"},
           {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"}]
    if download.get("endpoint"):
        env.append({"name": "HF_ENDPOINT", "value": download["endpoint"]})
    if download.get("tokenSecret"):
        secret = download["tokenSecret"]
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": secret["name"], "key": secret.get("key", "token")}}})
    return {"name": FETCH_CONTAINER, "image": r.spec["serving"]["image"],
            "command": ["python", "-m", FETCH_MODULE],
            "args": [model["path"], "--revision", model.get("revision", "main"), "--out", model_dir(r)],
            "env": env, "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
            "securityContext": dict(CONTAINER_SECURITY), "terminationMessagePolicy": "FallbackToLogsOnError",
            "volumeMounts": [_model_mount(r, writable=True)]}


def _config_map(r: Resolved, classes: list[GpuClass]) -> dict:
    thresholds = {c.product: {"exit_tokens": c.exit_tokens, "enter_tokens": c.enter_tokens,
                              "bandwidth_gbps": c.bandwidth_gbps, "bandwidth_source": c.bandwidth_source,
                              "threshold_source": c.threshold_source}
                  for c in classes if c.served}
    constants = dataclasses.asdict(r.constants) if r.constants is not CONSTANTS else attestation()
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(r, f"{r.name}-switch", _labels(r.name, "config")),
            "data": {"constants.json": json.dumps(constants, indent=2, sort_keys=True),
                     "arm.json": json.dumps(arm_config(r.arm), indent=2, sort_keys=True),
                     "thresholds.json": json.dumps(thresholds, indent=2, sort_keys=True)}}


def _class_selector(r: Resolved, c: GpuClass) -> dict:
    return {INSTANCE_LABEL: r.name, COMPONENT_LABEL: "server", CLASS_LABEL: _slug(c.product)[:63].strip("-")}


def _placement(spec: dict, c: GpuClass) -> dict:
    """Node affinity on the class's product labels, spec.placement's nodeSelector and tolerations: the server pods
    and the class's probe Job schedule on the same nodes."""
    pod: dict[str, Any] = {"affinity": _affinity(c)}
    placement = spec.get("placement", {})
    if placement.get("nodeSelector"):
        pod["nodeSelector"] = dict(placement["nodeSelector"])
    if placement.get("tolerations"):
        pod["tolerations"] = list(placement["tolerations"])
    return pod


def _deployment(r: Resolved, c: GpuClass, config_hash: str) -> dict:
    spec, serving, res, knobs = r.spec, r.spec["serving"], r.spec["resources"], r.spec.get("pod") or {}
    labels = {**_labels(r.name), CLASS_LABEL: _slug(c.product)[:63].strip("-")}
    requests = {"cpu": str(res.get("cpu", DEFAULT_CPU)), "memory": str(res.get("memory", DEFAULT_MEMORY))}
    env = [{"name": "VSKIPPER_GPU_PRODUCT", "value": c.product}]
    if serving.get("apiKeySecret"):
        secret = serving["apiKeySecret"]
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": secret["name"],
                                                                         "key": secret.get("key", "api-key")}}})
    mounts = [{"name": "switch", "mountPath": CONFIG_DIR, "readOnly": True}, {"name": "shm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "switch", "configMap": {"name": f"{r.name}-switch"}},
               {"name": "shm", "emptyDir": {"medium": "Memory"}}]
    model_volume = _model_volume(r)
    if model_volume:
        volumes.append(model_volume)
        mounts.append(_model_mount(r))
    def probe(path: str, period: int, timeout: int, failures: int) -> dict:
        return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": timeout,
                "failureThreshold": failures}

    container = {
        "name": "server", "image": serving["image"], "args": server_args(r, c),
        "ports": [{"name": "http", "containerPort": serving["port"], "protocol": "TCP"}],
        "env": env + list(knobs.get("env", [])),
        "resources": {"limits": {c.resource: str(res["gpus"])}, "requests": requests},
        # SGLang 0.5.21's endpoints (none needs the API key): /health answers 200 once the model is loaded and
        # warmed up, which the startup probe waits for; /health_generate runs a one-token generation unless
        # requests are running (a hung scheduler fails it: liveness restarts the pod); /ready is 503 while
        # starting or shutting down (readiness takes the pod out of the Service).
        "startupProbe": probe("/health", PROBE_PERIOD, 5, -(-serving["startupTimeoutSeconds"] // PROBE_PERIOD)),
        "livenessProbe": probe("/health_generate", 30, 25, 3),
        "readinessProbe": probe("/ready", PROBE_PERIOD, 5, 3),
        # Endpoints stop sending new requests before SGLang is told to stop; the grace period covers the drain.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(DRAIN_SECONDS)]}}},
        "securityContext": dict(CONTAINER_SECURITY),
        "volumeMounts": mounts + list(knobs.get("volumeMounts", [])),
    }
    pod: dict[str, Any] = {
        **_placement(spec, c), "containers": [container],
        "securityContext": {**POD_SECURITY, **({"fsGroup": RUNTIME_UID, "fsGroupChangePolicy": "OnRootMismatch"}
                                               if downloads(r) else {})},
        "terminationGracePeriodSeconds": serving["terminationGracePeriodSeconds"],
        "volumes": volumes + list(knobs.get("volumes", [])),
    }
    if downloads(r):
        pod["initContainers"] = [_fetch_container(r)]
    for key in ("serviceAccountName", "priorityClassName", "imagePullSecrets"):
        if knobs.get(key):
            pod[key] = knobs[key]
    annotations = {**(knobs.get("annotations") or {}),
                   PRODUCT_ANNOTATION: c.product, "vskipper.io/exit-tokens": str(c.exit_tokens),
                   "vskipper.io/enter-tokens": str(c.enter_tokens), "vskipper.io/bandwidth-gbps": f"{c.bandwidth_gbps:g}",
                   "vskipper.io/bandwidth-source": c.bandwidth_source, "vskipper.io/config-hash": config_hash}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(r, c.deployment, labels, {PRODUCT_ANNOTATION: c.product, **(
                {NODES_LOST_ANNOTATION: c.nodes_lost_at} if c.nodes_lost_at else {})}),
            "spec": {"replicas": c.replicas, "selector": {"matchLabels": _class_selector(r, c)},
                     # A GPU node seldom has a spare GPU: replace one pod at a time, never surge.
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
                     # a rollout waits out a pod's start (the model's download and load, the warm-up) before the
                     # Deployment reports ProgressDeadlineExceeded (600 s by default, under the default start)
                     "progressDeadlineSeconds": serving["startupTimeoutSeconds"] + PROGRESS_MARGIN_S,
                     "template": {"metadata": {"labels": {**(knobs.get("labels") or {}), **labels},
                                               "annotations": annotations}, "spec": pod}}}


def _disruption_budget(r: Resolved, c: GpuClass) -> dict:
    """At most one server of a class evicted at a time (node drains, autoscaler scale-down)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(r, c.deployment, {**_labels(r.name), CLASS_LABEL: _class_selector(r, c)[CLASS_LABEL]},
                              {PRODUCT_ANNOTATION: c.product}),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _class_selector(r, c)}}}


def _network_policy(r: Resolved) -> dict:
    """Ingress to the resource's server pods, on the server port, only from the spec's peers (egress stays open)."""
    peers = []
    for peer in r.spec["serving"]["networkPolicy"]["allowFrom"]:
        out: dict[str, Any] = {}
        if peer.get("namespaces"):
            out["namespaceSelector"] = {"matchExpressions": [
                {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": list(peer["namespaces"])}]}
        if peer.get("podLabels"):
            out["podSelector"] = {"matchLabels": dict(peer["podLabels"])}
        peers.append(out)
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(r, r.name, _labels(r.name)),
            "spec": {"podSelector": {"matchLabels": {INSTANCE_LABEL: r.name, COMPONENT_LABEL: "server"}},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": r.spec["serving"]["port"]}]}]}}


def _probe_job(r: Resolved, c: GpuClass) -> dict:
    labels = {**_labels(r.name, "bandwidth-probe"), CLASS_LABEL: _slug(c.product)[:63].strip("-")}
    knobs = r.spec.get("pod") or {}
    container = {"name": "probe", "image": r.spec["serving"]["image"],
                 "command": ["python", "-m", PROBE_MODULE], "args": ["--device", "cuda"],
                 "resources": {"limits": {c.resource: "1"}},
                 "securityContext": dict(CONTAINER_SECURITY), "terminationMessagePolicy": "File"}
    pod = {"restartPolicy": "Never", **_placement(r.spec, c), "securityContext": dict(POD_SECURITY),
           "containers": [container]}
    for key in ("serviceAccountName", "priorityClassName", "imagePullSecrets"):
        if knobs.get(key):
            pod[key] = knobs[key]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _meta(r, _child_name(r.name, c.product, "probe-"), labels, {PRODUCT_ANNOTATION: c.product}),
            "spec": {"backoffLimit": 1, "ttlSecondsAfterFinished": 3600,
                     "template": {"metadata": {"labels": labels}, "spec": pod}}}


def _objects(r: Resolved, classes: list[GpuClass], measured: Mapping[str, float]) -> list[dict]:
    spec = r.spec
    config = _config_map(r, classes)
    config_hash = hashlib.sha256((config["data"]["constants.json"] + config["data"]["arm.json"]).encode()).hexdigest()[:16]
    port = spec["serving"]["port"]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(r, r.name, _labels(r.name)),
               "spec": {"type": "ClusterIP",
                        "selector": {INSTANCE_LABEL: r.name, COMPONENT_LABEL: "server"},
                        "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]}}
    objects = [config, service] + [_deployment(r, c, config_hash) for c in classes if c.served]
    objects += [_disruption_budget(r, c) for c in classes if c.served]
    if (spec["serving"].get("networkPolicy") or {}).get("enabled"):
        objects.append(_network_policy(r))
    if spec["metrics"]["enabled"] and spec["metrics"]["serviceMonitor"]:
        objects.append({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _meta(r, r.name, _labels(r.name)),
            "spec": {"selector": {"matchLabels": {INSTANCE_LABEL: r.name, COMPONENT_LABEL: "server"}},
                     # Each server pod's GPU class onto its series: dashboards and rules group by it.
                     "podTargetLabels": [CLASS_LABEL],
                     "endpoints": [{"port": "http", "path": "/metrics", "interval": spec["metrics"]["interval"]}]}})
    if spec["bandwidthProbe"]["enabled"]:
        # no probe where its measurement would serve nothing: measured already, or overridden (an override wins)
        objects += [_probe_job(r, c) for c in classes if not c.reason.startswith("NotAllowed")
                    and c.node_state == "Present" and _lookup(measured, c.product) is None
                    and c.bandwidth_source != "override"]
    for obj in objects:
        digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
        obj["metadata"].setdefault("annotations", {})[PLAN_HASH_ANNOTATION] = digest
    return objects


# -- what applying would change ---------------------------------------------------------------------------------

def object_key(obj: Mapping[str, Any]) -> tuple[str, str, str, str]:
    meta = obj.get("metadata") or {}
    return obj.get("apiVersion", ""), obj.get("kind", ""), meta.get("namespace", ""), meta.get("name", "")


_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][0-9]+)?")
_BINARY_EXP = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL_EXP = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity's value (`1000m` and `1` are equal; `65536Mi` and `64Gi` are), None if it is not one."""
    match = _QUANTITY.fullmatch(str(value))
    if not match or isinstance(value, bool):
        return None
    number, suffix = Decimal(match[1]), match[2] or ""
    if suffix in _BINARY_EXP:
        return number * 1024 ** _BINARY_EXP[suffix]
    exponent = int(suffix[1:]) if suffix[:1] in ("e", "E") else _DECIMAL_EXP[suffix]
    return number.scaleb(exponent)


def contains(applied: Any, desired: Any, quantities: bool = False) -> bool:
    """Every field the plan sets has that value in the applied object (fields the server adds are ignored;
    quantities, which the API server stores canonically, compare by value: resource requests and limits, an
    emptyDir's sizeLimit)."""
    if isinstance(desired, Mapping):
        return isinstance(applied, Mapping) and all(
            k in applied and contains(applied[k], v, quantities or k in ("requests", "limits", "sizeLimit"))
            for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(applied, list) and len(applied) == len(desired)
                and all(contains(a, d) for a, d in zip(applied, desired, strict=True)))
    if quantities and quantity(desired) is not None:
        return quantity(desired) == quantity(applied)
    return applied == desired or (not isinstance(desired, bool) and str(applied) == str(desired))


# Kinds whose spec the API server will not patch once created (a Job's pod template is immutable): a changed one
# is deleted and created anew.
REPLACED_KINDS = (("batch/v1", "Job"),)


@dataclass
class Changes:
    create: list[dict] = field(default_factory=list)
    update: list[dict] = field(default_factory=list)
    delete: list[dict] = field(default_factory=list)  # applied objects the plan no longer wants
    replace: list[dict] = field(default_factory=list)  # changed objects of REPLACED_KINDS: delete, then create

    @property
    def empty(self) -> bool:
        return not (self.create or self.update or self.delete or self.replace)


def diff(desired: Iterable[dict], applied: Iterable[dict]) -> Changes:
    """What applying `desired` over the objects managed for the same resource (`applied`) would change."""
    have = {object_key(o): o for o in applied}
    changes = Changes()
    for obj in desired:
        current = have.pop(object_key(obj), None)
        if current is None:
            changes.create.append(obj)
        elif not contains(current, obj):
            (changes.replace if (obj["apiVersion"], obj["kind"]) in REPLACED_KINDS else changes.update).append(obj)
    changes.delete = list(have.values())
    return changes
