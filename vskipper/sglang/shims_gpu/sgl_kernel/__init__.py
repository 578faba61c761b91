"""Stand-in for SGLang's CUDA kernel package `sgl_kernel` on a GPU machine that lacks the wheel.

Called by the Llama / Qwen3 path's CUDA forwards with the Triton attention backend (torch, on the tensors' device);
without `--gpu-jit` SGLang's forced torch backend runs its ops' torch paths instead and never reaches the first
three (SGLang's graph runners call `weak_ref_tensor` directly):
  rmsnorm(input, weight, eps, out, enable_pdl) -> out = RMSNorm(input) * weight
  fused_add_rmsnorm(input, residual, weight, eps, enable_pdl) -> None, in place: residual = input + residual,
      input = RMSNorm(residual) * weight, the sum and the norm in fp32 (as the CUDA kernel computes them)
  silu_and_mul(input, out) -> silu(input[..., :d]) * input[..., d:] (MLP widths SGLang's JIT kernel rejects)
  utils.is_arch_support_pdl() -> False (plain launches)
  weak_ref_tensor(t) -> a view of t's memory that does not keep it alive (SGLang's breakable and piecewise
      prefill CUDA graphs hand their captured outputs on so; the graph's memory pool owns the memory)
Every other name below is importable and raises NotImplementedError when called. No `scalar_type` submodule and no
`torch.ops.sgl_kernel` operator exist (SGLang falls back, or probes and finds none).
"""

from __future__ import annotations

import torch
from sgl_kernel import kvcacheio, quantization, utils  # noqa: F401  (submodules SGLang imports)
from sgl_kernel._missing import define

STAND_IN = "cuda"  # lets the runtime attest that the stand-in, not the CUDA wheel, was imported

# Imported at module level on the CUDA path, never called by the served configuration.
IMPORT_ONLY = (
    "top_k_renorm_prob", "top_p_renorm_prob", "int8_scaled_mm", "moe_align_block_size", "moe_sum",
    "moe_sum_reduce", "gemma_rmsnorm", "gemma_fused_add_rmsnorm", "gelu_and_mul", "gelu_tanh_and_mul",
)
define(globals(), __name__, IMPORT_ONLY)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x (fp32) / sqrt(mean(x^2) + eps) over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
            enable_pdl: bool | None = None) -> torch.Tensor:
    y = (_rms(input.float(), eps) * weight.float()).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: bool | None = None) -> None:
    x = input.float() + residual.float()
    residual.copy_(x)
    input.copy_(_rms(x, eps) * weight.float())


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    d = input.shape[-1] // 2
    y = torch.nn.functional.silu(input[..., :d].float()) * input[..., d:].float()
    if out is None:
        return y.to(input.dtype)
    out.copy_(y)
    return out


def weak_ref_tensor(tensor):
    """A tensor over `tensor`'s memory (same dtype, shape, strides and offset) whose storage does not own it, as
    the CUDA kernel makes one: the memory lives as long as its owner keeps it, not as long as the view. Anything
    not a tensor comes back as it is (as the kernel's Python wrapper does)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    storage = tensor.untyped_storage()
    borrowed = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        borrowed, tensor.storage_offset(), tensor.size(), tensor.stride())
