"""What the whole machine did in a window (`benchmarks/gpu/machine.py`): read for real from this Linux machine's
/proc, and from written tables whose every case is known."""

import os
import threading
import time

import pytest

from benchmarks.gpu import machine, run

TICK = os.sysconf("SC_CLK_TCK")


def write_stat(proc, cpus: dict[int, list[int]]) -> None:
    total = [sum(col) for col in zip(*cpus.values(), strict=True)]
    lines = ["cpu  " + " ".join(map(str, total))]
    lines += [f"cpu{n} " + " ".join(map(str, ticks)) for n, ticks in cpus.items()]
    lines += ["intr 12345 1 2 3", "ctxt 999", "btime 1700000000"]
    (proc / "stat").write_text("\n".join(lines) + "\n")


def stat_line(pid: int, name: str, utime: int = 0, stime: int = 0, start: int = 0, cpu: int = 0) -> str:
    fields = ["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 6 + [str(start)] + ["0"] * 16 + [str(cpu)]
    return f"{pid} ({name}) " + " ".join(fields + ["0"] * 5) + "\n"  # the 3rd field on: start 22nd, CPU 39th


def write_process(proc, pid: int, name: str, utime: int, stime: int, start: int = 0) -> None:
    (proc / str(pid)).mkdir(exist_ok=True)
    (proc / str(pid) / "stat").write_text(stat_line(pid, name, utime, stime, start))


def test_each_cpus_busy_and_stolen_ticks_leave_idle_iowait_and_steal_out_of_busy(tmp_path):
    #                user nice system idle iowait irq softirq steal guest guest_nice
    write_stat(tmp_path, {0: [100, 5, 20, 900, 30, 1, 2, 40, 0, 0], 1: [10, 0, 5, 50, 0, 0, 0, 7, 0, 0]})
    assert machine.cpu_times(tmp_path) == {0: (128, 40), 1: (15, 7)}
    (tmp_path / "short").mkdir()  # an old kernel's lines, a blank line and one that does not parse
    (tmp_path / "short" / "stat").write_text("cpu  1 2 3 4\ncpu0 1 2 3 4\n\ncpu1 x 2 3 4\ncpux 1 2\n")
    assert machine.cpu_times(tmp_path / "short") == {0: (6, 0)}
    assert machine.cpu_times(tmp_path / "absent") == {}


def test_each_process_is_named_between_its_first_and_last_parenthesis_and_one_unreadable_is_left_out(tmp_path):
    write_process(tmp_path, 41, "sglang::scheduler (1)", 300, 100, start=5000)
    write_process(tmp_path, 42, "tar", 10, 0, start=7000)
    (tmp_path / "43").mkdir()  # no stat: it ended between the listing and the read
    (tmp_path / "44").mkdir()
    (tmp_path / "44" / "stat").write_text("44 (cut) S 1\n")  # too short to hold its times
    (tmp_path / "self").mkdir()  # not a pid
    assert machine.process_times(tmp_path) == {41: ("sglang::scheduler (1)", 400 / TICK, 5000),
                                               42: ("tar", 10 / TICK, 7000)}


def test_a_thread_is_read_by_its_id_its_time_on_a_cpu_and_runnable_its_preemptions_and_last_cpu(tmp_path):
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "schedstat").write_text("2500000000 400000000 1234\n")
    (tmp_path / "77" / "stat").write_text(stat_line(77, "python (x)", cpu=5))
    (tmp_path / "77" / "status").write_text("voluntary_ctxt_switches:\t9\nnonvoluntary_ctxt_switches:\t31\n")
    assert machine.task(77, tmp_path) == {"tid": 77, "run_s": 2.5, "runnable_s": 0.4, "involuntary": 31, "cpu": 5,
                                          "migrations": None}  # a kernel that publishes no sched file
    (tmp_path / "77" / "sched").write_text("python (77, #threads: 3)\n----\nse.exec_start   :   12.5\n"
                                           "se.nr_migrations                             :                   14\n")
    assert machine.task(77, tmp_path)["migrations"] == 14
    (tmp_path / "77" / "status").write_text("voluntary_ctxt_switches:\t9\n")  # a kernel without the count
    assert machine.task(77, tmp_path) is None and machine.task(78, tmp_path) is None  # and a thread gone


def schedstats() -> dict:
    """This thread as the kernel accounts it, or a skip where it keeps no scheduler statistics (a kernel without
    them prints zeros; a sandbox's /proc may have no schedstat)."""
    me = machine.task(threading.get_native_id())
    if me is None or me["run_s"] == 0:
        pytest.skip("this kernel keeps no scheduler statistics for its threads (/proc/<tid>/schedstat)")
    return me


def test_this_machines_own_thread_reads_as_one_of_its_cpus():
    me = schedstats()
    assert me["run_s"] > 0 and os.path.isdir(f"/sys/devices/system/cpu/cpu{me['cpu']}")


def test_a_cores_siblings_are_read_from_its_topology_lists_and_ranges(tmp_path):
    for cpu, text in ((0, "0,8"), (8, "0,8"), (3, "2-3"), (5, "5"), (6, "6,x")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text + "\n")
    assert machine.siblings(0, tmp_path) == [8] and machine.siblings(8, tmp_path) == [0]
    assert machine.siblings(3, tmp_path) == [2] and machine.siblings(5, tmp_path) == []
    assert machine.siblings(7, tmp_path) == [] and machine.siblings(6, tmp_path) == []  # unpublished, unparsed


def forward(run_s, runnable_s, involuntary, cpu, tid=7, migrations=None):
    return {"tid": tid, "run_s": run_s, "runnable_s": runnable_s, "involuntary": involuntary, "cpu": cpu,
            "migrations": migrations}


def test_a_window_averages_cpus_over_its_wall_time_weighs_the_forwards_cpu_beside_it_and_lists_processes(tmp_path):
    (tmp_path / "cpu1" / "topology").mkdir(parents=True)
    (tmp_path / "cpu1" / "topology" / "thread_siblings_list").write_text("1,3\n")
    t = TICK  # one second of ticks
    before = {"t": 10.0, "uptime": 100.0, "cpus": {0: (0, 0), 1: (0, 0), 2: (5, 0), 3: (0, 0)},
              "forward": forward(1.0, 0.25, 4, 1),
              "processes": {7: ("scheduler", 5.0, 100), 8: ("tar", 1.0, 200), 9: ("idle", 2.0, 300),
                            11: ("run.py", 3.0, 400), 12: ("old", 9.0, 500)}}
    after = {"t": 12.0, "uptime": 102.0, "cpus": {0: (2 * t, 0), 1: (2 * t, t // 2), 2: (0, 0), 3: (2 * t, 0)},
             "forward": forward(2.5, 0.35, 7, 1),
             "processes": {7: ("scheduler", 6.5, 100), 8: ("tar", 1.2, 200), 9: ("idle", 2.0, 300),
                           10: ("new", 0.3, 101 * TICK), 11: ("run.py", 3.1, 400), 12: ("reused", 0.5, 101 * TICK),
                           13: ("unread", 7.0, 50)}}
    doc = machine.window(before, after, client=11, cpus=tmp_path)
    assert doc["wall_s"] == 2.0 and doc["cpus"] == 4
    assert doc["busy_cpus"] == pytest.approx(3.0) and doc["stolen_cpus"] == pytest.approx(0.25)  # CPU 2 went back
    # started in the window (a new pid, or an old one taken again): from zero; older but unread before: left out
    assert [(p["name"], p["start"], round(p["cpu_s"], 6), p.get("client", False)) for p in doc["processes"]] == [
        ("scheduler", 100, 1.5, False), ("reused", 101 * TICK, 0.5, False), ("new", 101 * TICK, 0.3, False),
        ("tar", 200, 0.2, False), ("run.py", 400, 0.1, True)]
    assert doc["forward"] == {"tid": 7, "run_s": 1.5, "runnable_s": pytest.approx(0.1), "involuntary": 3,
                              "cpu_before": 1, "cpu": 1, "moved": False}
    # CPU 1 busy the whole window, three quarters of it the forward's own run
    assert doc["core"] == {"cpu": 1, "busy": pytest.approx(1.0), "others": pytest.approx(0.25),
                           "stolen": pytest.approx(0.25), "siblings": [{"cpu": 3, "busy": pytest.approx(1.0)}]}
    moved = machine.window(before, {**after, "forward": forward(2.5, 0.35, 7, 0)}, cpus=tmp_path)
    assert moved["forward"]["moved"] and moved["core"]["cpu"] == 0 and moved["core"]["siblings"] == []
    # away and back to the CPU it started on: its migrations say so where the kernel counts them
    back = {**before, "forward": forward(1.0, 0.25, 4, 1, migrations=3)}
    assert machine.window(back, {**after, "forward": forward(2.5, 0.35, 7, 1, migrations=5)})["forward"]["moved"]
    assert not machine.window(back, {**after, "forward": forward(2.5, 0.35, 7, 1, migrations=3)})["forward"]["moved"]
    alone = machine.window(before, {**after, "forward": forward(9.0, 0.35, 7, 1)}, cpus=tmp_path)
    assert alone["core"]["others"] == 0.0  # the thread's time counted past the CPU's ticks: none beside it
    assert "forward" not in machine.window(before, {**after, "forward": None})  # the thread gone at the end
    assert "forward" not in machine.window(before, {**after, "forward": forward(2.5, 0.35, 7, 1, tid=8)})
    assert machine.window({**before, "cpus": {}}, after) is None  # no /proc to read
    assert machine.window(after, after) is None  # no time between the readings


def test_a_real_window_sees_this_thread_and_process_burn_cpu_and_marks_the_client():
    """This machine's own /proc: a window in which this process's thread spins until the kernel has charged it
    CPU, read as the forward's thread."""
    schedstats()
    me = threading.get_native_id()
    before = machine.reading(True, me)
    assert before["cpus"] and os.getpid() in before["processes"] and before["forward"]["tid"] == me
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sum(range(10_000))
        now = machine.task(me)
        if now["run_s"] - before["forward"]["run_s"] >= 0.1:
            break
    after = machine.reading(False, me)
    doc = machine.window(before, after, client=os.getpid())
    assert doc["cpus"] == len(before["cpus"]) and doc["busy_cpus"] > 0
    assert any(p["pid"] == os.getpid() and p.get("client") and p["cpu_s"] >= 0.05 for p in doc["processes"])
    assert doc["forward"]["run_s"] >= 0.1
    assert all(us > 0 for us in doc["canary_us"])  # the loop timed at both ends


def test_a_window_reads_its_own_work_outside_what_it_times(monkeypatch):
    """The first reading scans the processes and times the canary before it reads the thread, the CPUs and the
    clock; the last reads the clock, the CPUs and the thread before it scans and times again."""
    calls = []
    for name in ("canary", "process_times", "uptime", "task", "cpu_times"):
        monkeypatch.setattr(machine, name, lambda *a, _n=name, **k: calls.append(_n) or {})
    monkeypatch.setattr(machine.time, "monotonic", lambda: calls.append("clock") or 1.0)
    machine.reading(True, forward=7)
    assert calls == ["canary", "process_times", "uptime", "task", "cpu_times", "clock"]
    calls.clear()
    machine.reading(False, forward=7)
    assert calls == ["clock", "cpu_times", "task", "process_times", "uptime", "canary"]


def test_the_canary_takes_longer_for_a_longer_loop_and_keeps_the_least_of_its_rounds(monkeypatch):
    ticks = iter([0, 5_000_000, 0, 2_000_000, 0, 9_000_000])  # three rounds of 5, 2 and 9 ms
    monkeypatch.setattr(machine.time, "perf_counter_ns", lambda: next(ticks))
    assert machine.canary(loops=10, rounds=3) == 2000.0
    monkeypatch.undo()
    short = min(machine.canary(loops=2_000) for _ in range(5))
    assert min(machine.canary(loops=200_000) for _ in range(3)) > 10 * short  # a hundred times the work


def test_the_forward_is_the_servers_one_main_thread():
    threads = {"5": {"name": "MainThread", "cpu_s": 1.0, "waits": 3},
               "6": {"name": "vskipper-state-writer", "cpu_s": 0.1, "waits": 9}}
    assert run.forward_tid(threads) == 5
    assert run.forward_tid({"6": threads["6"]}) is None  # none attested
    assert run.forward_tid({**threads, "9": threads["5"]}) is None  # two replicas' tables: no one forward


def window(busy, wall, others, siblings, pid_cpu, runnable=0.002, moved=False, core=True):
    return {"wall_s": wall, "cpus": 4, "busy_cpus": busy, "stolen_cpus": busy / 10,
            "forward": {"tid": 5, "run_s": 0.05 * wall, "runnable_s": runnable, "involuntary": 2, "cpu_before": 1,
                        "cpu": 2 if moved else 1, "moved": moved}, "canary_us": [1000 + busy * 100, 1500.0],
            **({"core": {"cpu": 1, "busy": others + 0.05, "others": others, "stolen": 0.0, "siblings": siblings}}
               if core else {}),
            "processes": [{"pid": 5, "start": 10, "name": "leftover", "cpu_s": pid_cpu},
                          {"pid": 6, "start": 20, "name": "python", "cpu_s": 0.01, "client": True}]}


def test_a_lengths_prompts_pool_their_seconds_over_their_wall_time_and_a_core_without_siblings_has_no_figure():
    windows = [window(1.0, 0.1, 0.2, [{"cpu": 3, "busy": 0.2}], 0.1),
               window(3.0, 0.3, 0.6, [{"cpu": 3, "busy": 0.8}], 0.1, runnable=0.008),
               window(9.0, 0.1, 0.9, [{"cpu": 3, "busy": 0.4}], 0.1, moved=True)]  # moved: its CPU not weighed
    m = run.machine_pooled(windows)
    assert m["windows"] == 3 and m["busy_cpus"] == pytest.approx((0.1 + 0.9 + 0.9) / 0.5)
    assert m["stolen_cpus"] == pytest.approx(m["busy_cpus"] / 10)
    assert m["runnable_ms"] == pytest.approx(4.0) and m["involuntary"] == 2 and m["moved"] == 1
    assert m["forward_cpus"] == [1, 1, 2]
    assert m["core_others"] == pytest.approx((0.02 + 0.18) / 0.4) and m["weighed"] == 2
    assert m["sibling_busy"] == pytest.approx((0.02 + 0.24) / 0.4)
    assert [(p["name"], round(p["cpu_s"], 6), p.get("client", False)) for p in m["processes"]] == [
        ("leftover", 0.3, False), ("python", 0.03, True)]
    alone = run.machine_pooled([window(1.0, 0.1, 0.6, [], 0.0)])
    assert alone["core_others"] == pytest.approx(0.6) and alone["sibling_busy"] is None
    unread = run.machine_pooled([window(1.0, 0.1, 0.6, [], 0.0), {**window(1.0, 0.1, 0.6, [], 0.0), "forward": None,
                                                                  "core": None}])
    assert unread["runnable_ms"] is None and unread["involuntary"] is None  # not every prompt read the thread
    cell = {"tokens": 32, "ttft_s": 0.02, "pass_spans": {"host_ms": 1.0, "device_ms": None, "passes": 1}}
    rows = [line for line in run.pass_span_lines({"a": {"prefill": [{**cell, "machine": m}]},
                                                  "b": {"prefill": [{**cell, "machine": alone}]},
                                                  "c": {"prefill": [cell]}}) if line.startswith("| 32 |")]
    assert m["canary_us"] == 1500  # the median of both ends of every prompt: 1100, 1300, 1900 and 1500 three times
    assert rows[0].endswith(f"| 1 | {m['busy_cpus']:.2f} of 4 | {m['stolen_cpus']:.2f} | 4.0 | 2.0 | "
                            "50% (65%), 2 of 3 | 1500 |")
    assert rows[1].endswith("| 1.00 of 4 | 0.10 | 2.0 | 2.0 | 60% (no sibling), 1 of 1 | 1300 |")
    assert rows[2].endswith("| 1 | n/a | n/a | n/a | n/a | n/a | n/a |")  # a sweep from before the machine's reading


def test_the_clock_windows_machine_row_sums_the_forwards_waits_and_names_a_moved_cpu():
    windows = [window(2.0, 1.0, 0.5, [{"cpu": 11, "busy": 0.9}], 1.0),
               window(4.0, 3.0, 0.1, [], 2.5, runnable=0.003, moved=True)]
    row = run.machine_row(windows)
    assert row == ("3.50 of 4 | 0.35 | 5.0 ms, 4 preempted; CPU 1, 1 -> 2 | 50% (11 90%), n/a | 1200 / 1500, "
                   "1400 / 1500 | leftover 5 3.50 s, python 6 (client) 0.02 s")
    reused = [{**windows[0], "processes": [{"pid": 5, "start": 99, "name": "again", "cpu_s": 0.4}]}, windows[1]]
    assert run.process_list(reused) == "leftover 5 2.50 s, again 5 0.40 s, python 6 (client) 0.01 s"
    assert run.machine_row([{**windows[0], "forward": None, "core": None}]).startswith("2.00 of 4 | 0.20 | n/a | n/a")
