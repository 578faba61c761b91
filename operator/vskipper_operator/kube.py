"""The one place the operator talks to the Kubernetes API (besides Kopf's own watching and patching).

A small aiohttp client over the connection Kopf logged in with: list the objects a resource manages, create
them, server-side apply them (`fieldManager=vskipper-operator`, forced: the operator owns the fields it sets),
delete them, read and merge-patch ConfigMaps. Conflicts (409), throttling (429) and server errors (5xx) are
retried with exponential backoff; when the retries run out the error is re-raised for Kopf to retry the
handler later. A 401 (short-lived credentials that ran out) makes the client log in again (`relogin`, the same
login Kopf uses: the service account token or the kubeconfig, read anew) and repeat the request once.

A name held by an object the resource does not own (no owner reference with its uid) is never adopted: `create`
raises `NameTaken`, saying who holds it, and writes nothing.

A create is a POST (it fails on a name someone else took meanwhile, where an apply would take the object over),
which the API server records as the operator's *Update* of every field it sent; server-side apply never removes
a field another operation owns, so a field a later plan leaves out (an emptyDir model volume a PVC replaces, an
init container) would stay for good. Right after the POST the operator's entry in `managedFields` is made its
*Apply* entry (`own_as_applied`, kubectl's upgrade from client-side apply), so that its applies own those fields.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp

from vskipper_operator import metrics

logger = logging.getLogger(__name__)

MANAGER = "vskipper-operator"
RETRY_STATUSES = {409: "conflict", 429: "throttled", 500: "server_error", 502: "server_error",
                  503: "server_error", 504: "server_error"}

# (apiVersion, kind) -> (URL prefix, plural); the managed kinds and the few the operator reads.
RESOURCES: dict[tuple[str, str], tuple[str, str]] = {
    ("v1", "ConfigMap"): ("/api/v1", "configmaps"),
    ("v1", "Service"): ("/api/v1", "services"),
    ("v1", "Pod"): ("/api/v1", "pods"),
    ("apps/v1", "Deployment"): ("/apis/apps/v1", "deployments"),
    ("batch/v1", "Job"): ("/apis/batch/v1", "jobs"),
    ("policy/v1", "PodDisruptionBudget"): ("/apis/policy/v1", "poddisruptionbudgets"),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("/apis/networking.k8s.io/v1", "networkpolicies"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ("/apis/monitoring.coreos.com/v1", "servicemonitors"),
}
MANAGED_KINDS = (("v1", "ConfigMap"), ("v1", "Service"), ("apps/v1", "Deployment"), ("batch/v1", "Job"),
                 ("policy/v1", "PodDisruptionBudget"), ("networking.k8s.io/v1", "NetworkPolicy"),
                 ("monitoring.coreos.com/v1", "ServiceMonitor"))


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, body: str):
        super().__init__(f"{method} {path}: HTTP {status}: {body[:300]}")
        self.status = status


class NameTaken(Exception):
    """The name a planned object needs is held by an object the resource does not own."""

    def __init__(self, obj: Mapping[str, Any], holder: Mapping[str, Any]):
        meta = obj["metadata"]
        self.kind, self.name = obj["kind"], f"{meta['namespace']}/{meta['name']}"
        self.holder = describe_holder(holder)
        super().__init__(f"{self.kind} {self.name} exists and belongs to {self.holder}: not adopted")


def describe_holder(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    owners = meta.get("ownerReferences") or []
    owner = next((o for o in owners if o.get("controller")), owners[0] if owners else None)
    if owner:
        return f"{owner.get('kind')} {owner.get('name')} (uid {owner.get('uid')})"
    managers = sorted({m.get("manager") for m in meta.get("managedFields") or [] if m.get("manager")})
    return f"no owner (written by {', '.join(managers)})" if managers else "no owner"


def owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    return uid is not None and any(o.get("uid") == uid for o in (obj.get("metadata") or {}).get("ownerReferences") or [])


def matches(obj: Mapping[str, Any], selector: str) -> bool:
    """Equality-based label selector (`a=b,c=d`), re-checked on the client: deleting what the plan no longer
    wants must never reach an object outside the selector."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, _, v in (term.partition("=") for term in selector.split(",") if term))


def path_for(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    prefix, plural = RESOURCES[(api_version, kind)]
    base = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{base}/{name}" if name else base


class Kube:
    def __init__(self, server: str, *, token: str | None = None, scheme: str | None = None,
                 ssl_context: ssl.SSLContext | bool | None = None,
                 backoffs: Sequence[float] = (0.1, 0.3, 1.0, 3.0),
                 relogin: Callable[[], Awaitable[Any]] | None = None):
        self.server = server.rstrip("/")
        self.backoffs = tuple(backoffs)
        self.relogin = relogin
        self._use(token, scheme, ssl_context)
        self._session: aiohttp.ClientSession | None = None

    def _use(self, token: str | None, scheme: str | None, ssl_context: ssl.SSLContext | bool | None) -> None:
        headers = {"Accept": "application/json", "User-Agent": MANAGER}
        if token:
            headers["Authorization"] = f"{scheme or 'Bearer'} {token}"
        self._headers = headers
        self._ssl = ssl_context

    async def _login_again(self) -> bool:
        """New credentials from `relogin` (a Kopf ConnectionInfo); False when there is no way to get any."""
        info = await self.relogin() if self.relogin else None
        if info is None:
            return False
        await self.close()
        self._use(info.token, info.scheme, self.ssl_context(info))
        return True

    @classmethod
    def from_connection(cls, info: Any, backoffs: Sequence[float] | None = None,
                        relogin: Callable[[], Awaitable[Any]] | None = None) -> Kube:
        """From Kopf's `ConnectionInfo` (whatever login method Kopf used)."""
        kwargs: dict[str, Any] = {} if backoffs is None else {"backoffs": backoffs}
        return cls(info.server, token=info.token, scheme=info.scheme, ssl_context=cls.ssl_context(info),
                   relogin=relogin, **kwargs)

    @staticmethod
    def ssl_context(info: Any) -> ssl.SSLContext | bool | None:
        context: ssl.SSLContext | bool | None = None
        if info.server.startswith("https"):
            if info.insecure:
                context = False
            else:
                context = ssl.create_default_context(
                    cafile=info.ca_path or None,
                    cadata=(info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data) or None)
                if info.certificate_path and info.private_key_path:
                    context.load_cert_chain(info.certificate_path, info.private_key_path)
        return context

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                      content_type: str = "application/json", missing_ok: bool = False) -> Any:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        relogged = False
        attempt = 0
        while True:
            if self._session is None:
                self._session = aiohttp.ClientSession(headers=self._headers)
            async with self._session.request(method, self.server + path, data=data, params=params or None,
                                             headers=headers, ssl=self._ssl) as resp:
                text = await resp.text()
                if resp.status < 300:
                    return json.loads(text) if text else None
                if resp.status == 404 and missing_ok:
                    return None
                if resp.status == 401 and not relogged:
                    relogged = True
                    if await self._login_again():
                        continue
                reason = RETRY_STATUSES.get(resp.status)
                if method == "POST" and resp.status == 409:
                    reason = None  # AlreadyExists, not a write conflict: retrying cannot help
                if reason is None or attempt == len(self.backoffs):
                    metrics.ERRORS.labels("api").inc()
                    raise ApiError(resp.status, method, path, text)
            metrics.API_RETRIES.labels(reason).inc()
            await asyncio.sleep(self.backoffs[attempt])
            attempt += 1

    # -- the operations the handlers use ------------------------------------------------------------------------

    async def list_managed(self, namespace: str, selector: str) -> list[dict]:
        """Objects of every managed kind carrying `selector` (kinds whose API is absent are skipped)."""
        out = []
        for api_version, kind in MANAGED_KINDS:
            listing = await self.request("GET", path_for(api_version, kind, namespace),
                                         params={"labelSelector": selector}, missing_ok=True)
            for item in (listing or {}).get("items", []):
                if not matches(item, selector):
                    continue
                item.setdefault("apiVersion", api_version)
                item.setdefault("kind", kind)
                out.append(item)
        return out

    async def create(self, obj: Mapping[str, Any], owner_uid: str | None = None) -> dict:
        """Create `obj`; if its name exists, apply over it only when `owner_uid` owns it, else raise NameTaken."""
        meta = obj["metadata"]
        current = await self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if current is None:
            try:
                created = await self.request("POST", path_for(obj["apiVersion"], obj["kind"], meta["namespace"]),
                                             body=obj, params={"fieldManager": MANAGER})
            except ApiError as exc:
                if exc.status != 409:
                    raise
                current = await self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]) or {}
            else:
                metrics.APPLIED.labels(obj["kind"], "create").inc()
                return await self.own_as_applied(obj, created)
        if not owned_by(current, owner_uid):
            raise NameTaken(obj, current)
        return await self.apply(obj)  # ours, but no longer carrying the labels it is listed by

    async def own_as_applied(self, obj: Mapping[str, Any], created: dict) -> dict:
        """The operator's Update entry in the created object's `managedFields` turned into its Apply entry (a JSON
        patch that holds only at the version the POST returned); the object as the server then holds it. Where the
        object changed meanwhile (409, 422) it is left as it is: its fields stay the operator's Update, which a
        later apply cannot remove, and a warning says so."""
        meta = created.get("metadata") or {}
        entries = meta.get("managedFields") or []
        upgraded = [{**e, "operation": "Apply"} if e.get("manager") == MANAGER and e.get("operation") == "Update"
                    and not e.get("subresource") else e for e in entries]
        if upgraded == entries:
            return created
        patch = [{"op": "test", "path": "/metadata/resourceVersion", "value": meta.get("resourceVersion")},
                 {"op": "replace", "path": "/metadata/managedFields", "value": upgraded}]
        path = path_for(obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        try:
            return await self.request("PATCH", path, body=patch, content_type="application/json-patch+json")
        except ApiError as exc:
            if exc.status not in (409, 422):
                raise
            logger.warning(f"{obj['kind']} {obj['metadata']['name']} changed before its fields were made the "
                           f"operator's applied ones ({exc.status}): a field a later plan leaves out stays")
            return created

    async def apply(self, obj: Mapping[str, Any]) -> dict:
        """Server-side apply: the operator's field manager owns exactly the fields it sends."""
        meta = obj["metadata"]
        applied = await self.request(
            "PATCH", path_for(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]), body=obj,
            params={"fieldManager": MANAGER, "force": "true"}, content_type="application/apply-patch+yaml")
        metrics.APPLIED.labels(obj["kind"], "apply").inc()
        return applied

    async def delete(self, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        await self.request("DELETE", path_for(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]),
                           body={"propagationPolicy": "Background"}, missing_ok=True)
        metrics.APPLIED.labels(obj["kind"], "delete").inc()

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        return await self.request("GET", path_for(api_version, kind, namespace, name), missing_ok=True)

    async def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict]:
        listing = await self.request("GET", path_for(api_version, kind, namespace),
                                     params={"labelSelector": selector}, missing_ok=True)
        return [item for item in (listing or {}).get("items", []) if matches(item, selector)]

    async def merge_config_map(self, namespace: str, name: str, data: Mapping[str, str],
                               labels: Mapping[str, str]) -> None:
        """Merge keys into a ConfigMap, creating it when absent."""
        path = path_for("v1", "ConfigMap", namespace, name)
        if await self.request("GET", path, missing_ok=True) is None:
            await self.create({"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
                               "data": dict(data)})
        else:
            await self.request("PATCH", path, body={"data": dict(data)}, content_type="application/merge-patch+json")
