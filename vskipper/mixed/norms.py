"""RMSNorm, the residual add with RMSNorm, and SiLU-and-mul, one Triton launch each, with the values of SGLang's
torch paths (`RMSNorm.forward_native`, `SiluAndMul.forward_native`) for the CUDA stand-in profile that has neither
SGLang's CUDA kernels nor their JIT compiler.

There SGLang runs each of these as a chain of torch kernels a call (a residual add with RMSNorm: ten, each a pass
over the rows in fp32), in every layer of every arm, dense included: a large share of a prefill's launches and of
a decode step's kernel time on the H200. Here each is one program a row (the norms) or a tile of a row (SiLU-and-
mul), launched over a grid of the pass's rows: no argument carries the row count, so one compiled variant serves
every pass and a captured decode graph replays it.

  rms_norm(x, w, eps)               y = (x_f * rsqrt(mean(x_f^2) + eps) * w_f).to(x.dtype), x_f = fp32(x)
  rms_norm(x, w, eps, residual=r)   s = fp32(x) + fp32(r);  (y of s as above, s.to(x.dtype)): new tensors, inputs
                                    left as they are (as the torch path's)
  silu_and_mul(x)                   g, u = x[..., :d], x[..., d:];  silu(g) rounded to x.dtype, times u, rounded
                                    (the torch path's two ops, each rounding to x.dtype)

The reductions sum in a different order than torch's, so values agree to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vskipper.mixed.kernels import cdiv, next_power_of_2

NORM_MAX_WIDTH = 16384  # the widest row one program normalizes (Llama-3-8B and Qwen3-8B: 4,096)
NORM_MAX_WARPS = 8  # a program's warps: one per 512 elements of its row's block, 1 to 8 (a 4,096 row: 8)
SILU_BLOCK = 1024  # elements of a row one SiLU-and-mul program covers
SILU_WARPS = 4


@triton.jit
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, n_cols, stride_x, stride_r, stride_y, stride_s, eps,
                    RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Row `program_id(0)`: y = RMSNorm(x [+ r]) * w over its n_cols; with RESIDUAL, s = x + r (in x's dtype) too.
    The sum, the mean of squares and the scaling in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    v = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        v += tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(s_ptr + row * stride_s + cols, v.to(s_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (v * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_kernel(x_ptr, y_ptr, d, stride_x, stride_y, BLOCK: tl.constexpr):
    """Row `program_id(0)`, columns of tile `program_id(1)`: y = silu(g) * u, g and u the two halves of x's row,
    each product's factors rounded to y's dtype as the torch path's ops round them."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (silu * u.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def norm_launch(width: int) -> tuple[int, int]:
    """(BLOCK, warps) of a norm's launch over rows of `width`: the row in one block, a warp per 512 elements of it."""
    block = next_power_of_2(width)
    return block, max(1, min(NORM_MAX_WARPS, block // 512))


def rms_norm_unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why `rms_norm` cannot take these operands, or None."""
    width = x.shape[-1] if x.dim() else 0
    if x.numel() == 0:
        return "no rows"
    if width > NORM_MAX_WIDTH:
        return f"rows of {width} exceed {NORM_MAX_WIDTH}"
    if tuple(weight.shape) != (width,) or weight.device != x.device or weight.stride(0) != 1:
        return f"weight {tuple(weight.shape)} on {weight.device} for rows of {width} on {x.device}"
    if x.stride(-1) != 1:
        return "rows not contiguous"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             checked: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x's rows (any leading shape, rows contiguous), or of x + residual with the sum returned beside it;
    see the module's table. Operands `rms_norm_unsupported` refuses raise ValueError, unless the caller `checked`
    them already (a call per norm per pass: the host's time is the point)."""
    if not checked:
        why = rms_norm_unsupported(x, weight)
        if why is None and residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
            why = f"residual {tuple(residual.shape)} for x {tuple(x.shape)}, or its rows not contiguous"
        if why is not None:
            raise ValueError(f"rms_norm: {why}")
    width = x.shape[-1]
    flat = x.dim() != 2
    x2 = x.reshape(-1, width) if flat else x
    y = torch.empty_like(x2)
    r2, s = (x2, y) if residual is None else (residual.reshape(-1, width) if flat else residual, torch.empty_like(x2))
    block, warps = norm_launch(width)
    rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y, s, width, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0),
                                    eps, RESIDUAL=residual is not None, BLOCK=block, num_warps=warps)
    if flat:
        y, s = y.view(x.shape), s.view(x.shape)
    return y if residual is None else (y, s)


def silu_and_mul(x: torch.Tensor, checked: bool = False) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] over x's rows (any leading shape, rows contiguous, an even width); `checked`:
    the caller checked that already."""
    width = x.shape[-1]
    if not checked and (width % 2 or x.stride(-1) != 1 or x.numel() == 0):
        raise ValueError(f"silu_and_mul: rows of {width} (an even width, contiguous, at least one row)")
    d = width // 2
    flat = x.dim() != 2
    x2 = x.reshape(-1, width) if flat else x
    y = x2.new_empty(x2.shape[0], d)
    silu_mul_kernel[(x2.shape[0], cdiv(d, SILU_BLOCK))](x2, y, d, x2.stride(0), y.stride(0), BLOCK=SILU_BLOCK,
                                                        num_warps=SILU_WARPS)
    return y.view(*x.shape[:-1], d) if flat else y
