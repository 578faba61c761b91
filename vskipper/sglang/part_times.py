"""The part clock: where a served pass's time goes, measured inside the server.

With the serve spec's `part_clock` on (`VSKIPPER_PART_CLOCK=1` in the server's environment; off by default, and
then nothing is wrapped), the model's forward passes are timed part by part: each decoder layer's Q / K/V /
fused QKV projection (told apart by the weight rows they multiply), rotary embedding, K/V write, attention read
(SGLang's attention layer, and on a mixed pass the routed body's read around it: narrowing the batch to the RUN
rows is the read's), o_proj, MLP, norms and adapter, the rest of each layer (`glue`: the routed body's cohort
packing and scatter, the route and the tape), and the pass outside the layers (`outside`: embedding, final norm,
logits). Each part's time is exclusive of the parts it calls (SGLang's attention layer writes the K/V of a dense
pass inside it: that write is `kv_write`, not `read`), summed per phase and per layer kind (`routed`, `dense`),
with the passes counted, in the attestation (`part_clock`). Shared modules (SGLang caches one rotary embedding
for every layer; one KV pool) are wrapped once and charged to the layer that calls them.

It answers what a served step spends on the work a Project-Only row skips, at every row (an arm whose rows all
RUN) and at the RUN rows (a routed arm), which is the time limit of what routing can save in that server
(`benchmarks/bench_cpu.py`). Its own cost is two clock reads and some bookkeeping per wrapped call (about 2 us on
CPU, some 250 calls a pass at 16 layers): the clock counts its calls per phase (`calls_total`) and measures what one
costs the host where it is installed (`calibrate`, `call_cost_s`), so that a pass's share of its own is known.
It reads the host's clock: on CPU that is the work; on a GPU, whose kernels run asynchronously, it times their
launches: what the host spends on each part, not the device. There it also times
each pass's span on the device (CUDA events recorded before and after the forward, read once they complete, a
pass or more later, never waited for by the passes; none in a CUDA graph capture): `device_seconds_total` and
`device_passes_total` per phase. A routed pass is counted again apart (`routed_total`: its passes, tokens, host
and device seconds per phase), so that a hybrid arm's routed passes stand apart from its dense ones. The span
includes any wait of the device for the host's launches: where the host runs ahead it is the pass's device time,
and a span about as long as the pass's host time (longer by the last kernels' tail) marks a host-bound pass. The
clock's own wrapped calls add to the host's time (`calls_total` times `call_cost_s`).

Around each pass the clock also reads the kernel's account of the thread that runs the forward (`thread_usage`: its
CPU clock, how often it waited and how often it left the processor otherwise; `forward_thread` per phase, the routed
passes' in `routed_total` too), a few system calls a pass of about a microsecond each. A pass whose host time its
thread's CPU time fills computed throughout (its Python, torch's dispatch, the driver's launches, a spin on the
device); where the host time is longer, the thread waited the difference: for the interpreter's lock while another
thread of the process ran, for the device, for a lock of the driver's or the allocator's. On a host-bound GPU pass
that tells a slower issue of the same launches from a wait between them. (On a CPU torch's own threads compute
beside the forward's: its thread's CPU time there is a part of the pass's work, and its waits include theirs.)
Beside them, the seconds the interpreter's garbage collector ran during the passes (`gc_time`, from `gc.callbacks`):
a collection holds the interpreter's lock for most of its run (the finalizers it calls may let it go), whichever
thread set it off.

With `pass_spans` alone (`VSKIPPER_PASS_SPANS=1`) the clock wraps nothing: each pass's host span (its forward,
`outside`) and device span are timed whole, cheap enough to leave on beside the figures they explain (the device
run's servers: whether a pass was host-bound). A reader on another thread (the state writer) waits for the
device's end of the passes timed so far before it reads them (`read_device`): the attestation then holds the
device's span of every pass up to the last, not one pass behind. It touches no event while SGLang's decode or
prefill graph runner captures (the runtime takes no state document then: `Runtime.capturing_graphs`, from the
hooks around their captures); SGLang's metadata glue
graph, captured lazily while serving where `SGLANG_ENABLE_METADATA_GLUE_GRAPH` asks for it, is not held off
(the device run leaves it off).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

try:
    import resource
except ImportError:  # not on every platform: no thread's usage there
    resource = None

# The interleaved control passes' phases (`vskipper.sglang.spec.ENV_INTERLEAVE_CONTROL`), apart from the routed
# passes of the same phase: in the part clock, and (decode alone) in the pass clock.
CONTROL_PHASES = {"decode": "decode_control", "prefill": "prefill_control"}
CONTROL_PHASE = CONTROL_PHASES["decode"]


def clock_phase(phase: str, control: bool) -> str:
    """A pass's phase in the clocks: an interleaved control pass's is its phase's `CONTROL_PHASES` entry."""
    return CONTROL_PHASES.get(phase, phase) if control else phase


def pass_tokens(forward_batch) -> int:
    """The rows an SGLang forward batch runs: its tokens (prefill: the tokens it extends, without those a
    request took from the radix cache)."""
    ids = getattr(forward_batch, "input_ids", None)
    return int(ids.shape[0]) if ids is not None else int(forward_batch.batch_size)


# The routed passes' own totals (`routed_total`), per phase: passes, tokens, host seconds (the forward whole), the
# forward's thread's CPU seconds and waits in them (`FORWARD_THREAD_FIELDS`), device seconds over the passes the
# device's clock reached.
ROUTED_FIELDS = ("passes_total", "tokens_total", "host_seconds_total", "cpu_seconds_total", "waits_total",
                 "device_seconds_total", "device_passes_total")
# What the thread that runs the forward did during the passes (`forward_thread`), per phase: its CPU seconds (user
# and system), how often it gave up the processor to wait (for the interpreter's lock, another lock, the device, a
# sleep) and how often it left the processor otherwise (`thread_usage`: taken by the kernel for another task, or
# yielded by `sched_yield`, as a CUDA wait in yield mode does). A pass whose host seconds its CPU
# seconds fill computed all along (its Python, torch's dispatch, the driver's launches, a spin on the device); the
# rest of its host time it waited, its waits counting how often. Also the garbage collector's seconds and
# collections during them (`gc_time`: a collection holds the interpreter's lock for most of its run, and so the
# forward, whichever thread set it off).
FORWARD_THREAD_FIELDS = ("cpu_seconds_total", "waits_total", "preempted_total", "gc_seconds_total",
                         "gc_collections_total")


def thread_usage() -> tuple[float, int, int] | None:
    """(CPU seconds, voluntary context switches, involuntary ones) of the calling thread so far: its CPU clock
    (`time.thread_time`, which the kernel brings up to date for the call; `getrusage`'s CPU times are only as
    fresh as the last scheduler tick or switch, a millisecond or more behind on a thread that just woke) and the
    kernel's switch counts (`getrusage(RUSAGE_THREAD)`); None where the platform has no per-thread usage."""
    who = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None
    if who is None:
        return None
    usage = resource.getrusage(who)
    return time.thread_time(), usage.ru_nvcsw, usage.ru_nivcsw


class _Collections:
    """The interpreter's garbage collections in this process so far, from `gc.callbacks`: their seconds and how
    many. Each runs holding the interpreter's lock, one at a time."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.count += 1
            self._start = None


_collections: _Collections | None = None
_collections_lock = threading.Lock()


def gc_time() -> tuple[float, int]:
    """(seconds, collections) of the interpreter's garbage collector in this process, counted from this function's
    first call on (which installs the count into `gc.callbacks`)."""
    global _collections
    if _collections is None:
        with _collections_lock:
            if _collections is None:
                import gc

                _collections = _Collections()
                gc.callbacks.append(_collections)
    return _collections.seconds, _collections.count

PARTS = ("q", "kv", "qkv", "rope", "kv_write", "read", "o", "mlp", "ln1", "ln2", "projector", "glue")


def cuda_events() -> Callable[[], Any] | None:
    """A maker of timing events for the device's passes where CUDA runs, else None (a CPU's passes are the host's
    time)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return lambda: torch.cuda.Event(enable_timing=True)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no timing event may be recorded into it)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class PartClock:
    """Exclusive wall time per (phase, layer kind, part), summed; passes counted per phase; and where `events`
    makes timing events (CUDA: `cuda_events`), each pass's device time per phase."""

    def __init__(self, clock=time.perf_counter, events: Callable[[], Any] | None = None,
                 capturing: Callable[[], bool] = capturing, parts: bool = True,
                 usage: Callable[[], tuple[float, int, int] | None] | None = thread_usage,
                 collector: Callable[[], tuple[float, int]] | None = gc_time, samples: bool = False) -> None:
        """`parts` False: the passes' spans alone; `wrap` (and so `install`) wraps nothing. `usage`: the calling
        thread's (CPU seconds, waits, preemptions) so far (`thread_usage`), and `collector` the garbage collector's
        (seconds, collections) so far (`gc_time`), each read around each pass (`forward_thread`); None: not
        read. `samples`: the forward's Python stack sampled while a pass runs (`stack_samples`, `samples` in the
        attestation)."""
        self.clock = clock
        self.usage, self.collector = usage, collector
        self._running: tuple[int, str] | None = None  # (the forward thread's ident, its pass's phase) in a pass
        self.sampler = None
        if samples:
            from vskipper.sglang.stack_samples import StackSampler

            self.sampler = StackSampler(lambda: self._running)
            self.sampler.start()
        self.thread: dict[str, dict[str, float]] = {field: defaultdict(float if "seconds" in field else int)
                                                    for field in FORWARD_THREAD_FIELDS}
        self.events, self.capturing = events, capturing
        self.parts = parts
        self._settling = threading.RLock()  # the forward's thread and a reader's both settle (and `_lost`)
        # why the device's spans stopped, where they did (`device`, `_lost`); why the forward thread's usage did
        # (`thread`, `_no_thread`)
        self.errors: dict[str, str] = {}
        self.device_seconds: dict[str, float] = defaultdict(float)
        self.device_passes: dict[str, int] = defaultdict(int)
        self._pending: deque[tuple[str, bool, Any, Any]] = deque()  # (phase, routed, start, end): on the device
        # The routed passes' share of each total (`routed_total`): a hybrid arm's passes run routed or dense, each
        # kind at its own cost; the dense passes' are the totals less these.
        self.routed: dict[str, dict[str, float]] = {field: defaultdict(float if "seconds" in field else int)
                                                     for field in ROUTED_FIELDS}
        self.phase = "other"
        self.where = "outside"  # the layer kind running now ('routed', 'dense'), 'outside' between layers
        self.seconds: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(
            lambda: defaultdict(float)))
        self.passes: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)  # the rows the passes of each phase ran (prefill: tokens)
        self._children: list[float] = []  # time of timed calls nested in each open call
        self._wrapped: set[tuple[int, str]] = set()
        self.calls: dict[str, int] = defaultdict(int)  # the wrapped calls the passes of each phase made
        self.call_cost_s: float | None = None  # the clock's own host time a wrapped call (`calibrate`)

    def timed(self, fn, part, where: str | None = None):
        """`fn`, timed as `part` (a name, or a function of fn's arguments that returns one) of the layer kind
        `where` (None: the layer running when it is called; a layer sets it for what it calls)."""

        def call(*args, **kwargs):
            outer = self.where
            if where is not None:
                self.where = where
            self._children.append(0.0)
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = self.clock() - t0
                self.calls[self.phase] += 1
                nested = self._children.pop()
                name = part(*args, **kwargs) if callable(part) else part
                self.seconds[self.phase][self.where][name] += dt - nested
                self.where = outer
                if self._children:
                    self._children[-1] += dt

        return call

    def wrap(self, obj: Any, attr: str, part, where: str | None = None) -> None:
        """Replace `obj.attr` by its timed call, once per object and attribute (a clock of spans alone: never)."""
        key = (id(obj), attr)  # the objects wrapped (layers, modules, the pool) live as long as the process
        if not self.parts or key in self._wrapped:
            return
        self._wrapped.add(key)
        setattr(obj, attr, self.timed(getattr(obj, attr), part, where))

    def calibrate(self, calls: int = 2000, rounds: int = 5) -> float:
        """The clock's own host time a wrapped call (`call_cost_s`): a call timed through a scratch clock of this
        one's kind, nested in another as a layer's parts are, less the same call unwrapped: the least of `rounds`
        rounds of `calls` of each, so that a round another thread held up counts on neither side. A floor: in a pass the clock's code may run with its data out of the processor's caches,
        and a part named by a function of the call's arguments (the fused QKV projection's) costs a few
        microseconds more. A pass's `calls` times it is the least the clock adds to its host time by its own
        Python; a difference between a timed and an untimed pass many times that is not the clock's code."""
        scratch = PartClock(self.clock, usage=None, collector=None)

        def work() -> None:
            return None

        timed = scratch.timed(work, "glue", "routed")
        outer = scratch.timed(lambda: [timed() for _ in range(calls)], "glue", "routed")
        wrapped = plain = float("inf")
        for _ in range(rounds):
            t0 = self.clock()
            outer()
            wrapped = min(wrapped, self.clock() - t0)
            t0 = self.clock()
            [work() for _ in range(calls)]  # noqa: B018 -- the same loop, unwrapped
            plain = min(plain, self.clock() - t0)
        self.call_cost_s = max(0.0, (wrapped - plain) / calls)
        return self.call_cost_s

    def install(self, layers, routed: tuple[int, ...]) -> None:
        """Wrap the parts of SGLang decoder layers (Llama, Qwen3; `layers`: (layer id, layer)), and measure what a
        wrapped call costs the host (`calibrate`). The KV pool's write is wrapped once the pool exists (`wrap`, from
        the hook around the runner's forward)."""
        self.calibrate()
        for i, layer in layers:
            attn = layer.self_attn
            self.wrap(layer, "forward", "glue", "routed" if i in routed else "dense")
            weight = attn.qkv_proj.weight
            rows = {(weight.data_ptr(), attn.q_size): "q",
                    (weight[attn.q_size:].data_ptr(), 2 * attn.kv_size): "kv",
                    (weight.data_ptr(), weight.shape[0]): "qkv"}
            self.wrap(attn.qkv_proj.quant_method, "apply",
                      lambda module, *args, _rows=rows, **kwargs: _rows.get(
                          (module.weight.data_ptr(), module.weight.shape[0]), "glue"))
            self.wrap(attn.rotary_emb, "forward", "rope")
            self.wrap(attn.attn, "forward", "read")
            self.wrap(attn.o_proj, "forward", "o")
            self.wrap(layer.mlp, "forward", "mlp")
            self.wrap(layer.input_layernorm, "forward", "ln1")
            self.wrap(layer.post_attention_layernorm, "forward", "ln2")
            if hasattr(layer, "router_proj"):
                self.wrap(layer.router_proj, "forward", "projector")

    def around_pass(self, forward_mode, run, control: bool = False, tokens: int = 0, routed: bool = False):
        """Time one forward pass (`run()`) of SGLang's batch mode `forward_mode` over `tokens` rows; what its
        layers do not take is `outside`. An interleaved control pass is a phase of its own (`CONTROL_PHASES`). A
        `routed` pass is counted in `routed_total` too."""
        self.phase = clock_phase("decode" if forward_mode.is_decode() else "prefill" if forward_mode.is_extend()
                                 else "other", control)
        marks, events = None, self.events  # no event is recorded or queried in a capture
        if events is not None and not self.capturing():
            try:
                marks = (events(), events())
                marks[0].record()
            except Exception as exc:  # the clock's failure never fails the pass
                marks = self._lost(exc)
        thread = self._thread_now()
        self._running = (threading.get_ident(), self.phase)
        if self.sampler is not None:
            self.sampler.begin()
        t0 = self.clock()
        try:
            return self.timed(run, "outside", "outside")()
        finally:
            host = self.clock() - t0
            self._running = None
            if self.sampler is not None:
                self.sampler.end()
            self._count_thread(thread, routed)
            if marks is not None:
                try:
                    marks[1].record()
                except Exception as exc:
                    self._lost(exc)
                else:
                    with self._settling:
                        if self.events is not None:  # not lost meanwhile (by the reader's thread)
                            self._pending.append((self.phase, routed, *marks))
                self.settle()
            self.passes[self.phase] += 1
            self.tokens[self.phase] += tokens
            if routed:
                self.routed["passes_total"][self.phase] += 1
                self.routed["tokens_total"][self.phase] += tokens
                self.routed["host_seconds_total"][self.phase] += host

    def _thread_now(self) -> tuple[Any, Any] | None:
        """The forward thread's usage and the garbage collector's time now, for `_count_thread` after the pass;
        None where neither is read (or reading them failed: `errors` says why, and they are read no more)."""
        try:
            return (self.usage() if self.usage is not None else None,
                    self.collector() if self.collector is not None else None)
        except Exception as exc:  # the clock's failure never fails the pass
            self._no_thread(exc)
            return None

    def _count_thread(self, was: tuple[Any, Any] | None, routed: bool) -> None:
        """Add what the forward's thread and the garbage collector did since `was` (`_thread_now`) to this pass's
        phase (`forward_thread`; a routed pass's CPU and waits to `routed_total` too)."""
        if was is None:
            return
        used, collected = was
        try:
            if used is not None:
                cpu, waits, preempted = (now - then for now, then in zip(self.usage(), used, strict=True))
                self.thread["cpu_seconds_total"][self.phase] += cpu
                self.thread["waits_total"][self.phase] += waits
                self.thread["preempted_total"][self.phase] += preempted
                if routed:
                    self.routed["cpu_seconds_total"][self.phase] += cpu
                    self.routed["waits_total"][self.phase] += waits
            if collected is not None:
                seconds, count = self.collector()
                self.thread["gc_seconds_total"][self.phase] += seconds - collected[0]
                self.thread["gc_collections_total"][self.phase] += count - collected[1]
        except Exception as exc:
            self._no_thread(exc)

    def _no_thread(self, exc: Exception) -> None:
        """Reading the forward thread's usage or the collector's time failed: neither is read again, and the
        attestation says why (`errors`: `thread`)."""
        self.usage = self.collector = None
        self.errors.setdefault("thread", f"{type(exc).__name__}: {str(exc).strip()[:300]}")

    def _lost(self, exc: Exception) -> None:
        """A timing event failed: the device's spans stop (the host's go on, and the pass with them), and the
        attestation says why (`errors`: the first failure, whichever thread met it)."""
        with self._settling:
            self.events = None
            self._pending.clear()
            self.errors.setdefault("device", f"{type(exc).__name__}: {str(exc).strip()[:300]}")

    def settle(self) -> None:
        """Count the device time of each pass whose end the device has reached, in order, without waiting."""
        with self._settling:
            try:
                while self._pending and self._pending[0][3].query():
                    phase, routed, start, end = self._pending[0]
                    span = start.elapsed_time(end) / 1e3
                    self.device_seconds[phase] += span
                    self.device_passes[phase] += 1
                    if routed:
                        self.routed["device_seconds_total"][phase] += span
                        self.routed["device_passes_total"][phase] += 1
                    self._pending.popleft()
            except Exception as exc:
                self._lost(exc)

    def read_device(self) -> bool:
        """For a reader on another thread (the state writer), so that the thread running the passes never waits
        on the device: wait until the device has reached the end of every pass timed so far, then count them
        (`settle`). Reads a snapshot of the queue, which that thread's appends and `settle`'s pops leave whole.
        Whether it read them (where an event failed the device's spans stop, `_lost`). Never while a graph is
        captured: its caller, the runtime's state document, is held off then (`Runtime.capturing_graphs`)."""
        if self.sampler is not None:  # the stack samples up to now, for the same document
            self.sampler.publish()
        try:
            for *_, end in list(self._pending):
                end.synchronize()
            self.settle()
            return "device" not in self.errors
        except Exception as exc:
            self._lost(exc)
            return False

    def live(self) -> dict[str, Any]:
        """The clock's own dicts under the attestation's fields: a runtime's attestation reads them whenever it is
        written."""
        return {"parts": self.parts, "passes_total": self.passes, "tokens_total": self.tokens,
                "seconds_total": self.seconds, "device_seconds_total": self.device_seconds,
                "device_passes_total": self.device_passes, "routed_total": self.routed,
                "forward_thread": self.thread, "calls_total": self.calls, "call_cost_s": self.call_cost_s,
                **({"samples": self.sampler.view} if self.sampler is not None else {}), "errors": self.errors}

    def attestation(self) -> dict[str, Any]:
        """A copy of `live`, as plain dicts."""
        return {field: {phase: {where: dict(parts) for where, parts in kinds.items()} for phase, kinds in value.items()}
                if field == "seconds_total" else {f: dict(v) for f, v in value.items()}
                if field in ("routed_total", "forward_thread")
                else dict(value) if isinstance(value, dict) else value
                for field, value in self.live().items()}


class PassClock:
    """Decode step time by kind of pass, for a server that interleaves its routed decode passes with all-RUN
    control passes (`vskipper.sglang.spec.ENV_INTERLEAVE_CONTROL`).

    A pass's step is the time from its start to the next pass's start: its forward, the scheduler's handling of
    its output and the planning of the next batch, everything a throughput counts. A step is kept only where the
    next pass decodes the same number of rows (the same batch, a token later), so the two kinds of pass compare
    the same work, seconds apart, on a host whose speed drifts over minutes."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self.passes: dict[str, int] = defaultdict(int)
        self._open: tuple[str, int, float] | None = None  # the pass running now: its kind, rows and start

    def start(self, kind: str | None, rows: int) -> None:
        """A pass starts: `kind` 'decode' (routed) or `CONTROL_PHASE`; None for any other pass (prefill, dense)."""
        now = self.clock()
        if self._open is not None and kind is not None and self._open[1] == rows:
            self.seconds[self._open[0]] += now - self._open[2]
            self.passes[self._open[0]] += 1
        self._open = (kind, rows, now) if kind is not None else None

    def attestation(self) -> dict[str, Any]:
        """The clock's own dicts, live: the runtime's attestation reads them whenever it is written."""
        return {"passes_total": self.passes, "seconds_total": self.seconds}
