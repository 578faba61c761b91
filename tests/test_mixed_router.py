"""`vskipper.mixed.router`: a trained gate's route of a routed layer from the router's two GEMMs and two Triton
launches, under the interpreter, against the gate's own module and decision (FlexiDepth's and the Qwen3 hard
gate's); what it launches; and what it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from vskipper.constants import CONSTANTS
from vskipper.mixed.host_waits import HostWaitDetector
from vskipper.mixed.launches import LaunchCount, interpreted_launches
from vskipper.mixed.router import GATE_MAX_WIDTH, _tanh, gate_form, gate_route
from vskipper.skippers.modules import SkipRouter
from vskipper.skippers.random_skip import RandomSkip
from vskipper.skippers.trained_gate import FlexiDepthGate, HardGate

assert os.environ.get("TRITON_INTERPRET") == "1", "the kernel tests need TRITON_INTERPRET=1 (see conftest.py)"

GATES = [FlexiDepthGate(), HardGate()]
ROOT = Path(__file__).resolve().parents[1]


def _router(hidden: int, reduced: int, dtype: torch.dtype, seed: int) -> SkipRouter:
    """A router of random weights, scaled so that its weights spread over (0, 1) on both sides of the threshold."""
    torch.manual_seed(seed)
    router = SkipRouter(hidden, reduced)
    with torch.no_grad():
        router.router_norm.weight.uniform_(0.5, 1.5)
        router.router_head.weight.mul_(4.0)
    return router.to(dtype)


def _rows(rows: int, hidden: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(rows, hidden, generator=g).to(dtype)
    valid = (torch.rand(rows, generator=g) > 0.2).view(-1, 1)  # padding rows RUN with unit weight
    return u, valid


@pytest.mark.parametrize("gate", GATES, ids=lambda g: g.name)
@pytest.mark.parametrize("rows, hidden, reduced", [(1, 64, 4), (37, 64, 16), (130, 96, 6)])
def test_the_fused_gate_routes_as_the_gates_own_module_in_fp32(gate, rows, hidden, reduced):
    """In fp32 the run flags equal the skipper's own `route` and the branch weights agree to fp32 rounding (the
    sums run in another order): FlexiDepth's router weight where a row runs, its complement where it projects, 1
    for a padding row; the hard gate's 1 everywhere. Widths that are no power of two are masked."""
    router = _router(hidden, reduced, torch.float32, rows)
    u, valid = _rows(rows, hidden, torch.float32, rows)
    want, got = gate.route(0, u, valid, router), gate_route(gate, u, valid, router)
    p = router(u).view(-1)
    assert ((p - CONSTANTS.router_run_threshold).abs() > 1e-4).all()  # no row within a rounding of the threshold
    assert got.run_mask.shape == (rows, 1) and got.run_mask.dtype == torch.bool
    assert torch.equal(got.run_mask, want.run_mask)
    assert got.weights.shape == (rows, 1) and got.weights.dtype == torch.float32
    torch.testing.assert_close(got.weights, want.weights, rtol=2e-6, atol=2e-6)
    if rows > 1:  # both branches taken, and padding rows
        assert want.run_mask[valid].any() and not want.run_mask[valid].all() and not valid.all()


@pytest.mark.parametrize("gate", GATES, ids=lambda g: g.name)
def test_the_fused_gate_routes_as_the_gates_own_module_in_bfloat16(gate):
    """In bfloat16, rounded where the module rounds (the encoder's, the norm's, the product's, tanh's, the
    decoder's and the head's outputs): rows whose router weight is not within a few roundings of the threshold
    route alike, and the weights agree to a unit of bfloat16 (the interpreter truncates its casts where a device
    rounds to nearest)."""
    router = _router(256, 16, torch.bfloat16, 3)
    u, valid = _rows(300, 256, torch.bfloat16, 3)
    want, got = gate.route(0, u, valid, router), gate_route(gate, u, valid, router)
    p = router(u).view(-1, 1)
    clear = ((p - CONSTANTS.router_run_threshold).abs() > 0.03) | ~valid
    assert clear.float().mean() > 0.8
    assert torch.equal(got.run_mask[clear], want.run_mask[clear])
    assert got.weights.dtype == torch.bfloat16
    agree = clear & (got.run_mask == want.run_mask)
    torch.testing.assert_close(got.weights[agree].float(), want.weights[agree].float(), rtol=0, atol=2 ** -7)


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, _tanh(tl.load(x_ptr + offs)))


def test_the_gates_tanh_is_accurate_to_fp32_rounding_near_zero_and_saturates_far_out():
    """The kernel's tanh (its series near 0, exp(-2|x|) beyond) against torch's over [-30, 30], tiny arguments
    and the switch at 0.1 included: a few fp32 ulps, relative, where 1 - exp(-2|x|) alone would lose half the
    digits near 0; exactly +-1 far out, no overflow."""
    x = torch.cat([torch.linspace(-30, 30, 4096), torch.tensor([1e-30, -1e-7, 1e-4, 0.0999999, 0.1, 0.1000001])])
    x = torch.nn.functional.pad(x, (0, (-x.numel()) % 512))
    y = torch.empty_like(x)
    _tanh_kernel[(x.numel() // 512,)](x, y, BLOCK=512)
    torch.testing.assert_close(y, torch.tanh(x), rtol=4e-7, atol=1e-30)
    assert y[x.abs() > 10].abs().eq(1.0).all()


def test_the_fused_gate_launches_two_gemms_and_two_kernels_and_waits_for_no_device_value():
    """Where the module and the decision dispatch 22 operators a routed layer (three GEMMs, the norm's fp32 chain,
    tanh, sigmoid, the threshold's and the weights' selects), the fused gate dispatches the encoder's and the
    decoder's GEMMs and launches two kernels, and none of it makes the host wait for a device value."""
    gate, router = FlexiDepthGate(), _router(64, 4, torch.bfloat16, 0)
    u, valid = _rows(16, 64, torch.bfloat16, 0)
    own = LaunchCount()
    with own:
        gate.route(0, u, valid, router)
    assert sum(own.ops.values()) == 22 and own.ops["mm"] == 3
    fused = LaunchCount()
    detector = HostWaitDetector()
    with interpreted_launches(fused.triton), fused, detector:
        gate_route(gate, u, valid, router)
    assert dict(fused.ops) == {"mm": 2}
    assert dict(fused.triton) == {"gate_norm_tanh_kernel": 1, "gate_decide_kernel": 1}
    assert detector.waits == []


def test_the_fused_gate_serves_the_trained_gates_alone_and_refuses_what_it_cannot_read():
    """`gate_form` names the fused gate for FlexiDepth and the hard gate (attested), None for skippers that
    read no router; `gate_route` refuses those, and a row wider than one program reads, naming the width. A
    pass of no rows routes nothing."""
    assert gate_form(FlexiDepthGate()) and gate_form(HardGate()) and gate_form(RandomSkip(0.5, 0.5)) is None
    router = _router(64, 4, torch.float32, 0)
    u, valid = _rows(4, 64, torch.float32, 0)
    with pytest.raises(ValueError, match="'random_skip' has no fused gate"):
        gate_route(RandomSkip(0.5, 0.5), u, valid, router)
    wide = SkipRouter(GATE_MAX_WIDTH * 2, 4)
    with pytest.raises(ValueError, match=f"at most {GATE_MAX_WIDTH} values in one program, got {GATE_MAX_WIDTH * 2}"):
        gate_route(FlexiDepthGate(), torch.zeros(1, GATE_MAX_WIDTH * 2), valid[:1], wide)
    empty = gate_route(FlexiDepthGate(), u[:0], valid[:0], router)
    assert empty.run_mask.shape == (0, 1) and empty.weights.shape == (0, 1)


def test_the_gate_benchmark_times_both_routes_beside_their_launches(tmp_path):
    """`benchmarks/gate_bench.py` at a tiny count, in a child process: each gate's own route and the fused gate
    timed, beside the launches a call makes on a GPU; its figures mean nothing here."""
    out = tmp_path / "gate.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gate_bench.py"), "--calls", "20",
                          "--repetitions", "2", "--json", str(out)], capture_output=True, text=True, timeout=240,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    launches = {gate: (sum(r["own_launches"]), r["fused_launches"]) for gate, r in report["gates"].items()}
    assert launches == {"flexidepth": (22, [2, 2]), "qwen3_hard_gate": (19, [2, 2])}
    for gate, r in report["gates"].items():
        assert len(r["own_us"]) == len(r["fused_us"]) == 2 and r["fused_over_own"] > 0
        assert f"  {gate}" in run.stdout
