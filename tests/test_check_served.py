"""`benchmarks/gpu/check_served.py`: the served routed layer's execution against its torch execution, as the device
run checks it before its first routed server. Here on CPU under the Triton interpreter with a tiny model (the
device's bf16 shapes and its CUDA graphs need the GPU); a fault injected into one of the triton execution's
kernels strays in exactly the cases that run it, and the run's summary says so."""

import json

import pytest
import torch

from benchmarks.gpu import check_served, run
from vskipper.mixed import kernels


def _check(tmp_path) -> dict:
    return check_served.check(torch.device("cpu"), torch.float32, check_served.SMOKE, check_served.DRY_CASES, None,
                              tmp_path)


def test_the_served_layer_agrees_with_its_torch_execution_in_every_case(tmp_path):
    out = tmp_path / "check.json"
    stamp = run.check_stamp(None, "torch")  # as run.py takes it before it starts the check
    assert check_served.main(["--dry-run", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["execution"]["decode"] == "triton"
    # what a later run on this device may reuse it for: this tree's checked code, the packages, the table, the ops
    assert report["stamp"] == stamp and stamp["sglang"] == "0.5.21" and stamp["sgl-kernel"] is None
    # the servers' attention backend (the device run's profile: the stand-ins'), against a reference through another
    assert report["attention_backend"] == "triton" and report["reference_backend"] == "torch_native"
    names = [c["case"] for c in report["cases"]]
    assert len(names) == 26 and sum(n.startswith("decode") for n in names) == 6
    # RandomSkip's fused routes against its own ops, both arms' skippers, at 1, 3 (the padded batch) and 16 rows;
    # the trained gates' fused route against their own, at the same rows
    assert sum(n.startswith("fused routes of ") for n in names) == 6
    assert sum(n.startswith("fused gate of ") for n in names) == 6
    # a batch of 3 replayed from the graph captured for SGLang's next capture size (4), for another batch
    assert sum(" 3 rows replayed from the graph of 4," in n for n in names) == 2
    assert {n.rsplit(", ", 1)[1] for n in names if n.startswith("prefill")} == {"packed read", "backend read"}
    # the s = 0.5 route mixes the cohorts somewhere in each phase; the control's has every row RUN
    for phase in ("decode", "prefill"):
        shares = [c["project_only_share"] for c in report["cases"] if c["case"].startswith(phase)]
        assert any(0 < s < 1 for s in shares)
    assert all(c["project_only_share"] == 0 for c in report["cases"] if ", s=0," in c["case"])
    # the served model's warm-up, timed first: nothing compiles in the interpreter, but it ran and was counted
    warm = report["warm"]
    assert warm["compiled"]["compiles"] == 0 and warm["seconds"] > 0 and warm["compiled"]["kernels"] == {}
    # the served passes watched for host waits: the largest decode batch and each prefill with either read, both
    # routes; none waits anywhere (the backend's read included)
    watched = [w["case"] for w in report["host_waits"]]
    assert len(watched) == 10 and sum(n.startswith("decode 5 rows") for n in watched) == 2
    assert report["host_waits_watch"] is None  # it saw the known wait
    assert all(w["ok"] and w["waits"] == [] for w in report["host_waits"])
    # beside each, the dense pass: through SGLang's torch-native backend (the rig's own here) it reads the requests'
    # lengths on the host, seen at SGLang's frames; through its Triton backend (the backend reads) it waits for none
    for w in report["host_waits"]:
        sites = {d["where"].split(":")[0] for d in w["dense_waits"]}
        assert not any(d["own"] for d in w["dense_waits"])
        assert sites == (set() if w["case"].endswith("backend read") else
                         {"sglang/srt/layers/attention/torch_native_backend.py"}), w
    # the same passes timed, host against device: on CPU the host's alone, no span and no host-bound verdict
    issued = report["host_issue"]
    assert [t["case"] for t in issued] == watched
    assert all(t[side]["host_ms"] > 0 and t[side]["device_ms"] is None and t[side]["host_bound"] is None
               for t in issued for side in ("routed", "dense"))
    assert report["host_issue_rule"] == {"reps": check_served.DRY_CASES["issue_reps"],
                                         "host_bound": check_served.HOST_BOUND}


def test_a_host_wait_in_the_served_pass_is_found_where_vskipper_makes_it(tmp_path, monkeypatch):
    """A scalar read of the cohort counts, as a pass that sized its cohorts on the host would make, in every
    routed pass the served execution runs: each watched pass waits, at vSkipper's frame that made the call, and
    the summary lists them. The layer cases still agree: a wait costs time, not values."""
    real = kernels.cohort_maps

    def sizing(run, run_idx, proj_idx, counts, *args, **kwargs):
        real(run, run_idx, proj_idx, counts, *args, **kwargs)
        int(counts[0])

    monkeypatch.setattr(kernels, "cohort_maps", sizing)
    report = _check(tmp_path)
    assert all(c["ok"] for c in report["cases"])
    for watched in report["host_waits"]:
        assert not watched["ok"] and watched["waits"], watched
        for wait in watched["waits"]:
            assert wait["own"] and wait["what"] == "aten._local_scalar_dense.default"
            assert wait["where"].startswith("vskipper/mixed/cohorts.py:"), wait
    text = "\n".join(run.check_lines({"sweep": {"check": {"runs": {}, "report": report}}}))
    assert "the operators that would wait on a GPU" in text and "**10 of 10 passes wait**" in text
    assert "- decode 5 rows, context 12, s=0.5: aten._local_scalar_dense.default at vskipper/mixed/cohorts.py:" \
        in text


def test_a_wait_in_sglangs_code_counts_only_beyond_the_dense_pass_and_a_dead_watch_checks_nothing(monkeypatch):
    """SGLang's code may wait in a routed pass as often, at each site, as in upstream's dense pass of the same rows
    (its backend's read); one more there is held against the routed pass, as is any of vSkipper's."""
    from vskipper.mixed.host_waits import Wait

    read = Wait("a synchronizing CUDA call", "sglang/srt/layers/attention/triton_backend.py:9 in forward", False)
    meta = Wait("a synchronizing CUDA call", "sglang/srt/layers/attention/triton_backend.py:50 in init", False)
    own = Wait("a synchronizing CUDA call", "vskipper/mixed/routed_layer.py:7 in mixed_depth", True)

    class Watch:
        def __init__(self, found):
            self.found = found

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class FakeCase:
        def __init__(self, ran):
            self.ran = ran

        def run(self, execution, backend=None, watch=None):
            self.ran.append((backend, watch))

        def dense(self):
            return self

    def verdict(routed, dense):
        watches = [Watch(routed), Watch(dense)]
        monkeypatch.setattr(check_served, "host_waits", lambda device: watches.pop(0))
        ran = []
        out = check_served.wait_verdict("prefill", FakeCase(ran), None, torch.device("cpu"), "triton")
        # the routed pass, then the dense pass warm and watched, all through the same backend
        assert [(b, w is not None) for b, w in ran] == [("triton", True), ("triton", False), ("triton", True)]
        return out["ok"], [Wait(**w) for w in out["held"]]

    assert verdict([read], [read]) == (True, [])
    assert verdict([read, read, meta], [read]) == (False, [read, read, meta])  # one read more, and a new site
    assert verdict([own], [read]) == (False, [own])
    assert verdict([], [read, read]) == (True, [])  # the routed decode reads no backend
    dead = check_served.wait_verdict("prefill", None, None, torch.device("cpu"), dead="nothing seen")
    assert not dead["ok"] and "not live on this build: nothing seen" in dead["error"]


def test_issue_timing_takes_each_sides_median_and_calls_a_pass_host_bound_where_its_host_nears_the_span(
        monkeypatch):
    """Each side run once under the host-wait watch, then timed within its own clocks (`PassClock`: the host's
    time and the device's span, faked here as no CUDA device is); the medians, and host-bound where the median of
    the passes' host shares of the span reaches `HOST_BOUND` in a pass that waits for nothing. A pass that waits,
    or whose waits a dead watch cannot see, gets no verdict; one that cannot run is reported not timed."""
    readings = {"routed": [(1.0, 1.05), (0.9, 1.0), (5.0, 1.0), (0.95, 1.0), (1.0, 1.1)],  # ms: (host, device)
                "dense": [(0.3, 1.0), (0.2, 0.9), (0.25, 1.0), (0.3, 1.0), (0.2, 1.0)]}
    waits = {"routed": [], "dense": []}

    class Clock:
        def __init__(self, device):
            self.host_s = self.device_s = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Watch(Clock):
        found = ()

    class FakeCase:
        def __init__(self, side, ran, table):
            self.side, self.ran, self.table = side, ran, table

        def run(self, execution, backend=None, watch=None):
            self.ran.append((self.side, backend, type(watch).__name__))
            if isinstance(watch, Watch):
                watch.found = waits[self.side]
            else:
                watch.host_s, watch.device_s = (ms / 1e3 for ms in self.table[self.side].pop(0))

        def dense(self):
            return FakeCase("dense", self.ran, self.table)

    monkeypatch.setattr(check_served, "PassClock", Clock)
    monkeypatch.setattr(check_served, "host_waits", lambda device: Watch(device))

    def timing(dead=None):
        ran = []
        table = {side: list(values) for side, values in readings.items()}
        out = check_served.issue_timing("prefill 1024 tokens, s=0.5", FakeCase("routed", ran, table), None,
                                        torch.device("cpu"), None, "triton", dead=dead)
        # each side watched once, then timed 5 times, the dense side through the servers' backend
        assert ran == ([("routed", None, "Watch")] + [("routed", None, "Clock")] * 5 + [("dense", "triton", "Watch")]
                       + [("dense", "triton", "Clock")] * 5)
        return out

    out = timing()
    assert out["routed"] == {"backend": None, "waits": 0, "host_ms": 1.0, "device_ms": 1.0, "host_share": 0.95,
                             "host_bound": True}
    assert out["dense"] == {"backend": "triton", "waits": 0, "host_ms": 0.25, "device_ms": 1.0, "host_share": 0.25,
                            "host_bound": False}
    waits["dense"] = ["a read"]  # a dense pass that waits: its host time holds the device's, no verdict
    waited = timing()["dense"]
    assert waited["waits"] == 1 and waited["host_bound"] is None
    waits["dense"] = []
    blind = timing(dead="nothing seen")["routed"]
    assert blind["waits"] is None and blind["host_bound"] is None and blind["host_share"] == 0.95
    readings["routed"] = [(0.9, 1.0)] * 5  # exactly at the share: host-bound
    assert timing()["routed"]["host_bound"] is True

    class Broken:
        def run(self, *args, **kwargs):
            raise RuntimeError("launch failed")

    failed = check_served.issue_timing("prefill", Broken(), None, torch.device("cpu"))
    assert not failed["ok"] and "launch failed" in failed["error"]
    # the summary's table: each side's host and device ms, host-bound named, its waits; a pass not timed below
    report = {"device": "NVIDIA H200", "host_issue": [out, failed], "host_issue_rule": {"reps": 5, "host_bound": 0.9}}
    lines = run.issue_lines(report)
    assert lines[0].startswith("Host against device in one layer's warm eager pass (`check_served.issue_timing`, "
                               "the median of 5 passes a side)")
    assert "Where the host took 90% of the span or more in a pass that waits for nothing" in lines[0]
    assert "| prefill 1024 tokens, s=0.5 | 1.000 | 1.000 (host-bound) | 0 | 0.250 | 1.000 | 0 |" in lines
    assert lines[-3:] == ["", "- prefill: not timed (RuntimeError: launch failed)", ""]
    assert run.issue_lines({"device": "cpu"}) == []
    only_failed = run.issue_lines({"device": "NVIDIA H200", "host_issue": [failed]})  # no rule, no table
    assert "Where the host took most of the span" in only_failed[0] and not any("|" in line for line in only_failed)
    checked = {"execution": {"decode": "triton"}, "rtol": 0.05, "ok": True,
               "cases": [{"case": "decode 16 rows", "ok": True, "output_error": 0.004, "kv_error": 0.0}], **report}
    assert lines[2] in run.check_lines({"sweep": {"check": {"runs": {}, "report": checked}}})  # the check's section


def test_the_pass_clock_times_from_an_idle_device_and_takes_the_host_before_the_end(monkeypatch):
    """On CUDA (faked: the calls' order is what counts), the clock waits for the device to idle, records its
    start event, then starts the host's clock; at the end it reads the host's clock before it records the end
    event and waits for it. A pass that raised records nothing more: its own error stands."""
    calls = []

    class Event:
        def __init__(self, enable_timing=False):
            self.name = f"event{sum(c.startswith('new') for c in calls)}"
            calls.append(f"new {self.name}")

        def record(self):
            calls.append(f"record {self.name}")

        def synchronize(self):
            calls.append(f"synchronize {self.name}")

        def elapsed_time(self, end):
            calls.append("elapsed")
            return 2.0

    ticks = iter((10.0, 10.001))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("synchronize device"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(check_served.time, "perf_counter", lambda: (calls.append("host clock"), next(ticks))[1])
    with check_served.PassClock(torch.device("cuda")) as clock:
        calls.append("pass")
    assert calls == ["synchronize device", "new event0", "new event1", "record event0", "host clock", "pass",
                     "host clock", "record event1", "synchronize event1", "elapsed"]
    assert clock.host_s == pytest.approx(0.001) and clock.device_s == pytest.approx(0.002)
    calls.clear()
    ticks = iter((0.0, 1.0))
    with pytest.raises(RuntimeError, match="the pass"), check_served.PassClock(torch.device("cuda")) as failed:
        raise RuntimeError("the pass")
    assert "record event1" not in calls and failed.device_s is None


@pytest.mark.parametrize("kernel,strays", [
    ("masked_decode_attention", lambda name: name.startswith("decode")),
    ("packed_prefill_attention", lambda name: name.endswith("packed read")),
])
def test_a_fault_in_a_read_strays_in_the_cases_that_take_it_and_no_other(tmp_path, monkeypatch, kernel, strays):
    real = getattr(kernels, kernel)
    monkeypatch.setattr(kernels, kernel, lambda *args, **kwargs: real(*args, **kwargs) * 1.5)
    report = _check(tmp_path)
    assert not report["ok"]
    for case in report["cases"]:
        hit = strays(case["case"]) and case["project_only_share"] < 1  # a pass whose rows all project reads nothing
        assert case["ok"] != hit, case


def test_a_fault_in_the_servers_backend_read_strays_in_the_backend_read_cases_and_no_other(tmp_path, monkeypatch):
    """The served layer reads through SGLang's Triton backend, the reference through its torch-native one: a fault
    in the Triton backend's extend read (which a server's routed prefill takes where the table chose the backend
    read) strays there, the control's all-RUN pass included."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    real = TritonAttnBackend.forward_extend
    monkeypatch.setattr(TritonAttnBackend, "forward_extend", lambda self, *a, **k: real(self, *a, **k) * 1.5)
    report = _check(tmp_path)
    assert not report["ok"]
    for case in report["cases"]:
        assert case["ok"] != case["case"].endswith("backend read"), case


def _unchecked_where_the_servers_backend_is_needed(report: dict, error: str) -> None:
    """The backend reads and the padded replay (the backend fills its padding rows' context) are not checked,
    with `error`; every other case is checked and agrees."""
    assert not report["ok"] and len(report["cases"]) == 26
    for case in report["cases"]:
        needs = case["case"].endswith("backend read") or "replayed from the graph" in case["case"]
        assert case["ok"] != needs, case
        assert case.get("error") == (error if needs else None), case


def test_a_servers_backend_the_check_cannot_build_leaves_the_cases_that_need_it_unchecked(tmp_path, monkeypatch):
    """Where the servers' profile names no backend a standalone layer builds (SGLang's kernel wheels installed:
    SGLang picks one), the reads through it are reported not checked, not read through another backend."""
    from vskipper.sglang import cli

    monkeypatch.setattr(cli, "real_sgl_kernel_importable", lambda: True)
    assert check_served.servers_backend() == (None, None)
    report = _check(tmp_path)
    assert report["attention_backend"] is None
    _unchecked_where_the_servers_backend_is_needed(report, "RuntimeError: the servers' attention backend (SGLang "
                                                   "picks one) is not one a standalone layer builds (torch_native, "
                                                   "triton)")


def test_a_servers_backend_that_does_not_build_leaves_the_cases_that_need_it_unchecked(tmp_path, monkeypatch):
    from sglang.srt.layers.attention import triton_backend

    def refuse(self, runner, *args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(triton_backend.TritonAttnBackend, "__init__", refuse)
    report = _check(tmp_path)
    _unchecked_where_the_servers_backend_is_needed(
        report, "RuntimeError: no kernel image is available for execution on the device")


def test_a_padded_replay_whose_padding_rows_write_a_requests_kv_slot_strays_there_and_nowhere_else(tmp_path,
                                                                                                   monkeypatch):
    """The padding rows of a replayed graph must write KV slot 0 (SGLang's padding slot): a padding that points
    them at a request's slot overwrites that request's K/V, and only the padded replay's cases stray."""
    from vskipper.sglang.standalone import StandaloneLayer

    real = StandaloneLayer.padded

    def onto_request_zero(self, fb, rows, backend):
        out = real(self, fb, rows, backend)
        out.out_cache_loc[fb.batch_size:] = fb.out_cache_loc[0]
        return out

    monkeypatch.setattr(StandaloneLayer, "padded", onto_request_zero)
    report = _check(tmp_path)
    for case in report["cases"]:
        hit = "replayed from the graph" in case["case"]
        assert case["ok"] != hit, case
        assert not hit or case["kv_error"] > check_served.LAYER_RTOL


def test_a_read_one_key_past_its_position_strays_however_little_the_key_weighs(tmp_path, monkeypatch):
    """Every slot the pass must not read holds NaN (`poisoned`): a packed read that takes one key past each row's
    position (a future token of its prompt, or past its request's last) turns the last rows to NaN, where one key
    among many would shift a row by less than the 5% it is allowed; the read through the backend is untouched."""
    real = kernels.packed_prefill_attention

    def one_past(q, k_pool, v_pool, r2t, req, positions, *args, **kwargs):
        return real(q, k_pool, v_pool, r2t, req, positions + 1, *args, **kwargs)

    monkeypatch.setattr(kernels, "packed_prefill_attention", one_past)
    report = _check(tmp_path)
    hits = [c for c in report["cases"] if c["case"].endswith("packed read") and c["project_only_share"] < 1]
    assert all(c["ok"] != (c in hits) for c in report["cases"])
    assert sum(c["output_error"] == float("inf") for c in hits) >= 3  # NaN: a poisoned key read, not a drift


def test_a_case_that_cannot_run_is_reported_not_passed(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("an illegal memory access was encountered")

    monkeypatch.setattr(kernels, "cohort_ffn_pair", broken)
    report = _check(tmp_path)  # every routed pass launches the FFN pair: no layer case runs, and none passes
    layer_cases = [c for c in report["cases"] if not c["case"].startswith(("fused routes", "fused gate"))]
    assert not report["ok"] and all("illegal memory access" in c["error"] for c in layer_cases)
    assert "illegal memory access" in report["warm"]["error"]  # the warm-up runs the pair too: reported, not raised


def test_the_summary_puts_the_check_first_and_says_what_a_straying_case_puts_in_doubt():
    ok = {"device": "NVIDIA H200", "execution": {"decode": "triton"}, "rtol": 0.05, "ok": True,
          "attention_backend": "triton",
          "cases": [{"case": "decode 16 rows", "ok": True, "output_error": 0.004, "kv_error": 0.0}]}
    text = "\n".join(run.check_lines({"sweep": {"check": {"runs": {}, "report": ok}}}))
    assert "## Check" in text and "all 1 cases agree (the worst row 0.004)" in text and "replayed" not in text
    assert 'layer ({"decode": "triton"}, its backend read through SGLang\'s triton attention backend) against' in text
    bad = {**ok, "ok": False, "cases": [*ok["cases"], {"case": "prefill 1024 tokens, s=0.5, packed read",
                                                      "ok": False, "output_error": 0.7, "kv_error": 0.0},
                                        {"case": "decode 64 rows, CUDA graph", "ok": False,
                                         "error": "RuntimeError: capture failed"}]}
    text = "\n".join(run.check_lines({"sweep": None, "headline": {"check": {"runs": {}, "report": bad}}}))
    assert "decode eager and replayed from CUDA graphs" in text
    assert "2 of 3 cases stray or could not run, and every routed figure below measures that execution" in text
    assert "- prefill 1024 tokens, s=0.5, packed read: output 0.7, K/V 0" in text
    assert "- decode 64 rows, CUDA graph: not checked (RuntimeError: capture failed)" in text
    # the host waits: none of vSkipper's, one in SGLang's (listed, not held against the pass)
    engine = {"what": "a synchronizing CUDA call", "where": "sglang/srt/layers/x.py:9 in forward", "own": False}
    ok["host_waits"] = [{"case": "decode 128 rows", "ok": True, "waits": []},
                        {"case": "prefill 1024 tokens, s=0.5, backend read", "ok": True, "waits": [engine]}]
    text = "\n".join(run.check_lines({"sweep": {"check": {"runs": {}, "report": ok}}}))
    assert "(torch's CUDA sync debug mode, each synchronizing call;" in text
    assert "none in vSkipper's code in 2 passes (1 elsewhere, none beyond the dense pass's)." in text
    # a watch that saw no known wait: every pass unchecked, whatever they report
    text = "\n".join(run.check_lines({"sweep": {"check": {"runs": {}, "report": {
        **ok, "host_waits_watch": "a scalar read of a device value was not seen"}}}}))
    assert "**not checked: the watch saw no wait where one was made** (a scalar read" in text
    assert run.check_lines({"sweep": None}) == []  # no stage that checks has run
    text = "\n".join(run.check_lines({"sweep": {"check": {"runs": {}}}}))  # left by the stage's budget
    assert "did not run (the stage's time budget)" in text and "the routed figures below are unchecked" in text
    crashed = {"check": {"runs": {"check-served": {"exit": 1, "output": "check-served.json"}}}}
    text = "\n".join(run.check_lines({"sweep": crashed}))
    assert "did not finish (exit 1" in text and "the routed figures below are unchecked" in text


def test_a_check_that_strays_leaves_its_stage_going_and_its_verdict_to_the_summary(tmp_path, monkeypatch):
    """check_served.py exits 1 where a case strays: the stage that ran it neither fails nor stops (a lease's later
    stages still run; the summary carries the verdict), and a check that wrote nothing runs again in a later
    stage."""
    stage = run.Stage("headline", tmp_path, 600)
    report = {"device": "cpu", "execution": {}, "rtol": 0.05, "ok": False, "cases": []}

    def fake_steps(plan, stage, steps, limit_s=None, need_s=None):
        ((name, target, cmd),) = steps
        assert name == "check-served" and "--dry-run" in cmd and target == tmp_path / run.CHECK_JSON
        assert need_s == run.CHECK_NEED_S  # what it takes on a device, not a generic step's need
        target.write_text(json.dumps(report))
        stage.failed.append(name)
        return {name: {"exit": 1, "output": str(target)}}

    monkeypatch.setattr(run, "run_steps", fake_steps)
    check = run.check_served(run.Plan.dry(), tmp_path, stage)
    assert stage.failed == [] and check["report"] == report and check["runs"]["check-served"]["exit"] == 1


def test_an_earlier_runs_check_at_this_runs_stamp_on_this_gpu_is_taken_and_any_other_is_not(tmp_path, monkeypatch):
    """A lease's second call on the same machine (`--earlier` its first call's folder) takes that call's check of the
    served layer where its stamp is this run's (the checked code, the packages, the table and the stand-in ops;
    `bundle.check_stamp`) and it ran on this GPU: no minute spent on it again, and the summary says whose it is. A
    stamp that differs in anything, or another GPU's folder, runs the check anew."""
    from benchmarks.gpu import bundle

    calls = []

    def fake_steps(plan, stage, steps, limit_s=None, need_s=None):
        calls.append(steps[0][1])
        return {}

    monkeypatch.setattr(run, "run_steps", fake_steps)
    report = {"device": "cpu", "execution": {"decode": "triton"}, "rtol": 0.05, "ok": True,
              "cases": [{"case": "decode 5 rows", "ok": True, "output_error": 0.001, "kv_error": 0.0}],
              "stamp": run.check_stamp(None, "torch")}
    env = json.dumps({"gpu": "none", "mode": "--dry-run", "stand_in_ops": "torch"})
    first, later = tmp_path / "first", tmp_path / "later"
    for folder in (first, later):
        folder.mkdir()
        (folder / "env.json").write_text(env)
    (first / run.CHECK_JSON).write_text(json.dumps(report))
    monkeypatch.setenv(run.ENV_EARLIER, str(first))
    where = f"an earlier run on this GPU ({first})"
    check = run.check_served(run.Plan.dry(), later, run.Stage("sweep", later, 600))
    assert calls == [] and json.loads((later / run.CHECK_JSON).read_text()) == {**report, "taken_from": where}
    assert check["report"] == {**report, "taken_from": where}
    (line,) = [ln for ln in run.check_lines({"sweep": {"check": check}}) if ln.startswith("The served")]
    assert f"checked by {where} at this run's code, packages, table and ops" in line
    # a later stage of this run, --earlier given or not, reads it as taken, from where it was taken
    monkeypatch.delenv(run.ENV_EARLIER)
    assert run.check_served(run.Plan.dry(), later, run.Stage("headline", later, 600)) == check and calls == []
    monkeypatch.setenv(run.ENV_EARLIER, str(first))
    # a stage whose own check crashed before (its run recorded, no report) takes the earlier one all the same
    crashed = tmp_path / "crashed"
    (crashed / "sweep").mkdir(parents=True)
    (crashed / "env.json").write_text(env)
    (crashed / "sweep" / "check-served.run.json").write_text(json.dumps({"check-served": {"exit": 1}}))
    assert run.check_served(run.Plan.dry(), crashed, run.Stage("sweep", crashed, 600))["report"]["ok"]
    # anything else in the stamp differs: checked anew
    for key, value in (("code", "0" * 64), ("triton", "3.6.0"), ("tile_table", "f" * 64), ("stand_in_ops", "triton"),
                       ("environment", {"SGLANG_FORCE_FUSED_OP_BACKEND": "torch"})):
        (first / run.CHECK_JSON).write_text(json.dumps({**report, "stamp": {**report["stamp"], key: value}}))
        fresh = tmp_path / f"fresh-{key}"
        fresh.mkdir()
        (fresh / "env.json").write_text(env)
        assert "report" not in run.check_served(run.Plan.dry(), fresh, run.Stage("sweep", fresh, 600))
        assert calls[-1] == fresh / run.CHECK_JSON
    # the same stamp on another GPU: not this run's check
    (first / run.CHECK_JSON).write_text(json.dumps(report))
    (first / "env.json").write_text(json.dumps({"gpu": "NVIDIA H200", "mode": "device", "stand_in_ops": "torch"}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "env.json").write_text(env)
    assert "report" not in run.check_served(run.Plan.dry(), other, run.Stage("sweep", other, 600))
    assert len(calls) == 6
    # an earlier check cut short as it was written is nobody's: checked anew, nothing raised
    (first / "env.json").write_text(env)
    (first / run.CHECK_JSON).write_text('{"stamp": ')
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "env.json").write_text(env)
    assert "report" not in run.check_served(run.Plan.dry(), torn, run.Stage("sweep", torn, 600)) and len(calls) == 7
    # the stamp's code is this tree's checked sources: a change to one of them changes it
    tree = tmp_path / "tree"
    (tree / "vskipper").mkdir(parents=True)
    (tree / "vskipper" / "a.py").write_text("x = 1\n")
    digest = bundle.code_digest(tree)
    (tree / "vskipper" / "a.py").write_text("x = 2\n")
    assert bundle.code_digest(tree) != digest


def test_a_check_stopped_by_its_limit_fails_and_its_stage_does_not_run_it_again(tmp_path, monkeypatch):
    """A check that hangs is stopped at `CHECK_LIMIT_S`: not left for the stage's next run (which would wait as
    long again) but failed, its log saying so; the stage goes on, and its next run does not start it again (a
    later stage's folder does). The summary says the routed figures are unchecked."""
    stage = run.Stage("sweep", tmp_path, 600)
    runs = run.run_steps(run.Plan.dry(), stage, (("check-served", tmp_path / "never.json", ["sleep", "5"]),),
                         limit_s=0.5)
    assert runs["check-served"]["exit"] == 124 and stage.failed == ["check-served"] and stage.left == []
    assert (stage.out / "check-served.log").read_text().startswith("stopped at its 0.5 s limit")

    calls = []

    def hung(plan, stage, steps, limit_s=None, need_s=None):
        calls.append(limit_s)
        stage.failed.append("check-served")
        return {"check-served": {"exit": 124, "output": str(steps[0][1])}}

    monkeypatch.setattr(run, "run_steps", hung)
    stage = run.Stage("sweep", tmp_path, 600)
    first = run.check_served(run.Plan.dry(), tmp_path, stage)
    again = run.check_served(run.Plan.dry(), tmp_path, run.Stage("sweep", tmp_path, 600))
    assert calls == [run.CHECK_LIMIT_S] and stage.failed == [] and again == first
    text = "\n".join(run.check_lines({"sweep": {"check": again}}))
    assert "did not finish (exit 124" in text and "the routed figures below are unchecked" in text
    run.check_served(run.Plan.dry(), tmp_path, run.Stage("headline", tmp_path, 600))
    assert len(calls) == 2  # a later stage's folder runs it again


def test_a_replay_whose_plan_buffers_keep_the_captured_batchs_request_slots_strays_there_and_nowhere_else(
        tmp_path, monkeypatch):
    """The replayed graph reads each row's request slot from the plan buffers, which each pass writes as a server
    does: buffers that kept the slots of the batch the graph was captured for (its rows other requests) read other
    requests' K/V, NaN where the replayed batch's KV state holds none, and only the replay's cases stray."""
    from vskipper.mixed.plan_buffers import PlanBuffers

    real = PlanBuffers.write

    def keeps_the_first_slots(self, req_rows, request_keys, dense_rows=None):
        written = getattr(self, "written", False)
        self.written = True
        return real(self, None if written else req_rows, request_keys, dense_rows)

    monkeypatch.setattr(PlanBuffers, "write", keeps_the_first_slots)
    report = _check(tmp_path)
    for case in report["cases"]:
        assert "error" not in case and case["ok"] != ("replayed from the graph" in case["case"]), case
    control = next(c for c in report["cases"] if "replayed from the graph" in c["case"] and ", s=0," in c["case"])
    assert control["output_error"] == float("inf")  # its first row read a request the batch does not hold


def test_a_replay_whose_plan_buffers_keep_the_captured_batchs_request_keys_strays_where_the_route_differs(
        tmp_path, monkeypatch):
    """Each replayed pass writes its rows' request keys into the plan buffers, as a server does, and the skipper
    routes each row by its key: buffers that kept the keys of the batch the graph was captured for route the
    replayed rows as other requests, so the s = 0.5 replay strays (the rows it routes apart compute another
    depth) and nothing else does; the s = 0 control routes every row RUN whatever its key and cannot notice."""
    from benchmarks.mixed_depth_bench import request_keys
    from vskipper.mixed.plan_buffers import PlanBuffers
    from vskipper.skippers.random_skip import reference_routes

    real = PlanBuffers.write

    def keeps_the_first_keys(self, req_rows, keys, dense_rows=None):
        first = getattr(self, "first_keys", None)
        if first is None:
            self.first_keys = keys.clone()
        return real(self, req_rows, keys if first is None else first[: keys.shape[0]].clone(), dense_rows)

    # The dry run's replay: 3 rows (request slots 1-3) replayed from the graph of 4 captured for slots 4, 3, 2, 1.
    route = check_served.ROUTES["s=0.5"]
    position = check_served.DRY_CASES["context"]

    def routes(slots):
        return [reference_routes(route.seed, int(k), position, route.r, route.d, 1)
                for k in request_keys(torch.tensor(slots))]

    assert routes([4, 3, 2]) != routes([1, 2, 3])  # the stale keys route some row otherwise: the fault is visible
    monkeypatch.setattr(PlanBuffers, "write", keeps_the_first_keys)
    report = _check(tmp_path)
    for case in report["cases"]:
        hit = "replayed from the graph" in case["case"] and ", s=0.5," in case["case"]
        assert "error" not in case and case["ok"] != hit, case


def test_the_stand_in_ops_agree_with_sglangs_torch_path_and_a_fault_or_a_fallback_is_found():
    """`--stand-in-ops triton`: SGLang's RMSNorm, SiLU-and-mul and RoPE through the hooks a server installs, against
    SGLang's torch path, at each row count; a kernel that computes wrong strays in its own cases and no other, and a
    call the hooks leave to SGLang's path fails its case too (the run would not measure the ops it names)."""
    from vskipper.mixed import norms
    from vskipper.sglang import stand_in_ops
    from vskipper.sglang.standalone import init_sglang

    init_sglang("cpu")
    rows = (1, 3)
    with torch.no_grad():
        cases = check_served.stand_in_ops_cases(torch.device("cpu"), torch.float32, check_served.SMOKE, rows)
        assert len(cases) == 10 and all(c["ok"] and c["paths"] == {"triton": 1} for c in cases)
        assert [c["case"] for c in cases if "RoPE" in c["case"]] == [
            f"stand-in ops: RoPE of {n} x (4 + 2) heads of 16" for n in rows]
        assert not any("timing" in c for c in cases)  # on CPU the interpreter runs the kernels: untimed unless asked
        timed = check_served.stand_in_ops_cases(torch.device("cpu"), torch.float32, check_served.SMOKE, (1,),
                                                timing_reps=2)
        for c in timed:  # each side's host time a call; no device span on CPU
            assert c["ok"] and set(c["timing"]) == {"triton", "torch"}
            assert all(t["host_us"] > 0 and t["device_us"] is None for t in c["timing"].values())
        table = run.ops_timing_lines({"device": "cpu", "cases": timed})
        assert "| case | Triton host us | Triton device us | torch host us | torch device us |" in table
        rope = timed[-1]["timing"]
        assert f"| RoPE of 1 x (4 + 2) heads of 16 | {rope['triton']['host_us']:.1f} | n/a | " \
               f"{rope['torch']['host_us']:.1f} | n/a |" in table
        assert run.ops_timing_lines({"device": "cpu", "cases": cases}) == []
        real, real_rope = norms.silu_and_mul, norms.rotary_embedding
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(norms, "silu_and_mul", lambda x, checked=False: real(x, checked) * 1.1)
            cases = check_served.stand_in_ops_cases(torch.device("cpu"), torch.float32, check_served.SMOKE, rows)
        assert [c["case"] for c in cases if not c["ok"]] == [c["case"] for c in cases if "SiLU" in c["case"]]
        with pytest.MonkeyPatch.context() as patch:  # the key rotated at the next position: RoPE's cases alone
            patch.setattr(norms, "rotary_embedding", lambda p, q, k, *a, **kw: (real_rope(p, q, k, *a, **kw)[0],
                                                                                 real_rope(p + 1, q, k, *a, **kw)[1]))
            cases = check_served.stand_in_ops_cases(torch.device("cpu"), torch.float32, check_served.SMOKE, rows)
        assert [c["case"] for c in cases if not c["ok"]] == [c["case"] for c in cases if "RoPE" in c["case"]]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(stand_in_ops, "_device_why", lambda x: "a device the kernels do not take")
            cases = check_served.stand_in_ops_cases(torch.device("cpu"), torch.float32, check_served.SMOKE, rows)
        assert not any(c["ok"] for c in cases)
        assert cases[0]["paths"] == {"torch: a device the kernels do not take": 1}


def test_a_run_on_the_stand_in_ops_checks_them_before_its_first_routed_server_and_says_so(tmp_path, monkeypatch):
    """A device run on `--stand-in-ops triton` hands the check the same ops (its cases then hold the stand-in ops'),
    a run on SGLang's paths does not, and the summary's check line names the ops' cases where they ran."""
    from dataclasses import replace

    commands = []

    def fake_steps(plan, stage, steps, limit_s=None, need_s=None):
        ((name, target, cmd),) = steps
        commands.append(cmd)
        return {}

    monkeypatch.setattr(run, "run_steps", fake_steps)
    for ops in ("torch", "triton"):
        run.check_served(replace(run.Plan.gpu(), stand_in_ops=ops), tmp_path, run.Stage(f"sweep-{ops}", tmp_path, 600))
    assert "--stand-in-ops" not in commands[0] and commands[1][-2:] == ["--stand-in-ops", "triton"]
    case = {"ok": True, "output_error": 0.001, "kv_error": 0.0}
    report = {"device": "NVIDIA H200", "execution": {}, "rtol": 0.05, "ok": True,
              "cases": [{**case, "case": "decode 16 rows"}, {**case, "case": "fused routes of 1 rows over 16 layers"},
                        {**case, "case": "fused gate of 1 rows, flexidepth"},
                        {**case, "case": "stand-in ops: RMSNorm of 1 x 4096"}]}
    (line,) = [ln for ln in run.check_lines({"sweep": {"check": {"report": report}}}) if ln.startswith("The served")]
    assert "prefill with either read; RandomSkip's fused routes against its own ops; the trained gates' fused route " \
        "against their own; the stand-in ops against SGLang's torch path; each row" in line


def test_fused_routes_that_differ_from_the_skippers_own_stray_in_their_cases():
    """A fused launch that drops a route (here: every row RUN) strays in the s = 0.5 arm's cases, whose skipper
    projects some rows; the control's, every row RUN, agree."""
    from vskipper.mixed import routes

    real = routes.fused_state

    def all_run(skipper, batch):
        state = real(skipper, batch)
        state["run"].fill_(True)
        return state

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(routes, "fused_state", all_run)
        cases = check_served.routes_cases(torch.device("cpu"), torch.float32, (1, 16))
    assert [c["case"] for c in cases if not c["ok"]] == [f"fused routes of {n} rows over 16 layers, s=0.5"
                                                          for n in (1, 16)]
    assert all(c["ok"] for c in cases if c["case"].endswith("s=0"))


def test_a_fused_gate_that_routes_otherwise_than_the_gates_own_strays_in_its_cases():
    """A fused gate that drops the decision (here: every row RUN) strays in each gate's cases with rows that
    project; the weights a FlexiDepth gate gives them stray too. Its cases at the served rows otherwise agree."""
    from vskipper.mixed import router

    real = router.gate_route

    def all_run(skipper, u, valid, module):
        route = real(skipper, u, valid, module)
        route.run_mask.fill_(True)
        return route

    cases = check_served.gate_cases(torch.device("cpu"), torch.float32, check_served.SMOKE, (1, 16))
    assert all(c["ok"] for c in cases) and len(cases) == 4
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(router, "gate_route", all_run)
        cases = check_served.gate_cases(torch.device("cpu"), torch.float32, check_served.SMOKE, (1, 16))
    assert {c["case"] for c in cases if not c["ok"]} >= {f"fused gate of 16 rows, {g}"
                                                         for g in ("flexidepth", "qwen3_hard_gate")}
