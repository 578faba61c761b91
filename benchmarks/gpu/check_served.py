#!/usr/bin/env python3
"""Whether the served routed layer computes, on this device, what its torch execution computes.

    python benchmarks/gpu/check_served.py [--tile-table T] [--json OUT] [--dry-run]

One routed layer of the device run's model (SGLang's Llama decoder layer with vSkipper's routed body, SGLang's KV
pool; Llama-3-8B's shape, bf16, random weights: `mixed_depth_bench.ServedRig`), the execution a server takes on
this device (`cohort_execution`: the triton execution at the tile table given, or the one shipped for it), against
the torch execution of the same body (packed cohorts, cuBLAS, the masked decode read in torch and SDPA per request
for prefill; where every row is RUN its fast path reads through SGLang's torch-native backend: none of the Triton
kernels, SGLang's or ours), on the same rows, route and KV state:

  decode   batches of 16, 64 and 128 rows (the count ranges the sweep's batches reach) over 1,000 tokens of
           context, the triton execution eager and replayed from a CUDA graph (as a server replays it); and a
           graph captured for a batch of 128 rows from static plan buffers replayed for a batch of 121: SGLang's
           tensors of it padded to the graph's size as its graph runner pads them (`StandaloneLayer.padded`)
           copied into the graph's, its plan written into the buffers as a server writes it (the padding rows
           RUN, as the buffers pad them), its rows against the torch execution of the 121 alone
  prefill  one prompt of 1,024 tokens, and a pass of two prompts (600 and 424), eager, with the packed read and
           with the read through the attention backend the device run's servers serve with (`servers_backend`:
           SGLang's Triton extend kernel over every row, Project-Only rows with a zero query; which of the two a
           server takes, the table and that backend decide)

each with RandomSkip r = 1, d = 0.5 (about half the rows Project-Only, as the sweep's routed arm) and r = 0 (every
row RUN, the control), the layer's input handed over as the served layers hand it (a residual the add-norm
updates), and NaN in every KV slot the pass must not read (`poisoned`). A case passes where what the layer adds to
its input and the K/V it wrote lie, row by row, within `LAYER_RTOL` of the torch execution's row's largest value (a
chain of bf16 roundings; a wrong row, bound, split or read strays by whole values). Where the servers' backend is
not one a standalone layer builds, or does not build, the cases that need it (the backend reads, and the padded
replay, whose padding the backend fills) are not checked. The triton execution's decode reads no attention
backend: SGLang's Triton decode kernel, which dense layers run, is not checked here. Prints each case and exits 1
if any strays or could not run; `--json` writes them.

RandomSkip's routes of a pass in the fused launch the triton execution serves them with (`vskipper.mixed.routes`)
against the skipper's own tensor ops, for both arms' skippers over 16 routed layers at one row, a padded decode
batch's and a prefill's rows (signed request keys, some rows invalid): equal, flag for flag. A trained gate's route
in the fused form the triton execution serves it with (`vskipper.mixed.router`: FlexiDepth's, which the hybrid and
always-route arms serve, and the Qwen3 hard gate's) against the gate's own module and decision, over a router of
the served widths with random weights, at the same rows (some invalid): the flags equal wherever the router's weight
is not within `GATE_MARGIN` of the threshold (the sums' order and a GEMM library's may route those either way) and
the branch weights within `GATE_ATOL` there.

With `--stand-in-ops triton` (a run whose servers serve the CUDA stand-ins' Triton ops, `vskipper serve
--stand-in-ops`), SGLang's RMSNorm (over the hidden width, with its residual add and without, and over head_dim),
SiLU-and-mul and RoPE (Llama-3's, of the query and key views of a fused QKV projection) through the hooks a server
installs, against SGLang's own torch path, at one row, at a padded decode batch's and at a prefill's rows: each
output row within `OPS_RTOL` of its largest value, and every call taken by the kernels (none fallen back); beside
each case, what a call of either path costs the host (Triton's own launcher included, on a GPU) and the device,
warm, the median of `OPS_TIMING_REPS` calls a side taken in turns.

The served execution's eager passes (the largest decode batch, and each prefill with either read, for both
routes) run once more, warm, watched for what makes the host wait for the device (`vskipper.mixed.host_waits`): on
a GPU, torch's CUDA sync debug mode reports each synchronizing call with its site (save those of an operator called
through `torch.ops` and inside an extension: `DeviceSyncWatch`); on CPU the operators that would wait on a GPU stand
for them. First the watch must see a known wait (a scalar read of a device value), or every
pass is reported not checked. Beside each, upstream's dense pass of the same rows through the same backend is
watched alike. A pass passes where no wait is vSkipper's and SGLang's code waits at no site more often than in the
dense pass (its attention backend's read, which a dense pass makes alike, is listed, not held against it). The
host waits do not change the exit status: the routed figures measure what the passes compute either way, and the
summary says where they wait.

Interpreted kernels and the CPU cannot show a fault only the device has (a race, an out-of-bounds read that lands
on zeros, a compiler's bug at the device's tiles): the device run checks this before it trusts a routed figure.
`--dry-run` runs the same cases on CPU under the Triton interpreter (ours and SGLang's Triton backend's kernels)
with a tiny model (fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path

if "--dry-run" in sys.argv and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # the triton execution on CPU: the interpreter

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from mixed_depth_bench import (  # noqa: E402
    LLAMA3_8B,
    SMOKE,
    ServedRig,
    captured,
    project_only_share,
    request_keys,
    served_config,
)

from vskipper.mixed.host_waits import host_waits, live  # noqa: E402
from vskipper.mixed.plan_buffers import PlanBuffers  # noqa: E402
from vskipper.serveargs import STAND_IN_OPS  # noqa: E402
from vskipper.sglang.standalone import ATTENTION_BACKENDS, TORCH_NATIVE  # noqa: E402
from vskipper.skippers.random_skip import RandomSkip  # noqa: E402

# How far a row of the served execution may stray from the torch execution's, as a share of that row's largest
# value: a layer is a chain of five GEMMs, two norms and a read, each rounding to bf16 (an ulp is 1/128 of a value),
# where one GEMM's check allows 0.02 (`vskipper.mixed.tuner.CHECK_RTOL`); a wrong row, a dropped K split, a bound
# past the count or a read of the wrong keys strays by whole values.
LAYER_RTOL = 0.05
ROUTES = {"s=0.5": RandomSkip(r=1.0, d=0.5, seed=0), "s=0": RandomSkip(r=0.0, d=0.5, seed=0)}
# padded: the rows of a decode batch replayed from the graph SGLang captured for the next of its capture sizes
# (`capture_size`: 121 rows replay the graph of 128; 3 the graph of 4)
DEVICE_CASES = {"decode_rows": (16, 64, 128), "context": 1000, "prompts": ((1024,), (600, 424)), "padded": 121,
                "issue_reps": 5}
DRY_CASES = {"decode_rows": (2, 5), "context": 12, "prompts": ((16,), (9, 7)), "padded": 3, "issue_reps": 2}
REFERENCE_BACKEND = TORCH_NATIVE  # the reference's attention backend (none of its kernels is Triton's)
# The stand-in ops against SGLang's torch path: two bf16 roundings apart at most (a sum in another order, then the
# output's rounding); a wrong row, column or weight strays by whole values
OPS_RTOL = 2 * 2 ** -7
ROPE_POSITIONS = 8192  # the stand-in RoPE case's positions: the device run's context length
OPS_TIMING_REPS = 15  # timed calls a side of each stand-in op case (`op_timing`: their median is the figure)
GATE_MARGIN = 0.02  # a router weight this close to the run threshold may route either way
GATE_ATOL = 2 * 2 ** -7  # the branch weights (in [0, 1]): two units of bf16 at 1


def torch_execution(device: torch.device):
    """The reference: the torch execution with reads of its own (SDPA per request, the masked torch read) and no
    Triton kernel; a pass with every row RUN takes its fast path, upstream's attention through the backend it
    runs in (`REFERENCE_BACKEND`)."""
    from vskipper.sglang.models.routed import CohortExecution

    return CohortExecution("torch", prefill_read="rows", decode_read="masked")


def servers_backend() -> tuple[str | None, str | None]:
    """(the attention backend the device run's servers serve with where a standalone layer builds it, else None;
    the one their profile names, None where SGLang picks one): the GPU serving profile of this interpreter's
    packages (`platform_profile`: the CUDA stand-ins' Triton backend without SGLang's kernel wheels)."""
    from vskipper.sglang.cli import platform_profile

    named = platform_profile("gpu").attention_backend
    return (named if named in ATTENTION_BACKENDS else None), named


def capture_size(rows: int, max_rows: int, device: torch.device) -> int:
    """The batch size of the graph SGLang's decode graph runner replays a batch of `rows` from: the least of its
    capture sizes (up to `max_rows`, at SGLang's defaults on `device`) that holds it."""
    from sglang.srt.arg_groups.cuda_graph_hook import generate_decode_cuda_graph_batch_sizes
    from sglang.srt.server_args import ServerArgs

    sizes = generate_decode_cuda_graph_batch_sizes(ServerArgs(model_path="dummy", device=device.type), max_rows)
    return min(size for size in sizes if size >= rows)


class EagerGraph:
    """A CUDA graph's stand-in where none is captured (CPU): a replay runs the function again and writes its
    outputs into those the first run returned, as a replay refills the captured outputs."""

    def __init__(self, fn) -> None:
        self.fn, self.out = fn, fn()

    def replay(self) -> None:
        for held, fresh in zip(self.out, self.fn(), strict=True):
            held.copy_(fresh)


def capture(fn, graph: bool):
    """(a graph of fn, the outputs each replay refills): a CUDA graph (`captured`), or else `EagerGraph`."""
    if graph:
        return captured(fn)
    graph = EagerGraph(fn)
    return graph, graph.out


class Case:
    """One pass (`fb`) over one rig's layer from a saved KV state, its input handed over as a served layer past the
    first is handed it (hidden states and the residual the add-norm updates in place). Of a batch padded to a
    graph's size, the `real` rows are the batch's and are compared."""

    def __init__(self, rig: ServedRig, fb, hidden: torch.Tensor, residual: torch.Tensor, route,
                 kv0: tuple[torch.Tensor, torch.Tensor], real: int | None = None) -> None:
        self.rig, self.fb, self.hidden, self.residual, self.route = rig, fb, hidden, residual, route
        self.kv0 = kv0  # the pool's K and V before each run (`poisoned`)
        self.real = hidden.shape[0] if real is None else real
        self._want: tuple[torch.Tensor, torch.Tensor] | None = None

    def want(self, reference) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch execution's (what the layer adds, the K/V it wrote) through `REFERENCE_BACKEND`, run once for
        the case's every served run (the same route: the same share)."""
        if self._want is None:
            self._want = self.run(reference, backend=REFERENCE_BACKEND)
        return self._want

    def dense(self) -> Case:
        """This case's rows, input and KV state, the pass upstream's dense forward (no route)."""
        return Case(self.rig, self.fb, self.hidden, self.residual, None, self.kv0, self.real)

    def restore(self) -> None:
        pool, lid = self.rig.world.pool, self.rig.lid
        pool.get_key_buffer(lid).copy_(self.kv0[0])
        pool.get_value_buffer(lid).copy_(self.kv0[1])

    def run(self, execution, graph: bool = False, backend: str | None = None, watch=None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the layer adds to its input, in fp32: its output's hidden + residual less the input's; the K/V it
        wrote at the pass's slots), with `execution`, eager or replayed from a CUDA graph, through attention
        `backend` (by default the rig's), its metadata planned for the pass first as a model runner plans it;
        `share` then holds the pass's Project-Only share. An eager pass runs within `watch` (a context manager:
        `vskipper.mixed.host_waits`), the planning and the KV state's restore outside it."""
        world = self.rig.world
        world.slot.execution = execution
        world.plan(self.fb, backend)
        self.restore()
        hidden, residual = self.hidden.clone(), self.residual.clone()
        layer_pass = self.rig.pass_fn(self.fb, hidden, self.route, residual)

        def passed():  # the inputs set again first (the pass updates the residual in place)
            hidden.copy_(self.hidden)
            residual.copy_(self.residual)
            return layer_pass()

        with world.context(backend):
            if graph:
                h, r = replayed(passed, self.restore)
            else:
                with watch or nullcontext():
                    h, r = passed()
        return self.outcome(layer_pass, h, r)

    def replayed_as(self, execution, batch: Case, graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """This case's pass captured (a CUDA graph, or `EagerGraph` where none is) from static plan buffers, as a
        server's routed decode graph is (`SkipperCausalLM.capture_pass`), then replayed for `batch`: SGLang's
        tensors of the batch padded to the graph's size copied into those the graph holds, as its graph runner
        copies them, and the batch's plan written into the buffers as a server writes it (`write_plan`: its
        rows, the rest padding; on CUDA its keys staged in pinned host memory and copied over at once, its
        request slots copied on the device). `batch`'s outcome (`run`). This
        case's batch is spent (its tensors hold `batch`'s after)."""
        world, rows = self.rig.world, self.hidden.shape[0]
        world.slot.execution = execution
        world.plan(self.fb)
        self.restore()
        buffers = PlanBuffers(rows, self.hidden.device)
        buffers.frozen = True  # a graph holds their addresses
        buffers.write(self.fb.req_pool_indices, request_keys(self.fb.req_pool_indices).cpu())
        hidden, residual = self.hidden.clone(), self.residual.clone()
        inputs = (self.hidden.clone(), self.residual.clone())  # what each replay's pass is handed
        layer_pass = self.rig.pass_fn(self.fb, hidden, self.route, residual, plan_buffers=buffers)

        def passed():
            hidden.copy_(inputs[0])
            residual.copy_(inputs[1])
            return layer_pass()

        with world.context():
            replay, (h, r) = capture(passed, graph)
            for name in ("positions", "req_pool_indices", "seq_lens", "out_cache_loc"):
                getattr(self.fb, name).copy_(getattr(batch.fb, name))
            slots = batch.fb.req_pool_indices[: batch.real]  # the batch's own, on the device
            buffers.write(slots, request_keys(slots).cpu())
            inputs[0].copy_(batch.hidden)
            inputs[1].copy_(batch.residual)
            batch.restore()
            replay.replay()
        if hidden.device.type == "cuda":
            torch.cuda.synchronize()
        return batch.outcome(layer_pass, h, r)

    def outcome(self, layer_pass, h: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the layer adds, the K/V it wrote) at this case's `real` rows, from a pass's output (h, r); `share`
        then holds the Project-Only share of those rows."""
        real, pool, lid = self.real, self.rig.world.pool, self.rig.lid
        loc = self.fb.out_cache_loc[:real]
        written = torch.cat([pool.get_key_buffer(lid)[loc], pool.get_value_buffer(lid)[loc]], dim=1)
        added = (h.float() + r.float() - self.hidden.float() - self.residual.float())[:real]
        self.share = project_only_share(layer_pass, real)
        return added, written.flatten(1).float()


def poisoned(rig: ServedRig, clean: tuple[torch.Tensor, torch.Tensor], readable: dict[int, int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K and V (`clean`) with NaN in every slot the pass must not read: each request's positions from
    `readable[request]` on (its length after the pass; every position of a request outside it). A read past a
    row's position or of another request's keys then turns its row to NaN, however little one key weighs in a
    long context, where a row's 5% would hide it."""
    world = rig.world
    k, v = clean[0].clone(), clean[1].clone()
    for request in range(len(world.lengths)):
        slots = world.req_pool.req_to_token[world.request_slot(request), readable.get(request, 0):].long()
        k[slots] = float("nan")
        v[slots] = float("nan")
    return k, v


def replayed(fn, restore):
    """fn captured in a CUDA graph (`mixed_depth_bench.captured`), replayed once from the KV state `restore` sets:
    the replay's output."""
    graph, out = captured(fn)
    restore()
    graph.replay()
    torch.cuda.synchronize()
    return out


def row_strays(got: torch.Tensor, want: torch.Tensor) -> float:
    """The worst row's largest deviation of `got` from `want`, as a share of that row's largest value in `want`
    (per row: a Project-Only row's adapter adds far less than a RUN row's MLP, and a wrong one must not hide
    under the RUN rows' scale). NaN anywhere is a deviation past any bound."""
    diff = (got - want).abs().amax(dim=1)
    scale = want.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    worst = (diff / scale).max()
    return float("inf") if torch.isnan(worst) else float(worst)


def compared(case: Case, execution, reference, graph: bool = False, backend: str | None = None):
    """(`case` run with the served `execution`, eager or replayed, through `backend`; run with the `reference`
    execution; the served run's Project-Only share)."""
    return case.run(execution, graph=graph, backend=backend), case.want(reference), case.share


def replay_compared(case: Case, batch: Case, base: Case, execution, reference, graph: bool):
    """(`batch` replayed from `case`'s graph (`Case.replayed_as`) with the served `execution`; `base`, the batch
    `batch` pads, run with the `reference` execution; the replay's Project-Only share of the batch's rows)."""
    return case.replayed_as(execution, batch, graph), base.want(reference), batch.share


def refused(why: str):
    raise RuntimeError(why)


def not_checked(name: str, exc: Exception) -> dict:
    """A case that could not run (the capture refused, a launch failed, the servers' backend not built): reported
    as such, not checked and not passed."""
    error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    print(f"  {name:72} NOT CHECKED: {error}", flush=True)
    return {"case": name, "ok": False, "error": error}


def verdict(name: str, run) -> dict:
    """One case: `run()` gives (got, want, the pass's Project-Only share), got and want each (what the layer
    adds, the K/V it wrote), the served execution's and the torch execution's; each row's deviation beside
    `LAYER_RTOL`. A case that cannot run (the capture refused, a launch failed, the servers' backend not built)
    is reported as such: not checked, not passed."""
    try:
        got, want, share = run()
    except Exception as exc:
        return not_checked(name, exc)
    out_err, kv_err = row_strays(got[0], want[0]), row_strays(got[1], want[1])
    ok = out_err <= LAYER_RTOL and kv_err <= LAYER_RTOL
    print(f"  {name:72} Project-Only {share:4.2f}  output {out_err:9.3g}  K/V {kv_err:9.3g} of their rows' "
          f"largest values  {'ok' if ok else 'STRAYS'}", flush=True)
    return {"case": name, "ok": ok, "output_error": out_err, "kv_error": kv_err, "project_only_share": share}


def wait_verdict(name: str, case: Case, execution, device: torch.device, backend: str | None = None,
                 dead: str | None = None) -> dict:
    """One pass of `case` with the served `execution` (warm: after its checked run), eager, watched for host waits
    (`vskipper.mixed.host_waits.host_waits`: on a GPU the CUDA runtime's own report of each synchronizing call),
    and upstream's dense pass of the same rows through the same backend, warm and watched alike. It passes where
    no wait's nearest frame is vSkipper's and no other site (SGLang's code, as its attention backend's read, which
    a dense pass makes alike) waits more often than in the dense pass. Where the watch sees nothing here (`dead`: why,
    from `host_waits.live`), not checked."""
    if dead:
        return not_checked(name, RuntimeError(f"the host-wait watch is not live on this build: {dead}"))
    routed, dense = host_waits(device), host_waits(device)
    try:
        case.run(execution, backend=backend, watch=routed)
        control = case.dense()
        control.run(execution, backend=backend)  # warm, as the routed pass is: a first call's work is not counted
        control.run(execution, backend=backend, watch=dense)
    except Exception as exc:  # noqa: BLE001 (a pass that cannot run is this case's finding)
        return not_checked(name, exc)
    own = [w for w in routed.found if w.own]
    extra = Counter(w.where for w in routed.found if not w.own) - Counter(w.where for w in dense.found if not w.own)
    held = own + [w for w in routed.found if not w.own and extra[w.where] > 0]
    ok = not held
    print(f"  {name:72} {len(own)} of vSkipper's, {len(routed.found) - len(own)} elsewhere (dense: "
          f"{len(dense.found)})  {'ok' if ok else 'WAITS'}"
          + "".join(f"\n      {w.what} at {w.where}" for w in routed.found), flush=True)
    return {"case": name, "ok": ok, "waits": [w._asdict() for w in routed.found],
            "dense_waits": [w._asdict() for w in dense.found], "held": [w._asdict() for w in held]}


ISSUE_REPS = DEVICE_CASES["issue_reps"]  # warm passes a side `issue_timing` times (their median is the figure)
HOST_BOUND = 0.9  # a pass whose host issued it in this share of the device's span or more kept the device waiting


class PassClock:
    """Around one eager pass (`Case.run`'s watch): the host's seconds from its start to its last launch issued
    (and any wait inside it) and, on CUDA, the device's span of it (events recorded as it starts and ends, the
    device idle before: the span then holds whatever the device waited for the host's next launch)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host_s: float | None = None
        self.device_s: float | None = None

    def __enter__(self) -> PassClock:
        if self.cuda:
            torch.cuda.synchronize()
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        self.host_s = time.perf_counter() - self._t0
        if self.cuda and exc_type is None:  # a failed pass's error stands (a CUDA error would make these raise)
            self._events[1].record()
            self._events[1].synchronize()
            self.device_s = self._events[0].elapsed_time(self._events[1]) / 1e3
        return False


def issue_timing(name: str, case: Case, execution, device: torch.device, backend: str | None = None,
                 dense_backend: str | None = None, reps: int = ISSUE_REPS, dead: str | None = None) -> dict:
    """Whether the host or the device sets a pass's time: the host's milliseconds to issue one warm eager pass of
    `case` beside the device's span of it (`PassClock`), the median of `reps`, for the served execution (through
    `backend`) and for upstream's dense pass of the same rows (through `dense_backend`: the servers' attention
    backend, as a dense server reads), each side first run once more under the host-wait watch
    (`host_waits`). Where the host took `HOST_BOUND` of the device's span or more (the median of the passes'
    shares) in a pass that waits for nothing, the device waited on the host's launches (`host_bound`): fewer or
    cheaper launches, not faster kernels, would shorten the pass. A pass that waits, or whose waits the watch
    cannot see (`dead`), gets no verdict: its host time holds the device's. On CPU the device is the host: no
    span, no verdict."""

    def timed(pass_case: Case, through: str | None) -> dict:
        watch = host_waits(device)
        pass_case.run(execution, backend=through, watch=watch)
        waits = None if dead else len(watch.found)
        clocks = [PassClock(device) for _ in range(reps)]
        for clock in clocks:
            pass_case.run(execution, backend=through, watch=clock)
        host = statistics.median(c.host_s for c in clocks)
        share = (round(statistics.median(c.host_s / c.device_s for c in clocks), 4)  # the verdict reads it so
                 if all(c.device_s for c in clocks) else None)
        span = statistics.median(c.device_s for c in clocks) if share is not None else None
        return {"backend": through, "waits": waits, "host_ms": round(host * 1e3, 4),
                "device_ms": None if span is None else round(span * 1e3, 4),
                "host_share": share,
                "host_bound": None if share is None or waits != 0 else share >= HOST_BOUND}

    try:
        routed, dense = timed(case, backend), timed(case.dense(), dense_backend)
    except Exception as exc:  # noqa: BLE001 (a pass that cannot run is this case's finding)
        return not_checked(name, exc)

    def said(side: dict) -> str:
        span = "no span" if side["device_ms"] is None else f"device {side['device_ms']:.3f} ms"
        waits = "waits not seen" if side["waits"] is None else f"{side['waits']} waits"
        return f"host {side['host_ms']:.3f} ms, {span}, {waits}" + (", host-bound" if side["host_bound"] else "")

    print(f"  {name:72} routed: {said(routed)}; dense: {said(dense)}", flush=True)
    return {"case": name, "ok": True, "routed": routed, "dense": dense}


def timed_warm(layer, execution, hidden: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The warm-up a served model runs when it is built (`warm_layer`), first in this process, on this layer: its
    seconds and the Triton compilations it made (`compile_watch`), built or loaded from Triton's cache: what a
    routed server's start pays for it on this device."""
    from benchmarks.gpu.headline import compiles_between
    from vskipper.sglang import compile_watch
    from vskipper.sglang.models.routed import warm_layer

    compile_watch.install()
    before = compile_watch.attestation()
    t0 = time.perf_counter()
    warm_layer(layer, execution, hidden, dtype, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"seconds": round(time.perf_counter() - t0, 3),
            "compiled": compiles_between(before, compile_watch.attestation())}


def stand_in_ops_cases(device: torch.device, dtype: torch.dtype, size, rows: tuple[int, ...],
                       timing_reps: int | None = None) -> list[dict]:
    """SGLang's RMSNorm, SiLU-and-mul and RoPE through the stand-in ops' hooks (`vskipper.sglang.stand_in_ops`)
    against SGLang's torch path on the same operands, at each of `rows`: each case's worst row beside `OPS_RTOL`,
    whether every call took the kernels, and each side's host and device time a call (`op_timing`: `timing_reps`
    calls a side; by default `OPS_TIMING_REPS` on CUDA, none elsewhere, where the interpreter runs the kernels)."""
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    from vskipper.sglang import stand_in_ops

    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    reps = (OPS_TIMING_REPS if device.type == "cuda" else 0) if timing_reps is None else timing_reps

    # Llama-3's rotary embedding (base 500,000, NeoX halves), its cos/sin cache as SGLang keeps it on the device
    rope = RotaryEmbedding(size.head_dim, size.head_dim, ROPE_POSITIONS, 500000, True, dtype).to(device)
    results = []
    for n in rows:
        for width, residual in ((size.hidden, True), (size.hidden, False), (size.head_dim, False)):
            norm = RMSNorm(width, eps=1e-5).to(device, dtype)
            norm.weight.copy_(1.0 + 0.5 * randn(width))
            x, r = randn(n, width) * 3, randn(n, width)
            args = (x, r) if residual else (x,)
            name = f"stand-in ops: RMSNorm of {n} x {width}" + (" with its residual add" if residual else "")
            results.append(op_verdict(name, lambda norm=norm, args=args: stand_in_ops.around_rmsnorm(
                RMSNorm.forward_native, norm, *args), lambda norm=norm, args=args: norm.forward_native(*args),
                device, reps))
        z = randn(n, 2 * size.intermediate) * 4
        results.append(op_verdict(f"stand-in ops: SiLU-and-mul of {n} x {2 * size.intermediate}",
                                  lambda z=z: stand_in_ops.around_silu_and_mul(SiluAndMul.forward_native, None, z),
                                  lambda z=z: SiluAndMul.forward_native(None, z), device, reps))
        # RoPE of the query and key views of one fused QKV projection, as the layers split it, at positions up to
        # the device run's context length
        qkv = randn(n, (size.heads + 2 * size.kv_heads) * size.head_dim) * 3
        q, k, _ = qkv.split([size.heads * size.head_dim, *2 * [size.kv_heads * size.head_dim]], dim=-1)
        positions = torch.randint(0, ROPE_POSITIONS, (n,), generator=gen).to(device)
        results.append(op_verdict(f"stand-in ops: RoPE of {n} x ({size.heads} + {size.kv_heads}) heads of "
                                  f"{size.head_dim}",
                                  lambda q=q, k=k, p=positions: stand_in_ops.around_rope(
                                      RotaryEmbedding.forward_native, rope, p, q, k),
                                  lambda q=q, k=k, p=positions: rope.forward_native(p, q, k), device,
                                  reps))
    return results


def routes_cases(device: torch.device, dtype: torch.dtype, rows: tuple[int, ...], layers: int = 16) -> list[dict]:
    """Each of `ROUTES`' skippers' fused routes (`vskipper.mixed.routes.fused_state`) against its own
    `prepare_batch` at each of `rows`: the run flags and weights equal, or the case strays."""
    from vskipper.mixed.routes import fused_state
    from vskipper.skippers.base import BatchContext

    gen = torch.Generator().manual_seed(0)
    results = []
    for n in rows:
        keys = torch.randint(-2 ** 62, 2 ** 62, (n,), generator=gen).to(device)
        positions = torch.randint(0, 8192, (n,), generator=gen).to(device)
        valid = (torch.rand(n, generator=gen) > 0.1).to(device)
        batch = BatchContext(torch.empty(n, 8, dtype=dtype, device=device), valid, tuple(range(layers, 2 * layers)),
                             "decode", keys, positions)
        for arm, skipper in ROUTES.items():
            name = f"fused routes of {n} rows over {layers} layers, {arm}"
            try:
                got, want = fused_state(skipper, batch), skipper.prepare_batch(batch)
                differ = int((got["run"] != want["run"]).sum()) + int((got["weights"] != want["weights"]).sum())
            except Exception as exc:  # noqa: BLE001 (a launch that fails is this case's finding)
                results.append(not_checked(name, exc))
                continue
            print(f"  {name:72} {differ} flags or weights differ  {'ok' if differ == 0 else 'STRAYS'}", flush=True)
            results.append({"case": name, "ok": differ == 0, "output_error": float(differ), "kv_error": 0.0})
    return results


def gate_cases(device: torch.device, dtype: torch.dtype, size, rows: tuple[int, ...]) -> list[dict]:
    """Each trained gate's fused route (`vskipper.mixed.router.gate_route`) against its own `route` at each of
    `rows`, over one router of `size`'s widths: the flags equal where the router's weight is clear of the threshold
    by `GATE_MARGIN`, and the weights there within `GATE_ATOL`, or the case strays."""
    from vskipper.constants import CONSTANTS
    from vskipper.mixed.router import gate_route
    from vskipper.modelspec import router_sizes
    from vskipper.skippers.modules import SkipRouter
    from vskipper.skippers.trained_gate import FlexiDepthGate, HardGate

    hidden = size.hidden
    torch.manual_seed(0)
    router = SkipRouter(hidden, router_sizes({"hidden_size": hidden, "intermediate_size": hidden})[0])
    with torch.no_grad():  # weights spread on both sides of the threshold
        router.router_norm.weight.uniform_(0.5, 1.5)
        router.router_head.weight.mul_(4.0)
    router = router.to(device, dtype)
    gen = torch.Generator().manual_seed(0)
    results = []
    for n in rows:
        u = torch.randn(n, hidden, generator=gen).to(device, dtype)
        valid = (torch.rand(n, 1, generator=gen) > 0.1).to(device)
        for gate in (FlexiDepthGate(), HardGate()):
            name = f"fused gate of {n} rows, {gate.name}"
            try:
                got, want = gate_route(gate, u, valid, router), gate.route(0, u, valid, router)
                p = router(u).view(-1, 1)
                clear = ((p - CONSTANTS.router_run_threshold).abs() > GATE_MARGIN) | ~valid
                flags = int((got.run_mask != want.run_mask)[clear].sum())
                err = float((got.weights.float() - want.weights.float())[clear].abs().max()) if clear.any() else 0.0
            except Exception as exc:  # noqa: BLE001 (a launch that fails is this case's finding)
                results.append(not_checked(name, exc))
                continue
            ok = flags == 0 and err <= GATE_ATOL
            print(f"  {name:72} {flags} clear flags differ, weights within {err:.3g}  {'ok' if ok else 'STRAYS'}",
                  flush=True)
            results.append({"case": name, "ok": ok, "output_error": err, "kv_error": 0.0, "flags": flags,
                            "clear_rows": int(clear.sum())})
    return results


def op_timing(hooked, native, device: torch.device, reps: int = OPS_TIMING_REPS) -> dict:
    """Each side of a stand-in op's case timed alone, warm, `reps` calls a side taking turns (`PassClock`: the
    host's microseconds from the call to its return, its launches issued, and on CUDA the device's span of them):
    the medians, by side ('triton' the hooked path, 'torch' SGLang's). On CUDA the host's figure holds Triton's
    own launcher, which the CPU's benchmark (`benchmarks/stand_in_ops_bench.py`) does not time."""
    sides = {"triton": hooked, "torch": native}
    clocks: dict[str, list[PassClock]] = {side: [] for side in sides}
    for fn in sides.values():  # warm: compiled, the allocator's blocks cached
        fn()
    for i in range(reps):
        for side in (("triton", "torch") if i % 2 == 0 else ("torch", "triton")):
            with PassClock(device) as clock:
                sides[side]()
            clocks[side].append(clock)
    out = {}
    for side, timed in clocks.items():
        spans = [c.device_s for c in timed]
        out[side] = {"host_us": round(statistics.median(c.host_s for c in timed) * 1e6, 2),
                     "device_us": None if None in spans else round(statistics.median(spans) * 1e6, 2)}
    return out


def op_verdict(name: str, hooked, native, device: torch.device, reps: int = 0) -> dict:
    """One stand-in op's case: `hooked()` (through the hook, which must take the kernel) against `native()` on
    `device`; with `reps`, each side timed too (`op_timing`, `reps` calls a side)."""
    from vskipper.sglang import stand_in_ops

    before = stand_in_ops.calls()
    try:
        got, want = hooked(), native()
    except Exception as exc:  # noqa: BLE001 (a launch that fails is this case's finding)
        return not_checked(name, exc)
    taken = {path: n for (_op, path), n in (stand_in_ops.calls() - before).items()}
    pairs = zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,), strict=True)
    err = max(row_strays(g.float().reshape(-1, g.shape[-1]), w.float().reshape(-1, w.shape[-1])) for g, w in pairs)
    ok = err <= OPS_RTOL and taken == {"triton": 1}
    timing = op_timing(hooked, native, device, reps) if reps else None
    said = "" if timing is None else "; host us " + " / ".join(
        f"{side} {t['host_us']:.1f}" + ("" if t["device_us"] is None else f" (device {t['device_us']:.1f})")
        for side, t in timing.items())
    print(f"  {name:72} worst row {err:9.3g} of its largest value, path {taken}  {'ok' if ok else 'STRAYS'}{said}",
          flush=True)
    return {"case": name, "ok": ok, "output_error": err, "kv_error": 0.0, "paths": taken,
            **({"timing": timing} if timing is not None else {})}


def check(device: torch.device, dtype: torch.dtype, size, cases: dict, tile_table: Path | None, tmp: Path,
          stand_in_ops: bool = False) -> dict:
    """Every case of `cases` (`DEVICE_CASES` or `DRY_CASES`): the report `--json` writes."""
    from vskipper.sglang.standalone import init_sglang

    init_sglang(device.type)
    torch.set_grad_enabled(False)
    context, real = cases["context"], cases["padded"]
    graph_rows = capture_size(real, max(*cases["decode_rows"], real), device)
    rows_max = max(*cases["decode_rows"], graph_rows)  # request slots
    longest = max(context + 2, max(sum(p) for p in cases["prompts"]))
    hf_config, _ = served_config(size, dtype, tmp, longest)
    reference = torch_execution(device)
    backend, named = servers_backend()
    results, report = [], {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                           "attention_backend": backend, "reference_backend": REFERENCE_BACKEND}
    unbuilt = None if backend else (f"the servers' attention backend ({named or 'SGLang picks one'}) is not one a "
                                    f"standalone layer builds ({', '.join(ATTENTION_BACKENDS)})")

    def inputs(rig: ServedRig, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen, hidden = rig.world.gen, hf_config.hidden_size
        return (torch.randn(rows, hidden, generator=gen).to(device, dtype),
                torch.randn(rows, hidden, generator=gen).to(device, dtype))

    rig = ServedRig(hf_config, rows_max, context + 1, dtype, device, "triton", tile_table, serving_backend=named)
    served = rig.world.slot.execution
    report["execution"] = served.attestation()
    try:
        report["warm"] = timed_warm(rig.layer, served, hf_config.hidden_size, dtype, device)
    except Exception as exc:  # noqa: BLE001 (what stopped it is the report's: the cases show what runs)
        report["warm"] = {"error": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}
    print(f"  the served model's warm-up on this layer: {json.dumps(report['warm'])}")
    graphs = device.type == "cuda" and rig.graph_blocker is None  # as a server captures its routed decode graphs
    if device.type == "cuda" and not graphs:
        report["decode_graphs"] = f"not replayed: {rig.graph_blocker}"
    print(f"  the served execution: {json.dumps(report['execution'])}; the backend read through SGLang's "
          f"{backend or 'no'} attention backend" + (f" ({unbuilt})" if unbuilt else "")
          + (f"; decode {report['decode_graphs']}" if "decode_graphs" in report else ""))
    pool = rig.world.pool
    clean = (pool.get_key_buffer(rig.lid).normal_().clone(), pool.get_value_buffer(rig.lid).normal_().clone())

    def decode_case(rows: int, route, pad_to: int | None = None, reverse: bool = False) -> Case:
        """A decode batch of `rows` requests at `context` tokens, in order or `reverse`d (padded to `pad_to`
        rows: the servers' backend fills the padding rows' context); the same draws for the same rows."""
        rig.world.lengths = [context] * rows_max
        rig.world.gen.manual_seed(rows)
        fb = rig.world.batch({r: 1 for r in (reversed(range(rows)) if reverse else range(rows))})
        hidden, residual = inputs(rig, rows)
        kv0 = poisoned(rig, clean, {r: context + 1 for r in range(rows)})
        if pad_to is None:
            return Case(rig, fb, hidden, residual, route, kv0)
        pad_hidden, pad_residual = inputs(rig, pad_to - rows)
        return Case(rig, rig.world.padded(fb, pad_to, backend), torch.cat([hidden, pad_hidden]),
                    torch.cat([residual, pad_residual]), route, kv0, real=rows)

    waits = []  # the served execution's eager passes watched for host waits (`wait_verdict`)
    issued = []  # and timed, host against device (`issue_timing`)
    dead = report["host_waits_watch"] = live(device)  # None: the watch sees a known wait on this build
    for rows in cases["decode_rows"]:
        for arm, route in ROUTES.items():
            case = decode_case(rows, route)
            results.append(verdict(f"decode {rows} rows, context {context}, {arm}, eager",
                                   partial(compared, case, served, reference)))
            if rows == max(cases["decode_rows"]):
                waits.append(wait_verdict(f"decode {rows} rows, context {context}, {arm}", case, served, device,
                                          dead=dead))
                issued.append(issue_timing(f"decode {rows} rows, context {context}, {arm}", case, served, device,
                                           dense_backend=backend, reps=cases["issue_reps"], dead=dead))
            if graphs:
                results.append(verdict(f"decode {rows} rows, context {context}, {arm}, CUDA graph",
                                       partial(compared, case, served, reference, True)))
    # a graph captured for one batch (its requests in reverse: each row another request's than in the batch it is
    # replayed for, so request slots not written read another request's K/V), replayed for another padded to its size
    for arm, route in ROUTES.items():
        name = (f"decode {real} rows replayed from the graph of {graph_rows}, context {context}, {arm}"
                + ("" if graphs else ", eager stand-in"))
        if unbuilt:
            results.append(verdict(name, partial(refused, unbuilt)))
            continue
        results.append(verdict(name, lambda route=route: replay_compared(
            decode_case(graph_rows, route, reverse=True), decode_case(real, route, graph_rows),
            decode_case(real, route), served, reference, graphs)))
    rig = ServedRig(hf_config, 2, longest, dtype, device, "triton", tile_table, serving_backend=named)
    served = rig.world.slot.execution
    pool = rig.world.pool
    clean = (pool.get_key_buffer(rig.lid).normal_().clone(), pool.get_value_buffer(rig.lid).normal_().clone())
    for prompts in cases["prompts"]:
        rig.world.lengths = [0, 0]
        fb = rig.world.batch(dict(enumerate(prompts)))
        hidden, residual = inputs(rig, sum(prompts))
        kv0 = poisoned(rig, clean, dict(enumerate(prompts)))
        for arm, route in ROUTES.items():
            case = Case(rig, fb, hidden, residual, route, kv0)
            for read in ("packed", "backend"):
                name = f"prefill {' + '.join(map(str, prompts))} tokens, {arm}, {read} read"
                if read == "backend" and unbuilt:
                    results.append(verdict(name, partial(refused, unbuilt)))
                    continue
                execution = replace(served, prefill_read=read)
                through = backend if read == "backend" else None
                results.append(verdict(name, partial(compared, case, execution, reference, backend=through)))
                waits.append(wait_verdict(name, case, execution, device, through, dead))
                issued.append(issue_timing(name, case, execution, device, through, backend or through,
                                           cases["issue_reps"], dead))
    rows = (1, real, max(sum(p) for p in cases["prompts"]))  # one row, a padded decode batch's, a prefill's
    results += routes_cases(device, dtype, rows)
    results += gate_cases(device, dtype, size, rows)
    if stand_in_ops:
        results += stand_in_ops_cases(device, dtype, size, rows)
    report.update(cases=results, ok=all(r["ok"] for r in results), rtol=LAYER_RTOL, host_waits=waits,
                  host_issue=issued, host_issue_rule={"reps": cases["issue_reps"], "host_bound": HOST_BOUND})
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tile-table", type=Path, help="the table the servers take (`vskipper tune-tiles`); default: "
                   "the one shipped for this device")
    p.add_argument("--json", type=Path, help="write the cases here")
    p.add_argument("--dry-run", action="store_true", help="on CPU, the Triton interpreter and a tiny model")
    p.add_argument("--stand-in-ops", choices=STAND_IN_OPS, default="torch",
                   help="the servers' RMSNorm, SiLU-and-mul and RoPE (`vskipper serve --stand-in-ops`): triton "
                        "checks them")
    args = p.parse_args(argv)
    from benchmarks.gpu.bundle import check_stamp

    stamp = check_stamp(args.tile_table, args.stand_in_ops)  # before the check sets SGLang's variables of its own
    if args.dry_run:
        device, dtype, size, cases = torch.device("cpu"), torch.float32, SMOKE, DRY_CASES
    else:
        if not torch.cuda.is_available():
            print("check_served: no GPU visible; --dry-run checks on CPU", file=sys.stderr)
            return 2
        device, dtype, size, cases = torch.device("cuda"), torch.bfloat16, LLAMA3_8B, DEVICE_CASES
    print(f"the served routed layer against its torch execution ({'dry run, CPU' if args.dry_run else device})")
    with tempfile.TemporaryDirectory(prefix="check-served-") as tmp:
        report = check(device, dtype, size, cases, args.tile_table, Path(tmp), args.stand_in_ops == "triton")
    failed = [r["case"] for r in report["cases"] if not r["ok"]]
    print(f"{len(report['cases']) - len(failed)} of {len(report['cases'])} cases within {LAYER_RTOL} of the torch "
          f"execution's rows" + (f"; STRAYING OR NOT CHECKED: {', '.join(failed)}" if failed else ""))
    waiting = [w["case"] for w in report["host_waits"] if not w["ok"]]
    print(f"{len(report['host_waits']) - len(waiting)} of {len(report['host_waits'])} served passes make the host "
          f"wait in none of vSkipper's code" + (f"; WAITING OR NOT CHECKED: {', '.join(waiting)}" if waiting else ""))
    if args.json:
        report["stamp"] = stamp  # what a later run on this device may reuse it for
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
