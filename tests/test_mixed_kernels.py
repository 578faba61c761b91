"""The Triton kernels under TRITON_INTERPRET=1 (no GPU here): count-bounded cohort GEMMs with the gather in the
operand load and the weighted scatter in the epilogue, the masked decode attention, and a routed decode forward
running on them, each against plain torch. The interpreter proves the kernels' semantics (indexing, masks,
early exit, epilogue); their speed needs a GPU (benchmarks/mixed_depth_bench.py)."""

import os
import random
from contextlib import contextmanager

import pytest
import torch
from mixed_world import HostReadDetector, OwnLaunches, TapeSkipper, World, random_routes

from vskipper.mixed.attention import paged_attention
from vskipper.mixed.backend import cohort_ffn_torch
from vskipper.mixed.bench_stack import BenchStack
from vskipper.mixed.cohorts import CohortBuilder, build_cohorts
from vskipper.mixed.kernels import (
    INTERPRETED_READ_TILE,
    CohortFFN,
    cdiv,
    cohort_down_scatter,
    cohort_ffn_pair,
    cohort_ffn_triton,
    cohort_gate_up,
    cohort_gemm,
    cohort_scatter_add,
    masked_decode_attention,
    next_power_of_2,
    packed_prefill_attention,
    packed_prefill_block_m,
)
from vskipper.mixed.reference import reference_forward
from vskipper.mixed.tape import RouteTape
from vskipper.mixed.tiles import Tile
from vskipper.mixed.tuner import READ_CANDIDATES
from vskipper.skippers.base import LayerRoute
from vskipper.skippers.static_depth import StaticDepth
from vskipper.skippers.trained_gate import FlexiDepthGate

# tests/conftest.py selects the interpreter before triton is first imported.
assert os.environ.get("TRITON_INTERPRET") == "1", "the kernel tests need TRITON_INTERPRET=1 (see conftest.py)"

SMALL = Tile(16, 32, 32, 4, 1)


def weights(g, d, n):
    return (torch.randn(n, d, generator=g) / d**0.5, torch.randn(n, d, generator=g) / d**0.5,
            torch.randn(d, n, generator=g) / n**0.5)


def test_the_host_grid_helpers_agree_with_tritons_own():
    """The launch grids' host arithmetic (without `triton.cdiv`'s constexpr-function call) equals Triton's at every
    size a launch takes."""
    import triton

    for a in range(1, 4100):
        assert next_power_of_2(a) == triton.next_power_of_2(a)
        for b in (1, 3, 16, 32, 64, 128, 256):
            assert cdiv(a, b) == triton.cdiv(a, b)


@pytest.mark.parametrize("share_run", [0.0, 1.0, 0.6])
@pytest.mark.parametrize("capacity,d,n", [(24, 64, 96), (40, 48, 8)])  # an MLP shape, a narrow projector shape
def test_cohort_ffn_kernels_match_torch_for_ragged_counts(capacity, d, n, share_run):
    g = torch.Generator().manual_seed(capacity + n)
    x = torch.randn(capacity, d, generator=g)
    wg, wu, wd = weights(g, d, n)
    w = torch.rand(capacity, generator=g)
    mask = torch.rand(capacity, generator=g) < share_run
    c = build_cohorts(mask)
    stored, from_zero = torch.full((capacity, d), float("nan")), torch.zeros(capacity, d)
    for idx, count in ((c.run_idx, c.n_run), (c.proj_idx, c.n_proj)):
        y = torch.randn(capacity, d, generator=g)
        expected = y.clone()
        cohort_ffn_torch(x, idx, count, w, wg, wu, wd, expected)
        cohort_ffn_triton(x, idx, count, w, wg, wu, wd, y, tiles=SMALL)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
        # Stored, not added: the two cohorts cover every row once, whatever the rows held (NaN here).
        cohort_ffn_torch(x, idx, count, w, wg, wu, wd, from_zero)
        cohort_ffn_triton(x, idx, count, w, wg, wu, wd, stored, tiles=SMALL, accumulate=False)
    torch.testing.assert_close(stored, from_zero, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("share_run", [0.0, 1.0, 0.6])
def test_the_grouped_ffn_pair_equals_each_cohorts_ffn_on_its_own(share_run, accumulate):
    """The MLP over the RUN cohort and the projector over the Project-Only cohort in one launch per stage: the
    same y as the two FFNs launched one after the other (added, or stored into NaN rows), with either cohort
    empty, widths that are no multiple of the tile, and a projector narrower than one tile. Launched once a
    stage: two kernels, not four."""
    g = torch.Generator().manual_seed(7 + int(10 * share_run))
    capacity, d, n_mlp, n_proj = 40, 48, 80, 24
    x = torch.randn(capacity, d, generator=g)
    mlp_w, proj_w = weights(g, d, n_mlp), weights(g, d, n_proj)
    w = torch.rand(capacity, generator=g)
    c = build_cohorts(torch.rand(capacity, generator=g) < share_run)
    y0 = torch.randn(capacity, d, generator=g) if accumulate else torch.full((capacity, d), float("nan"))
    expected, y = y0.clone(), y0.clone()
    for (idx, count), ws, op in (((c.run_idx, c.n_run), mlp_w, "mlp"), ((c.proj_idx, c.n_proj), proj_w, "proj")):
        cohort_ffn_triton(x, idx, count, w, *ws, expected, op=op, tiles=SMALL, accumulate=accumulate)
    launches = OwnLaunches()
    with launches.triton():
        cohort_ffn_pair(x, w, y, CohortFFN(c.run_idx, c.n_run, *mlp_w), CohortFFN(c.proj_idx, c.n_proj, *proj_w),
                        tiles=SMALL, accumulate=accumulate)
    assert launches.launches == ["grouped_gate_up_kernel", "grouped_down_scatter_kernel"]
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert not y.isnan().any()


def test_the_ffn_pair_launches_apart_where_its_table_measured_that_faster_or_gathers():
    """A table whose `ffn_pair` timed the two FFNs faster apart at this capacity launches each on its own (four
    kernels, the same y); one that gathers an FFN GEMM there cannot group them, even when asked to, nor can one grid
    read weights of two dtypes."""
    from mixed_world import gathering_table

    from vskipper.mixed.tiles import PairTiming

    g = torch.Generator().manual_seed(2)
    capacity, d = 24, 32
    x, w = torch.randn(capacity, d, generator=g), torch.rand(capacity, generator=g)
    c = build_cohorts(torch.rand(capacity, generator=g) < 0.5)
    pair = (CohortFFN(c.run_idx, c.n_run, *weights(g, d, 48)), CohortFFN(c.proj_idx, c.n_proj, *weights(g, d, 16)))
    table = gathering_table(set())
    outs = {}
    for name, timing in (("grouped", PairTiming(1.0, 2.0)), ("apart", PairTiming(2.0, 1.0))):
        table.ffn_pair = [(1, None, timing)]
        outs[name] = torch.full((capacity, d), float("nan"))
        launches = OwnLaunches()
        with launches.triton():
            cohort_ffn_pair(x, w, outs[name], *pair, tiles=table, accumulate=False)
        assert len(launches.launches) == (2 if name == "grouped" else 4), launches.launches
    torch.testing.assert_close(outs["apart"], outs["grouped"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot launch grouped at 24 slots: the table serves an FFN GEMM in the "
                                         "gathered form there"):
        cohort_ffn_pair(x, w, outs["apart"], *pair, tiles=gathering_table({"proj_down"}), grouped=True)
    # one grid reads both FFNs' weights with one element type
    other = CohortFFN(*pair[1][:2], *(t.to(torch.float64) for t in pair[1][2:]))
    with pytest.raises(ValueError, match=r"their weights' dtypes differ \(\['torch.float32', 'torch.float64'\]\)"):
        cohort_ffn_pair(x, w, outs["apart"], pair[0], other, grouped=True)


def test_tiles_past_the_device_count_write_nothing():
    g = torch.Generator().manual_seed(3)
    capacity, d, n = 48, 32, 32
    x = torch.randn(capacity, d, generator=g)
    wg, wu, wd = weights(g, d, n)
    idx = torch.randperm(capacity, generator=g)
    count = torch.tensor([5])
    a = torch.full((capacity, n), 7.0)
    cohort_gate_up(x, idx, count, wg, wu, out=a, tile=SMALL)
    assert (a[5:] == 7.0).all()  # rows at and past the count are left alone
    rows = idx[:5]
    xa = x[rows]
    torch.testing.assert_close(a[:5], torch.nn.functional.silu(xa @ wg.t()) * (xa @ wu.t()))
    y = torch.randn(capacity, d, generator=g)
    before = y.clone()
    w = torch.rand(capacity, generator=g)
    cohort_down_scatter(a, idx, count, w, wd, y, tile=SMALL)
    untouched = torch.ones(capacity, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(y[untouched], before[untouched])
    torch.testing.assert_close(y[rows], before[rows] + w[rows, None] * (a[:5] @ wd.t()))


@pytest.mark.parametrize("count", [0, 5, 17, 40])
def test_the_attention_cohort_gemms_touch_the_counted_rows_alone(count):
    """Q of the gathered cohort rows, packed (slots at and past the count left alone), and o_proj of packed rows
    added onto their batch rows (every other row left alone), with a width that is no multiple of the tile."""
    g = torch.Generator().manual_seed(count)
    capacity, d, q_width = 40, 48, 80
    u = torch.randn(capacity, d, generator=g)
    w_q, w_o = torch.randn(q_width, d, generator=g) / d**0.5, torch.randn(d, q_width, generator=g) / q_width**0.5
    idx = torch.randperm(capacity, generator=g)
    rows = idx[:count]
    q = torch.full((capacity, q_width), 7.0)
    cohort_gemm(u, idx, torch.tensor([count]), w_q, out=q, tile=SMALL)
    assert (q[count:] == 7.0).all()
    torch.testing.assert_close(q[:count], u[rows] @ w_q.t())
    assert torch.equal(cohort_gemm(u, idx, torch.tensor([count]), w_q, tile=SMALL)[count:],
                       torch.zeros(capacity - count, q_width))  # a fresh output is zeros past the count
    h = torch.randn(capacity, d, generator=g)
    before = h.clone()
    cohort_scatter_add(q, idx, torch.tensor([count]), w_o, h, tile=SMALL)
    untouched = torch.ones(capacity, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(h[untouched], before[untouched])
    torch.testing.assert_close(h[rows], before[rows] + q[:count] @ w_o.t())


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_the_q_gemm_in_batch_rows_stores_each_cohort_row_in_its_own_row(share):
    """`batch_rows`: row idx[m] of the output holds u[idx[m]] @ W_q^T for m < count, in its batch row (where the
    decode rotation and read find it). The map's slots past the count name row 0, a RUN row here: a slot past the
    count stores nothing there. A gathered table's form multiplies every row: the cohort's rows agree."""
    from mixed_world import gathering_table

    g = torch.Generator().manual_seed(int(100 * share))
    capacity, d, q_width = 40, 48, 80
    u = torch.randn(capacity, d, generator=g)
    w_q = torch.randn(q_width, d, generator=g) / d**0.5
    mask = torch.rand(capacity, generator=g) < share
    mask[0] = share > 0
    c = build_cohorts(mask)
    rows = c.run_idx[: int(c.n_run)]
    q = cohort_gemm(u, c.run_idx, c.n_run, w_q, tile=SMALL, batch_rows=True)
    assert q.shape == (capacity, q_width)
    torch.testing.assert_close(q[rows], u[rows] @ w_q.t())
    gathered = cohort_gemm(u, c.run_idx, c.n_run, w_q, batch_rows=True, tile=gathering_table({"attn_q"}))
    torch.testing.assert_close(gathered[rows], q[rows])
    with pytest.raises(ValueError, match="no `out` with batch_rows"):
        cohort_gemm(u, c.run_idx, c.n_run, w_q, out=q, tile=SMALL, batch_rows=True)


@pytest.mark.parametrize("tile", ["unsplit", "split", "gathered"])
@pytest.mark.parametrize("count", [0, 5, 17, 40])
def test_o_proj_over_a_read_of_every_batch_row_reads_the_cohort_rows_where_they_lie(count, tile):
    """`batch_rows`: o_proj's operand is a read of every batch row (SGLang's prefill backend), its rows in batch
    order; h[idx[m]] += a[idx[m]] @ W_o^T for m < count, as the packed operand a[idx] adds, and nothing else is
    touched. The rows outside the cohort hold NaN, which must not reach h: they are not read (the gathered form
    gathers the map's rows, masking the slots past the count). The Q GEMM's `finite_others` zero-fills the rows
    outside the cohort, the kernel's form and the split one's; the gathered form's hold each row's own query."""
    from mixed_world import gathering_table

    g = torch.Generator().manual_seed(count)
    capacity, d, width = 40, 48, 80
    tiles = {"unsplit": SMALL, "split": Tile(16, 32, 32, 4, 1, 2),
             "gathered": gathering_table({"attn_q", "attn_o"})}[tile]
    w_q, w_o = torch.randn(width, d, generator=g) / d**0.5, torch.randn(d, width, generator=g) / width**0.5
    u = torch.randn(capacity, d, generator=g)
    idx, n = torch.randperm(capacity, generator=g), torch.tensor([count])
    rows = idx[:count]
    outside = torch.ones(capacity, dtype=torch.bool)
    outside[rows] = False
    q = cohort_gemm(u, idx, n, w_q, tile=tiles, batch_rows=True, finite_others=True)
    torch.testing.assert_close(q[rows], u[rows] @ w_q.t())
    assert torch.equal(q[outside], torch.zeros_like(q[outside])) if tile != "gathered" \
        else torch.allclose(q[outside], u[outside] @ w_q.t(), atol=1e-5)
    a = torch.randn(capacity, width, generator=g)
    a[outside] = float("nan")
    h = torch.randn(capacity, d, generator=g)
    before = h.clone()
    cohort_scatter_add(a, idx, n, w_o, h, tile=tiles, batch_rows=True)
    assert torch.equal(h[outside], before[outside])
    packed = before.clone()
    cohort_scatter_add(a[idx], idx, n, w_o, packed, tile=tiles)
    torch.testing.assert_close(h, packed, rtol=0, atol=0)
    torch.testing.assert_close(h[rows], before[rows] + a[rows] @ w_o.t())


@pytest.mark.parametrize("split_k", [2, 4])
@pytest.mark.parametrize("count", [0, 5, 17, 40])
def test_a_tile_that_splits_k_computes_what_the_unsplit_tile_does_on_the_counted_rows_alone(count, split_k):
    """`Tile.split_k`: each split's programs sum their share of K into a plane of an fp32 workspace, and the reduce
    launch runs the unsplit kernel's epilogue on the planes' sum: Q packed and in batch rows, o_proj's unweighted
    add and the down GEMM's weighted add or store, each on the counted rows alone. K spans 2 and 3 tiles of 32, so
    4 splits leave some empty (they add zeros). The sum runs in split order: a launch repeated is bit-equal."""
    g = torch.Generator().manual_seed(10 * count + split_k)
    capacity, d, width = 40, 48, 80
    split = Tile(16, 32, 32, 4, 1, split_k)
    u = torch.randn(capacity, d, generator=g)
    w_q, w_o = torch.randn(width, d, generator=g) / d**0.5, torch.randn(d, width, generator=g) / width**0.5
    idx, n = torch.randperm(capacity, generator=g), torch.tensor([count])
    rows = idx[:count]
    untouched = torch.ones(capacity, dtype=torch.bool)
    untouched[rows] = False
    q = torch.full((capacity, width), 7.0)
    cohort_gemm(u, idx, n, w_q, out=q, tile=split)
    assert (q[count:] == 7.0).all()
    torch.testing.assert_close(q[:count], u[rows] @ w_q.t())
    unsplit = torch.full((capacity, width), 7.0)
    cohort_gemm(u, idx, n, w_q, out=unsplit, tile=SMALL)
    torch.testing.assert_close(q, unsplit, rtol=1e-6, atol=1e-6)
    again = torch.full((capacity, width), 7.0)
    cohort_gemm(u, idx, n, w_q, out=again, tile=split)
    assert torch.equal(again, q)
    in_rows = cohort_gemm(u, idx, n, w_q, tile=split, batch_rows=True)
    torch.testing.assert_close(in_rows[rows], u[rows] @ w_q.t())
    h = torch.randn(capacity, d, generator=g)
    before = h.clone()
    cohort_scatter_add(q, idx, n, w_o, h, tile=split)
    assert torch.equal(h[untouched], before[untouched])
    torch.testing.assert_close(h[rows], before[rows] + q[:count] @ w_o.t())
    w = torch.rand(capacity, generator=g)
    for accumulate in (True, False):
        y = torch.randn(capacity, d, generator=g)
        before = y.clone()
        cohort_down_scatter(q, idx, n, w, w_o, y, tile=split, accumulate=accumulate)
        assert torch.equal(y[untouched], before[untouched])
        torch.testing.assert_close(y[rows], before[rows] * accumulate + w[rows, None] * (q[:count] @ w_o.t()))


def test_where_the_mlps_down_tile_splits_k_the_ffn_pair_splits_grouped_or_apart():
    """Where the MLP's down tile splits K: a table whose `ffn_pair` timed the two FFNs faster apart launches them
    apart, each down GEMM split as its own tile says, then its reduce; one that timed them faster grouped (or did not
    time them) launches them grouped, both down GEMMs in one launch split as the MLP's tile says (each cohort's
    planes in its half of one workspace), then a reduce each. The same output either way."""
    from mixed_world import INTERPRETER_ENTRY

    from vskipper.mixed.tiles import COUNT_RANGES, OPERATIONS, PairTiming, parse_tile_table

    g = torch.Generator().manual_seed(5)
    capacity, d = 24, 32
    x, w = torch.randn(capacity, d, generator=g), torch.rand(capacity, generator=g)
    c = build_cohorts(torch.rand(capacity, generator=g) < 0.5)
    pair = (CohortFFN(c.run_idx, c.n_run, *weights(g, d, 48)), CohortFFN(c.proj_idx, c.n_proj, *weights(g, d, 16)))
    tiles = {op: [{"rows": [lo, hi], **INTERPRETER_ENTRY,
                   **({"split_k": 2} if op.endswith("down") and hi is not None and hi <= 32 else {})}
                  for lo, hi in COUNT_RANGES] for op in OPERATIONS}
    table = parse_tile_table({"device": "H200", "dtype": "float32", "tiles": tiles}, 227 * 1024)
    assert table.lookup("mlp_down", capacity).split_k == 2 and table.lookup("mlp_down", 33).split_k == 1
    outs, seen = {}, {}
    for name, timing in (("apart", PairTiming(2.0, 1.0)), ("grouped", PairTiming(1.0, 2.0)), ("untimed", None)):
        table.ffn_pair = [(1, None, timing)]
        outs[name] = torch.full((capacity, d), float("nan"))
        launches = OwnLaunches()
        with launches.triton():
            cohort_ffn_pair(x, w, outs[name], *pair, tiles=table, accumulate=False)
        seen[name] = launches.launches
    assert seen["apart"] == ["cohort_gate_up_kernel", "cohort_down_scatter_kernel", "split_k_reduce_kernel"] * 2
    assert seen["grouped"] == seen["untimed"] == ["grouped_gate_up_kernel", "grouped_down_scatter_kernel",
                                                  "split_k_reduce_kernel", "split_k_reduce_kernel"]
    torch.testing.assert_close(outs["apart"], outs["grouped"], rtol=1e-5, atol=1e-5)
    unsplit = torch.full((capacity, d), float("nan"))
    cohort_ffn_pair(x, w, unsplit, *pair, tiles=SMALL, accumulate=False, grouped=True)
    torch.testing.assert_close(outs["grouped"], unsplit, rtol=1e-6, atol=1e-6)
    assert torch.equal(outs["grouped"], outs["untimed"])


def test_a_zero_count_launches_a_full_grid_that_does_nothing():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 32, generator=g)
    wg, wu, wd = weights(g, 32, 32)
    y = torch.randn(32, 32, generator=g)
    before = y.clone()
    cohort_ffn_triton(x, torch.arange(32), torch.tensor([0]), torch.rand(32, generator=g), wg, wu, wd, y,
                      tiles=SMALL)
    assert torch.equal(y, before)


@pytest.mark.parametrize("heads,kv_heads,splits", [(4, 2, None), (8, 8, 1), (4, 2, 3), (4, 1, 8)])
def test_masked_decode_attention_matches_the_reference_and_ignores_foreign_slots(heads, kv_heads, splits):
    """Every split count gives the reference read: splits past a short row's length stay empty, and a row outside
    `reads` loads no slot (foreign slots hold NaN)."""
    rng = random.Random(heads)
    g = torch.Generator().manual_seed(heads)
    hd, rows, ctx = 16, 6, 30
    slots = 1 + rows * ctx + 40  # slot 0 reserved, 40 slots nobody in the batch owns
    k_pool = torch.randn(slots, kv_heads, hd, generator=g)
    v_pool = torch.randn(slots, kv_heads, hd, generator=g)
    perm = torch.randperm(slots - 1, generator=g) + 1
    r2t = perm[: rows * ctx].view(rows, ctx)
    positions = torch.tensor([rng.randrange(r2t.shape[1]) for _ in range(rows)])
    reads = torch.tensor([rng.random() < 0.7 for _ in range(rows)])
    owned = {int(r2t[r, t]) for r in range(rows) if reads[r] for t in range(int(positions[r]) + 1)}
    foreign = torch.tensor([s for s in range(slots) if s not in owned])
    k_pool[foreign] = float("nan")
    v_pool[foreign] = float("nan")
    q = torch.randn(rows, heads, hd, generator=g)
    req = torch.arange(rows)
    out = masked_decode_attention(q, k_pool, v_pool, r2t, req, positions, reads, 0.25, block_t=16, splits=splits)
    expected = paged_attention(q, k_pool, v_pool, r2t, req, positions, 0.25, reads)
    assert torch.isfinite(out).all()
    assert (out[~reads] == 0).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # A cohort's packed slots over the batch rows, as a cohort map holds them: slot m < count reads for row idx[m]
    # (its query, request and position gathered by the kernel), the slots past the count name row 0 and read
    # nothing; out is packed (a row a slot, however many batch rows there are), zeros past the count.
    reading = torch.nonzero(reads).view(-1)  # rows whose keys are not NaN
    count = reading.shape[0]
    past = torch.zeros(max(1, rows - count - 1), dtype=torch.int64)
    idx = torch.cat([reading[torch.randperm(count, generator=g)], past])
    slot_reads = torch.arange(idx.shape[0]) < count
    packed = masked_decode_attention(q, k_pool, v_pool, r2t, req, positions, slot_reads, 0.25, block_t=16,
                                     splits=splits, idx=idx)
    assert packed.shape == (idx.shape[0], heads, hd) and (packed[count:] == 0).all()
    torch.testing.assert_close(packed[:count], expected[idx[:count]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,share", [(4, 2, 0.6), (4, 4, 1.0), (8, 2, 0.3), (6, 2, 0.5), (4, 2, 0.0)])
def test_the_packed_prefill_read_matches_the_reference_over_the_run_slots_alone(heads, kv_heads, share):
    """A prefill pass of four requests (prompt extensions of 1-23 tokens behind prefixes of 0-9), its RUN tokens
    packed in batch order: a program's tile (16 query rows: 16 / group slots, the group's heads folded in, padded
    where the group is no power of two) spans several requests, and each slot reads its own request's keys up to
    its position. Slots past the reading prefix are zero; keys no reading slot owns hold NaN and never reach
    an output."""
    _check_packed_prefill_read(heads, kv_heads, share, block_n=16)


@pytest.mark.parametrize("tile", READ_CANDIDATES, ids=str)
def test_every_launch_the_tuner_tries_for_the_packed_read_reads_the_same(tile):
    """The tuner's candidate launches (`READ_CANDIDATES`) differ in slots a program and keys a step (warps and
    stages do not change what the interpreter computes): with the grouped heads of Llama-3-8B (4 a KV head), a
    program of 128 query rows spans every request of the pass, and a step of 128 keys all of a request's keys."""
    _check_packed_prefill_read(8, 2, 0.6, block_m=packed_prefill_block_m(4, tile), block_n=tile.block_n)


@contextmanager
def _poisoned_empty():
    """`torch.empty` hands out NaN-filled floating tensors meanwhile: a kernel that leaves a row unwritten shows."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def _check_packed_prefill_read(heads: int, kv_heads: int, share: float, extend=None, ctx: int = 40,
                               **blocks) -> list[tuple[int, int]]:
    """The packed read of a prefill pass over `extend` ((request slot, prefix, new tokens) each) against the
    reference, gathered and not; returns the packed (request, position) of each reading slot."""
    rng = random.Random(heads * 10 + kv_heads)
    g = torch.Generator().manual_seed(heads + kv_heads)
    hd = 16
    if extend is None:
        extend = [(3, rng.randrange(10), 23), (1, 0, 1), (0, rng.randrange(10), 7), (2, 4, 12)]
    requests = max(r for r, _, _ in extend) + 1
    slots = 1 + requests * ctx + 30
    perm = torch.randperm(slots - 1, generator=g) + 1
    r2t = perm[: requests * ctx].view(requests, ctx)
    tokens = [(r, prefix + i) for r, prefix, n in extend for i in range(n)]
    run = [rng.random() < share for _ in tokens]
    packed = [t for t, keep in zip(tokens, run, strict=True) if keep]
    capacity = len(tokens)
    req = torch.tensor([r for r, _ in packed] + [0] * (capacity - len(packed)))
    pos = torch.tensor([p for _, p in packed] + [0] * (capacity - len(packed)))
    reads = torch.arange(capacity) < len(packed)
    k_pool = torch.randn(slots, kv_heads, hd, generator=g)
    v_pool = torch.randn(slots, kv_heads, hd, generator=g)
    owned = {int(r2t[r, t]) for r, p in packed for t in range(p + 1)}
    foreign = torch.tensor([s for s in range(slots) if s not in owned])
    k_pool[foreign] = float("nan")
    v_pool[foreign] = float("nan")
    q = torch.randn(capacity, heads, hd, generator=g)
    with _poisoned_empty():  # the kernel writes every output row itself: zeros where a slot reads nothing
        out = packed_prefill_attention(q, k_pool, v_pool, r2t, req, pos, reads, 0.25, **blocks)
    assert torch.isfinite(out).all() and (out[~reads] == 0).all()
    n = len(packed)
    if n:
        expected = paged_attention(q[:n], k_pool, v_pool, r2t, req[:n], pos[:n], 0.25, length=ctx)
        torch.testing.assert_close(out[:n], expected, rtol=1e-5, atol=1e-5)
    # The gathering form, as a served layer launches it: queries, requests and positions in batch rows (every
    # token's; a Project-Only row's query of no meaning, NaN here), slot m reading for batch row idx[m] (the RUN
    # map: batch order, 0 past the count): the same packed output.
    idx = torch.tensor([i for i, keep in enumerate(run) if keep] + [0] * (capacity - n))
    q_rows = torch.full((capacity, heads, hd), float("nan"))
    q_rows[idx[:n]] = q[:n]
    with _poisoned_empty():
        gathered = packed_prefill_attention(q_rows, k_pool, v_pool, r2t, torch.tensor([r for r, _ in tokens]),
                                            torch.tensor([p for _, p in tokens]), reads, 0.25, idx=idx, **blocks)
    torch.testing.assert_close(gathered, out, rtol=0, atol=0)
    return packed


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 2)])
def test_the_packed_read_takes_the_blocks_every_row_sees_whole_unmasked_and_reads_the_same(heads, kv_heads):
    """Long prompts (a prompt of 90 tokens behind a prefix of 30, one of 40 with none, a third of 50 behind 7)
    with half their tokens RUN: most of a program's key blocks lie below the first position of its slots, where
    the read takes them without masks, and some programs' slots span two requests, where it masks every block
    (the geometry asserted below). Both equal the reference, gathered and not, with keys no reading slot owns
    poisoned: an unmasked range one block too long, or unmasked blocks over two requests, reads a key a slot must
    not see and strays. (That the kernel takes the unmasked branch at all is not observable here: it computes the
    same.)"""
    block_n = 16
    packed = _check_packed_prefill_read(heads, kv_heads, 0.5, extend=[(2, 30, 90), (0, 0, 40), (1, 7, 50)],
                                        ctx=128, block_n=block_n)
    group = heads // kv_heads
    block_m = packed_prefill_block_m(1 << (group - 1).bit_length(), INTERPRETED_READ_TILE)  # group padded
    tiles = [packed[i:i + block_m] for i in range(0, len(packed), block_m)]
    whole = [min(p for _, p in t) + 1 for t in tiles if len({r for r, _ in t}) == 1]
    assert sum(w // block_n for w in whole) > 10  # unmasked blocks the geometry gives
    assert len(whole) < len(tiles)  # and programs over two requests, which mask every block


@pytest.fixture(scope="module")
def triton_model(tiny_flexidepth):
    return BenchStack.from_pretrained(tiny_flexidepth, capacity=8, backend="triton")


def test_routed_decode_on_the_triton_backend_matches_the_reference(triton_model):
    model = triton_model
    world = World(model, 5, seed=2)
    model(*world.prefill_batch({r: 1 + r % 3 for r in range(5)}), world.kv)
    for mode in ("random", "all_project"):
        ids, batch = world.decode_batch(world.rng.sample(range(5), 4), padding=2)
        routes = random_routes(model.routed_layers, batch.rows, world.rng, batch.valid, mode)
        ref_kv = world.fork_cache()
        out = model(ids, batch, world.kv, TapeSkipper(routes))
        expected = reference_forward(model, ids, batch, ref_kv, routes)
        torch.testing.assert_close(out[batch.valid], expected[batch.valid], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(world.kv.k[:, 1:], ref_kv.k[:, 1:], rtol=1e-5, atol=1e-5)
    att = model.attestation()
    assert att["decode_backend"] == "triton" and att["backends_used"]["decode"] == "triton"
    assert att["triton_interpreted"] and att["cohort_counts"] == "device scalars"
    assert att["tiles"] == "interpreter tile"


def test_all_run_routed_decode_on_triton_equals_the_dense_decode(triton_model):
    model = triton_model
    outs = []
    for skipper in (None, StaticDepth(0.0)):
        world = World(model, 4, seed=8)
        model(*world.prefill_batch({0: 2, 1: 3, 2: 1, 3: 2}), world.kv)
        ids, batch = world.decode_batch([2, 0, 3, 1], padding=1)
        outs.append(model(ids, batch, world.kv, skipper)[batch.valid])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_a_routed_decode_step_on_the_triton_backend_reads_no_tensor_value_on_the_host(tiny_flexidepth):
    """The capture contract: with the trained gate choosing routes, tape, cohort maps, attention and cohort
    GEMMs run without a single host read, so a captured graph replays new routes. The torch backend (CPU)
    reads the decode context bound (its largest position), which the detector sees, so it would see a read on
    the Triton path too."""
    reads = {}
    for backend in ("triton", "torch"):
        model = BenchStack.from_pretrained(tiny_flexidepth, capacity=8, backend=backend)
        world = World(model, 4, seed=9)
        model(*world.prefill_batch({0: 2, 1: 3, 2: 1, 3: 2}), world.kv)
        ids, batch = world.decode_batch([1, 3, 0, 2], padding=2)
        with HostReadDetector() as detector:
            model(ids, batch, world.kv, FlexiDepthGate())
        reads[backend] = detector.reads
    assert reads["triton"] == []
    assert reads["torch"]


@pytest.mark.parametrize("rows", [1, 5, 16, 33, 1024, 2500])
def test_the_fused_cohort_maps_equal_the_torch_builders_in_one_launch(rows):
    """`CohortBuilder.build(fused=True)` (one Triton launch) writes the maps, counts and live slots the torch build
    implies, for any route (all RUN, all Project-Only, mixed) and any pass below the builder's capacity, and the
    maps stay views of the builder's storage (a captured graph holds their addresses). A prefill pass of more
    rows than the launch's block walks them block by block: its counts carry across the blocks."""
    gen = torch.Generator().manual_seed(rows)
    builder = CohortBuilder(max(40, rows + 7))
    masks = [torch.ones(rows, dtype=torch.bool), torch.zeros(rows, dtype=torch.bool),
             torch.rand(rows, generator=gen) < 0.5]
    for run in masks:
        want = build_cohorts(run)
        got = builder.build(run, fused=True)
        for field in ("run_idx", "proj_idx", "n_run", "n_proj"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (run.tolist(), field)
        assert got.live.tolist() == [m < int(want.n_run) for m in range(rows)]
        assert got.run_idx.data_ptr() == builder.build(run, fused=True).run_idx.data_ptr()
    torch_build = builder.build(masks[2])  # the torch build over the same storage: the same maps and live slots
    assert torch.equal(torch_build.run_idx, want.run_idx) and torch.equal(torch_build.live, got.live)


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recording_a_route_in_the_maps_launch_writes_what_the_tape_records_and_its_maps(rows, dense, dtype):
    """`record_and_build` (one launch) leaves the tape as `RouteTape.record` leaves it and returns the fused maps of
    the recorded row: for a route read through strided views (a [rows, 2] skipper output's column), fp32 weights
    into the tape's dtype, with dense-mode rows (RUN, unit weight) and without; the other layers' rows and the
    padding stay untouched, and the maps are the builder's storage. Into a bf16 tape the interpreter's cast
    truncates where torch's copy (and a GPU's store) rounds to nearest: one bf16 step apart at most."""
    gen = torch.Generator().manual_seed(rows)
    run = torch.rand(rows, 2, generator=gen) < 0.5
    weights = torch.rand(rows, 2, generator=gen) + 0.25
    route = LayerRoute(run[:, :1], weights[:, 1:])  # columns of wider tensors: strides 2
    dense_rows = (torch.rand(rows, generator=gen) < 0.4) if dense else None
    want_tape, got_tape = (RouteTape(40, (3, 5), dtype=dtype) for _ in range(2))
    for tape in (want_tape, got_tape):
        tape.pad(rows)
        tape.record(3, LayerRoute(torch.zeros(rows, 1, dtype=torch.bool), torch.full((rows, 1), 0.5)))
    want_tape.record(5, route, dense_rows)
    builder = CohortBuilder(40)
    got = builder.record_and_build(got_tape, 5, route, dense_rows)
    assert torch.equal(got_tape.run, want_tape.run)
    if dtype == torch.float32:
        assert torch.equal(got_tape.weights, want_tape.weights)
    else:
        torch.testing.assert_close(got_tape.weights, want_tape.weights, rtol=2**-7, atol=0)
    want = build_cohorts(want_tape.layer(5, rows)[0])
    for field in ("run_idx", "proj_idx", "n_run", "n_proj", "live"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.run_idx.data_ptr() == builder.build(want_tape.layer(5, rows)[0], fused=True).run_idx.data_ptr()


def test_the_views_a_routed_layer_takes_each_pass_are_kept_for_its_size_and_made_anew_for_another():
    """A routed layer's tape row, its counts and its maps are views kept while passes keep their row count (the same
    objects, no views made again); a pass of another size gets views of its size, and each build's maps and tape
    rows hold that build's route, whichever size came before."""
    builder, tape = CohortBuilder(40), RouteTape(40, (3, 5))
    gen = torch.Generator().manual_seed(0)
    seen, previous = {}, None
    for rows in (7, 7, 12, 7):
        tape.pad(rows)
        for layer in (3, 5):
            route = LayerRoute(torch.rand(rows, 1, generator=gen) < 0.5, torch.rand(rows, 1, generator=gen))
            got = builder.record_and_build(tape, layer, route)
            run, weights = tape.layer(layer, rows)
            assert run.shape == (rows,) and got.run_idx.shape == (rows,)
            assert torch.equal(run, route.run_mask.view(-1)) and torch.equal(weights, route.weights.view(-1))
            want = build_cohorts(route.run_mask)
            for field in ("run_idx", "proj_idx", "n_run", "n_proj", "live"):
                assert torch.equal(getattr(got, field), getattr(want, field)), field
            if rows == previous:  # the second pass of a size in a row: the same views
                assert got is seen[layer][0] and run is seen[layer][1]
            elif layer in seen:  # another size than the pass before: views made anew
                assert got is not seen[layer][0] and run is not seen[layer][1]
            seen[layer] = (got, run)
        previous = rows


def test_recording_in_the_maps_launch_refuses_what_the_tape_refuses():
    builder, tape = CohortBuilder(4), RouteTape(8, (2,))
    with pytest.raises(ValueError, match="exceed the cohort capacity 4"):
        builder.record_and_build(tape, 2, LayerRoute(torch.ones(6, 1, dtype=torch.bool), torch.ones(6, 1)))
    with pytest.raises(KeyError, match="layer 1 is not a routed layer"):
        builder.record_and_build(tape, 1, LayerRoute(torch.ones(2, 1, dtype=torch.bool), torch.ones(2, 1)))
    with pytest.raises(ValueError, match="weights have 3 rows, run_mask has 2"):
        builder.record_and_build(tape, 2, LayerRoute(torch.ones(2, 1, dtype=torch.bool), torch.ones(3, 1)))
    with pytest.raises(ValueError, match="dense_rows has shape"):
        builder.record_and_build(tape, 2, LayerRoute(torch.ones(2, 1, dtype=torch.bool), torch.ones(2, 1)),
                                 torch.ones(3, dtype=torch.bool))
    # the launch steps through the route's first stride: a route of more than one column is refused, not misread
    with pytest.raises(ValueError, match=r"route of layer 2: weights has shape \(2, 2\), not \[rows\] or \[rows, 1\]"):
        builder.record_and_build(tape, 2, LayerRoute(torch.ones(2, 1, dtype=torch.bool), torch.ones(2, 2)))
