"""The Grafana dashboard, built with grafana-foundation-sdk and rendered to helm/vskipper/files/dashboard.json.

Every query names metrics from `vskipper.metrics_names` (the runtime, SGLang's histograms, gauges and counters),
the operator's `vskipper_operator_*` or kube-state-metrics' pod series (`KUBE_STATE_METRICS`, joined with the pod's
GPU class); a test evaluates each one against a live Prometheus that scrapes real exporters.
Queries use two template variables: `$datasource` (a Prometheus data source) and `$namespace`.

Cohort sizes have no metric of their own: the panel shows row-layer visits per decode pass by action, i.e. the
cohort size times the number of routed layers. Runtime series carry their server's GPU class
(`vskipper.metrics_names.GPU_CLASS`, copied from the pod label by the operator's ServiceMonitor): routed shares,
cohort sizes, SGLang's latency, KV-cache use, queue depth and throughput, and the server pods' readiness and
restarts are drawn per deployment and GPU class, V per server against the thresholds of its class (which
the servers of a class report alike), and the operator's gauges show the thresholds it derived per class.
"""

from __future__ import annotations

import json

from deploy.rules import share
from vskipper.metrics_names import (
    GPU_CLASS,
    GPU_CLASS_POD_LABEL,
    OPERATOR_API_RETRIES,
    OPERATOR_ENTER_TOKENS,
    OPERATOR_ERRORS,
    OPERATOR_EXIT_TOKENS,
    OPERATOR_GPU_CLASSES,
    OPERATOR_RECONCILE_DURATION,
    OPERATOR_RECONCILES,
    OPERATOR_V_STAR_TOKENS,
    PASSES,
    RESIDENT_TOKENS,
    ROUTED_PREFILL_PASSES,
    ROWS,
    SGLANG_E2E,
    SGLANG_GENERATED_TOKENS,
    SGLANG_ITL,
    SGLANG_KV_USAGE,
    SGLANG_QUEUE,
    SGLANG_RUNNING,
    SGLANG_TTFT,
    SWITCH_DECISIONS,
    THRESHOLD_TOKENS,
    target_label,
)

UID = "vskipper-overview"
DATASOURCE_VAR = "datasource"
NAMESPACE_VAR = "namespace"
NS = f'namespace=~"${NAMESPACE_VAR}"'
RATE = "$__rate_interval"

# kube-state-metrics (v2, docs/metrics/workload/pod-metrics.md), the only series here no vSkipper or SGLang code
# exports. Its pod labels reach `kube_pod_labels` only when allowed (`--metric-labels-allowlist=
# pods=[vskipper.io/gpu-class]`; kube-prometheus-stack: `kube-state-metrics.metricLabelsAllowlist`), as
# `label_` + the label's name with invalid characters replaced by `_`.
KUBE_POD_LABELS = "kube_pod_labels"
KUBE_POD_READY = "kube_pod_status_ready"  # condition: true | false | unknown
KUBE_CONTAINER_RESTARTS = "kube_pod_container_status_restarts_total"
KUBE_STATE_METRICS = (KUBE_POD_LABELS, KUBE_POD_READY, KUBE_CONTAINER_RESTARTS)
KUBE_GPU_CLASS = "label_" + target_label(GPU_CLASS_POD_LABEL)  # label_vskipper_io_gpu_class


def sglang_selector(metric: str, suffix: str) -> str:
    """A selector for an SGLang series under either spelling of its prefix. prometheus_client (0.26) writes
    OpenMetrics sample names with `sglang_` for `sglang:` (its HELP/TYPE lines keep the colon), and Prometheus
    negotiates OpenMetrics, so the stored name depends on the client version inside the SGLang image."""
    pattern = metric.replace("sglang:", "sglang[:_]", 1) + suffix
    return f'{{__name__=~"{pattern}", {NS}}}'


def by_gpu_class(pod_series: str) -> str:
    """A kube-state-metrics pod series joined with its pod's GPU class, under the runtime series' label name."""
    labels = (f'label_replace({KUBE_POD_LABELS}{{{NS}, {KUBE_GPU_CLASS}!=""}}, '
              f'"{GPU_CLASS}", "$1", "{KUBE_GPU_CLASS}", "(.+)")')
    return f"{pod_series}\n* on (namespace, pod) group_left ({GPU_CLASS}) {labels}"


def _panels() -> list[tuple[str, str, str, list[tuple[str, str]]]]:
    """(row title, panel title, unit, [(expr, legend)]) in display order."""
    rows, passes = ROWS.name, PASSES.name
    cls = f"{{{{{GPU_CLASS}}}}}"  # the legend's {{vskipper_io_gpu_class}}
    by_class = f"service, {GPU_CLASS}"
    lat = []
    for title, metric in (("TTFT", SGLANG_TTFT), ("TPOT (inter-token latency)", SGLANG_ITL),
                          ("End-to-end latency", SGLANG_E2E)):
        lat.append(("Latency (SGLang), per GPU class", f"{title}, per GPU class", "s", [
            (f"histogram_quantile({q}, sum by (le, {by_class}) "
             f"(rate({sglang_selector(metric, '_bucket')}[{RATE}])))",
             f"p{int(q * 100)} {{{{service}}}} {cls}") for q in (0.5, 0.99)]))
    serving = [
        ("Serving (SGLang), per GPU class", "KV-cache usage, per GPU class", "percentunit", [
            (f"max by ({by_class}) ({sglang_selector(SGLANG_KV_USAGE, '')})", f"max {{{{service}}}} {cls}"),
            (f"avg by ({by_class}) ({sglang_selector(SGLANG_KV_USAGE, '')})", f"mean {{{{service}}}} {cls}")]),
        ("Serving (SGLang), per GPU class", "Queue depth (waiting and running requests), per GPU class", "short", [
            (f"sum by ({by_class}) ({sglang_selector(SGLANG_QUEUE, '')})", f"waiting {{{{service}}}} {cls}"),
            (f"sum by ({by_class}) ({sglang_selector(SGLANG_RUNNING, '')})", f"running {{{{service}}}} {cls}")]),
        ("Serving (SGLang), per GPU class", "Generated tokens/s, per GPU class", "short", [
            (f"sum by ({by_class}) (rate({sglang_selector(SGLANG_GENERATED_TOKENS, '')}[{RATE}]))",
             f"{{{{service}}}} {cls}")]),
    ]
    pods = [
        ("Server pods (kube-state-metrics), per GPU class", "Server pods by readiness, per GPU class", "short", [
            (f"sum by (namespace, {GPU_CLASS}, condition) "
             f"({by_gpu_class(f'{KUBE_POD_READY}{{{NS}}}')})", f"ready={{{{condition}}}} {{{{namespace}}}} {cls}")]),
        ("Server pods (kube-state-metrics), per GPU class", "Container restarts, per GPU class", "short", [
            (f"sum by (namespace, {GPU_CLASS}) "
             f"({by_gpu_class(f'increase({KUBE_CONTAINER_RESTARTS}{{{NS}}}[{RATE}])')})",
             f"{{{{namespace}}}} {cls}")]),
    ]
    return [
        ("Routing", "Routed share of decode rows, per GPU class", "percentunit", [
            (share(f'rate({rows}{{{NS}, phase="decode", action="project_only"}}[{RATE}])',
                   f'rate({rows}{{{NS}, phase="decode"}}[{RATE}])', by_class), f"{{{{service}}}} {cls}")]),
        ("Routing", "Routed share of passes per phase, per GPU class", "percentunit", [
            (share(f'rate({passes}{{{NS}, mode="routed"}}[{RATE}])', f"rate({passes}{{{NS}}}[{RATE}])",
                   f"{by_class}, phase"), f"{{{{service}}}} {cls} {{{{phase}}}}")]),
        ("Routing", "Routed prefill passes by how their routed layers ran, per GPU class", "ops", [
            (f"sum by ({by_class}, layers) (rate({ROUTED_PREFILL_PASSES.name}{{{NS}}}[{RATE}]))",
             f"{{{{service}}}} {cls} {{{{layers}}}}")]),
        ("Routing", "Decode cohort sizes (row-layer visits per pass, by action)", "short", [
            (f'sum by ({by_class}, action) (rate({rows}{{{NS}, phase="decode"}}[{RATE}]))\n'
             f'/ on ({by_class}) group_left () sum by ({by_class}) (rate({passes}{{{NS}, phase="decode"}}[{RATE}]))',
             f"{{{{service}}}} {cls} {{{{action}}}}")]),
        ("Switch", "Resident tokens V against the thresholds of each GPU class", "short", [
            (f"{RESIDENT_TOKENS.name}{{{NS}}}", f"V {{{{pod}}}} {cls}"),
            (f"max by (namespace, {by_class}, bound) ({THRESHOLD_TOKENS.name}{{{NS}}})",
             f"{{{{bound}}}} {{{{service}}}} {cls}")]),
        ("Switch", "Thresholds per GPU class (operator)", "short", [
            (f"{OPERATOR_ENTER_TOKENS}{{{NS}}}", "enter {{name}} {{gpu_product}}"),
            (f"{OPERATOR_EXIT_TOKENS}{{{NS}}}", "exit {{name}} {{gpu_product}}"),
            (f"{OPERATOR_V_STAR_TOKENS}{{{NS}}}", "V* {{name}} {{gpu_product}}")]),
        ("Switch", "Switch decisions", "short", [
            (f"sum by (decision) (increase({SWITCH_DECISIONS.name}{{{NS}}}[{RATE}]))", "{{decision}}")]),
        *lat,
        *serving,
        *pods,
        ("Operator", "Reconciles by result", "ops", [
            (f"sum by (result) (rate({OPERATOR_RECONCILES}[$__rate_interval]))", "{{result}}")]),
        ("Operator", "Errors and API retries", "ops", [
            (f"sum by (kind) (rate({OPERATOR_ERRORS}[$__rate_interval]))", "error {{kind}}"),
            (f"sum by (reason) (rate({OPERATOR_API_RETRIES}[$__rate_interval]))", "retry {{reason}}")]),
        ("Operator", "Reconcile duration", "s", [
            (f"histogram_quantile(0.99, sum by (le) (rate({OPERATOR_RECONCILE_DURATION}_bucket"
             "[$__rate_interval])))", "p99")]),
        ("Operator", "GPU classes (served / not served)", "short", [
            (f"sum by (served) ({OPERATOR_GPU_CLASSES}{{{NS}}})", "served={{served}}")]),
    ]


def build_dashboard() -> dict:
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    ds = DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VAR}}}")
    board = (db.Dashboard("vSkipper")
             .uid(UID)
             .tags(["vskipper", "sglang"])
             .description("Routing, the mode switch, SGLang serving per GPU class, server pods and the vSkipper operator")
             .time("now-1h", "now")
             .refresh("30s")
             .timezone("browser")
             .with_variable(db.DatasourceVariable(DATASOURCE_VAR).label("Data source").type("prometheus"))
             .with_variable(db.QueryVariable(NAMESPACE_VAR).label("Namespace").datasource(ds)
                            .query(f"label_values({RESIDENT_TOKENS.name}, namespace)")
                            .multi(True).include_all(True).all_value(".*")))
    panel_id = 0
    current_row = None
    for row_title, title, unit, targets in _panels():
        if row_title != current_row:
            panel_id += 1
            board = board.with_row(db.Row(row_title).id(panel_id))
            current_row = row_title
        panel_id += 1
        panel = timeseries.Panel().id(panel_id).title(title).datasource(ds).unit(unit).height(8).span(12)
        for i, (expr, legend) in enumerate(targets):
            panel = panel.with_target(prometheus.Dataquery().expr(expr).legend_format(legend)
                                      .ref_id(chr(ord("A") + i)).datasource(ds))
        board = board.with_panel(panel)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def all_expressions() -> list[str]:
    return [expr for _, _, _, targets in _panels() for expr, _ in targets]


def render_dashboard_json() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"
