"""Which passes may replay a captured graph, and how many did, per phase and mode.

A replayed graph never calls the model's Python forward: it runs whatever the graph captured. SGLang captures
the dense model, so a routed pass must never replay it. Before SGLang's graph runner answers whether it can run
a pass (`can_run_graph`), the pass has been planned (`vskipper.sglang.models.routed`, before the forward): the
veto answers no for a routed pass of a phase without a captured routed variant, and the pass runs eagerly. After
the forward, SGLang's own report of whether it replayed (`ModelRunnerOutput.can_run_graph`) is counted; a routed
pass that replayed a dense graph all the same is an error, never a count.

Pure Python (no torch, no SGLang).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PHASES = ("prefill", "decode")
MODES = ("dense", "routed")


class RoutedReplayError(RuntimeError):
    """A routed pass replayed a captured graph that holds no routed variant."""


class ReplayLedger:
    """The replay veto and the per-phase, per-mode counts of passes replayed from a graph and passes run eagerly.

    `routed_graphs[phase]`: whether a routed variant of that phase's graphs was captured (decode, once SGLang's
    decode graph runner captured the model's variants; where none was, routed passes run eagerly). The counts' keys are fixed at construction; only their values change, so a reader on
    another thread (the state writer) never sees the mapping change size."""

    def __init__(self, routed_graphs: Mapping[str, bool] | None = None) -> None:
        self.routed_graphs = {phase: bool((routed_graphs or {}).get(phase, False)) for phase in PHASES}
        self.passes = {phase: {mode: {"replayed": 0, "eager": 0} for mode in MODES} for phase in PHASES}
        self.vetoed = {phase: 0 for phase in PHASES}

    def allows_replay(self, phase: str, routed: bool) -> bool:
        """Whether a pass of `phase` may replay a captured graph: a dense pass may; a routed pass only where a
        routed variant is captured."""
        return not routed or self.routed_graphs[_phase(phase)]

    def veto(self, phase: str, routed: bool, graph_can_run: bool) -> bool:
        """The graph runner's answer after the veto: `graph_can_run` (SGLang's own answer) unless the pass may
        not replay, which is counted."""
        if graph_can_run and not self.allows_replay(phase, routed):
            self.vetoed[_phase(phase)] += 1
            return False
        return graph_can_run

    def record(self, phase: str, routed: bool, replayed: bool) -> None:
        """Count one pass of `phase` after its forward; `replayed` is SGLang's report that it ran a graph."""
        phase = _phase(phase)
        if replayed and not self.allows_replay(phase, routed):
            raise RoutedReplayError(f"a routed {phase} pass replayed a captured graph, which holds the dense model "
                                    f"only: its routes never ran (--cuda-graph-backend-{phase} must be disabled "
                                    "for an arm that routes it)")
        self.passes[phase]["routed" if routed else "dense"]["replayed" if replayed else "eager"] += 1

    def attestation(self) -> dict[str, Any]:
        return {"passes_total": {p: {m: dict(c) for m, c in modes.items()} for p, modes in self.passes.items()},
                "routed_replays_vetoed_total": dict(self.vetoed),
                "routed_graph_variants": dict(self.routed_graphs)}


def _phase(phase: str) -> str:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    return phase
