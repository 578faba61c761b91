"""Where a pass's host time goes, by sampling: the Python stack of the thread that runs the forward, read every
`INTERVAL_S` while a pass runs.

The part clock says how long a pass's launches took on the host and, from the kernel's account, whether its thread
computed or waited meanwhile (`vskipper.sglang.part_times`); it does not say where in the code. A sampler thread
reads the forward thread's innermost Python frame (`sys._current_frames`) while the clock's pass runs, and counts
per phase the line it stood at, three ways: the innermost frame whatever its code (torch's and Triton's Python
included; where the thread is inside C code, such as a kernel launch or a wait on a lock, the Python line that
called it), the innermost frame of vSkipper's code, and the innermost of SGLang's. A line that holds a share of
the samples holds about that share of the passes' host time.

Its own cost: the sampler takes the interpreter's lock for each sample (some tens of microseconds, the frames of
every thread collected), so the forward gives it up about once an interval: a few percent of a pass at 2 ms. It is
a measurement mode (`VSKIPPER_STACK_SAMPLES=1`, `ServeSpec.stack_samples`), off when deployed, and only reads
frames while a pass runs.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

INTERVAL_S = 0.002  # between two samples of a running pass
KINDS = ("innermost", "vskipper", "sglang")  # which frame of a sample is counted


def code_of(filename: str) -> str | None:
    """Whose code a frame's file is: 'vskipper', 'sglang' (SGLang's runtime, `sglang/srt`), or None."""
    name = filename.replace("\\", "/")
    if "/vskipper/" in name:
        return "vskipper"
    return "sglang" if "/sglang/srt/" in name else None


def frame_key(frame) -> str:
    """A frame as counted: the last two parts of its file's path, its function and its line."""
    code = frame.f_code
    path = code.co_filename.replace("\\", "/").rsplit("/", 2)
    return f"{'/'.join(path[-2:])}:{code.co_name}:{frame.f_lineno}"


def sample_keys(frame) -> dict[str, str]:
    """The counted frames of one sample, innermost first (`KINDS`): the innermost frame, the innermost of vSkipper's
    code and of SGLang's (absent where the stack holds none)."""
    keys = {"innermost": frame_key(frame)}
    while frame is not None and len(keys) < len(KINDS):
        kind = code_of(frame.f_code.co_filename)
        if kind is not None and kind not in keys:
            keys[kind] = frame_key(frame)
        frame = frame.f_back
    return keys


class StackSampler(threading.Thread):
    """Samples the frames of the thread that runs a pass every `interval_s`, counting per phase each of `KINDS`.
    `view` holds the counts as copies the sampler replaces after each pass, so that a reader on another thread
    serializes them while it samples on."""

    def __init__(self, running: Callable[[], tuple[int, str] | None], interval_s: float = INTERVAL_S) -> None:
        """`running()`: (the forward thread's ident, the phase of its pass) while a pass runs, else None."""
        super().__init__(name="vskipper-stack-sampler", daemon=True)
        self.running, self.interval_s = running, interval_s
        self.samples: Counter[str] = Counter()
        self.counts: dict[str, dict[str, Counter[str]]] = {kind: defaultdict(Counter) for kind in KINDS}
        self.view: dict[str, Any] = {"interval_s": interval_s, "samples_total": {}, **{kind: {} for kind in KINDS}}
        self._halt = threading.Event()

    def sample(self) -> bool:
        """Take one sample where a pass runs: whether one was taken."""
        running = self.running()
        if running is None:
            return False
        ident, phase = running
        frame = sys._current_frames().get(ident)
        if frame is None:
            return False
        self.samples[phase] += 1
        for kind, key in sample_keys(frame).items():
            self.counts[kind][phase][key] += 1
        del frame
        return True

    def publish(self) -> None:
        """Copy the counts into `view` (each field replaced whole: a reader serializing `view` meets no dict that
        changes size)."""
        self.view["samples_total"] = dict(self.samples)
        for kind in KINDS:
            self.view[kind] = {phase: dict(c) for phase, c in self.counts[kind].items()}

    def run(self) -> None:
        sampled = False
        while not self._halt.wait(self.interval_s):
            if self.sample():
                sampled = True
            elif sampled:  # a pass ended since the last sample: its counts out for readers
                self.publish()
                sampled = False

    def stop(self) -> None:
        self._halt.set()


def top(counts: dict[str, int], n: int = 8) -> list[tuple[str, int]]:
    """The `n` most sampled keys, most first."""
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def window(before: dict | None, after: dict | None, phase: str, kind: str) -> tuple[int, dict[str, int]]:
    """The samples of `phase` between two readings of a sampler's `view` (as the attestation holds it): how many,
    and each key's count of `kind`; (0, {}) where a reading lacks them."""
    if not after:
        return 0, {}
    was = (before or {}).get(kind, {}).get(phase, {})
    now = after.get(kind, {}).get(phase, {})
    counts = {k: n - was.get(k, 0) for k, n in now.items() if n - was.get(k, 0) > 0}
    total = after.get("samples_total", {}).get(phase, 0) - (before or {}).get("samples_total", {}).get(phase, 0)
    return total, counts
