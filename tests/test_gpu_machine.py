"""What the whole machine did in a window (`benchmarks/gpu/machine.py`): read for real from this Linux machine's
/proc, and from written tables whose every case is known."""

import os
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


def write_process(proc, pid: int, name: str, utime: int, stime: int) -> None:
    (proc / str(pid)).mkdir(exist_ok=True)
    fields = ["S", "1", "1", "1", "0", "-1", "4194560", "10", "0", "0", "0", str(utime), str(stime)]
    (proc / str(pid) / "stat").write_text(f"{pid} ({name}) " + " ".join(fields + ["0"] * 30) + "\n")


def test_each_cpus_busy_and_stolen_ticks_leave_idle_iowait_and_steal_out_of_busy(tmp_path):
    #                user nice system idle iowait irq softirq steal guest guest_nice
    write_stat(tmp_path, {0: [100, 5, 20, 900, 30, 1, 2, 40, 0, 0], 1: [10, 0, 5, 50, 0, 0, 0, 7, 0, 0]})
    assert machine.cpu_times(tmp_path) == {0: (128, 40), 1: (15, 7)}
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "stat").write_text("cpu  1 2 3 4\ncpu0 1 2 3 4\n")  # an old kernel: no steal column
    assert machine.cpu_times(tmp_path / "short") == {0: (6, 0)}
    assert machine.cpu_times(tmp_path / "absent") == {}


def test_each_process_is_named_between_its_first_and_last_parenthesis_and_one_that_ended_is_left_out(tmp_path):
    write_process(tmp_path, 41, "sglang::scheduler (1)", 300, 100)
    write_process(tmp_path, 42, "tar", 10, 0)
    (tmp_path / "43").mkdir()  # no stat: it ended between the listing and the read
    (tmp_path / "self").mkdir()  # not a pid
    assert machine.process_times(tmp_path) == {41: ("sglang::scheduler (1)", 400 / TICK), 42: ("tar", 10 / TICK)}


def test_a_cores_siblings_are_read_from_its_topology_lists_and_ranges(tmp_path):
    for cpu, text in ((0, "0,8"), (8, "0,8"), (3, "2-3"), (5, "5")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text + "\n")
    assert machine.siblings(0, tmp_path) == [8] and machine.siblings(8, tmp_path) == [0]
    assert machine.siblings(3, tmp_path) == [2] and machine.siblings(5, tmp_path) == []
    assert machine.siblings(7, tmp_path) == []  # no topology published


def test_a_window_averages_busy_and_stolen_cpus_over_its_wall_time_and_lists_the_busiest_processes(tmp_path):
    (tmp_path / "cpu1" / "topology").mkdir(parents=True)
    (tmp_path / "cpu1" / "topology" / "thread_siblings_list").write_text("1,3\n")
    t = TICK  # one second of ticks
    before = {"t": 10.0, "cpus": {0: (0, 0), 1: (0, 0), 2: (0, 0), 3: (0, 0)},
              "processes": {7: ("scheduler", 5.0), 8: ("tar", 1.0), 9: ("idle", 2.0), 11: ("run.py", 3.0)}}
    after = {"t": 12.0, "cpus": {0: (2 * t, 0), 1: (t, t // 2), 2: (0, 0), 3: (2 * t, 0)},
             "processes": {7: ("scheduler", 6.5), 8: ("tar", 1.2), 9: ("idle", 2.0), 10: ("new", 0.3),
                           11: ("run.py", 3.1)}}
    doc = machine.window(before, after, core=1, top=3, client=11, cpus=tmp_path)
    assert doc["wall_s"] == 2.0 and doc["cpus"] == 4
    assert doc["busy_cpus"] == pytest.approx(2.5) and doc["stolen_cpus"] == pytest.approx(0.25)
    assert [(p["name"], round(p["cpu_s"], 6)) for p in doc["processes"]] == [
        ("scheduler", 1.5), ("new", 0.3), ("tar", 0.2)]  # started in the window: from zero; the idle one left out
    assert doc["core"] == {"cpu": 1, "busy": pytest.approx(0.5), "stolen": pytest.approx(0.25),
                           "siblings": [{"cpu": 3, "busy": pytest.approx(1.0)}]}
    assert [p.get("client") for p in machine.window(before, after, client=11)["processes"]][-1] is True
    assert "core" not in machine.window(before, after) and "core" not in machine.window(before, after, core=9)
    assert machine.window({**before, "cpus": {}}, after) is None  # no /proc to read
    assert machine.window(after, after) is None  # no time between the readings


def test_a_real_window_sees_this_process_burn_cpu_and_marks_it_the_client():
    """This machine's own /proc: a window in which this process spins until the kernel has charged it CPU."""
    before = machine.reading()
    assert before["cpus"] and os.getpid() in before["processes"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sum(range(10_000))
        mine = machine.process_times().get(os.getpid())
        if mine and mine[1] - before["processes"][os.getpid()][1] >= 0.1:
            break
    after = machine.reading()
    doc = machine.window(before, after, core=0, client=os.getpid())
    assert doc["cpus"] == len(before["cpus"]) and doc["busy_cpus"] > 0
    assert any(p["pid"] == os.getpid() and p.get("client") and p["cpu_s"] >= 0.1 for p in doc["processes"])
    assert doc["core"]["cpu"] == 0 and 0 <= doc["core"]["busy"]


def test_the_forward_machine_takes_the_core_of_the_schedulers_main_thread_alone():
    before = {"t": 0.0, "cpus": {0: (0, 0), 1: (0, 0)}, "processes": {}}
    after = {"t": 1.0, "cpus": {0: (TICK, 0), 1: (0, 0)}, "processes": {}}
    threads = {"5": {"name": "MainThread", "cpu_s": 1.0, "waits": 3, "cpu": 0},
               "6": {"name": "vskipper-state-writer", "cpu_s": 0.1, "waits": 9, "cpu": 1}}
    assert run.forward_machine(before, after, threads)["core"]["cpu"] == 0
    assert "core" not in run.forward_machine(before, after, {"6": threads["6"]})  # no main thread named
    unplaced = {"5": {k: v for k, v in threads["5"].items() if k != "cpu"}}  # a kernel that gives no CPU
    assert "core" not in run.forward_machine(before, after, unplaced)


def test_a_lengths_prompts_machine_is_their_medians_and_a_core_without_hyperthreads_has_no_sibling_figure():
    def window(busy, core_busy, siblings, pid_cpu):
        return {"wall_s": 0.1, "cpus": 4, "busy_cpus": busy, "stolen_cpus": busy / 10,
                "core": {"cpu": 2, "busy": core_busy, "stolen": 0.0, "siblings": siblings},
                "processes": [{"pid": 5, "name": "leftover", "cpu_s": pid_cpu},
                              {"pid": 6, "name": "python", "cpu_s": 0.01, "client": True}]}

    paired = [window(1.0, 0.9, [{"cpu": 3, "busy": 0.2}], 0.1), window(3.0, 0.5, [{"cpu": 3, "busy": 0.8}], 0.1),
              window(2.0, 0.7, [{"cpu": 3, "busy": 0.4}], 0.1), {**window(9.0, 0, [], 0.1), "core": None}]
    m = run.machine_medians(paired)
    assert m["windows"] == 4 and m["busy_cpus"] == 2.5 and m["stolen_cpus"] == pytest.approx(0.25)
    assert m["core_busy"] == 0.7 and m["sibling_busy"] == 0.4 and m["forward_cpus"] == [2, 2, 2]  # three placed
    assert [(p["name"], round(p["cpu_s"], 6), p.get("client", False)) for p in m["processes"]] == [
        ("leftover", 0.4, False), ("python", 0.04, True)]
    alone = run.machine_medians([window(1.0, 0.6, [], 0.0)])
    assert alone["core_busy"] == 0.6 and alone["sibling_busy"] is None
    cell = {"tokens": 32, "ttft_s": 0.02, "pass_spans": {"host_ms": 1.0, "device_ms": None, "passes": 1}}
    rows = [line for line in run.pass_span_lines({"a": {"prefill": [{**cell, "machine": m}]},
                                                  "b": {"prefill": [{**cell, "machine": alone}]},
                                                  "c": {"prefill": [cell]}}) if line.startswith("| 32 |")]
    assert rows[0].endswith("| 1 | 2.50 | 0.25 | 70% (40%) |") and rows[1].endswith("| 1.00 | 0.10 | 60% (no sibling) |")
    assert rows[2].endswith("| 1 | n/a | n/a | n/a |")  # a sweep from before the machine's reading
