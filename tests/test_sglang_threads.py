"""Each thread's CPU time from Linux's /proc (`vskipper.sglang.threads`), read for real and from a written table."""

import os
import threading
import time

from vskipper.sglang import threads


def test_a_thread_that_burns_cpu_between_two_readings_is_the_busiest_under_its_python_name():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    time.sleep(0.01)  # the main thread has given up the processor once before the first reading
    before = threads.thread_cpu()
    spinner = threading.Thread(target=spin, name="spinner", daemon=True)
    spinner.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the kernel has charged it some ticks (10 ms each)
            now = threads.thread_cpu()
            if any(t["name"] == "spinner" and t["cpu_s"] >= 0.05 for t in now.values()):
                break
            time.sleep(0.01)
    finally:
        stop.set()
        spinner.join()
    main = str(threading.main_thread().native_id)
    assert before[main]["name"] == "MainThread" and before[main]["cpu_s"] > 0
    top = threads.busiest(before, now)
    assert any(t["name"] == "spinner" and t["cpu_s"] >= 0.05 for t in top)  # started between them: from zero
    assert now[main]["waits"] >= before[main]["waits"] > 0  # the main thread slept between the readings
    assert [t["cpu_s"] for t in top] == sorted((t["cpu_s"] for t in top), reverse=True)


def test_the_table_parses_a_kernel_name_with_spaces_and_parentheses_and_skips_a_thread_that_ended(tmp_path):
    """utime and stime are the 14th and 15th fields of a task's stat; the name between the first '(' and the
    last ')' may hold both. A task whose stat is gone (ended) is left out; a thread Python did not start keeps its
    kernel name."""
    (tmp_path / "99999999").mkdir()  # past any pid_max: no thread of this process has the id
    (tmp_path / "99999999" / "stat").write_text("101 (cuda (evt) 1) S 1 1 1 0 -1 4194560 10 0 0 0 250 50 0 0 20 0 9 0 "
                                           "1 2 3\n")
    (tmp_path / "99999999" / "status").write_text("Name:\tcuda (evt) 1\nvoluntary_ctxt_switches:\t17\n"
                                             "nonvoluntary_ctxt_switches:\t3\n")
    (tmp_path / "99999998").mkdir()  # no stat: the thread ended between the listing and the read
    table = threads.thread_cpu(tmp_path)
    tick = os.sysconf("SC_CLK_TCK")
    assert table == {"99999999": {"name": "cuda (evt) 1", "cpu_s": 300 / tick, "waits": 17}}
    assert threads.thread_cpu(tmp_path / "absent") == {}


def test_the_allocator_counts_are_cudas_alone():
    assert threads.allocator_counts("cpu") is None and threads.allocator_counts(None) is None


def test_the_busiest_threads_are_those_that_used_the_most_cpu_between_two_readings_at_most_top():
    before = {"1": {"name": "MainThread", "cpu_s": 1.0, "waits": 2}, "2": {"name": "pool", "cpu_s": 0.5, "waits": 0},
              "3": {"name": "pool", "cpu_s": 0.5, "waits": 0}}
    after = {"1": {"name": "MainThread", "cpu_s": 1.5, "waits": 9}, "2": {"name": "pool", "cpu_s": 0.5, "waits": 4},
             "3": {"name": "pool", "cpu_s": 0.6, "waits": 1}, "4": {"name": "new", "cpu_s": 0.2, "waits": 3}}
    assert threads.busiest(before, after) == [  # a thread that waited and used no CPU is left out
        {"tid": "1", "name": "MainThread", "cpu_s": 0.5, "waits": 7},
        {"tid": "4", "name": "new", "cpu_s": 0.2, "waits": 3},  # started between them: from zero
        {"tid": "3", "name": "pool", "cpu_s": 0.6 - 0.5, "waits": 1}]
    assert [t["tid"] for t in threads.busiest(before, after, top=2)] == ["1", "4"]
