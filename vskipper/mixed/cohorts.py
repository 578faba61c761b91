"""Cohort maps: from one layer's run mask, the packed index maps of its RUN and Project-Only rows.

For a run mask over `rows` batch rows, `CohortBuilder.build` writes, on the mask's device and with no host read:

  run_idx   int64 [rows]   run_idx[m]  = the batch row of RUN cohort position m,          m < n_run
  proj_idx  int64 [rows]   proj_idx[m] = the batch row of Project-Only cohort position m, m < n_proj
  n_run     int64 [1]      RUN rows (a device scalar)
  n_proj    int64 [1]      Project-Only rows; n_run + n_proj = rows

Cohort order is batch order (a stable compaction by prefix sums). Entries at and past a count are 0, a valid
row, so a gather there is harmless; every consumer bounds its work by the count anyway.

  live      bool  [rows]   m < n_run: the RUN cohort's packed slots that hold a row

`build(run_mask, fused=True)` writes the same maps with one Triton launch (`vskipper.mixed.kernels.cohort_maps`,
the triton execution's: about nine small kernels fewer per routed layer).

`record_and_build(tape, layer_id, route, dense_rows)` is `tape.record` followed by the fused build over the
recorded row, in that one launch: the skipper's route read once, the tape's row and the maps written from it,
and the counts into the layer's row of the tape's `counts` (the pass is counted from them, no launch of its own).

Invariant 2: these maps are derived from the current tape and the current row set at every routed layer of
every step. Nothing route-dependent is cached: the builder keeps only route-independent buffers (row numbers,
output storage) that each build overwrites in full.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vskipper.mixed.tape import RouteTape
from vskipper.skippers.base import LayerRoute


@dataclass(frozen=True)
class Cohorts:
    run_idx: torch.Tensor
    proj_idx: torch.Tensor
    n_run: torch.Tensor
    n_proj: torch.Tensor
    live: torch.Tensor

    @property
    def rows(self) -> int:
        return self.run_idx.shape[0]

    def host_counts(self) -> tuple[int, int]:
        """(n_run, n_proj) on the host. Free on CPU; on a GPU it synchronizes (prefill and tests only)."""
        return int(self.n_run), int(self.n_proj)


class CohortBuilder:
    def __init__(self, capacity: int, device: str | torch.device = "cpu") -> None:
        self.capacity = capacity
        self._rows = torch.arange(capacity + 1, dtype=torch.int64, device=device)
        self._run = torch.zeros(capacity + 1, dtype=torch.int64, device=device)
        self._proj = torch.zeros(capacity + 1, dtype=torch.int64, device=device)
        self._counts = torch.zeros(2, dtype=torch.int64, device=device)  # the fused build's (n_run, n_proj)
        self._live = torch.zeros(capacity, dtype=torch.bool, device=device)
        # The fused builds' maps for the pass's row count, by the counts they read (`_fused`): one set of views a
        # layer, made at a pass's first build of that size and kept while its passes keep the size.
        self._fused_for: tuple[int, dict[int, Cohorts]] = (0, {})

    def _check(self, rows: int) -> None:
        if rows > self.capacity:
            raise ValueError(f"{rows} rows exceed the cohort capacity {self.capacity}")
        if rows == 0:
            raise ValueError("a routed layer needs at least one row")

    def _fused(self, rows: int, counts: torch.Tensor) -> Cohorts:
        """The maps the fused launch (`kernels.cohort_maps`) wrote for a pass of `rows` rows, with the counts it
        stored in `counts` (int64 [2]): views of the builder's storage and of `counts`, made once per row count and
        counts (a routed layer's views cost the host more than its maps' launch; the storage never moves)."""
        held, views = self._fused_for
        if held != rows:
            views = {}
            self._fused_for = (rows, views)
        key = counts.data_ptr()
        cohorts = views.get(key)
        if cohorts is None:
            cohorts = views[key] = Cohorts(self._run[:rows], self._proj[:rows], counts[0:1], counts[1:2],
                                           self._live[:rows])
        return cohorts

    def build(self, run_mask: torch.Tensor, fused: bool = False) -> Cohorts:
        run = run_mask.reshape(-1)
        rows = run.shape[0]
        self._check(rows)
        if fused:
            from vskipper.mixed.kernels import cohort_maps

            cohort_maps(run.contiguous(), self._run, self._proj, self._counts, self._live)
            return self._fused(rows, self._counts)
        run64 = run.to(torch.int64)
        ends_run = torch.cumsum(run64, 0)
        ends_proj = self._rows[1 : rows + 1] - ends_run
        dump = self._rows[rows]  # one slot past the rows: where the other cohort's rows land, then dropped
        to_run = torch.where(run, ends_run - 1, dump)
        to_proj = torch.where(run, dump, ends_proj - 1)
        row_ids = self._rows[:rows]
        self._run.zero_().scatter_(0, to_run, row_ids)
        self._proj.zero_().scatter_(0, to_proj, row_ids)
        n_run = ends_run[rows - 1 :]
        n_proj = ends_proj[rows - 1 :]
        # The maps are views of the builder's buffers: the next build (the next routed layer) overwrites them.
        return Cohorts(self._run[:rows], self._proj[:rows], n_run, n_proj, row_ids < n_run)

    def record_and_build(self, tape: RouteTape, layer_id: int, route: LayerRoute,
                         dense_rows: torch.Tensor | None = None) -> Cohorts:
        """`tape.record(layer_id, route, dense_rows)`, then `build(<the recorded run>, fused=True)`, in one Triton
        launch: the tape's row holds what `record` writes (dense-mode rows RUN with unit weight), the maps are
        those of that row."""
        j, run, weights = tape.checked(layer_id, route, flat=False)  # the launch steps by each one's first stride
        rows = run.shape[0]
        self._check(rows)
        if dense_rows is not None and dense_rows.shape != (rows,):
            raise ValueError(f"dense_rows has shape {tuple(dense_rows.shape)}, the route {rows} rows")
        from vskipper.mixed.kernels import cohort_maps

        # the layer's row of the tape, and its counts, which stay on the tape: the pass is counted from them
        tape_run, tape_weights, counts = tape.views(j, rows)
        cohort_maps(run, self._run, self._proj, counts, self._live,
                    record=(tape_run, tape_weights, weights,
                            None if dense_rows is None else dense_rows.contiguous()))
        return self._fused(rows, counts)


def build_cohorts(run_mask: torch.Tensor) -> Cohorts:
    """One-off maps with their own storage (tests, prefill)."""
    rows = run_mask.reshape(-1).shape[0]
    c = CohortBuilder(rows, run_mask.device).build(run_mask)
    return Cohorts(c.run_idx.clone(), c.proj_idx.clone(), c.n_run.clone(), c.n_proj.clone(), c.live)

