"""Helpers for the tests that run the real operator: a Kubernetes API on loopback, and the operator process.

No kube-apiserver can run here (no envtest assets are reachable; Debian has only etcd), so the API server is
`kmock`'s `KubernetesEmulator` (a Kubernetes API mock server by Kopf's author, made for testing Kopf operators)
on 127.0.0.1, run in a thread of its own. It stores objects, serves list/watch/get/create/patch/delete and API
discovery, and records every request; it does not run controllers, defaulting or real server-side apply merge
semantics (a PATCH merges JSON). Faults are injected with kmock's own DSL, e.g.
`cluster.api["patch", kmock.resource("apps/v1/deployments")][:2] << 409`.

`ApiServer` adds the rules of a real kube-apiserver that the operator's reconcile depends on:
- a Job's pod template is immutable: a write that would change `spec.template` is answered 422 (Invalid);
- resource quantities in pod templates are stored canonically (`1000m` -> `1`, `65536Mi` -> `64Gi`), as
  `resource.Quantity` serializes them;
- a bearer token in `expired_tokens` gets 401 on every request (short-lived credentials that ran out);
- a create of a name that exists is 409 AlreadyExists (kmock's own), whoever holds the name;
- every write stamps the object with the next `metadata.resourceVersion` of one counter, as etcd's revision
  does (kmock stores whatever the client sent); a write naming a `resourceVersion` other than the stored one
  is 409 Conflict, and a JSON patch whose `test` operation fails (Kopf tests the resourceVersion it read
  before it adds its finalizer) is 422 Invalid, unapplied (optimistic concurrency). Kopf's consistency wait
  rests on these versions: after its own patch it waits for the watch event that carries the patch's version
  before it handles the object again; with one constant version it took the stale event before its patch for
  the current state and handled the same change again;
- `metadata.generation` is the API server's, whatever the client sends: 1 on create, one more on each write
  that changes anything outside `metadata` and `status` (a spec change, a scale) and on a delete that
  finalizers hold (`deletionTimestamp` set), none on a status or metadata write. A write that changes nothing
  keeps both (the API server stores nothing; kmock still sends a MODIFIED event for it). Not modelled: kinds
  that carry no generation (Events, Nodes) get one here, a `status` write applies whatever else it holds, a
  list's `resourceVersion` is kmock's placeholder and a DELETED event carries the last stored version;
- `metadata.managedFields` names who wrote an object and how: a create records its `fieldManager` as an *Update*,
  a server-side apply (`application/apply-patch+yaml`) the manager's *Apply* entry, and a client may rewrite the
  list (kubectl's upgrade from client-side apply does). Which fields each entry owns, and the pruning on apply
  that follows from it (a field an apply leaves out is removed only from the applier's own *Apply* entry), are
  not modelled: the tests read who holds the entries;
- `fail(...)` makes matching writes fail without changing anything (kmock's own reactions answer with a status
  but still apply the write);
- with `admission=True`, SkipperDeployments are admitted against the generated CRD (tests/admission.py), 422
  naming the field.

kmock's path parser reads `/api/v1/namespaces` (the list of Namespaces, which Kopf watches when it serves
named namespaces) as a namespaced path without its namespace and fails; `_parse_path` reads it as the
cluster-scoped `namespaces` resource, as the API server does.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path

import attrs
import jsonpatch
import jsonpointer
import kmock
import kmock._internal.dicts as kmock_dicts
import kmock._internal.parsing as kmock_parsing
from admission import admit

ROOT = Path(__file__).resolve().parents[1]
CRD = "vskipper.io/v1alpha1/skipperdeployments"
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}
# Every API the operator reads, writes or watches (the managed kinds of vskipper_operator.kube included).
RESOURCES = [
    ("v1/namespaces", "Namespace", False, set()), ("v1/nodes", "Node", False, set()),
    ("v1/events", "Event", True, set()), ("v1/configmaps", "ConfigMap", True, set()),
    ("v1/services", "Service", True, set()), ("v1/pods", "Pod", True, set()),
    ("apps/v1/deployments", "Deployment", True, {"status", "scale"}),
    ("batch/v1/jobs", "Job", True, {"status"}),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, {"status"}),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, set()),
    ("monitoring.coreos.com/v1/servicemonitors", "ServiceMonitor", True, set()),
    (CRD, "SkipperDeployment", True, {"status", "scale"}),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, set()),
]


def wait_for(predicate, timeout=60.0, what="condition"):
    """Poll `predicate` until it holds (its value) or `timeout` passes. The cap is generous: on a loaded machine the
    operator can take over 20 s to reach a change queued behind its handling of the one before (CI once saw it
    re-handle a generation-2 diff for 20 s before the generation-3 change), and a wait that holds returns at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def canonical_quantity(value) -> str:
    """How the API server writes a resource.Quantity back: binary-SI inputs with the largest exact binary suffix,
    the others with the largest exact decimal suffix (`1000m` -> `1`, `1.5` -> `1500m`, `65536Mi` -> `64Gi`)."""
    text = str(value)
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", text)
    if not match:
        return text
    number, suffix = Decimal(match[1]), match[2]
    if suffix in _BINARY:
        amount = number * 1024 ** _BINARY[suffix]
        for name, power in sorted(_BINARY.items(), key=lambda kv: -kv[1]):
            if amount % 1024 ** power == 0:
                return f"{amount // 1024 ** power}{name}"
        return f"{amount.normalize():f}"
    exponent = int(suffix[1:]) if suffix[:1] in ("e", "E") else _DECIMAL.get(suffix)
    if exponent is None:
        return text
    amount = number * Decimal(10) ** exponent
    for name, power in sorted(_DECIMAL.items(), key=lambda kv: -kv[1]):
        scaled = amount / Decimal(10) ** power
        if scaled == scaled.to_integral_value() and scaled >= 1 or power == -9:
            return f"{int(scaled)}{name}"
    return text


def _merge(old, patch):
    if not isinstance(old, dict) or not isinstance(patch, dict):
        return patch
    out = dict(old)
    for key, value in patch.items():
        out[key] = _merge(old.get(key), value)
    return out


def _versioned_away(obj):
    """`obj` without the fields a write stamps."""
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k not in ("resourceVersion", "generation")}
    return {**obj, "metadata": meta}


def _desired(obj):
    """What a generation counts changes of: everything but `metadata` and `status`."""
    return {key: value for key, value in obj.items() if key not in ("metadata", "status")}


def _pod_specs(obj):
    spec = (obj or {}).get("spec") or {}
    template = spec.get("template") or {}
    if isinstance(template.get("spec"), dict):
        yield template["spec"]


_kmock_parse_path = kmock_parsing.parse_path


def _parse_path(path: str):
    parts = path.strip("/").split("/")
    if parts[:1] == ["api"] and parts[2:] == ["namespaces"]:
        return kmock_parsing.ParsedPath("", parts[1], "namespaces")
    return _kmock_parse_path(path)


kmock_parsing.parse_path = _parse_path


class Refused(kmock.KubernetesError):
    pass


@attrs.define(eq=False)
class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator with the API server's rules the reconcile meets (see the module docstring)."""

    expired_tokens: set = attrs.field(factory=set)
    admission: bool = False
    faults: list = attrs.field(factory=list)

    def fail(self, method: str, path_part: str, times: int, status: int = 500, when=lambda data: True) -> dict:
        """The next `times` `method` requests under `path_part` whose JSON object body satisfies `when` get
        `status`, unapplied; the returned record counts them (`hits`)."""
        fault = {"method": method, "path": path_part, "left": times, "status": status, "when": when, "hits": 0}
        self.faults.append(fault)
        return fault

    async def _handle(self, request):
        refusal = self._refusal(request)
        if refusal is not None:
            self.refused.append(request)
            return await self._render_error(refusal)
        if request.action == kmock.action.DELETE:
            self._stamp_deletion(request)
        if request.action in (kmock.action.CREATE, kmock.action.UPDATE) and isinstance(request.data, (dict, list)):
            for pod in _pod_specs(request.data) if isinstance(request.data, dict) else ():
                for container in pod.get("containers") or []:
                    for kind in ("requests", "limits"):
                        amounts = (container.get("resources") or {}).get(kind) or {}
                        for key, value in amounts.items():
                            amounts[key] = canonical_quantity(value)
            self._stamp(request)  # on the canonical body: a write of `1000m` over a stored `1` changes nothing
            self._record_manager(request)
        return await super()._handle(request)

    refused: list = attrs.field(factory=list)
    revision: int = 0  # the last resourceVersion handed out

    def _stored(self, request):
        """The object a write to a named object meets, as stored (None: absent or deleted)."""
        key = (request.resource, request.namespace, request.name)
        if request.name is None or key not in self._objects or self._objects[key].deleted:
            return None
        return self._objects[key].last.raw

    def _stamp(self, request) -> None:
        """The write's resourceVersion and generation, set in its body (a merge patch's metadata, a JSON patch's
        last operations) before kmock stores it."""
        self.revision += 1
        version, generation = str(self.revision), 1
        if request.action != kmock.action.CREATE:
            stored = self._stored(request)
            if stored is None:
                return
            after = kmock_dicts.patch_dict(copy.deepcopy(stored), copy.deepcopy(request.data))
            meta = stored.get("metadata") or {}
            generation = int(meta.get("generation") or 1) + (_desired(after) != _desired(stored))
            if _versioned_away(after) == _versioned_away(stored):  # a no-op write: nothing is stored anew
                version, generation = meta.get("resourceVersion", version), meta.get("generation", generation)
        if isinstance(request.data, list):
            request.data.extend({"op": "add", "path": f"/metadata/{key}", "value": value}
                                for key, value in (("resourceVersion", version), ("generation", generation)))
            return
        meta = request.data.get("metadata")
        request.data["metadata"] = {**(meta if isinstance(meta, dict) else {}), "resourceVersion": version,
                                    "generation": generation}

    def _record_manager(self, request) -> None:
        """The write's field manager in `managedFields` (module docstring): a create's as an Update, an apply's as
        its Apply entry beside the others."""
        if not isinstance(request.data, dict):
            return
        manager = (request.params or {}).get("fieldManager") or "unknown"
        entry = {"manager": manager, "apiVersion": request.data.get("apiVersion"), "fieldsType": "FieldsV1",
                 "fieldsV1": {}}
        if request.action == kmock.action.CREATE:
            request.data["metadata"]["managedFields"] = [{**entry, "operation": "Update"}]
        elif "apply-patch" in (request.headers or {}).get("Content-Type", ""):
            stored = self._stored(request) or {}
            others = [e for e in (stored.get("metadata") or {}).get("managedFields") or []
                      if (e.get("manager"), e.get("operation")) != (manager, "Apply")]
            request.data["metadata"]["managedFields"] = [*others, {**entry, "operation": "Apply"}]

    def _stamp_deletion(self, request) -> None:
        """A delete that finalizers hold sets `deletionTimestamp` (kmock's own patch): a write of its own, with its
        version and one more generation, stamped here first."""
        stored = self._stored(request)
        meta = (stored or {}).get("metadata") or {}
        if stored is None or not meta.get("finalizers") or meta.get("deletionTimestamp"):
            return
        self.revision += 1
        self._objects[(request.resource, request.namespace, request.name)].patch(
            {"metadata": {"resourceVersion": str(self.revision), "generation": int(meta.get("generation") or 1) + 1}})

    def _refusal(self, request):
        auth = (request.headers or {}).get("Authorization", "")
        if auth.partition(" ")[2] in self.expired_tokens:
            return Refused(status=401, reason="Unauthorized", message="the bearer token has expired")
        for fault in self.faults:
            if (fault["left"] > 0 and str(request.method).upper().endswith(fault["method"])
                    and fault["path"] in str(request.url.path) and isinstance(request.data, dict)
                    and fault["when"](request.data)):
                fault["left"] -= 1
                fault["hits"] += 1
                return Refused(status=fault["status"], reason="InternalError", message="injected fault")
        if request.resource is not None and request.action == kmock.action.UPDATE and isinstance(request.data, list):
            stored = self._stored(request)
            try:  # its `test` operations (Kopf tests the resourceVersion it read) hold, or nothing applies
                if stored is not None:
                    jsonpatch.apply_patch(copy.deepcopy(stored), request.data)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                return Refused(status=422, reason="Invalid", message="the server rejected our request due to an "
                               f"error in our request: {exc}")
        if request.resource is None or not isinstance(request.data, dict):
            return None
        sent = (request.data.get("metadata") or {}).get("resourceVersion")
        if request.action == kmock.action.UPDATE and sent is not None:
            stored = self._stored(request)
            if stored is not None and str(sent) != (stored.get("metadata") or {}).get("resourceVersion"):
                return Refused(status=409, reason="Conflict", message=f"Operation cannot be fulfilled on "
                               f"{request.resource.plural} {request.name!r}: the object has been modified; please "
                               "apply your changes to the latest version and try again")
        plural = request.resource.plural
        if (request.action == kmock.action.UPDATE and plural == "jobs" and request.name
                and request.subresource is None and "template" in (request.data.get("spec") or {})):
            key = (request.resource, request.namespace, request.name)
            stored = self._objects[key] if key in self._objects else None
            old = ((stored.raw if stored is not None and not stored.deleted else {}).get("spec") or {}).get("template")
            if old is not None and _merge(old, request.data["spec"]["template"]) != old:
                return Refused(status=422, reason="Invalid", message=f"Job.batch {request.name!r} is invalid: "
                               "spec.template: Invalid value: field is immutable")
        if self.admission and plural == "skipperdeployments" and request.subresource is None and (
                request.action == kmock.action.CREATE):
            errors = admit(request.data)
            if errors:
                return Refused(status=422, reason="Invalid", message="; ".join(errors))
        return None


class Cluster:
    """kmock's Kubernetes emulator on loopback, in its own event loop thread (Kopf runs in another)."""

    def __init__(self, admission: bool = False):
        self.admission = admission
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        self.api, self.server = self._call(self._start())
        self.url = str(self.server.url).rstrip("/")
        return self

    async def _start(self):
        api = ApiServer(admission=self.admission)
        for key, kind, namespaced, subresources in RESOURCES:
            api.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=VERBS,
                                                    subresources=subresources)
        await api.__aenter__()
        server = kmock.Server(api)
        await server.__aenter__()
        return api, server

    async def _stop(self):
        await self.server.__aexit__(None, None, None)
        await self.api.__aexit__(None, None, None)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def __exit__(self, *exc):
        self._call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig whose current context is this server (Kopf's `login_with_kubeconfig` reads it)."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "token"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}]}))
        return path

    def http(self, method, path, body=None, content_type="application/json"):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                text = resp.read()
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return None
            raise
        return json.loads(text) if text else None

    def add_resource(self, obj: dict, uid: str) -> None:
        """A SkipperDeployment with the uid and creation time the API server would give it (kmock assigns
        neither; `ApiServer` stamps its resourceVersion and generation)."""
        obj = {**obj, "metadata": {**obj["metadata"], "uid": uid, "creationTimestamp": "2026-01-01T00:00:00Z"}}
        self.http("POST", f"/apis/vskipper.io/v1alpha1/namespaces/{obj['metadata']['namespace']}/skipperdeployments",
                  obj)

    def requests(self):
        return list(self.api)  # every request the server saw, in order

    def writes(self, path_part):
        return [r for r in self.requests() if r.method in ("POST", "PATCH", "DELETE", "PUT")
                and path_part in str(r.url.path)]


@contextmanager
def operator_process(kubeconfig: Path, log: Path, metrics_port: int, health_port: int, resync_seconds: float = 1):
    """`vskipper-operator run` in a process of its own, as the operator pod runs it (standalone Kopf, cluster-wide,
    Kopf's liveness endpoint, the metrics port flag), logged in through `kubeconfig`; yields the process once its
    liveness endpoint answers. The environment carries the chart's two tuning variables (resync period, API
    backoffs) and nothing inherited that would override the metrics port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VSKIPPER_OPERATOR_")
           and k != "KUBERNETES_SERVICE_HOST"}
    env.update(KUBECONFIG=str(kubeconfig), VSKIPPER_OPERATOR_RESYNC_SECONDS=str(resync_seconds),
               VSKIPPER_OPERATOR_API_BACKOFFS="0.05,0.1,0.2",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "operator"), env.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "vskipper_operator.cli", "run", f"--liveness=http://127.0.0.1:{health_port}/healthz",
         f"--metrics-port={metrics_port}"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True)  # noqa: SIM115

    def healthy():
        assert proc.poll() is None, f"the operator exited ({proc.returncode}):\n{log.read_text()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/healthz", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    try:
        wait_for(healthy, timeout=60, what=f"the operator's liveness endpoint (log: {log})")
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
