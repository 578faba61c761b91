"""Segments of a pass captured as CUDA graphs and replayed, each keyed by the caller (`SegmentGraphs`).

A segment is a function of no arguments that reads only storage the caller keeps at fixed addresses (static
buffers it refills before each replay, weights, a tape that never moves) and returns tensors (alone, or in tuples,
lists, dicts, named tuples and dataclasses). The first call of a key runs the function once eagerly on the capture
stream (what it launches compiles and warms there), then captures it and replays the capture; every later call
replays it. Twice per key the device is read (`SegmentGraphs.check`): the capture's first replay (its outputs set to
NaN before it) against that eager run, and the first later replay against the function run eagerly again after
it. The outputs a call returns are the capture's own: the next replay of the same key overwrites them, so the
caller consumes them before that. A capture that fails raises `CaptureFailed` and leaves its work undone (the
caller runs the function eagerly), and every capture after it does too.

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


# What `difference` says of a value that is NaN or infinite on one side and not the same on the other (finite, so
# that an attestation holding it stays JSON)
NOT_FINITE = 1e30


def difference(got: Any, want: Any) -> float:
    """The worst difference between two segments' outputs of one structure (or flat lists of their tensors): per
    floating tensor its largest absolute difference where both are finite over the larger of `want`'s largest
    finite value and 1e-6, `NOT_FINITE` where one side is NaN or infinite and the other is not the same; 1.0 for
    another tensor that differs anywhere (reads the device: a capture's check, not a replay's)."""
    worst = 0.0
    for g, w in zip(tensors(got), tensors(want), strict=True):
        if not g.numel():
            continue
        if g.is_floating_point():
            g, w = g.float(), w.float()
            finite = g.isfinite() & w.isfinite()
            if bool((~finite & ~((g == w) | (g.isnan() & w.isnan()))).any()):
                return NOT_FINITE
            scale = max(float(w.abs().where(finite, 0).max()), 1e-6)
            worst = max(worst, float((g - w).abs().where(finite, 0).max()) / scale)
        elif not torch.equal(g, w):
            worst = max(worst, 1.0)
    return worst


def poison(outputs: Any) -> None:
    """NaN into every floating tensor of a capture's outputs before its first replay: a replay that writes none
    of them (a kernel that ran outside the capture) leaves NaN where the eager run left values."""
    for t in tensors(outputs):
        if t.is_floating_point():
            t.fill_(float("nan"))


def snapshot(outputs: Any) -> list[torch.Tensor]:
    """A copy of the tensors of a segment's outputs, in order (a segment may return views of static storage that
    its next run overwrites)."""
    return [t.clone() for t in tensors(outputs)]


def copy_into(held: Any, fresh: Any) -> None:
    """Copy the tensors of `fresh` outputs into those of `held` ones of the same structure, in place (other leaves,
    a number or a set of layers, are the function's own constants: a graph does not write them)."""
    for h, f in zip(tensors(held), tensors(fresh), strict=True):
        h.copy_(f)


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
        """`fn` captured; where it fails, the segment's own error raised, the capture ended as far as CUDA lets
        it and the pool released from recording (torch ends the stream's capture before it stops allocating to the
        pool, so a capture CUDA refused leaves the pool recording otherwise). The pool may still be unusable for
        another capture: the caller captures no more (`SegmentGraphs`)."""
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                outputs = fn()
            except BaseException:
                self._abandon()
                raise
            self.graph.capture_end()
        current.wait_stream(self.stream)
        return outputs

    def _abandon(self) -> None:
        try:
            self.graph.capture_end()
        except Exception:  # noqa: BLE001 (CUDA invalidated the capture: the segment's own error is the one raised)
            end = getattr(torch._C, "_cuda_endAllocateToPool", None)
            if end is not None:
                try:
                    end(self.stream.device.index if self.stream.device.index is not None
                        else torch.cuda.current_device(), self.pool)
                except Exception:  # noqa: BLE001 (not recording any more)
                    pass

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
        # called with (key, outputs) right after a segment's first later replay, before the eager rerun that checks
        # it writes whatever that rerun writes too: the caller's look at what the replay alone left
        self.after_first_replay: Callable[[Hashable, Any], None] | None = None
        self._hold = hold
        self.counts: Counter[str] = Counter(captured=0, replayed=0)  # fixed keys: a reader may list them meanwhile
        self.check: dict[str, Any] = {"segments": 0, "worst_difference": 0.0, "worst_segment": None,
                                      "rechecked": 0, "worst_recheck": 0.0, "worst_recheck_segment": None,
                                      # segments whose capture recorded no kernel; whose check met a NaN or an
                                      # infinity where the other side had something else (`NOT_FINITE`)
                                      "empty": [], "not_finite": []}
        # each checked segment's worst difference over its checks so far (`difference`), for a caller that refuses
        # a capture that strayed
        self.worst_by_key: dict[Hashable, float] = {}
        # what the captures took of the device's memory (CUDA's caching allocator reserved more by this much)
        self.memory: dict[str, int | None] = {"reserved_bytes": 0}
        self._stream = None
        self.broken: str | None = None  # why the first failed capture failed: no capture after it
        self._failed: list[Any] = []  # the graphs whose capture failed, kept (CUDA's allocator may still name them)
        if graph is not None:
            self._make = graph
        elif device.type == "cuda":
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
            self._make = lambda: CudaGraph(pool, stream)
            self._stream = stream
        else:
            self._make = RerunGraph

    def run(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        """The outputs of segment `key` (`fn` captured at its first call, replayed at every later one). A capture
        that fails raises `CaptureFailed`, its work not done, and so does every capture after it (on CUDA the
        shared pool may be unusable once one failed; the segments captured already still replay)."""
        held = self._graphs.get(key)
        if held is None:
            if self.broken is not None:
                raise CaptureFailed(key, f"no capture after a failed one ({self.broken})")
            return self._capture(key, fn)
        graph, outputs, captured = held
        graph.replay()
        self.counts["replayed"] += 1
        if key in self._unchecked:
            self._unchecked.discard(key)
            if self.after_first_replay is not None:
                self.after_first_replay(key, outputs)
            replayed = snapshot(outputs)  # the eager run may write the same static storage
            self._note(key, difference(replayed, self._eager(captured)), "rechecked", "worst_recheck",
                       "worst_recheck_segment")
            copy_into(outputs, replayed)  # the replay's outputs, as it left them
        return outputs

    def _capture(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        graph = self._make()
        eager = snapshot(self._eager(fn))  # the capture's replay may write the same static storage
        before = torch.cuda.memory_reserved(self.device) if self._stream is not None else 0
        try:
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                if self._hold is not None:
                    with self._hold():
                        outputs = graph.capture(fn)
                else:
                    outputs = graph.capture(fn)
        except Exception as exc:  # noqa: BLE001 (whatever CUDA or the function refused: the caller runs eagerly)
            self._failed.append(graph)
            self.broken = f"{key!r}: {type(exc).__name__}: {str(exc).strip()[:300]}"
            raise CaptureFailed(key, f"{type(exc).__name__}: {str(exc).strip()[:300]}") from exc
        if any("CUDA Graph is empty" in str(w.message) for w in warned):  # a segment that launches nothing
            self.check["empty"].append(repr(key))
        if self._stream is not None:
            self.memory["reserved_bytes"] += torch.cuda.memory_reserved(self.device) - before
        poison(outputs)
        graph.replay()  # a CUDA capture launched nothing: the replay computes the pass's outputs
        self._graphs[key] = (graph, outputs, fn)
        self._unchecked.add(key)
        self.counts["captured"] += 1
        self._note(key, difference(outputs, eager), "segments", "worst_difference", "worst_segment")
        return outputs

    def _note(self, key: Hashable, worst: float, count: str, field: str, where: str) -> None:
        self.check[count] += 1
        self.worst_by_key[key] = max(worst, self.worst_by_key.get(key, 0.0))
        if worst >= NOT_FINITE:
            self.check["not_finite"].append(repr(key))
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
