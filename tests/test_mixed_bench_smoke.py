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
    assert len(report["kernels"]) == 4 and {k["op"] for k in report["kernels"]} == {
        "mlp_gate_up", "mlp_down", "proj_gate_up", "proj_down"}
    assert len(report["decode"]["cells"]) == 4 and "tau_ms" in report["decode"]
    assert [p["tokens"] for p in report["prefill"]] == [16, 32]
    assert '"cohort_passes": 0' not in res.stdout.splitlines()[-1]  # routed layers really ran cohorts
