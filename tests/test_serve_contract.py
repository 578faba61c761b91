"""The contract between the operator and the runtime: the container arguments the operator plans are accepted
by `vskipper serve` as they are, and reach SGLang and the served configuration intact.

No cluster and no GPU here: the planned Deployment's arguments are run through `vskipper serve --dry-run`
(which validates the arm against the checkpoint and prints the server command and environment it would exec)."""

import json
import subprocess
import sys

from operator_fixtures import mixed_pool, resource

from vskipper.checkpoint import make_tiny_model
from vskipper_operator.plan import ARM_FILE, Node, plan


def sglang_parser():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def test_planned_container_args_are_accepted_by_vskipper_serve(tmp_path, cli_env):
    ckpt = make_tiny_model("flexidepth-llama", tmp_path / "ckpt")
    spec_changes = {"model": {"path": "/models/flexidepth", "preset": "llama-3-8b", "servedName": "llama3-skip"},
                    "serving": {"image": "vskipper:test", "cudaGraphMaxBatchSize": 256},
                    "metrics": {"enabled": True}}
    result = plan(resource(**spec_changes), [Node.from_object(n) for n in mixed_pool()])
    deployments = [o for o in result.objects if o["kind"] == "Deployment"]
    config_map = next(o for o in result.objects if o["kind"] == "ConfigMap")
    assert len(deployments) == 2  # A100 and H100 classes; the unknown GPU gets none
    arm_file = tmp_path / "arm.json"
    arm_file.write_text(config_map["data"]["arm.json"])
    for deployment in deployments:
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        args = [str(ckpt) if a == "/models/flexidepth" else str(arm_file) if a == ARM_FILE else a
                for a in container["args"]]
        assert args[0] == "serve"
        proc = subprocess.run([sys.executable, "-m", "vskipper.cli", *args, "--platform", "cpu", "--dry-run"],
                              capture_output=True, text=True, env=cli_env)
        assert proc.returncode == 0, proc.stderr
        shown = json.loads(proc.stdout)
        command = shown["command"]
        for flag in ("--served-model-name", "--tp-size", "--dtype", "--cuda-graph-max-bs-decode", "--enable-metrics"):
            assert flag in command, flag  # SGLang's own flags pass through unchanged
        assert command[command.index("--served-model-name") + 1] == "llama3-skip"
        exit_tokens = args[args.index("--exit-tokens") + 1]
        enter_tokens = args[args.index("--enter-tokens") + 1]
        env = json.dumps(shown["environment"])
        assert exit_tokens in env and enter_tokens in env  # the class's thresholds reach the served config
        # ... and SGLang's own launch-flag parser (the pinned release's) takes every flag, unambiguously.
        assert command[1:3] == ["-m", "vskipper.sglang.server"]
        server_args = sglang_parser().parse_args(command[3:])
        assert server_args.served_model_name == "llama3-skip" and server_args.cuda_graph_max_bs_decode == 256


def test_serve_refuses_unknown_options_only_for_other_commands(cli_env):
    proc = subprocess.run([sys.executable, "-m", "vskipper.cli", "devices", "--bogus"], capture_output=True,
                          text=True, env=cli_env)
    assert proc.returncode == 2 and "unrecognized arguments: --bogus" in proc.stderr
