"""The `vskipper` command line, run as a user runs it, and the torch-free import boundary."""

import json
import subprocess
import sys

import pytest


def run(args, env, check=True):
    proc = subprocess.run([sys.executable, "-m", "vskipper.cli", *args], capture_output=True, text=True, env=env)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_thresholds_json_for_a_catalogued_device(cli_env):
    out = json.loads(run(["thresholds", "--device", "NVIDIA-A100-SXM4-80GB", "--skip-ratio", "0.5",
                          "--model", "llama-3-8b", "--json"], cli_env).stdout)
    assert out["exit_tokens"] == 160_000 and out["enter_tokens"] == 200_000
    assert round(out["v_star_tokens"]) == 157_668 and round(out["ridge_rows"]) == 161


def test_thresholds_from_bandwidth_and_a_config_file(cli_env, tiny_flexidepth):
    out = json.loads(run(["thresholds", "--bandwidth-gbps", "3350", "--tflops", "990", "--skip-ratio", "0.5",
                          "--model", str(tiny_flexidepth / "config.json"), "--routed-layers", "16", "--json"],
                         cli_env).stdout)
    assert out["routed_layers"] == 16 and out["kv_bytes_per_token_layer"] == 256  # 2 * 2 kv heads * 16 * fp32
    text = run(["thresholds", "--device", "H100-SXM", "--skip-ratio", "0.5", "--model", "llama-3-8b"],
               cli_env).stdout
    assert "V* = 273.0k" in text and "exit 270k / enter 340k" in text


@pytest.mark.parametrize("args,message", [
    (["thresholds", "--device", "NVIDIA-X1", "--skip-ratio", "0.5", "--model", "llama-3-8b"], "unknown device"),
    (["thresholds", "--device", "H200", "--skip-ratio", "0", "--model", "llama-3-8b"], "skip_ratio"),
    (["thresholds", "--device", "H200", "--skip-ratio", "0.5", "--model", "gpt-5"], "neither a preset"),
    (["arms", "warp-speed"], "unknown arm"),
])
def test_errors_are_specific_and_exit_2(cli_env, args, message):
    proc = run(args, cli_env, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_devices_arms_constants_listings(cli_env):
    devices = json.loads(run(["devices", "--json"], cli_env).stdout)
    assert any(d["name"] == "H200" for d in devices)
    arms = json.loads(run(["arms", "--json"], cli_env).stdout)
    assert arms["hybrid"]["decode"] == "hybrid" and arms["always-route"]["prefill"] == "routed"
    consts = json.loads(run(["constants"], cli_env).stdout)
    assert consts["prefill_min_prompt_tokens"] == 1536 and consts["prefill_probe_period_batches"] == 64


def test_make_tiny_model_writes_a_checkpoint(cli_env, tmp_path):
    run(["make-tiny-model", "--arch", "qwen3-skipper", "--out", str(tmp_path / "q")], cli_env)
    assert (tmp_path / "q" / "model.safetensors").is_file()


def test_pure_modules_import_without_torch(cli_env):
    """The operator installs vSkipper without torch: the rule, the switch, the arms and the registry must not
    pull it in."""
    code = ("import sys, vskipper.roofline, vskipper.switch, vskipper.arms, vskipper.constants, "
            "vskipper.skippers, vskipper.modelspec, vskipper.cli; "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
