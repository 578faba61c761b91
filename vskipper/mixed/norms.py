"""RMSNorm, the residual add with RMSNorm, SiLU-and-mul and the rotary embedding, one Triton launch each, with the
values of SGLang's torch paths (`RMSNorm.forward_native`, `SiluAndMul.forward_native`,
`RotaryEmbedding.forward_native`) for the CUDA stand-in profile that has neither SGLang's CUDA kernels nor their JIT
compiler.

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
  rotary_embedding(pos, q, k, ...)  each head's first rotary_dim values of the query and the key rotated by the
                                    position's cos and sin (the cache's row: rotary_dim / 2 cosines, then as many
                                    sines), in its halves (NeoX) or its even and odd values (GPT-J), the rest of
                                    the head copied: new tensors of q's and k's shapes, one program a token for the
                                    query's heads and one for the key's

The reductions sum in a different order than torch's, so values agree to fp32 rounding, not bit for bit. The rotary
embedding multiplies in fp32 and rounds once, where the torch path rounds the cosines and sines to the operands'
dtype and each product and sum to it (as SGLang's CUDA kernel does, it keeps fp32): in float32 the two agree to
fp32 rounding, in bfloat16 within a few units in the last place of the head's largest value.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vskipper.mixed.kernels import cdiv, next_power_of_2

NORM_MAX_WIDTH = 16384  # the widest row one program normalizes (Llama-3-8B and Qwen3-8B: 4,096)
NORM_MAX_WARPS = 8  # a program's warps: one per 512 elements of its row's block, 1 to 8 (a 4,096 row: 8)
SILU_BLOCK = 1024  # elements of a row one SiLU-and-mul program covers
SILU_WARPS = 4
ROPE_MAX_ELEMENTS = 16384  # the most values one rotary program rotates: its heads times half the rotary width
ROPE_WARPS = 4


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


@triton.jit
def _rotate_heads(x_ptr, y_ptr, tok, heads, stride_xt, stride_xh, stride_yt, stride_yh, c, s,
                  HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, HEAD: tl.constexpr, NEOX: tl.constexpr,
                  PASS_BLOCK: tl.constexpr, HEADS_BLOCK: tl.constexpr):
    """Token `tok`'s `heads` heads of x rotated into y: the first 2 * HALF values of each head by c and s (fp32, one
    a pair), the rest of the head copied."""
    offs_h = tl.arange(0, HEADS_BLOCK)[:, None]
    offs_i = tl.arange(0, HALF_BLOCK)[None, :]
    mask = (offs_h < heads) & (offs_i < HALF)
    x_row = x_ptr + tok * stride_xt + offs_h * stride_xh
    y_row = y_ptr + tok * stride_yt + offs_h * stride_yh
    if NEOX:  # the pairs are (i, i + HALF)
        i1 = offs_i
        i2 = offs_i + HALF
    else:  # GPT-J: the pairs are (2i, 2i + 1)
        i1 = 2 * offs_i
        i2 = 2 * offs_i + 1
    x1 = tl.load(x_row + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + i2, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_row + i1, (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_row + i2, (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=mask)
    if PASS_BLOCK > 0:  # the head's values past the rotary width, as they are
        offs_p = 2 * HALF + tl.arange(0, PASS_BLOCK)[None, :]
        p_mask = (offs_h < heads) & (offs_p < HEAD)
        tl.store(y_row + offs_p, tl.load(x_row + offs_p, mask=p_mask, other=0.0), mask=p_mask)


@triton.jit
def rope_kernel(pos_ptr, cs_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, q_heads, k_heads, stride_pos, stride_cs,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, HEAD: tl.constexpr, NEOX: tl.constexpr,
                PASS_BLOCK: tl.constexpr, HEADS_BLOCK: tl.constexpr):
    """Token `program_id(0)`: its query's heads (`program_id(1)` 0) or its key's (1) rotated by the cos and sin of
    its position's row of the cache."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok * stride_pos).to(tl.int64)
    offs_i = tl.arange(0, HALF_BLOCK)
    c_mask = offs_i < HALF
    c = tl.load(cs_ptr + pos * stride_cs + offs_i, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(cs_ptr + pos * stride_cs + HALF + offs_i, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    if tl.program_id(1) == 0:
        _rotate_heads(q_ptr, qo_ptr, tok, q_heads, stride_qt, stride_qh, stride_qot, stride_qoh, c, s,
                      HALF, HALF_BLOCK, HEAD, NEOX, PASS_BLOCK, HEADS_BLOCK)
    else:
        _rotate_heads(k_ptr, ko_ptr, tok, k_heads, stride_kt, stride_kh, stride_kot, stride_koh, c, s,
                      HALF, HALF_BLOCK, HEAD, NEOX, PASS_BLOCK, HEADS_BLOCK)


@functools.cache
def rope_launch(head_size: int, rotary_dim: int, heads: int) -> dict[str, int]:
    """The constexprs of a rotary launch over heads of `head_size` whose first `rotary_dim` values rotate, for up
    to `heads` heads a token (one dict a shape, shared: not to be changed)."""
    half = rotary_dim // 2
    rest = head_size - rotary_dim
    return {"HALF": half, "HALF_BLOCK": next_power_of_2(half), "HEAD": head_size,
            "PASS_BLOCK": next_power_of_2(rest) if rest else 0, "HEADS_BLOCK": next_power_of_2(heads)}


def _heads(x: torch.Tensor, tokens: int, head_size: int) -> tuple[int, int, int] | None:
    """(heads, token stride, head stride) of x as (tokens, heads, head_size), each head's values adjacent, without a
    copy; None where no such view is. Read from x's shape and strides where it is one of the layers' (rows of a
    token's heads, or tokens x heads x head_size), else from a view."""
    if x.numel() % (tokens * head_size):
        return None
    if x.dim() == 2 and x.shape[0] == tokens and x.stride(1) == 1:
        return x.shape[1] // head_size, x.stride(0), head_size
    if x.dim() == 3 and x.shape[0] == tokens and x.shape[2] == head_size and x.stride(2) == 1:
        return x.shape[1], x.stride(0), x.stride(1)
    try:
        view = x.view(tokens, -1, head_size)
    except RuntimeError:
        return None
    return (view.shape[1], view.stride(0), view.stride(1)) if view.stride(2) == 1 else None


def rope_unsupported(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
                     head_size: int, rotary_dim: int) -> str | None:
    """Why `rotary_embedding` cannot take these operands, or None."""
    tokens = positions.numel()
    if tokens == 0:
        return "no tokens"
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        return f"positions of shape {tuple(positions.shape)} and {positions.dtype} (one integer a token)"
    if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        return f"a rotary width of {rotary_dim} in heads of {head_size}"
    if tuple(cos_sin_cache.shape[1:]) != (rotary_dim,) or cos_sin_cache.stride(-1) != 1:
        return f"a cos/sin cache of shape {tuple(cos_sin_cache.shape)} for a rotary width of {rotary_dim}"
    for name, x in (("query", query), ("key", key)):
        if x.device != positions.device or cos_sin_cache.device != x.device:
            return f"the {name} on {x.device}, the positions on {positions.device}, the cache on {cos_sin_cache.device}"
        heads = _heads(x, tokens, head_size)
        if heads is None:
            return f"a {name} of shape {tuple(x.shape)} and strides {x.stride()} that no view of ({tokens}, heads, " \
                   f"{head_size}) takes"
        if heads[0] * next_power_of_2(rotary_dim // 2) > ROPE_MAX_ELEMENTS:
            return f"{heads[0]} {name} heads of {rotary_dim // 2} pairs exceed {ROPE_MAX_ELEMENTS} a program"
    return None


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
                     head_size: int, rotary_dim: int, neox: bool, checked: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The query and the key rotated at `positions` (one a token; see the module's table): new contiguous tensors
    of their shapes. Operands `rope_unsupported` refuses raise ValueError, unless the caller `checked` them already.
    The positions are not checked against the cache's rows (a host read): as SGLang's own kernels, a position past
    them reads past the cache."""
    if not checked:
        why = rope_unsupported(positions, query, key, cos_sin_cache, head_size, rotary_dim)
        if why is not None:
            raise ValueError(f"rotary_embedding: {why}")
    tokens = positions.shape[0]
    (q_heads, q_st, q_sh), (k_heads, k_st, k_sh) = _heads(query, tokens, head_size), _heads(key, tokens, head_size)
    # new tensors of the operands' shapes: contiguous, so (tokens, heads, head_size) with strides (heads x head_size,
    # head_size)
    q_out, k_out = query.new_empty(query.shape), key.new_empty(key.shape)
    rope_kernel[(tokens, 2)](positions, cos_sin_cache, query, key, q_out, k_out, q_heads, k_heads,
                             positions.stride(0), cos_sin_cache.stride(0), q_st, q_sh, k_st, k_sh,
                             q_heads * head_size, head_size, k_heads * head_size, head_size, NEOX=neox,
                             num_warps=ROPE_WARPS, **rope_launch(head_size, rotary_dim, max(q_heads, k_heads)))
    return q_out, k_out
