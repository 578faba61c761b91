"""Static, model-owned buffers holding one pass's per-row plan, written before the forward.

A captured decode graph reads its inputs from fixed addresses. The per-row plan of a routed pass is written into
these buffers on the host side of the pass, before the forward (or a graph replay) starts, and the forward reads
only views of them:

  req_rows      int64 [C]  each row's request slot (SGLang's req_to_token row)
  request_keys  int64 [C]  each row's stable request key (RandomSkip hashes it with the position)
  dense_rows    bool  [C]  rows of dense-mode requests in a routed pass (they RUN with unit weight)
  valid         bool  [C]  True for the pass's rows, False for padding up to the capacity

Rows past the pass's row count are padding: request slot 0, key 0, dense (RUN), not valid. Writing never
reallocates within the capacity; a pass larger than the capacity (an eager prefill) grows the buffers first (to
at least twice the capacity), which is refused once the buffers are `frozen` (a graph holds their addresses).

The four fields are views of one byte tensor on the device (`storage`: the int64 fields first, so every view is
aligned). Off the host a pass's plan is staged in a host copy of that tensor (pinned on CUDA) and reaches the
device in one non-blocking copy of the whole tensor; on the host the fields are written in place. Either way only
what changed is written: the pass's rows, and the padding of rows the previous write used that this one does
not. A pass that hands the very tensors of the last write's request keys and dense-mode rows over as many rows
(a decode batch whose requests did not change: the runtime keeps its host tensors until they do, and never
writes them in place) rewrites only its request slots: on the host one copy, off it (where the slots are on the
device, as a decode batch's are) no staging and no host-to-device copy. Two staging tensors take turns, and one
is written again only once its copy has left it (a CUDA event). A field handed over on the device (a replayed
graph's request slots, SGLang's) is copied into its view after the staged copy, on the same stream.

Only a replayed graph needs the request slots at a fixed address. A write without them (`req_rows` None) is for
a pass that reads SGLang's slots where they already lie on the device (an eager one): that field is left
unspecified over its rows, and a standing plan then costs no copy at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np
import torch

# (field, dtype, padding), in storage order: the 8-byte fields first, so each field's offset is a multiple of its
# element size.
FIELDS = (("req_rows", torch.int64, 0), ("request_keys", torch.int64, 0), ("dense_rows", torch.bool, True),
          ("valid", torch.bool, False))
STAGES = 2  # staging tensors taking turns off the host


def expand_rows(values: Sequence | np.ndarray, counts: Sequence[int], rows: int) -> torch.Tensor:
    """Each request's value in `values` repeated over its `counts` rows: a host tensor [rows] (a prefill pass's
    per-row plan from its requests'). One numpy repeat: on the host a fraction of `torch.repeat_interleave`'s
    cost per call, and no intermediate tensors."""
    out = np.repeat(np.asarray(values), counts)
    if out.shape[0] != rows:
        raise ValueError(f"the requests' rows sum to {out.shape[0]}, the pass has {rows}")
    return torch.from_numpy(out)


def _field_views(storage: torch.Tensor, capacity: int) -> dict[str, torch.Tensor]:
    views, offset = {}, 0
    for name, dtype, _ in FIELDS:
        size = capacity * dtype.itemsize
        views[name] = storage[offset:offset + size].view(dtype)
        offset += size
    return views


class _Stage:
    """A host tensor laid out as the device storage, its field views, how many rows its last write used, and how
    many leading rows of its dense-mode field are False (a pass without dense-mode rows rewrites none of them)."""

    def __init__(self, storage: torch.Tensor, capacity: int) -> None:
        self.storage = storage
        self.fields = _field_views(storage, capacity)
        self.rows = 0
        self.clear = 0  # dense_rows[:clear] is False
        self.event = None  # CUDA: recorded after the copy out of this stage
        for name, _, pad in FIELDS:
            self.fields[name].fill_(pad)

    def write(self, rows: int, values: dict[str, torch.Tensor | None]) -> None:
        """The fields in `values` (None: dense_rows all False) over the first `rows` rows, and the padding."""
        f = self.fields
        for name, value in values.items():
            if value is not None:
                f[name][:rows].copy_(value)
                if name == "dense_rows":
                    self.clear = 0
            elif name == "dense_rows" and self.clear < rows:
                f[name][self.clear:rows].fill_(False)
                self.clear = rows
        if rows > self.rows:
            f["valid"][self.rows:rows].fill_(True)
        elif rows < self.rows:  # rows the previous write used become padding again
            for name, _, pad in FIELDS:
                f[name][rows:self.rows].fill_(pad)
            self.clear = min(self.clear, rows)
        self.rows = rows


class PlanBuffers:
    def __init__(self, capacity: int, device: str | torch.device = "cpu", staged: bool | None = None) -> None:
        """`staged` (default: off the host) writes through host staging tensors and one copy per pass."""
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.device = torch.device(device)
        self.staged = self.device.type != "cpu" if staged is None else staged
        self.frozen = False
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        nbytes = capacity * sum(dtype.itemsize for _, dtype, _ in FIELDS)
        self.storage = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        fields = _field_views(self.storage, capacity)
        self.req_rows, self.request_keys = fields["req_rows"], fields["request_keys"]
        self.dense_rows, self.valid = fields["dense_rows"], fields["valid"]
        if self.staged:
            pin = self.device.type == "cuda"
            self._stages = [_Stage(torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin), capacity)
                            for _ in range(STAGES)]
            for name, _, pad in FIELDS:  # the device's padding, as the stages hold it (no copy from the host)
                fields[name].fill_(pad)
        else:
            self._stages = [_Stage(self.storage, capacity)]
        self._turn = 0
        self._views: dict[int, Mapping[str, torch.Tensor]] = {}
        self.rows = 0
        self._last: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # (keys, dense) last written

    def write(self, req_rows: torch.Tensor | None, request_keys: torch.Tensor,
              dense_rows: torch.Tensor | None = None) -> int:
        """Write a pass's plan (each [rows]; `dense_rows` None: no dense-mode row) and pad the rest. Returns rows.
        `request_keys` and `dense_rows` that are the objects of the last write, over as many rows, are taken as
        unchanged: the caller hands a tensor again only while its values stand. `req_rows` None: the pass
        does not read the buffers' request slots (an eager pass reads its own where they lie, on the buffers'
        device), and they are left unspecified over its rows."""
        rows = request_keys.shape[0]
        for name, t in (("req_rows", req_rows), ("dense_rows", dense_rows)):
            if t is not None and t.shape[0] != rows:
                raise ValueError(f"plan field {name!r} has {t.shape[0]} rows, request_keys has {rows}")
        if rows > self.capacity:
            if self.frozen:
                raise ValueError(f"a pass of {rows} rows exceeds the plan buffers' capacity {self.capacity}, "
                                 "which a captured graph holds")
            self._allocate(max(rows, 2 * self.capacity))  # doubling: a few growths over a server's warm-up
        last_keys, last_dense = self._last
        if rows == self.rows and request_keys is last_keys and dense_rows is last_dense and (
                req_rows is None or not self.staged or req_rows.device.type != "cpu"):
            if req_rows is not None:
                self.req_rows[:rows].copy_(req_rows, non_blocking=self.staged)  # the rest stands as last written
            return rows
        self._last = (None, None)  # until this write is whole
        values = {"request_keys": request_keys, "dense_rows": dense_rows}
        if req_rows is not None:
            values["req_rows"] = req_rows
        if not self.staged:
            self._stages[0].write(rows, values)
            self.rows, self._last = rows, (request_keys, dense_rows)
            return rows
        stage = self._stages[self._turn]
        self._turn = (self._turn + 1) % len(self._stages)
        if stage.event is not None:
            stage.event.synchronize()  # its previous copy has left it (long since, unless the device lags)
        on_device = {name: v for name, v in values.items() if v is not None and v.device.type != "cpu"}
        stage.write(rows, {name: v for name, v in values.items() if name not in on_device})
        self.storage.copy_(stage.storage, non_blocking=True)
        if self.device.type == "cuda":
            stage.event = stage.event or torch.cuda.Event()
            stage.event.record()
        for name, value in on_device.items():  # after the staged copy, which wrote their padding
            getattr(self, name)[:rows].copy_(value, non_blocking=True)
        self.rows, self._last = rows, (request_keys, dense_rows)
        return rows

    def views(self, rows: int | None = None) -> Mapping[str, torch.Tensor]:
        """Views (no copy) of the first `rows` rows (default: the last pass's), by field: one read-only mapping
        per row count, kept (every routed pass asks for it)."""
        rows = self.rows if rows is None else rows
        views = self._views.get(rows)
        if views is None:
            views = self._views[rows] = MappingProxyType({
                "req_rows": self.req_rows[:rows], "request_keys": self.request_keys[:rows],
                "dense_rows": self.dense_rows[:rows], "valid": self.valid[:rows]})
        return views
