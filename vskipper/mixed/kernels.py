"""Count-bounded cohort GEMMs in Triton: one captured graph serves every cohort size.

A cohort is given by an index map `idx` [C] (cohort position -> batch row) and a device-side count `count` [1];
C is the captured batch size. The GEMM kernels launch a static grid sized for C rows; a program whose row tile
starts at or past `count` returns at once, so the work is bounded by the cohort, not the batch.

`cohort_gate_up_kernel`
    Reads   X[idx[m], :] for m < count (the gather is folded into the operand load), W_gate [N, K], W_up [N, K]
    Writes  A[m, :] = silu(X[idx[m]] @ W_gate^T) * (X[idx[m]] @ W_up^T) for m < count, packed (row m of A)
            A rows >= count are not written.
    Grid    (cdiv(C, BLOCK_M), cdiv(N, BLOCK_N))

`cohort_down_scatter_kernel`
    Reads   A[m, :] for m < count, W_down [D, N], weights[idx[m]], Y[idx[m], :]
    Writes  Y[idx[m], :] += weights[idx[m]] * (A[m] @ W_down^T) for m < count (the scatter and the branch
            weight are folded into the epilogue). Each (row, column) of Y belongs to one program: idx has no
            repeated rows below count, so no atomics are needed.
            (GATHER_A: A[idx[m], :] instead, A in the cohort's batch rows: o_proj over a read of every batch row)
    Grid    (cdiv(C, BLOCK_M), cdiv(D, BLOCK_N), SPLIT_K)

`grouped_gate_up_kernel` and `grouped_down_scatter_kernel`
    The two kernels above over two cohorts in one launch (a routed layer's MLP over the RUN cohort and projector
    over the Project-Only one, the same X, branch weights and Y): the second cohort's column tiles follow the
    first's in the grid, each program one tile of one cohort.
    Grid    (cdiv(C, BLOCK_M), cdiv(N, BLOCK_N) + cdiv(N2, BLOCK_N)) and (cdiv(C, BLOCK_M), 2 cdiv(D, BLOCK_N))

`cohort_gemm_kernel`
    Reads   X[idx[m], :] for m < count, W [N, K]
    Writes  A[m, :] = X[idx[m]] @ W^T for m < count, packed; rows >= count are not written
            (SCATTER: A[idx[m], :] instead, in the cohort's batch rows; rows outside the cohort are not written)
    Grid    (cdiv(C, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K)
    (the RUN cohort's Q projection; with the down kernel unweighted, its o_proj scatters h[idx[m]] += A[m] @ W_o^T)

`split_k_reduce_kernel`
    With SPLIT_K > 1 (a tile's `split_k`), `cohort_down_scatter_kernel` and `cohort_gemm_kernel` split K: the
    programs of split s sum their share of K tiles and store the fp32 sums into plane s of a workspace [SPLIT_K,
    C, N] at the packed slots m < count; this launch then sums the planes in split order (a launch repeated is
    bit-equal, where atomics would not be) and runs the epilogue the unsplit kernel runs (weighted, added or
    stored, into the batch rows or packed).
    A decode pass's grid over few rows holds few output tiles (the MLP's down at 128 rows in tiles of 64 x 128:
    64 programs on the H200's 132 SMs); split, it fills the device, for a workspace written and read once (at
    128 rows, 2 MiB a split, mostly in L2) and a second launch. The gate-up kernels never split (their activation
    needs both sums whole). `grouped_down_scatter_kernel` splits as the MLP's down tile says, each cohort's planes
    in its half of one workspace [2, SPLIT_K, C, D], then a reduce each.
    Grid    (cdiv(C, 16), cdiv(N, 128))

`cohort_maps_kernel`
    Reads   run[r] for r < rows (bool)
            (RECORD: a skipper's route instead, run[r * stride_run] and weights[r * stride_w], with DENSE its
            dense-mode rows, which RUN with unit weight whatever the route says)
    Writes  run_idx / proj_idx [rows]: the batch rows of each cohort in batch order, 0 at and past its count;
            counts [2]: (n_run, n_proj); live [rows]: m < n_run (the RUN cohort's packed slots that hold a row)
            (RECORD: also the layer's row of the route tape, tape_run[r] and tape_w[r], from what it read)
    Grid    (1,): one program over a block of the next power of two >= rows (a prefix sum and two scatters in one
            launch, where the torch builder of `vskipper.mixed.cohorts` takes about nine)

`masked_decode_split_kernel` and `masked_decode_merge_kernel` are the decode attention read with the RUN mask,
split over the context; `packed_prefill_kernel` (at the end) is the prefill read of the RUN cohort's packed slots
alone.

Where a measured table found cuBLAS faster at a memory-bound capacity (`TileTable.gathers`), `cohort_gemm`,
`cohort_scatter_add` and `cohort_ffn_triton` run that operation in the gathered form of `vskipper.mixed.gathered`
instead: the same contract over every slot of the map, no host read either.

The GEMMs accumulate in fp32. For the FlexiDepth projector pass (gate_proj, down_proj, up_proj) as
(W_gate, W_up, W_down). Tests run these kernels under TRITON_INTERPRET=1 against torch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vskipper.mixed.gathered import (
    batch_rows_gemm,
    gathered_down,
    gathered_gate_up,
    gathered_gemm,
    gathered_scatter_add,
)
from vskipper.mixed.tiles import (
    DEFAULT_READ_TILE,
    FFN_OPERATIONS,
    ReadTile,
    Tile,
    TileTable,
    tile_table_for,
)

# Under the interpreter (tests on CPU) small tiles keep the numpy emulation quick.
INTERPRETER_TILE = Tile(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host integers, for launch grids. `triton.cdiv` is a constexpr function whose host call costs
    a few microseconds (its arguments unwrapped through lists and dicts): nine a routed layer's launches."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1), on the host: `triton.next_power_of_2` without its call cost."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@triton.jit
def _gate_up_tile(x_ptr, idx_ptr, count, wg_ptr, wu_ptr, out_ptr, N, K, pid_m, pid_n,
                  stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = tl.load(idx_ptr + offs_m, mask=m_mask, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    g_ptrs = wg_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = wu_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g)
        acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def cohort_gate_up_kernel(x_ptr, idx_ptr, count_ptr, wg_ptr, wu_ptr, out_ptr, N, K,
                          stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    count = tl.load(count_ptr)
    if pid_m * BLOCK_M >= count:
        return
    _gate_up_tile(x_ptr, idx_ptr, count, wg_ptr, wu_ptr, out_ptr, N, K, pid_m, tl.program_id(1),
                  stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def grouped_gate_up_kernel(x_ptr, idx_ptr, count_ptr, wg_ptr, wu_ptr, out_ptr, N,
                           idx2_ptr, count2_ptr, wg2_ptr, wu2_ptr, out2_ptr, N2, K, TILES_N,
                           stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                           stride_w2n, stride_w2k, stride_o2m, stride_o2n,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # The first cohort's column tiles, then the second's. A program picks its cohort's operands and runs the one
    # tile loop: one loop compiled, so the launch takes the shared memory of one cohort's tile, not of two.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    first = pid_n < TILES_N
    count = tl.load(tl.where(first, count_ptr, count2_ptr))
    if pid_m * BLOCK_M >= count:
        return
    _gate_up_tile(x_ptr, tl.where(first, idx_ptr, idx2_ptr), count, tl.where(first, wg_ptr, wg2_ptr),
                  tl.where(first, wu_ptr, wu2_ptr), tl.where(first, out_ptr, out2_ptr), tl.where(first, N, N2), K,
                  pid_m, tl.where(first, pid_n, pid_n - TILES_N), stride_xm, stride_xk,
                  tl.where(first, stride_wn, stride_w2n), tl.where(first, stride_wk, stride_w2k),
                  tl.where(first, stride_om, stride_o2m), tl.where(first, stride_on, stride_o2n),
                  BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _k_tiles(K, pid_s, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K tiles [lo, hi) of split `pid_s` of SPLIT_K: every tile unsplit; else consecutive equal shares, the
    last ones short or empty (an empty share stores zeros)."""
    tiles = tl.cdiv(K, BLOCK_K)
    if SPLIT_K == 1:
        lo = 0
        hi = tiles
    else:
        share = tl.cdiv(tiles, SPLIT_K)
        lo = pid_s * share
        hi = tl.minimum(lo + share, tiles)
    return lo, hi


@triton.jit
def _store_partial(ws_ptr, acc, offs_m, offs_n, mask, pid_s, stride_ws_s, stride_ws_m):
    """One split's fp32 partial sums into its plane of the workspace, at the packed slots (`split_k_reduce_kernel`
    sums the planes and runs the epilogue)."""
    ws_ptrs = ws_ptr + pid_s * stride_ws_s + offs_m[:, None] * stride_ws_m + offs_n[None, :]
    tl.store(ws_ptrs, acc, mask=mask)


@triton.jit
def _epilogue(acc, y_ptr, w_ptr, batch, rows, m_mask, offs_n, mask, stride_ym, stride_yn,
              WEIGHTED: tl.constexpr, ACCUMULATE: tl.constexpr):
    """A GEMM tile's epilogue: its sums weighted by their batch rows' branch weights (WEIGHTED), added onto
    (ACCUMULATE) or stored into y's `rows`."""
    if WEIGHTED:
        w = tl.load(w_ptr + batch, mask=m_mask, other=0.0).to(tl.float32)
        acc = w[:, None] * acc
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down_tile(a_ptr, idx_ptr, count, w_ptr, wd_ptr, y_ptr, D, N, pid_m, pid_d,
               stride_am, stride_an, stride_wd, stride_wn, stride_ym, stride_yd,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               WEIGHTED: tl.constexpr, ACCUMULATE: tl.constexpr,
               ws_ptr, pid_s, stride_ws_s, stride_ws_m, SPLIT_K: tl.constexpr, GATHER_A: tl.constexpr = False):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    offs_d = pid_d * BLOCK_N + tl.arange(0, BLOCK_N)
    d_mask = offs_d < D
    offs_k = tl.arange(0, BLOCK_K)
    k_lo, k_hi = _k_tiles(N, pid_s, BLOCK_K, SPLIT_K)
    rows = tl.load(idx_ptr + offs_m, mask=m_mask, other=0)
    a_rows = rows if GATHER_A else offs_m  # slot m's A row: its batch row (A in batch rows) or m (A packed)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + (offs_k[None, :] + k_lo * BLOCK_K) * stride_an
    b_ptrs = wd_ptr + offs_d[None, :] * stride_wd + (offs_k[:, None] + k_lo * BLOCK_K) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi):
        k_mask = offs_k < N - k * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & d_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_an
        b_ptrs += BLOCK_K * stride_wn
    mask = m_mask[:, None] & d_mask[None, :]
    if SPLIT_K > 1:
        _store_partial(ws_ptr, acc, offs_m, offs_d, mask, pid_s, stride_ws_s, stride_ws_m)
    else:
        _epilogue(acc, y_ptr, w_ptr, rows, rows, m_mask, offs_d, mask, stride_ym, stride_yd, WEIGHTED, ACCUMULATE)


@triton.jit
def cohort_down_scatter_kernel(a_ptr, idx_ptr, count_ptr, w_ptr, wd_ptr, y_ptr, D, N,
                               stride_am, stride_an, stride_wd, stride_wn, stride_ym, stride_yd,
                               ws_ptr, stride_ws_s, stride_ws_m,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               WEIGHTED: tl.constexpr = True, ACCUMULATE: tl.constexpr = True,
                               SPLIT_K: tl.constexpr = 1, GATHER_A: tl.constexpr = False):
    pid_m = tl.program_id(0)
    count = tl.load(count_ptr)
    if pid_m * BLOCK_M >= count:
        return
    _down_tile(a_ptr, idx_ptr, count, w_ptr, wd_ptr, y_ptr, D, N, pid_m, tl.program_id(1),
               stride_am, stride_an, stride_wd, stride_wn, stride_ym, stride_yd, BLOCK_M, BLOCK_N, BLOCK_K,
               WEIGHTED, ACCUMULATE, ws_ptr, tl.program_id(2), stride_ws_s, stride_ws_m, SPLIT_K, GATHER_A)


@triton.jit
def grouped_down_scatter_kernel(a_ptr, idx_ptr, count_ptr, wd_ptr, N, a2_ptr, idx2_ptr, count2_ptr, wd2_ptr, N2,
                                w_ptr, y_ptr, D, TILES_D,
                                stride_am, stride_an, stride_wd, stride_wn, stride_a2m, stride_a2n,
                                stride_wd2, stride_w2n, stride_ym, stride_yd,
                                ws_ptr, stride_ws_c, stride_ws_s, stride_ws_m,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                ACCUMULATE: tl.constexpr = True, SPLIT_K: tl.constexpr = 1):
    # As the grouped gate-up: the first cohort's column tiles, then the second's (disjoint rows of y), one loop;
    # split, each cohort's partial sums go into its own half of the workspace ([2, SPLIT_K, C, D]).
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    first = pid_d < TILES_D
    count = tl.load(tl.where(first, count_ptr, count2_ptr))
    if pid_m * BLOCK_M >= count:
        return
    _down_tile(tl.where(first, a_ptr, a2_ptr), tl.where(first, idx_ptr, idx2_ptr), count, w_ptr,
               tl.where(first, wd_ptr, wd2_ptr), y_ptr, D, tl.where(first, N, N2), pid_m,
               tl.where(first, pid_d, pid_d - TILES_D), tl.where(first, stride_am, stride_a2m),
               tl.where(first, stride_an, stride_a2n), tl.where(first, stride_wd, stride_wd2),
               tl.where(first, stride_wn, stride_w2n), stride_ym, stride_yd, BLOCK_M, BLOCK_N, BLOCK_K, True,
               ACCUMULATE, tl.where(first, ws_ptr, ws_ptr + stride_ws_c), tl.program_id(2), stride_ws_s,
               stride_ws_m, SPLIT_K)


@triton.jit
def cohort_gemm_kernel(x_ptr, idx_ptr, count_ptr, w_ptr, out_ptr, N, K,
                       stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                       ws_ptr, stride_ws_s, stride_ws_m,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SCATTER: tl.constexpr = False, SPLIT_K: tl.constexpr = 1):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    count = tl.load(count_ptr)
    if pid_m * BLOCK_M >= count:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = tl.load(idx_ptr + offs_m, mask=m_mask, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    pid_s = tl.program_id(2)
    k_lo, k_hi = _k_tiles(K, pid_s, BLOCK_K, SPLIT_K)
    a_ptrs = x_ptr + rows[:, None] * stride_xm + (offs_k[None, :] + k_lo * BLOCK_K) * stride_xk
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + (offs_k[:, None] + k_lo * BLOCK_K) * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        _store_partial(ws_ptr, acc, offs_m, offs_n, mask, pid_s, stride_ws_s, stride_ws_m)
    else:
        if SCATTER:  # each cohort row's result in its batch row
            out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
        else:
            out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def split_k_reduce_kernel(ws_ptr, idx_ptr, count_ptr, w_ptr, y_ptr, N, stride_ws_s, stride_ws_m, stride_ym, stride_yn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                          WEIGHTED: tl.constexpr, ACCUMULATE: tl.constexpr, SCATTER: tl.constexpr):
    # The epilogue of a GEMM whose K was split: the planes' sum at each counted slot, weighted, added or stored
    # into its batch row (SCATTER) or its packed row, as the unsplit kernel's epilogue does.
    pid_m = tl.program_id(0)
    count = tl.load(count_ptr)
    if pid_m * BLOCK_M >= count:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = m_mask[:, None] & (offs_n < N)[None, :]
    ws_ptrs = ws_ptr + offs_m[:, None] * stride_ws_m + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):  # in split order: the sum is the same from launch to launch
        acc += tl.load(ws_ptrs + s * stride_ws_s, mask=mask, other=0.0)
    batch = tl.load(idx_ptr + offs_m, mask=m_mask, other=0)
    if SCATTER:
        rows = batch
    else:
        rows = offs_m
    _epilogue(acc, y_ptr, w_ptr, batch, rows, m_mask, offs_n, mask, stride_ym, stride_yn, WEIGHTED, ACCUMULATE)


REDUCE_BLOCK_M, REDUCE_BLOCK_N = 16, 128  # the reduce's tile: an elementwise pass over the counted slots


class SplitK(NamedTuple):
    """A GEMM launch's K split (`Tile.split_k`): the fp32 workspace its splits write, one plane a split ([splits, C,
    N], allocated at the launch, as a captured graph's other buffers are), and the grid's third dimension. An
    unsplit launch passes any tensor for the workspace, which it never reads."""

    ws: torch.Tensor
    splits: int

    @classmethod
    def of(cls, tile: Tile, capacity: int, n: int, like: torch.Tensor) -> SplitK:
        if tile.split_k == 1:
            return cls(like, 1)
        return cls(torch.empty(tile.split_k, capacity, n, dtype=torch.float32, device=like.device), tile.split_k)

    @property
    def strides(self) -> tuple[int, int]:
        return (self.ws.stride(0), self.ws.stride(1)) if self.splits > 1 else (0, 0)

    def reduce(self, idx: torch.Tensor, count: torch.Tensor, weights: torch.Tensor | None, y: torch.Tensor,
               accumulate: bool, scatter: bool) -> None:
        """The split GEMM's epilogue (`split_k_reduce_kernel`): nothing for an unsplit launch, whose own epilogue
        ran."""
        if self.splits == 1:
            return
        capacity, n = self.ws.shape[1:]
        grid = (cdiv(capacity, REDUCE_BLOCK_M), cdiv(n, REDUCE_BLOCK_N))
        split_k_reduce_kernel[grid](self.ws, idx, count, idx if weights is None else weights, y, n, *self.strides,
                                    y.stride(0), y.stride(1), BLOCK_M=REDUCE_BLOCK_M, BLOCK_N=REDUCE_BLOCK_N,
                                    SPLIT_K=self.splits, WEIGHTED=weights is not None, ACCUMULATE=accumulate,
                                    SCATTER=scatter)


def _grid_tile(op: str, capacity: int, x: torch.Tensor, tiles: TileTable | Tile | None) -> Tile:
    if isinstance(tiles, Tile):
        return tiles
    if tiles is None:
        if not x.is_cuda:
            return INTERPRETER_TILE
        tiles = device_tile_table(x.device)
    return tiles.lookup(op, capacity)


_TABLES: dict[tuple[int, str | None], TileTable] = {}


def device_tile_table(device: torch.device, path: str | Path | None = None) -> TileTable:
    """The table the CUDA device serves with: the one at `path` when given (measured on this device:
    `tiles.given_tile_table`), else its shipped table or the default for its shared-memory limit (cached per
    index and path)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, None if path is None else str(path))
    if key not in _TABLES:
        props = torch.cuda.get_device_properties(index)
        limit = getattr(props, "shared_memory_per_block_optin", None) or 99 * 1024
        _TABLES[key] = tile_table_for(props.name, limit, path=path)
    return _TABLES[key]


def cohort_gate_up(x: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, w_gate: torch.Tensor,
                   w_up: torch.Tensor, out: torch.Tensor | None = None, tile: Tile | None = None) -> torch.Tensor:
    """A [C, N] with rows m < count set to silu(x[idx[m]] W_gate^T) * (x[idx[m]] W_up^T); others untouched."""
    capacity, (n, k) = idx.shape[0], w_gate.shape
    out = torch.empty(capacity, n, dtype=x.dtype, device=x.device) if out is None else out
    t = tile or _grid_tile("mlp_gate_up", capacity, x, None)
    grid = (cdiv(capacity, t.block_m), cdiv(n, t.block_n))
    cohort_gate_up_kernel[grid](x, idx, count, w_gate, w_up, out, n, k, x.stride(0), x.stride(1),
                                w_gate.stride(0), w_gate.stride(1), out.stride(0), out.stride(1),
                                BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                                num_warps=t.num_warps, num_stages=t.num_stages)
    return out


def cohort_down_scatter(a: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, weights: torch.Tensor,
                        w_down: torch.Tensor, y: torch.Tensor, tile: Tile | None = None,
                        accumulate: bool = True) -> None:
    """y[idx[m]] += weights[idx[m]] * (a[m] @ W_down^T) for m < count, in place (`accumulate` False: y[idx[m]] =,
    where y's rows hold nothing yet)."""
    t = tile or _grid_tile("mlp_down", idx.shape[0], a, None)
    _down_launch(a, idx, count, weights, w_down, y, t, accumulate)


def _down_launch(a: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, weights: torch.Tensor | None,
                 w: torch.Tensor, y: torch.Tensor, t: Tile, accumulate: bool, batch_rows: bool = False) -> None:
    """The down kernel's launch (unweighted where `weights` is None: o_proj), its K split as the tile says;
    `batch_rows`: slot m's row of `a` is its batch row idx[m], not m."""
    capacity, (d, n) = idx.shape[0], w.shape
    split = SplitK.of(t, capacity, d, y)
    grid = (cdiv(capacity, t.block_m), cdiv(d, t.block_n), split.splits)
    cohort_down_scatter_kernel[grid](a, idx, count, idx if weights is None else weights, w, y, d, n, a.stride(0),
                                     a.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1), split.ws,
                                     *split.strides, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                                     WEIGHTED=weights is not None, ACCUMULATE=accumulate, SPLIT_K=split.splits,
                                     GATHER_A=batch_rows, num_warps=t.num_warps, num_stages=t.num_stages)
    split.reduce(idx, count, weights, y, accumulate, scatter=True)


def _gathers(tiles: TileTable | Tile | None, op: str, capacity: int) -> bool:
    """Whether a table serves `op` at `capacity` slots in the gathered cuBLAS form (`TileTable.gathers`)."""
    return isinstance(tiles, TileTable) and tiles.gathers(op, capacity)


def cohort_gemm(x: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, w: torch.Tensor,
                out: torch.Tensor | None = None, tile: TileTable | Tile | None = None,
                batch_rows: bool = False, finite_others: bool = False) -> torch.Tensor:
    """A [C, N] with rows m < count set to x[idx[m]] @ W^T (packed), rows >= count untouched (zeros when
    `out` is not given). A table may serve it in the gathered form (`vskipper.mixed.gathered`).

    `batch_rows`: A [len(x), N] in x's rows instead, row idx[m] set to x[idx[m]] @ W^T for m < count; the rows
    outside the cohort hold values of no meaning: whatever the storage held (the masked and packed reads skip
    them), or, with `finite_others` (a read of every row, which reads them and whose outputs there no one reads),
    zeros. Its gathered form multiplies every row of x (`batch_rows_gemm`): each row's own product, finite too."""
    capacity, (n, k) = idx.shape[0], w.shape
    if batch_rows and out is not None:
        raise ValueError("cohort_gemm stores its batch rows into storage of its own: no `out` with batch_rows")
    if _gathers(tile, "attn_q", capacity):
        return batch_rows_gemm(x, w) if batch_rows else gathered_gemm(x, idx, count, w, out)
    if batch_rows:
        out = (torch.zeros if finite_others else torch.empty)(x.shape[0], n, dtype=x.dtype, device=x.device)
    elif out is None:
        out = torch.zeros(capacity, n, dtype=x.dtype, device=x.device)
    t = _grid_tile("attn_q", capacity, x, tile)
    split = SplitK.of(t, capacity, n, out)
    grid = (cdiv(capacity, t.block_m), cdiv(n, t.block_n), split.splits)
    cohort_gemm_kernel[grid](x, idx, count, w, out, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                             out.stride(0), out.stride(1), split.ws, *split.strides, BLOCK_M=t.block_m,
                             BLOCK_N=t.block_n, BLOCK_K=t.block_k, SCATTER=batch_rows, SPLIT_K=split.splits,
                             num_warps=t.num_warps, num_stages=t.num_stages)
    split.reduce(idx, count, None, out, accumulate=False, scatter=batch_rows)
    return out


def cohort_scatter_add(a: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
                       tile: TileTable | Tile | None = None, batch_rows: bool = False) -> None:
    """y[idx[m]] += a[m] @ W^T for m < count, in place (the down kernel, unweighted; or, as a table says, the
    gathered form). `batch_rows`: a [len(y), N] in batch rows instead, y[idx[m]] += a[idx[m]] @ W^T (the kernel
    gathers its rows in its operand load, the gathered form in its gather): o_proj over a read of every batch row,
    whose other rows are not read."""
    capacity = idx.shape[0]
    if _gathers(tile, "attn_o", capacity):
        gathered_scatter_add(a.index_select(0, idx) if batch_rows else a, idx, count, w, y)
        return
    _down_launch(a, idx, count, None, w, y, _grid_tile("attn_o", capacity, a, tile), accumulate=True,
                 batch_rows=batch_rows)


def cohort_ffn_triton(x: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, weights: torch.Tensor,
                      w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, y: torch.Tensor,
                      op: str = "mlp", tiles: TileTable | Tile | None = None, accumulate: bool = True) -> None:
    """The cohort FFN of `vskipper.mixed.backend` on the two kernels, or either in the gathered form where a
    table says so (`cohort_ffn_gathers`); `op` is 'mlp' or 'proj'; `accumulate` False stores each cohort row's
    output instead of adding it (y's rows hold nothing yet: not with a gathered down, which adds)."""
    if op not in ("mlp", "proj"):
        raise ValueError(f"op must be 'mlp' or 'proj', got {op!r}")
    capacity = idx.shape[0]
    weights = _flat(weights)
    if _gathers(tiles, f"{op}_gate_up", capacity):
        a = gathered_gate_up(x, idx, count, w_gate, w_up)
    else:
        a = cohort_gate_up(x, idx, count, w_gate, w_up, tile=_grid_tile(f"{op}_gate_up", capacity, x, tiles))
    if _gathers(tiles, f"{op}_down", capacity):
        if not accumulate:
            raise ValueError(f"{op}_down serves in the gathered form here, which adds into y: zero y's rows and "
                             "pass accumulate=True (`cohort_ffn_gathers`)")
        gathered_down(a, idx, count, weights, w_down, y)
    else:
        cohort_down_scatter(a, idx, count, weights, w_down, y, tile=_grid_tile(f"{op}_down", capacity, x, tiles),
                            accumulate=accumulate)


class CohortFFN(NamedTuple):
    """One cohort's FFN in a routed layer: its map (`idx` [C], `count` [1]) and its gate, up and down weights (the
    projector's in the order `cohort_ffn_triton` takes them)."""

    idx: torch.Tensor
    count: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor




def _flat(weights: torch.Tensor) -> torch.Tensor:
    """The branch weights as the down kernels read them: one per batch row, contiguous."""
    if weights.dim() == 1 and weights.stride(0) == 1:  # the tape's row, as a routed layer hands it: no view
        return weights
    weights = weights.reshape(-1)
    return weights if weights.stride(0) == 1 else weights.contiguous()


def _apart_because(mlp: CohortFFN, proj: CohortFFN, tiles: TileTable | Tile | None, capacity: int) -> str | None:
    """Why the two FFNs cannot launch grouped (one grid reads both FFNs' weights with one element type, gate and up
    of each with one layout, over the same hidden width), or None."""
    if any(_gathers(tiles, op, capacity) for op in FFN_OPERATIONS):
        return "the table serves an FFN GEMM in the gathered form there"
    weights = (mlp.w_gate, mlp.w_up, mlp.w_down, proj.w_gate, proj.w_up, proj.w_down)
    if len({w.dtype for w in weights}) > 1:
        return f"their weights' dtypes differ ({sorted({str(w.dtype) for w in weights})})"
    (n1, k), (n2, k2), d = mlp.w_gate.shape, proj.w_gate.shape, mlp.w_down.shape[0]
    if k2 != k or mlp.w_up.stride() != mlp.w_gate.stride() or proj.w_up.stride() != proj.w_gate.stride():
        return "their gate and up weights differ in width or layout"
    if tuple(mlp.w_down.shape) != (d, n1) or tuple(proj.w_down.shape) != (d, n2) or d != k:
        return (f"their down weights are {tuple(mlp.w_down.shape)} and {tuple(proj.w_down.shape)}, not ({k}, {n1}) "
                f"and ({k}, {n2})")
    return None


def cohort_ffn_pair(x: torch.Tensor, weights: torch.Tensor, y: torch.Tensor, mlp: CohortFFN, proj: CohortFFN,
                    tiles: TileTable | Tile | None = None, accumulate: bool = True, grouped: bool | None = None
                    ) -> None:
    """A routed layer's two cohort FFNs over the same input rows x and branch weights: the RUN cohort's MLP and the
    Project-Only cohort's projector, each adding weights[r] * FFN(x[r]) into its rows r of y, which no two cohorts
    share. `accumulate` False: y holds nothing yet, and each cohort row gets its output stored; where a down GEMM
    serves in the gathered form, which adds, y is zeroed first (a row in neither cohort then holds zero).

    Both in one launch per stage (`grouped_gate_up_kernel`, then `grouped_down_scatter_kernel`), at the MLP's
    tiles: the projector's column tiles follow the MLP's in one grid, so its few programs fill the MLP's last wave
    instead of running a wave of their own after it, and each stage launches once (a down tile that splits K then
    adds a reduce launch a cohort). Each FFN runs on its own, as
    `cohort_ffn_triton` runs it, where the table serves any of the four GEMMs in the gathered form at this capacity
    or measured the two faster apart there (`TileTable.groups_ffn`), and where one grid cannot read both
    (`_apart_because`); `grouped` (the tuner's) forces either, grouped only where one grid can."""
    capacity = mlp.idx.shape[0]
    if proj.idx.shape[0] != capacity:
        raise ValueError(f"the cohort maps hold {capacity} and {proj.idx.shape[0]} slots: one pass's maps have "
                         "as many slots each")
    why_apart = _apart_because(mlp, proj, tiles, capacity)
    if grouped is None:
        grouped = why_apart is None and (not isinstance(tiles, TileTable) or tiles.groups_ffn(capacity))
    elif grouped and why_apart is not None:
        raise ValueError(f"the FFNs cannot launch grouped at {capacity} slots: {why_apart}")
    if not grouped:
        if not accumulate and any(cohort_ffn_gathers(tiles, op, capacity) for op in ("mlp", "proj")):
            y.zero_()
            accumulate = True
        for op, ffn in (("mlp", mlp), ("proj", proj)):
            cohort_ffn_triton(x, ffn.idx, ffn.count, weights, ffn.w_gate, ffn.w_up, ffn.w_down, y, op=op,
                              tiles=tiles, accumulate=accumulate)
        return
    weights = _flat(weights)
    (n1, k), n2, d = mlp.w_gate.shape, proj.w_gate.shape[0], mlp.w_down.shape[0]
    a1 = torch.empty(capacity, n1, dtype=x.dtype, device=x.device)
    a2 = torch.empty(capacity, n2, dtype=x.dtype, device=x.device)
    t = _grid_tile("mlp_gate_up", capacity, x, tiles)
    tiles_n = cdiv(n1, t.block_n)
    grid = (cdiv(capacity, t.block_m), tiles_n + cdiv(n2, t.block_n))
    grouped_gate_up_kernel[grid](x, mlp.idx, mlp.count, mlp.w_gate, mlp.w_up, a1, n1,
                                 proj.idx, proj.count, proj.w_gate, proj.w_up, a2, n2, k, tiles_n,
                                 x.stride(0), x.stride(1), mlp.w_gate.stride(0), mlp.w_gate.stride(1),
                                 a1.stride(0), a1.stride(1), proj.w_gate.stride(0), proj.w_gate.stride(1),
                                 a2.stride(0), a2.stride(1), BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                                 BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages)
    t = _grid_tile("mlp_down", capacity, a1, tiles)
    tiles_d = cdiv(d, t.block_n)
    # split as the MLP's down tile says: each cohort's planes in its half of one workspace, then a reduce each
    if t.split_k == 1:
        ws_args, halves = (y, 0, 0, 0), []
    else:
        planes = torch.empty(2, t.split_k, capacity, d, dtype=torch.float32, device=y.device)
        ws_args = (planes, planes.stride(0), planes.stride(1), planes.stride(2))
        halves = [(SplitK(planes[0], t.split_k), mlp), (SplitK(planes[1], t.split_k), proj)]
    grid = (cdiv(capacity, t.block_m), 2 * tiles_d, t.split_k)
    grouped_down_scatter_kernel[grid](a1, mlp.idx, mlp.count, mlp.w_down, n1, a2, proj.idx, proj.count,
                                      proj.w_down, n2, weights, y, d, tiles_d,
                                      a1.stride(0), a1.stride(1), mlp.w_down.stride(0), mlp.w_down.stride(1),
                                      a2.stride(0), a2.stride(1), proj.w_down.stride(0), proj.w_down.stride(1),
                                      y.stride(0), y.stride(1), *ws_args, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                                      BLOCK_K=t.block_k, ACCUMULATE=accumulate, SPLIT_K=t.split_k,
                                      num_warps=t.num_warps, num_stages=t.num_stages)
    for half, ffn in halves:
        half.reduce(ffn.idx, ffn.count, weights, y, accumulate, scatter=True)


def cohort_ffn_gathers(tiles: TileTable | Tile | None, op: str, capacity: int) -> bool:
    """Whether the cohort FFN `op` ('mlp' or 'proj') adds its down GEMM's output in the gathered form at
    `capacity` slots, so that a caller storing into an empty y must zero it first."""
    return _gathers(tiles, f"{op}_down", capacity)


# One compiled variant for every pass (per dtypes and switches): every pass walks its rows in blocks of one size
# (`COHORT_MAPS_BLOCK`, at one warp count), and no argument is specialized, neither the row count nor a stride nor
# a pointer's alignment (a skipper's route is a row of its [layers, rows] tensor, aligned or not by the layer and
# the count). A block sized by the pass (its next power of two) compiled a variant per size while serving: on the
# H200 four prefill sizes stalled the first routed passes 1.3-1.7 s each (benchmarks/results/H200/lease-4). The
# one program's loads go unvectorized: at most a prefill chunk's few thousand rows.
COHORT_MAPS_ARGS = ("run_ptr", "rows", "run_idx_ptr", "proj_idx_ptr", "counts_ptr", "live_ptr", "w_ptr", "dense_ptr",
                    "tape_run_ptr", "tape_w_ptr", "stride_run", "stride_w")


@triton.jit(do_not_specialize=list(COHORT_MAPS_ARGS))
def cohort_maps_kernel(run_ptr, rows, run_idx_ptr, proj_idx_ptr, counts_ptr, live_ptr,
                       w_ptr, dense_ptr, tape_run_ptr, tape_w_ptr, stride_run, stride_w,
                       BLOCK: tl.constexpr, RECORD: tl.constexpr, DENSE: tl.constexpr):
    n_run = tl.zeros([], dtype=tl.int32)  # RUN rows in the blocks walked so far
    for start in range(0, rows, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_pass = offs < rows
        if RECORD:  # the skipper's route, recorded into the tape on the way (the copies the tape would launch)
            run = (tl.load(run_ptr + offs * stride_run, mask=in_pass, other=0) != 0).to(tl.int32)  # any dtype: 0/1
            w = tl.load(w_ptr + offs * stride_w, mask=in_pass, other=1.0)
            if DENSE:
                dense = tl.load(dense_ptr + offs, mask=in_pass, other=0) != 0
                run = tl.where(dense, 1, run)
                w = tl.where(dense, 1.0, w)
            tl.store(tape_run_ptr + offs, run == 1, mask=in_pass)
            tl.store(tape_w_ptr + offs, w, mask=in_pass)  # cast to the tape's dtype (on a GPU rounded to nearest)
        else:
            run = tl.load(run_ptr + offs, mask=in_pass, other=0).to(tl.int32)
        ends_run = n_run + tl.cumsum(run, 0)  # RUN rows at or before each row
        ends_proj = offs + 1 - ends_run
        # Each cohort's rows land at their packed positions, below its count
        tl.store(run_idx_ptr + ends_run - 1, offs.to(tl.int64), mask=in_pass & (run == 1))
        tl.store(proj_idx_ptr + ends_proj - 1, offs.to(tl.int64), mask=in_pass & (run == 0))
        n_run += tl.sum(run, 0)
    # the positions at and past each count get 0: never one a packed row took
    for start in range(0, rows, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_pass = offs < rows
        tl.store(run_idx_ptr + offs, tl.zeros([BLOCK], dtype=tl.int64), mask=in_pass & (offs >= n_run))
        tl.store(proj_idx_ptr + offs, tl.zeros([BLOCK], dtype=tl.int64), mask=in_pass & (offs >= rows - n_run))
        tl.store(live_ptr + offs, offs < n_run, mask=in_pass)
    tl.store(counts_ptr, n_run.to(tl.int64))
    tl.store(counts_ptr + 1, (rows - n_run).to(tl.int64))


COHORT_MAPS_BLOCK = 1024  # rows a step of the maps' one program: a decode batch in one, a prefill chunk in a few
COHORT_MAPS_WARPS = 4
COHORT_MAPS_MAX_ROWS = 1 << 20  # far beyond any pass (a prefill chunk is thousands): a count gone wrong is refused


def cohort_maps(run: torch.Tensor, run_idx: torch.Tensor, proj_idx: torch.Tensor, counts: torch.Tensor,
                live: torch.Tensor, record: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
                | None = None) -> None:
    """The cohort maps of one layer's run mask (bool [rows], contiguous) into the given storage, in one launch
    (`cohort_maps_kernel`, one compiled variant for every row count); no host read.

    `record` = (tape_run [rows], tape_w [rows], weights [rows], dense_rows [rows] or None): `run` and `weights`
    are then a skipper's route ([rows] or [rows, 1], any first stride: the launch steps by it), which the same
    launch writes into the tape's row (tape_run, tape_w: contiguous), the dense-mode rows RUN with unit weight,
    and the maps follow from what it wrote."""
    rows = run.shape[0]
    if not 0 < rows <= COHORT_MAPS_MAX_ROWS:
        raise ValueError(f"cohort_maps covers 1..{COHORT_MAPS_MAX_ROWS} rows, got {rows}")
    if record is None:
        tape_run, tape_w, weights, dense = run, run, run, None
    else:
        tape_run, tape_w, weights, dense = record
    cohort_maps_kernel[(1,)](run, rows, run_idx, proj_idx, counts, live, weights, run if dense is None else dense,
                             tape_run, tape_w, run.stride(0), weights.stride(0), BLOCK=COHORT_MAPS_BLOCK,
                             RECORD=record is not None, DENSE=dense is not None, num_warps=COHORT_MAPS_WARPS)


LOG2E = math.log2(math.e)  # the reads' scores are in base 2: exp2, the device's own exponential


@triton.jit
def _paged_softmax_step(q, k_ptr, v_ptr, r2t_ptr, req, kvh, offs_t, offs_d, t_mask, see, qk_scale, stride_ks,
                        stride_kh, stride_r2t, m_i, l_i, acc, masked=True):
    """One block of a request's keys and values (positions offs_t, those in t_mask; its pages by req_to_token row
    `req`, KV head `kvh`) into the online softmax of the query rows q; `see` masks the scores. Scores are in base 2
    (`qk_scale` is the softmax scale times log2(e), `LOG2E`), so the exponentials are exp2. Returns the running
    (max, sum of exponentials, unnormalised output). Where `masked` is false (a block every row sees whole) the
    scores are taken as they are: no select over the block."""
    slots = tl.load(r2t_ptr + req * stride_r2t + offs_t, mask=t_mask, other=0)
    kv_off = slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
    k = tl.load(k_ptr + kv_off, mask=t_mask[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale  # [query rows, keys]
    if masked:
        s = tl.where(see, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    v = tl.load(v_ptr + kv_off, mask=t_mask[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def masked_decode_split_kernel(q_ptr, k_ptr, v_ptr, r2t_ptr, req_ptr, pos_ptr, read_ptr, idx_ptr, mid_o_ptr,
                               mid_ml_ptr, qk_scale, stride_qr, stride_qh, stride_ks, stride_kh, stride_r2t,
                               GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                               BLOCK_T: tl.constexpr, SPLITS: tl.constexpr, GATHER: tl.constexpr = False):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if tl.load(read_ptr + row) == 0:  # a row that reads nothing loads nothing; the merge writes its zeros
        return
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    if GATHER:  # slot `row` reads for batch row idx[row]: its query, request and position are that row's
        src = tl.load(idx_ptr + row)
    else:
        src = row
    req = tl.load(req_ptr + src)
    length = tl.load(pos_ptr + src) + 1
    span = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_T) * BLOCK_T  # this row's span per split, whole tiles
    lo = split * span
    hi = tl.minimum(lo + span, length)
    q = tl.load(q_ptr + src * stride_qr + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None],
                other=0.0)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        t_mask = offs_t < hi
        m_i, l_i, acc = _paged_softmax_step(q, k_ptr, v_ptr, r2t_ptr, req, kvh, offs_t, offs_d, t_mask,
                                            t_mask[None, :], qk_scale, stride_ks, stride_kh, stride_r2t, m_i, l_i,
                                            acc)
    # Partials [rows, heads, SPLITS, ...]: the unnormalised sum, and (max, sum of exponentials); an empty split
    # (past its row's length) leaves (-inf, 0) and zeros, which the merge weighs by exp2(-inf) = 0.
    head_split = (row * GROUP * tl.num_programs(1) + heads) * SPLITS + split
    tl.store(mid_o_ptr + head_split[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])
    tl.store(mid_ml_ptr + head_split * 2, m_i, mask=g_mask)
    tl.store(mid_ml_ptr + head_split * 2 + 1, l_i, mask=g_mask)


@triton.jit
def masked_decode_merge_kernel(mid_o_ptr, mid_ml_ptr, read_ptr, out_ptr, stride_or, stride_oh,
                               HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
                               BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    out_ptrs = out_ptr + row * stride_or + head * stride_oh + offs_d
    if tl.load(read_ptr + row) == 0:
        # A row that reads nothing emits zeros (stored, not computed: its softmax would be 0/0).
        tl.store(out_ptrs, tl.zeros((HEAD_DIM,), dtype=tl.float32).to(out_ptr.dtype.element_ty))
        return
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < SPLITS
    base = (row * HEADS + head) * SPLITS + offs_s
    m = tl.load(mid_ml_ptr + base * 2, mask=s_mask, other=float("-inf"))
    l_s = tl.load(mid_ml_ptr + base * 2 + 1, mask=s_mask, other=0.0)
    o = tl.load(mid_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    # Base 2, as the splits' scores; split 0 always holds the row's first tile: the max is finite.
    w = tl.exp2(m - tl.max(m, 0))
    acc = tl.sum(o * w[:, None], 0)
    tl.store(out_ptrs, (acc / tl.sum(l_s * w, 0)).to(out_ptr.dtype.element_ty))


DECODE_SPLITS = 8  # the most splits of one row's context (SGLang's Triton decode default, num_kv_splits)


MASKED_DECODE_BLOCK_T = 64  # keys a step of the masked decode read


def masked_decode_block_g(group: int) -> int:
    """The query rows of a masked decode program: the group's heads, padded to tl.dot's least M (16)."""
    return max(16, next_power_of_2(group))


def decode_splits(max_context: int, block_t: int) -> int:
    """Splits of the context for the masked decode read: up to DECODE_SPLITS, never more than the tiles of the
    longest context a request slot can hold (a shape, so the choice is the same at capture and replay)."""
    return max(1, min(DECODE_SPLITS, cdiv(max_context, block_t)))


def masked_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            req_to_token: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor,
                            reads: torch.Tensor, scale: float, block_t: int = MASKED_DECODE_BLOCK_T,
                            splits: int | None = None, idx: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention with a row mask, split over the context (split-KV), capture-safe (no host read).

    Reads   q [rows, heads, hd]; for each row with reads[row]: the slots req_to_token[req, 0..pos] of the K/V
            pools [slots, kv_heads, hd]; nothing at all for the other rows
    Writes  out [rows, heads, hd]: the causal attention of reading rows, exact zeros for the others
    Grid    split: (rows, kv_heads, splits), each program one split of its row's context (whole tiles of
            `block_t`), the query heads of one KV head sharing its loads (grouped-query attention);
            merge: (rows, heads), the splits' partials weighed by their maxima

    With `idx` (int64 [C], a cohort's packed slots): slot m reads for batch row idx[m], its query q[idx[m]], request
    req_indices[idx[m]] and position positions[idx[m]] (q, req_indices and positions in batch rows), where
    reads[m]; out is [C, heads, hd], packed. The kernel gathers them itself: no gathers launched before it.
    """
    heads, head_dim = q.shape[1:]
    rows = q.shape[0] if idx is None else idx.shape[0]
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton decode attention, got {head_dim}")
    if splits is None:
        splits = decode_splits(req_to_token.shape[1], block_t)
    q = q.contiguous()
    out = torch.empty(rows, heads, head_dim, dtype=q.dtype, device=q.device)
    read = reads.contiguous() if reads.dtype == torch.bool else reads.to(torch.bool)  # loaded as int1, no cast
    mid_o = torch.empty(rows, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    mid_ml = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q.device)
    masked_decode_split_kernel[(rows, kv_heads, splits)](
        q, k_pool, v_pool, req_to_token, req_indices, positions, read, read if idx is None else idx, mid_o, mid_ml,
        scale * LOG2E, q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), req_to_token.stride(0),
        GROUP=group, BLOCK_G=masked_decode_block_g(group), HEAD_DIM=head_dim, BLOCK_T=block_t,
        SPLITS=splits, GATHER=idx is not None)
    masked_decode_merge_kernel[(rows, heads)](
        mid_o, mid_ml, read, out, out.stride(0), out.stride(1), HEADS=heads, HEAD_DIM=head_dim, SPLITS=splits,
        BLOCK_S=next_power_of_2(splits))
    return out


@triton.jit(do_not_specialize=["slots_total"])  # as cohort_maps_kernel's rows
def packed_prefill_kernel(q_ptr, k_ptr, v_ptr, r2t_ptr, req_ptr, pos_ptr, read_ptr, idx_ptr, out_ptr, qk_scale,
                          slots_total, stride_qm, stride_qh, stride_ks, stride_kh, stride_r2t, stride_om, stride_oh,
                          GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATHER: tl.constexpr):
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    start_m = pid_m * BLOCK_M
    # The query rows of one KV head: BLOCK_M slots x the GROUP query heads that share it, (slot, head) in order,
    # so each key block is loaded once for the whole group.
    offs_r = tl.arange(0, BLOCK_M * BLOCK_G)
    slot = start_m + offs_r // BLOCK_G
    g = offs_r % BLOCK_G
    head = kvh * GROUP + g
    offs_d = tl.arange(0, HEAD_DIM)
    mine = (slot < slots_total) & (g < GROUP)  # the output rows this program writes, reading or not
    if tl.load(read_ptr + start_m) == 0:  # the reading slots are a prefix: none from here on, their output zero
        tl.store(out_ptr + slot[:, None] * stride_om + head[:, None] * stride_oh + offs_d[None, :],
                 tl.zeros((BLOCK_M * BLOCK_G, HEAD_DIM), dtype=out_ptr.dtype.element_ty), mask=mine[:, None])
        return
    live = (tl.load(read_ptr + slot, mask=slot < slots_total, other=0) != 0) & (g < GROUP)
    if GATHER:  # slot m reads for batch row idx[m]: its query, request and position in batch rows
        row = tl.load(idx_ptr + slot, mask=live, other=0)
    else:
        row = slot
    req = tl.load(req_ptr + row, mask=live, other=-1)
    pos = tl.load(pos_ptr + row, mask=live, other=-1)
    q = tl.load(q_ptr + row[:, None] * stride_qm + head[:, None] * stride_qh + offs_d[None, :], mask=live[:, None],
                other=0.0)
    # A finite floor, not -inf: a row of another request than the one being read keeps alpha = 1.
    m_i = tl.full((BLOCK_M * BLOCK_G,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M * BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M * BLOCK_G, HEAD_DIM), dtype=tl.float32)
    # The tile's slots belong to one or a few requests, each a run of consecutive slots (packed in batch order):
    # read each request's keys in turn, for its rows alone.
    end_m = tl.max(tl.where(live, slot + 1, start_m), 0)
    cur = start_m
    while cur < end_m:
        if GATHER:
            r = tl.load(req_ptr + tl.load(idx_ptr + cur))
        else:
            r = tl.load(req_ptr + cur)
        nxt = tl.min(tl.where((slot > cur) & live & (req != r), slot, end_m), 0)
        rows = live & (req == r) & (slot >= cur) & (slot < nxt)
        hi = tl.max(tl.where(rows, pos, -1), 0) + 1  # the request's keys up to its last row here
        # Where the tile's reading rows are all this request's, the key blocks below its first row's position are
        # seen whole by every one of them: read without masks (flash attention's off-diagonal blocks). The rows
        # that read nothing take those keys too (their query zero), and are zeroed at the store.
        alone = tl.sum((live & (req != r)).to(tl.int32), 0) == 0
        lo = tl.min(tl.where(rows, pos, hi), 0)
        whole = tl.where(alone, (lo + 1) // BLOCK_N * BLOCK_N, 0)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            in_kv = offs_n < hi
            see = rows[:, None] & in_kv[None, :] & (offs_n[None, :] <= pos[:, None])  # causal, this request's rows
            m_i, l_i, acc = _paged_softmax_step(q, k_ptr, v_ptr, r2t_ptr, r, kvh, offs_n, offs_d, in_kv, see,
                                                qk_scale, stride_ks, stride_kh, stride_r2t, m_i, l_i, acc,
                                                start_n + BLOCK_N > whole)
        cur = nxt
    # A reading row saw at least its own key (l_i >= 1); a row that reads nothing, or a padded head, writes zero
    # (scaled, not selected per element).
    out = acc * tl.where(live, 1.0 / tl.maximum(l_i, 1.0), 0.0)[:, None]
    tl.store(out_ptr + slot[:, None] * stride_om + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mine[:, None])


INTERPRETED_READ_TILE = ReadTile(16, 16)  # under the interpreter: tl.dot's least M and N


def packed_prefill_block_m(block_g: int, tile: ReadTile) -> int:
    """Slots a program of the packed prefill read: the tile's query rows over the group's heads (padded to
    `block_g`)."""
    return max(1, tile.block_rows // block_g)


def packed_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                             req_to_token: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor,
                             reads: torch.Tensor, scale: float, block_m: int | None = None,
                             block_n: int | None = None, tile: ReadTile | None = None,
                             idx: torch.Tensor | None = None) -> torch.Tensor:
    """The prefill attention read of the RUN cohort's packed slots alone, bounded by a device mask (no host read).

    Reads   q [C, heads, hd] for the slots `reads` marks (bool [C], a prefix: the first n_run slots; slot m:
            request slot req_indices[m], position positions[m]); the slots req_to_token[req, 0..pos] of the K/V
            pools [slots, kv_heads, hd] (every row's K/V of the pass already written there, Project-Only tokens'
            included)
    Writes  out [C, heads, hd]: each reading slot's causal attention over its request; zeros elsewhere (every
            row written by the kernel: no fill launched first)
    Grid    (cdiv(C, BLOCK_M), kv_heads): a program's tile of consecutive slots, with the query heads that share
            its KV head folded into its rows, reads the keys of each request its slots belong to, up to the last
            of their positions, flash-attention style (online softmax in base 2). Where a tile's reading slots
            are all one request's, the key blocks below its first slot's position are read without masks (every
            slot sees them whole); the blocks from there on, and every block of a tile over two requests, are
            masked per slot. Slots of one request must be consecutive
            with rising positions, as a prefill pass's cohort packs them (batch order); Project-Only tokens are in
            no slot and read nothing.
    Tile    `tile` on a GPU (the device table's `prefill_read`; default `DEFAULT_READ_TILE`), the interpreter's
            16 x 16 elsewhere; `block_m` / `block_n` override its slots a program and keys a step (tests).

    With `idx` (int64 [C], the cohort's packed slots, as the decode read's): slot m reads for batch row idx[m], its
    query q[idx[m]], request req_indices[idx[m]] and position positions[idx[m]] (q, req_indices and positions in
    batch rows, as many as the slots); out stays packed. The kernel gathers them itself: no gathers launched first.
    """
    slots, heads, head_dim = q.shape if idx is None else (idx.shape[0], *q.shape[1:])
    kv_heads = k_pool.shape[1]
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 for the packed prefill attention, got {head_dim}")
    group = heads // kv_heads
    block_g = next_power_of_2(group)
    t = (tile or DEFAULT_READ_TILE) if q.is_cuda else INTERPRETED_READ_TILE
    block_m = block_m or packed_prefill_block_m(block_g, t)
    if block_m * block_g < 16:
        raise ValueError(f"block_m {block_m} x {block_g} heads a KV head gives {block_m * block_g} query rows a "
                         "program, fewer than 16")
    block_n = block_n or t.block_n
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty(slots, heads, head_dim, dtype=q.dtype, device=q.device)  # every row written by the kernel
    read = reads.contiguous() if reads.dtype == torch.bool else reads.to(torch.bool)
    packed_prefill_kernel[(cdiv(slots, block_m), kv_heads)](
        q, k_pool, v_pool, req_to_token, req_indices, positions, read, read if idx is None else idx, out,
        scale * LOG2E, slots, q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), req_to_token.stride(0),
        out.stride(0), out.stride(1), GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_M=block_m,
        BLOCK_N=block_n, GATHER=idx is not None, num_warps=t.num_warps, num_stages=t.num_stages)
    return out
