"""The scheduler-side state of one vSkipper server: served arm, skipper, mode switch, counters.

SGLang runs the model inside its scheduler process. The model classes (`vskipper.sglang.models`) ask the
`Runtime` once per forward pass for a `Step`: which rows run routed. The runtime decides from the foundation's
`ModeSwitch`:

  prefill (SGLang's extend)  a request's prefill mode is fixed when SGLang's scheduler admits it into a round
                             (`vskipper.sglang.hooks`): before the round is formed the switch previews the mode from
                             the candidate round's prompt tokens and every waiting request's prefix lookups are keyed
                             by it (`extra_key` namespace `vsk:dense` / `vsk:routed`); once formed, the round is
                             committed with that mode. A chunked prompt keeps it.
  decode                     the switch observes V = the running batch's resident KV tokens (the sum of its
                             sequence lengths, host-side), then fixes the decode mode of the requests that start
                             decoding; promotion is one-way. A request that leaves the decode batch has finished.
  prefix cache               a prompt reuses only KV computed under its own prefill mode (the namespaces above),
                             and a request whose decode ran in another mode than its prefill (or was promoted)
                             inserts only its prompt's KV, never its generated KV (`kv_insert_limit`).

Counters are cumulative and monotonic. The runtime writes its attestation (the served design and the counters) to
a JSON state file that the HTTP process serves at `/vskipper/attestation`, and, when SGLang runs with
`--enable-metrics`, moves Prometheus counters in the multiprocess directory SGLang's `/metrics` reads. In a server
the state file is written off the forward path (`StateWriter`): when the HTTP process asks for it (each read of
the attestation) and at most every `STATE_INTERVAL_S` otherwise; a pass only marks the state changed. A runtime
without a writer (tests, tools) writes after every pass.

The launcher passes the served configuration through the environment (the scheduler is a spawned process).
Under tensor and data parallelism every scheduler process builds a runtime; `vskipper.sglang.replicas` says which
of them report, and how the HTTP process merges the replicas' state files. Pipeline parallelism is refused for
routed arms.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
import zlib
from bisect import bisect_left
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import torch

from vskipper import constants
from vskipper.mixed.cohorts import CohortBuilder
from vskipper.mixed.deferred import DeferredReads
from vskipper.mixed.plan_buffers import expand_rows
from vskipper.mixed.tape import RouteTape, tape_capacity
from vskipper.sglang import active, compile_watch, executed, stand_in_ops
from vskipper.sglang import threads as thread_table
from vskipper.sglang.admission import AdmissionLimits, is_health_check, prompt_tokens
from vskipper.sglang.part_times import CONTROL_PHASES
from vskipper.sglang.replicas import ENV_RUN_ID, Placement, read_state_request
from vskipper.sglang.spec import ENV_INTERLEAVE_CONTROL, ServeConfigError, ServeSpec, check_arm_for_model
from vskipper.skippers.base import BatchContext, Skipper
from vskipper.skippers.registry import SkipperConfigError, build_skipper
from vskipper.switch import Mode, ModeSwitch, Policy, PrefillDecision

COHORT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
FOLD_PASSES = 64  # routed passes whose counts wait on the host, at most, before a pass counts them
STATE_INTERVAL_S = 0.5  # the longest a changed state waits for its write when nobody asks for it
STATE_POLL_S = 0.01  # how often the writer looks for a request from the HTTP process


NAMESPACE_PREFIX = "vsk:"
# Records leave with their requests (`release`, `abort_queued`); this bound only guards against a release path
# SGLang adds later: past it the oldest record is forgotten, in O(1).
MAX_TRACKED_REQUESTS = 65536


def machine_identity(device: str | None) -> dict[str, str | None]:
    """Which machine serves: its host name and, on CUDA, the device's name and UUID. The UUID names one physical
    GPU, so cells served by two starts on two machines of one kind tell apart by it; host names may not (two
    machines may share one)."""
    out: dict[str, str | None] = {"host": platform.node() or None, "device_name": None, "device_uuid": None}
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        out["device_name"] = props.name
        out["device_uuid"] = str(getattr(props, "uuid", "") or "") or None
    return out


@lru_cache(maxsize=MAX_TRACKED_REQUESTS)
def request_key(rid: str) -> int:
    """A stable int64 key per request id (RandomSkip hashes it with the position); cached, as every pass of a
    request asks for it again."""
    return zlib.crc32(str(rid).encode())


def namespaced_extra_key(mode: Mode, base: str | None) -> str:
    """The radix-cache key namespace of a request prefilled in `mode` (SGLang reads a LoRA id from the key's
    last characters, so the request's own key stays at the end)."""
    return f"{NAMESPACE_PREFIX}{mode.value}" + (f"|{base}" if base else "")


@dataclass
class RequestRecord:
    """One admitted request: its prefill mode, and once it decodes, its decode mode and promotion.

    A retracted request keeps its record (it is counted once); its re-admission prefills its prompt plus the
    output it carried back, in the mode of that round, and `prefilled_tokens` moves to that boundary."""

    prefill_mode: Mode
    prefilled_tokens: int  # tokens its (latest) admission prefilled in `prefill_mode`
    probe: bool = False  # its admission round is a share probe (reported after its first pass)
    decode_mode: Mode | None = None
    promoted: bool = False
    retracted: bool = False  # back in SGLang's waiting queue, to be admitted again
    decoded: bool = False  # counted in requests_total["decode"] (once per request)

    def generated_kv_reusable(self) -> bool:
        return self.decode_mode is self.prefill_mode and not self.promoted


@dataclass
class Step:
    """What one forward pass runs: phase, per-row routed flags, the skipper's per-pass state and the tape.

    Everything here is fixed on the host before the forward; the routed layers read nothing back. The pass's
    routed decisions are read from the tape after the forward, without waiting for the device (`Runtime.finish`)."""

    phase: str  # "prefill" | "decode"
    routed: bool  # any row runs the routed layers through the tape
    skipper: Skipper | None = None
    state: Any = None
    tape: RouteTape | None = None
    builder: CohortBuilder | None = None
    # bool [rows]: rows of dense-mode requests (RUN, unit weight). `keys` and `dense_rows` are decided on the
    # host; the model writes them into its plan buffers and the step then reads their views on the device.
    dense_rows: torch.Tensor | None = None
    rows: int = 0
    probe: bool = False
    dense_count: int = 0  # rows of dense-mode requests (host)
    health_check: bool = False  # every row belongs to /health_generate's probe: not counted as traffic
    keys: torch.Tensor | None = None  # int64 [rows]: each row's request key (RandomSkip hashes it)
    control: bool = False  # an interleaved control pass: every row RUN through the routed layers (`ServeSpec`)
    context: int | None = None  # decode: the longest request's tokens, read on the host once (the read's bound)
    # a routed prefill pass where the server asks for prefill graphs: how its routed layers ran
    # (`vskipper.metrics_names.PREFILL_LAYER_RUNS`, set by `vskipper.sglang.prefill_graphs.PrefillGraphs`)
    prefill_layers: str | None = None


class PassRoutes(NamedTuple):
    """What counting a routed pass's decisions needs besides its tape's counts, kept while they are read (a
    tuple: built at every routed pass, a third of a frozen dataclass's cost)."""

    phase: str
    layers: tuple[int, ...]  # the tape's routed layers, in the order of its counts
    rows: int
    dense_count: int
    probe: bool
    finished: float  # time.time() after the forward
    on_tape: bool = False  # read from the tape's `counts` (n_run, n_proj per layer), not its RUN rows per layer


@dataclass
class Counters:
    passes: dict = field(default_factory=lambda: {p: {"dense": 0, "routed": 0} for p in ("prefill", "decode")})
    rows: dict = field(default_factory=lambda: {p: {"run": 0, "project_only": 0} for p in ("prefill", "decode")})
    rows_per_layer: dict = field(default_factory=dict)  # layer -> {"run": n, "project_only": n}
    cohort_sizes: Counter = field(default_factory=Counter)  # bucket upper bound of the RUN cohort -> passes
    requests: dict = field(default_factory=lambda: {"prefill": Counter(), "decode": Counter()})
    unkeyed_admissions: int = 0  # requests admitted without a prefill-mode namespace (not through the hook)
    withheld_generated_kv_tokens: int = 0  # generated tokens whose KV was kept out of the prefix cache
    retractions: int = 0  # requests SGLang retracted (each is re-admitted later, and counted once above)
    # Admission rounds whose previewed mode differed from the rule on the round SGLang admitted: re-keyed to the
    # admitted round's mode (no admitted request reused prefix KV yet), or bound to the previewed mode by reuse.
    admission_rounds: Counter = field(default_factory=Counter)  # "previewed" | "rekeyed" | "bound"
    health_check_passes: Counter = field(default_factory=Counter)  # phase -> passes of health probes alone


# The RUN cohort size histogram's buckets (a pass-layer lands in the first whose bound it does not exceed).
COHORT_LABELS = (*(f"le_{b}" for b in COHORT_BUCKETS), f"gt_{COHORT_BUCKETS[-1]}")


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
        self.prefill_floor = gauge(m.PREFILL_FLOOR_TOKENS)
        self.routed_prefill = counter(m.ROUTED_PREFILL_PASSES)
        self._children: dict = {}

    def child(self, metric, *labels):
        """A labelled child, looked up once (`labels()` takes a lock and builds a key on every call)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child


class Runtime:
    def __init__(self, spec: ServeSpec, model_type: str, routed_layers: tuple[int, ...], model_class: str,
                 device: str = "cpu", placement: Placement | None = None) -> None:
        arm = spec.arm
        check_arm_for_model(arm, model_type)
        if arm.skipper is not None and not routed_layers:
            raise ServeConfigError(f"arm {arm.name!r} routes but the checkpoint has no 'routing_layers'")
        placement = placement or Placement()
        if arm.skipper is not None and placement.pp_size > 1:
            raise ServeConfigError(f"arm {arm.name!r} routes, and routed layers do not run under pipeline "
                                   f"parallelism (--pp-size {placement.pp_size}): serve it with --pp-size 1")
        if spec.interleave_control and arm.skipper is None:
            raise ServeConfigError(f"{ENV_INTERLEAVE_CONTROL}=1 interleaves a routed arm's passes with all-RUN "
                                   f"ones, and arm {arm.name!r} does not route")
        # Per phase: whether its next routed pass is an interleaved control pass.
        self._control_next = dict.fromkeys(CONTROL_PHASES, False)
        self.placement = placement
        self.spec = spec
        self.arm = arm
        self.model_type = model_type
        self.model_class = model_class
        self.routed_layers = tuple(routed_layers)
        self.device = device
        try:
            self.skipper = build_skipper(arm.skipper, arm.params) if arm.skipper else None
            # the share of routed decisions that project as this rank's routed layers carry the params out (a
            # static tail projects whole layers: 0.3 of 16 is 0.25), which the switch's prefill rule reads
            self.served_skip_ratio = arm.declared_skip_ratio(len(self.routed_layers) if arm.skipper else None)
        except SkipperConfigError as exc:
            raise ServeConfigError(str(exc)) from None
        self.switch = ModeSwitch(arm.switch_settings(), spec.enter_tokens, spec.exit_tokens,
                                 constants=spec.switch_constants(), declared_project_share=self.served_skip_ratio)
        self.counters = Counters()
        self._requests: OrderedDict[str, RequestRecord] = OrderedDict()
        self._candidates: PrefillDecision | None = None
        self._decoding: dict[str, int] = {}  # decoding request -> its resident KV tokens at its last decode pass
        # The last decode pass's request ids and their per-row routed flags and keys (host tensors): the next pass
        # of the same requests, with no promotion and no request ended in between, reuses them.
        self._decode_rows: tuple[list, torch.Tensor, torch.Tensor, int] | None = None
        self._dense_of: tuple[torch.Tensor, torch.Tensor] | None = None  # (row_routed, its dense-mode rows)
        self._tape: RouteTape | None = None
        self._builder: CohortBuilder | None = None
        # Decode passes a captured graph replays: a tape and cohort builder that never reallocate.
        self._graph_tape: RouteTape | None = None
        self._graph_rows = 0  # the largest batch a captured routed graph replays (`reserve_graph_tape`)
        self._graph_builder: CohortBuilder | None = None
        self._route_reads = DeferredReads()  # routed passes' tape counts on their way to the host
        self._arrived: list[tuple[list[int], PassRoutes]] = []  # counts on the host, not yet counted
        self._decisions_seen = Counter()
        self._promotions_seen = 0
        self.started = time.time()
        self.machine = machine_identity(device)
        compile_watch.install()  # a kernel compiled while serving stalls the passes behind it: counted
        self.hooks_applied = False  # set by the model class once it checked vskipper.sglang.hooks
        self.state_request = 0  # the latest read request of the HTTP process the state file answers
        self._state_lock = threading.RLock()  # the state document reads the attestation under it
        self._capture_free = threading.Lock()  # held through a CUDA graph capture (`capturing_graphs`)
        self._writer: StateWriter | None = None
        self.execution: dict[str, Any] = {}  # what the model class reports of its routed execution
        # The model class's own `*_total` counters (live dicts with fixed keys), beside the runtime's.
        self.model_counters: dict[str, Any] = {}
        self.part_clock = None  # the model's clock where a measurement mode asks for one (`part_times.PartClock`)
        self.prometheus = _Prometheus() if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and placement.reports \
            else None
        if self.prometheus is not None and arm.switch_settings().decode is Policy.HYBRID:
            # Exported only while decode is switched, so no alert compares V with a threshold nobody uses.
            self.prometheus.threshold.labels("enter").set(spec.enter_tokens)
            self.prometheus.threshold.labels("exit").set(spec.exit_tokens)
        if self.prometheus is not None and arm.switch_settings().prefill is Policy.HYBRID:
            self.prometheus.prefill_floor.set(spec.switch_constants().prefill_min_prompt_tokens)
        if self.prometheus is not None and "prefill" in arm.routed_phases:
            # every series from the start (at 0), so that a share of them reads 0, not nothing, before a pass
            from vskipper.metrics_names import PREFILL_LAYER_RUNS

            for how in PREFILL_LAYER_RUNS:
                self.prometheus.child(self.prometheus.routed_prefill, how)
        self.write_state()

    # -- per pass -------------------------------------------------------------------------------------------

    def plan(self, forward_batch: Any, hidden: torch.Tensor, positions: torch.Tensor) -> Step:
        """Decide this pass's rows and prepare the skipper's state (`decide`, then `prepare_state`), the per-row
        plan on the hidden states' device (a served model writes it into its plan buffers instead)."""
        step = self.decide(forward_batch, hidden.shape[0], hidden.dtype, hidden.device)
        if step.keys is not None:
            step.keys = step.keys.to(hidden.device)
        if step.dense_rows is not None:
            step.dense_rows = step.dense_rows.to(hidden.device)
        self.prepare_state(step, hidden, positions)
        return step

    def decide(self, forward_batch: Any, rows: int, dtype: torch.dtype, device: torch.device | str) -> Step:
        """Decide this pass's rows on the host, before the forward. `forward_batch` is SGLang's ForwardBatch
        (extend or decode) of `rows` rows; the tape is kept in `dtype` on `device`."""
        mode = forward_batch.forward_mode
        if mode.is_decode():
            step = self._plan_decode(forward_batch, rows, dtype, device)
        elif mode.is_extend():
            step = self._plan_prefill(forward_batch, rows, dtype, device)
        else:
            return Step("other", False)
        rids = forward_batch.rids or ()
        step.health_check = bool(rids) and all(is_health_check(r) for r in rids)
        return step

    def prepare_state(self, step: Step, hidden: torch.Tensor, positions: torch.Tensor, fused: bool = False) -> None:
        """The skipper's per-pass state from the pass's inputs (tensor ops on the device, inside the forward);
        `fused` (the triton execution): in one launch where the skipper has a fused form
        (`vskipper.mixed.routes.fused_state`, the same state)."""
        if not step.routed:
            return
        step.tape.pad(step.rows)
        valid = torch.ones(step.rows, dtype=torch.bool, device=hidden.device)
        step.state = self.pass_state(step, hidden, positions, valid, fused)

    def pass_state(self, step: Step, hidden: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                   fused: bool = False) -> Any:
        """The skipper's per-pass state of `step`'s rows (`valid`: False for padding rows, which run every layer),
        as `prepare_state` computes it, returned rather than set."""
        batch = BatchContext(hidden, valid, self.routed_layers, step.phase, step.keys, positions)
        state = None
        if fused:
            from vskipper.mixed.routes import fused_state

            state = fused_state(self.skipper, batch)
        return self.skipper.prepare_batch(batch) if state is None else state

    # -- admission (SGLang's scheduler, through vskipper.sglang.hooks) ------------------------------------------

    def key_candidates(self, waiting: Sequence[Any], limits: AdmissionLimits) -> PrefillDecision | None:
        """Before SGLang forms an admission round from its waiting queue: preview the round's prefill mode and
        key every waiting request's prefix lookups by it.

        The candidate round is the waiting requests, in queue order, that SGLang's limits let in: the prefill
        token budget (the request that crosses it is counted whole: a chunked prompt is admitted once), the free
        KV tokens and the free request slots. `admit` then decides on the round SGLang actually formed."""
        if not waiting:
            self._candidates = None
            return None
        decision = self.switch.preview_prefill(limits.candidate_tokens(waiting))
        self._candidates = decision
        if self.skipper is not None:  # arms that never route keep SGLang's single namespace
            self._key(waiting, decision.mode)
        return decision

    @staticmethod
    def _key(reqs: Iterable[Any], mode: Mode) -> None:
        for req in reqs:
            if not hasattr(req, "vskipper_base_extra_key"):
                req.vskipper_base_extra_key = req.extra_key
            req.extra_key = namespaced_extra_key(mode, req.vskipper_base_extra_key)

    def admit(self, reqs: Iterable[Any]) -> PrefillDecision | None:
        """After SGLang formed a round: decide its prefill mode on the requests it admitted (their prompt tokens,
        a re-admitted request's carried output included).

        The previewed mode keyed their prefix lookups. Where the rule on the admitted round agrees, that is the
        decision. Where it does not and no admitted request reused prefix KV, the requests are re-keyed to the
        admitted round's mode (nothing of the previewed namespace is in their KV rows yet). Where one did reuse
        prefix KV of the previewed mode, the round is bound to that mode: its KV must extend that namespace."""
        new = [r for r in reqs if r.rid not in self._requests or self._requests[r.rid].retracted]
        if not new:
            return None
        if self._candidates is None:
            raise RuntimeError("vSkipper: an admission round was formed without a preview of its prefill mode")
        preview, self._candidates = self._candidates, None
        if all(is_health_check(r.rid) for r in new):  # /health_generate's probe: dense, and no decision
            decision = PrefillDecision(Mode.DENSE, False, "health check")
        else:
            total = sum(prompt_tokens(r) for r in new)
            rule = self.switch.preview_prefill(total)
            if rule.mode is preview.mode:
                outcome, bound = "previewed", None
            elif self.skipper is not None and any(len(getattr(r, "prefix_indices", ()) or ()) for r in new):
                outcome, bound = "bound", preview.mode
            else:
                outcome, bound = "rekeyed", None
            decision = self.switch.admit_prefill(total, time.time(), bound=bound)
            self.counters.admission_rounds[outcome] += 1
        if self.skipper is not None and decision.mode is not preview.mode:
            self._key(new, decision.mode)
        self._record_admission([(r.rid, prompt_tokens(r)) for r in new], decision, keyed=self.skipper is not None)
        return decision

    def _record_admission(self, admitted: list[tuple[str, int]], decision: PrefillDecision, keyed: bool) -> None:
        """Record (request id, tokens its admission prefills) of one round decided `decision`."""
        for rid, prefilled in admitted:
            record = self._requests.get(rid)
            if record is not None:  # a retracted request, admitted again: counted once
                record.prefill_mode, record.prefilled_tokens, record.probe = decision.mode, prefilled, decision.probe
                record.decode_mode, record.promoted, record.retracted = None, False, False
                continue
            self._requests[rid] = RequestRecord(decision.mode, prefilled, decision.probe)
            if is_health_check(rid):
                continue
            self.counters.requests["prefill"][decision.mode.value] += 1
            if not keyed and self.skipper is not None:
                self.counters.unkeyed_admissions += 1
        while len(self._requests) > MAX_TRACKED_REQUESTS:
            rid, _ = self._requests.popitem(last=False)
            self._end(rid)

    def kv_insert_limit(self, rid: str, up_to: int, protected: int) -> int:
        """How much of a released request's KV row the prefix cache may keep: all of it when the request decoded
        in its prefill mode, else what its admission prefilled (its prompt, plus the output a retraction carried
        back), never less than the `protected` prefix the cache already owns for the request (SGLang frees the
        row from the limit on: a limit below what the tree holds would free slots the tree still references)."""
        record = self._requests.get(rid)
        if record is None or record.decode_mode is None or record.generated_kv_reusable():
            return up_to
        limit = min(up_to, max(record.prefilled_tokens, protected))
        self.counters.withheld_generated_kv_tokens += up_to - limit
        return limit

    def release(self, rid: str, finished: bool) -> None:
        """SGLang released a request's KV row: it finished (or was aborted) and its record goes, or it was
        retracted and waits to be admitted again under the same record."""
        record = self._requests.get(rid)
        if record is None:
            return
        self._end(rid)
        if finished:
            del self._requests[rid]
        elif not record.retracted:
            record.retracted = True
            self.counters.retractions += 1
        self._publish_resident()
        self.state_changed()

    def abort_queued(self, rid: str) -> None:
        """A request left SGLang's waiting queue aborted (a retracted one has a record; a new one has none)."""
        if self._requests.pop(rid, None) is not None:
            self._end(rid)
            self.state_changed()

    # -- per pass -------------------------------------------------------------------------------------------

    def _plan_prefill(self, fb: Any, rows: int, dtype: torch.dtype, device: torch.device | str) -> Step:
        rids = list(fb.rids or [])
        seq_lens = (fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens).tolist()
        unadmitted = [i for i, rid in enumerate(rids) if rid not in self._requests]
        if unadmitted:  # admitted outside the scheduler hook (no namespace): decided here, counted as unkeyed
            decision = self.switch.admit_prefill(sum(seq_lens[i] for i in unadmitted), time.time())
            self._record_admission([(rids[i], seq_lens[i]) for i in unadmitted], decision, keyed=False)
        records = [self._requests[rid] for rid in rids]
        probe = any(r.probe for r in records)
        for r in records:
            r.probe = False
        if self.skipper is None:
            return Step("prefill", False, rows=rows)
        routed_req = [r.prefill_mode is Mode.ROUTED for r in records]
        extend_rows = list(fb.extend_seq_lens_cpu or [rows])
        n_routed = sum(n for n, routed in zip(extend_rows, routed_req, strict=True) if routed)
        if n_routed == 0:
            return self._step("prefill", rows, dtype, device, None, None, probe, 0)
        keys = expand_rows(np.fromiter(map(request_key, rids), np.int64, len(rids)), extend_rows, rows)
        # every row routed (a routed arm's usual round): no per-row flags
        row_routed = None if n_routed == rows else expand_rows(np.array(routed_req, dtype=bool), extend_rows, rows)
        return self._step("prefill", rows, dtype, device, row_routed, keys, probe, n_routed)

    def _plan_decode(self, fb: Any, rows: int, dtype: torch.dtype, device: torch.device | str) -> Step:
        now = time.time()
        rids = list(fb.rids or [])
        last = self._decode_rows
        same = last is not None and last[0] == rids  # the last decode pass's requests, none ended since
        if not same:
            present = set(rids)
            for rid in [r for r in self._decoding if r not in present]:  # left the batch (its release ends it too)
                self._end(rid)
        seq_lens = fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens
        lengths = seq_lens.tolist()
        resident = sum(lengths)
        promoted = self.switch.observe(resident, now)
        for rid in promoted:
            if rid in self._requests:
                self._requests[rid].promoted = True
        if same:  # every request already decoding: only their lengths move
            self._decoding.update(zip(rids, lengths, strict=True))
        else:
            for rid, length in zip(rids, lengths, strict=True):
                if rid not in self._decoding:
                    mode = self.switch.start_decode(rid)
                    record = self._requests.get(rid)
                    if record is None:  # admitted before this runtime tracked it: nothing known of its prefill
                        record = self._requests[rid] = RequestRecord(mode, length)
                    record.decode_mode = mode
                    if not record.decoded and not is_health_check(rid):
                        record.decoded = True
                        self.counters.requests["decode"][mode.value] += 1
                self._decoding[rid] = length
        self._publish_resident(resident)  # the decoding requests are this batch's now
        if self.skipper is None:
            self._decode_rows = (rids, None, None, 0)
            return Step("decode", False, rows=rows)
        if not same or promoted:
            routed = [self.switch.decode_mode(r) is Mode.ROUTED for r in rids]
            last = self._decode_rows = (rids, torch.tensor(routed, dtype=torch.bool),
                                        torch.tensor(list(map(request_key, rids)), dtype=torch.int64), sum(routed))
        _, row_routed, keys, n_routed = last
        step = self._step("decode", rows, dtype, device, row_routed, keys, False, n_routed)
        step.context = max(lengths, default=0)
        return step

    def _dense_rows(self, row_routed: torch.Tensor) -> torch.Tensor:
        """The dense-mode rows, ~row_routed: the same tensor while `row_routed` is (a decode batch's requests
        unchanged), which the plan buffers take as an unchanged plan."""
        if self._dense_of is None or self._dense_of[0] is not row_routed:
            self._dense_of = (row_routed, ~row_routed)
        return self._dense_of[1]

    def _end(self, rid: str) -> None:
        """The request stopped decoding (it left the batch: finished, aborted or retracted)."""
        self.switch.finish(rid)
        self._decoding.pop(rid, None)
        self._decode_rows = None

    def resident_tokens(self) -> int:
        """The KV tokens of the requests decoding now (as of their last decode pass, less those that left)."""
        return sum(self._decoding.values())

    def _publish_resident(self, resident: int | None = None) -> None:
        if self.prometheus is not None:
            self.prometheus.resident.set(self.resident_tokens() if resident is None else resident)

    def _step(self, phase: str, rows: int, dtype: torch.dtype, device: torch.device | str,
              row_routed: torch.Tensor | None, keys: torch.Tensor | None, probe: bool,
              n_routed: int | None = None) -> Step:
        """`row_routed` and `keys` are host tensors (built from the request records; `n_routed` their routed
        rows, where known; `row_routed` None: every row routed, or none where `n_routed` is 0): the decisions
        made on them here read no device value, and the step keeps its keys and dense-mode rows on the host for
        the model's plan buffers (`Runtime.plan`: on the device)."""
        n_routed = int(row_routed.sum()) if n_routed is None else n_routed
        if self.skipper is None or rows == 0 or n_routed == 0:
            return Step(phase, False, rows=rows)
        if phase == "decode" and self._graph_tape is not None and rows <= self._graph_rows:
            tape, builder = self._graph_tape, self._graph_builder  # a captured routed graph may replay it
        else:
            if self._tape is None or self._tape.capacity < rows:
                # Eager execution: the tape grows to the largest pass seen and is reused after that (its rows
                # aligned: `tape_capacity`, as the graph tape's, which holds the largest captured batch).
                capacity = tape_capacity(rows)
                self._tape = RouteTape(capacity, self.routed_layers, dtype, device)
                self._builder = CohortBuilder(capacity, device)
            tape, builder = self._tape, self._builder
        control = False
        # A probe pass keeps the skipper's routes (its share is what it measures), and the alternation skips it.
        if self.spec.interleave_control and phase in self._control_next and not probe:
            control = self._control_next[phase]
            self._control_next[phase] = not control
            if control:  # every row RUN, as a dense-mode row: the s = 0 control's work through the routed layers
                n_routed, row_routed = 0, torch.zeros(rows, dtype=torch.bool)
        dense_rows = None if n_routed == rows else self._dense_rows(row_routed)
        return Step(phase, True, self.skipper, None, tape, builder, dense_rows, rows, probe,
                    rows - n_routed, keys=keys, control=control)

    def reserve_graph_tape(self, capacity: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """Static storage for decode passes of up to `capacity` rows, which captured routed graphs replay: their
        tape and cohort maps live at fixed addresses from now on. Their storage is `tape_capacity(capacity)` rows:
        each layer's row of the tape starts 16-byte aligned, as the kernels reading and writing it are compiled
        to expect (the maps' launch records the routes there)."""
        self._graph_rows = capacity
        self._graph_tape = RouteTape(tape_capacity(capacity), self.routed_layers, dtype, device)
        self._graph_builder = CohortBuilder(tape_capacity(capacity), device)

    def on_graph_tape(self, step: Step) -> bool:
        """Whether the pass records its routes on the graph tape (a captured routed graph may replay it)."""
        return step.tape is not None and step.tape is self._graph_tape

    def capture_step(self, rows: int, dense_rows: torch.Tensor, keys: torch.Tensor) -> Step:
        """The routed decode step a graph of `rows` rows is captured from: the graph tape, and every row's
        dense-mode flag and request key read from `dense_rows` and `keys` (views of static buffers a replayed
        pass writes first). Never counted."""
        if self.skipper is None or self._graph_tape is None or rows > self._graph_rows:
            raise RuntimeError(f"no graph tape holds a routed decode graph of {rows} rows")
        return Step("decode", True, self.skipper, None, self._graph_tape, self._graph_builder, dense_rows, rows,
                    keys=keys)

    def finish(self, step: Step, on_tape: bool = False) -> None:
        """Count a pass after its forward. A routed pass's decisions are read from its tape without waiting for
        the device (`DeferredReads`), and counted with the others that reached the host when the attestation is
        read (a server's state writer reads it at most `STATE_INTERVAL_S` after a change), or once `FOLD_PASSES`
        wait, in order (a probe round's share is read at once: the switch needs it now; `_settle`). Without a
        state writer the counters and Prometheus' rows lag until one of those. `on_tape`: the routed layers'
        cohort maps wrote each layer's counts into the tape (the triton execution's do), and the pass is read
        from them with no launch of its own; otherwise its run mask is reduced (`RouteTape.run_counts`)."""
        if step.phase not in ("prefill", "decode"):
            return
        if step.health_check:
            self.counters.health_check_passes[step.phase] += 1
            self.state_changed()
            return
        mode = "routed" if step.routed else "dense"
        with self._state_lock:
            self.counters.passes[step.phase][mode] += 1
            if step.routed:
                tape = step.tape
                routes = PassRoutes(step.phase, tape.routed_layers, step.rows, step.dense_count, step.probe,
                                    time.time(), on_tape)
                self._route_reads.push(tape.counts if on_tape else tape.run_counts(step.rows), routes)
            self._settle(block=step.probe)
        if self.prometheus is not None:
            p = self.prometheus
            p.child(p.passes, step.phase, mode).inc()
            if step.routed and step.phase == "prefill":
                p.child(p.routed_prefill, step.prefill_layers or "eager_not_asked").inc()
            decisions = self.switch.counters.decisions
            for kind, n in decisions.items():
                if n > self._decisions_seen[kind]:
                    p.child(p.decisions, kind).inc(n - self._decisions_seen[kind])
                    self._decisions_seen[kind] = n
            promoted = self.switch.counters.promoted_requests
            if promoted > self._promotions_seen:
                p.promotions.inc(promoted - self._promotions_seen)
                self._promotions_seen = promoted
        self.state_changed()

    def _settle(self, block: bool, count: bool = False) -> None:
        """Take the routed passes' counts that reached the host (with `block`: every one, waiting for them). They
        are counted together (`_count_arrived`) when the attestation is read (`count`: in a server, the state
        writer's thread, off the forward path), at a probe pass (`block`: the switch needs its share now), or
        once `FOLD_PASSES` wait."""
        self._arrived.extend(self._route_reads.ready(block))
        if block or count or len(self._arrived) >= FOLD_PASSES:
            self._count_arrived()

    def _count_arrived(self) -> None:
        """Count the decisions of every routed pass whose tape counts reached the host, in one go: sums and a
        tally over all of them at once, not a Python step per pass and layer. Per routed layer its Project-Only
        rows (the pass's rows less the tape's RUN rows) and its RUN rows of routed-mode requests (dense-mode rows
        are RUN on the tape and not counted), each pass-layer's RUN cohort size in `COHORT_BUCKETS`, and per
        phase the rows; a probe pass's Project-Only share goes to the switch, in the order the passes ran."""
        arrived, self._arrived = self._arrived, []
        groups: dict[tuple[str, tuple[int, ...]], list[tuple[list[int], PassRoutes]]] = {}
        for counts, routes in arrived:
            # the tape's (n_run, n_proj) pairs: the pass's RUN rows are its rows less the Project-Only ones
            run = [routes.rows - n for n in counts[1::2]] if routes.on_tape else counts
            groups.setdefault((routes.phase, routes.layers), []).append((run, routes))
            if routes.probe:
                n_run = sum(run)
                routed_rows = (routes.rows - routes.dense_count) * len(run)  # RUN and Project-Only, every layer
                if routed_rows:
                    self.switch.record_prefill_share((routes.rows * len(run) - n_run) / routed_rows, routes.finished)
        for (phase, layers), passes in groups.items():
            runs = [run for run, _ in passes]  # each pass's RUN rows per layer on its tape
            rows = sum(routes.rows for _, routes in passes)
            dense = sum(routes.dense_count for _, routes in passes)
            per_layer = list(map(sum, zip(*runs, strict=True)))
            for layer, n_run in zip(layers, per_layer, strict=True):
                per = self.counters.rows_per_layer.setdefault(layer, {"run": 0, "project_only": 0})
                per["run"] += n_run - dense
                per["project_only"] += rows - n_run
            for size, n in Counter(chain.from_iterable(runs)).items():  # the pass-layers of each cohort size
                self.counters.cohort_sizes[COHORT_LABELS[bisect_left(COHORT_BUCKETS, size)]] += n
            n_run = sum(per_layer)
            run_rows, proj_rows = n_run - dense * len(layers), rows * len(layers) - n_run
            self.counters.rows[phase]["run"] += run_rows
            self.counters.rows[phase]["project_only"] += proj_rows
            if self.prometheus is not None:
                p = self.prometheus
                if run_rows:
                    p.child(p.rows, phase, "run").inc(run_rows)
                if proj_rows:
                    p.child(p.rows, phase, "project_only").inc(proj_rows)

    # -- attestation ----------------------------------------------------------------------------------------

    def attestation(self, threads: dict | None = None, allocator: dict | None = None) -> dict[str, Any]:
        """The served design and the counters, every routed pass whose counts reached the host counted (under the
        state lock: the scheduler's passes count beside it). `threads` and `allocator`: this process's threads'
        CPU and its CUDA allocator's counters, where the document answers a reader (`threads.thread_cpu`,
        `threads.allocator_counts`, read before the lock), else None."""
        with self._state_lock:
            self._settle(block=False, count=True)
        c = self.counters
        return {
            "passes_total": c.passes,
            "rows_total": c.rows,
            "rows_per_layer_total": {str(k): v for k, v in sorted(c.rows_per_layer.items())},
            "run_cohort_size_passes_total": dict(sorted(c.cohort_sizes.items())),
            "requests_total": {k: dict(v) for k, v in c.requests.items()},
            "retractions_total": c.retractions,
            "requests_tracked": len(self._requests),  # records of requests still in SGLang (queued or running)
            "resident_tokens": self.resident_tokens(),  # KV tokens of the requests decoding now
            "admission_rounds_total": dict(c.admission_rounds),
            "health_check_passes_total": dict(c.health_check_passes),
            "promotions_total": self.switch.counters.promoted_requests,
            "prefix_cache": {"keyed_by_prefill_mode": self.skipper is not None and self.hooks_applied,
                             "namespaces": [namespaced_extra_key(m, None) for m in Mode] if self.skipper else [],
                             "unkeyed_admissions_total": c.unkeyed_admissions,
                             "withheld_generated_kv_tokens_total": c.withheld_generated_kv_tokens},
            "arm": self.arm.as_dict(),
            "served_skip_ratio": self.served_skip_ratio,  # the arm's declared share as the routed layers carry it
            "skipper": self.skipper.attestation() if self.skipper is not None else None,
            "switch": self.switch.attestation(),
            "thresholds": {"enter_tokens": self.spec.enter_tokens, "exit_tokens": self.spec.exit_tokens,
                           "source": self.spec.thresholds_source, **self.spec.prefill_floor()},
            "constants": constants.attestation(),
            "model": {"model_type": self.model_type, "class": self.model_class,
                      "routed_layers": list(self.routed_layers)},
            "execution": {"device": self.device,
                          "routed_layers_backend": "torch cohorts (vskipper.mixed.routed_layer over SGLang's "
                                                   "qkv_proj, o_proj and MLP)",
                          "attention_backend": "SGLang's on dense passes and all-RUN layers; on mixed routed "
                                               "layers every row's K/V through the KV pool's set_kv_buffer, then "
                                               "RUN rows alone read (vskipper.mixed.attention over SGLang's "
                                               "req_to_token)",
                          "cuda_graphs": None, "tiles": None, "profile": self.spec.profile,
                          **self.execution},
            **self.model_counters,
            "triton_compiles": compile_watch.attestation(),
            "stand_in_ops": stand_in_ops.attestation(),  # RMSNorm, SiLU-and-mul and RoPE: the paths their calls took
            **executed.attestation(),  # what SGLang executes, read after boot; the scheduler's pass counts
            "placement": {"replica": self.placement.replica, "dp_rank": self.placement.dp_rank,
                          "attn_dp_rank": self.placement.attn_dp_rank},
            "run_id": os.environ.get(ENV_RUN_ID),
            "machine": self.machine,
            "threads": threads,  # each thread's CPU so far, where a reader asked: what ran beside the forward's
            "allocator": allocator,  # the CUDA allocator's trips to the driver so far, where a reader asked
            "started": self.started,
            "updated": time.time(),
            "state_request": self.state_request,
        }

    @contextmanager
    def capturing_graphs(self) -> Iterator[None]:
        """Around a CUDA graph capture in this process (the hooks around SGLang's graph runners' captures): no state
        document is taken meanwhile, since taking one waits for and queries the device's copies and timing events,
        which CUDA refuses from any thread while SGLang captures in its global mode (`GraphCapturing`)."""
        with self._capture_free:
            yield

    def state_document(self, threads: bool = False) -> str | None:
        """The attestation as JSON, or None where this replica writes no state file; with `threads`, this
        process's threads' CPU in it (a document a reader asked for). Raises `GraphCapturing` while a graph is
        captured (the state writer takes it again after)."""
        if self.spec.state_file is None or not self.placement.reports:
            return None
        if not self._capture_free.acquire(blocking=False):
            raise GraphCapturing("a CUDA graph is being captured: the state is written once it is")
        try:
            return self._state_document(threads)
        finally:
            self._capture_free.release()

    def _state_document(self, threads: bool = False) -> str:
        # The device's copies of the passes in flight are waited for outside the lock: the forward's thread takes
        # it to count each pass (`finish`), and waiting inside it would stall that thread until the device drained,
        # its next batch unprepared. Under the lock only passes pushed since then can still wait.
        self._route_reads.wait_pushed()
        if self.part_clock is not None:  # likewise the device's end of the passes the clock timed
            self.part_clock.read_device()
        # Read outside the lock too, and only for a reader: a few milliseconds at a hundred threads, which the
        # periodic writes, made while passes run, do not spend.
        table = thread_table.thread_cpu() if threads else None
        allocator = thread_table.allocator_counts(self.device) if threads else None
        with self._state_lock:
            self._settle(block=True)
            return json.dumps(self.attestation(table, allocator), default=str)

    def write_state(self, document: str | None = None, threads: bool = False) -> None:
        """The state file, from `document` or a fresh one (`threads`: with the threads' CPU, `state_document`)."""
        document = self.state_document(threads) if document is None else document
        if document is None:
            return
        path = self.placement.state_file(self.spec.state_file)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(document)
        os.replace(tmp, path)

    def state_changed(self) -> None:
        """The counters changed: written now without a writer, by the writer otherwise (never from two threads)."""
        if self._writer is None:
            self.write_state()
        else:
            self._writer.changed()

    def start_state_writer(self) -> None:
        """Write the state file off the forward path from now on (`StateWriter`)."""
        if self._writer is None and self.spec.state_file is not None and self.placement.reports:
            self._writer = StateWriter(self)
            self._writer.start()


class StateWriter(threading.Thread):
    """Writes a runtime's state file in its own thread: at once when the HTTP process asks (a request stamp next
    to the state file, `vskipper.sglang.replicas.request_state`), else at most every `STATE_INTERVAL_S` after a
    change. The document carries the latest stamp it answers (`state_request`), which the HTTP process waits for.

    The scheduler mutates the counters while the writer reads them: `finish` and the document share a lock; a
    document that races another mutation (admission bookkeeping) raises and is simply taken again."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(name="vskipper-state-writer", daemon=True)
        self.runtime = runtime
        self._changed = threading.Event()
        self.answered = 0

    def changed(self) -> None:
        self._changed.set()

    def run(self) -> None:
        try:
            bind_device(self.runtime.device)
        except Exception as exc:  # the writer writes on (its waits on the device then go to the thread's own GPU)
            print(f"vskipper: the state writer could not take the model's device {self.runtime.device}: {exc}",
                  file=sys.stderr, flush=True)
        base = self.runtime.spec.state_file
        last = 0.0
        while True:
            time.sleep(STATE_POLL_S)
            request = read_state_request(base)
            due = self._changed.is_set() and time.monotonic() - last >= STATE_INTERVAL_S
            if request <= self.answered and not due:
                continue
            self._changed.clear()
            try:
                self.runtime.state_request = max(request, self.answered)
                self.runtime.write_state(threads=request > self.answered)  # a reader asked: what ran, too
            except RuntimeError:  # a counter changed size while it was read, or a graph is being captured: again
                # next time
                self._changed.set()
                continue
            self.answered = self.runtime.state_request
            last = time.monotonic()


class GraphCapturing(RuntimeError):
    """The state is not taken while a CUDA graph is captured (`Runtime.capturing_graphs`)."""


def bind_device(device: str | None) -> None:
    """Make the model's GPU this thread's: the state writer waits for the device's copies and timing events, and a
    thread's CUDA calls otherwise go to GPU 0 (a scheduler process serving another GPU would open a context
    there). Nothing off CUDA."""
    if device and torch.device(device).type == "cuda" and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))


def get_runtime(model_type: str, routed_layers: tuple[int, ...], model_class: str, device: str) -> Runtime:
    """The process's runtime, built from the environment on first use (in the scheduler process) and registered
    in `active`. A routed arm needs vSkipper's scheduler hooks (prefix namespaces by prefill mode), and any arm on
    the stand-in Triton ops their hooks: the server refuses to start without."""
    runtime = active.current_runtime()
    if runtime is None:
        runtime = Runtime(ServeSpec.from_env(), model_type, routed_layers, model_class, device,
                          Placement.from_sglang())
        from vskipper.sglang.hooks import check_applied

        if runtime.skipper is not None:
            check_applied()
            runtime.hooks_applied = True
            runtime.write_state()
        elif stand_in_ops.targets():  # a dense arm on the stand-in ops needs their hooks all the same
            check_applied(stand_in_ops.targets())
        runtime.start_state_writer()
        active.set_runtime(runtime)
    return runtime
