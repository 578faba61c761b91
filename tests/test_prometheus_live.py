"""A real Prometheus server (Debian's prometheus 2.x binary) on loopback, with the chart's rules loaded, evaluates
every PromQL expression of the dashboard and of the rules through its HTTP API: no panel or alert names a metric
nothing emits. Three setups, each with its own Prometheus scraping every second:

- The real runtime (`real_runtime`, one server start): `vskipper serve` on a tiny FlexiDepth checkpoint with
  SGLang's `--enable-metrics`, the hybrid arm with decode thresholds of 30/20 resident tokens so routing engages
  under a few requests, and a steady trickle of streamed requests. Every runtime-side dashboard query (`vskipper_*`
  and SGLang's histograms) and every recording rule returns data from it, with the labels the planned
  ServiceMonitor attaches, and every runtime metric and SGLang histogram, the alerts' inputs included, is there.
- The real operator (`real_operator`): `vskipper-operator run` in its own process, as the operator pod runs it
  (metrics port flag, Kopf's liveness endpoint, standalone, cluster-wide), against kmock's Kubernetes API on
  loopback (tests/kube_world.py; no kube-apiserver runs here). It reconciles the example SkipperDeployments over
  the example node pool; the API answers 500 to every list of Deployments in the `bench` namespace, so the
  RandomSkip example there keeps failing to reconcile, and an invalid copy of it is rejected. Every value on its
  endpoint is set by the handlers and the API client themselves: every operator-side dashboard query and rule
  expression (`vskipper_operator_*`) returns data, and the reconcile-error alert goes pending on the real failure.
- Synthetic pathological runtimes (`pathological_runtimes`, tests/standin_exporters.py): the alerts select
  pathologies a healthy server does not show (routing never engaging, a flapping switch, routed passes that skip
  nothing), so two stand-in endpoints with the runtime's metric names act them out with fixed increments. They
  check that each runtime-side alert returns data, picks the pathological server and spares the healthy one, that
  the recording rules compute the expected shares from known counts, and that thresholds are drawn per GPU class
  for two servers of two classes.

Scrape targets carry the labels the ServiceMonitors attach (namespace, service, pod, and for a server its
`podTargetLabels`: the GPU class); the operator job keeps its series' own `namespace` label (honor_labels), as the
chart's monitors do.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import kmock
import pytest
import yaml
from kube_world import Cluster, operator_process, wait_for
from operator_fixtures import A100, H100

from vskipper import metrics_names as mn
from vskipper.metrics_names import GPU_CLASS
from vskipper.sglang.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "helm" / "vskipper" / "files" / "prometheus-rules.yaml"
PROMETHEUS = shutil.which("prometheus")

pytestmark = [pytest.mark.server,  # a real Prometheus scraping real servers and the operator
              pytest.mark.skipif(PROMETHEUS is None, reason="prometheus missing: run `make tools`")]


def _get(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _query(base: str, expr: str) -> list:
    body = _get(base, "/api/v1/query", query=expr)
    assert body["status"] == "success", body
    return body["data"]["result"]


def eventually(check, timeout: float = 60.0):
    """`check()` until it raises no AssertionError or OSError (its value), for up to `timeout` seconds. Prometheus
    scrapes every second with a 1 s timeout: one scrape that a loaded host answers late marks its target's series
    stale until the next lands, and a one-shot query in that second reads no data (or the query itself times out).
    A check that holds returns at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except (AssertionError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


@contextmanager
def running_prometheus(tmp: Path, scrape_configs: list[dict], targets: int):
    """Prometheus on a free loopback port with the chart's rules, scraping every second; yields its URL once
    `targets` targets are up and a few scrapes have landed (rate() and increase() need two samples or more)."""
    port = free_port()
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(RULES)],
              "scrape_configs": scrape_configs}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = tmp / "prometheus.log"
    server = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(log, "w"))  # noqa: SIM115
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if len(_query(base, "up == 1")) == targets:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise AssertionError(f"prometheus never scraped {targets} targets:\n{log.read_text()}")
            time.sleep(0.5)
        time.sleep(8)
        yield base
    finally:
        server.kill()
        server.wait()


@pytest.fixture(scope="module")
def pathological_runtimes(tmp_path_factory):
    """Prometheus scraping the two synthetic runtimes: `engaged` (flapping) as llama on an A100, `stuck` (routing
    never engages, routed prefill skips nothing) as qwen on an H100."""
    tmp = tmp_path_factory.mktemp("prometheus")
    engaged_port, stuck_port, kube_state_port = free_port(), free_port(), free_port()
    exporters = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "standin_exporters.py"),
         "--runtime-port", f"engaged={engaged_port}", "--runtime-port", f"stuck={stuck_port}",
         "--kube-state-port", str(kube_state_port)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        stdout=subprocess.PIPE, text=True)
    scrape_configs = [
        {"job_name": "vskipper-runtime", "static_configs": [
            {"targets": [f"127.0.0.1:{engaged_port}"],
             "labels": {"namespace": "llm", "service": "llama", "pod": "llama-a100-80gb-0",
                        GPU_CLASS: "nvidia-a100-sxm4-80gb"}},
            {"targets": [f"127.0.0.1:{stuck_port}"],
             "labels": {"namespace": "llm", "service": "qwen", "pod": "qwen-h100-0",
                        GPU_CLASS: "nvidia-h100-80gb-hbm3"}}]},
        # kube-prometheus-stack scrapes kube-state-metrics with honorLabels: its namespace/pod labels are the pods'
        {"job_name": "kube-state-metrics", "honor_labels": True, "static_configs": [
            {"targets": [f"127.0.0.1:{kube_state_port}"]}]},
    ]
    try:
        assert exporters.stdout.readline().strip() == "ready"
        with running_prometheus(tmp, scrape_configs, targets=3) as base:
            yield base
    finally:
        exporters.kill()
        exporters.wait()


def _instantiate(expr: str) -> str:
    """Grafana's variables as a dashboard viewer would have them: all namespaces, a 30 s rate window."""
    return expr.replace('namespace=~"$namespace"', 'namespace=~".*"').replace("$__rate_interval", "30s")


def _dashboard_exprs() -> list[tuple[str, str]]:
    board = json.loads((ROOT / "helm" / "vskipper" / "files" / "dashboard.json").read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out.append((f"{panel['title']} / {target['refId']}", target["expr"]))
    return out


def _rule_exprs() -> list[tuple[str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(rule.get("record") or rule["alert"], rule["expr"]) for g in groups for rule in g["rules"]]


def _kube_state_side(expr: str) -> bool:
    from deploy.dashboard import KUBE_STATE_METRICS

    return any(name in expr for name in KUBE_STATE_METRICS)


def _operator_side(expr: str) -> bool:
    return "vskipper_operator_" in expr or "vskipper-operator" in expr


def _runtime_side(expr: str) -> bool:
    return not _operator_side(expr) and not _kube_state_side(expr)


def test_every_runtime_side_alert_returns_data_on_the_pathological_servers(pathological_runtimes):
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = [(r["alert"], r["expr"]) for g in groups for r in g["rules"] if "alert" in r and _runtime_side(r["expr"])]
    assert len(alerts) == 4

    def check():
        empty = [name for name, expr in alerts if not _query(pathological_runtimes, expr)]
        assert not empty, f"alert expressions with no data: {empty}"

    eventually(check)


def test_alerts_pick_the_pathological_server_and_spare_the_healthy_one(pathological_runtimes):
    service = {r["metric"]["instance"]: r["metric"].get("service") for r in _query(pathological_runtimes, "up")}

    def instances(alert):
        expr = dict(_rule_exprs())[alert]
        return {service[r["metric"]["instance"]] for r in _query(pathological_runtimes, expr)}

    def check():
        assert instances("VskipperRoutingNeverEngages") == {"qwen"}
        assert instances("VskipperMechanismNotExecuted") == {"qwen"}
        assert instances("VskipperSwitchFlapping") == {"llama"}
        assert instances("VskipperPrefillGraphsRefused") == {"qwen"}

    eventually(check)


def test_prometheus_evaluates_the_loaded_rules(pathological_runtimes):
    """The server loaded the rules file: recording rules compute the shares of the known counts and every
    runtime-side alert is pending (for: 5m)."""
    def check():
        share = _query(pathological_runtimes, "vskipper:decode_rows_skipped:ratio_rate5m")
        by_service = {r["metric"]["service"]: float(r["value"][1]) for r in share}
        assert by_service.get("llama") == pytest.approx(0.75, abs=0.01)  # 24 of 32 decode row-visits skip
        assert by_service.get("qwen") == 0.0
        routed = _query(pathological_runtimes, 'vskipper:passes_routed:ratio_rate5m{phase="decode"}')
        assert {r["metric"]["service"]: float(r["value"][1]) for r in routed} == {"llama": 1.0, "qwen": 0.0}
        pending = {r["metric"]["alertname"] for r in _query(pathological_runtimes, 'ALERTS{alertstate="pending"}')}
        # ... and the operator-down alert: this Prometheus scrapes no operator at all
        assert pending == {"VskipperRoutingNeverEngages", "VskipperSwitchFlapping", "VskipperMechanismNotExecuted",
                           "VskipperPrefillGraphsRefused", "VskipperOperatorDown"}

    eventually(check)


def _panel_expr(title_prefix: str, ref: str = "A") -> str:
    return next(expr for title, expr in _dashboard_exprs() if title.startswith(title_prefix) and title.endswith(ref))


def test_thresholds_are_drawn_per_gpu_class(pathological_runtimes):
    expr = _panel_expr("Resident tokens V against the thresholds of each GPU class", "B")
    want = {(s, c, b) for s, c in (("llama", "nvidia-a100-sxm4-80gb"), ("qwen", "nvidia-h100-80gb-hbm3"))
            for b in ("enter", "exit")}

    def check():
        assert {(r["metric"]["service"], r["metric"][GPU_CLASS], r["metric"]["bound"]) for r in
                _query(pathological_runtimes, _instantiate(expr))} == want

    eventually(check)


def test_server_pod_readiness_and_restarts_are_drawn_per_gpu_class(pathological_runtimes):
    """The pod panels join kube-state-metrics' series with each server pod's GPU class: the unrelated pod (no class
    label) is left out, the Ready A100 server counts as ready, the H100 server as not ready and restarting."""
    pod_panels = [(title, expr) for title, expr in _dashboard_exprs() if _kube_state_side(expr)]
    assert [t for t, _ in pod_panels] == ["Server pods by readiness, per GPU class / A",
                                          "Container restarts, per GPU class / A"]

    def check():
        ready = {(r["metric"][GPU_CLASS], r["metric"]["condition"]): float(r["value"][1])
                 for r in _query(pathological_runtimes, _instantiate(pod_panels[0][1]))}
        assert ready == {("nvidia-a100-sxm4-80gb", "true"): 1.0, ("nvidia-a100-sxm4-80gb", "false"): 0.0,
                         ("nvidia-a100-sxm4-80gb", "unknown"): 0.0, ("nvidia-h100-80gb-hbm3", "true"): 0.0,
                         ("nvidia-h100-80gb-hbm3", "false"): 1.0, ("nvidia-h100-80gb-hbm3", "unknown"): 0.0}
        restarts = {r["metric"][GPU_CLASS]: float(r["value"][1])
                    for r in _query(pathological_runtimes, _instantiate(pod_panels[1][1]))}
        assert set(restarts) == {"nvidia-a100-sxm4-80gb", "nvidia-h100-80gb-hbm3"}
        assert restarts["nvidia-a100-sxm4-80gb"] == 0.0 and restarts["nvidia-h100-80gb-hbm3"] > 0

    eventually(check)


# -- the real operator --------------------------------------------------------------------------------------------

EXAMPLES = ROOT / "manifests" / "examples"
OPERATOR_NAMESPACE = "vskipper-system"


@pytest.fixture(scope="class")
def real_operator(tmp_path_factory):
    """Prometheus scraping the real operator, which reconciles three SkipperDeployments over the example node pool:
    the FlexiDepth example (llm), the RandomSkip example (bench, where the API answers 500 to every list of
    Deployments) and an invalid copy of it (bench). Yields (Prometheus URL, the cluster, the refused requests).
    Class-scoped: the operator is stopped before the real runtime's server starts."""
    tmp = tmp_path_factory.mktemp("real-operator")
    healthy = yaml.safe_load((EXAMPLES / "flexidepth-llama3-8b.yaml").read_text())
    failing = yaml.safe_load((EXAMPLES / "random-skip-arm.yaml").read_text())
    invalid = copy.deepcopy(failing)
    invalid["metadata"]["name"] = "random-invalid"
    invalid["spec"]["skipper"]["params"]["r"] = 1.5
    with Cluster() as cluster:
        for node in json.loads((EXAMPLES / "nodes-mixed-pool.json").read_text())["items"]:
            cluster.http("POST", "/api/v1/nodes", node)
        for obj in (healthy, failing, invalid):
            cluster.add_resource(obj, uid=f"uid-{obj['metadata']['name']}")
        refused = cluster.api[kmock.action.LIST, kmock.resource("apps/v1/deployments"),
                              kmock.namespace(failing["metadata"]["namespace"])] << 500
        metrics_port = free_port()
        with operator_process(cluster.write_kubeconfig(tmp / "kubeconfig"), tmp / "operator.log", metrics_port,
                              health_port=free_port()):
            scrape = [{"job_name": "vskipper-operator", "honor_labels": True, "static_configs": [
                {"targets": [f"127.0.0.1:{metrics_port}"], "labels": {"namespace": OPERATOR_NAMESPACE}}]}]
            with running_prometheus(tmp, scrape, targets=1) as base:
                # increase() needs the error counter to grow between two scrapes: the next failed attempt
                wait_for(lambda: _query(base, 'ALERTS{alertname="VskipperOperatorReconcileErrors"}'), timeout=90,
                         what="the reconcile-error alert")
                yield {"base": base, "cluster": cluster, "refused": refused, "healthy": healthy}


def _pending_are(base: str, names: set[str]) -> None:
    pending = {r["metric"]["alertname"] for r in _query(base, 'ALERTS{alertstate="pending"}')}
    assert pending == names


class TestRealOperator:
    def test_every_operator_side_dashboard_query_and_rule_returns_data(self, real_operator):
        base = real_operator["base"]
        queries = [(title, _instantiate(expr)) for title, expr in _dashboard_exprs() if _operator_side(expr)]
        rules = [(name, expr) for name, expr in _rule_exprs() if _operator_side(expr)]
        assert len(queries) >= 8  # thresholds, reconciles, errors, retries, duration, GPU classes
        assert [name for name, _ in rules] == ["VskipperOperatorDown", "VskipperOperatorReconcileErrors",
                                               "VskipperDeploymentNotReady", "VskipperGpuClassNotServed"]

        def check():
            empty = [title for title, expr in queries + rules if not _query(base, expr)]
            # the operator is up: its down alert has nothing to say; every other query has data
            assert empty == ["VskipperOperatorDown"], \
                f"operator-side queries with no data from the real operator: {empty}"

        eventually(check)

    def test_gauges_are_the_plan_of_the_reconciled_example_and_keep_its_namespace(self, real_operator):
        base, meta = real_operator["base"], real_operator["healthy"]["metadata"]

        def per_class(metric):
            return {(r["metric"]["namespace"], r["metric"]["name"], r["metric"]["gpu_product"]): float(r["value"][1])
                    for r in _query(base, metric)}

        # only the resource that reconciled has gauges; its namespace, not the operator pod's, is kept
        key = (meta["namespace"], meta["name"])

        def check():
            assert per_class("vskipper_operator_enter_tokens") == {(*key, A100): 200_000, (*key, H100): 340_000}
            assert per_class("vskipper_operator_exit_tokens") == {(*key, A100): 160_000, (*key, H100): 270_000}
            classes = {r["metric"]["served"]: float(r["value"][1])
                       for r in _query(base, "vskipper_operator_gpu_classes")}
            assert classes.get("true") == 2
            # no kubelet makes pods ready here: the reconciled resource and the invalid one are not Ready
            ready = {r["metric"]["name"]: float(r["value"][1])
                     for r in _query(base, "vskipper_operator_resource_ready")}
            assert ready == {meta["name"]: 0, "random-invalid": 0}

        eventually(check)

    def test_counters_record_what_the_operator_met(self, real_operator):
        base, refused = real_operator["base"], real_operator["refused"]

        def by(label, metric):
            return {r["metric"][label]: float(r["value"][1]) for r in _query(base, metric)}

        def check():
            assert set(by("result", "vskipper_operator_reconciles_total")) == {"applied", "unchanged", "error",
                                                                               "invalid"}
            assert set(by("kind", "vskipper_operator_errors_total")) == {"api", "invalid_spec"}
            assert set(by("reason", "vskipper_operator_api_retries_total")) == {"server_error"}
            # each failed reconcile: a list answered 500, retried three times (VSKIPPER_OPERATOR_API_BACKOFFS)
            errors = by("result", "vskipper_operator_reconciles_total")["error"]
            assert errors >= 2 and len(list(refused)) >= 4 * errors
            # series that name no resource carry the operator's own namespace (honor_labels keeps the others')
            assert {r["metric"]["namespace"] for r in _query(base, "vskipper_operator_reconciles_total")} == \
                {OPERATOR_NAMESPACE}

        eventually(check)

    def test_pending_alerts_are_reconcile_errors_resources_not_ready_and_classes_not_served(self, real_operator):
        base, cluster = real_operator["base"], real_operator["cluster"]
        # no pod is ever ready here, and the example pool has GPUs of unknown bandwidth (GB300)
        eventually(lambda: _pending_are(base, {"VskipperOperatorReconcileErrors", "VskipperDeploymentNotReady",
                                               "VskipperGpuClassNotServed"}))
        # the healthy example's Deployments exist; the failing namespace got none
        assert cluster.http("GET", "/apis/apps/v1/namespaces/llm/deployments")["items"]
        assert not cluster.writes("/namespaces/bench/deployments")


# -- the real runtime ---------------------------------------------------------------------------------------------

def monitor_target_labels(objects: list[dict], deployment: dict) -> dict:
    """The labels prometheus-operator attaches to a server pod's series through the planned ServiceMonitor:
    namespace, service and pod, and each of its `podTargetLabels` under the name it gives them."""
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    service = next(o for o in objects if o["kind"] == "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    labels = {"namespace": service["metadata"]["namespace"], "service": service["metadata"]["name"],
              "pod": f"{deployment['metadata']['name']}-0"}
    labels.update({mn.target_label(name): pod_labels[name] for name in monitor["spec"]["podTargetLabels"]})
    return labels


@pytest.fixture(scope="module")
def real_runtime(tmp_path_factory):
    """Prometheus scraping a real `vskipper serve` (SGLang 0.5.21 on CPU, --enable-metrics) under a trickle of
    requests; yields (Prometheus URL, the target labels the planned ServiceMonitor would attach)."""
    pytest.importorskip("sglang")
    from operator_fixtures import mixed_pool, resource

    from tests.sglang_world import serve
    from vskipper.checkpoint import make_tiny_model, write_tiny_tokenizer
    from vskipper_operator.plan import plan

    tmp = tmp_path_factory.mktemp("real-runtime")
    model = make_tiny_model("flexidepth-llama", tmp / "flexidepth")
    write_tiny_tokenizer(model)
    objects = plan(resource(metrics={"serviceMonitor": True}), mixed_pool()).objects
    deployment = next(o for o in objects if o["kind"] == "Deployment"
                      and o["metadata"]["annotations"]["vskipper.io/gpu-product"] == A100)
    labels = monitor_target_labels(objects, deployment)
    stop = threading.Event()
    failures: list[Exception] = []

    def trickle(server):
        prompts = ([5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 300, 12, 7, 8], [100, 200, 300, 400, 17, 18, 19])
        i = 0
        while not stop.is_set():
            try:  # V grows past the enter threshold (30) within each request: decode turns routed, then off
                _stream_generate(server.url, list(prompts[i % len(prompts)]), 32)
            except Exception as exc:  # reported by the tests
                failures.append(exc)
                return
            i += 1

    with serve(model, tmp, arm="hybrid", enter_tokens=30, exit_tokens=20, extra=("--enable-metrics",)) as server:
        worker = threading.Thread(target=trickle, args=(server,), daemon=True)
        worker.start()
        scrape = [{"job_name": "vskipper-runtime", "metrics_path": "/metrics", "static_configs": [
            {"targets": [f"127.0.0.1:{server.port}"], "labels": labels}]}]
        try:
            with running_prometheus(tmp, scrape, targets=1) as base:
                _wait_for_data(base, failures)
                yield base, labels
        finally:
            stop.set()
            worker.join(timeout=120)
    assert not failures, failures


def _stream_generate(url: str, input_ids: list[int], n: int) -> None:
    """A streamed /generate: SGLang observes its inter-token-latency histogram only on intermediate outputs, which
    a non-streamed request of a few tokens never produces."""
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    req = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        chunks = [line for line in resp.read().decode().splitlines() if line.startswith("data:")]
    # a starved HTTP process may send a whole request's tokens as one chunk (SGLang sends the latest output): the
    # request is checked whole, and `_wait_for_data` waits for the inter-token samples
    assert len(chunks) >= 2 and chunks[-1].strip() == "data: [DONE]", chunks[-3:]
    assert json.loads(chunks[-2][len("data:"):])["meta_info"]["completion_tokens"] == n, chunks[-2][:300]


def _wait_for_data(base: str, failures: list, timeout: float = 120) -> None:
    """Until the decode switch has engaged and SGLang's histograms have samples in the dashboard's window."""
    probes = [f'{mn.PASSES.name}{{phase="decode", mode="routed"}}', mn.THRESHOLD_TOKENS.name,
              'rate({__name__=~"sglang[:_]inter_token_latency_seconds_count"}[30s]) > 0']
    deadline = time.monotonic() + timeout
    while not all(_query(base, p) for p in probes):
        assert not failures, failures
        assert time.monotonic() < deadline, [p for p in probes if not _query(base, p)]
        time.sleep(1)


def test_real_runtime_answers_every_runtime_side_dashboard_query(real_runtime):
    base, labels = real_runtime
    exprs = [(title, expr) for title, expr in _dashboard_exprs() if _runtime_side(expr)]
    assert len(exprs) >= 11  # routing, switch and latency panels

    def check():
        empty = [title for title, expr in exprs if not _query(base, _instantiate(expr))]
        assert not empty, f"dashboard queries with no data from the real server: {empty}"
        # the per-class views carry the GPU class the planned ServiceMonitor copies from the pod
        thresholds = _query(base, _instantiate(_panel_expr("Resident tokens V against the thresholds", "B")))
        assert {(r["metric"][GPU_CLASS], r["metric"]["bound"], float(r["value"][1])) for r in thresholds} == \
            {(labels[GPU_CLASS], "enter", 30.0), (labels[GPU_CLASS], "exit", 20.0)}

    eventually(check)


def test_real_runtime_answers_every_recording_rule(real_runtime):
    base, labels = real_runtime
    groups = yaml.safe_load(RULES.read_text())["groups"]
    records = [(r["record"], r["expr"]) for g in groups for r in g["rules"] if "record" in r]
    assert len(records) == 3 and all(_runtime_side(expr) for _, expr in records)

    def check():
        for name, expr in records:
            result = _query(base, expr)
            assert result, f"{name}: no data from the real server"
            for r in result:
                assert {k: r["metric"][k] for k in ("namespace", "service", GPU_CLASS)} == \
                    {k: labels[k] for k in ("namespace", "service", GPU_CLASS)}, name
                assert 0.0 <= float(r["value"][1]) <= 1.0, (name, r)
        routed = _query(base, 'vskipper:passes_routed:ratio_rate5m{phase="decode"}')
        assert routed and float(routed[0]["value"][1]) > 0  # the switch engaged on the real server

    eventually(check)


def test_real_runtime_emits_every_runtime_metric_and_sglang_metric(real_runtime):
    """The inputs of every runtime-side panel and rule, the alerts' included, come from the real server."""
    base, _ = real_runtime
    names = [m.name for m in mn.RUNTIME_METRICS]
    names += [f'{h.replace("sglang:", "sglang[:_]")}_bucket' for h in mn.SGLANG_HISTOGRAMS]
    names += [h.replace("sglang:", "sglang[:_]") for h in (*mn.SGLANG_GAUGES, *mn.SGLANG_COUNTERS)]

    def check():
        missing = [n for n in names if not _query(base, f'{{__name__=~"{n}"}}')]
        assert not missing, f"not exported by the real server: {missing}"

    eventually(check)
    rule_inputs = {n for _, expr in _rule_exprs() if _runtime_side(expr)
                   for n in (m.name for m in mn.RUNTIME_METRICS) if n in expr}
    assert rule_inputs <= set(names)


def test_autoscaling_examples_adapter_rule_gives_the_hpa_a_value_per_server_pod(real_runtime):
    """prometheus-adapter's steps for the HPA example's Pods metric, on the real server's series: discover the
    series with the rule's seriesQuery, then evaluate its metricsQuery for the pod in its namespace."""
    from test_autoscaling_example import adapter_query, adapter_rule

    base, labels = real_runtime
    rule = adapter_rule()

    def check():
        series = {r["metric"]["__name__"] for r in _query(base, rule["seriesQuery"])}
        assert len(series) == 1, series
        result = _query(base, adapter_query(rule, series.pop(), labels["namespace"], [labels["pod"], "other-0"]))
        assert [r["metric"] for r in result] == [{"pod": labels["pod"]}]
        assert float(result[0]["value"][1]) >= 0

    eventually(check)
