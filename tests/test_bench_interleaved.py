"""`benchmarks/bench_interleaved.py`: s = 0.5 over s = 0 from one server whose decode passes, and prefill passes,
alternate between the two. Its arithmetic on made-up attestations, then one run against a real SGLang server on CPU (the quick size:
the figures mean nothing, the server's interleaving and both clocks are real)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import ROOT

from vskipper.sglang.part_times import CONTROL_PHASE


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_interleaved", ROOT / "benchmarks" / "bench_interleaved.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_interleaved"] = module
    spec.loader.exec_module(module)
    return module


PER_PASS = {CONTROL_PHASE: {"outside": {"outside": 2.0}, "dense": {"mlp": 30.0, "read": 30.0},
                            "routed": {"qkv": 3.0, "read": 40.0, "o": 4.0, "mlp": 30.0, "glue": 5.0}},
            "decode": {"outside": {"outside": 2.0}, "dense": {"mlp": 30.0, "read": 30.0},
                       "routed": {"q": 1.0, "kv": 1.5, "read": 20.0, "o": 3.0, "mlp": 24.0, "projector": 3.0,
                                  "glue": 8.0}}}


def _attestation(control: int, routed: int, control_ms: float = 200.0, routed_ms: float = 180.0) -> dict:
    """The server's pass and part clocks after `control` and `routed` passes (made-up ms a pass and step)."""
    passes = {CONTROL_PHASE: control, "decode": routed}
    return {"pass_clock": {"passes_total": dict(passes),
                           "seconds_total": {CONTROL_PHASE: control * control_ms / 1e3,
                                             "decode": routed * routed_ms / 1e3}},
            "part_clock": {"passes_total": dict(passes),
                           "seconds_total": {phase: {where: {part: ms * passes[phase] / 1e3 for part, ms in parts.items()}
                                                     for where, parts in PER_PASS[phase].items()}
                                             for phase in passes}}}


def test_a_run_compares_the_control_step_with_the_routed_step_and_the_limit_each_pass_with_its_own_kind():
    bench = _bench()
    run = bench.interleaved_run(_attestation(10, 10), _attestation(60, 50))  # 50 control, 40 routed steps
    assert run["control"]["steps"] == 50 and run["routed"]["steps"] == 40
    assert run["control"]["step_ms"] == pytest.approx(200.0) and run["routed"]["step_ms"] == pytest.approx(180.0)
    assert run["ratio"] == pytest.approx(200.0 / 180.0)
    assert run["model_ratio"] == pytest.approx(144.0 / 122.5) and run["dense_ratio"] == pytest.approx(1.0)
    # Over two runs with unequal counts of each kind, the limit is the limit a pass (each kind by its own passes).
    limit = bench.interleaved_limit([run, bench.interleaved_run(_attestation(60, 50), _attestation(61, 80))])
    assert limit["saving_ms"] == pytest.approx(75.5 - 48.0 - 3.0)
    assert limit["limit"] == pytest.approx(144.0 / (144.0 - 24.5))
    assert limit["step_ms"] == pytest.approx({"s=0": 144.0, "s=0.5": 122.5})


def test_the_report_divides_each_run_by_its_dense_layers_and_names_a_run_above_the_limit(capsys):
    bench = _bench()
    base = bench.interleaved_run(_attestation(10, 10), _attestation(60, 50))  # limit 144 / 119.5 = 1.205x
    runs = [{**base, "ratio": ratio, "dense_ratio": dense} for ratio, dense in ((1.15, 0.99), (1.22, 1.02),
                                                                                 (1.18, 1.00))]
    summary = bench.report(runs)
    assert summary["ratio"] == pytest.approx((1.18, 1.15, 1.22))
    assert summary["ratio_over_dense"] == pytest.approx((1.18, 1.15 / 0.99, 1.22 / 1.02))
    assert summary["above_limit"] == ["run 1 1.220x (dense layers 1.020)"]
    out = capsys.readouterr().out
    assert "over dense      1.180x [1.162, 1.196]  (each run's step ratio over its dense layers' ratio; 88% of" in out
    assert "above the limit: run 1 1.220x (dense layers 1.020)" in out
    assert bench.report([runs[0]])["above_limit"] == []
    assert "above the limit" not in capsys.readouterr().out
    # Within the limit raw, above it once divided by dense layers that ran faster in the control passes.
    low = {**base, "ratio": 1.19, "dense_ratio": 0.98}
    assert bench.report([low])["above_limit"] == ["run 0 1.190x, over dense 1.214x (dense layers 0.980)"]


def _prefill_attestation(control: int, routed: int, short: int = 0) -> dict:
    """The part clock after `control` and `routed` prefill passes of 1024 tokens (`short` of the routed ones 1
    token: a prompt the radix cache held): the decode figures' parts, 10 times longer."""
    passes = {"prefill_control": control, "prefill": routed}
    per_pass = {"prefill_control": PER_PASS[CONTROL_PHASE], "prefill": PER_PASS["decode"]}
    return {"part_clock": {"passes_total": dict(passes),
                           "tokens_total": {"prefill_control": 1024 * control, "prefill": 1024 * routed - 1023 * short},
                           "seconds_total": {phase: {where: {part: 10 * ms * passes[phase] / 1e3
                                                             for part, ms in parts.items()}
                                                     for where, parts in per_pass[phase].items()}
                                             for phase in passes}}}


def test_a_prefill_run_compares_the_kinds_model_time_a_pass_and_refuses_prompts_cut_into_chunks(capsys):
    bench = _bench()
    load = bench.Load(1024, 1, 16, 1)
    run = bench.prefill_run(_prefill_attestation(3, 4), _prefill_attestation(12, 12), load)  # 9 + 8 passes
    assert run["control"]["clock"]["passes"] == 9 and run["routed"]["clock"]["passes"] == 8
    assert run["model_ratio"] == pytest.approx(1440.0 / 1225.0) and run["dense_ratio"] == pytest.approx(1.0)
    with pytest.raises(RuntimeError, match="the prefill load's 16 prompts and its warm-up ran as 34 passes, not one "
                                           "pass each .chunked prefill below 1024 tokens"):
        bench.prefill_run(_prefill_attestation(3, 4), _prefill_attestation(20, 21), load)
    with pytest.raises(RuntimeError, match="the routed prefill passes ran 8193 tokens in 9 passes, not 1024 each: a "
                                           "prompt was served in part from SGLang's radix cache"):
        bench.prefill_run(_prefill_attestation(3, 4), _prefill_attestation(11, 13, short=1), load)
    with pytest.raises(RuntimeError, match="no control prefill pass ran in this run"):
        bench.prefill_run(_prefill_attestation(3, 4), _prefill_attestation(3, 21), load)
    summary = bench.report_prefill([run, {**run, "model_ratio": 1.10, "dense_ratio": 0.98}], 1.3)
    assert summary["model_ratio"] == pytest.approx(((1440 / 1225 + 1.10) / 2, 1.10, 1440 / 1225))
    assert summary["limit"]["limit"] == pytest.approx(1440.0 / (1440.0 - 245.0))
    assert summary["line"].startswith(f"prefill {(1440 / 1225 + 1.10) / 2:.3f}x [1.100, 1.176], over dense ")
    assert "of FLOP limit 1.300x" in summary["line"] and summary["above_limit"] == []
    out = capsys.readouterr().out
    assert "the part clock's 1.205x" in out and "above the part clock's limit" not in out
    # Each kind's parts, to tell what moved between the kinds of pass besides the routing.
    assert "parts, control -> routed pass (ms a pass): layers routed 820.0 -> 605.0, dense 600.0 -> 600.0; the " \
           "routed layers' glue 50.00 -> 80.00, kv 0.00 -> 15.00" in out
    # Within the FLOP limit, above the part clock's: named as a question, apart from the FLOP limit's runs.
    time = bench.report_prefill([run, {**run, "model_ratio": 1.25, "dense_ratio": 1.0}], 1.3)
    assert time["above_limit"] == [] and time["above_time_limit"] == ["run 1 1.250x, over dense 1.250x (dense "
                                                                      "layers 1.000)"]
    assert "above the part clock's limit (1.205x): run 1 1.250x" in capsys.readouterr().out
    above = bench.report_prefill([run, {**run, "model_ratio": 1.35, "dense_ratio": 1.12}], 1.3)
    assert above["above_limit"] == ["run 1 1.350x (dense layers 1.120)"] and above["above_time_limit"] == []
    assert "above the FLOP limit: run 1 1.350x (dense layers 1.120)" in capsys.readouterr().out
    assert bench.prefill_load(bench.SIZES["full"]) == load


def test_a_server_that_timed_no_control_step_is_refused_naming_the_switch():
    bench = _bench()
    with pytest.raises(RuntimeError, match="no control decode step was timed in this run: is the server "
                                           r"interleaving \(VSKIPPER_INTERLEAVE_CONTROL=1"):
        bench.interleaved_run(_attestation(10, 10), _attestation(10, 30))


@pytest.mark.server
def test_a_quick_run_against_a_real_server_times_both_kinds_of_decode_step_and_of_prefill_pass(cli_env, tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_interleaved.py"), "--size", "quick",
                           "--repetitions", "1", "--server-threads", "1", "--out", str(out)], env=cli_env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "bench.json").read_text())
    (run,) = summary["runs"]
    # The quick load decodes 4 requests of 8 tokens together: both kinds of step, a few each, at one batch.
    assert run["control"]["steps"] >= 2 and run["routed"]["steps"] >= 2
    assert run["control"]["clock"]["passes"] >= run["control"]["steps"]
    assert run["routed"]["clock"]["routed"] > 0 and summary["limit"]["projector_ms"] > 0  # routed passes projected
    assert summary["limit"]["routed_parts_ms"]["s=0"].get("projector", 0.0) == 0.0  # control passes never did
    assert proc.stdout.strip().splitlines()[-1] == summary["line"]
    assert summary["line"].startswith("interleaved decode ") and "; prefill " in summary["line"]
    (prefill,) = summary["prefill"]["runs"]  # its prompts one pass each (else refused), both kinds of pass
    assert prefill["control"]["clock"]["passes"] >= 1 and prefill["routed"]["clock"]["passes"] >= 1
    assert summary["prefill"]["limit"]["routed_parts_ms"]["s=0"].get("projector", 0.0) == 0.0
