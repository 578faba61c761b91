"""The one place the operator talks to the Kubernetes API (besides Kopf's own watching and patching).

A small aiohttp client over the connection Kopf logged in with: list the objects a resource manages, create
them, server-side apply them (`fieldManager=vskipper-operator`, forced: the operator owns the fields it sets),
delete them, read and merge-patch ConfigMaps. Conflicts (409), throttling (429) and server errors (5xx) are
retried with exponential backoff; when the retries run out the error is re-raised for Kopf to retry the
handler later.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from vskipper_operator import metrics

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
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ("/apis/monitoring.coreos.com/v1", "servicemonitors"),
}
MANAGED_KINDS = (("v1", "ConfigMap"), ("v1", "Service"), ("apps/v1", "Deployment"), ("batch/v1", "Job"),
                 ("monitoring.coreos.com/v1", "ServiceMonitor"))


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, body: str):
        super().__init__(f"{method} {path}: HTTP {status}: {body[:300]}")
        self.status = status


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
                 backoffs: Sequence[float] = (0.1, 0.3, 1.0, 3.0)):
        self.server = server.rstrip("/")
        self.backoffs = tuple(backoffs)
        headers = {"Accept": "application/json", "User-Agent": MANAGER}
        if token:
            headers["Authorization"] = f"{scheme or 'Bearer'} {token}"
        self._headers = headers
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_connection(cls, info: Any, backoffs: Sequence[float] | None = None) -> Kube:
        """From Kopf's `ConnectionInfo` (whatever login method Kopf used)."""
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
        kwargs = {} if backoffs is None else {"backoffs": backoffs}
        return cls(info.server, token=info.token, scheme=info.scheme, ssl_context=context, **kwargs)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                      content_type: str = "application/json", missing_ok: bool = False) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers)
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        for attempt in range(len(self.backoffs) + 1):
            async with self._session.request(method, self.server + path, data=data, params=params or None,
                                             headers=headers, ssl=self._ssl) as resp:
                text = await resp.text()
                if resp.status < 300:
                    return json.loads(text) if text else None
                if resp.status == 404 and missing_ok:
                    return None
                reason = RETRY_STATUSES.get(resp.status)
                if method == "POST" and resp.status == 409:
                    reason = None  # AlreadyExists, not a write conflict: retrying cannot help
                if reason is None or attempt == len(self.backoffs):
                    metrics.ERRORS.labels("api").inc()
                    raise ApiError(resp.status, method, path, text)
            metrics.API_RETRIES.labels(reason).inc()
            await asyncio.sleep(self.backoffs[attempt])
        raise AssertionError("unreachable")

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

    async def create(self, obj: Mapping[str, Any]) -> dict:
        meta = obj["metadata"]
        try:
            created = await self.request("POST", path_for(obj["apiVersion"], obj["kind"], meta["namespace"]),
                                         body=obj, params={"fieldManager": MANAGER})
        except ApiError as exc:
            if exc.status != 409:
                raise
            return await self.apply(obj)  # created meanwhile: apply over it
        metrics.APPLIED.labels(obj["kind"], "create").inc()
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
