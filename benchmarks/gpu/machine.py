"""What the whole machine did while a window of passes ran, read by the device run's client beside the servers.

A server's own threads (`vskipper.sglang.threads`) say whether another thread of its process took the forward's
interpreter lock. They do not see the rest of the machine: another process burning a CPU (a server that did not
end, a packer), the forward's core shared with a busy hyperthread sibling, or the hypervisor taking the CPU from
the guest (steal). Each of these slows the forward's launches while its thread's own CPU time may still fill the
pass, and none depends on the arm: two servers of one arm could then run their passes at different speeds. What a
virtual machine does not publish (a neighbour on the physical core behind a virtual CPU, beyond what it steals)
shows only as a slower CPU: each reading also times a fixed loop of pure Python on the reader's CPU (`canary`),
whose time moves with the machine's speed for one thread (on an idle 2-core development VM it took 1,058-1,620 us
over ten seconds, nothing else running).

Read from Linux's `/proc/stat` (each CPU's busy, idle and stolen time), `/proc/<pid>/stat` (each process's CPU
time and start), `/proc/<tid>/schedstat` and `stat` (the forward's thread: its time on a CPU, its time runnable
but waiting for one, the CPU it last ran on) and `/sys/devices/system/cpu/cpu<N>/topology/thread_siblings_list`
(the CPUs that share a core). Nothing read raises: what cannot be read is left out, and a window says nothing
where a reading holds no CPU.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PROC = Path("/proc")
CPUS = Path("/sys/devices/system/cpu")
TOP = 5  # the processes a table lists, the busiest first
CANARY_LOOPS = 20_000  # iterations of the canary's loop: about a millisecond of one thread
CANARY_ROUNDS = 3  # the least of these runs is a reading's canary


def _tick() -> int:
    return os.sysconf("SC_CLK_TCK")


def cpu_times(proc: Path = PROC) -> dict[int, tuple[int, int]]:
    """{CPU: (busy, stolen)} in clock ticks since boot, per CPU (`/proc/stat`'s cpuN lines: busy is every state
    but idle, iowait and steal; guest time is inside user's already); {} where it cannot be read, and a line
    that does not parse left out."""
    try:
        lines = (proc / "stat").read_text().splitlines()
    except OSError:
        return {}
    times = {}
    for line in lines:
        name, *fields = line.split() or [""]
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            cpu, ticks = int(name[3:]), [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        except ValueError:
            continue
        ticks += [0] * (8 - len(ticks))
        idle, iowait, steal = ticks[3], ticks[4], ticks[7]
        times[cpu] = (sum(ticks) - idle - iowait - steal, steal)
    return times


def _stat_fields(text: str) -> tuple[str, list[str]]:
    """A /proc stat line's name (between its first '(' and last ')') and its fields from the third (the state)."""
    close = text.rindex(")")
    return text[text.index("(") + 1:close], text[close + 2:].split()


def process_times(proc: Path = PROC) -> dict[int, tuple[str, float, int]]:
    """{pid: (name, CPU seconds since it started, its start in ticks since boot)} of every process now
    (`/proc/<pid>/stat`'s utime, stime and starttime, its threads' time included); a process that ends while it
    is read, or whose stat does not parse, is left out."""
    try:
        tick, pids = _tick(), [int(p) for p in os.listdir(proc) if p.isdigit()]
    except (OSError, ValueError):
        return {}
    table = {}
    for pid in pids:
        try:
            name, fields = _stat_fields((proc / str(pid) / "stat").read_text())
            table[pid] = (name, (int(fields[11]) + int(fields[12])) / tick, int(fields[19]))
        except (OSError, ValueError, IndexError):
            continue
    return table


def uptime(proc: Path = PROC) -> float | None:
    """Seconds since boot (`/proc/uptime`), which a process's start is counted from; None where unread."""
    try:
        return float((proc / "uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def task(tid: int, proc: Path = PROC) -> dict | None:
    """One thread of any process by its id (thread ids are the machine's): the seconds it has run on a CPU and
    waited runnable for one (`schedstat`: time another task held the CPU it could have run on), its involuntary
    switches (the kernel took the CPU from it), the CPU it last ran on (`stat`'s 39th field) and how often it moved
    from one CPU to another (`sched`'s se.nr_migrations; None where the kernel does not publish it); None where the
    thread is gone or its files do not parse. The kernel brings a running thread's time up to date at its ticks
    (a few ms): a window's figures are that coarse."""
    try:
        ran, waited, _ = (int(v) for v in (proc / str(tid) / "schedstat").read_text().split()[:3])
        _, fields = _stat_fields((proc / str(tid) / "stat").read_text())
        status = (proc / str(tid) / "status").read_text()
        taken = next(int(line.split()[1]) for line in status.splitlines()
                     if line.startswith("nonvoluntary_ctxt_switches:"))
        doc = {"tid": tid, "run_s": ran / 1e9, "runnable_s": waited / 1e9, "involuntary": taken,
               "cpu": int(fields[36]), "migrations": None}
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    try:
        for line in (proc / str(tid) / "sched").read_text().splitlines():
            if line.startswith("se.nr_migrations"):
                doc["migrations"] = int(line.split(":")[1])
    except (OSError, ValueError, IndexError):
        pass
    return doc


def siblings(cpu: int, cpus: Path = CPUS) -> list[int]:
    """The other CPUs that share `cpu`'s core (its hyperthread siblings, as the kernel publishes them: on a
    virtual machine, its virtual topology); [] where it is not published or does not parse."""
    try:
        text = (cpus / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
        found = []
        for part in text.split(","):
            first, _, last = part.partition("-")
            found += range(int(first), int(last or first) + 1)
    except (OSError, ValueError):
        return []
    return [c for c in found if c != cpu]


def canary(loops: int = CANARY_LOOPS, rounds: int = CANARY_ROUNDS) -> float:
    """The microseconds of a fixed loop of pure Python on the calling thread, the least of `rounds` runs: the
    machine's speed for one thread now. The same loop takes longer where the CPU runs at a lower clock or is
    shared with work the guest does not see."""
    best = None
    for _ in range(rounds):
        t0, x = time.perf_counter_ns(), 0
        for i in range(loops):
            x += i * i
        took = (time.perf_counter_ns() - t0) / 1e3
        best = took if best is None else min(best, took)
    return best


def reading(first: bool, forward: int | None = None, proc: Path = PROC) -> dict:
    """The machine now: its CPUs' and its processes' times, the forward's thread (`forward`: its id), the canary
    and the monotonic clock. A window's `first` reading takes the canary and the processes, then the thread, the
    CPUs and the clock; its last one the clock, the CPUs and the thread, then the processes and the canary: the
    reader's own work (milliseconds on its CPU) falls outside the window the CPU and thread figures cover."""
    doc: dict = {}
    if first:
        doc.update(canary_us=canary(), processes=process_times(proc), uptime=uptime(proc))
        doc.update(forward=task(forward, proc) if forward is not None else None)
        doc.update(cpus=cpu_times(proc))
        doc.update(t=time.monotonic())
    else:
        doc.update(t=time.monotonic())
        doc.update(cpus=cpu_times(proc))
        doc.update(forward=task(forward, proc) if forward is not None else None)
        doc.update(processes=process_times(proc), uptime=uptime(proc), canary_us=canary())
    return doc


def _used(before: dict, after: dict, client: int | None) -> list[dict]:
    """Every process's CPU seconds between two readings, those that used none left out, the busiest first: one
    that started between them (its pid new, or taken again: another start) from zero, one that the first reading
    missed although it was older (its stat unread then) left out; one that started and ended between them is not
    seen (its time is in the CPUs' all the same)."""
    tick, since = _tick(), before.get("uptime")
    used = []
    for pid, (name, seconds, start) in after["processes"].items():
        was = before["processes"].get(pid)
        if was is not None and was[2] == start:
            seconds -= was[1]
        elif since is None or start / tick < since - 1.0:  # older than the window, unread before: unknown
            continue
        if seconds > 0:
            used.append({"pid": pid, "start": start, "name": name, "cpu_s": seconds,
                         **({"client": True} if pid == client else {})})
    return sorted(used, key=lambda u: -u["cpu_s"])


def window(before: dict, after: dict, client: int | None = None, cpus: Path = CPUS) -> dict | None:
    """What the machine did between a window's two readings (`reading`): how many CPUs were busy and stolen on
    average (their seconds over the window's wall seconds), every process that used CPU in it, the busiest first
    (`client`: the pid to mark as the reader's own), and where both readings read the forward's thread: its
    seconds on a CPU and runnable waiting for one, the kernel's preemptions of it, the CPUs it last ran on at
    either end (`moved`: it ran on another CPU in between, by its migrations where the kernel counts them, else
    another at the end), and on the CPU it ended on, how busy that CPU was (`busy`) and beyond the forward's own
    time (`others`, at least 0: both are counted in ticks) and each of its siblings; the canary's microseconds at
    either end (`canary_us`). None where either reading holds no CPU."""
    wall = after["t"] - before["t"]
    if not before.get("cpus") or not after.get("cpus") or wall <= 0:
        return None
    tick = _tick()

    def share(cpu: int, index: int) -> float | None:
        if cpu not in before["cpus"] or cpu not in after["cpus"]:
            return None
        return max(0, after["cpus"][cpu][index] - before["cpus"][cpu][index]) / tick / wall

    shared = [c for c in after["cpus"] if c in before["cpus"]]
    doc = {"wall_s": wall, "cpus": len(shared),
           "busy_cpus": sum(share(c, 0) for c in shared), "stolen_cpus": sum(share(c, 1) for c in shared),
           "processes": _used(before, after, client),
           "canary_us": [before.get("canary_us"), after.get("canary_us")]}
    start, end = before.get("forward"), after.get("forward")
    if start and end and start["tid"] == end["tid"]:
        run_s = end["run_s"] - start["run_s"]
        doc["forward"] = {"tid": end["tid"], "run_s": run_s, "runnable_s": end["runnable_s"] - start["runnable_s"],
                          "involuntary": end["involuntary"] - start["involuntary"],
                          "cpu_before": start["cpu"], "cpu": end["cpu"],
                          "moved": start["cpu"] != end["cpu"] or (
                              start.get("migrations") is not None and end.get("migrations") is not None
                              and end["migrations"] != start["migrations"])}
        core = end["cpu"]
        if core in shared:
            doc["core"] = {"cpu": core, "busy": share(core, 0), "others": max(0.0, share(core, 0) - run_s / wall),
                           "stolen": share(core, 1),
                           "siblings": [{"cpu": s, "busy": share(s, 0)} for s in siblings(core, cpus) if s in shared]}
    return doc
