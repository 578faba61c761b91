"""StaticDepth: every valid row projects at a fixed tail of the routed layers (a static layer subset)."""

from __future__ import annotations

from typing import Any

import torch

from vskipper.skippers.base import BatchContext, LayerRoute, Skipper, unit_route
from vskipper.skippers.registry import tail_count


def tail_layers(routed_layers: tuple[int, ...], ratio: float) -> frozenset[int]:
    take = tail_count(len(routed_layers), ratio)
    return frozenset(routed_layers[len(routed_layers) - take:])


class StaticDepth(Skipper):
    name = "static_depth"
    decision = "static_tail_fraction"

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    def parameters(self) -> dict[str, Any]:
        return {"ratio": self.ratio}

    def prepare_batch(self, batch: BatchContext) -> dict[str, Any]:
        valid = batch.valid_rows.view(-1)
        dtype = batch.hidden_states.dtype
        # Both routes are built once per forward; `route` only picks one, with no per-layer allocation.
        return {
            "tail": tail_layers(batch.routed_layers, self.ratio),
            "project": unit_route(valid, valid, dtype),
            "run": unit_route(valid, torch.zeros_like(valid), dtype),
        }

    def route(self, layer_id: int, normed_hidden: torch.Tensor, state: dict[str, Any],
              router: torch.nn.Module | None = None) -> LayerRoute:
        return state["project"] if layer_id in state["tail"] else state["run"]
