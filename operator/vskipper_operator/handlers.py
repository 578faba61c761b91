"""Kopf handlers: thin glue between the cluster and the pure builders in `vskipper_operator.plan`.

- create/update/resume of a SkipperDeployment: plan against the indexed GPU nodes, apply what differs
  (server-side apply, so re-running changes nothing; quantities compare by value, as the API server stores them
  canonically), replace changed Jobs (their pod template is immutable), delete what the plan no longer wants,
  post an Event per derived threshold and per unknown GPU, patch the status. A name held by an object the resource
  does not own is never adopted: `Degraded`/`Ready=False` with reason NameTaken and a Warning Event say who holds
  it. Owner references on every object make deletion cascade through the garbage collector.
- a resync timer per resource re-runs the same reconciliation: drift in the managed fields is corrected. Kopf
  puts a finalizer on every resource that has a timer (`kopf.zalando.org/KopfFinalizerMarker`): deleting a
  SkipperDeployment, or its namespace, waits for a running operator; uninstall in the order operator/README.md
  gives.
- a Node watch: when the set of GPU classes in the cluster changes (a product appears or disappears, or GPU
  nodes without product labels do), every SkipperDeployment is annotated with the new set, which triggers its
  update handler (re-plan); a failed annotation is retried on the next Node event.
- a SkipperDeployment's deletion removes its per-class gauges.
- a resource whose model is downloaded (hf://): its server pods' `fetch-model` init containers are read on every
  reconcile (the resync timer's period at the latest) into the `ModelAvailable` condition (Downloading,
  DownloadFailed with the container's termination message, Downloaded).
- GPU classes with no node: planned anyway when named in spec.placement.gpuProducts with scaleFromZero, and a
  served class whose nodes are gone is kept for spec.placement.nodeLossGraceSeconds (status rows say which);
  the resync timer removes it once the grace period is over.
- bandwidth probe Jobs: when one succeeds, its pod's termination message (JSON written by
  `vskipper_operator.probe`) is stored in the namespace's `vskipper-bandwidth` ConfigMap, which every later
  plan prefers over the catalogue (status source `measured`).

Leader election: Kopf has none. Its "peering" only pauses lower-priority operators while a higher-priority one
runs; it is not a lease. The operator therefore runs `--standalone` as a single replica with the Deployment
strategy `Recreate` (manifests/operator.yaml), so two instances never reconcile the same resource at once.
Liveness: Kopf's endpoint (`--liveness`, default http://0.0.0.0:8080/healthz). Metrics: `vskipper_operator_*`
on their own port (VSKIPPER_OPERATOR_METRICS_PORT, default 9090; 0 turns them off).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any

import kopf

from vskipper.roofline import normalize_product
from vskipper_operator import metrics
from vskipper_operator.crd import GPU_PRODUCT_LABEL, GROUP, PLURAL, VERSION, SpecError
from vskipper_operator.kube import ApiError, Kube, NameTaken
from vskipper_operator.plan import (
    COMPONENT_LABEL,
    INSTANCE_LABEL,
    MANAGED_BY_LABEL,
    MANAGER,
    PRODUCT_ANNOTATION,
    Node,
    diff,
    downloads,
    new_conflicts,
    node_gpus,
    offers,
    plan,
    resolve,
    served_rows,
    status_patch,
)
from vskipper_operator.probe import parse_result
from vskipper_operator.settings import Settings

# The timer's interval is fixed when the handlers are declared; every other setting is read when the operator
# starts (`configure`), with the command line's flags (`run_operator`) winning over the environment.
RESYNC_SECONDS = Settings.from_env().resync_seconds
BANDWIDTH_CONFIG_MAP = "vskipper-bandwidth"
CLASSES_ANNOTATION = "vskipper.io/gpu-classes"
log = logging.getLogger(__name__)  # lines that are not an object's Events
MEASURED_ANNOTATION = "vskipper.io/measured-bandwidth"

# Per event loop (one operator run each; tests run several in one process): the credentials Kopf logged in
# with, the operator's client, and the last GPU class set seen.
_connections: dict[asyncio.AbstractEventLoop, Any] = {}
_login_kwargs: dict[asyncio.AbstractEventLoop, dict] = {}
_clients: dict[asyncio.AbstractEventLoop, Kube] = {}
_classes: dict[asyncio.AbstractEventLoop, str] = {}
_settings: dict[asyncio.AbstractEventLoop, Settings] = {}
_flags: dict[str, object] = {}  # from the command line (run_operator)
_metrics_served: list[int] = []


def operator_settings() -> Settings:
    loop = asyncio.get_running_loop()
    if loop not in _settings:
        _settings[loop] = Settings.from_env(**_flags)
    return _settings[loop]


def kube() -> Kube:
    loop = asyncio.get_running_loop()
    if loop not in _connections:  # a timer that fires while the operator stops, after `close`
        raise kopf.TemporaryError("the operator is stopping", delay=RESYNC_SECONDS)
    if loop not in _clients:
        _clients[loop] = Kube.from_connection(_connections[loop], backoffs=operator_settings().api_backoffs,
                                               relogin=_relogin)
    return _clients[loop]


def _login(**kwargs: Any) -> Any:
    return (kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
            or kopf.login_via_client(**kwargs))


@kopf.on.login()
async def login(**kwargs: Any) -> Any:
    """In-cluster service account, else the kubeconfig ($KUBECONFIG, read now), else the kubernetes client's
    loaders (exec plugins); remembered so the operator's own client uses the same credentials as Kopf, and
    logs in the same way again when its credentials are refused (401)."""
    loop = asyncio.get_running_loop()
    _login_kwargs[loop] = kwargs
    _connections[loop] = _login(**kwargs)
    return _connections[loop]


async def _relogin() -> Any:
    loop = asyncio.get_running_loop()
    info = _login(**_login_kwargs[loop]) if loop in _login_kwargs else None
    if info is not None:
        _connections[loop] = info
    return info


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="operator.vskipper.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="operator.vskipper.io", key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # Events are posted explicitly, not from every log line
    settings.networking.error_backoffs = [1, 3, 10, 30]
    settings.execution.max_workers = 4
    # A deletion that meets the resync timer mid-run waits for it to end, then checks again after this long (Kopf's
    # default, 60 s, held a deleted resource and its finalizer that long behind one reconcile)
    settings.background.cancellation_polling = 2
    _settings.pop(asyncio.get_running_loop(), None)  # read afresh for this run
    port = operator_settings().metrics_port
    if port and not _metrics_served:
        metrics.serve(port)
        _metrics_served.append(port)


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    loop = asyncio.get_running_loop()
    _classes.pop(loop, None)
    _settings.pop(loop, None)
    _connections.pop(loop, None)
    _login_kwargs.pop(loop, None)
    client = _clients.pop(loop, None)
    if client is not None:
        await client.close()


@kopf.on.probe(id="gpuClasses")
def probe_gpu_classes(gpu_nodes: kopf.Index, **_: Any) -> int:
    return len(_gpu_classes(gpu_nodes))


# -- indices ----------------------------------------------------------------------------------------------------

@kopf.index("", "v1", "nodes")
def gpu_nodes(name: str, labels: kopf.Labels, status: kopf.Status, **_: Any) -> dict | None:
    """GPU nodes by name: those with a product label, and those whose device plugin reports GPUs without one
    (GPU Feature Discovery missing). The plan's input; kept current by Kopf's watch."""
    gpus = node_gpus(status)
    return {name: {"labels": dict(labels), "gpus": gpus}} if labels.get(GPU_PRODUCT_LABEL) or gpus else None


@kopf.index(GROUP, VERSION, PLURAL)
def skipper_deployments(namespace: str, name: str, annotations: kopf.Annotations, **_: Any) -> dict:
    return {(namespace, name): annotations.get(CLASSES_ANNOTATION)}


def _nodes(index: kopf.Index) -> list[Node]:
    return [Node(name, entry["labels"], entry["gpus"]) for name, store in index.items() for entry in store]


def _gpu_classes(index: kopf.Index) -> str:
    """The trigger: the GPU products the nodes offer (a MIG slice type under the `mixed` strategy among them, and
    a card only while some node still has it whole), and how many GPU nodes carry no product label."""
    nodes = _nodes(index)
    products = sorted({raw for n in nodes for raw, _ in offers(n)})
    unlabelled = sum(1 for n in nodes if GPU_PRODUCT_LABEL not in n.labels)
    return ",".join(products + ([f"+{unlabelled} unlabelled"] if unlabelled else []))


# -- the reconciliation -----------------------------------------------------------------------------------------

def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _measured(namespace: str) -> dict[str, float]:
    cm = await kube().get("v1", "ConfigMap", namespace, BANDWIDTH_CONFIG_MAP)
    out = {}
    for product, value in ((cm or {}).get("data") or {}).items():
        try:
            out[product] = float(value)
        except ValueError:
            continue
    return out


async def reconcile(body: kopf.Body, gpu_nodes: kopf.Index, patch: kopf.Patch, logger: Any) -> None:
    start = time.perf_counter()
    meta, namespace, name = body["metadata"], body["metadata"]["namespace"], body["metadata"]["name"]
    resource = {"apiVersion": body["apiVersion"], "kind": body["kind"],
                "metadata": {"name": name, "namespace": namespace, "uid": meta.get("uid")},
                "spec": dict(body.get("spec") or {})}
    previous = dict(body.get("status") or {})
    now = _now()
    try:
        resolve(resource)  # a spec error is reported before anything is read from the API
        applied = await kube().list_managed(namespace, f"{INSTANCE_LABEL}={name},{MANAGED_BY_LABEL}={MANAGER}")
        result = plan(resource, _nodes(gpu_nodes), await _measured(namespace), served_rows(applied), now)
    except ApiError as exc:
        metrics.RECONCILES.labels("error").inc()
        raise kopf.TemporaryError(str(exc), delay=10) from exc
    except SpecError as exc:
        metrics.RECONCILES.labels("invalid").inc()
        metrics.ERRORS.labels("invalid_spec").inc()
        kopf.warn(body, reason="InvalidSpec", message=str(exc))
        patch.status["observedGeneration"] = meta.get("generation")
        patch.status["conditions"] = [{"type": "Ready", "status": "False", "reason": "InvalidSpec",
                                       "message": str(exc), "lastTransitionTime": _now()}]
        metrics.record_ready(namespace, name, patch.status["conditions"])
        raise kopf.PermanentError(str(exc)) from None
    conflicts: list[NameTaken] = []
    try:
        changes = diff(result.objects, applied)
        for obj in changes.replace:
            await kube().delete(obj)
        for obj in changes.create + changes.replace:
            try:
                await kube().create(obj, meta.get("uid"))
            except NameTaken as exc:
                conflicts.append(exc)
        for obj in changes.update:
            await kube().apply(obj)
        for obj in changes.delete:
            await kube().delete(obj)
    except ApiError as exc:
        metrics.RECONCILES.labels("error").inc()
        raise kopf.TemporaryError(str(exc), delay=10) from exc
    taken = {(c.kind, c.name) for c in conflicts}
    changed = {o["metadata"]["name"] for o in changes.create + changes.update + changes.replace
               if o["kind"] == "Deployment" and (o["kind"], f"{namespace}/{o['metadata']['name']}") not in taken}
    for message in new_conflicts(previous, [str(c) for c in conflicts]):
        kopf.warn(body, reason="NameTaken", message=message)
    for kind, reason, message in result.new_events(previous, changed):
        kopf.event(body, type=kind, reason=reason, message=message)
    for obj in changes.delete:
        if obj["kind"] == "Deployment":
            product = (obj["metadata"].get("annotations") or {}).get(PRODUCT_ANNOTATION, obj["metadata"]["name"])
            kopf.info(body, reason="GpuClassRemoved", message=f"{product}: no longer in the pool; "
                                                              f"{obj['metadata']['name']} deleted")
    ready = {o["metadata"]["name"]: (o.get("status") or {}).get("readyReplicas", 0)
             for o in applied if o.get("kind") == "Deployment"}
    pods = await kube().list("v1", "Pod", namespace, result.selector) if downloads(result.resolved) else []
    status = result.status(ready, meta.get("generation"), now, previous.get("conditions", ()),
                           [str(c) for c in conflicts], pods)
    for key, value in status_patch(previous, status).items():
        logger.debug(f"status.{key} changed: {previous.get(key)!r} -> {value!r}")
        patch.status[key] = value
    metrics.record_plan(result)
    metrics.record_ready(namespace, name, status["conditions"])
    metrics.RECONCILES.labels("applied" if not changes.empty else "unchanged").inc()
    metrics.DURATION.observe(time.perf_counter() - start)
    logger.info(f"planned {len(result.served)} served GPU class(es): {status['gpuClassSummary']}; "
                f"{len(changes.create)} created, {len(changes.update)} applied, {len(changes.replace)} replaced, "
                f"{len(changes.delete)} deleted" + (f"; {len(conflicts)} name(s) held by others" if conflicts else ""))


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def on_change(body: kopf.Body, gpu_nodes: kopf.Index, patch: kopf.Patch, logger: Any, **_: Any) -> None:
    await reconcile(body, gpu_nodes, patch, logger)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, idle=RESYNC_SECONDS)
async def resync(body: kopf.Body, gpu_nodes: kopf.Index, patch: kopf.Patch, logger: Any, **_: Any) -> None:
    """Drift correction: the same reconciliation, when the resource itself has been quiet for a while."""
    try:
        await reconcile(body, gpu_nodes, patch, logger)
    except kopf.PermanentError:
        pass  # already reported by the change handler


async def _annotate(namespace: str, name: str, key: str, value: str) -> None:
    """Set one annotation on a SkipperDeployment (a merge patch; a resource deleted meanwhile is no error): its
    change handler then re-plans it."""
    await kube().request("PATCH", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}",
                         body={"metadata": {"annotations": {key: value}}},
                         content_type="application/merge-patch+json", missing_ok=True)


@kopf.on.event("", "v1", "nodes")
async def on_node(gpu_nodes: kopf.Index, skipper_deployments: kopf.Index, logger: Any, **_: Any) -> None:
    """When the cluster's set of GPU products changes, mark every SkipperDeployment to be re-planned."""
    classes = _gpu_classes(gpu_nodes)
    loop = asyncio.get_running_loop()
    if classes == _classes.get(loop):
        return
    failed = 0
    for (namespace, name), store in skipper_deployments.items():
        if classes in set(store):
            continue
        logger.info(f"GPU classes now [{classes}]: re-planning {namespace}/{name}")
        try:
            await _annotate(namespace, name, CLASSES_ANNOTATION, classes)
        except ApiError as exc:
            failed += 1
            # logged, not posted: Kopf would post a Node's warning as an Event in `default`, where an operator
            # watching its own namespaces may not write
            log.warning(f"could not mark {namespace}/{name} for re-planning (retried on the next Node event): {exc}")
    if not failed:  # remembered only once every resource has it: a failed trigger is not lost
        _classes[loop] = classes


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_resource_event(type: str, namespace: str, name: str, **_: Any) -> None:
    """A deleted SkipperDeployment's per-class gauges go with it."""
    if type == "DELETED":
        metrics.forget(namespace, name)


# -- measured bandwidth -----------------------------------------------------------------------------------------

@kopf.on.event("batch", "v1", "jobs", labels={COMPONENT_LABEL: "bandwidth-probe", MANAGED_BY_LABEL: MANAGER})
async def on_probe_job(body: kopf.Body, namespace: str, name: str, logger: Any, **_: Any) -> None:
    """A finished probe Job: store its measured bandwidth and re-plan the resource that asked for it."""
    if not (body.get("status") or {}).get("succeeded"):
        return
    product = normalize_product((body["metadata"].get("annotations") or {}).get(PRODUCT_ANNOTATION, ""))
    measured = await _measured(namespace)
    if not product or product in measured:
        return
    gbps = None
    for pod in await kube().list("v1", "Pod", namespace, f"job-name={name}"):
        for cs in (pod.get("status") or {}).get("containerStatuses", []):
            message = ((cs.get("state") or {}).get("terminated") or {}).get("message")
            value = parse_result(message)
            if value is None:
                metrics.ERRORS.labels("probe").inc()
                logger.warning(f"probe {name}: unreadable result {message!r}")
            gbps = value or gbps
    if gbps is None or not gbps > 0:
        return
    await kube().merge_config_map(namespace, BANDWIDTH_CONFIG_MAP, {product: f"{gbps:.1f}"},
                                  {"app.kubernetes.io/name": "vskipper", MANAGED_BY_LABEL: MANAGER})
    owner = (body.get("metadata") or {}).get("labels", {}).get(INSTANCE_LABEL)
    logger.info(f"measured {product}: {gbps:.1f} GB/s")
    if owner:
        await _annotate(namespace, owner, MEASURED_ANNOTATION, f"{product}={gbps:.1f}")


def run_operator(namespaces: list[str], liveness: str, metrics_port: int) -> None:
    """`vskipper-operator run`: a standalone (single-replica) Kopf operator."""
    _flags.update(metrics_port=metrics_port)
    Settings.from_env(**_flags)  # a bad variable stops the operator here, naming it
    kopf.run(standalone=True, clusterwide=not namespaces, namespaces=namespaces, liveness_endpoint=liveness)
