"""The forward's stack samples (`vskipper.sglang.stack_samples`): a sampler thread ticks while a pass runs, the
thread that runs it (the main thread, at a signal) or the sampler reads its frames, and counts per phase where it
stood; the part clock starts it where the serve spec asks (`ENV_STACK_SAMPLES`)."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest
from pass_modes import Mode

from vskipper.sglang.part_times import PartClock
from vskipper.sglang.spec import ENV_STACK_SAMPLES, ServeConfigError, ServeSpec
from vskipper.sglang.stack_samples import (
    KINDS,
    StackSampler,
    frame_key,
    next_tick_s,
    sample_keys,
    top,
    window,
)


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_frame_is_counted_by_its_files_last_two_parts_its_function_and_its_line():
    frame = sys._getframe()
    assert frame_key(frame) == f"tests/test_stack_samples.py:{frame.f_code.co_name}:{frame.f_lineno}"
    keys = sample_keys(frame)
    # this test's own frame is the innermost; pytest's frames hold no vSkipper or SGLang code
    assert keys["innermost"].startswith("tests/test_stack_samples.py:test_a_frame_is_counted")
    assert set(keys) == {"innermost"}


def spin_until(taken, samples: int, deadline_s: float = 20.0) -> None:
    """Spin until `taken()` reaches `samples` (a loaded machine's sampler wakes late), or the deadline."""
    end = time.monotonic() + deadline_s
    while taken() < samples and time.monotonic() < end:
        spin(0.01)


def test_the_sampler_reads_the_running_threads_frames_only_while_a_pass_runs_and_publishes_after(monkeypatch):
    """Samples while `running` names the thread, by phase, from a pass's begin to its end; none between passes,
    where it does not even look; the counts reach `view` once the pass has ended, each field replaced whole; a
    sleeping sampler stops at once."""
    import vskipper.sglang.stack_samples as stack_samples

    monkeypatch.setattr(stack_samples, "IDLE_CHECK_S", 60.0)
    running: list = [None]
    looks = [0]

    def named():
        looks[0] += 1
        return running[0]

    sampler = StackSampler(named, interval_s=0.001)
    sampler.start()
    try:
        spin(0.05)  # no pass: nothing sampled, and the sampler sleeps
        assert sampler.samples == {} and looks[0] == 0
        running[0] = (threading.get_ident(), "prefill")
        spin(0.05)  # named but not begun: the sampler sleeps
        assert sampler.samples == {}
        sampler.begin()
        spin_until(lambda: sampler.samples.get("prefill", 0), 10)
        running[0] = None
        sampler.end()
        end = time.monotonic() + 5.0
        while sampler.view["samples_total"] != dict(sampler.samples) and time.monotonic() < end:
            time.sleep(0.005)
        # the pass ended: counts published, then asleep again (no more looks)
        seen = looks[0]
        spin(0.05)
        assert looks[0] <= seen + 1
    finally:
        t0 = time.monotonic()
        sampler.stop()
        sampler.join(10.0)
    # stopped by waking it: a sampler left asleep would look again only after IDLE_CHECK_S (patched to a minute)
    assert not sampler.is_alive() and time.monotonic() - t0 < 10.0
    view = sampler.view
    assert view["samples_total"]["prefill"] >= 10 and set(view["samples_total"]) == {"prefill"}
    innermost = view["innermost"]["prefill"]
    # the pass spent its time in spin(): most samples stood there (the sampler needs the interpreter's lock, which
    # the spinning thread gives up at its switch interval, so each sample lands inside the loop)
    spun = sum(n for key, n in innermost.items() if ":spin:" in key)
    assert spun >= 0.8 * view["samples_total"]["prefill"]
    assert top(innermost, 1)[0][0].startswith("tests/test_stack_samples.py:spin:")
    assert view["vskipper"] == {} and view["sglang"] == {}  # no frame of either in this test's stack


def test_whose_code_a_frame_is_goes_by_where_each_package_lies_not_by_folder_names():
    import importlib.util
    import os

    import torch.nn.functional

    import vskipper.sglang.part_times as part_times
    from vskipper.sglang.stack_samples import code_of

    assert code_of(part_times.__file__) == "vskipper"  # vSkipper's SGLang glue, not SGLang's
    sglang = list(importlib.util.find_spec("sglang").submodule_search_locations)[0]  # found, not imported
    assert code_of(os.path.join(sglang, "srt", "layers", "radix_attention.py")) == "sglang"
    assert code_of(os.path.join(sglang, "lang", "api.py")) is None  # SGLang's runtime alone
    assert code_of(torch.nn.functional.__file__) is None
    # a checkout in a folder named like a package counts nothing of its own by that name
    assert code_of("/home/u/vskipper/.venv/lib/python3.11/site-packages/triton/runtime/jit.py") is None


def test_a_window_of_samples_is_the_difference_of_two_readings():
    before = {"samples_total": {"prefill": 10}, "innermost": {"prefill": {"a": 6, "b": 4}}}
    after = {"samples_total": {"prefill": 25, "decode": 3}, "innermost": {"prefill": {"a": 6, "b": 9, "c": 10}}}
    assert window(before, after, "prefill", "innermost") == (15, {"b": 5, "c": 10})
    assert window(None, after, "decode", "vskipper") == (3, {})
    assert window(before, None, "prefill", "innermost") == (0, {})


def test_the_part_clock_samples_its_passes_where_asked_and_attests_them():
    """A clock with `samples` starts a sampler over its passes: the pass's phase and thread, the counts in the
    attestation's `samples`; a clock without it has none."""
    clock = PartClock(usage=None, collector=None, samples=True)
    try:
        clock.around_pass(Mode(decode=False), lambda: spin_until(lambda: clock.sampler.samples.get("prefill", 0), 10),
                          tokens=64)
        end = time.monotonic() + 5.0
        while not clock.attestation()["samples"]["samples_total"] and time.monotonic() < end:
            time.sleep(0.005)
        samples = clock.attestation()["samples"]
        assert samples["samples_total"]["prefill"] >= 10
        assert set(samples) == {"interval_s", "mode", "samples_by_mode", "samples_total", "seconds_total", *KINDS}
        # the pass ran in the main thread, which made the clock: every sample read there at a signal
        assert samples["mode"] == "signal" and samples["samples_by_mode"] == {"signal": samples["samples_total"]["prefill"]}
        assert any(":spin:" in key for key in samples["innermost"]["prefill"])
        # the clock's own frame (the pass it wraps) is vSkipper's innermost; no frame of SGLang's runtime here
        assert all(key.startswith("vskipper/sglang/part_times.py:") for key in samples["vskipper"]["prefill"])
        assert samples["sglang"] == {}
    finally:
        clock.sampler.stop()
    assert "samples" not in PartClock(usage=None, collector=None).attestation()


def test_the_serve_spec_carries_the_stack_samples_through_the_environment_and_refuses_other_values():
    from vskipper.arms import get_arm

    env = ServeSpec(get_arm("dense"), 0, 0, pass_spans=True, stack_samples=True).to_env()
    assert env[ENV_STACK_SAMPLES] == "1" and ServeSpec.from_env(env).stack_samples
    assert not ServeSpec.from_env(ServeSpec(get_arm("dense"), 0, 0).to_env()).stack_samples
    with pytest.raises(ServeConfigError, match=f"{ENV_STACK_SAMPLES} must be 0 or 1, got 'yes'"):
        ServeSpec.from_env({**env, ENV_STACK_SAMPLES: "yes"})


def test_a_reader_gets_the_samples_so_far_while_passes_run_back_to_back():
    """Passes without a gap for the sampler to publish in: the clock's reader (`read_device`, which the state
    writer calls before each document) publishes them itself."""
    clock = PartClock(usage=None, collector=None, samples=True)
    try:
        passes = 0
        while clock.sampler.samples.get("decode", 0) < 5 and passes < 1000:  # 10 passes or so on an idle machine
            clock.around_pass(Mode(decode=True), lambda: spin(0.02), tokens=8)
            passes += 1
        clock.read_device()
        samples = clock.attestation()["samples"]
        assert samples["samples_total"]["decode"] >= 5
        assert sum(samples["innermost"]["decode"].values()) == samples["samples_total"]["decode"]
    finally:
        clock.sampler.stop()


def nap_head(seconds: float) -> None:
    """A pass's first part: it lets the interpreter's lock go often, as a forward's launches do."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        time.sleep(0.0002)


def nap_tail(seconds: float) -> None:
    """The rest of the pass, likewise."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        time.sleep(0.0002)


def test_a_sampler_woken_by_a_pass_waits_for_the_next_tick_not_a_whole_interval():
    """Ticks lie on the clock's multiples of the interval: woken 2.3 ms into a 5 ms tick, it waits 2.7 ms."""
    assert next_tick_s(12.3e-3, 5e-3) == pytest.approx(2.7e-3)
    assert next_tick_s(10.0e-3 + 1e-9, 5e-3) == pytest.approx(5e-3)
    assert 0 < next_tick_s(time.monotonic(), 5e-3) <= 5e-3


def test_the_start_of_a_pass_after_a_gap_is_sampled_too():
    """Passes with a gap between them, each 4 ms of one part then 16 ms of another at a 5 ms interval: the first
    part is sampled (about a fifth of the samples on an idle machine; a sampler that waited a whole interval on
    waking would give it none). Only that it is sampled is asserted: on a loaded machine the sampler's thread
    wakes late, which takes samples off the head at random."""
    running: list = [None]
    sampler = StackSampler(lambda: running[0], interval_s=0.005)
    sampler.start()
    try:
        for _ in range(40):
            running[0] = (threading.get_ident(), "prefill")
            sampler.begin()
            nap_head(0.004)
            nap_tail(0.016)
            running[0] = None
            sampler.end()
            time.sleep(0.003)
    finally:
        sampler.stop()
        sampler.join(5.0)
    counts = sampler.counts["innermost"]["prefill"]
    head = sum(n for key, n in counts.items() if ":nap_head:" in key)
    tail = sum(n for key, n in counts.items() if ":nap_tail:" in key)
    assert head > 0 and tail > head  # about 30 and 130 at 5 ms over 0.8 s of passes on an idle machine
    assert sampler.seconds["prefill"] > 0  # what the samples held the lock, counted


needs_signal = pytest.mark.skipif(not hasattr(signal, "SIGUSR2") or not hasattr(signal, "pthread_kill"),
                                  reason="no SIGUSR2 to signal a thread with here")


def sample_until(sampler, ident, phase, work, samples: int = 20, deadline_s: float = 20.0) -> None:
    """`sampler` over passes of `phase` by thread `ident`, each running `work(0.02)`, until it has counted
    `samples` of them (or the deadline: a loaded machine hands the interpreter's lock over late)."""
    running: list = [None]
    sampler.running = lambda: running[0]
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        running[0] = (ident, phase)
        sampler.begin()
        work(0.02)
        running[0] = None
        sampler.end()
        sampler.publish()
        if sampler.samples[phase] >= samples:
            return


@needs_signal
def test_the_main_threads_passes_are_sampled_by_the_thread_itself_at_a_signal_and_others_by_the_sampler():
    """Made in the main thread, the sampler signals it and the main thread reads its own stack (a thread that
    walks another's frames can crash CPython 3.11); two such samplers share the handler and each counts what it
    asked for; a forward on another thread, or a sampler told not to signal, is read by the sampler's thread; a
    sampler made off the main thread, or where someone else handles the signal, cannot take it."""
    from vskipper.sglang import stack_samples

    main = StackSampler(lambda: None, interval_s=0.002)
    twin = StackSampler(lambda: None, interval_s=0.002)
    assert main.mode == twin.mode == "signal" and main.view["mode"] == "signal"
    assert signal.getsignal(signal.SIGUSR2) is stack_samples._dispatch
    main.start()
    twin.start()
    try:
        sample_until(main, threading.get_ident(), "prefill", spin)
        sample_until(twin, threading.get_ident(), "decode", spin)  # the other sampler's ticks meanwhile: none
    finally:
        for s in (main, twin):
            s.stop()
            s.join(5.0)
    for s, phase in ((main, "prefill"), (twin, "decode")):
        assert s.samples[phase] >= 20 and set(s.samples) == {phase} and s.by_mode == {"signal": s.samples[phase]}
        assert top(s.counts["innermost"][phase], 1)[0][0].startswith("tests/test_stack_samples.py:spin:")
        assert s._asked is None and s not in stack_samples._signalled  # every signal handled; stopped
    assert StackSampler(lambda: None, signals=False).mode == "thread"
    other = {}
    worker = threading.Thread(target=lambda: other.update(sampler=StackSampler(lambda: None)))
    worker.start()
    worker.join()
    assert other["sampler"].mode == "thread"  # made off the main thread
    previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # someone else's handler
    try:
        assert StackSampler(lambda: None).mode == "thread"
    finally:
        signal.signal(signal.SIGUSR2, previous)
        signal.siginterrupt(signal.SIGUSR2, False)

    done = threading.Event()
    ident: list = []

    def forward():  # a forward on another thread: read by the sampler's thread whatever its mode
        ident.append(threading.get_ident())
        while not done.is_set():
            spin(0.001)

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()
    while not ident:
        time.sleep(0.001)
    walker = StackSampler(lambda: None, interval_s=0.002)
    walker.start()
    try:
        sample_until(walker, ident[0], "prefill", time.sleep)
    finally:
        done.set()
        thread.join(5.0)
        walker.stop()
        walker.join(5.0)
    assert walker.mode == "signal" and walker.by_mode == {"thread": walker.samples["prefill"]} and \
        walker.samples["prefill"] >= 20


@needs_signal
def test_a_handler_that_fails_stops_its_sampler_and_never_the_forward(monkeypatch):
    """The handler runs inside the forward: a sample that raises there is the sampler's error, not the pass's."""
    from vskipper.sglang import stack_samples

    sampler = StackSampler(lambda: None, interval_s=0.002)

    def broken(frame):
        raise ValueError("no keys")

    monkeypatch.setattr(stack_samples, "sample_keys", broken)
    sampler.start()
    try:
        running = (threading.get_ident(), "prefill")
        sampler.running = lambda: running
        sampler.begin()
        end = time.monotonic() + 10.0
        while "error" not in sampler.view and time.monotonic() < end:
            spin(0.01)  # the forward runs on through the handler's failure
        sampler.end()
    finally:
        sampler.stop()
        sampler.join(5.0)
    assert sampler.view["error"] == "ValueError: no keys" and sampler not in stack_samples._signalled


@needs_signal
def test_a_signal_handled_elsewhere_after_the_start_stops_the_sampler_without_signalling():
    """Someone sets the signal's handler after the sampler took it (a default one would end the process at the
    next signal): the sampler sends none, says so and stops."""
    running = (threading.get_ident(), "prefill")  # this, the main thread, runs a pass
    sampler = StackSampler(lambda: running, interval_s=0.002)
    previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        sampler.start()
        sampler.begin()
        sampler.join(5.0)
    finally:
        signal.signal(signal.SIGUSR2, previous)
        signal.siginterrupt(signal.SIGUSR2, False)
    assert not sampler.is_alive() and "handled elsewhere" in sampler.view["error"] and sampler.samples == {}
