"""The route tape: each routed layer's run mask and branch weights, in device buffers sized for a capacity C.

A skipper's `LayerRoute` for layer l is copied into row l of two preallocated buffers with tensor ops:

  run      bool  [L_r, C]   True: the row runs the layer; False: Project-Only
  weights  dtype [L_r, C]   the multiplier of the branch the row takes (MLP on RUN, projector on Project-Only)

Rows past the batch's row count hold RUN with unit weight (the padding convention of the skipper interface):
`pad(rows)` writes them for every layer at once, once per pass (two fills, where padding each layer's record took
two a layer). Recording never reads a tensor value on the host and never reallocates, so a decode graph captured at
capacity C replays with whatever routes the skipper writes at the next step; the cohort maps read the tape
as data (`vskipper.mixed.cohorts`). The triton execution records a layer's route in the launch that builds its
cohort maps (`CohortBuilder.record_and_build`): the same rows written, no copy launched of their own.

  counts   int64 [L_r, 2]  each layer's (RUN, Project-Only) rows in its last pass, where that launch wrote them

A pass's decisions are counted from the tape after its forward: `run_counts` reduces the run mask (one launch),
while the triton execution's maps launches have already written `counts` (inside a replayed graph too), so its
passes are counted from it with no launch of their own (every other value from the second: Project-Only rows;
a replayed graph's maps also cover its padding rows, which RUN, so these are the pass's own).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vskipper.skippers.base import LayerRoute

MIN_CAPACITY = 64


def tape_capacity(rows: int) -> int:
    """A tape (and cohort builder) capacity for passes of `rows` rows: at least MIN_CAPACITY, a multiple of 16, so
    every layer's row of the tape starts 16-byte aligned, as the kernels reading it are compiled to expect
    (Triton marks an aligned pointer divisible; `python -m vskipper.mixed.compile_check`)."""
    return max(MIN_CAPACITY, -(-rows // 16) * 16)


class RouteTape:
    def __init__(self, capacity: int, routed_layers: Sequence[int], dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        if not routed_layers:
            raise ValueError("routed_layers must name at least one layer")
        self.capacity = capacity
        self.routed_layers = tuple(int(layer) for layer in routed_layers)
        self._slot = {layer: j for j, layer in enumerate(self.routed_layers)}
        self.run = torch.ones(len(self.routed_layers), capacity, dtype=torch.bool, device=device)
        self.weights = torch.ones(len(self.routed_layers), capacity, dtype=dtype, device=device)
        # Each layer's (n_run, n_proj) as the cohort maps store them: a layer's pair 16-byte aligned, as the
        # builder's own (the kernels reading the counts are compiled for that alignment).
        self.counts = torch.zeros(len(self.routed_layers), 2, dtype=torch.int64, device=device)
        self._count_views: dict[int, torch.Tensor] = {}
        # each layer's row views for the pass's row count (`views`), kept while passes keep the size
        self._views_for: tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = (0, {})
        self._pad_for: tuple[int, torch.Tensor | None, torch.Tensor | None] = (-1, None, None)  # `pad`'s views

    def slot(self, layer_id: int) -> int:
        try:
            return self._slot[layer_id]
        except KeyError:
            raise KeyError(f"layer {layer_id} is not a routed layer of this tape "
                           f"(routed layers: {list(self.routed_layers)})") from None

    def record(self, layer_id: int, route: LayerRoute, dense_rows: torch.Tensor | None = None) -> None:
        """Copy one layer's route over its first rows in place (the rows past them: `pad`). The row count is a
        shape, never a tensor value.

        `dense_rows` (bool [rows]) marks rows of dense-mode requests in a mixed-mode batch: they RUN with unit
        weight whatever the skipper said, so they compute exactly what the dense forward computes."""
        j, run, weights = self.checked(layer_id, route)
        rows = run.shape[0]
        if dense_rows is not None:
            run = run | dense_rows
            weights = torch.where(dense_rows, torch.ones((), dtype=weights.dtype, device=weights.device), weights)
        tape_run, tape_weights, _ = self.views(j, rows)
        tape_run.copy_(run)
        tape_weights.copy_(weights)

    def checked(self, layer_id: int, route: LayerRoute, flat: bool = True) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(the layer's tape row, run [rows], weights [rows]) of a route this tape can record: its rows within
        the capacity, as many weights as run flags. The flat views may be strided (no copy). `flat` False: the
        route's own tensors ([rows] or [rows, 1], as a skipper returns them), for a reader that steps through
        them by their first stride (no view made)."""
        j = self.slot(layer_id)
        run, weights = route.run_mask, route.weights
        rows = run.shape[0]
        if rows > self.capacity:
            raise ValueError(f"route of layer {layer_id} has {rows} rows, more than the tape capacity "
                             f"{self.capacity}")
        if weights.shape[0] != rows:
            raise ValueError(f"route of layer {layer_id}: weights have {weights.shape[0]} rows, "
                             f"run_mask has {rows}")
        if flat:
            return j, run.reshape(-1), weights.reshape(-1)
        for name, t in (("run_mask", run), ("weights", weights)):
            if t.shape[1:] not in ((), (1,)):
                raise ValueError(f"route of layer {layer_id}: {name} has shape {tuple(t.shape)}, not [rows] or "
                                 f"[rows, 1]")
        return j, run, weights

    def pad(self, rows: int) -> None:
        """Every layer's rows past `rows`: RUN with unit weight (once per pass, before its layers record)."""
        if rows < self.capacity:
            held, run, weights = self._pad_for
            if held != rows:  # views kept while passes keep their size
                run, weights = self.run[:, rows:], self.weights[:, rows:]
                self._pad_for = (rows, run, weights)
            run.fill_(True)
            weights.fill_(1.0)

    def layer(self, layer_id: int, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (run [rows], weights [rows]) of one layer's tape; no copy."""
        run, weights, _ = self.views(self.slot(layer_id), self.capacity if rows is None else rows)
        return run, weights

    def views(self, j: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(run [rows], weights [rows], counts [2]) of tape row `j`: views made once per row count and kept (the
        tape never reallocates), since a routed layer asks for them at every pass, where making them anew costs
        the host more than the layer's maps launch."""
        held, views = self._views_for
        if held != rows:
            views = {}
            self._views_for = (rows, views)
        row = views.get(j)
        if row is None:
            row = views[j] = (self.run[j, :rows], self.weights[j, :rows], self.counts[j])
        return row

    def run_counts(self, rows: int) -> torch.Tensor:
        """RUN rows per routed layer over the first `rows` rows (dense-mode rows count: they RUN), as a device
        tensor [L_r]; a layer's Project-Only rows are `rows` less its count. For counters: read once per pass
        after the forward, through `DeferredReads`, never by waiting for the device; one reduction, no complement
        of the tape."""
        run = self._count_views.get(rows)
        if run is None:  # a view per row count, kept (the tape never reallocates)
            run = self._count_views[rows] = self.run[:, :rows]
        return run.sum(dim=1)
