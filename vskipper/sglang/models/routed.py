"""What the skipper model classes share: the per-pass step slot and the router/adapter weight loading.

(No `EntryClass`: SGLang's registry imports this module and registers nothing from it.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from vskipper.sglang.runtime import Step

ROUTER_MARKERS = (".router.", ".router_proj.")


class StepSlot:
    """The current forward pass's `Step`, set by the model around its forward and read by its routed layers."""

    def __init__(self) -> None:
        self.step: Step | None = None
        self.runtime = None


def is_router_tensor(name: str) -> bool:
    return any(m in name for m in ROUTER_MARKERS)


def split_router_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Load the router/adapter tensors by their checkpoint names; pass every other tensor through.

    Upstream loaders would mangle them (`router_proj.gate_proj` looks like a stacked MLP shard), so they never
    reach them."""
    params = dict(model.named_parameters())
    for name, tensor in weights:
        if not is_router_tensor(name):
            yield name, tensor
            continue
        param = params.get(name)
        if param is None:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter: its layer is not in 'routing_layers'")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(name)


def check_router_weights(model: torch.nn.Module, loaded: set[str]) -> None:
    missing = sorted(n for n, _ in model.named_parameters() if is_router_tensor(n) and n not in loaded)
    if missing:
        raise KeyError(f"checkpoint lacks router/adapter tensor {missing[0]!r} ({len(missing)} missing)")


class RouterWeightsMixin:
    """For a skipper model class placed before its SGLang base: the router/adapter tensors are taken out of
    the checkpoint stream by their real names (upstream's loader would read `router_proj.gate_proj` as an
    MLP shard), the rest goes to upstream's loader, and a missing router tensor is an error naming it."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        loaded: set[str] = set()
        result = super().load_weights(split_router_weights(self, weights, loaded))
        check_router_weights(self, loaded)
        return result
