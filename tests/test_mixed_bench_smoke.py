"""The GPU benchmark script runs end to end in its tiny CPU configuration (no timings are checked: the point is
that every section executes real routed and dense forwards, so the script is not dead code)."""

import json
import subprocess
import sys

from conftest import ROOT


def test_benchmark_smoke_run_executes_every_section(cli_env, tmp_path):
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mixed_depth_bench.py"), "--smoke",
                          "--json", str(out)], env=cli_env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [k["op"] for k in report["kernels"]] == [
        "mlp_gate_up", "mlp_down", "proj_gate_up", "proj_down", "attn_q", "attn_o"]
    assert [(k["K"], k["N"]) for k in report["kernels"][-2:]] == [(64, 64), (64, 64)]  # hidden, heads x head_dim
    assert len(report["decode"]["cells"]) == 4 and "tau_ms" in report["decode"]
    assert [p["tokens"] for p in report["prefill"]] == [16, 32]
    attested = [line for line in res.stdout.splitlines() if line.startswith("attestation after the run")]
    assert attested and '"cohort_passes": 0' not in attested[0]  # routed layers really ran cohorts


def test_benchmark_smoke_run_times_the_served_layer(cli_env, tmp_path):
    """Section 4 runs SGLang's routed decoder layer as the server builds it; the smoke run asks for the triton
    execution (in the interpreter), the one a GPU decodes and prefills with, so the GPU's code path runs here up to
    the graphs."""
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mixed_depth_bench.py"), "--smoke",
                          "--skip", "kernels,decode,prefill", "--json", str(out)], env=cli_env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    served = json.loads(out.read_text())["served"]
    assert served["execution"]["decode"] == "triton" and served["decode_graphs"] is False
    cells = served["decode"]["cells"]
    assert [(c["rows"], c["context"]) for c in cells] == [(2, 8), (2, 16), (4, 8), (4, 16)]
    for c in cells:  # at this size the adapter's weights can outweigh the K/V reads skipped: a limit below 1
        assert min(c["dense_ms"], c["s=0_ms"], c["s=0.5_ms"]) > 0 and 0.0 <= c["project_only_share"] <= 1.0
        assert c["bandwidth_limit"] == 1.0 if c["project_only_share"] == 0 else c["bandwidth_limit"] > 0
    assert any(c["project_only_share"] > 0 for c in cells)  # some rows really took the Project-Only branch
    prefill = served["prefill"]
    assert [p["tokens"] for p in prefill] == [16, 32]
    assert all(0 < p["project_only_share"] < 1 and p["flop_limit"] > 1 for p in prefill)
    # the triton execution's prefill read covers the RUN rows' packed slots alone
    assert not any(p["project_only_rows_read"] for p in prefill)
    assert json.loads(out.read_text())["complete"]
