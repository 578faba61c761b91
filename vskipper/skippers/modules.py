"""The checkpoint modules a trained skipper brings: the per-layer router and the Project-Only adapter.

Attribute names follow the released FlexiDepth checkpoint, so `load_state_dict` takes its tensors as they are:

  model.layers.{l}.router.router_enc.weight     [r, d]     d -> r
  model.layers.{l}.router.router_norm.weight    [r]        RMSNorm, variance in fp32
  model.layers.{l}.router.router_dec.weight     [d, r]     r -> d
  model.layers.{l}.router.router_head.weight    [1, d]     d -> 1
  model.layers.{l}.router_proj.gate_proj.weight [m, d]     d -> m
  model.layers.{l}.router_proj.down_proj.weight [m, d]     d -> m  (named like the Llama MLP's, shaped unlike it)
  model.layers.{l}.router_proj.up_proj.weight   [d, m]     m -> d

with r = d / router_reduction_factor and m = intermediate / proj_reduction_factor (16 and 16 in the release).
The Qwen3 skippers use the same layout.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from vskipper.modelspec import router_sizes  # noqa: F401  (re-exported: the modules' widths)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SkipRouter(nn.Module):
    """w = sigmoid(W_head W_dec tanh(RMSNorm(W_enc u))), one weight in [0, 1] per row; u = LN1(x)."""

    def __init__(self, hidden_size: int, reduced_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.router_enc = nn.Linear(hidden_size, reduced_size, bias=False)
        self.router_norm = RMSNorm(reduced_size, eps)
        self.router_dec = nn.Linear(reduced_size, hidden_size, bias=False)
        self.router_head = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.router_norm(self.router_enc(u)))
        return torch.sigmoid(self.router_head(self.router_dec(z)).float())  # [rows, 1], fp32


class ProjectorAdapter(nn.Module):
    """Proj(v) = up_proj(silu(gate_proj v) * down_proj v): the narrow stand-in for a skipped row's MLP."""

    def __init__(self, hidden_size: int, reduced_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, reduced_size, bias=False)
        self.down_proj = nn.Linear(hidden_size, reduced_size, bias=False)
        self.up_proj = nn.Linear(reduced_size, hidden_size, bias=False)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return self.up_proj(F.silu(self.gate_proj(v)) * self.down_proj(v))


# The checkpoint tensors a skipper brings, by the module names above: every loader sets them apart by these.
ROUTER_MARKERS = (".router.", ".router_proj.")


def is_router_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a layer's router or Project-Only adapter."""
    return any(m in name for m in ROUTER_MARKERS)
