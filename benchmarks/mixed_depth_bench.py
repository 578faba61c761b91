#!/usr/bin/env python3
"""Mixed-depth execution, measured side by side in one run (needs a GPU; `--smoke` runs a tiny CPU version).

1. Cohort GEMMs vs torch: for the 20 (operation, count range) shapes of the tile table, the Triton cohort
   kernels (tiles from the device's table) against torch/cuBLAS on the same packed rows; ratio = kernel / torch.
2. Decode: per-step latency of a 32-layer Llama-3-8B-sized stack (random weights, routed layers 16..31, paged
   KV), dense vs routed (RandomSkip r=1, d=s: every row projects at a fraction s of the routed layers), over a
   rows x context grid, both replayed from CUDA graphs captured per row count. Each mode's latency is fitted
   to a line in the resident tokens V = rows x context; tau = routed intercept - dense intercept, the measured
   crossover V_x = tau / (dense slope - routed slope), printed beside the rule's V* for the detected device.
3. Prefill: one prompt of 1k, 2k and 4k tokens, dense vs routed at s, eager (prefill is never captured).

Run:  python benchmarks/mixed_depth_bench.py [--rows 32,64,128,192] [--contexts 512,1024,2048,3072] [--s 0.5]
      python benchmarks/mixed_depth_bench.py --smoke      (tiny model on CPU; numbers mean nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # the smoke run's kernel section uses the interpreter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from vskipper.checkpoint import TinySize, tiny_config  # noqa: E402
from vskipper.mixed.bench_stack import BenchStack, ForwardBatch  # noqa: E402
from vskipper.mixed.tiles import COUNT_RANGES, OPERATIONS  # noqa: E402
from vskipper.mixed.tuner import op_dims, representative_rows, time_call  # noqa: E402
from vskipper.roofline import derive_thresholds, find_device, kv_bytes_per_token_layer  # noqa: E402
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

def bench_kernels(size: TinySize, device: torch.device, dtype: torch.dtype, smoke: bool) -> list[dict]:
    from torch.nn import functional as F

    from vskipper.mixed.kernels import (
        INTERPRETER_TILE,
        cohort_down_scatter,
        cohort_gate_up,
        device_tile_table,
    )

    table = device_tile_table(device) if device.type == "cuda" else None
    g = torch.Generator().manual_seed(0)
    results = []
    ranges = COUNT_RANGES[:1] if smoke else COUNT_RANGES
    for op in OPERATIONS:
        k_dim, n_dim = op_dims(op, size.hidden, size.intermediate, size.intermediate // size.reduction)
        w1 = (torch.randn(n_dim, k_dim, generator=g) / k_dim**0.5).to(device, dtype)
        w2 = (torch.randn(n_dim, k_dim, generator=g) / k_dim**0.5).to(device, dtype)
        for lo, hi in ranges:
            rows = representative_rows(lo, hi)
            tile = table.lookup(op, rows) if table else INTERPRETER_TILE
            x = torch.randn(2 * rows, k_dim, generator=g).to(device, dtype)
            idx = torch.randperm(2 * rows, generator=g)[:rows].to(device)
            count = torch.tensor([rows], device=device)
            w = torch.rand(2 * rows, generator=g).to(device, dtype)
            if op.endswith("gate_up"):
                def ref(x=x, idx=idx, w1=w1, w2=w2):
                    a = x.index_select(0, idx)
                    return F.silu(a @ w1.t()) * (a @ w2.t())

                def ker(x=x, idx=idx, count=count, w1=w1, w2=w2, tile=tile):
                    return cohort_gate_up(x, idx, count, w1, w2, tile=tile)
            else:
                packed = torch.randn(rows, k_dim, generator=g).to(device, dtype)
                y = torch.zeros(2 * rows, n_dim, device=device, dtype=dtype)

                def ref(packed=packed, idx=idx, w1=w1, w=w, y=y):
                    y.index_add_(0, idx, (packed @ w1.t()) * w.index_select(0, idx)[:, None])

                def ker(packed=packed, idx=idx, count=count, w1=w1, w=w, y=y, tile=tile):
                    cohort_down_scatter(packed, idx, count, w, w1, y, tile=tile)
            interpret = device.type != "cuda"
            t_ref, t_ker = time_call(ref, interpret), time_call(ker, interpret)
            results.append({"op": op, "rows": [lo, hi], "K": k_dim, "N": n_dim, "kernel_ms": t_ker,
                            "torch_ms": t_ref, "ratio": t_ker / t_ref})
            print(f"  {op:13} rows {lo:>3}..{hi if hi else '':<4} K={k_dim:<6} N={n_dim:<6} kernel "
                  f"{t_ker:8.4f} ms  torch {t_ref:8.4f} ms  ratio {t_ker / t_ref:5.2f}x", flush=True)
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


def time_step(fn, use_graph: bool, reps: int) -> float:
    if not use_graph:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script runs end to end")
    p.add_argument("--rows", default="32,64,128,192")
    p.add_argument("--contexts", default="512,1024,2048,3072")
    p.add_argument("--prefill", default="1024,2048,4096")
    p.add_argument("--s", type=float, default=0.5, help="skip ratio: share of routed decisions projecting")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--skip", default="", help="comma list of sections to skip: kernels,decode,prefill")
    p.add_argument("--json", help="also write every figure to this JSON file")
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
    report: dict = {"device": name, "s": args.s, "smoke": args.smoke}

    if "kernels" not in skip:
        print("1. cohort GEMM / torch on packed rows")
        report["kernels"] = bench_kernels(size, device, dtype, args.smoke)

    config = tiny_config("flexidepth-llama", size, dtype=str(dtype).removeprefix("torch."))
    with torch.device(device):
        model = BenchStack(config, capacity=max(rows_grid)).to(dtype).eval()
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

    if "prefill" not in skip:
        print("3. prefill, one prompt (eager)")
        report["prefill"] = bench_prefill(model, prefill, args.s, args.page_size, max(3, reps // 4))

    print(f"attestation after the run: {json.dumps(model.attestation())}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
