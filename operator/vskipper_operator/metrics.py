"""The operator's own Prometheus metrics (namespace `vskipper_operator`, named in `vskipper.metrics_names`), on a
registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from vskipper import metrics_names as names

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(names.OPERATOR_RECONCILES, "Reconciliations of SkipperDeployments, by result "
                     "(applied: something changed, unchanged, invalid, error)", ["result"], registry=REGISTRY)
ERRORS = Counter(names.OPERATOR_ERRORS, "Errors by kind (invalid_spec, api, probe)", ["kind"],
                 registry=REGISTRY)
API_RETRIES = Counter(names.OPERATOR_API_RETRIES, "Kubernetes API requests retried after a "
                      "conflict, throttling or server error", ["reason"], registry=REGISTRY)
APPLIED = Counter(names.OPERATOR_APPLIED, "Objects created, updated or deleted",
                  ["kind", "action"], registry=REGISTRY)
DURATION = Histogram(names.OPERATOR_RECONCILE_DURATION, "Time to plan and apply one resource",
                     registry=REGISTRY, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
_CLASS = ["namespace", "name", "gpu_product"]
EXIT_TOKENS = Gauge(names.OPERATOR_EXIT_TOKENS, "Served exit threshold per GPU class, resident KV tokens",
                    _CLASS, registry=REGISTRY)
ENTER_TOKENS = Gauge(names.OPERATOR_ENTER_TOKENS, "Served enter threshold per GPU class, resident KV tokens",
                     _CLASS, registry=REGISTRY)
V_STAR_TOKENS = Gauge(names.OPERATOR_V_STAR_TOKENS, "Roofline crossover V* per GPU class, resident KV tokens",
                      _CLASS, registry=REGISTRY)
BANDWIDTH = Gauge(names.OPERATOR_BANDWIDTH, "Memory bandwidth the thresholds were derived "
                  "from, by source (catalogue, override, measured)", [*_CLASS, "source"], registry=REGISTRY)
GPU_CLASSES = Gauge(names.OPERATOR_GPU_CLASSES, "GPU classes per resource, by served (true/false)",
                    ["namespace", "name", "served"], registry=REGISTRY)

READY = Gauge(names.OPERATOR_RESOURCE_READY, "1 when the SkipperDeployment's Ready condition is True, else 0",
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
