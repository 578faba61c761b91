"""Segments of a pass captured as CUDA graphs and replayed, each keyed by the caller (`SegmentGraphs`).

A segment is a function of no arguments that reads only storage the caller keeps at fixed addresses (static
buffers it refills before each replay, weights, a tape that never moves) and returns tensors (alone, or in tuples,
lists, dicts, named tuples and dataclasses). The first call of a key runs the function once eagerly on the capture
stream (what it launches compiles and warms there), then captures it and replays the capture; every later call
replays it. Twice per key the device is read (`SegmentGraphs.check`): the capture's first replay against that eager
run, and the first later replay against the function run eagerly again after it. The outputs a call returns are the
capture's own: the next replay of the same key overwrites them, so the caller consumes them before that. A capture
that fails raises `CaptureFailed` and leaves its work undone: the caller runs the function eagerly.

A segment must give the same outputs when it runs twice over the same inputs (its first call runs it eagerly, then
replays the capture: an update in place of its own inputs would apply twice).

Every segment shares one memory pool. A later capture may reuse what an earlier one freed (its intermediates); the
outputs of each capture are held, so none is ever another's intermediate. Segments must replay on one stream and
consume each output before a segment captured earlier than its producer replays again: the caller's passes replay
them in capture order.

Where no CUDA graph can be captured (CPU), `RerunGraph` stands in: a replay runs the captured function again and
copies its outputs into the capture's. It reads what a graph would where the function closed over tensors (a
per-pass tensor it kept is the capture's, read again whatever it holds now), and not where the function looks an
object up again at each call (an attribute set anew each pass is read anew, where a graph would read the capture's
address): a test over it catches the first kind of mistake, only a device the second.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import torch


def tensors(outputs: Any) -> list[torch.Tensor]:
    """The tensors of a segment's outputs, in order."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, dict):
        return [t for value in outputs.values() for t in tensors(value)]
    if isinstance(outputs, (tuple, list)):
        return [t for value in outputs for t in tensors(value)]
    if dataclasses.is_dataclass(outputs):
        return [t for f in dataclasses.fields(outputs) for t in tensors(getattr(outputs, f.name))]
    return []


def difference(got: Any, want: Any) -> float:
    """The worst difference between two segments' outputs of one structure: per floating tensor its largest
    absolute difference over the larger of its largest value and 1e-6, 1.0 for another tensor that differs
    anywhere (reads the device: a capture's check, not a replay's)."""
    worst = 0.0
    for g, w in zip(tensors(got), tensors(want), strict=True):
        if g.is_floating_point():
            scale = max(float(w.abs().max()) if w.numel() else 0.0, 1e-6)
            worst = max(worst, float((g.float() - w.float()).abs().max()) / scale if g.numel() else 0.0)
        elif not torch.equal(g, w):
            worst = max(worst, 1.0)
    return worst


def snapshot(outputs: Any) -> list[torch.Tensor]:
    """A copy of the tensors of a segment's outputs, in order (a segment may return views of static storage that
    its next run overwrites)."""
    return [t.clone() for t in tensors(outputs)]


def copy_into(held: Any, fresh: Any) -> None:
    """Copy `fresh` outputs into `held` ones of the same structure (tensors in place; other leaves left)."""
    if isinstance(held, torch.Tensor):
        held.copy_(fresh)
    elif isinstance(held, dict):
        for key, value in held.items():
            copy_into(value, fresh[key])
    elif isinstance(held, (tuple, list)):
        for h, f in zip(held, fresh, strict=True):
            copy_into(h, f)
    elif dataclasses.is_dataclass(held):
        for f in dataclasses.fields(held):
            copy_into(getattr(held, f.name), getattr(fresh, f.name))
    # anything else (a number, a set of layers) is the function's own constant: a graph does not write it


class RerunGraph:
    """A stand-in for a CUDA graph where none can be captured (CPU): the capture runs the function, a replay
    runs it again and copies its outputs into the capture's."""

    def __init__(self) -> None:
        self.fn: Callable[[], Any] | None = None
        self.outputs: Any = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn, self.outputs = fn, fn()
        return self.outputs

    def replay(self) -> None:
        copy_into(self.outputs, self.fn())


class CudaGraph:
    """One CUDA graph captured on `stream` into `pool`, in thread-local mode (another thread's CUDA calls, as a
    state writer's event queries, neither break the capture nor are refused)."""

    def __init__(self, pool: Any, stream: torch.cuda.Stream) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool, self.stream = pool, stream

    def capture(self, fn: Callable[[], Any]) -> Any:
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                outputs = fn()
            finally:
                self.graph.capture_end()
        current.wait_stream(self.stream)
        return outputs

    def replay(self) -> None:
        self.graph.replay()


class CaptureFailed(RuntimeError):
    """A segment's capture failed (`key`, why): the caller runs its work eagerly instead."""

    def __init__(self, key: Hashable, why: str) -> None:
        super().__init__(f"the capture of segment {key!r} failed: {why}")
        self.key, self.why = key, why


class SegmentGraphs:
    """Captured segments by key (module docstring). `graph` makes one graph (`RerunGraph` off CUDA); `hold` wraps
    each capture (a runtime that must take no state document meanwhile).

    Two checks read the device, once per segment each: a capture's first replay against the eager run before it
    over the same inputs, and the first replay of a later call (other inputs) against the function run eagerly
    again after it (`recheck`): a kernel that ran outside the capture, or a value the capture kept from its own
    pass, leaves the later replay's outputs stale. The worst of each (`difference`) and its segment are in `check`."""

    def __init__(self, device: torch.device, graph: Callable[[], Any] | None = None,
                 hold: Callable[[], Any] | None = None) -> None:
        self.device = device
        self._graphs: dict[Hashable, tuple[Any, Any, Callable[[], Any]]] = {}
        self._unchecked: set[Hashable] = set()  # captured, not yet replayed at a later call
        self._hold = hold
        self.counts: Counter[str] = Counter(captured=0, replayed=0)  # fixed keys: a reader may list them meanwhile
        self.check: dict[str, Any] = {"segments": 0, "worst_difference": 0.0, "worst_segment": None,
                                      "rechecked": 0, "worst_recheck": 0.0, "worst_recheck_segment": None}
        # what the captures took of the device's memory (CUDA's caching allocator reserved more by this much)
        self.memory: dict[str, int] = {"reserved_bytes": 0}
        self._stream = None
        if graph is not None:
            self._make = graph
        elif device.type == "cuda":
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
            self._make = lambda: CudaGraph(pool, stream)
            self._stream = stream
        else:
            self._make = RerunGraph

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        """The outputs of segment `key` (`fn` captured at its first call, replayed at every later one). A capture
        that fails raises `CaptureFailed`, its work not done."""
        held = self._graphs.get(key)
        if held is None:
            return self._capture(key, fn)
        graph, outputs, captured = held
        graph.replay()
        self.counts["replayed"] += 1
        if key in self._unchecked:
            self._unchecked.discard(key)
            replayed = snapshot(outputs)  # the eager run may write the same static storage
            self._note(key, difference(replayed, self._eager(captured)), "rechecked", "worst_recheck",
                       "worst_recheck_segment")
            for t, r in zip(tensors(outputs), replayed, strict=True):  # the replay's outputs, as it left them
                t.copy_(r)
        return outputs

    def _capture(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        graph = self._make()
        eager = snapshot(self._eager(fn))  # the capture's replay may write the same static storage
        before = torch.cuda.memory_reserved(self.device) if self._stream is not None else 0
        try:
            with warnings.catch_warnings():  # a segment that launches nothing (a view's state) captures no node
                warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                if self._hold is not None:
                    with self._hold():
                        outputs = graph.capture(fn)
                else:
                    outputs = graph.capture(fn)
        except Exception as exc:  # noqa: BLE001 (whatever CUDA or the function refused: the caller runs eagerly)
            raise CaptureFailed(key, f"{type(exc).__name__}: {str(exc).strip()[:300]}") from exc
        if self._stream is not None:
            self.memory["reserved_bytes"] += torch.cuda.memory_reserved(self.device) - before
        graph.replay()  # a CUDA capture launched nothing: the replay computes the pass's outputs
        self._graphs[key] = (graph, outputs, fn)
        self._unchecked.add(key)
        self.counts["captured"] += 1
        self._note(key, difference(outputs, eager), "segments", "worst_difference", "worst_segment")
        return outputs

    def _note(self, key: Hashable, worst: float, count: str, field: str, where: str) -> None:
        self.check[count] += 1
        if worst >= self.check[field]:
            self.check[field], self.check[where] = worst, repr(key)

    def _eager(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` once eagerly where its capture runs (on CUDA: the capture stream), so that what it launches is
        compiled and its libraries' per-stream state made before the capture; its outputs."""
        if self._stream is None:
            return fn()
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            outputs = fn()
        current.wait_stream(self._stream)
        return outputs
