"""The bandwidth probe: a real torch copy benchmark (on CPU here; a probe Job runs it on the GPU class)."""

from __future__ import annotations

import json
import subprocess
import sys

from operator_fixtures import H100, node, resource

from vskipper.modelspec import PRESETS
from vskipper.roofline import derive_thresholds
from vskipper_operator.plan import plan
from vskipper_operator.probe import parse_result


def test_probe_measures_copy_bandwidth_and_writes_the_termination_message(tmp_path):
    log = tmp_path / "termination-log"
    out = subprocess.run([sys.executable, "-m", "vskipper_operator.probe", "--device", "cpu", "--mib", "32",
                          "--iters", "4", "--termination-log", str(log)], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["method"] == "copy" and result["device"] == "cpu" and result["bytes"] == 32 * 2**20
    assert result["bandwidth_gbps"] == round(2 * result["bytes"] * 4 / result["seconds"] / 1e9, 1)
    assert 0.05 < result["bandwidth_gbps"] < 2000  # any real CPU copy lands in this range
    assert json.loads(log.read_text()) == result


def test_probe_result_flows_into_the_plan_as_measured_bandwidth(tmp_path):
    log = tmp_path / "termination-log"
    subprocess.run([sys.executable, "-m", "vskipper_operator.probe", "--device", "cpu", "--mib", "16",
                    "--iters", "2", "--termination-log", str(log)], capture_output=True, check=True)
    gbps = parse_result(log.read_text())
    result = plan(resource(), [node("h100-0", H100)], measured={H100: gbps})
    (row,) = result.status()["gpuClasses"]
    assert (row["bandwidthSource"], row["bandwidthGBps"]) == ("measured", gbps)
    want = derive_thresholds(gbps, 0.5, 16, PRESETS["llama-3-8b"].kv_bytes_per_token_layer)
    assert (row["exitTokens"], row["enterTokens"]) == (want.exit_tokens, want.enter_tokens)


def test_unreadable_probe_output_is_not_a_measurement():
    assert parse_result(None) is None
    assert parse_result("Error: CUDA out of memory") is None
    assert parse_result(json.dumps({"bandwidth_gbps": 0})) is None
    assert parse_result(json.dumps({"bandwidth_gbps": "2890.5"})) == 2890.5


def test_cuda_probe_refuses_to_run_without_a_gpu():
    """No GPU here: the CUDA path itself is exercised only by a probe Job on a GPU node."""
    import torch

    if torch.cuda.is_available():
        return
    out = subprocess.run([sys.executable, "-m", "vskipper_operator.probe", "--device", "cuda",
                          "--termination-log", ""], capture_output=True, text=True)
    assert out.returncode != 0 and "no CUDA device is visible" in out.stderr
