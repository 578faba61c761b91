"""The tile tuner behind `vskipper tune-tiles`: time candidate tiles against torch on the same packed rows.

For each of the 48 shapes (6 operations x 8 count ranges, `vskipper.mixed.tiles`) it builds a cohort of a
representative size for the range (the range's upper end; 4,096 for the open one) over a batch twice that size
with a random row map, times every candidate tile that fits the device's shared memory, and times the gathered
cuBLAS form on the same slots (`vskipper.mixed.gathered`: gather, matmul(s) (the MLP's gate and up as halves of
one merged weight, as served: one GEMM, `op_weights`), SiLU-and-multiply; for down, the
matmul and the weighted, masked index_add; for Q, the gather, the matmul and the mask; for o_proj, the matmul and
the masked index_add). The best candidate goes in the table with its time ratio to torch, and its time with half
the slots live (`kernel_half_ms`), and on a catalogued device its roofline floor at those rows (`floor_ms`,
`vskipper.roofline.gemm_floor_ms`): `TileTable.gathers` serves the gathered form where it beats both. A decode
shape of the down GEMMs, Q and o_proj also tries the current table's tile with K split (`SPLIT_SEEDS`) and a tile
over every slot split to fill the device (`whole_rows_split_tile`). In the
prefill ranges (a prefill pass's tokens: to 1,024, to 2,048, above; an operation's three timed together, each
candidate at every length before the next, so it compiles once; each shape twice a decode shape's share of the
budget, `PREFILL_WEIGHT`) every candidate is timed at both counts and each length takes its fastest over both
(`time_shapes`' `by_half`: a routed layer serves about half its rows RUN, where a tile that fills the device at the
full count idles). A decode range's shapes are timed as replays of a CUDA graph (their kernels take tens of microseconds, the
host's launches as long), the prefill ranges' eagerly, as each is served. After them, the packed prefill read
(`tune_prefill_read`, in a share of `READ_WEIGHT` shapes set aside from the start): each launch of
`READ_CANDIDATES` over the RUN half of one prompt of 2,048 tokens, as a served layer launches it (each slot
gathering its row's query, request and position), beside the causal read of every row by SDPA and, given a
`BackendRead`, by the host engine's attention backend (the read a routed prefill layer takes instead; `vskipper
tune-tiles` times SGLang's Triton extend kernel); the fastest goes in the table's `prefill_read`. Between the two,
at each count range, a routed layer's two cohort FFNs (the MLP over a random RUN half of the rows, the projector
over the rest) at the tiles just tuned, launched grouped (one grid a stage for both, at the MLP's tiles) and apart
(each at its own): the table's `ffn_pair`, which decides how the served layer launches
them.

Nothing is timed before its output is checked (`strays`, within `CHECK_RTOL` of the reference's largest value): a
candidate tile against the gathered form at the full and the half count (the rows past the count keeping what they
held), a packed read launch against SDPA's read of the RUN rows (zeros past them), the grouped FFN launch against
the two launched apart. A launch that strays is refused and logged (a tile's entry counts its `refused`; a grouped
launch keeps the reason as `grouped_error`, and apart serves): a fault only the device shows (a race in a K split,
a bound that reads past its rows) is never timed, so never the fastest. A shape whose every tile strays stops the
tuner, naming it.

It needs a GPU. `interpret=True` runs a tiny smoke configuration on the Triton interpreter instead (tiny widths,
fp32, one candidate per shape, one call per timing): it exercises the whole path and writes a well-formed table,
whose times mean nothing and which must never be committed as a device's table.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import NamedTuple

import torch
from torch.nn import functional as F

from vskipper.mixed.tiles import (
    CHOSEN_BOTH,
    CHOSEN_FULL,
    COUNT_RANGES,
    DEFAULT_READ_TILE,
    FFN_OPERATIONS,
    MAX_SPLIT_K,
    OPERATIONS,
    PAIR_FIELD,
    PREFILL_RANGES,
    READ_FIELD,
    SPLIT_OPERATIONS,
    ReadTile,
    Tile,
    TileTable,
    TileTableError,
    is_prefill,
    parse_tile_table,
    tile_table_for,
)
from vskipper.modelspec import DTYPE_BYTES
from vskipper.roofline import find_device, gemm_floor_ms


class TunerError(RuntimeError):
    pass


PREFILL_ROWS = 4096  # the open range's shape: a prefill pass's tokens
READ_TOKENS = 2048  # the one prompt the packed prefill read is tuned on


def representative_rows(lo: int, hi: int | None, interpret: bool = False) -> int:
    """The rows a range's shapes are timed at: its upper end (`PREFILL_ROWS` for the open one). Under the
    interpreter (a smoke run) a prefill range's first rows, the fewest it holds."""
    if interpret and is_prefill(lo):
        return lo
    return hi if hi is not None else max(lo, PREFILL_ROWS)


# Tiles tried first for a prefill pass's rows, whatever the sample (which may hold few tiles of 128 rows): the
# first five of Triton's matmul tutorial's CUDA configurations, and 128 x 128 x 64 at 8 warps.
PREFILL_SEED_TILES = (Tile(128, 256, 64, 8, 3), Tile(64, 256, 32, 4, 4), Tile(128, 128, 32, 4, 4),
                      Tile(128, 128, 64, 8, 3), Tile(128, 64, 32, 4, 4), Tile(64, 128, 32, 4, 4))


def current_table(device_name: str, shared_mem_per_block: int, dtype: str) -> TileTable | None:
    """The table the device serves with before this tuning (shipped, or the default for its shared memory); None
    where none loads here."""
    try:
        return tile_table_for(device_name, shared_mem_per_block, dtype)
    except TileTableError:
        return None


def shipped_tiles(op: str, rows: Sequence[int], current: TileTable | None) -> list[Tile]:
    """The `current` table's tile for `op` at each of `rows`, once each (none without a table)."""
    return list(dict.fromkeys(current.lookup(op, n) for n in rows)) if current is not None else []


# The K splits a decode shape of an operation that splits K tries the current table's tile at, after the tile itself:
# on the H200 the MLP's down at 128 rows ran 64 programs (64 x 128 tiles) on 132 SMs, at 1.9x cuBLAS's time.
SPLIT_SEEDS = (1, 2, 4)


SPLIT_SEED_PROGRAMS = 132  # the least grid a whole-rows split seed aims at: a program on each H100 or H200 SM


def whole_rows_split_tile(rows: int, n_dim: int) -> Tile:
    """A decode shape's tile that reads each weight once (to 128 rows) and fills the device by splitting K: one row
    tile over every slot (block_m the rows' power of two, 16..128), 64 output columns a program, block_k 128 (64
    where block_m is 128, from 65 rows), 4 warps (8 where block_m is 64 or more, from 33 rows), 4 stages (a seed
    whose buffers do not fit is dropped, `candidate_tiles`), and K split the fewest ways (a power of two, to
    `MAX_SPLIT_K`) whose grid holds `SPLIT_SEED_PROGRAMS` programs."""
    block_m = min(128, max(16, 1 << (rows - 1).bit_length()))
    programs = -(-rows // block_m) * -(-n_dim // 64)
    split = 1
    while programs * split < SPLIT_SEED_PROGRAMS and split < MAX_SPLIT_K:
        split *= 2
    return Tile(block_m, 64, 64 if block_m == 128 else 128, 8 if block_m >= 64 else 4, 4, split)


def seed_tiles(op: str, lo: int, rows: Sequence[int], current: TileTable | None, n_dim: int | None = None
               ) -> list[Tile]:
    """The tiles the shapes of ranges from `lo`, timed at `rows`, are tried with before the sample: the `current`
    table's at each (`shipped_tiles`), so a new table is never measured worse than the one it replaces; for the
    prefill ranges (a prefill pass's tokens) the large tiles of `PREFILL_SEED_TILES`; for a decode range of an
    operation that splits K (`SPLIT_OPERATIONS`), the current tile at each split of `SPLIT_SEEDS`, and given the
    operation's output width `n_dim`, the `whole_rows_split_tile` of each of `rows`."""
    shipped = shipped_tiles(op, rows, current)
    if is_prefill(lo):
        return shipped + list(PREFILL_SEED_TILES)
    if op not in SPLIT_OPERATIONS:
        return shipped
    split = [replace(t, split_k=s) for t in shipped for s in SPLIT_SEEDS if s != t.split_k]
    whole = [whole_rows_split_tile(n, n_dim) for n in rows] if n_dim is not None else []
    return list(dict.fromkeys(shipped + split + whole))


def candidate_tiles(op: str, rows: int, shared_mem_per_block: int, dtype_bytes: int = 2,
                    limit: int | None = None, seeds: tuple[Tile, ...] | list[Tile] = ()) -> list[Tile]:
    """The tiles tried for `op` over `rows` rows: `seeds` first (those whose buffers fit), then the grid of block
    sizes, warps and stages that fits the shared memory, sampled evenly down to `limit` tiles in all."""
    fits = [t for t in dict.fromkeys(seeds) if t.shared_mem_bytes(op, dtype_bytes) <= shared_mem_per_block]
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
    out = [t for t in out if t not in fits]
    if limit is not None:
        # The seeds first, then a sample spread over the list (its smallest tile always in it).
        fits = fits[:limit]
        room = limit - len(fits)
        step = max(1, len(out) // max(1, room))
        out = out[::step][:room]
    return fits + out


def _ms(value: float) -> float:
    """A time as the table keeps it: five significant digits (never rounded to zero, which a table refuses)."""
    return float(f"{value:.5g}")


def time_call(fn: Callable[[], object], interpret: bool, reps: int = 20, graph: bool = False) -> float:
    """Milliseconds per call: on a GPU triton's do_bench, or with `graph` the replay of a CUDA graph holding the
    calls (do_bench_cudagraph), as a decode pass replays its kernels: no launch overhead on either side, where a
    decode shape's kernels (tens of microseconds) would otherwise time the host's launches. Wall clock under the
    interpreter."""
    if not interpret:
        from triton.testing import do_bench, do_bench_cudagraph

        if graph:  # replays vary little: a fifth of do_bench's time, which also bounds the graph's unrolled calls
            return float(do_bench_cudagraph(fn, rep=reps))
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


def op_weights(op: str, n_dim: int, k_dim: int, g: torch.Generator, device: torch.device, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random [N, K] weights of an operation as served: the MLP's gate and up as the halves of one merged
    weight (SGLang's `gate_up_proj`, which the gathered form multiplies in one GEMM), any other operation's apart
    (the projector's gate and up are weights of their own; other operations take the first alone)."""
    both = (torch.randn(2 * n_dim, k_dim, generator=g) / k_dim**0.5).to(device, dtype)
    if op == "mlp_gate_up":
        return both[:n_dim], both[n_dim:]
    return both[:n_dim].clone(), both[n_dim:].clone()


def shape_calls(op: str, rows: int, w1: torch.Tensor, w2: torch.Tensor, g: torch.Generator,
                device: torch.device, dtype: torch.dtype
                ) -> tuple[Callable[[], object], Callable[..., object], torch.Tensor,
                           Callable[[Tile], tuple[float, float]]]:
    """The gathered cuBLAS form (`vskipper.mixed.gathered`, what serves where it wins) and the kernel of operation
    `op` over a cohort map of `rows` slots in a batch twice that size, with a random row map: what the tuner and
    `benchmarks/mixed_depth_bench.py` time side by side. The kernel takes a tile and optionally a device count
    (every slot live by default); the third value is the count of half the slots; the fourth checks a tile
    (`strays`: the kernel's output against the gathered form's, at the full count and at half, where the rows past
    the count must keep what they held). w1 [N, K] is the weight (gate-up: the gate; down: W_down), w2 the gate-up's
    up weight. Q (`attn_q`) is timed in the forms the decode read and the packed prefill read take: into the batch
    rows of a batch of `rows` rows (`batch_rows`; the packed form a prefill through SGLang's backend takes costs
    the kernel the same, its gathered form a gather and a mask more)."""
    from vskipper.mixed.gathered import batch_rows_gemm, gathered_down, gathered_gate_up, gathered_scatter_add
    from vskipper.mixed.kernels import cohort_down_scatter, cohort_gate_up, cohort_gemm, cohort_scatter_add

    batch, k_dim, n_dim = 2 * rows, w1.shape[1], w1.shape[0]
    idx = torch.randperm(batch, generator=g)[:rows].to(device)
    count = torch.tensor([rows], device=device)
    h = max(1, rows // 2)
    half = torch.tensor([h], device=device)
    # each operation draws only the operands it reads (the down GEMMs and o_proj no batch of inputs: at the open
    # prefill range's 4,096 rows the MLP's down would draw 117 M values for nothing)
    if op.endswith("gate_up"):
        x = torch.randn(batch, k_dim, generator=g).to(device, dtype)

        def gate_up(tile, n=count):
            return cohort_gate_up(x, idx, n, w1, w2, tile=tile)

        want_gate_up = functools.cache(lambda: gathered_gate_up(x, idx, count, w1, w2))

        def check_gate_up(tile):  # slot m's row depends on m alone; the half count's rows past it hold nothing
            want = want_gate_up()
            return strays([(gate_up(tile), want), (gate_up(tile, half)[:h], want[:h])])

        return lambda: gathered_gate_up(x, idx, count, w1, w2), gate_up, half, check_gate_up
    if op == "attn_q":
        x_rows = torch.randn(rows, k_dim, generator=g).to(device, dtype)
        rows_idx = torch.randperm(rows, generator=g).to(device)

        def q(tile, n=count):
            return cohort_gemm(x_rows, rows_idx, n, w1, tile=tile, batch_rows=True)

        want_q = functools.cache(lambda: batch_rows_gemm(x_rows, w1))

        def check_q(tile):  # the cohort's rows in their batch rows; the others hold no meaning
            want, live = want_q(), rows_idx[:h]
            return strays([(q(tile), want), (q(tile, half)[live], want[live])])

        return lambda: batch_rows_gemm(x_rows, w1), q, half, check_q
    packed = torch.randn(rows, k_dim, generator=g).to(device, dtype)
    y = torch.zeros(batch, n_dim, device=device, dtype=dtype)
    if op == "attn_o":
        def reference():
            gathered_scatter_add(packed, idx, count, w1, y)

        def kernel(tile, n=count):
            cohort_scatter_add(packed, idx, n, w1, y, tile=tile)
    else:
        weights = torch.rand(batch, generator=g).to(device, dtype)

        def reference():
            gathered_down(packed, idx, count, weights, w1, y)

        def kernel(tile, n=count):
            cohort_down_scatter(packed, idx, n, weights, w1, y, tile=tile)

    def added(call) -> torch.Tensor:  # what one call adds onto zeroed rows
        y.zero_()
        call()
        return y.clone()

    @functools.cache
    def wanted() -> tuple[torch.Tensor, torch.Tensor]:  # the half count adds onto its slots' rows alone
        want = added(reference)
        want_half = torch.zeros_like(want)
        want_half[idx[:h]] = want[idx[:h]]
        return want, want_half

    def check_scatter(tile):
        want, want_half = wanted()
        return strays([(added(lambda: kernel(tile)), want), (added(lambda: kernel(tile, half)), want_half)])

    return reference, kernel, half, check_scatter


# The packed prefill read's launches tried on a GPU, the kernel's default first: query rows a program (the slots
# times the grouped heads), keys a step, warps, stages.
READ_CANDIDATES = (DEFAULT_READ_TILE, ReadTile(64, 32, 4, 3), ReadTile(64, 64, 4, 3), ReadTile(64, 128, 8, 2),
                   ReadTile(128, 32, 8, 3), ReadTile(128, 64, 8, 2), ReadTile(128, 64, 8, 3), ReadTile(128, 128, 8, 2))
READ_RUN_SHARE = 0.5  # the RUN share of the prompt the read is tuned on (RandomSkip r = 1, d = 0.5)
INTERPRETED_READ_TOKENS = 64


class BackendRead(NamedTuple):
    """The host engine's own prefill read, which a routed prefill layer takes where the packed read is no faster:
    `build(q, k, v, scale)` over one prompt in position order (q [T, heads, head_dim], k and v [T, kv_heads,
    head_dim]) returns a call that reads every row causally and returns its output [T, heads, head_dim]; `name` as
    the engine names that attention backend (`vskipper.sglang.backend_read` holds SGLang's)."""

    name: str
    build: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], Callable[[], torch.Tensor]]


# How far a timed call's output may stray from its reference's and still be timed as the same computation, as a
# share of the reference's largest value: a candidate tile's from the gathered cuBLAS form's, a packed read launch's
# and the backend's read from SDPA's causal read. Two bf16 roundings of the same value differ by an ulp, 1/128 of
# it; a kernel over the wrong rows, a K split that drops or doubles a part, a count bound that writes past the count
# or a read without the causal mask strays by whole values (the first row reads its own value alone).
CHECK_RTOL = 0.02


def strays(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """(the largest deviation of each (got, want) pair's `got` from its `want`, the deviation allowed: `CHECK_RTOL`
    of the first `want`'s largest value). NaN anywhere in `got` is a deviation past any bound."""
    err = 0.0
    for got, want in pairs:
        diff = (got.float() - want.float()).abs().max()
        err = max(err, float("inf") if torch.isnan(diff) else float(diff))
    return err, CHECK_RTOL * float(pairs[0][1].float().abs().max())


def read_calls(tokens: int, heads: int, kv_heads: int, head_dim: int, g: torch.Generator, device: torch.device,
               dtype: torch.dtype
               ) -> tuple[Callable[[], torch.Tensor], Callable[[ReadTile], object], float, tuple,
                          Callable[[ReadTile], tuple[float, float]]]:
    """The causal read of one prompt of `tokens` tokens by every row (SDPA, as a dense layer reads) and the packed
    read of its RUN rows alone (a random `READ_RUN_SHARE` of them, their K/V in shuffled pool slots) at a given tile,
    as a served layer launches it: over the pass's slots, the RUN rows' slots first (in position order), each
    gathering its row's query, request and position from the batch rows; the share of query-key pairs the RUN
    rows have (the read's limit); the prompt in position order, (q, k, v, scale), for a `BackendRead`; and the
    check of a launch (`strays`: its RUN slots against SDPA's rows at their positions, its other slots against
    zero)."""
    from vskipper.mixed.kernels import packed_prefill_attention

    k_pool = torch.randn(tokens, kv_heads, head_dim, generator=g).to(device, dtype)
    v_pool = torch.randn(tokens, kv_heads, head_dim, generator=g).to(device, dtype)
    r2t = torch.randperm(tokens, generator=g).to(torch.int32).view(1, tokens).to(device)
    n_run = max(1, int(tokens * READ_RUN_SHARE))
    pos = torch.randperm(tokens, generator=g)[:n_run].sort().values
    q_all = torch.randn(tokens, heads, head_dim, generator=g).to(device, dtype)
    idx = torch.zeros(tokens, dtype=torch.int64)
    idx[:n_run] = pos
    idx, positions = idx.to(device), torch.arange(tokens, device=device)
    req = torch.zeros(tokens, dtype=torch.int64, device=device)
    reads = (torch.arange(tokens) < n_run).to(device)
    scale = head_dim ** -0.5
    k_seq = k_pool[r2t[0].long()].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, tokens, hd] in position order
    v_seq = v_pool[r2t[0].long()].transpose(0, 1).unsqueeze(0)
    q_seq = q_all.transpose(0, 1).unsqueeze(0)

    def causal():
        return F.scaled_dot_product_attention(q_seq, k_seq, v_seq, is_causal=True, scale=scale, enable_gqa=True)

    def packed(tile: ReadTile):
        return packed_prefill_attention(q_all, k_pool, v_pool, r2t, req, positions, reads, scale, tile=tile,
                                        idx=idx)

    want_rows = functools.cache(lambda: causal()[0].transpose(0, 1)[pos.to(device)])  # SDPA's, at the RUN rows

    def check(tile: ReadTile) -> tuple[float, float]:  # the RUN rows' outputs in their slots, zeros past them
        out = packed(tile)
        return strays([(out[:n_run], want_rows()), (out[n_run:], torch.zeros_like(out[n_run:]))])

    pairs = float((pos + 1).sum()) / (tokens * (tokens + 1) / 2)
    prompt = (q_all, k_seq[0].transpose(0, 1).contiguous(), v_seq[0].transpose(0, 1).contiguous(), scale)
    return causal, packed, pairs, prompt, check


def time_backend_read(backend: BackendRead, causal: Callable[[], torch.Tensor], prompt: tuple, interpret: bool,
                      log: Callable[[str], None] = print) -> dict:
    """The `prefill_read` entry's fields for the host backend's read of every row (`backend`,
    `backend_all_rows_ms`), once its output matched SDPA's causal read of the same prompt (so what is timed is that
    read); none where it could not run or did not match, with the reason logged."""
    try:
        call = backend.build(*prompt)
        err, allowed = strays([(call(), causal()[0].transpose(0, 1))])
        if not err <= allowed:
            log(f"prefill_read: the {backend.name} backend's read not timed: its output strays {err:.3g} from "
                f"SDPA's causal read of the same prompt (at most {allowed:.3g})")
            return {}
        ms = time_call(call, interpret)
    except Exception as exc:  # the engine's kernel missing or refusing the shape: the table keeps SDPA's alone
        log(f"prefill_read: the {backend.name} backend's read not timed ({type(exc).__name__}: "
            f"{str(exc).strip()[:300]})")
        return {}
    return {"backend": backend.name, "backend_all_rows_ms": _ms(ms)}


# The packed prefill read's weight in the tuner's budget, against a GEMM shape's 1: it serves every RUN token of
# every routed prefill layer, and each of its eight launches compiles a kernel of its own.
READ_WEIGHT = 6


class Clock:
    """The tuner's time budget (None: unbounded), shared by the shapes still to tune by their weights (`start_shape`:
    a prefill shape twice a decode shape): a shape stops trying candidates once its share is spent (after its first),
    so the tuner ends about when its budget does, its later shapes timed on fewer candidates (the seeds come first)
    when compiles and timings run slower than planned. `reserved` weighs a shape timed last (the packed read,
    `READ_WEIGHT`): its share of the whole budget is set aside from the start, so the shapes before it cannot
    spend it however slowly they run."""

    def __init__(self, budget_s: float | None, shapes: float, reserved: float = 0) -> None:
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        self.left = shapes
        self.reserve_s = 0.0 if budget_s is None else budget_s * reserved / max(1e-9, shapes + reserved)
        self.shape_deadline: float | None = None

    def start_shape(self, weight: float = 1.0) -> None:
        """A shape of `weight` (a GEMM shape's 1) takes that share of what is left to the shapes still to tune."""
        if self.deadline is not None:
            now = time.monotonic()
            share = weight / max(weight, self.left)
            self.shape_deadline = now + max(0.0, self.deadline - self.reserve_s - now) * share
        self.left -= weight

    def start_reserved(self) -> None:
        """The reserved shape: whatever is left of the budget, its set-aside share included."""
        self.reserve_s, self.left = 0.0, 0
        self.shape_deadline = self.deadline

    def spent(self, tried: int) -> bool:
        return tried > 0 and self.shape_deadline is not None and time.monotonic() > self.shape_deadline


def tune_prefill_read(heads: int, kv_heads: int, head_dim: int, dtype: str = "bfloat16", interpret: bool = False,
                      log: Callable[[str], None] = print, clock: Clock | None = None,
                      backend: BackendRead | None = None) -> dict:
    """The packed prefill read's best launch (`READ_CANDIDATES`) on one prompt of `READ_TOKENS`, beside the
    default's time and the causal read of every row by SDPA and, given `backend`, by the host engine's backend
    (`time_backend_read`); the table's `prefill_read` entry."""
    clock = clock or Clock(None, 0)
    clock.start_reserved()
    device = torch.device("cpu" if interpret else "cuda")
    tokens = INTERPRETED_READ_TOKENS if interpret else READ_TOKENS
    tdtype = torch.float32 if interpret else getattr(torch, dtype)
    causal, packed, pairs, prompt, check = read_calls(tokens, heads, kv_heads, head_dim,
                                                      torch.Generator().manual_seed(1), device, tdtype)
    causal_ms = time_call(causal, interpret)
    timed: dict[ReadTile, float] = {}
    refused = 0
    for tile in READ_CANDIDATES[:1] if interpret else READ_CANDIDATES:
        if clock.spent(len(timed)):
            break
        try:
            err, allowed = check(tile)  # once before timing (it compiles the launch, too)
            if not err <= allowed:
                log(f"  prefill_read: refuse {tile}: its output strays {err:.3g} from SDPA's causal read "
                    f"(at most {allowed:.3g})")
                refused += 1
                continue
            timed[tile] = time_call(lambda tile=tile: packed(tile), interpret)
        except Exception as exc:  # a launch the compiler rejects (registers, shared memory) is skipped
            log(f"  prefill_read: skip {tile}: {type(exc).__name__}")
    if not timed:
        raise TunerError("prefill_read: no candidate launch ran"
                         + (f" ({refused} refused: their output strayed from SDPA's causal read)" if refused else ""))
    tile, ms = min(timed.items(), key=lambda kv: kv[1])
    default = timed.get(DEFAULT_READ_TILE)  # None where the default launch did not run
    # the engine's kernel last: one that broke the device would take the packed launches' timings with it
    backend_times = time_backend_read(backend, causal, prompt, interpret, log) if backend is not None else {}
    log(f"prefill_read  {tokens} tokens, {READ_RUN_SHARE:.0%} RUN, heads {heads}/{kv_heads} x {head_dim}: best {tile} "
        f"{ms:.4f} ms (default {'did not run' if default is None else f'{default:.4f} ms'}) vs every row's causal "
        f"read {causal_ms:.4f} ms by SDPA ({ms / causal_ms:.2f}x"
        + (f"), {backend_times['backend_all_rows_ms']:.4f} ms by the {backend_times['backend']} backend "
           f"({ms / backend_times['backend_all_rows_ms']:.2f}x" if backend_times else "")
        + f"; the RUN rows' share of the pairs {pairs:.2f})")
    return {**asdict(tile), "kernel_ms": _ms(ms), "default_ms": None if default is None else _ms(default),
            "causal_all_rows_ms": _ms(causal_ms), **backend_times, "pairs_share": round(pairs, 4), "tokens": tokens,
            "run_share": READ_RUN_SHARE, "tried": len(timed), **({"refused": refused} if refused else {})}


class ShapeCalls(NamedTuple):
    """One shape's calls (`shape_calls`): the gathered form, the kernel (a tile, optionally a device count), the
    count of half its slots and the check of a tile's output (None: not checked); `name` as the log says it."""

    name: str
    reference: Callable[[], object]
    kernel: Callable[..., object]
    half: torch.Tensor
    check: Callable[[Tile], tuple[float, float]] | None = None


def time_shape(shape: str, reference: Callable[[], object], kernel: Callable[..., object], half: torch.Tensor,
               candidates: list[Tile], clock: Clock, interpret: bool, graph: bool,
               log: Callable[[str], None] = print, by_half: bool = False,
               check: Callable[[Tile], tuple[float, float]] | None = None) -> dict:
    """One shape's table entry (`time_shapes` of that shape alone)."""
    return time_shapes([ShapeCalls(shape, reference, kernel, half, check)], candidates, clock, interpret, graph, log,
                       by_half)[0]


def time_shapes(shapes: list[ShapeCalls], candidates: list[Tile], clock: Clock, interpret: bool, graph: bool,
                log: Callable[[str], None] = print, by_half: bool = False, keep: int = 1) -> list[dict]:
    """Each shape's table entry: the gathered form's time, the best candidate tile's (every slot live) and that
    tile's with `half` the slots live, and what was tried; 'line' is the log's summary. With `graph`, as CUDA
    graph replays; where a shape's gathered form cannot be captured, every time of that shape is taken eagerly and
    its entry keeps no half-count time, so the form never serves there (a decode pass captures it). Several shapes
    (one operation's prefill lengths) take the candidates in turn, each candidate timed at every shape before the
    next: a tile compiles once for all of them, where shape after shape each would compile it again out of its own
    share (on a GPU a compile takes about as long as several timings).

    The best tile is the fastest with every slot live; with `by_half`, the fastest over both counts (its two times
    summed: each candidate is timed at half the count too). A served routed layer has about half its slots live, and
    a tile whose grid fills the device once at the full count runs half its programs, each as long, at half: on an
    H200 a 1,024-token prefill's routed down GEMMs (the MLP's at 128 x 256 tiles, 128 programs on 132 SMs, with
    the projector's in one grid) took 0.96 of their all-RUN time with half the rows RUN. The sum may pick a tile a
    little slower with every slot live (an all-RUN prefill, the s = 0 control's) for one much faster at half; the
    operation is timed alone, where a served layer may launch the projector's programs in the same grid (the
    FFN pair, timed after at the tiles chosen). Each candidate costs two timings: the shape's share of the budget
    reaches about half as many. The first `keep` candidates run whatever the budget (the current table's tile at
    each shape's range: a new table is never measured worse than the one it replaces)."""
    torch_ms, graphs = [], []  # graphs[n] False where asked for: the shape's capture failed
    for shape in shapes:
        try:
            torch_ms.append(time_call(shape.reference, interpret, graph=graph))
            graphs.append(graph)
        except Exception as exc:  # capture refused: eager times, and the gathered form is ruled out
            log(f"  {shape.name}: timed eagerly, the gathered form's CUDA graph failed ({type(exc).__name__}: "
                f"{exc}); it will not serve here")
            torch_ms.append(time_call(shape.reference, interpret))
            graphs.append(False)
    best: list[tuple[float, float, float | None, Tile] | None] = [None] * len(shapes)  # (score, full, half, tile)
    tried, refused = [0] * len(shapes), [0] * len(shapes)
    for tile in candidates:
        # never before every shape took the first `keep` (timed, or refused: a shape that refuses every tile spends
        # the budget as one that times them)
        taken = min(t + r for t, r in zip(tried, refused, strict=True))
        if taken >= keep and clock.spent(taken):
            break
        for n, shape in enumerate(shapes):
            try:
                if shape.check is not None:  # run once before any timing (it compiles the tile, too)
                    err, allowed = shape.check(tile)
                    if not err <= allowed:
                        log(f"  {shape.name}: refuse {tile}: its output strays {err:.3g} from the gathered form's "
                            f"(at most {allowed:.3g})")
                        refused[n] += 1
                        continue
                ms = time_call(lambda tile=tile, kernel=shape.kernel: kernel(tile), interpret, graph=graphs[n])
                half_ms = (time_call(lambda tile=tile, kernel=shape.kernel, half=shape.half: kernel(tile, half),
                                     interpret, graph=graphs[n]) if by_half else None)
            except Exception as exc:  # a candidate the compiler rejects (e.g. out of registers) is skipped
                log(f"  {shape.name}: skip {tile}: {type(exc).__name__}")
                continue
            tried[n] += 1
            score = ms + (half_ms or 0.0)
            if best[n] is None or score < best[n][0]:
                best[n] = (score, ms, half_ms, tile)
    entries = []
    for n, shape in enumerate(shapes):
        if best[n] is None:
            raise TunerError(f"{shape.name}: no candidate tile ran"
                             + (f" ({refused[n]} refused: their output strayed from the gathered form's)"
                                if refused[n] else ""))
        _, ms, half_ms, tile = best[n]
        if half_ms is None:
            half_ms = time_call(lambda tile=tile, kernel=shape.kernel, half=shape.half: kernel(tile, half),
                                interpret, graph=graphs[n])
        ratio = ms / torch_ms[n]
        line = (f"best {tile}{' over full and half live' if by_half else ''} {ms:.4f} ms (half live {half_ms:.4f}) "
                f"vs torch {torch_ms[n]:.4f} ms ({ratio:.2f}x; {tried[n]} tiles timed"
                f"{' in CUDA graphs' if graphs[n] else ''}{f', {refused[n]} refused' if refused[n] else ''})")
        entries.append({**asdict(tile), "ratio_vs_torch": round(ratio, 3), "kernel_ms": _ms(ms),
                        **({"kernel_half_ms": _ms(half_ms)} if graphs[n] == graph else {}),
                        "torch_ms": _ms(torch_ms[n]),
                        "tried": tried[n], **({"refused": refused[n]} if refused[n] else {}),
                        "timed": "cuda graph" if graphs[n] else ("interpreter" if interpret else "eager"),
                        "chosen_by": CHOSEN_BOTH if by_half else CHOSEN_FULL, "line": line})
    return entries


# The FFN pair's weight in the tuner's budget at each range, against a GEMM shape's 1 (up to 24 tiles): two timings.
PAIR_WEIGHT = 0.25
# A prefill shape's weight against a decode shape's 1: each candidate is timed at both counts, eagerly, over
# thousands of rows (on the H200 a decode shape timed 6-19 tiles in its share, a prefill shape at one count 4-14).
PREFILL_WEIGHT = 2.0


def shape_weight(lo: int) -> float:
    """The budget weight of a GEMM shape of the count range from `lo` rows."""
    return PREFILL_WEIGHT if is_prefill(lo) else 1.0


def ffn_pair_calls(rows: int, hidden: int, intermediate: int, proj_width: int, table: TileTable,
                   g: torch.Generator, device: torch.device, dtype: torch.dtype
                   ) -> tuple[Callable[[], object], Callable[[], object], Callable[[], tuple[float, float]]]:
    """A routed layer's two cohort FFNs over one pass of `rows` rows, a random half of them RUN, at `table`'s
    tiles, as `kernels.cohort_ffn_pair` serves them (the branch output stored): (grouped, apart, the check of the
    grouped launch's output against the two launched apart, `strays`, every row of it stored)."""
    from vskipper.mixed.cohorts import build_cohorts
    from vskipper.mixed.kernels import CohortFFN, cohort_ffn_pair

    x = torch.randn(rows, hidden, generator=g).to(device, dtype)
    weights = torch.rand(rows, generator=g).to(device, dtype)
    c = build_cohorts((torch.rand(rows, generator=g) < 0.5).to(device))
    (gate, up), (p_gate, p_up) = (op_weights(op, n, hidden, g, device, dtype)
                                  for op, n in (("mlp_gate_up", intermediate), ("proj_gate_up", proj_width)))
    down = (torch.randn(hidden, intermediate, generator=g) / intermediate**0.5).to(device, dtype)
    p_down = (torch.randn(hidden, proj_width, generator=g) / proj_width**0.5).to(device, dtype)
    mlp, proj = CohortFFN(c.run_idx, c.n_run, gate, up, down), CohortFFN(c.proj_idx, c.n_proj, p_gate, p_up, p_down)
    y = torch.empty(rows, hidden, device=device, dtype=dtype)

    def pair(grouped: bool) -> Callable[[], object]:
        return lambda: cohort_ffn_pair(x, weights, y, mlp, proj, tiles=table, accumulate=False, grouped=grouped)

    def stored(call) -> torch.Tensor:  # every row is one cohort's: stored by its FFN
        y.fill_(float("nan"))
        call()
        return y.clone()

    def check() -> tuple[float, float]:
        return strays([(stored(pair(True)), stored(pair(False)))])

    return pair(True), pair(False), check


def time_ffn_pairs(table: TileTable, hidden: int, intermediate: int, proj_width: int, g: torch.Generator,
                   device: torch.device, dtype: torch.dtype, interpret: bool, clock: Clock,
                   log: Callable[[str], None] = print) -> list[dict]:
    """The table's `ffn_pair` entries: at each count range the two cohort FFNs grouped against apart (CUDA graph
    replays for a decode range, as `time_shape` times them), at the tiles just tuned (grouped, both down GEMMs at
    the MLP's down tile and its split; apart, each at its own). A range where the table gathers an FFN GEMM (the
    two launch apart there whatever), or the budget is spent, keeps no timing: the served layer then groups them
    wherever it can (`TileTable.groups_ffn`). A range whose grouped launch fails, or whose output strays from the
    two launched apart, keeps the error (`grouped_error`): the served layer launches the two apart there, as the
    GEMMs' own timings did."""
    entries = []
    for lo, hi in COUNT_RANGES:
        clock.start_shape(PAIR_WEIGHT)
        rows = representative_rows(lo, hi, interpret)
        entry: dict = {"rows": [lo, hi]}
        where = f"ffn pair      rows {lo:>3}..{hi if hi else '':<4}"
        if any(table.gathers(op, rows) for op in FFN_OPERATIONS):
            log(f"{where} not timed: the table gathers an FFN GEMM there")
        elif clock.spent(1):
            log(f"{where} not timed: the budget is spent")
        else:
            grouped, apart, check = ffn_pair_calls(rows, hidden, intermediate, proj_width, table, g, device,
                                                   dtype)
            graph = not is_prefill(lo) and not interpret
            try:  # the GEMMs' own launches, each timed at these tiles already
                entry.update(apart_ms=_ms(time_call(apart, interpret, graph=graph)))
            except Exception as exc:  # the tiles' timings stand; this range keeps none
                log(f"{where} not timed: apart failed ({type(exc).__name__}: {str(exc).strip()[:300]})")
                entries.append(entry)
                continue
            try:
                err, allowed = check()  # once before timing: a grouped launch that strays is not served
                if not err <= allowed:
                    raise TunerError(f"its output strays {err:.3g} from the two launched apart (at most "
                                     f"{allowed:.3g})")
                entry.update(grouped_ms=_ms(time_call(grouped, interpret, graph=graph)))
            except Exception as exc:  # a launch the compiler or the device refuses, or a wrong one: apart serves
                entry.update(grouped_error=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
                log(f"{where} grouped failed ({entry['grouped_error']}); apart {entry['apart_ms']:.4f} ms serves")
            else:
                log(f"{where} grouped {entry['grouped_ms']:.4f} ms, apart {entry['apart_ms']:.4f} ms "
                    f"({entry['grouped_ms'] / entry['apart_ms']:.2f}x){' in CUDA graphs' if graph else ''}")
        entries.append(entry)
    return entries


def tune(device_name: str, shared_mem_per_block: int, hidden: int, intermediate: int, proj_width: int,
         dtype: str = "bfloat16", interpret: bool = False, max_candidates: int | None = None,
         log: Callable[[str], None] = print, q_width: int | None = None,
         read_heads: tuple[int, int, int] | None = None, budget_s: float | None = None,
         backend: BackendRead | None = None) -> dict:
    """Tune all 48 shapes, then time the FFN pair at each count range (`time_ffn_pairs`), and, given `read_heads`
    = (heads, kv_heads, head_dim), the packed prefill read (beside `backend`'s read of every row, given one), within
    `budget_s` (`Clock`); returns the table as a dict (validated), each entry with its ratio to torch and the
    candidates it tried."""
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
    current = current_table(device_name, shared_mem_per_block, dtype)
    catalogued = find_device(device_name)
    clock = Clock(budget_s, sum(len(OPERATIONS) * shape_weight(lo) + PAIR_WEIGHT for lo, _ in COUNT_RANGES),
                  READ_WEIGHT if read_heads is not None else 0)
    tiles: dict[str, list[dict]] = {}
    for op in OPERATIONS:
        k_dim, n_dim = op_dims(op, hidden, intermediate, proj_width, q_width)
        w1, w2 = op_weights(op, n_dim, k_dim, g, device, tdtype)
        # each decode range alone, served from graphs; the prefill lengths together (a tile compiled once for all
        # of them), each chosen over the full and the half count
        groups = [[r] for r in COUNT_RANGES if not is_prefill(r[0])] + [list(PREFILL_RANGES)]
        entries = []
        for ranges in groups:
            clock.start_shape(sum(shape_weight(lo) for lo, _ in ranges))
            rows = [representative_rows(lo, hi, interpret) for lo, hi in ranges]
            shapes = [ShapeCalls(f"{op} rows {lo}..{hi}", *shape_calls(op, n, w1, w2, g, device, tdtype))
                      for (lo, hi), n in zip(ranges, rows, strict=True)]
            prefill = is_prefill(ranges[0][0])
            candidates = candidate_tiles(op, rows[0], shared_mem_per_block, DTYPE_BYTES[dtype], max_candidates,
                                         seed_tiles(op, ranges[0][0], rows, current, n_dim))
            # the current table's tile at every length is timed whatever the budget (they come first)
            keep = max(1, len(shipped_tiles(op, rows, current)))
            timed = time_shapes(shapes, candidates, clock, interpret, graph=not prefill and not interpret, log=log,
                                by_half=prefill, keep=keep)
            for (lo, hi), n, entry in zip(ranges, rows, timed, strict=True):
                log(f"{op:13} rows {lo:>3}..{hi if hi else '':<4} K={k_dim:<6} N={n_dim:<6} {entry.pop('line')}")
                if catalogued is not None:  # the shape's roofline floor at its timed rows, beside its times
                    entry["floor_ms"] = _ms(gemm_floor_ms(n, n_dim, k_dim, 2 if op.endswith("gate_up") else 1,
                                                          DTYPE_BYTES[dtype], catalogued))
                entries.append({"rows": [lo, hi], **entry})
            del shapes  # the prefill lengths' operands are the largest; free them before the next operation's
        tiles[op] = entries
    data = {"device": device_name, "dtype": dtype,
            "source": ("interpreter smoke run (not a measurement)" if interpret else
                       f"vskipper tune-tiles: hidden {hidden}, intermediate {intermediate}, projector {proj_width}, "
                       f"q {q_width or hidden}"),
            "tiles": tiles}
    data[PAIR_FIELD] = time_ffn_pairs(parse_tile_table(data, shared_mem_per_block, where="tuned table"), hidden,
                                      intermediate, proj_width, g, device, tdtype, interpret, clock, log)
    if read_heads is not None:  # last, in the share set aside for it: a launch that broke the device loses no GEMM
        try:
            data[READ_FIELD] = tune_prefill_read(*read_heads, dtype=dtype, interpret=interpret, log=log, clock=clock,
                                                 backend=backend)
        except Exception as exc:  # optional: the GEMMs' measurements stand, the read keeps its default launch
            log(f"prefill_read: not tuned ({type(exc).__name__}: {exc}); the table keeps no `{READ_FIELD}`")
    parse_tile_table(data, shared_mem_per_block, where="tuned table")  # what we write must load
    return data
