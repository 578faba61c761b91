"""A trained gate's route of a routed layer in four launches, where the gate's module and decision take 22.

FlexiDepth's gate and the Qwen3 hard gate read the layer's router (`vskipper.skippers.modules.SkipRouter`) on
u = LN1 x and keep a row RUN where its weight exceeds the run threshold (`vskipper.skippers.trained_gate`). Run as
the module and the skipper write it, that is 22 torch operators a routed layer (three GEMMs, the router's RMSNorm
in fp32, tanh, sigmoid, the threshold and the branch weights' selects): a host dispatch each in an eager prefill,
a kernel each in a captured decode graph, at every routed layer (16 on Llama-3-8B). Here the two wide GEMMs stay
the host's (cuBLAS on a GPU) and the rest is two Triton launches:

  z = u W_enc^T                          the encoder GEMM ([rows, r], u's dtype)
  gate_norm_tanh_kernel                  zt = tanh(w_norm * RMSNorm(z)): one program a row, the variance in fp32,
                                         rounded where the module rounds (its norm's output to z's dtype, the
                                         weight's product and tanh to the product's dtype)
  t = zt W_dec^T                         the decoder GEMM ([rows, d])
  gate_decide_kernel                     p = sigmoid(t . w_head) (the head's sum rounded to t's dtype, as the
                                         module's head GEMM rounds it), run = p > threshold or the row is padding,
                                         and the branch weight: FlexiDepth's p (RUN) or 1 - p (Project-Only), a
                                         padding row's 1; the hard gate's 1

Values agree with the module's to the order of the sums (fp32 either way), not bit for bit: a row whose weight
lies within a rounding of the threshold may route the other way, as it may between two GEMM libraries. Neither
kernel takes the row count (a program a row), so one compiled variant per dtype serves every pass, compiled when
the model is built (`warm_gate`), and a captured decode graph replays it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import nn
from torch.nn import functional as F

from vskipper.constants import CONSTANTS
from vskipper.mixed.kernels import next_power_of_2
from vskipper.skippers.base import LayerRoute
from vskipper.skippers.trained_gate import FlexiDepthGate, HardGate

GATE_MAX_WIDTH = 16384  # the widest row (the hidden size) one program reads (Llama-3-8B: 4,096)
GATE_WARPS = 4  # a program's warps, either kernel
# whether a gate's branch weights are the router's (FlexiDepth: p and 1 - p) or unit (the hard gate)
GATE_WEIGHTED = {FlexiDepthGate.name: True, HardGate.name: False}


@triton.jit
def _tanh(x):
    """tanh in fp32 to a few ulp: its odd series below |x| = 0.1 (the first term left out, 62 x^9 / 2835, is
    under 2.2e-11 there), (1 - e) / (1 + e) with e = exp(-2|x|) <= 1 above (no overflow at any x, and 1 - e
    is at least 0.18, so no cancellation)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    far = (1.0 - e) / (1.0 + e)
    s = a * a
    near = a * (1.0 + s * (-1.0 / 3.0 + s * (2.0 / 15.0 - s * (17.0 / 315.0))))
    t = tl.where(a < 0.1, near, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def gate_norm_tanh_kernel(z_ptr, w_ptr, y_ptr, n_cols, stride_z, stride_y, eps, BLOCK: tl.constexpr):
    """Row `program_id(0)`: y = tanh(w * RMSNorm(z)) over its n_cols, rounded as the router's modules round: the
    normalized row to z's dtype, its product with w and tanh to y's."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    v = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n_cols + eps)
    normed = (v * rstd).to(z_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scaled = (w * normed).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, _tanh(scaled).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["valid_ptr", "run_ptr", "w_ptr", "threshold"])
def gate_decide_kernel(t_ptr, head_ptr, valid_ptr, run_ptr, w_ptr, n_cols, stride_t, threshold,
                       WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    """Row `program_id(0)`: p = sigmoid(t . head) (the sum rounded to t's dtype, then fp32), run = p > threshold
    or not valid, and its branch weight (WEIGHTED: p where it runs, 1 - p where it projects, 1 for padding; else
    1) in w's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    t = tl.load(t_ptr + row * stride_t + cols, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(head_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    logit = tl.sum(t * h, axis=0).to(t_ptr.dtype.element_ty).to(tl.float32)
    p = 1.0 / (1.0 + tl.exp(-logit))
    valid = tl.load(valid_ptr + row) != 0
    run = (p > threshold) | (valid == 0)
    if WEIGHTED:
        w = tl.where(valid, tl.where(run, p, 1.0 - p), 1.0)
    else:
        w = tl.full([], 1.0, tl.float32)
    tl.store(run_ptr + row, run)
    tl.store(w_ptr + row, w.to(w_ptr.dtype.element_ty))


def gate_form(skipper: Any) -> str | None:
    """What computes this skipper's routes in the triton execution (attested), or None: its own `route`."""
    if getattr(skipper, "name", None) not in GATE_WEIGHTED:
        return None
    return "the router's two GEMMs and two launches a routed layer (vskipper.mixed.router)"


def _block(width: int) -> int:
    if width > GATE_MAX_WIDTH:
        raise ValueError(f"the fused gate reads rows of at most {GATE_MAX_WIDTH} values in one program, got {width}")
    return next_power_of_2(width)


def gate_route(skipper: Any, u: torch.Tensor, valid: torch.Tensor, router: nn.Module) -> LayerRoute:
    """The route `skipper.route(layer, u, valid, router)` returns (`valid`: its state, bool [rows, 1]), from the
    router's two GEMMs and the two launches."""
    weighted = GATE_WEIGHTED.get(getattr(skipper, "name", None))
    if weighted is None:
        raise ValueError(f"skipper {getattr(skipper, 'name', skipper)!r} has no fused gate (known: "
                         f"{', '.join(sorted(GATE_WEIGHTED))})")
    norm, enc, dec = router.router_norm, router.router_enc.weight, router.router_dec.weight
    reduced_block, hidden_block = _block(enc.shape[0]), _block(dec.shape[0])
    rows, device = u.shape[0], u.device
    run = torch.empty(rows, 1, dtype=torch.bool, device=device)
    weights = torch.empty(rows, 1, dtype=u.dtype, device=device)
    if not rows:
        return LayerRoute(run, weights)
    z = F.linear(u, enc)
    # the product's dtype, as torch promotes it (a dispatch of its own: skipped where the dtypes are the same)
    product = z.dtype if norm.weight.dtype == z.dtype else torch.promote_types(norm.weight.dtype, z.dtype)
    zt = torch.empty(z.shape, dtype=product, device=device)
    gate_norm_tanh_kernel[(rows,)](z, norm.weight, zt, z.shape[1], z.stride(0), zt.stride(0), norm.eps,
                                   BLOCK=reduced_block, num_warps=GATE_WARPS)
    t = F.linear(zt, dec)
    valid = valid.reshape(-1)
    gate_decide_kernel[(rows,)](t, router.router_head.weight, valid if valid.stride(0) == 1 else valid.contiguous(),
                                run, weights, t.shape[1], t.stride(0), CONSTANTS.router_run_threshold,
                                WEIGHTED=weighted, BLOCK=hidden_block, num_warps=GATE_WARPS)
    return LayerRoute(run, weights)


def warm_gate(skipper: Any, router: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Compile the fused gate's variants before the server serves (a pass of one row: their first launches)."""
    hidden = router.router_enc.weight.shape[1]
    gate_route(skipper, torch.zeros(1, hidden, dtype=dtype, device=device),
               torch.ones(1, 1, dtype=torch.bool, device=device), router)
