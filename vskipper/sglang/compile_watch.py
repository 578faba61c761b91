"""Triton's compilations in the server's process, counted for the attestation.

A Triton kernel compiles once per specialization, at its first launch. One that first launches while the server
serves holds every pass behind it for as long as it compiles (1.3-1.7 s each for the cohort maps on the H200,
`benchmarks/results/H200/lease-4`). SGLang warns of such a compilation in its log; the attestation counts each one
(`triton_compiles`), so that a measurement window tells whether a compilation fell in it: the difference of its
two attestations' counts, not a search of a log.

Triton calls one listener (`triton.knobs.compilation.listener`) for every compilation, a load from its cache
included (`cache_hit`). `install` chains the listener found there, SGLang's where it installed its own first (and
SGLang's chains this one where it installs after). Under the interpreter (`TRITON_INTERPRET=1`) nothing compiles
and the counts stay 0.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any

RECENT = 16  # the latest compilations the attestation lists

_lock = threading.Lock()
_installed = False
_previous = None
_counts: Counter = Counter()  # "compiles" (built), "cache_loads" (loaded from Triton's cache)
_seconds = 0.0  # the built ones' compile time
_by_kernel: Counter = Counter()  # kernel name -> compilations built
_loads_by_kernel: Counter = Counter()  # kernel name -> loads from Triton's cache (a fresh machine compiles each)
_recent: deque = deque(maxlen=RECENT)


def install() -> bool:
    """Chain the counting listener into Triton's compilation listener, once per process. Whether it is installed
    (a Triton without the listener knob has nothing to chain into)."""
    global _installed, _previous
    with _lock:
        if _installed:
            return True
        try:
            import triton.knobs as knobs
        except ImportError:
            return False
        compilation = getattr(knobs, "compilation", None)
        if compilation is None or not hasattr(compilation, "listener"):
            return False
        _previous = compilation.listener
        compilation.listener = on_compilation
        _installed = True
        return True


def on_compilation(*, src, metadata, metadata_group, times, cache_hit) -> None:
    """Triton's listener: count the compilation, then call the listener this one replaced."""
    global _seconds
    if _previous is not None:
        _previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
    name = str(getattr(src, "name", None) or "?")
    seconds = getattr(times, "total", 0) / 1e6
    with _lock:
        if cache_hit:
            _counts["cache_loads"] += 1
            _loads_by_kernel[name] += 1
            return
        _counts["compiles"] += 1
        _seconds += seconds
        _by_kernel[name] += 1
        _recent.append({"kernel": name, "seconds": round(seconds, 4), "time": time.time()})


def attestation() -> dict[str, Any]:
    """The compilations so far in this process: built (`compiles_total`, their seconds, per kernel) and loaded
    from Triton's cache (per kernel: on a machine whose cache lacks them, each is built), with the latest built
    ones."""
    with _lock:
        return {"watched": _installed, "compiles_total": _counts["compiles"],
                "compile_seconds_total": round(_seconds, 4), "cache_loads_total": _counts["cache_loads"],
                "compiles_by_kernel": dict(sorted(_by_kernel.items())),
                "cache_loads_by_kernel": dict(sorted(_loads_by_kernel.items())), "recent": list(_recent)}
