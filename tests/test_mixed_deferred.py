"""`vskipper.mixed.deferred`: device values reach the host in order, without a pass waiting for its own.

No GPU runs here: the CUDA copy and event are replaced by an event this test completes by hand (`ManualEvent`),
which is all `ready` reads of a CUDA event (`query`, `synchronize`)."""

from __future__ import annotations

import pytest
import torch

from vskipper.mixed.deferred import DeferredReads


class ManualEvent:
    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


class ManualReads(DeferredReads):
    """DeferredReads whose copies complete when the test says (`events`, in push order)."""

    def __init__(self, depth: int = 64) -> None:
        super().__init__(depth)
        self.events: list[ManualEvent] = []

    def _start(self, value):
        self.events.append(ManualEvent())
        return value.to("cpu", copy=True).reshape(-1), self.events[-1]


def test_on_cpu_a_value_is_ready_when_pushed_and_is_a_copy():
    reads = DeferredReads()
    value = torch.tensor([3, 1])
    reads.push(value, "a")
    value.zero_()  # the tape is reused by the next pass
    assert list(reads.ready()) == [([3, 1], "a")] and len(reads) == 0


def test_values_come_back_once_copied_oldest_first_and_a_blocking_read_waits_for_the_rest():
    reads = ManualReads()
    for i in range(3):
        reads.push(torch.tensor([i]), i)
    assert list(reads.ready()) == []
    reads.events[1].done = True  # a later copy done before the oldest: nothing overtakes it
    assert list(reads.ready()) == []
    reads.events[0].done = True
    assert list(reads.ready()) == [([0], 0), ([1], 1)]
    assert not reads.events[2].waited
    assert list(reads.ready(block=True)) == [([2], 2)] and reads.events[2].waited


def test_values_past_the_depth_are_waited_for():
    reads = ManualReads(depth=2)
    for i in range(3):
        reads.push(torch.tensor([i]), i)
    assert list(reads.ready()) == [([0], 0)]  # three in flight, two allowed: the oldest is waited for
    assert reads.events[0].waited and not reads.events[1].waited and len(reads) == 2


def test_waiting_for_the_values_pushed_takes_none_of_them():
    """`wait_pushed` waits for every copy in flight and leaves them queued, for the reader that takes them."""
    reads = ManualReads()
    for i in range(2):
        reads.push(torch.tensor([i]), i)
    reads.wait_pushed()
    assert all(e.waited for e in reads.events) and len(reads) == 2
    assert list(reads.ready()) == [([0], 0), ([1], 1)]
    reads.wait_pushed()  # nothing in flight: nothing to wait for


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth must be at least 1"):
        DeferredReads(0)
