"""Stand-in for SGLang's CUDA kernel package `sgl_kernel` on CPU-only machines.

With `SGLANG_USE_CPU_ENGINE=1`, `sglang/kernels/ops/kvcache/cache_move.py` imports names from `sgl_kernel`
unconditionally. This package satisfies such imports: every attribute is a function that raises
NotImplementedError when called, so a code path that really needs a CUDA kernel fails loudly instead of computing
something else. No `torch.ops.sgl_kernel` operator is registered, so SGLang detects no AMX backend and runs
RMSNorm, SiLU and RoPE through its native torch paths (what dense Llama and Qwen3 need).
"""

from __future__ import annotations

STUB = True  # lets the runtime attest that the stand-in, not the CUDA wheel, was imported


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is a CUDA kernel; this CPU server runs with the sgl_kernel stand-in "
            "(vskipper/sglang/shims/sgl_kernel), which has no kernels")

    kernel.__name__ = name
    kernel.__qualname__ = name
    return kernel


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
