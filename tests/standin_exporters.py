"""Test helper: metrics endpoints for the live-Prometheus test (tests/test_prometheus_live.py).

The OPERATOR endpoint is the real one: `vskipper_operator.metrics.serve` with its registry, its per-class gauges
set by `record_plan` from a real plan of manifests/examples/flexidepth-llama3-8b.yaml over the example node pool,
and its counters driven the way handlers drive them.

The RUNTIME endpoints are STAND-INS: the SGLang integration that registers the runtime's metrics is not part of
this tree, so this helper registers the metrics named in `vskipper.metrics_names` (the one module the runtime
uses too) and SGLang 0.5.21's latency histograms with prometheus_client, and drives them through two scenarios:

- `engaged`: V above the enter threshold, decode passes routed, rows skip; the switch flips route_on/route_off
  many times (a flapping switch).
- `stuck`: V above the enter threshold but every decode pass dense (routing never engages); prefill passes run
  routed while no row skips (a mechanism declared but not executed).

    python tests/standin_exporters.py --operator-port P --runtime-port engaged=P1 --runtime-port stuck=P2
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from vskipper import metrics_names as mn

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llama-3-8b-flexidepth"


class RuntimeStandIn:
    def __init__(self, scenario: str, port: int):
        self.scenario = scenario
        reg = CollectorRegistry()
        self.metrics = {}
        for m in mn.RUNTIME_METRICS:
            cls = Counter if m.type == "counter" else Gauge
            self.metrics[m.name] = cls(m.base_name, m.help, m.label_names, registry=reg)
        self.ttft = Histogram(mn.SGLANG_TTFT, "TTFT", ["model_name", "is_streaming"], registry=reg)
        self.itl = Histogram(mn.SGLANG_ITL, "ITL", ["model_name"], registry=reg,
                             buckets=(0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.1))
        self.e2e = Histogram(mn.SGLANG_E2E, "E2E", ["model_name", "is_streaming"], registry=reg)
        threshold = self.metrics[mn.THRESHOLD_TOKENS.name]
        threshold.labels("enter").set(200_000)
        threshold.labels("exit").set(160_000)
        start_http_server(port, addr="127.0.0.1", registry=reg)

    def step(self, rng: random.Random) -> None:
        rows = self.metrics[mn.ROWS.name]
        passes = self.metrics[mn.PASSES.name]
        decisions = self.metrics[mn.SWITCH_DECISIONS.name]
        self.metrics[mn.RESIDENT_TOKENS.name].set(250_000 + rng.randint(0, 5_000))
        if self.scenario == "engaged":
            passes.labels("decode", "routed").inc(4)
            passes.labels("prefill", "routed").inc(1)
            passes.labels("prefill", "dense").inc(1)
            rows.labels("decode", "run").inc(16 * 8)
            rows.labels("decode", "project_only").inc(16 * 24)
            rows.labels("prefill", "run").inc(16 * 900)
            rows.labels("prefill", "project_only").inc(16 * 600)
            for decision in ("route_on", "route_off"):
                decisions.labels(decision).inc(2)
            decisions.labels("promote").inc()
            decisions.labels("prefill_routed").inc()
            decisions.labels("prefill_dense").inc()
            decisions.labels("probe").inc()
        else:  # stuck
            passes.labels("decode", "dense").inc(4)
            passes.labels("prefill", "routed").inc(1)
            rows.labels("decode", "run").inc(16 * 32)
            rows.labels("prefill", "run").inc(16 * 1500)
            decisions.labels("prefill_routed").inc()
        for _ in range(3):
            self.ttft.labels(MODEL, "true").observe(rng.uniform(0.05, 0.4))
            self.itl.labels(MODEL).observe(rng.uniform(0.008, 0.03))
            self.e2e.labels(MODEL, "true").observe(rng.uniform(1.0, 6.0))


def start_operator(port: int):
    import yaml

    from vskipper_operator import metrics
    from vskipper_operator.plan import nodes_from_document, plan

    metrics.serve(port)  # binds all interfaces, as in the operator pod
    resource = yaml.safe_load((ROOT / "manifests/examples/flexidepth-llama3-8b.yaml").read_text())
    nodes = nodes_from_document(yaml.safe_load((ROOT / "manifests/examples/nodes-mixed-pool.json").read_text()))
    metrics.record_plan(plan(resource, nodes))
    return metrics


def step_operator(metrics, rng: random.Random) -> None:
    for result in ("applied", "unchanged", "invalid", "error"):
        metrics.RECONCILES.labels(result).inc()
    for kind in ("invalid_spec", "api", "probe"):
        metrics.ERRORS.labels(kind).inc()
    for reason in ("conflict", "throttled", "server_error"):
        metrics.API_RETRIES.labels(reason).inc()
    metrics.APPLIED.labels("Deployment", "apply").inc()
    metrics.DURATION.observe(rng.uniform(0.01, 0.3))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--operator-port", type=int, required=True)
    parser.add_argument("--runtime-port", action="append", default=[], help="SCENARIO=PORT")
    parser.add_argument("--period", type=float, default=0.25)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    operator = start_operator(args.operator_port)
    runtimes = []
    for spec in args.runtime_port:
        scenario, port = spec.split("=")
        runtimes.append(RuntimeStandIn(scenario, int(port)))
    print("ready", flush=True)
    while True:
        step_operator(operator, rng)
        for runtime in runtimes:
            runtime.step(rng)
        time.sleep(args.period)


if __name__ == "__main__":
    sys.exit(main())
