"""The scheduler-side state of one vSkipper server: served arm, skipper, mode switch, counters.

SGLang runs the model inside its scheduler process. The model classes (`vskipper.sglang.models`) ask the
`Runtime` once per forward pass for a `Step`: which rows run routed. The runtime decides from the foundation's
`ModeSwitch`:

  prefill (SGLang's extend)  a request's prefill mode is fixed when it is admitted (its first extend pass; a
                             chunked prompt keeps it); the requests admitted in one pass form one admission round
  decode                     the switch observes V = the running batch's resident KV tokens (the sum of its
                             sequence lengths, host-side), then fixes the decode mode of the requests that start
                             decoding; promotion is one-way. A request that leaves the decode batch has finished.

Counters are cumulative and monotonic. After every pass the runtime writes its attestation (the served design and
the counters) to a JSON state file that the HTTP process serves at `/vskipper/attestation`, and, when SGLang runs
with `--enable-metrics`, moves Prometheus counters in the multiprocess directory SGLang's `/metrics` reads.

The launcher passes the served configuration through the environment (the scheduler is a spawned process).
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from vskipper import constants
from vskipper.mixed.cohorts import CohortBuilder
from vskipper.mixed.tape import RouteTape
from vskipper.sglang.spec import ServeConfigError, ServeSpec, check_arm_for_model
from vskipper.skippers.base import BatchContext, Skipper
from vskipper.skippers.registry import SkipperConfigError, build_skipper
from vskipper.switch import Mode, ModeSwitch, Policy

COHORT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def request_key(rid: str) -> int:
    """A stable int64 key per request id (RandomSkip hashes it with the position)."""
    return zlib.crc32(str(rid).encode())


@dataclass
class Step:
    """What one forward pass runs: phase, per-row routed flags, the skipper's per-pass state and the tape."""

    phase: str  # "prefill" | "decode"
    routed: bool  # any row runs the routed layers through the tape
    skipper: Skipper | None = None
    state: Any = None
    tape: RouteTape | None = None
    builder: CohortBuilder | None = None
    dense_rows: torch.Tensor | None = None  # bool [rows]: rows of dense-mode requests (RUN, unit weight)
    rows: int = 0
    probe: bool = False
    run_rows: int = 0  # routed decisions of routed-mode rows that ran (summed over routed layers)
    proj_rows: int = 0


@dataclass
class Counters:
    passes: dict = field(default_factory=lambda: {p: {"dense": 0, "routed": 0} for p in ("prefill", "decode")})
    rows: dict = field(default_factory=lambda: {p: {"run": 0, "project_only": 0} for p in ("prefill", "decode")})
    rows_per_layer: dict = field(default_factory=dict)  # layer -> {"run": n, "project_only": n}
    cohort_sizes: Counter = field(default_factory=Counter)  # bucket upper bound of the RUN cohort -> passes
    requests: dict = field(default_factory=lambda: {"prefill": Counter(), "decode": Counter()})


def _bucket(n: int) -> str:
    for b in COHORT_BUCKETS:
        if n <= b:
            return f"le_{b}"
    return "gt_1024"


class _Prometheus:
    """vSkipper counters in the Prometheus multiprocess directory SGLang's /metrics collects (scheduler side).
    Names, types, help and labels come from `vskipper.metrics_names`, the one list dashboards and rules read."""

    def __init__(self) -> None:
        from prometheus_client import Counter as PCounter
        from prometheus_client import Gauge

        from vskipper import metrics_names as m

        def counter(metric):
            return PCounter(metric.base_name, metric.help, list(metric.label_names))

        def gauge(metric):
            return Gauge(metric.base_name, metric.help, list(metric.label_names), multiprocess_mode="mostrecent")

        self.passes = counter(m.PASSES)
        self.rows = counter(m.ROWS)
        self.decisions = counter(m.SWITCH_DECISIONS)
        self.promotions = counter(m.PROMOTIONS)
        self.resident = gauge(m.RESIDENT_TOKENS)
        self.threshold = gauge(m.THRESHOLD_TOKENS)


class Runtime:
    def __init__(self, spec: ServeSpec, model_type: str, routed_layers: tuple[int, ...], model_class: str,
                 device: str = "cpu") -> None:
        arm = spec.arm
        check_arm_for_model(arm, model_type)
        if arm.skipper is not None and not routed_layers:
            raise ServeConfigError(f"arm {arm.name!r} routes but the checkpoint has no 'routing_layers'")
        self.spec = spec
        self.arm = arm
        self.model_type = model_type
        self.model_class = model_class
        self.routed_layers = tuple(routed_layers)
        self.device = device
        try:
            self.skipper = build_skipper(arm.skipper, arm.params) if arm.skipper else None
        except SkipperConfigError as exc:
            raise ServeConfigError(str(exc)) from None
        self.switch = ModeSwitch(arm.switch_settings(), spec.enter_tokens, spec.exit_tokens,
                                 declared_project_share=arm.declared_skip_ratio())
        self.counters = Counters()
        self._prefill_mode: OrderedDict[str, Mode] = OrderedDict()
        self._decoding: set[str] = set()
        self._tape: RouteTape | None = None
        self._builder: CohortBuilder | None = None
        self._decisions_seen = Counter()
        self._promotions_seen = 0
        self.started = time.time()
        self.prometheus = _Prometheus() if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else None
        if self.prometheus is not None and arm.switch_settings().decode is Policy.HYBRID:
            # Exported only while decode is switched, so no alert compares V with a threshold nobody uses.
            self.prometheus.threshold.labels("enter").set(spec.enter_tokens)
            self.prometheus.threshold.labels("exit").set(spec.exit_tokens)
        self.write_state()

    # -- per pass -------------------------------------------------------------------------------------------

    def plan(self, forward_batch: Any, hidden: torch.Tensor, positions: torch.Tensor) -> Step:
        """Decide this pass's rows. `forward_batch` is SGLang's ForwardBatch (extend or decode)."""
        mode = forward_batch.forward_mode
        if mode.is_decode():
            return self._plan_decode(forward_batch, hidden, positions)
        if mode.is_extend():
            return self._plan_prefill(forward_batch, hidden, positions)
        return Step("other", False)

    def _plan_prefill(self, fb: Any, hidden: torch.Tensor, positions: torch.Tensor) -> Step:
        now = time.time()
        rids = list(fb.rids or [])
        seq_lens = [int(n) for n in fb.seq_lens_cpu.tolist()] if fb.seq_lens_cpu is not None \
            else [int(n) for n in fb.seq_lens.tolist()]
        new = [i for i, rid in enumerate(rids) if rid not in self._prefill_mode]
        for i in new:  # a retracted request comes back through prefill: its decode state ends
            if rids[i] in self._decoding:
                self._end(rids[i])
        probe = False
        if new:
            decision = self.switch.admit_prefill(sum(seq_lens[i] for i in new), now)
            probe = decision.probe
            for i in new:
                self._prefill_mode[rids[i]] = decision.mode
                self.counters.requests["prefill"][decision.mode.value] += 1
            while len(self._prefill_mode) > 65536:  # requests that never decoded (e.g. max_tokens 1)
                self._prefill_mode.popitem(last=False)
        routed_req = [self._prefill_mode[rid] is Mode.ROUTED for rid in rids]
        extend = fb.extend_seq_lens_cpu or [hidden.shape[0]]
        row_routed = torch.repeat_interleave(torch.tensor(routed_req, dtype=torch.bool),
                                             torch.tensor(list(extend), dtype=torch.int64))
        keys = torch.repeat_interleave(torch.tensor([request_key(r) for r in rids], dtype=torch.int64),
                                       torch.tensor(list(extend), dtype=torch.int64))
        return self._step("prefill", hidden, positions, row_routed.to(hidden.device), keys.to(hidden.device),
                          probe)

    def _plan_decode(self, fb: Any, hidden: torch.Tensor, positions: torch.Tensor) -> Step:
        now = time.time()
        rids = list(fb.rids or [])
        present = set(rids)
        for rid in [r for r in self._decoding if r not in present]:
            self._end(rid)
        seq_lens = fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens
        resident = int(seq_lens.sum())
        self.switch.observe(resident, now)
        for rid in rids:
            if rid not in self._decoding:
                mode = self.switch.start_decode(rid)
                self._decoding.add(rid)
                self._prefill_mode.pop(rid, None)
                self.counters.requests["decode"][mode.value] += 1
        if self.prometheus is not None:
            self.prometheus.resident.set(resident)
        row_routed = torch.tensor([self.switch.decode_mode(r) is Mode.ROUTED for r in rids], dtype=torch.bool)
        keys = torch.tensor([request_key(r) for r in rids], dtype=torch.int64)
        return self._step("decode", hidden, positions, row_routed.to(hidden.device), keys.to(hidden.device), False)

    def _end(self, rid: str) -> None:
        self.switch.finish(rid)
        self._decoding.discard(rid)

    def _step(self, phase: str, hidden: torch.Tensor, positions: torch.Tensor, row_routed: torch.Tensor,
              keys: torch.Tensor, probe: bool) -> Step:
        rows = hidden.shape[0]
        if self.skipper is None or rows == 0 or not bool(row_routed.any()):
            return Step(phase, False, rows=rows)
        if self._tape is None or self._tape.capacity < rows:
            # Eager CPU execution: the tape grows to the largest pass seen and is reused after that.
            self._tape = RouteTape(max(rows, 64), self.routed_layers, hidden.dtype, hidden.device)
            self._builder = CohortBuilder(max(rows, 64), hidden.device)
        valid = torch.ones(rows, dtype=torch.bool, device=hidden.device)
        state = self.skipper.prepare_batch(BatchContext(hidden, valid, self.routed_layers, phase, keys, positions))
        dense_rows = None if bool(row_routed.all()) else ~row_routed
        return Step(phase, True, self.skipper, state, self._tape, self._builder, dense_rows, rows, probe)

    def record_layer(self, step: Step, layer_id: int, run: torch.Tensor) -> None:
        """Count one routed layer's decisions over the rows of routed-mode requests."""
        mine = run if step.dense_rows is None else run[~step.dense_rows]
        n_run = int(mine.sum())
        n_proj = int(mine.numel()) - n_run
        step.run_rows += n_run
        step.proj_rows += n_proj
        per = self.counters.rows_per_layer.setdefault(layer_id, {"run": 0, "project_only": 0})
        per["run"] += n_run
        per["project_only"] += n_proj
        self.counters.cohort_sizes[_bucket(int(run.sum()))] += 1

    def finish(self, step: Step) -> None:
        if step.phase not in ("prefill", "decode"):
            return
        mode = "routed" if step.routed else "dense"
        self.counters.passes[step.phase][mode] += 1
        self.counters.rows[step.phase]["run"] += step.run_rows
        self.counters.rows[step.phase]["project_only"] += step.proj_rows
        if step.probe and step.run_rows + step.proj_rows:
            self.switch.record_prefill_share(step.proj_rows / (step.run_rows + step.proj_rows), time.time())
        if self.prometheus is not None:
            p = self.prometheus
            p.passes.labels(step.phase, mode).inc()
            if step.run_rows:
                p.rows.labels(step.phase, "run").inc(step.run_rows)
            if step.proj_rows:
                p.rows.labels(step.phase, "project_only").inc(step.proj_rows)
            decisions = self.switch.counters.decisions
            for kind, n in decisions.items():
                if n > self._decisions_seen[kind]:
                    p.decisions.labels(kind).inc(n - self._decisions_seen[kind])
                    self._decisions_seen[kind] = n
            promoted = self.switch.counters.promoted_requests
            if promoted > self._promotions_seen:
                p.promotions.inc(promoted - self._promotions_seen)
                self._promotions_seen = promoted
        self.write_state()

    # -- attestation ----------------------------------------------------------------------------------------

    def attestation(self) -> dict[str, Any]:
        c = self.counters
        return {
            "passes_total": c.passes,
            "rows_total": c.rows,
            "rows_per_layer_total": {str(k): v for k, v in sorted(c.rows_per_layer.items())},
            "run_cohort_size_passes_total": dict(sorted(c.cohort_sizes.items())),
            "requests_total": {k: dict(v) for k, v in c.requests.items()},
            "promotions_total": self.switch.counters.promoted_requests,
            "arm": self.arm.as_dict(),
            "skipper": self.skipper.attestation() if self.skipper is not None else None,
            "switch": self.switch.attestation(),
            "thresholds": {"enter_tokens": self.spec.enter_tokens, "exit_tokens": self.spec.exit_tokens},
            "constants": constants.attestation(),
            "model": {"model_type": self.model_type, "class": self.model_class,
                      "routed_layers": list(self.routed_layers)},
            "execution": {"device": self.device, "routed_layers_backend": "torch (vskipper.mixed cohort_ffn)",
                          "attention_backend": "SGLang's (every row writes K/V; Project-Only reads are dropped)",
                          "cuda_graphs": False, "tiles": None},
            "started": self.started,
            "updated": time.time(),
        }

    def write_state(self) -> None:
        path = self.spec.state_file
        if path is None:
            return
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.attestation(), default=str))
        os.replace(tmp, path)


_RUNTIME: Runtime | None = None


def get_runtime(model_type: str, routed_layers: tuple[int, ...], model_class: str, device: str) -> Runtime:
    """The process's runtime, built from the environment on first use (in the scheduler process)."""
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = Runtime(ServeSpec.from_env(), model_type, routed_layers, model_class, device)
    return _RUNTIME
