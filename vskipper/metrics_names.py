"""The one place that names the runtime's Prometheus metrics (pure: no torch, no prometheus_client).

The runtime (the SGLang integration) registers exactly these metrics; the Prometheus rules and the Grafana
dashboard (`deploy/`) are generated from them, so a panel or an alert never names a metric nothing emits.
Names follow Prometheus conventions: `vskipper_` namespace, base units (tokens), counters end in `_total`, and
labels take values from small fixed sets (the enums of the switch and the skipper registry).

SGLang's own metrics (release 0.5.21, `sglang/srt/observability/metrics_collector.py`; TTFT and E2E carry an
`is_streaming` label too) are named here too: the dashboard reads TTFT, TPOT (inter-token latency) and end-to-end
latency from its histograms, KV-cache use, queue depth and generated tokens/s from its gauges and counters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vskipper.skippers.registry import Action
from vskipper.switch import PHASES, DecisionKind, Mode

NAMESPACE = "vskipper"

MODES = tuple(m.value for m in Mode)
ACTIONS = tuple(a.value for a in Action)
DECISIONS = tuple(d.value for d in DecisionKind)
BOUNDS = ("enter", "exit")


@dataclass(frozen=True)
class MetricName:
    """A metric as the runtime registers it: name (with `_total` for counters), type, help, label values."""

    name: str
    type: str  # counter | gauge | histogram
    help: str
    labels: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def label_names(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.labels)

    @property
    def base_name(self) -> str:
        """The name prometheus_client takes (it appends `_total` to counters itself)."""
        return self.name[: -len("_total")] if self.type == "counter" and self.name.endswith("_total") else self.name


ROWS = MetricName(
    "vskipper_rows_total", "counter",
    "Row-layer visits of routed layers, by phase and the action the row took (run: the whole layer; "
    "project_only: own K/V and the projector's update)",
    (("phase", PHASES), ("action", ACTIONS)))
PASSES = MetricName(
    "vskipper_passes_total", "counter",
    "Forward passes, by phase and the execution mode the pass ran in (dense or routed)",
    (("phase", PHASES), ("mode", MODES)))
SWITCH_DECISIONS = MetricName(
    "vskipper_switch_decisions_total", "counter",
    "Mode-switch decisions, by kind (route_on, route_off, promote, prefill_routed, prefill_dense, probe)",
    (("decision", DECISIONS),))
PROMOTIONS = MetricName(
    "vskipper_promotions_total", "counter",
    "Requests promoted from dense to routed decode when V crossed the enter threshold")
RESIDENT_TOKENS = MetricName(
    "vskipper_resident_tokens", "gauge",
    "Resident KV tokens V of the running decode batch, as the switch observes it")
THRESHOLD_TOKENS = MetricName(
    "vskipper_threshold_tokens", "gauge",
    "The switch's thresholds in resident KV tokens (enter: start routing decode; exit: stop); exported only "
    "while the decode phase is switched (hybrid policy), so alerts never compare V with an unused threshold",
    (("bound", BOUNDS),))

PREFILL_FLOOR_TOKENS = MetricName(
    "vskipper_prefill_floor_tokens", "gauge",
    "The prefill switch's floor in prompt tokens: an admission round routes from this many (`vskipper serve "
    "--prefill-floor-tokens`, else vskipper.constants'); exported only while the prefill phase is switched (hybrid "
    "policy)")

# How a routed prefill pass's routed layers ran (`vskipper.sglang.prefill_graphs`): replayed from the routed prefill
# graphs, or eagerly where the pass is longer than every captured count, where its count was refused (its capture
# failed or its checks at start strayed), or where the server asks for no graphs (`VSKIPPER_PREFILL_GRAPHS` unset)
PREFILL_LAYER_RUNS = ("replayed", "eager_longer", "eager_refused", "eager_not_asked")
ROUTED_PREFILL_PASSES = MetricName(
    "vskipper_routed_prefill_passes_total", "counter",
    "Routed prefill passes, by how their routed layers ran: replayed from the routed prefill graphs, or eagerly "
    "(eager_longer: longer than every count captured; eager_refused: its count's capture failed or its checks at "
    "start strayed; eager_not_asked: the server asks for no prefill graphs)",
    (("layers", PREFILL_LAYER_RUNS),))

RUNTIME_METRICS: tuple[MetricName, ...] = (ROWS, PASSES, SWITCH_DECISIONS, PROMOTIONS, RESIDENT_TOKENS,
                                           THRESHOLD_TOKENS, PREFILL_FLOOR_TOKENS, ROUTED_PREFILL_PASSES)

# SGLang 0.5.21's own histograms (seconds), exported under the `sglang:` prefix with a `model_name` label.
SGLANG_TTFT = "sglang:time_to_first_token_seconds"
SGLANG_ITL = "sglang:inter_token_latency_seconds"  # TPOT: the time per output token after the first
SGLANG_E2E = "sglang:e2e_request_latency_seconds"
SGLANG_HISTOGRAMS = (SGLANG_TTFT, SGLANG_ITL, SGLANG_E2E)
# ... and the scheduler's gauges and the request counters (same collector): KV-cache use, queue depth, throughput.
SGLANG_KV_USAGE = "sglang:token_usage"  # gauge, 0..1: the share of the KV-cache pool's tokens in use
SGLANG_QUEUE = "sglang:num_queue_reqs"  # gauge: requests waiting in the scheduler's queue
SGLANG_RUNNING = "sglang:num_running_reqs"  # gauge: requests in the running batch
SGLANG_GENERATED_TOKENS = "sglang:generation_tokens_total"  # counter: output tokens
SGLANG_GAUGES = (SGLANG_KV_USAGE, SGLANG_QUEUE, SGLANG_RUNNING)
SGLANG_COUNTERS = (SGLANG_GENERATED_TOKENS,)
SGLANG_METRICS = (*SGLANG_HISTOGRAMS, *SGLANG_GAUGES, *SGLANG_COUNTERS)
SGLANG_LABELS = ("model_name",)


# The operator's own metrics (`operator/vskipper_operator/metrics.py` registers exactly these; counters as
# exposed, with `_total`). The dashboard and the alerts read them from here.
OPERATOR_NAMESPACE = "vskipper_operator"
OPERATOR_RECONCILES = "vskipper_operator_reconciles_total"  # counter, by result
OPERATOR_ERRORS = "vskipper_operator_errors_total"  # counter, by kind
OPERATOR_API_RETRIES = "vskipper_operator_api_retries_total"  # counter, by reason
OPERATOR_APPLIED = "vskipper_operator_applied_objects_total"  # counter, by kind and action
OPERATOR_RECONCILE_DURATION = "vskipper_operator_reconcile_duration_seconds"  # histogram
OPERATOR_EXIT_TOKENS = "vskipper_operator_exit_tokens"  # gauge per GPU class
OPERATOR_ENTER_TOKENS = "vskipper_operator_enter_tokens"  # gauge per GPU class
OPERATOR_V_STAR_TOKENS = "vskipper_operator_v_star_tokens"  # gauge per GPU class
OPERATOR_BANDWIDTH = "vskipper_operator_bandwidth_bytes_per_second"  # gauge per GPU class, by source
OPERATOR_GPU_CLASSES = "vskipper_operator_gpu_classes"  # gauge per resource, by served
OPERATOR_RESOURCE_READY = "vskipper_operator_resource_ready"  # gauge per resource
OPERATOR_METRICS = (OPERATOR_RECONCILES, OPERATOR_ERRORS, OPERATOR_API_RETRIES, OPERATOR_APPLIED,
                    OPERATOR_RECONCILE_DURATION, OPERATOR_EXIT_TOKENS, OPERATOR_ENTER_TOKENS, OPERATOR_V_STAR_TOKENS,
                    OPERATOR_BANDWIDTH, OPERATOR_GPU_CLASSES, OPERATOR_RESOURCE_READY)


# The GPU class of a runtime series. The operator plans one Deployment per GPU class, each with its own thresholds,
# and labels its server pods with the class; the ServiceMonitor it plans copies that pod label onto every scraped
# series (`podTargetLabels`), under the name prometheus-operator gives it: invalid characters replaced by `_`.
GPU_CLASS_POD_LABEL = "vskipper.io/gpu-class"


def target_label(pod_label: str) -> str:
    """The series label prometheus-operator makes of a pod label named in a monitor's `podTargetLabels`."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", pod_label)


GPU_CLASS = target_label(GPU_CLASS_POD_LABEL)  # vskipper_io_gpu_class
