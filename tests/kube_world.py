"""Helpers for the tests that run the real operator: a Kubernetes API on loopback, and the operator process.

No kube-apiserver can run here (no envtest assets are reachable; Debian has only etcd), so the API server is
`kmock`'s `KubernetesEmulator` (a Kubernetes API mock server by Kopf's author, made for testing Kopf operators)
on 127.0.0.1, run in a thread of its own. It stores objects, serves list/watch/get/create/patch/delete and API
discovery, and records every request; it does not run controllers, defaulting, admission or real server-side
apply merge semantics (a PATCH merges JSON). Faults are injected with kmock's own DSL, e.g.
`cluster.api["patch", kmock.resource("apps/v1/deployments")][:2] << 409`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import kmock

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
    ("monitoring.coreos.com/v1/servicemonitors", "ServiceMonitor", True, set()),
    (CRD, "SkipperDeployment", True, {"status", "scale"}),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Cluster:
    """kmock's Kubernetes emulator on loopback, in its own event loop thread (Kopf runs in another)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        self.api, self.server = self._call(self._start())
        self.url = str(self.server.url).rstrip("/")
        return self

    async def _start(self):
        api = kmock.KubernetesEmulator()
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
        """A SkipperDeployment with the metadata the API server would give it (kmock assigns none)."""
        obj = {**obj, "metadata": {**obj["metadata"], "uid": uid, "generation": 1, "resourceVersion": "1",
                                   "creationTimestamp": "2026-01-01T00:00:00Z"}}
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
