"""The operator's own Prometheus metrics (namespace `vskipper_operator`), on a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter("vskipper_operator_reconciles_total", "Reconciliations of SkipperDeployments, by result "
                     "(applied: something changed, unchanged, invalid, error)", ["result"], registry=REGISTRY)
ERRORS = Counter("vskipper_operator_errors_total", "Errors by kind (invalid_spec, api, probe)", ["kind"],
                 registry=REGISTRY)
API_RETRIES = Counter("vskipper_operator_api_retries_total", "Kubernetes API requests retried after a "
                      "conflict, throttling or server error", ["reason"], registry=REGISTRY)
APPLIED = Counter("vskipper_operator_applied_objects_total", "Objects created, updated or deleted",
                  ["kind", "action"], registry=REGISTRY)
DURATION = Histogram("vskipper_operator_reconcile_duration_seconds", "Time to plan and apply one resource",
                     registry=REGISTRY, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
_CLASS = ["namespace", "name", "gpu_product"]
EXIT_TOKENS = Gauge("vskipper_operator_exit_tokens", "Served exit threshold per GPU class, resident KV tokens",
                    _CLASS, registry=REGISTRY)
ENTER_TOKENS = Gauge("vskipper_operator_enter_tokens", "Served enter threshold per GPU class, resident KV tokens",
                     _CLASS, registry=REGISTRY)
V_STAR_TOKENS = Gauge("vskipper_operator_v_star_tokens", "Roofline crossover V* per GPU class, resident KV tokens",
                      _CLASS, registry=REGISTRY)
BANDWIDTH = Gauge("vskipper_operator_bandwidth_bytes_per_second", "Memory bandwidth the thresholds were derived "
                  "from, by source (catalogue, override, measured)", [*_CLASS, "source"], registry=REGISTRY)
GPU_CLASSES = Gauge("vskipper_operator_gpu_classes", "GPU classes per resource, by served (true/false)",
                    ["namespace", "name", "served"], registry=REGISTRY)

READY = Gauge("vskipper_operator_resource_ready", "1 when the SkipperDeployment's Ready condition is True, else 0",
              ["namespace", "name"], registry=REGISTRY)

_PER_RESOURCE = (EXIT_TOKENS, ENTER_TOKENS, V_STAR_TOKENS, BANDWIDTH, GPU_CLASSES, READY)


def record_plan(result) -> None:
    """Set the per-class gauges from a PlanResult (classes that left are removed)."""
    forget(result.namespace, result.name)
    for c in result.classes:
        if not c.served:
            continue
        labels = (result.namespace, result.name, c.product)
        EXIT_TOKENS.labels(*labels).set(c.exit_tokens)
        ENTER_TOKENS.labels(*labels).set(c.enter_tokens)
        if c.thresholds is not None:
            V_STAR_TOKENS.labels(*labels).set(c.thresholds.v_star_tokens)
        BANDWIDTH.labels(*labels, c.bandwidth_source).set(c.bandwidth_gbps * 1e9)
    for served in (True, False):
        count = sum(1 for c in result.classes if c.served is served)
        GPU_CLASSES.labels(result.namespace, result.name, str(served).lower()).set(count)


def record_ready(namespace: str, name: str, conditions) -> None:
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    READY.labels(namespace, name).set(1 if ready else 0)


def forget(namespace: str, name: str) -> None:
    for gauge in _PER_RESOURCE:
        for labels in list(gauge._metrics):  # label tuples; prometheus_client has no prefix removal
            if labels[:2] == (namespace, name):
                gauge.remove(*labels)


def serve(port: int) -> None:
    if port > 0:
        start_http_server(port, registry=REGISTRY)
