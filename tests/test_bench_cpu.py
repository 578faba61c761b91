"""`make bench-cpu`'s checks. Its quick size runs end to end inside the demo's test (`tests/test_demo.py`, the
demo's step 6 runs the script as `make bench-cpu` does): a checkpoint written by the script, the two routed arms'
real SGLang servers on CPU driven by SGLang's own client, the limits and the decode profile; `check_quick_bench` checks the
shape of what it printed and wrote, never a figure (timings on a shared CPU mean nothing here)."""

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import ROOT

LAST_LINE = re.compile(r"prefill \d+\.\d\dx of limit \d+\.\d\dx; decode \d+\.\d\dx of limit \d+\.\d\dx; "
                       r"(s=0 overhead -?\d+\.\d%|s=0 overhead not measured \(no dense arm\))")


def check_quick_bench(stdout: str, out: Path, arms: tuple[str, ...] = ("s=0", "s=0.5")) -> None:
    """What a quick run of the bench printed and wrote (`out`: its --out): only the shape, never a figure."""
    lines = stdout.strip().splitlines()
    assert LAST_LINE.fullmatch(lines[-1]), lines[-1]
    summary = json.loads((out / "bench.json").read_text())
    assert set(summary["results"]) == set(arms)
    for arm, phases in summary["results"].items():
        assert set(phases) == {"prefill", "decode"} and all(len(v) == 1 and v[0] > 0 for v in phases.values()), arm
    assert summary["line"] == lines[-1]
    assert {arm: len(v) for arm, v in summary["prefill_latency_s"].items()} == dict.fromkeys(arms, 2)
    assert "prefill one prompt at a time (2 prompts of 32 tokens, alternating)" in stdout
    profiles = summary["profiles"]  # the served layer's, with the reads the server picks on CPU
    # the quick size's prompt of 32 tokens is short: the sized read takes the backend's (`SIZED_READ_MACS`)
    for phase, read, rows in (("decode", "backend", 4), ("prefill", "backend", 32)):
        profile = profiles[phase]
        assert set(profile["parts_all_ms"]) == set(profile["parts_run_ms"]) == {"q", "read", "o", "mlp"}, phase
        assert (profile["phase"], profile["read"], profile["rows"]) == (phase, read, rows)
        assert profile["project_only_rows"] == rows // 2 and profile["limit"] == summary["time_limits"][phase]
    # The arms served what they name: the dense server ran no routed pass, both routed servers routed every pass.
    passes = {m.group(1): json.loads(m.group(2)) for m in
              (re.match(r"\s+(\S+)\s+passes (\{.*\})$", line) for line in lines) if m}
    assert set(passes) == set(arms)
    if "dense" in passes:
        assert passes["dense"]["decode"]["routed"] == 0 and passes["dense"]["decode"]["dense"] > 0
    for arm in ("s=0", "s=0.5"):
        assert passes[arm]["decode"]["dense"] == 0 and passes[arm]["decode"]["routed"] > 0, arm
        assert passes[arm]["prefill"]["dense"] == 0 and passes[arm]["prefill"]["routed"] > 0, arm


def _bench_cpu():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_cpu", ROOT / "benchmarks" / "bench_cpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_cpu"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _Counters:
    """SGLang's request-token counters as its /metrics exposes them (two label sets, summed by the bench)."""

    def __init__(self, prompt: int, generation: int) -> None:
        self.prompt, self.generation = prompt, generation

    def metrics(self) -> str:
        lines = []
        for name, value in (("prompt_tokens", self.prompt), ("generation_tokens", self.generation)):
            lines += [f"# HELP sglang:{name}_total tokens", f"# TYPE sglang:{name}_total counter",
                      f'sglang:{name}_total{{model_name="m",stream="a"}} {value - 1}.0',
                      f'sglang:{name}_total{{model_name="m",stream="b"}} 1.0']
        return "\n".join(lines) + "\n"


def test_a_run_is_refused_unless_the_server_took_the_tokens_its_load_states():
    bench = _bench_cpu()
    load = bench.Load(input_len=1024, output_len=256, prompts=8, concurrency=4)
    # The prompts as ids plus the warm-up request (the first prompt, at most 32 generated tokens).
    assert load.served_tokens() == {"prompt": 9 * 1024, "generation": 8 * 256 + 32}
    server = _Counters(100, 7)
    before = bench.served_counts(server)
    assert before == {"prompt": 100, "generation": 7}
    server.prompt, server.generation = 100 + 9 * 1024, 7 + 8 * 256 + 32
    bench.check_served(server, "s=0", "decode", load, before)
    server.prompt = 100 + 9 * 1580  # prompts sent as text came out longer
    with pytest.raises(RuntimeError, match=r"arm s=0 decode: the server took \{'prompt': 14220"):
        bench.check_served(server, "s=0", "decode", load, before, wait_s=0.1)
    server.prompt = 100 + 9 * 1024 - 5  # short, and never catches up
    with pytest.raises(RuntimeError, match="the server took"):
        bench.check_served(server, "s=0", "decode", load, before, wait_s=0.1)


def _profile(limit: float, phase: str = "decode") -> dict:
    """A profile of `served_layer_profile`'s shape (figures made up: the report's arithmetic is checked)."""
    parts = {"q": 0.2, "read": 3.0, "o": 0.3, "mlp": 1.5}
    return {"phase": phase, "rows": 16, "context": 160, "project_only_rows": 8, "read": "backend", "layer_ms": 6.0,
            "step_ms": 96.0, "parts_all_ms": parts, "parts_run_ms": {k: v / 2 for k, v in parts.items()},
            "saving_ms": {k: v / 2 for k, v in parts.items()}, "projector_ms": 0.3, "layer_saving_ms": 2.2,
            "saved_ms": 17.6, "skippable_share": 0.18, "limit": limit,
            "routed_ms": {"s=0": 6.1, "s=0.5": 4.2}, "routed_saving_ms": 1.9}


def _clocks(read_all: float = 40.0, passes: int = 10) -> tuple[dict, dict]:
    """The s=0 and s=0.5 servers' part clocks (`vskipper.sglang.part_times`' attestation) after `passes` passes of
    each phase, from per-pass ms (made up: the arithmetic is checked)."""
    per_pass = {"s=0": {"outside": {"outside": 2.0}, "dense": {"mlp": 30.0, "read": 30.0},
                        "routed": {"qkv": 3.0, "read": read_all, "o": 4.0, "mlp": 30.0, "glue": 5.0, "rope": 2.0}},
                "s=0.5": {"outside": {"outside": 2.0}, "dense": {"mlp": 30.0, "read": 30.0},
                          "routed": {"q": 1.0, "kv": 1.5, "read": 20.0, "o": 3.0, "mlp": 24.0, "projector": 3.0,
                                     "glue": 8.0, "rope": 3.0}}}
    return tuple({"passes_total": {"prefill": passes, "decode": passes},
                  "seconds_total": {phase: {where: {part: ms * passes / 1e3 for part, ms in parts.items()}
                                            for where, parts in per_pass[arm].items()}
                                    for phase in ("prefill", "decode")}} for arm in ("s=0", "s=0.5"))


def test_the_time_limit_in_the_servers_is_what_the_skipped_parts_cost_at_every_row_less_at_the_run_rows():
    """s=0's routed layers at every row against s=0.5's at its RUN rows, Q at every row being the fused
    projection less the K/V projection, less the adapter; over s=0's model time a pass."""
    bench = _bench_cpu()
    served = bench.served_limit(*_clocks(), "decode")
    assert served["step_ms"] == pytest.approx({"s=0": 146.0, "s=0.5": 125.5})
    assert served["skipped_all_ms"] == pytest.approx({"q": 1.5, "read": 40.0, "o": 4.0, "mlp": 30.0})
    assert served["skipped_run_ms"] == pytest.approx({"q": 1.0, "read": 20.0, "o": 3.0, "mlp": 24.0})
    assert served["saving_ms"] == pytest.approx(75.5 - 48.0 - 3.0)
    assert served["limit"] == pytest.approx(146.0 / (146.0 - 24.5))
    assert served["model_ratio"] == pytest.approx(146.0 / 125.5)
    assert served["layers_ms"]["dense"] == pytest.approx({"s=0": 60.0, "s=0.5": 60.0})
    assert served["passes"] == {"s=0": 10, "s=0.5": 10}
    # The same load cut into 8 passes in the s=0.5 server: the load's time compares, not a pass's.
    s0, s05 = _clocks()
    s05["passes_total"]["decode"] = 8
    again = bench.served_limit(s0, s05, "decode")
    assert again["limit"] == pytest.approx(served["limit"]) and again["step_ms"] == pytest.approx(served["step_ms"])
    assert again["passes"] == {"s=0": 10, "s=0.5": 8}


def test_a_runs_clock_is_its_share_of_the_servers_part_clock_a_pass():
    bench = _bench_cpu()
    before, _ = _clocks(passes=10)
    after, _ = _clocks(passes=30)  # 20 more passes at the same ms a pass
    run = bench.run_clock(before, after, "decode")
    assert {k: run[k] for k in ("routed", "dense", "outside", "model", "passes")} == pytest.approx(
        {"routed": 44.0 + 40.0, "dense": 60.0, "outside": 2.0, "model": 146.0, "passes": 20})
    assert run["seconds"]["dense"] == pytest.approx({"mlp": 0.6, "read": 0.6})  # 30 ms a pass, 20 passes
    assert bench.run_clock(after, after, "decode")["model"] == 0.0  # no pass: nothing, not a division by zero
    assert (run["device"], run["device_passes"]) == (None, 0)  # a CPU's clock: no device span
    # A clock of pass spans alone times each forward whole (`outside`): no layer kind is timed, none reads 0
    spans = [{"parts": False, "passes_total": {"decode": n}, "seconds_total": {"decode": {"outside": {
        "outside": 0.003 * n}}}} for n in (10, 30)]
    whole = bench.run_clock(*spans, "decode")
    assert (whole["routed"], whole["dense"]) == (None, None)
    assert whole["outside"] == whole["model"] == pytest.approx(3.0) and whole["passes"] == 20
    # On a GPU: the device's span of the passes whose end it reached (here 19 of the 20), a pass on average
    gpu_before = {**before, "device_seconds_total": {"decode": 1.0}, "device_passes_total": {"decode": 9}}
    gpu_after = {**after, "device_seconds_total": {"decode": 1.0 + 19 * 0.2}, "device_passes_total": {"decode": 28}}
    gpu = bench.run_clock(gpu_before, gpu_after, "decode")
    assert gpu["device"] == pytest.approx(200.0) and gpu["device_passes"] == 19 and gpu["passes"] == 20
    # Two such runs make the clock of the phase's runs alone: the limit over them is the limit per pass.
    s0 = bench.runs_clock([run, run], "decode")
    assert s0["passes_total"] == {"decode": 40}
    s05 = bench.runs_clock([bench.run_clock(*[_clocks(passes=n)[1] for n in (10, 30)], "decode")] * 2, "decode")
    assert bench.served_limit(s0, s05, "decode")["limit"] == pytest.approx(
        bench.served_limit(*_clocks(), "decode")["limit"])


def _runs(dense_ms: list[float], model_ms: list[float]) -> list[dict]:
    return [{"routed": m - d - 2.0, "dense": d, "outside": 2.0, "model": m, "passes": 20}
            for d, m in zip(dense_ms, model_ms, strict=True)]


def test_each_pair_is_corrected_by_its_dense_layers_the_same_work_in_both_runs():
    """A run whose dense layers took 10% longer ran on a host 10% slower: its rate is scaled up by as much."""
    bench = _bench_cpu()
    d = bench.drift_corrected([13.0, 10.5, 11.0], [10.0, 10.0, 10.0],
                              _runs([60.0, 66.0, 54.0], [120.0, 132.0, 108.0]), _runs([60.0] * 3, [144.0] * 3))
    assert d["factors"] == pytest.approx([1.0, 1.1, 0.9])
    assert d["ratios"] == pytest.approx((1.155, 0.99, 1.3))
    assert d["model"] == pytest.approx((1.2, 144 / 132, 144 / 108))
    assert d["model_corrected"] == pytest.approx((1.2, 1.2, 1.2))  # the host's drift was the whole spread
    # The same load in fewer, larger passes: whole runs are compared, not passes.
    fewer = [{**run, "dense": run["dense"] * 7 / 5, "model": run["model"] * 7 / 5, "passes": run["passes"] * 5 / 7}
             for run in _runs([60.0] * 3, [144.0] * 3)]
    assert bench.drift_corrected([10.0] * 3, [10.0] * 3, fewer, _runs([60.0] * 3, [144.0] * 3))["factors"] == \
        pytest.approx([1.0] * 3)


@pytest.mark.parametrize("arms", [("dense", "s=0", "s=0.5"), ("s=0", "s=0.5")], ids=["full", "routed-only"])
def test_the_report_pairs_the_repetitions_and_flags_a_ratio_above_its_limit(arms, capsys):
    bench = _bench_cpu()
    size = bench.replace(bench.SIZES["quick"], arms=arms, repetitions=3)
    config = bench.tiny_config(bench.ARCH, size.model, "bfloat16")
    results = {"s=0": {"prefill": [100.0, 100.0, 100.0], "decode": [10.0, 10.0, 10.0]},
               "s=0.5": {"prefill": [110.0, 120.0, 130.0], "decode": [13.0, 10.5, 11.0]},
               "dense": {"prefill": [99.0, 101.0, 102.0], "decode": [10.0, 10.0, 10.4]}}
    latency = {"s=0": [1.0, 1.1, 1.2], "s=0.5": [0.8, 1.0, 0.9], "dense": [1.0, 1.0, 1.0]}
    latency = {arm: latency[arm] for arm in arms}
    profiles = {"prefill": _profile(limit=1.4, phase="prefill"), "decode": _profile(limit=1.2)}
    served = {"prefill": bench.served_limit(*_clocks(read_all=80.0), "prefill"),
              "decode": bench.served_limit(*_clocks(), "decode")}
    decode_limit = 146.0 / 121.5
    runs = {arm: {phase: _runs([60.0] * 3, [146.0] * 3) for phase in ("prefill", "decode")} for arm in arms}
    runs["s=0.5"]["decode"] = _runs([60.0, 66.0, 54.0], [125.5] * 3)
    summary = bench.report({arm: results[arm] for arm in arms}, config, size, profiles, latency, served, runs)
    out = capsys.readouterr().out
    assert summary["prefill_latency_speedup"] == pytest.approx((1.25, 1.1, 4 / 3))  # s=0 time over s=0.5's
    assert "s=0 1100 ms, s=0.5 900 ms: 1.250x [1.100, 1.333]" in out
    prefill_limit = summary["flop_limits"]["prefill"]
    assert summary["time_limits"] == {"prefill": 1.4, "decode": 1.2}
    assert summary["ratios"]["prefill"] == pytest.approx((1.2, 1.1, 1.3))  # median, min, max of the pairs
    assert summary["ratios"]["decode"] == pytest.approx((1.1, 1.05, 1.3))
    assert f"FLOP limit {prefill_limit:.3f}x ({(1.2 - 1) / (prefill_limit - 1):.0%} of its gain)" in out
    assert "the layer alone's 1.400x (50%)" in out  # prefill: (1.2 - 1) / (1.4 - 1)
    assert "the layer alone's 1.200x (50%)" in out  # decode: (1.1 - 1) / (1.2 - 1)
    assert f"time limit in the servers {decode_limit:.3f}x ({0.1 / (decode_limit - 1):.0%})" in out
    assert "saves 24.5 ms a pass (16.8% of s=0's model time) -> time limit 1.202x" in out
    assert "the routed layers saved 20.5 ms a pass of the 24.5 ms their skipped parts allow (84%:" in out
    assert "ABOVE" not in out and "above its FLOP limit" not in out
    # Decode pairs 1.3, 1.05, 1.1 with dense layers 1.0, 1.1, 0.9 times as long in the s=0.5 run.
    assert summary["drift_corrected"]["decode"]["ratios"] == pytest.approx((1.155, 0.99, 1.3))
    assert ("corrected for the host's drift 1.155x [0.990, 1.300] "
            f"({0.155 / (decode_limit - 1):.0%} of the goal limit's gain; each pair times its dense layers' "
            "time, s=0.5 run over s=0 run: 1.000, 1.100, 0.900)") in out
    assert "the model time alone (the servers' clocks, run by run) 1.163x [1.163, 1.163], corrected 1.163x" in out
    assert LAST_LINE.fullmatch(summary["line"])
    assert summary["line"].startswith(f"prefill 1.20x of limit {prefill_limit:.2f}x; decode 1.10x of limit "
                                      f"{decode_limit:.2f}x")
    assert summary["served_limits"]["decode"]["limit"] == pytest.approx(decode_limit)
    if "dense" in arms:
        assert summary["overhead"]["decode"] == pytest.approx((1.0, 1.0, 1.04))
        assert "dense over s=0 decode  1.000x [1.000, 1.040]   corrected for the host's drift 1.000x" in out
        assert summary["line"].endswith("s=0 overhead 1.0%")  # the larger phase median: prefill 1.01 (decode 1.0)
    else:
        assert summary["overhead"] is None and summary["line"].endswith("s=0 overhead not measured (no dense arm)")
    # Above the decode time limit: a question; prefill above its FLOP limit but within its time limit: explained.
    results["s=0.5"]["prefill"] = [100.0 * prefill_limit + 5] * 3
    bench.report({arm: results[arm] for arm in arms}, config, size, {**profiles, "decode": _profile(limit=1.05)},
                 latency, served, runs)
    out = capsys.readouterr().out
    assert "ABOVE a time limit (1.050x): a question, not a win" in out
    prefill_share = served["prefill"]["skippable_share"]
    assert (f"above its FLOP limit, within its time limits: what a Project-Only row skips takes "
            f"{prefill_share:.1%} of the servers' model time") in out
    # Above the prefill time limit too: a question.
    bench.report({arm: results[arm] for arm in arms}, config, size,
                 {**profiles, "prefill": _profile(limit=prefill_limit, phase="prefill")}, latency, served, runs)
    out = capsys.readouterr().out
    assert f"ABOVE a time limit ({prefill_limit:.3f}x)" in out and "above its FLOP limit" not in out


def test_a_start_order_names_every_arm_once(tmp_path):
    bench = _bench_cpu()
    with pytest.raises(SystemExit, match="--start-order must name the arms dense, s=0, s=0.5 once each, got s=0,dense"):
        bench.main(["--start-order", "s=0,dense", "--out", str(tmp_path / "never")])
    assert not (tmp_path / "never").exists()


def test_a_part_clock_the_server_served_late_is_read_again():
    """A state document older than the read (`answered: false`) may lack the last passes: a run's tokens would
    then differ between arms that computed the same (39 against 40 decode tokens once, in the demo's bench)."""
    bench = _bench_cpu()
    docs = iter([{"answered": False, "part_clock": {"tokens_total": {"decode": 39}}},
                 {"answered": True, "part_clock": {"tokens_total": {"decode": 40}}}])

    class Server:
        def get_json(self, path):
            assert path == "/vskipper/attestation"
            return next(docs)

    assert bench.part_clock(Server())["tokens_total"]["decode"] == 40


def test_a_repetition_whose_arms_computed_different_tokens_is_refused():
    """Each arm gets the same prompts; a repeated prompt served from the radix cache in one arm and prefilled
    whole in another would make the arms' rates compare different work."""
    bench = _bench_cpu()
    runs = {arm: {"prefill": [{"tokens": 9216}, {"tokens": 8193}], "decode": []} for arm in ("dense", "s=0", "s=0.5")}
    for rep in (0, 1):
        bench.same_work(runs, "prefill", rep)  # a prompt cached alike in every arm is the same work
    runs["s=0.5"]["prefill"][1]["tokens"] = 9216
    with pytest.raises(RuntimeError, match=r"repetition 1, prefill: the arms computed different tokens \(dense 8193, s=0 8193, s=0.5 9216\).*radix"):
        bench.same_work(runs, "prefill", 1)
    del runs["s=0.5"]["prefill"][1]  # an arm yet to run this repetition is not compared
    bench.same_work(runs, "prefill", 1)
    runs["s=0"]["prefill"][0]["tokens"] = 0  # a server whose part clock counts no tokens is not the radix cache
    with pytest.raises(RuntimeError, match=r"repetition 0, prefill: a server's part clock counted no tokens"):
        bench.same_work(runs, "prefill", 0)
