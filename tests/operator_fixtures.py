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


def mixed_pool() -> list[dict]:
    """Two A100 nodes (one time-sliced), one H100 node, one unknown GPU node and a CPU node."""
    return [node("a100-0", A100), node("a100-1", A100 + "-SHARED"), node("h100-0", H100),
            node("proto-0", UNKNOWN), node("cpu-0", None)]
