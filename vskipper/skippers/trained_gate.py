"""Trained gates: FlexiDepth's soft-weighted router and the Qwen3 skippers' straight-through hard gate.

Both read the layer's router module on u = LN1(x), the layer input after its input RMSNorm, and select RUN for
a row when its weight w exceeds 0.5. They differ in the branch weights:

  FlexiDepth   RUN:  y = h + w * MLP(LN2(h))          Project-Only:  y = x + (1 - w) * Proj(LN2(x))
  hard gate    RUN:  y = h + MLP(LN2(h))              Project-Only:  y = x + Proj(LN2(x))

(h = x + Attn(u); the weight never scales attention). The hard gate's straight-through estimator only matters
in training; its forward value is the hard 0/1 decision, hence unit weights at inference.
"""

from __future__ import annotations

from typing import Any

import torch

from vskipper.constants import CONSTANTS
from vskipper.skippers.base import BatchContext, LayerRoute, Skipper


class _TrainedGate(Skipper):
    requires_router_weights = True

    def __init__(self, skip_ratio: float) -> None:
        self.skip_ratio = skip_ratio

    def parameters(self) -> dict[str, Any]:
        return {"skip_ratio": self.skip_ratio, "run_threshold": CONSTANTS.router_run_threshold}

    def prepare_batch(self, batch: BatchContext) -> torch.Tensor:
        return batch.valid_rows.view(-1, 1)

    def route(self, layer_id: int, normed_hidden: torch.Tensor, state: torch.Tensor,
              router: torch.nn.Module | None = None) -> LayerRoute:
        if router is None:
            raise ValueError(f"skipper {self.name!r} needs layer {layer_id}'s router weights; none were loaded")
        valid = state
        w = router(normed_hidden).view(-1, 1)  # fp32 in [0, 1]
        run = (w > CONSTANTS.router_run_threshold) | ~valid
        return LayerRoute(run, self._weights(w, run, valid).to(normed_hidden.dtype))

    def _weights(self, w: torch.Tensor, run: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class FlexiDepthGate(_TrainedGate):
    name = "flexidepth"
    decision = "router_weight_above_half"

    def __init__(self, skip_ratio: float = 0.5) -> None:
        super().__init__(skip_ratio)

    def _weights(self, w, run, valid):
        return torch.where(valid, torch.where(run, w, 1.0 - w), torch.ones_like(w))


class HardGate(_TrainedGate):
    name = "qwen3_hard_gate"
    decision = "straight_through_hard_gate"

    def __init__(self, skip_ratio: float = 0.25) -> None:
        super().__init__(skip_ratio)

    def _weights(self, w, run, valid):
        return torch.ones_like(w)
