"""The skipper interface: a policy that says, per row and per routed layer, RUN or PROJECT_ONLY.

A skipper never executes either branch. Once per forward pass the runtime calls `prepare_batch` with the batch's
rows; then, at each routed layer, `route` returns that layer's `LayerRoute`:

  run_mask  bool  [rows, 1]  True: the row runs the layer (attention + MLP); False: Project-Only
  weights   dtype [rows, 1]  the multiplier of the branch the row takes (RUN: the MLP output;
                             Project-Only: the projector output), in the hidden states' dtype

Both live on the hidden states' device and are produced with tensor ops only: no `.item()`, no host branching on
tensor values, so a captured decode graph can replay them with new routes. (On CPU, where nothing is captured, a
skipper may compute them with numpy over the tensors' memory: RandomSkip does.) Padding rows (valid_rows False)
always RUN with unit weight. Whatever a route says, the runtime still writes every valid row's own K/V at every
layer (Invariant 1); that is the runtime's job, not the skipper's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vskipper.skippers.registry import FLEXIDEPTH_ADAPTER, WHOLE_LAYER_ACTIONS, Action


@dataclass
class BatchContext:
    """What a skipper may look at when a forward pass starts."""

    hidden_states: torch.Tensor  # [rows, hidden]: gives rows, device and dtype
    valid_rows: torch.Tensor  # bool [rows]: False for padding rows of a captured graph
    routed_layers: tuple[int, ...]  # the engine's routed layer ids, in execution order
    phase: str  # "prefill" or "decode"
    request_keys: torch.Tensor | None = None  # int64 [rows]: a stable per-request key (same for all its rows)
    positions: torch.Tensor | None = None  # int64 [rows]: each row's token position in its request

    @property
    def rows(self) -> int:
        return self.hidden_states.shape[0]


@dataclass
class LayerRoute:
    run_mask: torch.Tensor  # bool [rows, 1]
    weights: torch.Tensor  # hidden dtype [rows, 1]


class Skipper(ABC):
    name: ClassVar[str]
    supported_actions: ClassVar[frozenset[Action]] = WHOLE_LAYER_ACTIONS
    requires_router_weights: ClassVar[bool] = False
    projector_kind: ClassVar[str] = FLEXIDEPTH_ADAPTER
    decision: ClassVar[str] = ""  # a short name for how rows are chosen (attested)

    @abstractmethod
    def prepare_batch(self, batch: BatchContext) -> Any:
        """Per-forward state, computed once; passed back to every `route` call of the same forward."""

    @abstractmethod
    def route(self, layer_id: int, normed_hidden: torch.Tensor, state: Any,
              router: torch.nn.Module | None = None) -> LayerRoute:
        """The routes of one routed layer. `normed_hidden` is the layer's input after its input RMSNorm;
        `router` is that layer's router module when `requires_router_weights`."""

    def parameters(self) -> dict[str, Any]:
        return {}

    def attestation(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "decision": self.decision,
            "parameters": self.parameters(),
            "supported_actions": sorted(a.value for a in self.supported_actions),
            "requires_router_weights": self.requires_router_weights,
            "projector_kind": self.projector_kind,
        }


def unit_route(valid_rows: torch.Tensor, project: torch.Tensor, dtype: torch.dtype) -> LayerRoute:
    """A binary route with unit branch weights; padding rows RUN whatever `project` says."""
    run = ~(project & valid_rows)
    weights = torch.ones(run.shape, dtype=dtype, device=run.device)
    return LayerRoute(run.view(-1, 1), weights.view(-1, 1))
