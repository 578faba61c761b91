"""Test helper: two SYNTHETIC runtime metrics endpoints for the alert tests of tests/test_prometheus_live.py.

A healthy `vskipper serve` fires none of the alerts, and the pathologies they detect (a switch that never acts on
its thresholds, a switch flapping for ten minutes, routed passes that skip nothing) cannot be provoked in a real
server on CPU without breaking it on purpose. These endpoints therefore register the runtime's metrics (the names,
types and labels of `vskipper.metrics_names`, the module the real runtime registers them from) and SGLang
0.5.21's latency histograms with prometheus_client, and drive them with fixed increments through two scenarios:

- `engaged`: V above the enter threshold, decode passes routed, 24 of 32 decode row-visits skip; the switch
  flips route_on/route_off several times a second (a flapping switch).
- `stuck`: V above the enter threshold but every decode pass dense (routing never engages); prefill passes run
  routed while no row skips (a mechanism declared but not executed), their routed layers eagerly because their
  count's prefill graphs were refused (the `engaged` server's replay).

A third endpoint stands in for kube-state-metrics (`--kube-state-port`): the pod series of the two servers and of
an unrelated pod, one server not Ready and restarting, for the dashboard's per-class pod panels.

Nothing else is synthetic: the runtime-side dashboard queries and recording rules are checked against a real
`vskipper serve`, and the operator-side queries against the real operator, in the same test module.

    python tests/standin_exporters.py --runtime-port engaged=P1 --runtime-port stuck=P2
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from vskipper import metrics_names as mn

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
        self.metrics[mn.PREFILL_FLOOR_TOKENS.name].set(1536)
        start_http_server(port, addr="127.0.0.1", registry=reg)

    def step(self, rng: random.Random) -> None:
        rows = self.metrics[mn.ROWS.name]
        passes = self.metrics[mn.PASSES.name]
        decisions = self.metrics[mn.SWITCH_DECISIONS.name]
        self.metrics[mn.RESIDENT_TOKENS.name].set(250_000 + rng.randint(0, 5_000))
        if self.scenario == "engaged":
            passes.labels("decode", "routed").inc(4)
            passes.labels("prefill", "routed").inc(1)
            self.metrics[mn.ROUTED_PREFILL_PASSES.name].labels("replayed").inc(1)
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
            self.metrics[mn.ROUTED_PREFILL_PASSES.name].labels("eager_refused").inc(1)
            rows.labels("decode", "run").inc(16 * 32)
            rows.labels("prefill", "run").inc(16 * 1500)
            decisions.labels("prefill_routed").inc()
        for _ in range(3):
            self.ttft.labels(MODEL, "true").observe(rng.uniform(0.05, 0.4))
            self.itl.labels(MODEL).observe(rng.uniform(0.008, 0.03))
            self.e2e.labels(MODEL, "true").observe(rng.uniform(1.0, 6.0))


class KubeStateStandIn:
    """kube-state-metrics' pod series (the names the dashboard's generator lists) for three pods: the two servers'
    (their `vskipper.io/gpu-class` label allowed through, as the dashboard asks) and an unrelated pod without it.
    The A100 server is Ready; the H100 server is not and its container keeps restarting."""

    PODS = (("llm", "llama-a100-80gb-0", "nvidia-a100-sxm4-80gb", True),
            ("llm", "qwen-h100-0", "nvidia-h100-80gb-hbm3", False),
            ("llm", "unrelated-0", "", False))

    def __init__(self, port: int):
        from deploy.dashboard import (
            KUBE_CONTAINER_RESTARTS,
            KUBE_GPU_CLASS,
            KUBE_POD_LABELS,
            KUBE_POD_READY,
        )

        reg = CollectorRegistry()
        labels = Gauge(KUBE_POD_LABELS, "pod labels", ["namespace", "pod", "uid", KUBE_GPU_CLASS], registry=reg)
        ready = Gauge(KUBE_POD_READY, "pod ready", ["namespace", "pod", "uid", "condition"], registry=reg)
        self.restarts = Counter(KUBE_CONTAINER_RESTARTS.removesuffix("_total"), "restarts",
                                ["namespace", "pod", "uid", "container"], registry=reg)
        for ns, pod, gpu_class, is_ready in self.PODS:
            uid = f"uid-{pod}"
            labels.labels(ns, pod, uid, gpu_class).set(1)
            for condition in ("true", "false", "unknown"):
                ready.labels(ns, pod, uid, condition).set(int(condition == ("true" if is_ready else "false")))
            self.restarts.labels(ns, pod, uid, "server").inc(0)
        start_http_server(port, addr="127.0.0.1", registry=reg)

    def step(self, rng: random.Random) -> None:
        for ns, pod, _, is_ready in self.PODS:
            if not is_ready:
                self.restarts.labels(ns, pod, f"uid-{pod}", "server").inc()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runtime-port", action="append", required=True, help="SCENARIO=PORT")
    parser.add_argument("--kube-state-port", type=int, help="also a kube-state-metrics stand-in on this port")
    parser.add_argument("--period", type=float, default=0.25)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    runtimes = []
    for spec in args.runtime_port:
        scenario, port = spec.split("=")
        runtimes.append(RuntimeStandIn(scenario, int(port)))
    if args.kube_state_port:
        runtimes.append(KubeStateStandIn(args.kube_state_port))
    print("ready", flush=True)
    while True:
        for runtime in runtimes:
            runtime.step(rng)
        time.sleep(args.period)


if __name__ == "__main__":
    sys.exit(main())
