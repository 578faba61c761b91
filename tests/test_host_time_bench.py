"""`benchmarks/host_time_bench.py` at its quick size, in a child process (SGLang's context is published there):
the report's structure, every arm and ratio of both measurements, in either execution of the routed layers; its
figures mean nothing here."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_the_host_time_bench_reports_each_arm_and_the_routed_over_dense_ratios_of_both_measurements(tmp_path):
    out = tmp_path / "host.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_time_bench.py"), "--quick", "--json",
                          str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout
    for heading in ("hooks: prepare_pass + finish_pass", "pass: the whole eager pass",
                    "what the routed arms' hooks add over dense's"):
        assert heading in text
    lines = text.splitlines()
    assert lines[-2].startswith("host: hooks s=0.5/dense ") and "; pass s=0.5/dense " in lines[-2]
    assert lines[-2].endswith("(goal <= 1.10x)")
    report = json.loads(out.read_text())
    assert report["repetitions"] == 2 and report["goal"] == 1.10
    for kind in ("hooks", "pass"):
        shapes = report["summary"][kind]
        assert set(shapes) == {"decode b=4", "prefill 2x8"}
        for label, s in shapes.items():
            assert set(s["arms"]) == {"dense", "s=0", "s=0.5"}
            assert set(s["ratios"]) == {"s=0/dense", "s=0.5/dense"}
            for arm in s["arms"].values():
                assert 0 < arm["min"] <= arm["median"] <= arm["max"]
            assert all(len(us) == 2 for us in report["results"][kind][label]["us"].values())
            assert f"  {label}" in text
    assert "added_us" in report["summary"]["hooks"]["decode b=4"]["ratios"]["s=0.5/dense"]


def test_the_host_time_bench_takes_one_measurement_where_asked(tmp_path):
    out = tmp_path / "hooks.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_time_bench.py"), "--quick", "--only",
                          "hooks", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "hooks: prepare_pass + finish_pass" in run.stdout and "pass: the whole eager pass" not in run.stdout
    assert run.stdout.splitlines()[-2].startswith("host: hooks s=0.5/dense ") and "; pass" not in run.stdout
    assert set(json.loads(out.read_text())["results"]) == {"hooks"}


def test_the_host_time_bench_times_each_part_of_a_pass_where_asked(tmp_path):
    """`--only parts`: each arm's pass timed part by part (the hooks, the skipper's state, the dense and the routed
    layers, the rest), each routed arm's over dense's; the dense arm prepares no skipper state, the routed arms do,
    and the parts of every arm are positive where they ran."""
    out = tmp_path / "parts.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_time_bench.py"), "--quick", "--only",
                          "parts", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout
    assert "parts: where a whole eager pass's host time goes" in text and "(4 dense, 4 routed)" in text
    assert "hooks: prepare_pass" not in text and "pass: the whole eager pass" not in text
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"parts"}
    parts = report["summary"]["parts"]
    assert set(parts) == {"decode b=4", "prefill 2x8"}
    for label, s in parts.items():
        assert set(s["arms"]) == {"dense", "s=0", "s=0.5"} and set(s["added_us"]) == {"s=0", "s=0.5"}
        assert s["arms"]["dense"]["state"] == 0
        for name, arm in s["arms"].items():
            assert list(arm) == ["prepare_pass", "state", "dense layers", "routed layers", "finish_pass", "rest"]
            ran = [part for part in arm if part != "rest" and (part != "state" or name != "dense")]
            assert all(arm[part] > 0 for part in ran), (label, name, arm)
        for name, added in s["added_us"].items():
            assert added["state"] == s["arms"][name]["state"]
        assert f"  {label}" in text
    assert text.count("      per layer") == 4  # each layer group's per layer, in each shape


def test_the_host_time_bench_times_the_triton_execution_with_its_launches_counted_not_run(tmp_path):
    """`--execution triton`: the routed arms serve the GPU's execution (under the interpreter, its launches
    recorded and skipped), the eager pass is timed in prefill alone, and the launch table counts the Triton
    launches a routed pass makes (the skipper's routes once a pass, and five a routed layer in prefill: the maps, Q,
    o_proj, the FFN pair's two) beside dense's none."""
    out = tmp_path / "triton.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_time_bench.py"), "--quick", "--execution",
                          "triton", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "routed arms' execution: triton, prefill read 'backend'; every arm's RMSNorm, SiLU-and-mul and RoPE on " \
        "SGLang's torch paths; Triton launches recorded, not run" in run.stdout
    assert "launches a pass: torch operators that compute or copy" in run.stdout
    report = json.loads(out.read_text())
    assert report["execution"] == "triton" and report["prefill_read"] == "backend"
    assert set(report["summary"]["pass"]) == {"prefill 2x8"} and set(report["summary"]["hooks"]) == {
        "decode b=4", "prefill 2x8"}
    prefill = report["launches"]["prefill 2x8"]
    assert prefill["dense"]["triton"] == 0 and prefill["dense"]["ops"] > 0
    routed_layers = 4  # the quick model's 8 layers, the deeper half routed
    for arm in ("s=0", "s=0.5"):
        assert prefill[arm]["by_kernel"] == {"random_routes_kernel": 1, **{name: routed_layers for name in (
            "cohort_maps_kernel", "cohort_gemm_kernel", "cohort_down_scatter_kernel", "grouped_gate_up_kernel",
            "grouped_down_scatter_kernel")}}  # and RandomSkip's routes of the pass in one launch
        assert report["launches"]["decode b=4"][arm]["by_kernel"]["masked_decode_split_kernel"] == routed_layers


def test_the_host_time_bench_puts_flexidepths_fused_gate_beside_its_own_route_where_asked(tmp_path):
    """`--flexidepth`: two more routed arms, FlexiDepth always-route over the checkpoint's routers in the triton
    execution, one routing with the fused gate (two launches a routed layer, the router's two GEMMs beside them),
    the other with the gate's own route (none of the gate's launches; its sigmoid and tanh among its operators),
    each timed and counted beside dense."""
    out = tmp_path / "fd.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_time_bench.py"), "--quick", "--execution",
                          "triton", "--flexidepth", "--only", "pass", "--json", str(out)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["routed_arms"] == ["s=0", "s=0.5", "fd", "fd-own"]
    prefill, routed_layers = report["launches"]["prefill 2x8"], 4
    fused, own = prefill["fd"], prefill["fd-own"]
    assert fused["by_kernel"]["gate_norm_tanh_kernel"] == fused["by_kernel"]["gate_decide_kernel"] == routed_layers
    assert "gate_norm_tanh_kernel" not in own["by_kernel"] and "random_routes_kernel" not in fused["by_kernel"]
    assert own["by_op"]["sigmoid"] == own["by_op"]["tanh"] == routed_layers and "sigmoid" not in fused["by_op"]
    # the module's and the decision's 18 operators a layer in fp32 (its 4 casts, which bfloat16 dispatches, are no
    # copies here), 2 of them the GEMMs the fused gate keeps
    assert own["ops"] - fused["ops"] == 16 * routed_layers
    assert set(report["summary"]["pass"]["prefill 2x8"]["ratios"]) == {f"{a}/dense" for a in report["routed_arms"]}


def test_the_host_time_bench_times_the_stack_sampler_against_none_where_asked(tmp_path):
    """`--only samples`: every arm's pass plain and sampled at each interval, the samples each interval's sampler
    took counted per side (a 5 ms sampler takes fewer than a 2 ms one over as many passes, each of its own side),
    with the seconds they held the interpreter's lock, and each sampled side over its plain one."""
    out = tmp_path / "samples.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_time_bench.py"), "--quick", "--only",
                          "samples", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "samples: the whole eager pass with the stack sampler reading it every 2 or 5 ms" in run.stdout
    assert "sampler every 2 ms: sampled/plain " in run.stdout and "sampler every 5 ms: sampled/plain " in run.stdout
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"samples"}
    for label, data in report["results"]["samples"].items():
        sides = {f"{arm}{side}" for arm in ("dense", "s=0", "s=0.5") for side in ("+2ms", "+5ms")}
        assert set(data["us"]) == sides | {"dense", "s=0", "s=0.5"} and set(data["samples"]) == sides
        taken = {ms: sum(data["samples"][f"{arm}+{ms}ms"]["samples"] for arm in ("dense", "s=0", "s=0.5"))
                 for ms in ("2", "5")}
        # each side its own samples: over the arms' sides a 2 ms sampler takes more than a 5 ms one (a side alone
        # may take few on a loaded host, where the sampler's thread wakes late)
        assert taken["2"] > taken["5"] > 0
        for ms in ("2", "5"):
            arms = report["summary"]["samples"][label][ms]
            assert set(arms) == {"dense", "s=0", "s=0.5"}
            for name, arm in arms.items():
                side = data["samples"][f"{name}+{ms}ms"]
                assert arm["samples_per_pass"] == side["samples"] / data["sampled_passes"]
                assert (arm["own_us_per_sample"] is None) == (side["samples"] == 0)
                assert side["samples"] == 0 or (arm["own_us_per_sample"] > 0 and side["seconds"] > 0)
                assert arm["ratio"]["min"] <= arm["ratio"]["median"] <= arm["ratio"]["max"]


def test_the_host_time_bench_times_routed_prefill_passes_whose_routed_layers_replay_where_asked(tmp_path):
    """`--prefill-graphs` (with `--execution triton` only): the routed arms' prefill passes replay their routed
    layers (each replay launching nothing): a replayed pass launches no Triton kernel and fewer operators than
    dense's, whose eager layers are as ever."""
    bench = str(ROOT / "benchmarks" / "host_time_bench.py")
    refused = subprocess.run([sys.executable, bench, "--quick", "--prefill-graphs"], capture_output=True, text=True,
                             timeout=300, cwd=ROOT)
    assert refused.returncode == 2 and "give --execution triton" in refused.stderr
    out = tmp_path / "graphs.json"
    run = subprocess.run([sys.executable, bench, "--quick", "--execution", "triton", "--prefill-graphs", "--only",
                          "pass", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the routed arms' prefill passes replay their routed layers from graphs" in run.stdout
    report = json.loads(out.read_text())
    assert report["prefill_graphs"] is True and set(report["summary"]["pass"]) == {"prefill 2x8"}
    prefill = report["launches"]["prefill 2x8"]
    for arm in ("s=0", "s=0.5"):
        assert prefill[arm]["triton"] == 0 and 0 < prefill[arm]["ops"] < prefill["dense"]["ops"]
    # the packed read: each routed layer one segment, its read inside: fewer operators still than the backend read's
    refused = subprocess.run([sys.executable, bench, "--quick", "--prefill-read", "packed"], capture_output=True,
                             text=True, timeout=300, cwd=ROOT)
    assert refused.returncode == 2 and "--prefill-read is the triton execution's" in refused.stderr
    packed_out = tmp_path / "packed.json"
    run = subprocess.run([sys.executable, bench, "--quick", "--execution", "triton", "--prefill-graphs",
                          "--prefill-read", "packed", "--only", "pass", "--json", str(packed_out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "prefill read 'packed'" in run.stdout
    packed = json.loads(packed_out.read_text())["launches"]["prefill 2x8"]
    for arm in ("s=0", "s=0.5"):
        assert packed[arm]["triton"] == 0 and 0 < packed[arm]["ops"] < prefill[arm]["ops"]
