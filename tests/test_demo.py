"""`python -m demo` as `make demo` runs it: the offline tour alone (seconds), its sizing refused naming the flag,
and end to end (smallest sizing): two real SGLang servers on CPU, the OpenAI-compatible API, a matched-work A/B
with loadgen, the attestation and /metrics; the servers stop after; then the routing bench (step 6) at its quick
size, which is also the test of `make bench-cpu`'s pipeline.

The full run takes about three to five minutes on a 2-core CPU, most of it servers starting (two for the A/B,
two for the quick bench).
"""

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from test_bench_cpu import check_quick_bench

from demo.live import DEMO_ENTER_TOKENS, DEMO_EXIT_TOKENS
from vskipper.constants import CONSTANTS


def _demo(args, env, timeout=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "demo", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _sample(lines, name, **labels):
    for line in lines:
        series, value = line.rsplit(" ", 1)
        if series.split("{")[0] == name and dict(re.findall(r'(\w+)="([^"]*)"', series)) == labels:
            return float(value)
    raise AssertionError(f"{name}{labels} not among the printed metrics")


def test_offline_tour_writes_a_servable_checkpoint_and_replays_the_switch_without_a_server(cli_env, tmp_path):
    proc = _demo(["--offline", "--out", str(tmp_path / "demo")], cli_env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "exit 160000, enter 200000" in out and "route_on" in out
    assert "== 2." not in out and not (tmp_path / "demo" / "servers").exists()  # the tour starts no server
    assert (tmp_path / "demo" / "tiny-flexidepth" / "tokenizer.json").is_file()  # servable as written
    att = json.loads((tmp_path / "demo" / "switch-attestation.json").read_text())
    assert att["decisions_total"]["route_on"] == 1 and att["promoted_requests_total"] > 0


def test_a_sizing_out_of_range_exits_2_naming_the_flag(cli_env):
    proc = _demo(["--requests", "1"], cli_env)
    assert proc.returncode == 2 and "--requests must be between 2" in proc.stderr and "Traceback" not in proc.stderr
    proc = _demo(["--bench", "full"], cli_env)
    assert proc.returncode == 2 and "--bench: invalid choice: 'full'" in proc.stderr


@pytest.mark.server
def test_full_demo_serves_both_arms_gates_the_ab_and_prints_attestation_and_metrics(cli_env, tmp_path):
    # a burst (eight requests within 8 ms): they decode together on any host, however fast, so routing engages
    out = tmp_path / "demo"
    proc = _demo(["--out", str(out), "--requests", "8", "--repetitions", "1", "--rate", "1000", "--bench", "quick"],
                 cli_env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    servers = summary["servers"]
    assert set(servers) == {"dense", "hybrid"}

    # the offline tour still runs first
    assert text.index("exit 160000, enter 200000") < text.index("== 2.")

    # the OpenAI-compatible API answered on the hybrid server
    api = json.loads((out / "openai.json").read_text())
    assert api["chat_completion"]["choices"][0]["message"]["role"] == "assistant"
    assert api["chat_completion"]["usage"]["completion_tokens"] == 16
    assert api["completion"]["usage"]["completion_tokens"] == 16
    assert f"POST {servers['hybrid']}/v1/chat/completions" in text

    # the A/B: its report exists and every gate passed, the hybrid arm's routing engaged in its matched cell
    ab = summary["ab"]
    assert ab["gates_passed"] is True, ab.get("refusals")
    report = json.loads(Path(ab["report"]).read_text())
    assert (report["baseline"], report["arm"]) == ("dense", "hybrid")
    assert report["repetitions_run"] == report["repetitions_accepted"] == 1
    gates = report["repetitions"][0]["gates"]
    assert gates["passed"] and {"work_identity", "mechanism_evidence", "served_design", "execution_difference",
                                "cross_arm_identity"} <= set(gates["checked"])
    table = (Path(ab["report_dir"]) / "table.md").read_text()
    assert table.count("| 1000req-s | hybrid | 1 |") == 1
    assert "- 1000req-s hybrid: execution_difference passed 1/1; cross_arm_identity passed 1/1; KV pool hybrid" in table
    assert "execution_difference passed 1/1; cross_arm_identity passed 1/1" in text  # printed with the table
    rows = {r["arm"]: r for r in ab["arms"]}
    assert rows["hybrid"]["decode_passes"]["routed"] > 0 and rows["dense"]["decode_passes"]["routed"] == 0
    assert rows["hybrid"]["output_tokens"] == rows["dense"]["output_tokens"] > 0  # matched work
    assert "not performance claims" in text and "scaled for this tiny model" in text

    # the attestation as printed equals the served document: routed decode on hybrid, none on dense
    hybrid = json.loads((out / "attestation-hybrid.json").read_text())
    dense = json.loads((out / "attestation-dense.json").read_text())
    assert hybrid["arm"]["name"] == "hybrid" and dense["arm"]["name"] == "dense"
    assert hybrid["thresholds"] == {"enter_tokens": DEMO_ENTER_TOKENS, "exit_tokens": DEMO_EXIT_TOKENS,
                                       "source": "flags", "prefill_floor_source": "vskipper.constants",
                                       "prefill_floor_tokens": CONSTANTS.prefill_min_prompt_tokens}
    routed = hybrid["passes_total"]["decode"]["routed"]
    # (a burst starts every request routed, so nothing is promoted here: TestHybridArm proves promotion)
    assert routed > 0 and hybrid["rows_total"]["decode"]["project_only"] > 0
    assert hybrid["passes_total"]["prefill"]["routed"] == 0  # short prompts: under the prefill floor
    assert dense["passes_total"]["decode"]["routed"] == 0 and dense["passes_total"]["decode"]["dense"] > 0
    assert f"GET {servers['hybrid']}/vskipper/attestation" in text
    assert f"decode  passes: dense {hybrid['passes_total']['decode']['dense']}, routed {routed}" in text
    assert f"thresholds: enter {DEMO_ENTER_TOKENS} / exit {DEMO_EXIT_TOKENS}" in text

    # /metrics: where it is, and the vskipper_* lines agree with the attestation
    assert f"{servers['hybrid']}/metrics" in text and f"{servers['dense']}/metrics" in text
    lines = (out / "metrics-hybrid.txt").read_text().splitlines()
    assert lines and all(line.startswith("vskipper_") for line in lines)
    assert _sample(lines, "vskipper_passes_total", mode="routed", phase="decode") == routed
    assert _sample(lines, "vskipper_threshold_tokens", bound="enter") == DEMO_ENTER_TOKENS
    assert f'vskipper_passes_total{{mode="routed",phase="decode"}} {float(routed)}' in text

    # step 6, once the A/B's servers stopped: the routing bench at its quick size, streamed, kept and summarised
    assert text.index("servers stopped") < text.index("== 6.") and "CPU figures" in text
    bench_lines = (out / "routing-bench.txt").read_text()
    check_quick_bench(bench_lines, out / "routing-bench")
    assert f"  {bench_lines.strip().splitlines()[-1]}" in text
    assert summary["routing"]["line"] == bench_lines.strip().splitlines()[-1]

    # both servers were stopped when the demo ended
    assert "servers stopped" in text
    for url in servers.values():
        with pytest.raises(OSError):
            urllib.request.urlopen(url + "/health", timeout=5)
