"""The gathered cuBLAS forms (`vskipper.mixed.gathered`) keep the count-bounded kernels' contracts over every slot
of a cohort map, and a measured table that prefers them serves them in the routed layer with no host read. The
kernels run under TRITON_INTERPRET=1 (no GPU here); which form is faster is the GPU tuner's measurement."""

import os

import pytest
import torch
from mixed_world import HostReadDetector, OwnLaunches, World, gathering_table
from torch.utils._python_dispatch import TorchDispatchMode

from vskipper.mixed import kernels
from vskipper.mixed.backend import cohort_ffn_torch
from vskipper.mixed.bench_stack import BenchStack
from vskipper.mixed.cohorts import build_cohorts
from vskipper.mixed.gathered import (
    gathered_down,
    gathered_gate_up,
    gathered_gemm,
    gathered_scatter_add,
    merged_rows,
)
from vskipper.mixed.kernels import cohort_ffn_triton, cohort_gemm, cohort_scatter_add
from vskipper.mixed.tiles import OPERATIONS
from vskipper.skippers.trained_gate import FlexiDepthGate

assert os.environ.get("TRITON_INTERPRET") == "1", "the kernel tests need TRITON_INTERPRET=1 (see conftest.py)"

def _map(capacity: int, count: int, g: torch.Generator) -> torch.Tensor:
    """A cohort map as `build_cohorts` writes it: `count` distinct rows, then row 0 in every slot past them."""
    idx = torch.zeros(capacity, dtype=torch.int64)
    idx[:count] = torch.randperm(capacity, generator=g)[:count]
    return idx


@pytest.mark.parametrize("count", [0, 5, 40])
def test_the_gathered_forms_touch_the_counted_rows_alone_whatever_the_other_slots_hold(count):
    """Slots past the count name row 0 and their packed inputs hold NaN: nothing of them lands anywhere (row 0
    included, which a counted slot may also name), and the counted rows get the kernels' values."""
    g = torch.Generator().manual_seed(count)
    capacity, d, n = 40, 48, 80
    x = torch.randn(capacity, d, generator=g)
    w1, w2 = torch.randn(n, d, generator=g) / d**0.5, torch.randn(n, d, generator=g) / d**0.5
    w_back = torch.randn(d, n, generator=g) / n**0.5
    weights = torch.rand(capacity, generator=g)
    idx = _map(capacity, count, g)
    live, rows = slice(0, count), idx[:count]
    c = torch.tensor([count])

    q = torch.full((capacity, n), 7.0)
    gathered_gemm(x, idx, c, w1, out=q)
    assert (q[count:] == 7.0).all()
    torch.testing.assert_close(q[live], x[rows] @ w1.t())
    assert torch.equal(gathered_gemm(x, idx, c, w1)[count:], torch.zeros(capacity - count, n))
    want = torch.full((capacity, n), 7.0)
    kernels.cohort_gemm(x, idx, c, w1, out=want, tile=kernels.INTERPRETER_TILE)
    torch.testing.assert_close(q, want)

    a = torch.full((capacity, n), 7.0)
    gathered_gate_up(x, idx, c, w1, w2, out=a)
    assert (a[count:] == 7.0).all()
    torch.testing.assert_close(a[live], torch.nn.functional.silu(x[rows] @ w1.t()) * (x[rows] @ w2.t()))

    packed = a.clone()
    packed[count:] = float("nan")  # what an unwritten slot may hold
    for add, expect_rows in ((lambda y: gathered_down(packed, idx, c, weights, w_back, y),
                              weights[rows, None] * (packed[live] @ w_back.t())),
                             (lambda y: gathered_scatter_add(packed, idx, c, w_back, y), packed[live] @ w_back.t())):
        y = torch.randn(capacity, d, generator=g)
        before = y.clone()
        add(y)
        untouched = torch.ones(capacity, dtype=torch.bool)
        untouched[rows] = False
        assert torch.equal(y[untouched], before[untouched])
        torch.testing.assert_close(y[rows], before[rows] + expect_rows)


class _Matmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket.__name__ in ("mm", "addmm", "bmm")
        return func(*args, **(kwargs or {}))


def test_the_gate_and_up_halves_of_a_merged_weight_are_multiplied_in_one_gemm_with_the_same_values():
    """SGLang's MLP holds gate and up as one `gate_up_proj` weight, whose halves the routed layer hands over as
    views: the gathered form multiplies both in one GEMM; weights of their own (the projector's) take two."""
    g = torch.Generator().manual_seed(3)
    capacity, count, d, n = 24, 9, 32, 40
    x, idx, c = torch.randn(capacity, d, generator=g), _map(capacity, count, g), torch.tensor([count])
    merged = torch.randn(2 * n, d, generator=g)
    gate, up = merged.chunk(2, dim=0)
    assert torch.equal(merged_rows(gate, up), merged)
    apart = (gate.clone(), up.clone())
    assert torch.equal(merged_rows(merged[:n, :16], merged[n:, :16]), merged[:, :16])  # column slices: one view
    for w1, w2 in (apart, (up, gate), (gate, up.t().contiguous().t()), (merged[: n - 1], merged[n:])):
        assert merged_rows(w1, w2) is None  # apart, out of order, other strides, a gap
    for (w1, w2), gemms in (((gate, up), 1), (apart, 2)):
        with _Matmuls() as mm:
            got = gathered_gate_up(x, idx, c, w1, w2)
        assert mm.n == gemms
        torch.testing.assert_close(got[:count], torch.nn.functional.silu(x[idx[:count]] @ gate.t())
                                   * (x[idx[:count]] @ up.t()))


def test_a_table_that_prefers_torch_runs_the_gathered_forms_and_refuses_a_store_it_cannot_do(monkeypatch):
    """The dispatch: each operation takes the form its table names at this capacity, and a gathered down, which
    adds, refuses `accumulate=False` naming the operation (the FFN pair zeroes its output first)."""
    calls = []
    for name in ("gathered_gemm", "gathered_gate_up", "gathered_down", "gathered_scatter_add"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    g = torch.Generator().manual_seed(1)
    capacity, d, n = 24, 64, 96
    x = torch.randn(capacity, d, generator=g)
    wg, wu = torch.randn(n, d, generator=g) / d**0.5, torch.randn(n, d, generator=g) / d**0.5
    wd = torch.randn(d, n, generator=g) / n**0.5
    w = torch.rand(capacity, generator=g)
    c = build_cohorts(torch.rand(capacity, generator=g) < 0.6)
    expected = torch.zeros(capacity, d)
    cohort_ffn_torch(x, c.run_idx, c.n_run, w, wg, wu, wd, expected)

    y = torch.zeros(capacity, d)
    cohort_ffn_triton(x, c.run_idx, c.n_run, w, wg, wu, wd, y, tiles=gathering_table({"mlp_down"}))
    assert calls == ["gathered_down"]  # the gate-up kept its tile
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mlp_down serves in the gathered form here"):
        cohort_ffn_triton(x, c.run_idx, c.n_run, w, wg, wu, wd, y, tiles=gathering_table({"mlp_down"}),
                          accumulate=False)

    calls.clear()
    every = gathering_table(set(OPERATIONS))
    q = cohort_gemm(x, c.run_idx, c.n_run, wg, tile=every)
    h = torch.zeros(capacity, d)
    cohort_scatter_add(q, c.run_idx, c.n_run, wd, h, tile=every)
    assert calls == ["gathered_gemm", "gathered_scatter_add"]
    calls.clear()
    cohort_gemm(x, c.run_idx, c.n_run, wg, tile=gathering_table(set(OPERATIONS), device="Some Future GPU"))
    assert calls == []  # no ridge to hold the capacity against: the tile

    # the pair of cohort FFNs: grouped where every one of their GEMMs keeps its tile, else each as its table says
    proj = (wg[:16], wu[:16], torch.randn(d, 16, generator=g) / 4)
    pair = (kernels.CohortFFN(c.run_idx, c.n_run, wg, wu, wd), kernels.CohortFFN(c.proj_idx, c.n_proj, *proj))
    cohort_ffn_torch(x, c.proj_idx, c.n_proj, w, *proj, expected)
    for gathered, launched in (({"proj_gate_up"}, ["cohort_gate_up_kernel", "cohort_down_scatter_kernel",
                                                     "cohort_down_scatter_kernel"]),
                               (set(), ["grouped_gate_up_kernel", "grouped_down_scatter_kernel"])):
        calls.clear()
        y = torch.zeros(capacity, d)
        launches = OwnLaunches()
        with launches.triton():
            kernels.cohort_ffn_pair(x, w, y, *pair, tiles=gathering_table(gathered))
        assert calls == ["gathered_gate_up" for _ in gathered]
        assert [name for name in launches.launches if name.endswith("_kernel")] == launched
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    # storing into an output that holds nothing yet, where a down GEMM adds in the gathered form: the pair zeroes it
    y = torch.full((capacity, d), float("nan"))
    kernels.cohort_ffn_pair(x, w, y, *pair, tiles=gathering_table({"mlp_down"}), accumulate=False)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_a_routed_decode_step_with_every_gemm_gathered_equals_the_tiled_one_and_reads_nothing_on_the_host(
        tiny_flexidepth, monkeypatch):
    """The capture contract holds for the gathered forms too: with the trained gate choosing routes, a decode step
    whose table gathers all six operations (the branch output zeroed, both cohorts adding) makes no host read and
    hands on what the tiled step does."""
    calls = []
    real = kernels.gathered_down
    monkeypatch.setattr(kernels, "gathered_down", lambda *a, **k: calls.append("down") or real(*a, **k))
    outs = {}
    for name, tiles in (("tiled", gathering_table(set())), ("gathered", gathering_table(set(OPERATIONS)))):
        model = BenchStack.from_pretrained(tiny_flexidepth, capacity=8, backend="triton", tiles=tiles)
        world = World(model, 4, seed=9)
        model(*world.prefill_batch({0: 2, 1: 3, 2: 1, 3: 2}), world.kv)
        ids, batch = world.decode_batch([1, 3, 0, 2], padding=2)
        with HostReadDetector() as detector:
            outs[name] = model(ids, batch, world.kv, FlexiDepthGate())[batch.valid]
        assert detector.reads == [], name
    assert calls  # the gathered down ran (both cohorts, every routed layer of the gathered step and its prefill)
    torch.testing.assert_close(outs["gathered"], outs["tiled"], rtol=1e-5, atol=1e-5)
