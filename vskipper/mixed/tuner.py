"""The tile tuner behind `vskipper tune-tiles`: time candidate tiles against torch on the same packed rows.

For each of the 36 shapes (6 operations x 6 count ranges, `vskipper.mixed.tiles`) it builds a cohort of a
representative size for the range (the range's upper end; 256 for the open one) over a batch twice that size
with a random row map, times every candidate tile that fits the device's shared memory, and times the torch
equivalent on the same packed rows (gather, matmul(s) on cuBLAS, SiLU-and-multiply; for down, the matmul
and the weighted index_add; for Q, the gather and the matmul; for o_proj, the matmul and the index_add). The
best candidate goes in the table with its time ratio to torch.

It needs a GPU. `interpret=True` runs a tiny smoke configuration on the Triton interpreter instead (tiny
widths, fp32, one candidate per shape, one call per timing): it exercises the whole path and writes a well-formed table, whose times
mean nothing and which must never be committed as a device's table.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
from torch.nn import functional as F

from vskipper.mixed.tiles import COUNT_RANGES, OPERATIONS, Tile, parse_tile_table
from vskipper.modelspec import DTYPE_BYTES


class TunerError(RuntimeError):
    pass


PREFILL_ROWS = 2048  # the open range's shape: a prefill pass's tokens
INTERPRETED_PREFILL_ROWS = 600  # under the interpreter (a smoke run), still in the open range


def representative_rows(lo: int, hi: int | None, interpret: bool = False) -> int:
    if hi is not None:
        return hi
    return max(lo, INTERPRETED_PREFILL_ROWS if interpret else PREFILL_ROWS)


def candidate_tiles(op: str, rows: int, shared_mem_per_block: int, dtype_bytes: int = 2,
                    limit: int | None = None) -> list[Tile]:
    top_m = max(16, 1 << (rows - 1).bit_length())
    out = []
    for bm in (16, 32, 64, 128):
        if bm > top_m:
            continue
        for bn in (32, 64, 128, 256):
            for bk in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3, 4, 5):
                        t = Tile(bm, bn, bk, warps, stages)
                        if t.shared_mem_bytes(op, dtype_bytes) <= shared_mem_per_block:
                            out.append(t)
    if limit is not None:
        # Spread the sample over the list, always keeping the smallest and largest tiles.
        step = max(1, len(out) // max(1, limit))
        out = out[::step][:limit]
    return out


def time_call(fn: Callable[[], object], interpret: bool, reps: int = 20) -> float:
    """Median milliseconds per call: triton's do_bench on a GPU, wall clock under the interpreter."""
    if not interpret:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=reps * 5))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def op_dims(op: str, hidden: int, intermediate: int, proj_width: int, q_width: int | None = None
            ) -> tuple[int, int]:
    """(K, N) of an operation: the gate-up GEMMs and Q map hidden -> width, the down GEMMs and o_proj
    width -> hidden (Q's width: heads x head_dim, by default hidden)."""
    width = {"mlp": intermediate, "proj": proj_width, "attn": q_width or hidden}[op.split("_")[0]]
    return (hidden, width) if op.endswith(("gate_up", "_q")) else (width, hidden)


def shape_calls(op: str, rows: int, w1: torch.Tensor, w2: torch.Tensor, g: torch.Generator,
                device: torch.device, dtype: torch.dtype) -> tuple[Callable[[], object], Callable[[Tile], object]]:
    """The torch equivalent and the kernel (given a tile) of operation `op` over a cohort of `rows` rows in a
    batch twice that size, with a random row map: what the tuner and `benchmarks/mixed_depth_bench.py` time side
    by side. w1 [N, K] is the weight (gate-up: the gate; down: W_down), w2 the gate-up's up weight."""
    from vskipper.mixed.kernels import cohort_down_scatter, cohort_gate_up, cohort_gemm, cohort_scatter_add

    batch, k_dim, n_dim = 2 * rows, w1.shape[1], w1.shape[0]
    x = torch.randn(batch, k_dim, generator=g).to(device, dtype)
    idx = torch.randperm(batch, generator=g)[:rows].to(device)
    count = torch.tensor([rows], device=device)
    if op.endswith("gate_up"):
        def reference():
            a = x.index_select(0, idx)
            return F.silu(a @ w1.t()) * (a @ w2.t())

        return reference, lambda tile: cohort_gate_up(x, idx, count, w1, w2, tile=tile)
    if op == "attn_q":
        return (lambda: x.index_select(0, idx) @ w1.t()), lambda tile: cohort_gemm(x, idx, count, w1, tile=tile)
    packed = torch.randn(rows, k_dim, generator=g).to(device, dtype)
    y = torch.zeros(batch, n_dim, device=device, dtype=dtype)
    if op == "attn_o":
        return (lambda: y.index_add_(0, idx, packed @ w1.t()),
                lambda tile: cohort_scatter_add(packed, idx, count, w1, y, tile=tile))
    weights = torch.rand(batch, generator=g).to(device, dtype)
    return (lambda: y.index_add_(0, idx, (packed @ w1.t()) * weights.index_select(0, idx)[:, None]),
            lambda tile: cohort_down_scatter(packed, idx, count, weights, w1, y, tile=tile))


def tune(device_name: str, shared_mem_per_block: int, hidden: int, intermediate: int, proj_width: int,
         dtype: str = "bfloat16", interpret: bool = False, max_candidates: int | None = None,
         log: Callable[[str], None] = print, q_width: int | None = None) -> dict:
    """Tune all 36 shapes; returns the table as a dict (validated), each entry with its ratio to torch."""
    if interpret:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise TunerError("interpreter smoke run needs TRITON_INTERPRET=1 set before triton is imported")
        device, max_candidates, dtype = torch.device("cpu"), 1, "float32"  # numpy emulates fp32 fastest
    else:
        if not torch.cuda.is_available():
            raise TunerError("tune-tiles times kernels on a GPU and none is visible; pass --interpret for a "
                             "tiny smoke run on the Triton interpreter (its table is not a measurement)")
        device = torch.device("cuda")
    tdtype = getattr(torch, dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    tiles: dict[str, list[dict]] = {}
    for op in OPERATIONS:
        k_dim, n_dim = op_dims(op, hidden, intermediate, proj_width, q_width)
        w1 = (torch.randn(n_dim, k_dim, generator=g) / k_dim**0.5).to(device, tdtype)
        w2 = (torch.randn(n_dim, k_dim, generator=g) / k_dim**0.5).to(device, tdtype)
        entries = []
        for lo, hi in COUNT_RANGES:
            rows = representative_rows(lo, hi, interpret)
            reference, kernel = shape_calls(op, rows, w1, w2, g, device, tdtype)
            torch_ms = time_call(reference, interpret)
            best: tuple[float, Tile] | None = None
            for tile in candidate_tiles(op, rows, shared_mem_per_block, DTYPE_BYTES[dtype], max_candidates):
                try:
                    ms = time_call(lambda tile=tile, kernel=kernel: kernel(tile), interpret)
                except Exception as exc:  # a candidate the compiler rejects (e.g. out of registers) is skipped
                    log(f"  {op} rows {lo}..{hi}: skip {tile}: {type(exc).__name__}")
                    continue
                if best is None or ms < best[0]:
                    best = (ms, tile)
            if best is None:
                raise TunerError(f"{op} rows {lo}..{hi}: no candidate tile ran")
            ms, tile = best
            ratio = ms / torch_ms
            log(f"{op:13} rows {lo:>3}..{hi if hi else '':<4} K={k_dim:<6} N={n_dim:<6} best {tile} "
                f"{ms:.4f} ms vs torch {torch_ms:.4f} ms ({ratio:.2f}x)")
            entries.append({"rows": [lo, hi], **asdict(tile), "ratio_vs_torch": round(ratio, 3),
                            "kernel_ms": round(ms, 5), "torch_ms": round(torch_ms, 5)})
        tiles[op] = entries
    data = {"device": device_name, "dtype": dtype,
            "source": ("interpreter smoke run (not a measurement)" if interpret else
                       f"vskipper tune-tiles: hidden {hidden}, intermediate {intermediate}, projector {proj_width}, "
                       f"q {q_width or hidden}"),
            "tiles": tiles}
    parse_tile_table(data, shared_mem_per_block, where="tuned table")  # what we write must load
    return data
