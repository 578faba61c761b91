#!/usr/bin/env python3
"""Mixed-depth execution, measured side by side in one run (needs a GPU; `--smoke` runs a tiny CPU version).

1. Cohort GEMMs vs torch: for the 48 (operation, count range) shapes of the tile table, the Triton cohort
   kernels (tiles from the device's table) against torch/cuBLAS on the same packed rows; ratio = kernel / torch,
   each beside the shape's roofline floor on a catalogued GPU (`vskipper.roofline.gemm_floor_ms`: its bytes at
   the bandwidth or its multiply-adds at the peak, whichever is longer).
2. Decode: per-step latency of a 32-layer Llama-3-8B-sized stack (random weights, routed layers 16..31, paged
   KV), dense vs routed (RandomSkip r=1, d=s: every row projects at a fraction s of the routed layers), over a
   rows x context grid, both replayed from CUDA graphs captured per row count. Each mode's latency is fitted
   to a line in the resident tokens V = rows x context; tau = routed intercept - dense intercept, the measured
   crossover V_x = tau / (dense slope - routed slope), printed beside the rule's V* for the detected device.
3. Prefill: one prompt of 1k, 2k and 4k tokens, dense vs routed at s, eager (prefill is never captured).
Sections 2 and 3 run the routed-layer body over the engine-free stack's own modules (`vskipper.mixed.bench_stack`).
4. The served layer: SGLang's routed decoder layer as the server builds and runs it (`vskipper.sglang.standalone`:
   the model family's SGLang layer with the routed body, SGLang's KV pool and linear methods, the cohort execution
   the server picks on the device, the skipper's route and the tape inside the forward), one routed layer of the
   same shape. Decode over the same rows x context grid, replayed from a CUDA graph per cell where the server
   would capture the routed variant; prefill one prompt per length, eager. The control is always-route RandomSkip
   r = 0 (the routed path, nothing skipped), against r = 1, d = s; each ratio beside the layer's bandwidth limit
   (decode) or FLOP limit (prefill). Upstream's dense forward is timed too where its attention backend here
   (SGLang's torch-native one) is the server's: on CPU.

Run:  python benchmarks/mixed_depth_bench.py [--rows 32,64,128,192] [--contexts 512,1024,2048,3072] [--s 0.5]
      python benchmarks/mixed_depth_bench.py --smoke      (tiny model on CPU; numbers mean nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "--smoke" in sys.argv and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # the smoke run's kernel section uses the interpreter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from vskipper.checkpoint import TinySize, tiny_config  # noqa: E402
from vskipper.mixed.bench_stack import BenchStack, ForwardBatch  # noqa: E402
from vskipper.mixed.tiles import COUNT_RANGES, OPERATIONS, is_prefill  # noqa: E402
from vskipper.mixed.tuner import Clock, op_dims, op_weights, representative_rows, shape_calls, time_shape  # noqa: E402
from vskipper.roofline import derive_thresholds, find_device, gemm_floor_ms, kv_bytes_per_token_layer  # noqa: E402
from vskipper.skippers.random_skip import RandomSkip  # noqa: E402

LLAMA3_8B = TinySize(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128,
                     vocab=128256, reduction=16)
SMOKE = TinySize(layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=256,
                 reduction=16)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


# -- 1. cohort GEMMs vs torch -------------------------------------------------------------------------------

def bench_kernels(size: TinySize, device: torch.device, dtype: torch.dtype, smoke: bool,
                  tile_table: Path | None = None) -> list[dict]:
    from vskipper.mixed.kernels import INTERPRETER_TILE, device_tile_table

    table = device_tile_table(device, tile_table) if device.type == "cuda" else None
    # each shape beside its roofline floor on a catalogued GPU (none on CPU, where the interpreter runs)
    catalogued = find_device(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    g = torch.Generator().manual_seed(0)
    results = []
    ranges = COUNT_RANGES[:1] if smoke else COUNT_RANGES
    for op in OPERATIONS:
        k_dim, n_dim = op_dims(op, size.hidden, size.intermediate, size.intermediate // size.reduction,
                               size.heads * size.head_dim)
        w1, w2 = op_weights(op, n_dim, k_dim, g, device, dtype)
        for lo, hi in ranges:
            rows = representative_rows(lo, hi)
            tile = table.lookup(op, rows) if table else INTERPRETER_TILE
            ref, kernel, half, check = shape_calls(op, rows, w1, w2, g, device, dtype)
            interpret = device.type != "cuda"
            # as the tuner times them (decode ranges in CUDA graphs, eager where capture fails), once the tile's
            # output matched the gathered form's (a tile that strays is refused: the bench stops, naming it)
            timed = time_shape(f"{op} rows {lo}..{hi}", ref, kernel, half, [tile], Clock(None, 1), interpret,
                               graph=not is_prefill(lo) and not interpret, log=print, check=check)
            t_ref, t_ker = timed["torch_ms"], timed["kernel_ms"]
            t_half = timed.get("kernel_half_ms")  # None where the gathered form could not be captured
            serves = "gathered" if table is not None and table.gathers(op, rows) else "kernel"
            floor = None if catalogued is None else gemm_floor_ms(
                rows, n_dim, k_dim, 2 if op.endswith("gate_up") else 1, torch.finfo(dtype).bits // 8, catalogued)
            results.append({"op": op, "rows": [lo, hi], "K": k_dim, "N": n_dim, "kernel_ms": t_ker,
                            "kernel_half_ms": t_half, "torch_ms": t_ref, "ratio": t_ker / t_ref, "serves": serves,
                            "timed": timed["timed"], "tile": str(tile), "floor_ms": floor})
            print(f"  {op:13} rows {lo:>3}..{hi if hi else '':<4} K={k_dim:<6} N={n_dim:<6} kernel "
                  f"{t_ker:8.4f} ms (half live {'not timed' if t_half is None else f'{t_half:8.4f}'})  gathered torch {t_ref:8.4f} ms  ratio "
                  f"{t_ker / t_ref:5.2f}x  serves {serves}"
                  + ("" if floor is None else f"  floor {floor:8.4f} ms (kernel {t_ker / floor:5.2f}x, torch "
                                              f"{t_ref / floor:5.2f}x)"), flush=True)
    ratios = sorted(r["ratio"] for r in results)
    print(f"  median ratio over {len(ratios)} shapes: {statistics.median(ratios):.2f}x "
          f"(min {ratios[0]:.2f}, max {ratios[-1]:.2f})")
    return results


# -- 2. decode latency grid ---------------------------------------------------------------------------------

class DecodeRig:
    """Static inputs for one row count, a cache sized for the largest context, and a captured step per mode."""

    def __init__(self, model: BenchStack, kv, rows: int, page_size: int) -> None:
        self.model, self.kv, self.rows = model, kv, rows
        dev = model.device
        self.ids = torch.randint(0, model.config["vocab_size"], (rows,), device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.batch = ForwardBatch(self.positions, torch.arange(rows, device=dev),
                                  torch.ones(rows, dtype=torch.bool, device=dev), "decode",
                                  request_keys=torch.arange(rows, device=dev) * 7919 + 11)

    def step(self, skipper):
        return self.model(self.ids, self.batch, self.kv, skipper)


def captured(fn, warmups: int = 1):
    """fn captured in a CUDA graph after `warmups` calls on a side stream (which compile what it launches):
    (the graph, the output the capture returned, which each replay refills)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_step(fn, use_graph: bool, reps: int) -> float:
    if not use_graph:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    graph, _ = captured(fn, warmups=2)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def bench_decode(model: BenchStack, rows_grid: list[int], contexts: list[int], s: float, page_size: int,
                 use_graph: bool, reps: int) -> dict:
    max_rows, max_ctx = max(rows_grid), max(contexts) + 1
    pages_per_request = -(-max_ctx // page_size)
    kv = model.new_kv_cache(1 + max_rows * pages_per_request, page_size, max_rows, max_ctx)
    for r in range(max_rows):
        kv.assign_pages(r, range(1 + r * pages_per_request, 1 + (r + 1) * pages_per_request))
    kv.k.normal_()
    kv.v.normal_()
    skipper = RandomSkip(r=1.0, d=s, seed=0)
    cells = []
    for rows in rows_grid:
        rig = DecodeRig(model, kv, rows, page_size)
        # The graphs read positions as data: one capture per (rows, mode) would serve every context; capturing
        # per cell keeps the rig simple and costs only capture time.
        for ctx in contexts:
            rig.positions.fill_(ctx)
            dense = time_step(lambda rig=rig: rig.step(None), use_graph, reps)
            routed = time_step(lambda rig=rig: rig.step(skipper), use_graph, reps)
            cells.append({"rows": rows, "context": ctx, "V": rows * (ctx + 1), "dense_ms": dense,
                          "routed_ms": routed, "speedup": dense / routed})
            print(f"  rows {rows:>4} ctx {ctx:>6} V {rows * (ctx + 1):>9}  dense {dense:8.3f} ms  routed "
                  f"{routed:8.3f} ms  dense/routed {dense / routed:5.3f}", flush=True)
    vs = [c["V"] for c in cells]
    a_d, b_d = fit_line(vs, [c["dense_ms"] for c in cells])
    a_r, b_r = fit_line(vs, [c["routed_ms"] for c in cells])
    tau = a_r - a_d
    crossover = tau / (b_d - b_r) if b_d > b_r else float("inf")
    print(f"  dense line:  {a_d:.3f} ms + {b_d * 1e6:.3f} ms per 1M tokens")
    print(f"  routed line: {a_r:.3f} ms + {b_r * 1e6:.3f} ms per 1M tokens")
    print(f"  tau (intercept difference) = {tau:.3f} ms over {len(model.routed_layers)} routed layers "
          f"(paper, A100: 2.67 ms); measured crossover V_x = {crossover:,.0f} tokens")
    return {"cells": cells, "dense_line": [a_d, b_d], "routed_line": [a_r, b_r], "tau_ms": tau,
            "crossover_tokens": crossover}


# -- 3. prefill -------------------------------------------------------------------------------------------

def bench_prefill(model: BenchStack, lengths: list[int], s: float, page_size: int, reps: int) -> list[dict]:
    dev = model.device
    max_len = max(lengths)
    pages = -(-max_len // page_size)
    kv = model.new_kv_cache(1 + pages, page_size, 1, max_len)
    kv.assign_pages(0, range(1, 1 + pages))
    skipper = RandomSkip(r=1.0, d=s, seed=0)
    out = []
    for n in lengths:
        ids = torch.randint(0, model.config["vocab_size"], (n,), device=dev)
        batch = ForwardBatch(torch.arange(n, device=dev), torch.zeros(n, dtype=torch.int64, device=dev),
                             torch.ones(n, dtype=torch.bool, device=dev), "prefill",
                             request_keys=torch.full((n,), 12345, device=dev))
        times = {}
        for mode, sk in (("dense", None), ("routed", skipper)):
            def run(sk=sk, ids=ids, batch=batch):
                model(ids, batch, kv, sk)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            times[mode] = time_step(run, False, reps)
        out.append({"tokens": n, **{f"{k}_ms": v for k, v in times.items()},
                    "speedup": times["dense"] / times["routed"]})
        print(f"  {n:>6} tokens  dense {times['dense']:9.2f} ms  routed {times['routed']:9.2f} ms  "
              f"dense/routed {times['dense'] / times['routed']:5.3f}", flush=True)
    return out


# -- 4. the served layer ------------------------------------------------------------------------------------

def served_config(size: TinySize, dtype: torch.dtype, out: Path, longest: int):
    """The FlexiDepth-Llama config of `size` as SGLang's layers take it (a transformers config; no weights),
    its rotary table long enough for `longest` positions."""
    from transformers import AutoConfig

    from vskipper.sglang.configs import register_configs

    register_configs()
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config("flexidepth-llama", size, dtype=str(dtype).removeprefix("torch."))
    config["max_position_embeddings"] = max(config["max_position_embeddings"], longest)
    (out / "config.json").write_text(json.dumps(config))
    return AutoConfig.from_pretrained(str(out)), config


def one_layer(config: dict) -> dict:
    """`config` reduced to one routed layer and no vocabulary: the limits of a single served layer."""
    return {**config, "num_hidden_layers": 1, "routing_layers": [0], "vocab_size": 0}


class ServedRig:
    """One served routed decoder layer (`vskipper.sglang.standalone`: SGLang's Llama layer with the routed body,
    SGLang's KV pool and attention backend, by default its torch-native one; random weights) and its passes as the
    served model runs them: the skipper's per-pass state, its route into the tape, the cohort maps and the routed
    body, all inside the forward, with the execution the server picks on this device (`cohort_execution`)."""

    def __init__(self, config, requests: int, context: int, dtype: torch.dtype, device: torch.device,
                 execution: str = "auto", tile_table: Path | None = None, attention_backend: str | None = None,
                 serving_backend: str | None = None) -> None:
        """`attention_backend`: the one the layer reads through (default: the torch-native one);
        `serving_backend`: the prefill backend of the servers whose execution the rig takes (`cohort_execution`:
        the table weighs the packed read against that backend's; None, SDPA's)."""
        from vskipper.sglang.models.routed import cohort_execution, routed_graph_blocker
        from vskipper.sglang.standalone import TORCH_NATIVE, StandaloneLayer

        self.world = StandaloneLayer(config, layer_id=config.routing_layers[0], requests=requests,
                                     slots=requests * context + 1, context=context, dtype=dtype, device=device,
                                     attention_backend=attention_backend or TORCH_NATIVE)
        self.layer = self.world.layer
        self.lid = self.layer.layer_id
        self.device = self.world.device
        self.world.slot.execution = cohort_execution([self.layer], self.device, execution, tile_table,
                                                     serving_backend)
        self.graph_blocker = routed_graph_blocker(self.world.slot.execution, self.device)

    def pass_fn(self, fb, x: torch.Tensor, skipper, residual: torch.Tensor | None = None, plan_buffers=None):
        """One forward of the layer over batch `fb`: upstream's dense forward (skipper None) or the routed pass;
        with `residual`, the layer is handed it as a served layer past the first is (its add-norm updates it in
        place), where without it x is the first layer's input, left as it is. With `plan_buffers` (a
        `PlanBuffers` of the pass's rows), the pass reads its request slots, keys and dense-mode rows from their
        views, as a server's captured decode graph does (each replay reads what was written into them before it);
        otherwise from `fb` (keys: `request_keys`). The skipper's state is prepared as a server prepares it for the
        execution the rig serves with (`Runtime.prepare_state`: in one launch for the triton execution)."""
        from vskipper.mixed.cohorts import CohortBuilder
        from vskipper.mixed.routes import fused_state
        from vskipper.mixed.tape import RouteTape
        from vskipper.sglang.models.routed import PassPlan, plan_pass
        from vskipper.sglang.runtime import Step
        from vskipper.skippers.base import BatchContext

        world, layer, rows = self.world, self.layer, x.shape[0]
        phase = "decode" if fb.forward_mode.is_decode() else "prefill"
        if plan_buffers is None:
            plan, dense_rows = plan_pass(fb, rows), None
            keys = request_keys(plan.req_rows)
        else:
            views = plan_buffers.views(rows)  # the decode read's host bound as planned (a captured read takes none)
            plan = PassPlan(views["req_rows"], plan_pass(fb, rows).context)
            keys, dense_rows = views["request_keys"], views["dense_rows"]
        valid = torch.ones(rows, dtype=torch.bool, device=self.device)
        tape, builder = RouteTape(rows, (self.lid,), x.dtype, self.device), CohortBuilder(rows, self.device)

        def run():
            if skipper is not None:
                batch = BatchContext(x, valid, (self.lid,), phase, keys, fb.positions)
                state = fused_state(skipper, batch) if world.slot.execution.decode == "triton" else None
                state = skipper.prepare_batch(batch) if state is None else state
                world.slot.step = Step(phase, True, skipper, state, tape, builder, dense_rows, rows, keys=keys)
                world.slot.plan = plan
            try:
                return layer(fb.positions, x, fb, residual)
            finally:
                world.slot.step = world.slot.plan = None

        run.tape = tape  # after a routed pass: its route (`project_only_share`)
        return run


def request_keys(req_rows: torch.Tensor) -> torch.Tensor:
    """Each row's request key (RandomSkip hashes it with the position) from its request slot: one key a request."""
    return req_rows * 7919 + 11


def project_only_share(fn, rows: int | None = None) -> float:
    """The share of rows (the first `rows`, by default all) a routed pass (`ServedRig.pass_fn`, run at least
    once) sent Project-Only at its layer."""
    run = fn.tape.run[0, : fn.tape.capacity if rows is None else rows]
    return float((~run).sum()) / run.shape[0]


def synced(fn, device: torch.device):
    """fn, waiting for the device after it (eager timing on CUDA)."""
    if device.type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize()

    return run


ARMS_NOTE = "the control s=0 (always-route RandomSkip r = 0: the routed path, nothing skipped) against r = 1, d = s"


def bench_served(size: TinySize, device: torch.device, dtype: torch.dtype, rows_grid: list[int],
                 contexts: list[int], prefill: list[int], s: float, use_graph: bool, reps: int, prefill_reps: int,
                 tmp: Path, report: dict, write, execution: str = "auto", tile_table: Path | None = None) -> None:
    """Decode, then prefill, of one served routed layer into `report` (`write` after each): the control s=0
    against r = 1, d = s (one routed layer: about a share s of its rows project), each beside the limit of what
    the Project-Only rows skip; and upstream's dense forward where SGLang's torch-native backend, the one this
    layer reads through, is the server's (CPU). `execution` 'auto' is the server's choice; the smoke run asks for
    'triton' (in the interpreter), the execution a GPU decodes with."""
    from vskipper.sglang.standalone import init_sglang

    init_sglang(device.type)
    torch.set_grad_enabled(False)
    longest = max(max(contexts) + 2, max(prefill))
    hf_config, config = served_config(size, dtype, tmp, longest)
    arms = {"s=0": RandomSkip(r=0.0, d=s, seed=0), f"s={s}": RandomSkip(r=1.0, d=s, seed=0)}
    timed = ({"dense": None} if device.type == "cpu" else {}) | arms
    if device.type != "cpu":
        print("  dense not timed: this layer reads attention through SGLang's torch-native backend, the server's "
              "is Triton")
    report["decode"] = served_decode(hf_config, one_layer(config), timed, s, rows_grid, contexts, dtype, device,
                                     use_graph, reps, report, execution, tile_table)
    write()
    report["prefill"] = served_prefill(hf_config, one_layer(config), timed, s, prefill, dtype, device,
                                       prefill_reps, execution, tile_table)
    write()


def served_decode(hf_config, layer_cfg: dict, timed: dict, s: float, rows_grid: list[int], contexts: list[int],
                  dtype: torch.dtype, device: torch.device, use_graph: bool, reps: int, report: dict,
                  execution: str, tile_table: Path | None = None) -> dict:
    from vskipper.modelspec import decode_bytes

    rig = ServedRig(hf_config, max(rows_grid), max(contexts) + 1, dtype, device, execution, tile_table)
    attested = rig.world.slot.execution.attestation()
    graphs = use_graph and rig.graph_blocker is None
    print(f"  execution {json.dumps(attested)}; decode "
          f"{'replayed from CUDA graphs' if graphs else 'eager (' + (rig.graph_blocker or 'no graphs') + ')'}")
    report["execution"], report["decode_graphs"] = attested, graphs
    pool = rig.world.pool
    pool.get_key_buffer(rig.lid).normal_()
    pool.get_value_buffer(rig.lid).normal_()
    cells = []
    with rig.world.context():
        for rows in rows_grid:
            x = torch.randn(rows, hf_config.hidden_size, generator=rig.world.gen).to(device, dtype)
            for ctx in contexts:
                rig.world.lengths = [ctx] * max(rows_grid)
                fb = rig.world.batch({r: 1 for r in range(rows)})
                ms, fns = {}, {}
                for arm, skipper in timed.items():
                    fns[arm] = fn = rig.pass_fn(fb, x, skipper)
                    ms[arm] = time_step(fn, True, reps) if graphs else time_step(synced(fn, device), False, reps)
                share = project_only_share(fns[f"s={s}"])  # RandomSkip's hash: about s of the rows, not exactly
                v = rows * (ctx + 1)
                width = torch.finfo(dtype).bits // 8
                limit = decode_bytes(layer_cfg, v, 0.0, width) / decode_bytes(layer_cfg, v, share, width)
                cell = {"rows": rows, "context": ctx, "V": v, **{f"{k}_ms": t for k, t in ms.items()},
                        "project_only_share": share, "speedup": ms["s=0"] / ms[f"s={s}"], "bandwidth_limit": limit}
                cells.append(cell)
                dense = f"dense {ms['dense']:8.3f}  " if "dense" in ms else ""
                print(f"  rows {rows:>4} ctx {ctx:>6} V {v:>9}  {dense}s=0 {ms['s=0']:8.3f}  s={s} "
                      f"{ms[f's={s}']:8.3f} ms  s=0/s={s} {cell['speedup']:5.3f} (Project-Only {share:.2f} of the "
                      f"rows; bandwidth limit {limit:5.3f})", flush=True)
    vs = [c["V"] for c in cells]
    lines = {arm: fit_line(vs, [c[f"{arm}_ms"] for c in cells]) for arm in timed}
    for arm, (a, b) in lines.items():
        print(f"  {arm:>6} line: {a:.4f} ms + {b * 1e6:.3f} ms per 1M resident tokens")
    ratios = sorted(c["speedup"] / c["bandwidth_limit"] for c in cells)
    print(f"  s=0/s={s} over its bandwidth limit: median {statistics.median(ratios):.3f} "
          f"(min {ratios[0]:.3f}, max {ratios[-1]:.3f}; above 1 is a question, not a win: on a GPU the arms would "
          f"not run the same work; on CPU the decode read is compute-bound and the bytes do not bound it)")
    return {"cells": cells, "lines": {k: list(v) for k, v in lines.items()}}


def served_prefill(hf_config, layer_cfg: dict, timed: dict, s: float, lengths: list[int], dtype: torch.dtype,
                   device: torch.device, reps: int, execution: str, tile_table: Path | None = None) -> list[dict]:
    from vskipper.modelspec import token_macs

    rig = ServedRig(hf_config, 1, max(lengths), dtype, device, execution, tile_table)
    # Read through SGLang's backend, Project-Only rows enter the attention read with a zero query (the limit says so).
    reads = rig.world.slot.execution.prefill_read == "backend"
    out = []
    with rig.world.context():
        for n in lengths:
            rig.world.lengths = [0]
            fb = rig.world.batch({0: n})
            x = torch.randn(n, hf_config.hidden_size, generator=rig.world.gen).to(device, dtype)
            fns = {arm: rig.pass_fn(fb, x, sk) for arm, sk in timed.items()}
            ms = {arm: time_step(synced(fn, device), False, reps) for arm, fn in fns.items()}
            share = project_only_share(fns[f"s={s}"])
            context = (n + 1) / 2
            limit = token_macs(layer_cfg, context, 0.0, 0.0)["per_token"] / \
                token_macs(layer_cfg, context, share, 0.0, reads)["per_token"]
            row = {"tokens": n, **{f"{k}_ms": t for k, t in ms.items()}, "project_only_share": share,
                   "speedup": ms["s=0"] / ms[f"s={s}"], "flop_limit": limit,
                   "project_only_rows_read": reads}
            dense = ""
            if "dense" in ms:
                row["dense_over_s"] = ms["dense"] / ms[f"s={s}"]
                dense = f"dense {ms['dense']:9.2f}  "
            out.append(row)
            print(f"  {n:>6} tokens  {dense}s=0 {ms['s=0']:9.2f}  s={s} {ms[f's={s}']:9.2f} ms  "
                  f"s=0/s={s} {row['speedup']:5.3f} (Project-Only {share:.3f} of the tokens{', read' if reads else ''}"
                  f"; FLOP limit {limit:5.3f})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script runs end to end")
    p.add_argument("--rows", default="32,64,128,192")
    p.add_argument("--contexts", default="512,1024,2048,3072")
    p.add_argument("--prefill", default="1024,2048,4096")
    p.add_argument("--s", type=float, default=0.5, help="skip ratio: share of routed decisions projecting")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--skip", default="", help="comma list of sections to skip: kernels,decode,prefill,served")
    p.add_argument("--json", help="also write every figure to this JSON file")
    p.add_argument("--tile-table", type=Path, help="a tile table measured on this GPU (`vskipper tune-tiles`) "
                   "instead of the one shipped for it (on CPU the interpreter's tile serves)")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    if args.smoke:
        device, dtype, size = torch.device("cpu"), torch.float32, SMOKE
        rows_grid, contexts, prefill = [2, 4], [8, 16], [16, 32]
        reps, use_graph = 2, False
    else:
        if not torch.cuda.is_available():
            print("mixed_depth_bench: no GPU visible; run with --smoke for the CPU check", file=sys.stderr)
            return 2
        device, dtype, size = torch.device("cuda"), torch.bfloat16, LLAMA3_8B
        rows_grid = [int(v) for v in args.rows.split(",")]
        contexts = [int(v) for v in args.contexts.split(",")]
        prefill = [int(v) for v in args.prefill.split(",")]
        reps, use_graph = args.reps, True

    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    catalogued = find_device(name) if device.type == "cuda" else None
    print(f"device: {name} (catalogue: {catalogued.name if catalogued else 'unknown'}); dtype {dtype}; "
          f"s = {args.s}")
    # the table its GEMMs were asked to serve with (a GPU's; on CPU the interpreter's one tile serves whatever is given)
    report: dict = {"device": name, "s": args.s, "smoke": args.smoke,
                    "tile_table": str(args.tile_table) if args.tile_table else None}

    def write(report: dict) -> None:  # after each section: what ran survives a later section's failure
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, default=float) + "\n")

    if "kernels" not in skip:
        print("1. cohort GEMM / torch on packed rows")
        report["kernels"] = bench_kernels(size, device, dtype, args.smoke, args.tile_table)
        write(report)

    config = tiny_config("flexidepth-llama", size, dtype=str(dtype).removeprefix("torch."))
    tiles = None  # the stack's GEMMs: the shipped table of the device, or the one given
    if device.type == "cuda" and args.tile_table:
        from vskipper.mixed.kernels import device_tile_table

        tiles = device_tile_table(device, args.tile_table)
    with torch.device(device):
        model = BenchStack(config, capacity=max(rows_grid), tiles=tiles).to(dtype).eval()
    print(f"model: {size.layers} layers, hidden {size.hidden}, routed {len(model.routed_layers)}; "
          f"attestation {json.dumps(model.attestation())}")

    if "decode" not in skip:
        print(f"2. decode per-step latency ({'CUDA graphs' if use_graph else 'eager'})")
        decode = bench_decode(model, rows_grid, contexts, args.s, args.page_size, use_graph, reps)
        report["decode"] = decode
        kv_bytes = kv_bytes_per_token_layer(size.kv_heads, size.head_dim, 2)
        if catalogued is not None:
            rule = derive_thresholds(catalogued.bandwidth_gbps, args.s, len(model.routed_layers), kv_bytes)
            measured_tau_rule = rule.v_star_tokens * decode["tau_ms"] / rule.tau_ms
            gap = decode["crossover_tokens"] / rule.v_star_tokens - 1
            print(f"  rule V* ({catalogued.name}, tau {rule.tau_ms:.2f} ms) = {rule.v_star_tokens:,.0f} tokens; "
                  f"with the measured tau = {measured_tau_rule:,.0f}; measured crossover / V* - 1 = {gap:+.1%}")
            report["rule_v_star_tokens"] = rule.v_star_tokens
        else:
            print("  (device not catalogued: no rule V* to compare with)")
        write(report)

    if "prefill" not in skip:
        print("3. prefill, one prompt (eager)")
        report["prefill"] = bench_prefill(model, prefill, args.s, args.page_size, max(3, reps // 4))

    print(f"attestation after the run: {json.dumps(model.attestation())}")
    write(report)
    del model

    if "served" not in skip:
        print(f"4. the served layer: SGLang's routed decoder layer alone, {ARMS_NOTE}")
        report["served"] = {}
        with tempfile.TemporaryDirectory(prefix="mixed-bench-") as tmp:
            bench_served(size, device, dtype, rows_grid, contexts, prefill, args.s, use_graph, reps,
                         max(3, reps // 4), Path(tmp), report["served"], lambda: write(report),
                         execution="triton" if args.smoke else "auto", tile_table=args.tile_table)
    report["complete"] = True
    write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
