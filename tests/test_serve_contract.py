"""The contract between the operator and the runtime image: a planned server container, started the way Kubernetes
starts it in the runtime image, reaches `vskipper serve` and SGLang with every flag intact.

No cluster, image build or GPU here. The image's launch (ENTRYPOINT, CMD and the files COPY puts in place) is read
from images/runtime.Dockerfile; the planned container is resolved against it by Kubernetes' rules (`command`
replaces ENTRYPOINT, `args` replaces CMD); the entrypoint script runs from this tree with the planned environment
and execs `vskipper serve ... --dry-run` (which validates the arm against the checkpoint and prints the server
command and environment it would exec); that command then goes through SGLang 0.5.21's own flag parser."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from operator_fixtures import mixed_pool, resource

from vskipper.checkpoint import make_tiny_model
from vskipper.sglang.spec import ENV_ENTER, ENV_EXIT
from vskipper_operator.plan import ARM_FILE, Node, plan

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_DOCKERFILE = ROOT / "images" / "runtime.Dockerfile"


@dataclass(frozen=True)
class ImageLaunch:
    entrypoint: list[str]
    cmd: list[str]
    copies: list[tuple[tuple[str, ...], str]]  # (build-context sources, destination in the image)

    def source_of(self, path: str) -> Path:
        """The build-context file COPY puts at `path` in the image."""
        for sources, dest in self.copies:
            if dest == path and len(sources) == 1:
                return ROOT / sources[0]
        raise AssertionError(f"nothing in {RUNTIME_DOCKERFILE.name} is copied to {path}")

    @property
    def copied_roots(self) -> set[str]:
        return {Path(s).parts[0] for sources, _ in self.copies for s in sources}


def image_launch(dockerfile: Path) -> ImageLaunch:
    entrypoint: list[str] = []
    cmd: list[str] = []
    copies = []
    for line in dockerfile.read_text().splitlines():
        word, _, rest = line.partition(" ")
        if word == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif word == "CMD":
            cmd = json.loads(rest)
        elif word == "COPY":
            *sources, dest = rest.split()
            copies.append((tuple(s.rstrip("/") for s in sources), dest))
    assert entrypoint, f"{dockerfile.name}: no exec-form ENTRYPOINT"
    return ImageLaunch(entrypoint, cmd, copies)


def container_argv(container: dict, image: ImageLaunch) -> list[str]:
    """What Kubernetes runs for a container: `command` replaces the image's ENTRYPOINT, `args` its CMD, and a
    `command` given without `args` drops the CMD."""
    command = container.get("command") or image.entrypoint
    if container.get("args"):
        args = container["args"]
    else:
        args = [] if container.get("command") else image.cmd
    return [*command, *args]


def sglang_parser():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


@pytest.mark.server
def test_planned_server_containers_start_through_the_image_entrypoint_into_serve_and_sglang(tmp_path, cli_env):
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
    launch = image_launch(RUNTIME_DOCKERFILE)
    # `vskipper` as the image's console script runs it: the package's CLI on this interpreter.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vskipper").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m vskipper.cli "$@"\n')
    (bin_dir / "vskipper").chmod(0o755)
    for deployment in deployments:
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        argv = container_argv(container, launch)
        assert argv[: len(launch.entrypoint)] == launch.entrypoint  # the image's entrypoint runs, not bypassed
        script = launch.source_of(launch.entrypoint[0])
        args = [str(ckpt) if a == "/models/flexidepth" else str(arm_file) if a == ARM_FILE else a
                for a in argv[len(launch.entrypoint):]]
        env = {**cli_env, **{e["name"]: e["value"] for e in container.get("env", [])},
               "PATH": f"{bin_dir}:{cli_env['PATH']}"}
        proc = subprocess.run([sys.executable, str(script), *args, "--platform", "cpu", "--dry-run"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        product = deployment["metadata"]["annotations"]["vskipper.io/gpu-product"]
        assert f"vskipper runtime on {product}: vskipper serve --model {ckpt}" in proc.stderr
        shown = json.loads(proc.stdout)
        command = shown["command"]
        for flag in ("--served-model-name", "--tp-size", "--dtype", "--cuda-graph-max-bs-decode", "--enable-metrics"):
            assert flag in command, flag  # SGLang's own flags pass through unchanged
        assert command[command.index("--served-model-name") + 1] == "llama3-skip"
        exit_tokens = args[args.index("--exit-tokens") + 1]
        enter_tokens = args[args.index("--enter-tokens") + 1]
        served = shown["environment"]
        assert (served[ENV_EXIT], served[ENV_ENTER]) == (exit_tokens, enter_tokens)  # the class's thresholds
        # ... and SGLang's own launch-flag parser (the pinned release's) takes every flag, unambiguously.
        assert command[1:3] == ["-m", "vskipper.sglang.server"]
        server_args = sglang_parser().parse_args(command[3:])
        assert server_args.served_model_name == "llama3-skip" and server_args.cuda_graph_max_bs_decode == 256


def test_the_runtime_image_carries_what_every_planned_pod_runs():
    """Servers start through the entrypoint the image copies in; probe Jobs run a module whose source tree the
    image copies (and installs: pyproject's package discovery covers it)."""
    result = plan(resource(bandwidthProbe={"enabled": True}), mixed_pool())
    launch = image_launch(RUNTIME_DOCKERFILE)
    pods = [o["spec"]["template"]["spec"] for o in result.objects if o["kind"] in ("Deployment", "Job")]
    assert {o["kind"] for o in result.objects} >= {"Deployment", "Job"}
    for pod in pods:
        (container,) = pod["containers"]
        assert container["image"] == resource()["spec"]["serving"]["image"]
        argv = container_argv(container, launch)
        if argv[0] == launch.entrypoint[0]:
            assert launch.source_of(argv[0]).is_file()
            continue
        assert argv[:2] == ["python", "-m"], argv
        origin = Path(importlib.util.find_spec(argv[2]).origin).relative_to(ROOT)
        assert origin.parts[0] in launch.copied_roots, f"{argv[2]} ({origin}) is not copied into the image"


def test_container_argv_follows_kubernetes_rules():
    image = ImageLaunch(["/entry"], ["serve"], [])
    assert container_argv({}, image) == ["/entry", "serve"]
    assert container_argv({"args": ["--x"]}, image) == ["/entry", "--x"]
    assert container_argv({"command": ["vskipper"]}, image) == ["vskipper"]
    assert container_argv({"command": ["vskipper"], "args": ["serve"]}, image) == ["vskipper", "serve"]


def test_serve_refuses_unknown_options_only_for_other_commands(cli_env):
    proc = subprocess.run([sys.executable, "-m", "vskipper.cli", "devices", "--bogus"], capture_output=True,
                          text=True, env=cli_env)
    assert proc.returncode == 2 and "unrecognized arguments: --bogus" in proc.stderr
