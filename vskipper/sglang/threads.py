"""The CPU time each thread of this process has used, for the attestation (`threads`).

A forward pass's host time is its thread's launches, and a Python thread holds the interpreter's lock while it
runs: another thread of the scheduler's process that burns CPU during a pass takes that lock whenever the forward
lets it go (around each of torch's operators and each Triton launch), and the forward then waits for it back.
Two readings of this table, before and after a window of passes, say which threads ran beside the forward's, for
how long, and how often each waited. The runtime reads it for a document a reader asked for, outside its state
lock (`Runtime._state_document`): at a hundred threads it holds the interpreter's lock for milliseconds.

Read from Linux's `/proc/self/task/<tid>/stat` (user and system time, in clock ticks) and `status` (how often the
thread gave up the processor to wait: for the interpreter's lock, another lock, I/O or a sleep, `waits`); a thread
Python started is named as Python names it, any other (torch's, the CUDA driver's) by its kernel name. A forward
that loses the interpreter's lock at its launches waits once for each, where one that keeps it waits for nothing.
Elsewhere the table is empty.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

TASKS = Path("/proc/self/task")


def thread_cpu(tasks: Path = TASKS) -> dict[str, dict[str, float | str]]:
    """{native thread id: {"name", "cpu_s", "waits"}} for every thread of this process now; {} where /proc has
    none."""
    try:
        tids = os.listdir(tasks)
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return {}
    named = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    table: dict[str, dict[str, float | str]] = {}
    for tid in tids:
        try:
            stat = (tasks / tid / "stat").read_text()
            status = (tasks / tid / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        close = stat.rindex(")")
        fields = stat[close + 2:].split()  # from the third field (the state) on: utime and stime are the 14th, 15th
        waits = next((int(line.split()[1]) for line in status.splitlines()
                      if line.startswith("voluntary_ctxt_switches:")), 0)
        table[tid] = {"name": named.get(int(tid), stat[stat.index("(") + 1:close]),
                      "cpu_s": (int(fields[11]) + int(fields[12])) / tick, "waits": waits}
    return table


# The CUDA caching allocator's counters a window's passes may move: memory taken from and given back to the
# driver (each can hold the host; a block given back waits for the device first), a request retried after the
# allocator gave back its cache, and its waits on every stream. A pass whose temporaries fit the cached blocks moves
# none of them.
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_counts(device) -> dict[str, int] | None:
    """`ALLOCATOR_COUNTERS` of the CUDA caching allocator on `device` now (`torch.cuda.memory_stats`; those this
    torch counts), or None off CUDA."""
    import torch

    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats[name]) for name in ALLOCATOR_COUNTERS if name in stats}


def busiest(before: dict, after: dict, top: int = 4) -> list[dict[str, float | str]]:
    """The threads that used the most CPU between two readings (`thread_cpu`), most first, at most `top`: each
    its id, name, CPU seconds and waits between them (a thread started between them counts from zero)."""
    used = [{"tid": tid, "name": now["name"], "cpu_s": now["cpu_s"] - before.get(tid, {}).get("cpu_s", 0.0),
             "waits": now.get("waits", 0) - before.get(tid, {}).get("waits", 0)} for tid, now in after.items()]
    return sorted((u for u in used if u["cpu_s"] > 0), key=lambda u: -u["cpu_s"])[:top]
