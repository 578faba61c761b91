"""Small device tensors read on the host later, without stalling the pass that produced them.

A routed pass's counters come from its tape on the device. Reading them right after the forward (`.tolist()`)
waits for the whole pass to finish on the GPU, and so stops SGLang's scheduler from preparing the next batch while
the GPU runs this one (its overlap), which a dense pass never stops. `DeferredReads` instead enqueues, on the
stream that ran the pass, a copy of the tensor into pinned host memory and an event after it, and hands the value
back once the event has completed: at a later pass, or when a reader needs every value now (`ready(block=True)`).

On CPU there is nothing to wait for: a value is ready when pushed. Values come back in the order they were
pushed, each with the payload pushed with it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch


class DeferredReads:
    """FIFO of device values on their way to the host. `depth` bounds the values in flight: pushing past it waits
    for the oldest (at most `depth` passes behind, so the counters never lag further)."""

    def __init__(self, depth: int = 64) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.depth = depth
        self._pending: deque[tuple[torch.Tensor | list, Any, Any]] = deque()  # (host value, event or None, payload)
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}  # pinned buffers to reuse

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, value: torch.Tensor, payload: Any) -> None:
        """Start reading `value` (a device tensor the current stream is producing)."""
        self._pending.append((*self._start(value.detach() if value.requires_grad else value), payload))

    def _start(self, value: torch.Tensor) -> tuple[torch.Tensor | list, Any]:
        """Enqueue the copy of `value` to the host: (host tensor, the event after the copy), or off CUDA (value,
        None): its values as a list, read now (nothing to wait for)."""
        if value.device.type != "cuda":
            return (value if value.dim() == 1 else value.reshape(-1)).tolist(), None
        spare = self._free.get((value.numel(), value.dtype))
        host = spare.pop() if spare else torch.empty(value.numel(), dtype=value.dtype, device="cpu", pin_memory=True)
        host.copy_(value.reshape(-1), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def wait_pushed(self) -> None:
        """Wait until the device has copied every value pushed so far, taking none of them: a reader on another
        thread waits here, outside the lock its `ready` needs, so that the thread pushing never waits on the device
        behind it. Only reads the queue (a snapshot, which the pushing thread's appends and pops leave whole)."""
        for _, event, _ in list(self._pending):
            if event is not None:
                event.synchronize()

    def ready(self, block: bool = False) -> Iterator[tuple[list, Any]]:
        """(value as a list, payload) for each value the device has copied, oldest first; with `block`, every
        pending value (waiting for each). Values past `depth` are waited for whatever `block` says."""
        while self._pending:
            host, event, payload = self._pending[0]
            if event is not None and not event.query():
                if not block and len(self._pending) <= self.depth:
                    return
                event.synchronize()
            self._pending.popleft()
            if event is None:  # read when pushed
                yield host, payload
                continue
            values = host.tolist()
            self._free.setdefault((host.numel(), host.dtype), []).append(host)
            yield values, payload
