#!/usr/bin/env python3
"""`make bench-host`: the host time of a routed pass against a dense one, in one process on CPU.

A served pass goes through the model's hooks around SGLang's forward: `SkipperCausalLM.prepare_pass` (the
runtime's host decisions, `Runtime.decide`, then the routed pass's plan written into the static `PlanBuffers`),
the forward (on a GPU a decode pass replays a captured graph: no per-layer Python on the host's path), then
`finish_pass` (the pass counted: the tape's counts on their way to the host, the counters, Prometheus). A dense
arm's pass goes through the same hooks with a non-routed step. Here the real skipper model class
(`DDLlamaForCausalLM`: SGLang's `LlamaForCausalLM` with vSkipper's routed layers), with SGLang's real KV pool,
request-to-token pool and torch-native attention backend (`vskipper.sglang.standalone`'s context), is built once
per arm from one tiny checkpoint (hidden 64, 8 layers, layers 4-7 routed), each arm with its own runtime:

  dense   the dense arm (a non-routed step through the same hooks)
  s=0     always-route RandomSkip r = 0, d = 0.5: every row RUN through the routed path (the control)
  s=0.5   always-route RandomSkip r = 1, d = 0.5: half of each routed layer's rows Project-Only

and with `--flexidepth` two more, FlexiDepth always-route over the checkpoint's routers (random weights: which rows
run is theirs to say), its routes in the triton execution from the fused gate a server serves (`fd`,
`vskipper.mixed.router`) and from the gate's own route (`fd-own`, the module and the decision, as the torch
execution routes): the gate's host cost in a whole pass, side by side.

Two measurements, each at decode batches of 8, 64 and 256 requests (32 tokens of context each) and two prefill
passes (one prompt of 16 tokens, a pass of fixed costs alone; 4 prompts of 64 tokens); within every repetition the
arms take turns pass by pass (ABC, CBA, ...), each pass timed on its own, and a repetition's figure per arm is the
median of its passes:

  hooks   `prepare_pass` + `finish_pass` alone, no forward: the per-pass host work outside the forward, which a
          captured decode graph cannot hold (its time over a dense pass's is what routing adds to the host's
          critical path on a GPU, whatever the graph replays)
  pass    the whole eager pass: `prepare_pass`, the model's forward (embedding, every layer, logits), then
          `finish_pass`. The model is so small that compute is negligible: the time is the host's (Python,
          dispatch, SGLang's per-request decode read); on a GPU a routed decode pass replays a graph instead, so
          this is the eager bound (prefill, CPU)

and, with `--only parts` (not run by default), where a whole eager pass's host time goes:

  parts   each part of the whole pass timed on its own, its wrapper around it: `prepare_pass`, the skipper's
          per-pass state (`Runtime.prepare_state`: the tape's padding and the skipper's `prepare_batch`, or the
          triton execution's fused launch), the layers dense in every arm, the routed layers (which the dense arm
          runs dense), `finish_pass`, and the rest of the pass (the embedding, the final norm and logits, the
          forward's own Python); printed per arm with each routed arm's microseconds over dense's, and per layer

and, with `--only samples`, what the forward's stack sampler costs a pass (`vskipper.sglang.stack_samples`, which
a server runs with `VSKIPPER_STACK_SAMPLES=1` and the device run's clock stage and `run.sh --samples` turn on):

  samples every arm's whole eager pass without a sampler and with one reading it every 2 ms, and every 5 ms
          (woken as the pass begins, asleep after it, as the part clock runs it), the sides taking turns pass by
          pass; printed per interval and arm: each side's microseconds, sampled over plain, the samples a pass
          took, what each cost the pass and what of that it held the interpreter's lock itself

Printed per phase and batch: each arm's microseconds per pass (the median over repetitions, with their [min,
max]), each routed arm over dense (the median of the repetitions' ratios, [min, max]) beside the goal (within
10%: 1.10x), and what the hooks add to a pass over dense's hooks, in microseconds and as a share of the dense
eager pass.
Last line: `host: hooks s=0.5/dense <x>x .. <y>x; pass s=0.5/dense <x>x .. <y>x (goal <= 1.10x)` over the shapes.

`--execution triton` runs the routed arms' layers in the execution a GPU serves (the count-bounded Triton
kernels, `vskipper.mixed.routed_layer`) instead of the torch execution a CPU serves, under `TRITON_INTERPRET=1`
with every Triton launch recorded and not executed (`vskipper.mixed.launches.interpreted_launches`): the host's
Python around each launch is timed, the interpreter's run of the kernel is not, and Triton's own launcher (a
compiled kernel's argument binding and its driver call on a GPU) is not in the figure either. Its `pass`
measurement takes the prefill shape alone, its read through SGLang's attention backend (as on the H200, whose table
measured that read faster: dense and routed arms then read alike; `--prefill-read packed`: the routed arms' packed
Triton read, one launch a layer); a decode pass replays a captured graph on a GPU,
and the triton execution's masked decode read is one launch where dense's torch-native read runs here. The
kernels' outputs are left as their storage held them (denormals flushed to zero), which no host decision reads.

`--prefill-graphs` (with `--execution triton`): the routed arms' prefill passes replay their routed layers from
graphs captured at each prefill shape's tokens (`vskipper.sglang.prefill_graphs`, as `VSKIPPER_PREFILL_GRAPHS`
serves them), a replay standing in for a CUDA graph's launch by doing nothing (`NoReplay`): what is timed is the
host's work around the replays (the pass's copies into the static buffers, per routed layer three copies and the
read through SGLang's backend, two lookups; with the packed read two copies and one lookup), not the replay's own launch (on a GPU, `cudaGraphLaunch` of a graph
of some dozen kernels, tens of microseconds) nor any kernel's work, which a replay leaves on the device.

`--stand-in-ops triton` serves every arm's RMSNorm, SiLU-and-mul and RoPE as a server on `vskipper serve
--stand-in-ops triton` serves them: SGLang's three torch paths hooked in this process (`vskipper.sglang.stand_in_ops`), each call one
Triton launch, recorded and not run; the calls each path took are printed last.

Before the timings, one pass of each arm and shape is counted (`vskipper.mixed.launches.LaunchCount`): the torch
operators that compute or copy (a device kernel each on a GPU, and a host dispatch each) and the Triton launches,
each routed arm's count beside dense's.

One torch thread. Timings on a shared machine are noisy: the spread is printed, the arms alternate, and each
figure is a median over repetitions of many passes each.

    python benchmarks/host_time_bench.py                 # about two minutes on two cores
    python benchmarks/host_time_bench.py --quick         # tiny batches, two repetitions: checks the pipeline
    python benchmarks/host_time_bench.py --json out.json
    python benchmarks/host_time_bench.py --layers 32 --only hooks   # 16 routed layers, as Llama-3-8B's
    python benchmarks/host_time_bench.py --only parts               # where a pass's host time goes, part by part
    python benchmarks/host_time_bench.py --layers 32 --only samples # what the stack sampler costs a pass
    python benchmarks/host_time_bench.py --execution triton         # the GPU's execution, its launches not run
    python benchmarks/host_time_bench.py --execution triton --stand-in-ops triton   # and the stand-in ops
    python benchmarks/host_time_bench.py --execution triton --flexidepth            # and FlexiDepth's gate
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from vskipper.arms import Arm, get_arm  # noqa: E402
from vskipper.checkpoint import TinySize, make_tiny_model  # noqa: E402
from vskipper.serveargs import STAND_IN_OPS  # noqa: E402
from vskipper.sglang.standalone import init_sglang  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_cpu import ARMS as BENCH_CPU_ARMS  # noqa: E402
from bench_cpu import paired, spread  # noqa: E402

# bench-cpu's arms: dense, the s = 0 control and s = 0.5 (RandomSkip, every routed layer routed in both phases)
ARMS = {name: get_arm("dense") if arm is None else Arm.from_dict(arm, name=f"random-r{arm['params']['r']:g}-always")
        for name, arm in BENCH_CPU_ARMS.items()}
ROUTED_ARMS = ("s=0", "s=0.5")
# `--flexidepth`: FlexiDepth always-route, its routes from the fused gate (the triton execution's) and its own route
FLEXIDEPTH_ARMS = ("fd", "fd-own")
GOAL = 1.10  # a routed pass's host time within 10% of a dense pass's
CONTEXT = 32  # tokens of context per decode request


@dataclass(frozen=True)
class Shape:
    """One kind of pass: `batch` decode requests of `CONTEXT` tokens, or `prompts` prompts of `tokens` tokens."""

    phase: str
    batch: int  # requests in the pass
    tokens: int = 1  # new tokens per request (decode: 1)

    @property
    def label(self) -> str:
        return f"decode b={self.batch}" if self.phase == "decode" else f"prefill {self.batch}x{self.tokens}"

    @property
    def rows(self) -> int:
        return self.batch * self.tokens


FULL = (Shape("decode", 8), Shape("decode", 64), Shape("decode", 256), Shape("prefill", 1, 16),
        Shape("prefill", 4, 64))
QUICK = (Shape("decode", 4), Shape("prefill", 2, 8))


class ServedModel:
    """The skipper model class of one arm, built in this process as a server's scheduler builds it (its own
    runtime, its weights loaded by its own loader, the routed layers' `execution`), over SGLang's KV pool,
    request-to-token pool and torch-native attention backend; `batch` builds SGLang's ForwardBatch of a pass. The
    class is the checkpoint's architecture's (FlexiDepth-Llama's or Qwen3's)."""

    def __init__(self, arm: Arm, checkpoint: Path, requests: int, slots: int, execution: str = "auto",
                 prefill_read: str | None = None, prefill_graphs: tuple[int, ...] = (),
                 asked_read: str = "auto") -> None:
        from safetensors.torch import load_file
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from transformers import AutoConfig

        from vskipper.sglang import active
        from vskipper.sglang.models.ddllama import DDLlamaForCausalLM
        from vskipper.sglang.models.qwen3_skipper import Qwen3SkipperForCausalLM
        from vskipper.sglang.runtime import Runtime
        from vskipper.sglang.spec import ServeSpec

        config = AutoConfig.from_pretrained(str(checkpoint))
        routed = tuple(config.routing_layers)
        architecture = config.architectures[0]  # the checkpoint's, as SGLang's registry resolves it
        classes = {c.__name__: c for c in (DDLlamaForCausalLM, Qwen3SkipperForCausalLM)}
        if architecture not in classes:
            raise ValueError(f"{checkpoint}: config field 'architectures' is {config.architectures!r}; a served "
                             f"model is one of {', '.join(classes)}")
        model_class = classes[architecture]
        # The model asks for the process's runtime (`get_runtime`): this arm's, built without a state file.
        active.set_runtime(Runtime(ServeSpec(arm, 0, 0, None, execution=execution, prefill_read=asked_read),
                                   config.model_type, routed, architecture))
        model = model_class(config)
        model.load_weights(load_file(str(checkpoint / "model.safetensors")).items())
        if prefill_read is not None:  # the read a device's table chose, in place of this device's default
            model.slot.execution = replace(model.slot.execution, prefill_read=prefill_read)
        if prefill_graphs:  # built over the execution that serves here (a server's spec asks at its build)
            model.slot.prefill_graphs = model.prefill_graphs_for(prefill_graphs)
        self.model = model.eval()
        self.runtime = model.runtime
        attn = model.model.layers[0].self_attn
        layers = config.num_hidden_layers
        self.pool = MHATokenToKVPool(slots, 1, torch.float32, attn.num_kv_heads, attn.head_dim, layers, "cpu",
                                     False, start_layer=0, end_layer=layers - 1)
        self.req_pool = ReqToTokenPool(requests, CONTEXT + 64, "cpu", False)
        per = CONTEXT + 64
        self.req_pool.req_to_token[:requests, :per] = (torch.arange(requests * per) + 1).view(requests, per)
        self.backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=self.req_pool,
                                                              token_to_kv_pool=self.pool))

    def context(self):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        return forward_context(ForwardContext(attn_backend=self.backend))

    def batch(self, shape: Shape, first_slot: int):
        """SGLang's ForwardBatch of a pass of `shape` over request slots from `first_slot`: a decode pass of
        requests holding `CONTEXT` tokens each, or a prefill pass of whole prompts."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

        reqs = list(range(first_slot, first_slot + shape.batch))
        decode = shape.phase == "decode"
        prefix = [CONTEXT - 1 if decode else 0] * shape.batch
        seq = [p + shape.tokens for p in prefix]
        positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq, strict=True)])
        req_rows = torch.repeat_interleave(torch.tensor(reqs), shape.tokens)
        extend = torch.tensor([shape.tokens] * shape.batch)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, batch_size=shape.batch,
            input_ids=torch.randint(3, 500, (shape.rows,)), req_pool_indices=torch.tensor(reqs),
            seq_lens=torch.tensor(seq), out_cache_loc=self.req_pool.req_to_token[req_rows, positions].to(torch.int64),
            seq_lens_sum=sum(seq), seq_lens_cpu=torch.tensor(seq), positions=positions,
            rids=[f"{shape.phase}-{r}" for r in reqs], capture_hidden_mode=CaptureHiddenMode.NULL)
        if not decode:
            fb.extend_seq_lens, fb.extend_seq_lens_cpu = extend, extend.tolist()
            fb.extend_prefix_lens = torch.tensor(prefix)
            fb.extend_start_loc = torch.cumsum(extend, 0) - extend
            fb.extend_num_tokens = shape.rows
            fb.extend_logprob_start_lens_cpu = [shape.tokens] * shape.batch
        return fb

    def hooks(self, fb) -> None:
        """The host work around a pass, without its forward."""
        self.model.prepare_pass(fb)
        self.model.finish_pass(fb, False)

    def whole(self, fb) -> None:
        """The whole eager pass, as SGLang's model runner runs it with vSkipper's hooks around it."""
        self.model.prepare_pass(fb)
        with self.context():
            self.model.forward(fb.input_ids, fb.positions, fb)
        self.model.finish_pass(fb, False)


STAND_IN_OPS_SHOWN = {"torch": "SGLang's torch paths",
                      "triton": "the CUDA stand-ins' Triton kernels (vskipper serve --stand-in-ops triton)"}


def same_kv(models: list[ServedModel], seed: int = 0) -> None:
    """The same random K/V in every model's pools (models of one checkpoint and size), as if each had served the
    same requests: their passes then read alike."""
    gen = torch.Generator().manual_seed(seed)
    kv = [torch.randn(b.shape, generator=gen) for b in models[0].pool.k_buffer + models[0].pool.v_buffer]
    for m in models:
        for i, buffer in enumerate(m.pool.k_buffer + m.pool.v_buffer):
            buffer.copy_(kv[i])


class NoReplay:
    """A stand-in for a captured CUDA graph whose replay launches nothing: its capture runs the function once (its
    outputs, which replays never refresh), its replay costs the host a Python call."""

    def capture(self, fn):
        return fn()

    def replay(self) -> None:
        pass


def stand_in_hooks() -> None:
    """SGLang's RMSNorm, SiLU-and-mul and RoPE hooked as a server on `--stand-in-ops triton` hooks them, in this
    process: every arm's layers then launch the one-launch kernels (`vskipper.sglang.stand_in_ops`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from vskipper.sglang import stand_in_ops
    from vskipper.sglang.hooks import check_applied
    from vskipper.sglang.spec import ENV_STAND_IN_OPS

    os.environ[ENV_STAND_IN_OPS] = "triton"
    stand_in_ops.register(HookRegistry, HookType)
    HookRegistry.apply_hooks()
    check_applied(stand_in_ops.targets())


def first_slot(shape: Shape, shapes) -> int:
    """The request slot a pass of `shape` starts at: prefills after every decode batch's requests."""
    return 0 if shape.phase == "decode" else max(s.batch for s in shapes if s.phase == "decode")


def count_launches(models: dict[str, ServedModel], shapes) -> dict:
    """Per shape and arm, what one whole pass launches (after two warm-up passes: a replayed routed prefill's
    graphs are captured at the first and checked again at the second): the torch operators that compute or copy,
    by name, and the Triton launches, by kernel (recorded, not run)."""
    from vskipper.mixed.launches import LaunchCount, interpreted_launches

    counts: dict = {}
    for shape in shapes:
        for name, m in models.items():
            fb = m.batch(shape, first_slot(shape, shapes))
            with interpreted_launches(Counter(), run=False):  # warm-up: the runtime's records, buffers' sizes
                m.whole(fb)
                m.whole(fb)
            count = LaunchCount()
            with interpreted_launches(count.triton, run=False), count:
                m.whole(fb)
            counts.setdefault(shape.label, {})[name] = {
                "ops": sum(count.ops.values()), "triton": sum(count.triton.values()),
                "by_op": dict(count.ops.most_common()), "by_kernel": dict(count.triton.most_common())}
    return counts


def report_launches(counts: dict, routed: tuple[str, ...] = ROUTED_ARMS) -> None:
    print("\nlaunches a pass: torch operators that compute or copy (a device kernel each on a GPU) + Triton launches")
    names = list(next(iter(counts.values())))
    print(f"  {'pass':<16}" + "".join(f"{name:>22}" for name in names) + "".join(
        f"{name + ' - dense':>18}" for name in routed))
    for label, arms in counts.items():
        dense = arms["dense"]["ops"] + arms["dense"]["triton"]
        cells = [f"{a['ops']:5d} + {a['triton']:3d} = {a['ops'] + a['triton']:5d}" for a in arms.values()]
        cells += [f"{arms[name]['ops'] + arms[name]['triton'] - dense:+6d}" for name in routed]
        print(f"  {label:<16}" + "".join(f"{c:>22}" for c in cells[:len(names)])
              + "".join(f"{c:>18}" for c in cells[len(names):]))


def passes_for(kind: str, shape: Shape, quick: bool) -> int:
    """Passes of each arm per repetition: enough for a stable median, in a few seconds (quick: a few, and for the
    stack sampler's sides enough passes that a 5 ms sampler takes samples of each)."""
    if quick:
        return 12 if kind == "samples" else 3
    if kind == "hooks":
        return 200 if shape.phase == "decode" and shape.batch <= 64 else 100
    return max(5, min(40, 2000 // shape.rows))


def measure(models: dict[str, ServedModel], shapes, repetitions: int, quick: bool,
            kinds: dict[str, tuple[Shape, ...]] | None = None) -> dict:
    """For each kind and its shapes (every kind all `shapes` unless `kinds` says): per arm, each repetition's
    median microseconds per pass. Within a repetition the arms take turns pass by pass (ABC, CBA, ...), so a load
    that comes and goes on a shared machine lands on every arm alike; each pass is timed on its own."""
    results: dict = {}
    order = list(models)
    for kind, kind_shapes in (kinds or {"hooks": shapes, "pass": shapes}).items():
        for shape in kind_shapes:
            batches = {name: m.batch(shape, first_slot(shape, shapes)) for name, m in models.items()}
            fns = {name: m.hooks if kind == "hooks" else m.whole for name, m in models.items()}
            for name in order:  # warm-up: the runtime's records, the tape and the plan buffers' sizes
                fns[name](batches[name])
                fns[name](batches[name])
            n = passes_for(kind, shape, quick)
            times: dict[str, list[float]] = {name: [] for name in order}
            for _ in range(repetitions):
                per: dict[str, list[float]] = {name: [] for name in order}
                for i in range(n):
                    for name in order if i % 2 == 0 else reversed(order):
                        fn, fb = fns[name], batches[name]
                        t0 = time.perf_counter()
                        fn(fb)
                        per[name].append(time.perf_counter() - t0)
                for name in order:
                    times[name].append(statistics.median(per[name]) * 1e6)
            results.setdefault(kind, {})[shape.label] = {"passes": n, "us": times}
    return results


PARTS = ("prepare_pass", "state", "dense layers", "routed layers", "finish_pass", "rest")


class PartTimes:
    """While entered, the host time of each part of `ServedModel.whole`'s pass (`PARTS`) adds up in `seconds`:
    each part's callable wrapped where the pass looks it up (an instance attribute before its class's), each
    wrapper timing its call alone. What no wrapper covers is the pass's `rest`."""

    def __init__(self, m: ServedModel) -> None:
        model = m.model
        routed = set(model.config.routing_layers)
        self.targets = [(model, "prepare_pass", "prepare_pass"), (model, "finish_pass", "finish_pass"),
                        (model.runtime, "prepare_state", "state")]
        self.targets += [(layer, "forward", "routed layers" if i in routed else "dense layers")
                         for i, layer in enumerate(model.model.layers)]
        self.seconds = dict.fromkeys(PARTS, 0.0)

    def _timed(self, fn, part: str):
        seconds = self.seconds

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - t0
        return timed

    def __enter__(self) -> PartTimes:
        for obj, name, part in self.targets:
            setattr(obj, name, self._timed(getattr(obj, name), part))
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, _ in self.targets:
            delattr(obj, name)  # the class's own again

    def take(self, whole: float) -> dict[str, float]:
        """This pass's seconds per part (the rest: `whole` less the parts), and zero them for the next."""
        parts = dict(self.seconds, rest=whole - sum(self.seconds.values()))
        for part in self.seconds:
            self.seconds[part] = 0.0
        return parts


def measure_parts(models: dict[str, ServedModel], shapes, repetitions: int, quick: bool, measured) -> dict:
    """Per shape of `measured` (among `shapes`), arm and part: each repetition's median microseconds per pass of
    that part (`PartTimes`), the arms taking turns pass by pass as in `measure`."""
    results: dict = {}
    order = list(models)
    with ExitStack() as stack:
        timers = {name: stack.enter_context(PartTimes(m)) for name, m in models.items()}
        for shape in measured:
            batches = {name: m.batch(shape, first_slot(shape, shapes)) for name, m in models.items()}
            for name in order:
                models[name].whole(batches[name])
                models[name].whole(batches[name])
                timers[name].take(0.0)
            n = passes_for("pass", shape, quick)
            us: dict[str, dict[str, list[float]]] = {name: {part: [] for part in PARTS} for name in order}
            for _ in range(repetitions):
                per: dict[str, dict[str, list[float]]] = {name: {part: [] for part in PARTS} for name in order}
                for i in range(n):
                    for name in order if i % 2 == 0 else reversed(order):
                        t0 = time.perf_counter()
                        models[name].whole(batches[name])
                        for part, sec in timers[name].take(time.perf_counter() - t0).items():
                            per[name][part].append(sec)
                for name in order:
                    for part in PARTS:
                        us[name][part].append(statistics.median(per[name][part]) * 1e6)
            results[shape.label] = {"passes": n, "us": us}
    return results


class Sampled:
    """An arm's whole eager pass with a stack sampler reading the thread that runs it (`StackSampler`), woken as
    the pass begins and asleep after it, as a server's part clock runs it around each forward; its samples are
    counted under `phase`."""

    def __init__(self, m: ServedModel, sampler, running: list) -> None:
        self.m, self.sampler, self.running = m, sampler, running
        self.batch, self.phase = m.batch, "pass"

    def whole(self, fb) -> None:
        self.running[0] = (threading.get_ident(), self.phase)
        self.sampler.begin()
        try:
            self.m.whole(fb)
        finally:
            self.running[0] = None
            self.sampler.end()


SAMPLE_INTERVALS_MS = (2, 5)  # the sampler's intervals timed side by side (the stack sampler's own is one of them)


def sampled_side(name: str, interval_ms: float) -> str:
    """The name of arm `name`'s side sampled every `interval_ms`."""
    return f"{name}+{interval_ms:g}ms"


def measure_samples(models: dict[str, ServedModel], shapes, repetitions: int, quick: bool, measured,
                    intervals_ms=SAMPLE_INTERVALS_MS) -> dict:
    """Per shape of `measured`: every arm's whole pass plain and sampled at each of `intervals_ms` (`Sampled`, one
    sampler an interval, each side named by `sampled_side` and read through its own `running`, so that no sampler
    samples another side's pass), each repetition's median microseconds per pass as `measure` takes them (all
    sides taking turns pass by pass), and per sampled side the samples it took, the seconds they held the
    interpreter's lock, and its passes (`measure`'s two warm-up passes included, which its samples count too)."""
    from vskipper.sglang.stack_samples import StackSampler

    cells: dict[float, list] = {ms: [None] for ms in intervals_ms}
    samplers = {ms: StackSampler(lambda cell=cells[ms]: cell[0], interval_s=ms / 1e3) for ms in intervals_ms}
    sides: dict = {}
    for name, m in models.items():
        sides[name] = m
        for ms, sampler in samplers.items():
            sides[sampled_side(name, ms)] = Sampled(m, sampler, cells[ms])
    results: dict = {}
    for sampler in samplers.values():
        sampler.start()
    try:
        for shape in measured:
            for side_name, side in sides.items():
                if isinstance(side, Sampled):
                    side.phase = f"{shape.label}/{side_name}"
            timed = measure(sides, shapes, repetitions, quick, {"samples": (shape,)})["samples"][shape.label]
            for sampler in samplers.values():
                sampler.publish()  # the samples taken so far counted
            results[shape.label] = {**timed, "sampled_passes": 2 + timed["passes"] * repetitions, "samples": {
                side_name: {"samples": side.sampler.samples[side.phase], "seconds": side.sampler.seconds[side.phase]}
                for side_name, side in sides.items() if isinstance(side, Sampled)}}
    finally:
        for sampler in samplers.values():
            sampler.stop()
            sampler.join(5.0)
    return results


def report_samples(results: dict, repetitions: int, intervals_ms=SAMPLE_INTERVALS_MS) -> dict:
    """Each arm's pass sampled at each interval over its plain one (the median of the repetitions' ratios, [min,
    max]), the samples a pass it took, what a sample held the interpreter's lock (`own`), and what one cost the
    pass in all: the sampled pass's extra microseconds over its samples a pass (`each`: its own time and the
    lock's hand-over from the forward and back)."""
    print(f"\nsamples: the whole eager pass with the stack sampler reading it every "
          f"{' or '.join(f'{ms:g}' for ms in intervals_ms)} ms against without it, microseconds per pass, median "
          f"over {repetitions} repetitions")
    summaries: dict = {}
    for label, data in results.items():
        names = [n for n in data["us"] if all(sampled_side(n, ms) in data["us"] for ms in intervals_ms)]
        print(f"  {label}")
        for ms in intervals_ms:
            for name in names:
                side = sampled_side(name, ms)
                plain, sampled, taken = data["us"][name], data["us"][side], data["samples"][side]
                ratio = dict(zip(("median", "min", "max"), paired(sampled, plain), strict=True))
                per_pass = taken["samples"] / data["sampled_passes"]
                extra = statistics.median(sampled) - statistics.median(plain)
                each = extra / per_pass if per_pass else None
                own = taken["seconds"] / taken["samples"] * 1e6 if taken["samples"] else None
                summaries.setdefault(label, {}).setdefault(f"{ms:g}", {})[name] = {
                    "plain_us": statistics.median(plain), "sampled_us": statistics.median(sampled), "ratio": ratio,
                    "samples_per_pass": per_pass, "us_per_sample": each, "own_us_per_sample": own}
                print(f"    {ms:g} ms {name:<8} plain {statistics.median(plain):9.1f}  sampled "
                      f"{statistics.median(sampled):9.1f}  sampled/plain {ratio['median']:.3f}x [{ratio['min']:.3f}, "
                      f"{ratio['max']:.3f}]  {per_pass:5.2f} samples a pass"
                      + (f", each {each:+.1f} us" if each is not None else "")
                      + (f" (own {own:.1f} us)" if own is not None else ""))
    for ms in intervals_ms:
        arms = [a for shapes in summaries.values() for a in shapes[f"{ms:g}"].values()]
        ratios = [a["ratio"]["median"] for a in arms]
        own = [a["own_us_per_sample"] for a in arms if a["own_us_per_sample"] is not None]
        print(f"sampler every {ms:g} ms: sampled/plain {min(ratios):.3f}x .. {max(ratios):.3f}x "
              f"(median {statistics.median(ratios):.3f}x)"
              + (f"; a sample's own {min(own):.1f} .. {max(own):.1f} us" if own else ""))
    return summaries


def report_parts(results: dict, repetitions: int, layers: dict[str, int], routed: tuple[str, ...]) -> dict:
    """Each part's median microseconds per pass (over the repetitions) per arm, each routed arm's over dense's, and
    the layer groups' per layer."""
    print(f"\nparts: where a whole eager pass's host time goes, microseconds per pass (median over {repetitions} "
          f"repetitions of each part's median); layers per layer below their group ({layers['dense layers']} "
          f"dense, {layers['routed layers']} routed)")
    summaries: dict = {}
    for label, data in results.items():
        names = list(data["us"])
        med = {name: {part: statistics.median(v) for part, v in parts.items()} for name, parts in data["us"].items()}
        added = {name: {part: med[name][part] - med["dense"][part] for part in PARTS} for name in routed}
        summaries[label] = {"arms": med, "added_us": added, "passes_per_repetition": data["passes"]}
        print(f"  {label:<16}" + "".join(f"{name:>12}" for name in names)
              + "".join(f"{name + ' - dense':>16}" for name in routed))
        for part in PARTS:
            print(f"    {part:<14}" + "".join(f"{med[name][part]:12.1f}" for name in names)
                  + "".join(f"{added[name][part]:+16.1f}" for name in routed))
            if part in layers:
                count = layers[part]
                print(f"    {'  per layer':<14}" + "".join(f"{med[name][part] / count:12.1f}" for name in names)
                      + "".join(f"{added[name][part] / count:+16.1f}" for name in routed))
    return summaries


def summary(times: dict[str, list[float]], routed: tuple[str, ...] = ROUTED_ARMS) -> dict:
    """Medians with their [min, max], and each routed arm over dense repetition by repetition."""
    keys = ("median", "min", "max")
    out = {"arms": {name: dict(zip(keys, spread(t), strict=True)) for name, t in times.items()}, "ratios": {}}
    for name in routed:
        ratio = dict(zip(keys, paired(times[name], times["dense"]), strict=True))
        out["ratios"][f"{name}/dense"] = {**ratio, "within_goal": ratio["median"] <= GOAL}
    return out


def report(results: dict, repetitions: int, routed: tuple[str, ...] = ROUTED_ARMS) -> dict:
    what = {"hooks": "prepare_pass + finish_pass (the host work outside the forward a graph cannot hold)",
            "pass": "the whole eager pass (prepare_pass, forward, finish_pass; compute negligible)"}
    summaries: dict = {}
    for kind, shapes in results.items():
        print(f"\n{kind}: {what[kind]}, microseconds per pass, median [min, max] over {repetitions} repetitions")
        names = list(next(iter(shapes.values()))["us"])
        print(f"  {'pass':<16}" + "".join(f"{name:>28}" for name in names) + "".join(
            f"{name + '/dense':>26}" for name in routed))
        for label, data in shapes.items():
            s = summary(data["us"], routed)
            summaries.setdefault(kind, {})[label] = {**s, "passes_per_repetition": data["passes"]}
            cells = [f"{a['median']:9.1f} [{a['min']:8.1f}, {a['max']:8.1f}]" for a in s["arms"].values()]
            cells += [f"{r['median']:7.3f}x [{r['min']:.3f}, {r['max']:.3f}]" for r in s["ratios"].values()]
            print(f"  {label:<16}" + "".join(f"{c:>28}" for c in cells[:len(names)])
                  + "".join(f"{c:>26}" for c in cells[len(names):]))
    hooks, passes = summaries.get("hooks", {}), summaries.get("pass", {})
    if hooks and passes:
        print("\nwhat the routed arms' hooks add over dense's, microseconds per pass and share of the dense eager pass")
        for label, s in hooks.items():
            if label not in passes:  # a shape whose eager pass was not timed (the triton execution's decode)
                continue
            dense = s["arms"]["dense"]["median"]
            whole = passes[label]["arms"]["dense"]["median"]
            added = {name: s["arms"][name]["median"] - dense for name in routed}
            for name, us in added.items():
                s["ratios"][f"{name}/dense"]["added_us"] = us
                s["ratios"][f"{name}/dense"]["added_share_of_dense_pass"] = us / whole
            print(f"  {label:<16}" + "".join(f"   {name} +{us:7.1f} us ({us / whole:6.2%})" for name, us in added.items()))
    print(f"\ngoal: a routed pass's host time within {GOAL - 1:.0%} of a dense pass's ({GOAL:.2f}x)")
    parts = []
    for kind, shapes in summaries.items():
        ratios = [s["ratios"]["s=0.5/dense"]["median"] for s in shapes.values()]
        parts.append(f"{kind} s=0.5/dense {min(ratios):.3f}x .. {max(ratios):.3f}x")
    print(f"host: {'; '.join(parts)} (goal <= {GOAL:.2f}x)")
    return summaries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny batches, two repetitions (checks the pipeline)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (the deeper half routed)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--only", choices=("hooks", "pass", "parts", "samples"),
                        help="one measurement (default: hooks and pass; parts and samples only where named)")
    parser.add_argument("--execution", choices=("torch", "triton"), default="torch",
                        help="the routed arms' execution: torch (a CPU's), triton (a GPU's; its launches not run)")
    parser.add_argument("--stand-in-ops", choices=STAND_IN_OPS, default="torch",
                        help="every arm's RMSNorm, SiLU-and-mul and RoPE: SGLang's torch paths, or the CUDA "
                             "stand-ins' Triton kernels (`vskipper serve --stand-in-ops`; their launches not run)")
    parser.add_argument("--flexidepth", action="store_true",
                        help="two more routed arms: FlexiDepth always-route over the checkpoint's routers, its routes "
                             "from the fused gate as served in the triton execution (fd) and from the gate's own "
                             "route (fd-own)")
    parser.add_argument("--prefill-graphs", action="store_true",
                        help="with --execution triton: the routed arms' prefill passes replay their routed layers "
                             "from graphs at each prefill shape's tokens, each replay launching nothing (the host's "
                             "work around the replays)")
    parser.add_argument("--prefill-read", choices=("backend", "packed"), default="backend",
                        help="with --execution triton: the routed arms' prefill read, through SGLang's backend (as "
                             "the H200's table chose) or the packed Triton read (with --prefill-graphs: inside each "
                             "routed layer's one segment)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.prefill_graphs and args.execution != "triton":
        parser.error("--prefill-graphs replays the triton execution's routed layers: give --execution triton")
    if args.prefill_read != "backend" and args.execution != "triton":
        parser.error("--prefill-read is the triton execution's: give --execution triton")
    repetitions = 2 if args.quick else args.repetitions
    if repetitions < 1:
        parser.error("--repetitions must be at least 1")
    shapes = QUICK if args.quick else FULL
    triton = args.execution == "triton"
    interpreted = triton or args.stand_in_ops == "triton"
    if interpreted:  # the kernels become interpreted functions as they are defined: before anything imports them
        if "vskipper.mixed.kernels" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("Triton kernels here: set TRITON_INTERPRET=1 before vskipper.mixed.kernels is imported")
        os.environ["TRITON_INTERPRET"] = "1"
        torch.set_flush_denormal(True)  # the skipped kernels' outputs hold what their storage held
    torch.set_num_threads(1)
    init_sglang("cpu")
    if args.stand_in_ops == "triton":
        stand_in_hooks()
    from vskipper.sglang.configs import register_configs

    register_configs()
    size = TinySize(layers=args.layers, hidden=args.hidden, intermediate=2 * args.hidden)
    requests = max(s.batch for s in shapes) + max(s.batch for s in shapes if s.phase == "prefill")
    slots = requests * (CONTEXT + 64) + 1
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny_model("flexidepth-llama", Path(tmp) / "tiny", size)
        arms = {**ARMS, **(dict.fromkeys(FLEXIDEPTH_ARMS, get_arm("always-route")) if args.flexidepth else {})}
        routed = ROUTED_ARMS + (FLEXIDEPTH_ARMS if args.flexidepth else ())
        graphs = ()
        if args.prefill_graphs:
            from vskipper.sglang import prefill_graphs

            prefill_graphs.PREFILL_GRAPH_STAND_IN = NoReplay
            graphs = tuple(sorted({s.rows for s in shapes if s.phase == "prefill"}))
        models = {name: ServedModel(arm, checkpoint, requests, slots, args.execution if name in routed
                                    else "auto", args.prefill_read if triton and name in routed else None,
                                    graphs if name in routed else ())
                  for name, arm in arms.items()}
    if args.flexidepth:  # fd-own: the gate's own route, as the torch execution routes (the fused gate is triton's)
        models["fd-own"].model.slot.fused_gate = False
    config = models["dense"].model.config
    executions = {name: models[name].model.slot.execution for name in routed}
    for name, execution in executions.items():
        if execution.decode != args.execution:
            raise SystemExit(f"{name} runs the {execution.decode} execution, not {args.execution}: "
                             f"{execution.reason or 'see its attestation'}")
    print(f"model: DDLlamaForCausalLM, hidden {config.hidden_size}, {config.num_hidden_layers} layers, routed "
          f"{list(config.routing_layers)}; decode context {CONTEXT} tokens; one torch thread; arms "
          + ", ".join(f"{n} ({a.name})" for n, a in arms.items()))
    execution = executions[ROUTED_ARMS[0]]
    print(f"routed arms' execution: {execution.decode}, prefill read {execution.prefill_read!r}; every arm's RMSNorm, "
          f"SiLU-and-mul and RoPE on {STAND_IN_OPS_SHOWN[args.stand_in_ops]}"
          + ("; Triton launches recorded, not run: the host's Python around them timed, the kernels and Triton's "
             "own launcher not" if interpreted else "")
          + ("; the routed arms' prefill passes replay their routed layers from graphs (each replay launching "
             "nothing here)" if args.prefill_graphs else ""))
    # decode passes replay a captured graph on a GPU: the triton execution's eager pass is timed in prefill alone
    kinds = {"hooks": shapes, "pass": tuple(s for s in shapes if s.phase == "prefill") if triton else shapes}
    kinds["parts"] = kinds["samples"] = kinds["pass"]
    kinds = {args.only: kinds[args.only]} if args.only else {k: v for k, v in kinds.items()
                                                              if k not in ("parts", "samples")}
    parts_shapes, samples_shapes = kinds.pop("parts", None), kinds.pop("samples", None)
    t0 = time.perf_counter()
    launches = count_launches(models, shapes)
    report_launches(launches, routed)
    with ExitStack() as stack:
        if interpreted:
            from vskipper.mixed.launches import interpreted_launches

            stack.enter_context(interpreted_launches(Counter(), run=False))
        results = measure(models, shapes, repetitions, args.quick, kinds) if kinds else {}
        if parts_shapes is not None:
            results["parts"] = measure_parts(models, shapes, repetitions, args.quick, parts_shapes)
        if samples_shapes is not None:
            results["samples"] = measure_samples(models, shapes, repetitions, args.quick, samples_shapes)
    summaries = report({k: v for k, v in results.items() if k not in ("parts", "samples")}, repetitions,
                       routed) if kinds else {}
    if parts_shapes is not None:
        layers = {"routed layers": len(config.routing_layers)}
        layers["dense layers"] = config.num_hidden_layers - layers["routed layers"]
        summaries["parts"] = report_parts(results["parts"], repetitions, layers, routed)
    if samples_shapes is not None:
        summaries["samples"] = report_samples(results["samples"], repetitions)
    if args.stand_in_ops == "triton":
        from vskipper.sglang import stand_in_ops

        print(f"stand-in ops' calls by path: {stand_in_ops.attestation()['calls_total']}")
    print(f"({time.perf_counter() - t0:.0f} s; a shared machine's timings are noisy: compare within one run)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"repetitions": repetitions, "goal": GOAL, "execution": args.execution,
                                         "prefill_read": execution.prefill_read,
                                         "stand_in_ops": args.stand_in_ops, "routed_arms": list(routed),
                                         "prefill_graphs": args.prefill_graphs,
                                         "launches": launches,
                                         "results": results, "summary": summaries}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
