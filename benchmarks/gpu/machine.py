"""What the whole machine did while a window of passes ran, read by the device run's client beside the servers.

A server's own threads (`vskipper.sglang.threads`) say whether another thread of its process took the forward's
interpreter lock. They do not see the rest of the machine: another process burning a CPU (a server that did not
end, a packer), the forward's core shared with a busy hyperthread sibling, or the hypervisor taking the CPU from
the guest (steal). Each of these slows the forward's launches while its thread's own CPU time still fills the
pass, and none depends on the arm: two servers of one arm could then run their passes at different speeds.

Read from Linux's `/proc/stat` (each CPU's busy, idle and stolen time), `/proc/<pid>/stat` (each process's CPU
time) and `/sys/devices/system/cpu/cpu<N>/topology/thread_siblings_list` (the CPUs that share a core). Elsewhere
each reading is empty and a window says nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PROC = Path("/proc")
CPUS = Path("/sys/devices/system/cpu")
TOP = 5  # the processes a window lists, the busiest first


def cpu_times(proc: Path = PROC) -> dict[int, tuple[int, int]]:
    """{CPU: (busy, stolen)} in clock ticks since boot, per CPU (`/proc/stat`'s cpuN lines: busy is every state
    but idle, iowait and steal); {} where it cannot be read."""
    try:
        lines = (proc / "stat").read_text().splitlines()
    except OSError:
        return {}
    times = {}
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        ticks += [0] * (8 - len(ticks))
        idle, iowait, steal = ticks[3], ticks[4], ticks[7]
        times[int(name[3:])] = (sum(ticks) - idle - iowait - steal, steal)
    return times


def process_times(proc: Path = PROC) -> dict[int, tuple[str, float]]:
    """{pid: (name, CPU seconds since it started)} of every process now (`/proc/<pid>/stat`'s utime and stime,
    its threads' included); a process that ends while it is read is left out."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        pids = [int(p) for p in os.listdir(proc) if p.isdigit()]
    except (OSError, ValueError):
        return {}
    table = {}
    for pid in pids:
        try:
            stat = (proc / str(pid) / "stat").read_text()
        except OSError:
            continue
        close = stat.rindex(")")
        fields = stat[close + 2:].split()  # from the third field (the state) on: utime and stime are the 14th, 15th
        table[pid] = (stat[stat.index("(") + 1:close], (int(fields[11]) + int(fields[12])) / tick)
    return table


def siblings(cpu: int, cpus: Path = CPUS) -> list[int]:
    """The other CPUs that share `cpu`'s core (its hyperthread siblings); [] where the topology is not published."""
    try:
        text = (cpus / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
    except OSError:
        return []
    found = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        found += range(int(first), int(last or first) + 1)
    return [c for c in found if c != cpu]


def reading(proc: Path = PROC) -> dict:
    """The machine now: its CPUs' and its processes' times and the monotonic clock."""
    return {"t": time.monotonic(), "cpus": cpu_times(proc), "processes": process_times(proc)}


def window(before: dict, after: dict, core: int | None = None, top: int = TOP, client: int | None = None,
           cpus: Path = CPUS) -> dict | None:
    """What the machine did between two readings: how many CPUs were busy and stolen on average (busy CPU seconds
    over the window's wall seconds), the `top` processes that used the most CPU in it (`client`: the pid to mark
    as the reader's own), and where `core` (the CPU the forward's thread last ran on) is given, how busy it and
    each of its siblings were (a fraction of the window). None where either reading holds no CPU."""
    wall = after["t"] - before["t"]
    if not before["cpus"] or not after["cpus"] or wall <= 0:
        return None
    tick = os.sysconf("SC_CLK_TCK")

    def share(cpu: int, index: int) -> float | None:
        if cpu not in before["cpus"] or cpu not in after["cpus"]:
            return None
        return (after["cpus"][cpu][index] - before["cpus"][cpu][index]) / tick / wall

    shared = [c for c in after["cpus"] if c in before["cpus"]]
    used = [{"pid": pid, "name": name, "cpu_s": seconds - before["processes"].get(pid, (name, 0.0))[1],
             **({"client": True} if pid == client else {})}
            for pid, (name, seconds) in after["processes"].items()]
    doc = {"wall_s": wall, "cpus": len(shared),
           "busy_cpus": sum(share(c, 0) for c in shared), "stolen_cpus": sum(share(c, 1) for c in shared),
           "processes": sorted((u for u in used if u["cpu_s"] > 0), key=lambda u: -u["cpu_s"])[:top]}
    if core is not None and core in shared:
        doc["core"] = {"cpu": core, "busy": share(core, 0), "stolen": share(core, 1),
                       "siblings": [{"cpu": s, "busy": share(s, 0)} for s in siblings(core, cpus) if s in shared]}
    return doc
