"""Where a pass's host time goes, by sampling: the Python stack of the thread that runs the forward, read every
`INTERVAL_S` while a pass runs.

The part clock says how long a pass's launches took on the host and, from the kernel's account, whether its thread
computed or waited meanwhile (`vskipper.sglang.part_times`); it does not say where in the code. A sampler thread
ticks while the clock's pass runs, and at each tick the forward's Python stack is read and counted per phase by
the line it stood at, three ways: the innermost frame whatever its code (torch's and Triton's Python
included; where the thread is inside C code, such as a kernel launch or a wait on a lock, the Python line that
called it), the innermost frame of vSkipper's code, and the innermost of SGLang's runtime (`sglang/srt`).

Where the forward is the process's main thread (SGLang's scheduler runs it there) and the sampler was made in it,
the tick sends that thread a signal (`SIGNAL`) and the stack is read by the thread itself, in the handler Python
runs between two of its instructions (`mode` "signal"): a thread that walks another running thread's frames
(`sys._current_frames`, then `f_back`) can crash CPython 3.11 (a segmentation fault in the sampler's walk, seen
once on a CPU server; CPython issues 99110 and 111363), and one that walks its own cannot. System calls the signal
interrupts are restarted where the kernel restarts them (SA_RESTART, `signal.siginterrupt`; Python retries its own,
and pyzmq its polls); a handler that fails stops its sampler, never the pass. Elsewhere (another thread's forward, a sampler made off the main
thread, or `SIGNAL` already handled by someone else) the sampler thread reads the frames itself (`mode` "thread").

A tick needs the interpreter's lock, which the forward lets go around each of torch's operators and Triton's
launches and otherwise every 5 ms (the interpreter's switch interval): a sample lands where the forward next lets
the lock go (at a signal: where it next runs Python, after the call it was in), so a stretch of pure Python is
charged to the call that ends it, and where the forward keeps the lock samples come further apart than
`INTERVAL_S`. A line's share of the samples is about its share of the passes' host
time at the resolution of those hand-overs; the counts say how many samples there were.

Its own cost: read from the sampler's thread, a sample holds the interpreter's lock for 30-65 us (the stack walked,
its keys kept per line; counted per phase as `seconds_total`), and the forward then waits for the lock to come
back: on a 2-core CPU host a sample cost the pass 210-240 us in all (the medians over arms and shapes), a sample
every 5 ms made a pass a median 6% slower. In the signal mode the forward spends its own 29-44 us reading its stack
and the sampler's thread still takes the lock to send the signal: a sample cost the pass a median 120 us in all,
every 2 ms a median 6.5% slower, every 5 ms 3% (`benchmarks/host_time_bench.py --only samples`,
`benchmarks/README.md`). Hence 5 ms, the interpreter's own
switch interval, at which a stretch of pure Python is sampled anyway. It is a measurement mode
(`VSKIPPER_STACK_SAMPLES=1`, `ServeSpec.stack_samples`), off when deployed, and only reads frames while a pass
runs: between passes it sleeps until the next one begins (`StackSampler.begin`), so that it takes no lock from
the scheduler's work between them.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading
import time
import weakref
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from functools import cache, lru_cache
from typing import Any

INTERVAL_S = 0.005  # between two samples of a running pass (its cost: the module's docstring)
IDLE_CHECK_S = 1.0  # how often a sampler between passes looks whether it was stopped
KINDS = ("innermost", "vskipper", "sglang")  # which frame of a sample is counted
SIGNAL = getattr(signal, "SIGUSR2", None)  # the tick's signal to the forward's thread (SGLang handles none such)
_signalled: weakref.WeakSet[StackSampler] = weakref.WeakSet()  # whose ticks signal the main thread (`_dispatch`)
TAKEN, PENDING, NO_PASS = "taken", "pending", "no pass"  # what a tick did (`StackSampler.sample`)


def _dispatch(signum, frame) -> None:
    """The main thread's handler of `SIGNAL`: each signalling sampler that asked for a sample takes it. It runs
    inside the forward, so nothing it does may raise there: a sampler that fails stops signalling, and its
    attestation says why."""
    for sampler in list(_signalled):
        try:
            sampler._on_signal(frame)
        except Exception as exc:  # noqa: BLE001 -- the forward goes on; the sampler's view names the error
            _signalled.discard(sampler)
            sampler.view["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"


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
    samples). It also counts the seconds its samples took (`seconds_total`, per phase): in the signal mode the
    forward's own, else what they held the interpreter's lock. `view` holds copies of the counts, replaced in one
    update after a pass the sampler saw end and whenever a reader asks (`publish`), so that a reader on another
    thread serializes them while it samples on; `samples_by_mode` counts how each sample was read."""

    def __init__(self, running: Callable[[], tuple[int, str] | None], interval_s: float = INTERVAL_S,
                 signals: bool = True) -> None:
        """`running()`: (the forward thread's ident, the phase of its pass) while a pass runs, else None.
        `signals`: the main thread's passes sampled by the thread itself, at a signal (the module's docstring),
        where this is the main thread and the signal is free; else (or False) by this thread."""
        super().__init__(name="vskipper-stack-sampler", daemon=True)
        self.running, self.interval_s = running, interval_s
        self._main = threading.main_thread().ident
        self._asked: tuple[int, str] | None = None  # the pass a signal was sent for, until its handler runs
        self._taken: deque = deque()  # the handler's samples (phase, keys, seconds), counted by this thread
        self.mode = "signal" if signals and self._take_signal() else "thread"
        self.by_mode: Counter[str] = Counter()  # how each sample was read: at a signal, or walked from this thread
        self.samples: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()  # per phase, the time its samples took
        self.counts: dict[str, dict[str, Counter[str]]] = {kind: defaultdict(Counter) for kind in KINDS}
        self.view: dict[str, Any] = {"interval_s": interval_s, "mode": self.mode, "samples_by_mode": {},
                                     "samples_total": {}, "seconds_total": {}, **{kind: {} for kind in KINDS}}
        self._lock = threading.Lock()  # the counts, between this thread and a reader's `publish` (never the handler)
        self._halt = threading.Event()
        self._passing = threading.Event()  # set from a pass's begin to its end: the sampler wakes for it

    def begin(self) -> None:
        """A pass begins: the sampler wakes (after `running` names it)."""
        self._passing.set()

    def end(self) -> None:
        """The pass ended: the sampler sleeps until the next one begins (publishing its counts where it sees the
        gap)."""
        self._passing.clear()

    def _take_signal(self) -> bool:
        """Handle `SIGNAL` in this process (`_dispatch`; the system calls it interrupts restarted where the kernel
        restarts them, SA_RESTART), where this is the main thread and nobody else handles it (None: a handler
        installed outside Python): whether the main thread's passes are sampled at a signal. Several samplers
        share the handler, each taking the samples it asked for."""
        if SIGNAL is None or not hasattr(signal, "pthread_kill") or threading.get_ident() != self._main:
            return False
        held = signal.getsignal(SIGNAL)
        if held is not _dispatch:
            if held is not signal.SIG_DFL:
                return False  # someone else's
            signal.signal(SIGNAL, _dispatch)
        signal.siginterrupt(SIGNAL, False)
        _signalled.add(self)
        return True

    def sample(self) -> str:
        """One tick where a pass runs: `TAKEN` (a sample counted, or asked of the main thread at a signal),
        `PENDING` (the last one asked for still waits for its handler) or `NO_PASS` (none runs, or it ended
        meanwhile). The main thread is signalled only while `_dispatch` still handles the signal (a handler set
        in its place since: no more signals, and its frames are not walked either)."""
        t0 = time.perf_counter()
        running = self.running()
        if running is None:
            return NO_PASS
        ident, phase = running
        if self.mode == "signal" and ident == self._main:
            if self._asked is not None:
                return PENDING
            if signal.getsignal(SIGNAL) is not _dispatch:
                _signalled.discard(self)
                self.view["error"] = "the stack's signal is handled elsewhere now: no more samples"
                self._halt.set()
                return NO_PASS
            self._asked = running
            signal.pthread_kill(ident, SIGNAL)
            return TAKEN
        frame = sys._current_frames().get(ident)
        if frame is None or self.running() is not running:
            return NO_PASS
        keys = sample_keys(frame)
        del frame
        self._taken.append((phase, keys, time.perf_counter() - t0, "thread"))
        return TAKEN

    def _on_signal(self, frame) -> None:
        """In the main thread's handler of `SIGNAL` (`_dispatch`): its own stack read, where this sampler asked for
        a sample and the pass it asked for still runs (the same pass: a later one of the same phase is another),
        and handed to the sampler's thread to count (the handler takes no lock: the main thread may hold it)."""
        t0 = time.perf_counter()
        asked, self._asked = self._asked, None
        if asked is None or frame is None or self.running() is not asked:
            return
        keys = sample_keys(frame)
        self._taken.append((asked[1], keys, time.perf_counter() - t0, "signal"))

    def _drain(self) -> None:
        """Count the samples taken since the last drain."""
        with self._lock:
            while self._taken:
                phase, keys, seconds, mode = self._taken.popleft()
                self.samples[phase] += 1
                self.by_mode[mode] += 1
                for kind, key in keys.items():
                    self.counts[kind][phase][key] += 1
                self.seconds[phase] += seconds

    def publish(self) -> None:
        """Copy the counts into `view` in one update (a reader serializing `view` meets no dict that changes size,
        and no total without its counts)."""
        self._drain()
        with self._lock:
            fresh = {"samples_total": dict(self.samples), "seconds_total": dict(self.seconds),
                     "samples_by_mode": dict(self.by_mode),
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
                if self._halt.wait(next_tick_s(time.monotonic(), self.interval_s)):
                    break
                tick = self.sample()
                if tick == TAKEN:
                    sampled = True
                elif tick == NO_PASS and sampled:  # a pass ended since the last sample: its counts out for readers
                    self.publish()
                    sampled = False
        except Exception as exc:  # the sampler stops; the attestation says why
            self.view["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        finally:
            self._drain()

    def stop(self) -> None:
        """Stop sampling. The signal's handler stays (a signal already sent still finds it), without this sampler."""
        _signalled.discard(self)
        self._halt.set()
        self._passing.set()  # a sleeping sampler wakes to stop


def next_tick_s(now: float, interval_s: float) -> float:
    """Seconds from `now` to the sampler's next tick: ticks lie on the clock's multiples of the interval, so that a
    sampler woken by a pass samples at the next one, not a whole interval after waking."""
    return interval_s - now % interval_s


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
