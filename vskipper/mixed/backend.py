"""Cohort FFN backends: the same count-bounded math on Triton (GPU decode) or torch ops (CPU, prefill).

A cohort FFN over (x, idx, count, weights, w_gate, w_up, w_down, y) adds, for cohort positions m < count,

    y[idx[m]] += weights[idx[m]] * w_down @ (silu(w_gate @ x[idx[m]]) * (w_up @ x[idx[m]]))

(weights as the tape holds them: the multiplier of the branch the row takes). The MLP passes its
gate/up/down projections; the FlexiDepth adapter passes (gate_proj, down_proj, up_proj), its d->m, d->m and
m->d matrices.

  torch   `cohort_ffn_torch`: gather (index_select), matmul, weighted index_add over the first `count` rows;
          the count is read on the host (the kernels' reference in the tests)
  triton  `vskipper.mixed.kernels`: static grid for the capacity, device-side count, no host read
          (`cohort_ffn_triton`; a routed layer's two cohorts in one launch per stage, `cohort_ffn_pair`)
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch.nn import functional as F

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def select_backend(requested: str, device: torch.device) -> str:
    """`auto`: Triton on CUDA when installed, torch ops otherwise. `triton` off CUDA needs TRITON_INTERPRET=1."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if requested == "triton":
        if not triton_available():
            raise ValueError("backend 'triton' requested but triton is not installed")
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(f"backend 'triton' on a {device.type} device needs TRITON_INTERPRET=1 "
                             "(the interpreter is for tests only)")
    return requested


def cohort_ffn_torch(x: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, weights: torch.Tensor,
                     w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, y: torch.Tensor) -> None:
    n = int(count)
    if n == 0:
        return
    rows = idx[:n]
    a = x.index_select(0, rows)
    act = F.silu(a @ w_gate.t()) * (a @ w_up.t())
    out = (act @ w_down.t()) * weights.index_select(0, rows).view(-1, 1).to(act.dtype)
    y.index_add_(0, rows, out.to(y.dtype))
