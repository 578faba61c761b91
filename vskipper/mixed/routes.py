"""A skipper's per-pass routes in one Triton launch, where a skipper's decisions have a fused form.

`RandomSkip.prepare_batch` computes every routed layer's routes of a pass as a chain of about fifty integer tensor
ops over the pass's rows and [layers, rows] (its hash of each row's request key and position): fifty launches a
pass on a device, in an eager prefill a host dispatch each and in a captured decode graph a kernel each, before any
routed layer runs (on CPU the chain runs as numpy's ufuncs, no launch). `random_routes_kernel` computes the same
routes, bit for bit (the same 64-bit integer arithmetic; a modulus of 2^31 as a mask, which agrees with floor
division's for every sign), and the unit branch weights, in one launch over blocks of rows; `fused_state` hands
the runtime the state `prepare_batch` would have returned, so the skipper's `route` reads it unchanged. No argument
is specialized (the row count, the thresholds, the seed's mix, the pointers' alignment): one compiled variant per
routed-layer count and weight dtype serves every pass, compiled when the model is built (`warm_routes`).

Skippers without a fused form (trained gates read the layer's hidden states at each layer; StaticDepth has nothing
to hash) keep their own `prepare_batch`.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from vskipper.mixed.kernels import cdiv
from vskipper.skippers.base import BatchContext
from vskipper.skippers.random_skip import MASK, MIX, MOD, PHI, RandomSkip, _mix, _threshold

ROUTES_BLOCK = 1024  # rows a program covers: a decode batch in one, a prefill chunk in a few
ROUTES_WARPS = 4
ROUTES_ARGS = ("keys_ptr", "pos_ptr", "valid_ptr", "run_ptr", "w_ptr", "rows", "seed_mix", "thr_r", "thr_d")
_MASK = tl.constexpr(MASK)
_MIX = tl.constexpr(MIX)
_PHI = tl.constexpr(PHI)
_MOD = tl.constexpr(MOD)


@triton.jit
def _mix31(x):
    """`random_skip._mix` on int64 values."""
    x = x & _MASK
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=list(ROUTES_ARGS))
def random_routes_kernel(keys_ptr, pos_ptr, valid_ptr, run_ptr, w_ptr, rows, seed_mix, thr_r, thr_d,
                         LAYERS: tl.constexpr, BLOCK: tl.constexpr):
    """Rows of block `program_id(0)`: run [LAYERS, rows] (bool, True: RUN) and w [rows] (ones, w's dtype) of
    RandomSkip's routes: a valid row is selected where (k + position * PHI) mod 2^31 < thr_r, k = mix(mix(seed) ^
    fold(key)), and a selected row projects at layer j where (mix(k ^ mix(position)) + j * 2^31 // LAYERS) mod 2^31
    < thr_d."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_pass = offs < rows
    key = tl.load(keys_ptr + offs, mask=in_pass, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + offs, mask=in_pass, other=0).to(tl.int64)
    valid = tl.load(valid_ptr + offs, mask=in_pass, other=0) != 0
    folded = (key ^ (key >> 31) ^ (key >> 62)) & _MASK  # arithmetic shifts, as torch's and Python's
    k = _mix31(seed_mix.to(tl.int64) ^ folded)
    selected = (((k + pos * _PHI) & _MASK) < thr_r) & valid
    offset = _mix31(k ^ _mix31(pos))
    for j in tl.static_range(LAYERS):
        project = selected & (((offset + j * _MOD // LAYERS) & _MASK) < thr_d)
        tl.store(run_ptr + j * rows + offs, project == 0, mask=in_pass)
    tl.store(w_ptr + offs, tl.full([BLOCK], 1.0, w_ptr.dtype.element_ty), mask=in_pass)


def fused_state(skipper: Any, batch: BatchContext) -> dict[str, Any] | None:
    """The state `skipper.prepare_batch(batch)` returns, from one launch, where the skipper has a fused form (a
    `RandomSkip`); None where it has none."""
    if not isinstance(skipper, RandomSkip):
        return None
    if batch.request_keys is None or batch.positions is None:
        raise ValueError("random_skip needs per-row request_keys and positions in the batch context")
    keys, pos, valid = (t.reshape(-1) for t in (batch.request_keys, batch.positions, batch.valid_rows))
    rows, layers, device = keys.shape[0], len(batch.routed_layers), keys.device
    run = torch.empty(layers, rows, dtype=torch.bool, device=device)
    weights = torch.empty(rows, 1, dtype=batch.hidden_states.dtype, device=device)
    if rows:
        random_routes_kernel[(cdiv(rows, ROUTES_BLOCK),)](
            keys if keys.stride(0) == 1 else keys.contiguous(), pos if pos.stride(0) == 1 else pos.contiguous(),
            valid if valid.stride(0) == 1 else valid.contiguous(), run, weights, rows, _mix(skipper.seed),
            _threshold(skipper.r), _threshold(skipper.d), LAYERS=layers, BLOCK=ROUTES_BLOCK, num_warps=ROUTES_WARPS)
    return {"run": run.unsqueeze(-1), "weights": weights,
            "index": {layer: j for j, layer in enumerate(batch.routed_layers)}}


def fused_form(skipper: Any) -> str | None:
    """What computes this skipper's per-pass state in the triton execution (attested), or None: its own ops."""
    return "one launch (vskipper.mixed.routes.random_routes_kernel)" if isinstance(skipper, RandomSkip) else None


def warm_routes(skipper: Any, routed_layers: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """Compile the fused routes' one variant before the server serves (a pass of one row: its first launch)."""
    one = torch.zeros(1, dtype=torch.int64, device=device)
    fused_state(skipper, BatchContext(torch.empty(1, 1, dtype=dtype, device=device),
                                      torch.ones(1, dtype=torch.bool, device=device), routed_layers, "decode",
                                      one, one))
