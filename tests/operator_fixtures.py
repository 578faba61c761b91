"""Shared builders for the operator tests: SkipperDeployment resources and GPU nodes as the API returns them."""

from __future__ import annotations

import copy

A100 = "NVIDIA-A100-SXM4-80GB"
H100 = "NVIDIA-H100-80GB-HBM3"
UNKNOWN = "NVIDIA-GB300-PROTO"

BASE_SPEC = {
    "model": {"path": "/models/flexidepth-llama-3-8b", "preset": "llama-3-8b"},
    "skipper": {"name": "flexidepth", "params": {"skip_ratio": 0.5}},
    "serving": {"image": "ghcr.io/vskipper/vskipper-runtime:0.1.0"},
    "replicas": 2,
}


def resource(name: str = "llama", namespace: str = "llm", uid: str | None = None, **spec_changes) -> dict:
    spec = copy.deepcopy(BASE_SPEC)
    for key, value in spec_changes.items():
        spec[key] = value
    meta = {"name": name, "namespace": namespace}
    if uid:
        meta["uid"] = uid
    return {"apiVersion": "vskipper.io/v1alpha1", "kind": "SkipperDeployment", "metadata": meta, "spec": spec}


def node(name: str, product: str | None, **labels) -> dict:
    all_labels = dict(labels)
    if product:
        all_labels["nvidia.com/gpu.product"] = product
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": all_labels}}


def mig_mixed_node(name: str, card: str, slices: dict[str, int], whole: int = 0, **labels) -> dict:
    """A node as GPU Feature Discovery and the device plugin present it under MIG's `mixed` strategy: the card's
    own name stays in nvidia.com/gpu.product (its count is every card, partitioned or not), each slice type gets
    its own `nvidia.com/mig-<profile>.*` labels, and the allocatable resources are the cards left whole
    (`nvidia.com/gpu`) and each slice type's `nvidia.com/mig-<profile>`. Memory figures are the A100-80GB's."""
    memory = {"1g.10gb": 9728, "2g.20gb": 19968, "3g.40gb": 40192, "7g.80gb": 80896}
    cards = whole + (1 if slices else 0)
    all_labels = {"nvidia.com/mig.strategy": "mixed", "nvidia.com/gpu.count": str(cards),
                  "nvidia.com/gpu.replicas": "1" if whole else "0", **labels}
    allocatable = {"nvidia.com/gpu": str(whole)}
    for profile, count in slices.items():
        resource = f"nvidia.com/mig-{profile}"
        all_labels.update({f"{resource}.product": f"{card}-MIG-{profile}", f"{resource}.count": str(count),
                           f"{resource}.memory": str(memory.get(profile, 0)), f"{resource}.replicas": "1"})
        allocatable[resource] = str(count)
    doc = node(name, card, **all_labels)
    doc["status"] = {"capacity": dict(allocatable), "allocatable": allocatable}
    return doc


def mixed_pool() -> list[dict]:
    """Two A100 nodes (one time-sliced), one H100 node, one unknown GPU node and a CPU node."""
    return [node("a100-0", A100), node("a100-1", A100 + "-SHARED"), node("h100-0", H100),
            node("proto-0", UNKNOWN), node("cpu-0", None)]
