"""`vskipper serve`: validate the served configuration here, then hand the process over to the server launcher."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from vskipper.arms import Arm, get_arm
from vskipper.modelspec import load_model_facts
from vskipper.roofline import derive_thresholds, lookup_device
from vskipper.serveargs import API_KEY_ENV
from vskipper.switch import Policy

NVIDIA_DEVICE_NODE = "/dev/nvidiactl"  # present wherever an NVIDIA driver exposes a device


def eager_routed_phases(arm: Arm) -> list[str]:
    """SGLang flags that run the arm's routed phases without a routed graph variant eagerly (after the caller's
    flags: SGLang keeps the last): a replayed graph of such a phase would run the dense model, and the model
    refuses to start with those graphs on."""
    from vskipper.sglang.spec import ROUTED_GRAPH_PHASES

    return [flag for phase in arm.routed_phases if phase not in ROUTED_GRAPH_PHASES
            for flag in (f"--cuda-graph-backend-{phase}", "disabled")]


def load_arm(args: argparse.Namespace) -> Arm:
    if args.arm_file:
        with open(args.arm_file) as f:
            return Arm.from_dict(json.load(f), name=args.arm or Path(args.arm_file).stem)
    if not args.arm:
        raise ValueError("serve: pass --arm NAME or --arm-config FILE")
    return get_arm(args.arm)


def resolve_platform(platform: str, device_node: str = NVIDIA_DEVICE_NODE) -> str:
    """cpu | gpu: `auto` is gpu where an NVIDIA device node exists."""
    if platform == "auto":
        return "gpu" if os.path.exists(device_node) else "cpu"
    return platform


def real_sgl_kernel_importable() -> bool:
    """Whether this interpreter finds an `sgl_kernel` that is not one of vSkipper's stand-ins (never imported here:
    the real one loads CUDA libraries)."""
    from vskipper.sglang.spec import SHIMS_DIR, SHIMS_GPU_DIR

    try:
        found = importlib.util.find_spec("sgl_kernel")
    except (ImportError, ValueError):
        return False
    if found is None or found.origin is None:
        return False
    origin = Path(found.origin).resolve()
    return not any(origin.is_relative_to(d) for d in (SHIMS_DIR, SHIMS_GPU_DIR))


def detect_gpu_product() -> str | None:
    """The first GPU's product name as `nvidia-smi` reports it; None where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    return names[0] if names else None


def thresholds(arm: Arm, enter: int | None, exit_: int | None, model_dir: str | Path | None = None,
               gpu: str | None = None) -> tuple[int, int, str]:
    """(enter, exit, source): from the flags, else, for an arm that switches decode, from the roofline rule
    for the GPU (`--gpu`, else the detected one), the checkpoint's routed layers and KV width, and the arm's
    skip ratio as the checkpoint's routed layers carry it out."""
    if enter is not None or exit_ is not None:
        if enter is None or exit_ is None:
            raise ValueError("--enter-tokens and --exit-tokens go together")
        return enter, exit_, "flags"
    if arm.switch_settings().decode is not Policy.HYBRID:
        return 0, 0, "unused (decode is not switched)"
    product = gpu or detect_gpu_product()
    if product is None:
        raise ValueError(f"arm {arm.name!r} switches decode by resident tokens and no GPU was detected: pass "
                         "--enter-tokens and --exit-tokens, or --gpu PRODUCT to derive them for that GPU")
    device = lookup_device(product)
    facts = load_model_facts(str(model_dir))
    skip_ratio = arm.declared_skip_ratio(facts.num_routed_layers)
    if not skip_ratio:
        raise ValueError(f"arm {arm.name!r} declares no skip ratio to derive thresholds from: pass "
                         "--enter-tokens and --exit-tokens")
    t = derive_thresholds(device.bandwidth_gbps, skip_ratio, facts.num_routed_layers,
                          facts.kv_bytes_per_token_layer, device.dense_tflops)
    return t.enter_tokens, t.exit_tokens, f"roofline:{device.name}"


def checked_tile_table(path: str | None, platform: str, product: str | None = None) -> Path | None:
    """The tile table the server is handed (`--tile-table`), checked here before anything heavy starts: it loads,
    and on a GPU it names that GPU (`product`, else the detected one). The model checks it again against the
    device it runs on."""
    from vskipper.mixed.tiles import TileTableError, given_tile_table, load_tile_table

    if path is None:
        return None
    try:
        product = product or (detect_gpu_product() if platform == "gpu" else None)
        if product is not None:
            given_tile_table(path, product)
        else:
            load_tile_table(path)
    except TileTableError as exc:
        raise ValueError(f"--tile-table: {exc}") from None
    return Path(path).resolve()


def platform_profile(platform: str, jit: bool = False, ops: str = "torch"):
    """The serving profile of a resolved platform on this machine: on a GPU, with the real `sgl_kernel` where one
    is importable, else the stand-ins (their RMSNorm, SiLU-and-mul and RoPE on `ops`)."""
    from vskipper.sglang.spec import serve_profile

    return serve_profile(platform, platform == "gpu" and real_sgl_kernel_importable(), jit, ops)


def server_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    from vskipper.sglang.spec import (
        ENV_INTERLEAVE_CONTROL,
        ENV_PASS_SPANS,
        ENV_PREFILL_READ,
        ENV_STACK_SAMPLES,
        ServeSpec,
        check_arm_for_model,
        checkpoint_config,
        part_clock_from_env,
        prefill_graphs_from_env,
        serve_environment,
        switch_from_env,
    )

    arm = load_arm(args)
    check_arm_for_model(arm, checkpoint_config(args.model).get("model_type", ""))
    if arm.skipper is not None:  # the params can skip on this checkpoint's routed layers (else SkipperConfigError)
        arm.declared_skip_ratio(load_model_facts(str(args.model)).num_routed_layers)
    enter, exit_, source = thresholds(arm, args.enter_tokens, args.exit_tokens, args.model,
                                      getattr(args, "gpu", None))
    platform = resolve_platform(getattr(args, "platform", "auto"))
    profile = platform_profile(platform, getattr(args, "gpu_jit", False), getattr(args, "stand_in_ops", "torch"))
    extra = list(args.sglang_args or [])
    state = Path(args.state_file) if args.state_file else Path(tempfile.mkdtemp(prefix="vskipper-")) / "state.json"
    tiles = checked_tile_table(getattr(args, "tile_table", None), platform, getattr(args, "gpu", None))
    spec = ServeSpec(arm, enter, exit_, state, source, profile.attestation(), part_clock_from_env(os.environ),
                     switch_from_env(os.environ, ENV_INTERLEAVE_CONTROL), tile_table=tiles,
                     pass_spans=switch_from_env(os.environ, ENV_PASS_SPANS),
                     stack_samples=switch_from_env(os.environ, ENV_STACK_SAMPLES),
                     prefill_graphs=prefill_graphs_from_env(os.environ),
                     prefill_read=os.environ.get(ENV_PREFILL_READ) or "auto",
                     prefill_floor_tokens=getattr(args, "prefill_floor_tokens", None))
    cmd = [sys.executable, "-m", "vskipper.sglang.server", "--model-path", str(args.model), *profile.flags,
           "--host", args.host, "--port", str(args.port), *extra,
           *(eager_routed_phases(arm) if platform == "gpu" else ())]
    return cmd, serve_environment(spec, profile=profile)


def run_serve(args: argparse.Namespace) -> int:
    from vskipper.sglang.spec import ENV_PROFILE

    cmd, env = server_command(args)
    if args.dry_run:
        shown = {k: "***" if k == API_KEY_ENV else v for k, v in env.items()
                 if k.startswith(("VSKIPPER_", "SGLANG_")) or k == "PYTHONPATH"}  # the key stays unprinted
        profile = json.loads(env[ENV_PROFILE])
        print(json.dumps({"command": cmd, "environment": shown, "profile": profile}, indent=2))
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)
    return 0  # not reached
