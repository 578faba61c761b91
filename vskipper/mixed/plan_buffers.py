"""Static, model-owned buffers holding one pass's per-row plan, written before the forward.

A captured decode graph reads its inputs from fixed addresses. The per-row plan of a routed pass is written into
these buffers on the host side of the pass, before the forward (or a graph replay) starts, and the forward reads
only views of them:

  req_rows      int64 [C]  each row's request slot (SGLang's req_to_token row)
  request_keys  int64 [C]  each row's stable request key (RandomSkip hashes it with the position)
  dense_rows    bool  [C]  rows of dense-mode requests in a routed pass (they RUN with unit weight)
  valid         bool  [C]  True for the pass's rows, False for padding up to the capacity

Rows past the pass's row count are padding: request slot 0, key 0, dense (RUN), not valid. Writing never
reallocates within the capacity; a pass larger than the capacity (an eager prefill) grows the buffers first,
which is refused once the buffers are `frozen` (a graph holds their addresses).
"""

from __future__ import annotations

import torch


class PlanBuffers:
    def __init__(self, capacity: int, device: str | torch.device = "cpu") -> None:
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.device = torch.device(device)
        self.frozen = False
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.req_rows = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self.request_keys = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self.dense_rows = torch.ones(capacity, dtype=torch.bool, device=self.device)
        self.valid = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        self.rows = 0

    def write(self, req_rows: torch.Tensor, request_keys: torch.Tensor,
              dense_rows: torch.Tensor | None = None) -> int:
        """Write a pass's plan (each [rows]; `dense_rows` None: no dense-mode row) and pad the rest. Returns rows."""
        rows = req_rows.shape[0]
        for name, t in (("request_keys", request_keys), ("dense_rows", dense_rows)):
            if t is not None and t.shape[0] != rows:
                raise ValueError(f"plan field {name!r} has {t.shape[0]} rows, req_rows has {rows}")
        if rows > self.capacity:
            if self.frozen:
                raise ValueError(f"a pass of {rows} rows exceeds the plan buffers' capacity {self.capacity}, "
                                 "which a captured graph holds")
            self._allocate(rows)
        self.req_rows[:rows].copy_(req_rows, non_blocking=True)
        self.request_keys[:rows].copy_(request_keys, non_blocking=True)
        if dense_rows is None:
            self.dense_rows[:rows].fill_(False)
        else:
            self.dense_rows[:rows].copy_(dense_rows, non_blocking=True)
        self.valid[:rows].fill_(True)
        if rows < self.capacity:
            self.req_rows[rows:].fill_(0)
            self.request_keys[rows:].fill_(0)
            self.dense_rows[rows:].fill_(True)
            self.valid[rows:].fill_(False)
        self.rows = rows
        return rows

    def views(self, rows: int | None = None) -> dict[str, torch.Tensor]:
        """Views (no copy) of the first `rows` rows (default: the last pass's)."""
        rows = self.rows if rows is None else rows
        return {"req_rows": self.req_rows[:rows], "request_keys": self.request_keys[:rows],
                "dense_rows": self.dense_rows[:rows], "valid": self.valid[:rows]}
