"""`vskipper serve`: validate the served configuration here, then hand the process over to the server launcher."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from vskipper.arms import Arm, get_arm
from vskipper.switch import Policy

# SGLang's CPU recipe: the CPU engine (environment), torch-native attention and sampling, no grammar backend,
# no CUDA graphs, a small KV pool. Flags after `--` are appended and override these (SGLang keeps the last).
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--grammar-backend", "none", "--cuda-graph-backend-decode", "disabled",
             "--cuda-graph-backend-prefill", "disabled", "--mem-fraction-static", "0.1",
             "--max-total-tokens", "4096")


def load_arm(args: argparse.Namespace) -> Arm:
    if args.arm_file:
        with open(args.arm_file) as f:
            return Arm.from_dict(json.load(f), name=args.arm or Path(args.arm_file).stem)
    if not args.arm:
        raise ValueError("serve: pass --arm NAME or --arm-config FILE")
    return get_arm(args.arm)


def resolve_platform(platform: str) -> str:
    if platform == "auto":
        return "gpu" if os.path.exists("/dev/nvidiactl") else "cpu"
    return platform


def thresholds(arm: Arm, enter: int | None, exit_: int | None) -> tuple[int, int]:
    settings = arm.switch_settings()
    hybrid = Policy.HYBRID in (settings.prefill, settings.decode)
    if enter is None and exit_ is None:
        if hybrid and settings.decode is Policy.HYBRID:
            raise ValueError(f"arm {arm.name!r} switches decode by resident tokens: pass --enter-tokens and "
                             "--exit-tokens (`vskipper thresholds` derives them for a GPU)")
        return 0, 0
    if enter is None or exit_ is None:
        raise ValueError("--enter-tokens and --exit-tokens go together")
    return enter, exit_


def server_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    from vskipper.sglang.spec import ServeSpec, check_arm_for_model, checkpoint_config, serve_environment

    arm = load_arm(args)
    check_arm_for_model(arm, checkpoint_config(args.model).get("model_type", ""))
    enter, exit_ = thresholds(arm, args.enter_tokens, args.exit_tokens)
    state = Path(args.state_file) if args.state_file else Path(tempfile.mkdtemp(prefix="vskipper-")) / "state.json"
    spec = ServeSpec(arm, enter, exit_, state)
    extra = list(args.sglang_args or [])
    cpu = resolve_platform(getattr(args, "platform", "auto")) == "cpu"
    cmd = [sys.executable, "-m", "vskipper.sglang.server", "--model-path", str(args.model), *(CPU_FLAGS if cpu else ()),
           "--host", args.host, "--port", str(args.port), *extra]
    return cmd, serve_environment(spec, cpu=cpu)


def run_serve(args: argparse.Namespace) -> int:
    cmd, env = server_command(args)
    if args.dry_run:
        shown = {k: v for k, v in env.items() if k.startswith(("VSKIPPER_", "SGLANG_")) or k == "PYTHONPATH"}
        print(json.dumps({"command": cmd, "environment": shown}, indent=2))
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)
    return 0  # not reached
