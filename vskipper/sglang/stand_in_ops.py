"""The CUDA stand-in profile's fused ops in Triton (`vskipper serve --stand-in-ops triton`).

Without SGLang's CUDA kernels and their JIT compiler, SGLang's forced torch backend runs RMSNorm (with its residual
add), SiLU-and-mul and the rotary embedding as `forward_native`: a chain of torch kernels a call, in every layer of
every arm. With `--stand-in-ops triton`, hooks AROUND those three methods run `vskipper.mixed.norms`' one-launch
kernels instead, with the same values (to fp32 rounding; the rotary embedding in bf16 within a few units in the last
place, as SGLang's own CUDA kernel computes it), wherever the call is one the kernels take:

  RMSNorm.forward_native     rows of the module's own width, a weight of that width, no fp32 residual, no
                             post-residual addition, no variance over part of the row, no cast before the weight
                             (Llama and Qwen3 layers' norms; Qwen3's per-head q/k norms too)
  SiluAndMul.forward_native  any row of an even width
  RotaryEmbedding.forward_native
                             the base class's path (Llama-3's and Qwen3's rotary embeddings inherit it) with no
                             position offsets, no fused K/V write, no precomputed sin/cos, SGLang's own rotation;
                             the query and key each a view of (tokens, heads, head_size) with adjacent values

Any other call (another device than CUDA, unless the Triton interpreter is on; an option the kernels do not take)
runs SGLang's own torch path. Each call is counted by the path it took (`attestation`): a server on the stand-in
ops that still ran SGLang's chains says so, and why. A captured graph's replay calls no Python: a decode pass that
replays counts nothing, its graph holding what the captured calls launched.

The hooks apply to every instance, dense layers and routed layers alike (the routed layers call the layer's own
norms), in every arm of a run that asks for them: a run on these ops compares with runs on the same ops.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from vskipper.serveargs import STAND_IN_OPS
from vskipper.sglang.spec import ENV_STAND_IN_OPS

RMSNORM_TARGET = "sglang.srt.layers.layernorm.RMSNorm.forward_native"
SILU_TARGET = "sglang.srt.layers.activation.SiluAndMul.forward_native"
ROPE_TARGET = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward_native"
TARGETS = (RMSNORM_TARGET, SILU_TARGET, ROPE_TARGET)

_calls: Counter[tuple[str, str]] = Counter()  # (op, path): "triton" or "torch: <why>"


def requested(environ=os.environ) -> str:
    """The stand-in ops this process serves with ('torch' unless the server asked for 'triton')."""
    ops = environ.get(ENV_STAND_IN_OPS, "torch")
    if ops not in STAND_IN_OPS:
        raise ValueError(f"{ENV_STAND_IN_OPS}={ops!r}: one of {', '.join(STAND_IN_OPS)}")
    return ops


def _device_why(x) -> str | None:
    if x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"a {x.device.type} tensor"


def rmsnorm_why(norm, x, residual=None, post_residual_addition=None) -> str | None:
    """Why this `RMSNorm.forward_native` call (x contiguous) runs SGLang's torch path, or None (the Triton kernel
    takes it)."""
    from vskipper.mixed.norms import rms_norm_unsupported

    if post_residual_addition is not None:
        return "a post-residual addition"
    for attr, why in (("variance_size_override", "a variance over part of the row"),
                      ("override_orig_dtype", "an overridden output dtype")):
        if getattr(norm, attr, None) is not None:
            return why
    if getattr(norm, "cast_x_before_out_mul", False):
        return "a cast before the weight"
    if residual is not None and getattr(norm, "fp32_residual", False):
        return "an fp32 residual"
    if x.shape[-1] != norm.hidden_size:
        return f"rows of {x.shape[-1]}, the norm's {norm.hidden_size}"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1):
        return "a residual of another shape or dtype, or its rows not contiguous"
    return _device_why(x) or rms_norm_unsupported(x, norm.weight)


def around_rmsnorm(original, norm, x, residual=None, post_residual_addition=None, quant_linear=None, **kwargs):
    x = x if x.is_contiguous() else x.contiguous()  # as the torch path makes it
    why = f"arguments {sorted(kwargs)}" if kwargs else rmsnorm_why(norm, x, residual, post_residual_addition)
    if why is not None:
        _calls["rmsnorm", f"torch: {why}"] += 1
        return original(norm, x, residual, post_residual_addition, quant_linear, **kwargs)
    from vskipper.mixed.norms import rms_norm

    _calls["rmsnorm", "triton"] += 1
    return rms_norm(x, norm.weight, norm.variance_epsilon, residual, checked=True)


def around_silu_and_mul(original, op, x, *args, **kwargs):
    why = f"arguments beside x ({len(args) + len(kwargs)})" if args or kwargs else _device_why(x)
    if why is None and (x.shape[-1] % 2 or x.numel() == 0):
        why = f"rows of {x.shape[-1]}" if x.numel() else "no rows"
    if why is not None:
        _calls["silu_and_mul", f"torch: {why}"] += 1
        return original(op, x, *args, **kwargs)
    from vskipper.mixed.norms import silu_and_mul

    _calls["silu_and_mul", "triton"] += 1
    return silu_and_mul(x if x.stride(-1) == 1 else x.contiguous(), checked=True)


def rope_why(rope, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None) -> str | None:
    """Why this `RotaryEmbedding.forward_native` call runs SGLang's torch path, or None (the Triton kernel takes
    it)."""
    from sglang.srt.layers.rotary_embedding.utils import apply_rotary_emb

    from vskipper.mixed.norms import rope_unsupported

    if offsets is not None:
        return "position offsets"
    if fused_set_kv_buffer_arg is not None:
        return "a fused K/V write"
    if hasattr(rope, "sin_cos_cache"):
        return "a precomputed sin/cos"
    if getattr(rope, "_apply_rotary_emb_wrapped", None) is not apply_rotary_emb:
        return "another rotation than SGLang's apply_rotary_emb"
    return _device_why(query) or rope_unsupported(positions.flatten(), query, key, rope.cos_sin_cache,
                                                  rope.head_size, rope.rotary_dim)


def around_rope(original, rope, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None, **kwargs):
    why = f"arguments {sorted(kwargs)}" if kwargs else rope_why(rope, positions, query, key, offsets,
                                                                 fused_set_kv_buffer_arg)
    if why is not None:
        _calls["rope", f"torch: {why}"] += 1
        return original(rope, positions, query, key, offsets, fused_set_kv_buffer_arg, **kwargs)
    from vskipper.mixed.norms import rotary_embedding

    _calls["rope", "triton"] += 1
    return rotary_embedding(positions.flatten(), query, key, rope.cos_sin_cache, rope.head_size, rope.rotary_dim,
                            rope.is_neox_style, checked=True)


def register(registry, hook_type) -> None:
    """Hooks AROUND SGLang's three torch paths, where this process serves the Triton stand-in ops."""
    if requested() != "triton":
        return
    registry.register(RMSNORM_TARGET, around_rmsnorm, hook_type.AROUND)
    registry.register(SILU_TARGET, around_silu_and_mul, hook_type.AROUND)
    registry.register(ROPE_TARGET, around_rope, hook_type.AROUND)


def targets() -> tuple[str, ...]:
    """The hooks this process must have applied (none on SGLang's torch paths)."""
    return TARGETS if requested() == "triton" else ()


def calls() -> Counter[tuple[str, str]]:
    """A copy of the calls so far, by (op, path)."""
    return Counter(_calls)


def attestation() -> dict[str, Any]:
    """What this process serves its fused ops with, and each op's calls by the path they took."""
    calls: dict[str, dict[str, int]] = {}
    for (op, path), n in sorted(_calls.items()):
        calls.setdefault(op, {})[path] = n
    return {"ops": requested(), "calls_total": calls}
