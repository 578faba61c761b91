"""Where a pass's host time goes, by sampling: the Python stack of the thread that runs the forward, read every
`INTERVAL_S` while a pass runs.

The part clock says how long a pass's launches took on the host and, from the kernel's account, whether its thread
computed or waited meanwhile (`vskipper.sglang.part_times`); it does not say where in the code. A sampler thread
reads the forward thread's innermost Python frame (`sys._current_frames`) while the clock's pass runs, and counts
per phase the line it stood at, three ways: the innermost frame whatever its code (torch's and Triton's Python
included; where the thread is inside C code, such as a kernel launch or a wait on a lock, the Python line that
called it), the innermost frame of vSkipper's code, and the innermost of SGLang's runtime (`sglang/srt`).

A sample needs the interpreter's lock, which the forward lets go around each of torch's operators and Triton's
launches and otherwise every 5 ms (the interpreter's switch interval): a sample lands where the forward next lets
the lock go, so a stretch of pure Python is charged to the call that ends it, and where the forward keeps the lock
samples come further apart than `INTERVAL_S`. A line's share of the samples is about its share of the passes' host
time at the resolution of those hand-overs; the counts say how many samples there were.

Its own cost: a sample holds the interpreter's lock for 30-65 us (the stack walked, its keys kept per line; counted
per phase as `seconds_total`), and the forward then waits for the lock to come back. On a 2-core CPU host a sample
cost the pass 210-240 us in all (the medians over arms and shapes), so a sample every 2 ms made a pass 7-18%
slower (median 11%), every 5 ms from 3% faster to 8% slower (median 6% slower, within the repetitions' noise;
`benchmarks/host_time_bench.py --only samples`, `benchmarks/README.md`). Hence 5 ms, the interpreter's own
switch interval, at which a stretch of pure Python is sampled anyway. It is a measurement mode
(`VSKIPPER_STACK_SAMPLES=1`, `ServeSpec.stack_samples`), off when deployed, and only reads frames while a pass
runs: between passes it sleeps until the next one begins (`StackSampler.begin`), so that it takes no lock from
the scheduler's work between them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from functools import cache, lru_cache
from typing import Any

INTERVAL_S = 0.005  # between two samples of a running pass (its cost: the module's docstring)
IDLE_CHECK_S = 1.0  # how often a sampler between passes looks whether it was stopped
KINDS = ("innermost", "vskipper", "sglang")  # which frame of a sample is counted


@lru_cache(maxsize=1)
def _roots() -> dict[str, tuple[str, str]]:
    """Where each counted package's code lies, and the folder its paths are shown from: vSkipper's package, and
    SGLang's runtime where SGLang is importable."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # vskipper/
    roots = {"vskipper": (package + os.sep, os.path.dirname(package) + os.sep)}
    spec = importlib.util.find_spec("sglang")  # found, not imported (its package imports much)
    if spec is not None and spec.submodule_search_locations:
        package = os.path.abspath(list(spec.submodule_search_locations)[0])
        roots["sglang"] = (os.path.join(package, "srt") + os.sep, os.path.dirname(package) + os.sep)
    return roots


@cache
def code_of(filename: str) -> str | None:
    """Whose code a frame's file is: 'vskipper' (this package), 'sglang' (SGLang's runtime), or None (kept per
    file: a sample asks it of every frame it walks)."""
    for kind, (root, _) in _roots().items():
        if filename.startswith(root):
            return kind
    return None


def frame_key(frame) -> str:
    """A frame as counted: its file's path from the folder its package lies in (`vskipper/...`, `sglang/srt/...`;
    another installed package's from `site-packages`; any other file's last two parts), its function and its
    line."""
    code = frame.f_code
    return _key(code.co_filename, code.co_name, frame.f_lineno)


@lru_cache(maxsize=1 << 16)
def _key(name: str, function: str, line: int) -> str:
    """`frame_key` of a frame of `function` in file `name` at `line`, kept (by strings: code objects of two files
    can compare equal): the sampler holds the interpreter's lock while it makes its keys, and the forward waits
    for it meanwhile."""
    path = None
    for root, base in _roots().values():
        if name.startswith(root):
            path = name[len(base):]
            break
    if path is None:
        path = name.rsplit("site-packages" + os.sep, 1)[1] if "site-packages" + os.sep in name else \
            os.sep.join(name.rsplit(os.sep, 2)[-2:])
    return f"{path.replace(os.sep, '/')}:{function}:{line}"


def sample_keys(frame) -> dict[str, str]:
    """The counted frames of one sample, innermost first (`KINDS`): the innermost frame, the innermost of vSkipper's
    code and of SGLang's (absent where the stack holds none)."""
    keys = {"innermost": frame_key(frame)}
    while frame is not None and len(keys) < len(KINDS):
        code = frame.f_code
        kind = code_of(code.co_filename)
        if kind is not None and kind not in keys:
            keys[kind] = _key(code.co_filename, code.co_name, frame.f_lineno)
        frame = frame.f_back
    return keys


class StackSampler(threading.Thread):
    """Samples the frames of the thread that runs a pass every `interval_s`, counting per phase each of `KINDS`,
    from a pass's `begin` to its `end`, at the ticks of a clock that runs on between passes (a sampler woken by a
    pass waits for the next tick, not a whole interval: each part of a pass, its start too, has its share of the
    samples). It also counts the seconds its samples held the interpreter's lock (`seconds_total`, per phase): what
    it cost the forward beyond the lock's hand-over. `view` holds copies of the counts, replaced in one update
    after a pass the sampler saw end and whenever a reader asks (`publish`), so that a reader on another thread
    serializes them while it samples on."""

    def __init__(self, running: Callable[[], tuple[int, str] | None], interval_s: float = INTERVAL_S) -> None:
        """`running()`: (the forward thread's ident, the phase of its pass) while a pass runs, else None."""
        super().__init__(name="vskipper-stack-sampler", daemon=True)
        self.running, self.interval_s = running, interval_s
        self.samples: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()  # per phase, the time its samples took
        self.counts: dict[str, dict[str, Counter[str]]] = {kind: defaultdict(Counter) for kind in KINDS}
        self.view: dict[str, Any] = {"interval_s": interval_s, "samples_total": {}, "seconds_total": {},
                                     **{kind: {} for kind in KINDS}}
        self._lock = threading.Lock()  # the counts, between the sampler and a reader's `publish`
        self._halt = threading.Event()
        self._passing = threading.Event()  # set from a pass's begin to its end: the sampler wakes for it

    def begin(self) -> None:
        """A pass begins: the sampler wakes (after `running` names it)."""
        self._passing.set()

    def end(self) -> None:
        """The pass ended: the sampler sleeps until the next one begins (publishing its counts where it sees the
        gap)."""
        self._passing.clear()

    def sample(self) -> bool:
        """Take one sample where a pass runs: whether one was taken (not where the pass ended meanwhile)."""
        t0 = time.perf_counter()
        running = self.running()
        if running is None:
            return False
        ident, phase = running
        frame = sys._current_frames().get(ident)
        if frame is None or self.running() != running:
            return False
        keys = sample_keys(frame)
        del frame
        with self._lock:
            self.samples[phase] += 1
            for kind, key in keys.items():
                self.counts[kind][phase][key] += 1
            self.seconds[phase] += time.perf_counter() - t0
        return True

    def publish(self) -> None:
        """Copy the counts into `view` in one update (a reader serializing `view` meets no dict that changes size,
        and no total without its counts)."""
        with self._lock:
            fresh = {"samples_total": dict(self.samples), "seconds_total": dict(self.seconds),
                     **{kind: {phase: dict(c) for phase, c in self.counts[kind].items()} for kind in KINDS}}
        self.view.update(fresh)

    def run(self) -> None:
        sampled = False
        try:
            while not self._halt.is_set():
                if not self._passing.is_set():  # between passes: the last one's counts out, then sleep
                    if sampled:
                        self.publish()
                        sampled = False
                    self._passing.wait(IDLE_CHECK_S)
                    continue
                if self._halt.wait(self.interval_s - time.monotonic() % self.interval_s):  # the next tick
                    break
                if self.sample():
                    sampled = True
                elif sampled:  # a pass ended since the last sample: its counts out for readers
                    self.publish()
                    sampled = False
        except Exception as exc:  # the sampler stops; the attestation says why
            self.view["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"

    def stop(self) -> None:
        self._halt.set()
        self._passing.set()  # a sleeping sampler wakes to stop


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
    return max(0, total), counts
