"""A routed layer's Triton launches compiled before it serves.

Triton compiles a kernel once per compiled variant (its switches and block sizes, and how its arguments specialize),
at the variant's first launch. A served routed layer's triton execution picks its GEMM tiles by the pass's rows
(`vskipper.mixed.tiles.COUNT_RANGES`: a prefill pass's ranges from 513 rows), so the first routed pass of each size
range would compile its GEMMs while serving, holding every pass behind it (the cohort maps, whose block the pass
once sized, took 1.3-1.7 s a compilation on the H200; SGLang's log warns of each). `warm_routed_layer` runs the
routed body (`routed_layer`, the triton execution) once at a pass size in each range of the tiles it serves with,
over a layer's own weights, before the server serves. Its attention is stood in for (`WarmOps`: no K/V is written,
no read runs), since that needs the engine's KV pool: the reads are the engine's kernels or launched at shapes that
do not depend on the pass's range (the masked decode read compiles when decode graphs are captured); the packed
prefill read is not warmed.

The body's arguments are laid out as a served pass lays them out: the route recorded into a tape and the cohort maps
built from it (`CohortBuilder.record_and_build`), the tape's rows 16-byte aligned, fresh contiguous activations.
Each launch then keys the variant a served pass of that range keys (`tests/test_sglang_model_replay.py` checks that
every launch of a served pass is one the build made).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from vskipper.mixed.cohorts import CohortBuilder
from vskipper.mixed.routed_layer import routed_layer
from vskipper.mixed.tape import RouteTape, tape_capacity
from vskipper.mixed.tiles import COUNT_RANGES, TileTable
from vskipper.roofline import find_device
from vskipper.skippers.base import LayerRoute


@dataclass
class WarmOps:
    """`LayerOps` over a routed layer's weights with its attention stood in for: K/V of the pass's shapes, written
    nowhere, and a read that returns zeros of the shape a served read returns ([cohort slots, Q columns], or
    [batch rows, Q columns] where it reads every batch row; contiguous)."""

    attention: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]  # (Q rows, their bias, o_proj's weight)
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (gate rows, up rows, down)
    projector: nn.Module  # gate_proj, up_proj, down_proj
    post_attention_layernorm: nn.Module
    kv_columns: int
    reads_every_query: bool  # as the served layer's read (through the engine's backend: every batch row's query)

    def attention_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        return self.attention

    def mlp_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.mlp

    def projector_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.projector
        return p.gate_proj.weight, p.down_proj.weight, p.up_proj.weight

    def batch_q_kv(self, u: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k = torch.empty(u.shape[0], self.kv_columns, dtype=u.dtype, device=u.device)
        return q, k, torch.empty_like(k)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        pass

    def read_cohort(self, q: torch.Tensor, rows: torch.Tensor, reads: torch.Tensor) -> torch.Tensor:
        # a read of every batch row leaves its outputs in batch rows, the others' in the cohort's packed slots
        return torch.zeros(q.shape[0] if self.reads_every_query else rows.shape[0], q.shape[1], dtype=q.dtype,
                           device=q.device)


def warm_rows(tiles: Any, device: torch.device | str) -> tuple[int, ...]:
    """The pass sizes a warm-up runs: the first count of every range of `COUNT_RANGES` where the GEMMs are tiled by
    a table (a tile and a form per range), one pass where every count takes the same tile (the interpreter's).
    A table for a catalogued device serves an operation the table measured cuBLAS faster for in the gathered form
    up to the device's ridge and in its tile above it (`TileTable.gathers`): where the ridge falls inside a range,
    the first pass past it is warmed too, so that the range's tile compiles before serving as its form does."""
    if not (isinstance(tiles, TileTable) or (tiles is None and torch.device(device).type == "cuda")):
        return (1,)
    rows = [lo for lo, _ in COUNT_RANGES]
    catalogued = find_device(tiles.device) if isinstance(tiles, TileTable) else None
    if catalogued is not None:
        past = int(catalogued.ridge_rows) + 1  # an eager pass's cohort maps hold its rows: its capacity
        if any(lo < past and (hi is None or past <= hi) for lo, hi in COUNT_RANGES):
            rows.append(past)
    return tuple(sorted(set(rows)))


def warm_routed_layer(ops: WarmOps, hidden: int, dtype: torch.dtype, device: torch.device | str, tiles: Any,
                      rows: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Run the routed body's triton execution once at each pass size of `rows` (`warm_rows` where None), half of
    its rows RUN, over `ops`' weights: every Triton launch a served pass of that size range makes is compiled by
    it. The cohort maps (one variant for every size) are built with dense-mode rows and without. Where the prefill
    reads every batch row (`reads_every_query`), a pass of every size runs in both forms, since a decode pass of
    that size reads its cohort's slots (o_proj's operand packed, another variant). Returns the sizes run."""
    rows = warm_rows(tiles, device) if rows is None else rows
    forms = (replace(ops, reads_every_query=False), ops) if ops.reads_every_query else (ops,)
    for i, (n, form) in enumerate(itertools.product(rows, forms)):
        capacity = tape_capacity(n)
        tape, builder = RouteTape(capacity, (0,), dtype, device), CohortBuilder(capacity, device)
        tape.pad(n)
        run = (torch.arange(n, device=device) % 2 == 0).view(-1, 1)
        route = LayerRoute(run, torch.ones(n, 1, dtype=dtype, device=device))
        if i == 0:  # the maps' other variant: a pass with dense-mode rows (none here)
            builder.record_and_build(tape, 0, route, torch.zeros(n, dtype=torch.bool, device=device))
        cohorts = builder.record_and_build(tape, 0, route)
        run_row, weights = tape.layer(0, n)
        x = torch.zeros(n, hidden, dtype=dtype, device=device)
        routed_layer(form, x, torch.zeros_like(x), run_row, weights, "triton", cohorts, tiles, x_owned=True)
    return rows
