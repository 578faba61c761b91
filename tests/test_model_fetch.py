"""An hf:// model, downloaded for real before the server starts: `python -m vskipper.fetch` against a stand-in for
the Hugging Face Hub on loopback (tests/hub_standin.py, the hub's URL layout; no internet here), through
huggingface_hub's client and the plain-HTTP one; then the planned pod's two containers run as Kubernetes would
run them: the init container's command fills a folder standing in for the cache volume, and the server container's
args (through the runtime image's entrypoint) make `vskipper serve` accept that folder (`--dry-run`), and a real
`vskipper serve` on CPU serves the downloaded checkpoint behind the API key the pod would take from its Secret.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from hub_standin import Hub
from operator_fixtures import A100, node, resource
from test_serve_contract import RUNTIME_DOCKERFILE, container_argv, image_launch

from vskipper.fetch import MARKER, FetchError, check_checkpoint, parse_uri
from vskipper_operator.plan import ARM_FILE, MODEL_CACHE, plan

REPO = "vskipper/tiny-flexidepth"
TOKEN = "hf_standin_token"


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory):
    from vskipper.checkpoint import make_tiny_model, write_tiny_tokenizer

    path = make_tiny_model("flexidepth-llama", tmp_path_factory.mktemp("hub") / "tiny")
    write_tiny_tokenizer(path)
    (path / "original").mkdir()
    (path / "original" / "consolidated.pth").write_bytes(b"not downloaded by default")
    return path


@pytest.fixture
def hub(repo_dir):
    with Hub({REPO: repo_dir}, token=TOKEN) as hub:
        yield hub


def fetch(hub, out, *extra, token=TOKEN, client="auto", env=None):
    env = {**os.environ, **(env or {}), "HF_ENDPOINT": hub.url, "PYTHONPATH": str(Path(__file__).parents[1])}
    env.pop("HF_TOKEN", None)
    if token:
        env["HF_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "vskipper.fetch", f"hf://{REPO}", "--out", str(out),
                           "--client", client, *extra], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("client", ["hub", "http"])
def test_download_through_each_client_fetches_the_checkpoint_with_the_token(hub, repo_dir, tmp_path, client):
    proc = fetch(hub, tmp_path / "out", client=client)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).read_bytes() == (repo_dir / name).read_bytes(), name
    assert not (out / "original").exists()  # *.pth is not in the default patterns
    assert json.loads((out / MARKER).read_text())["repo"] == REPO
    assert check_checkpoint(out)["model_type"]
    repo_requests = [(m, path, auth) for m, path, auth in hub.requests if REPO in path]
    assert repo_requests and all(auth == f"Bearer {TOKEN}" for _, _, auth in repo_requests)
    resolved = {path for method, path, _ in hub.requests if method == "GET" and "/resolve/" in path}
    assert f"/{REPO}/resolve/{'main' if client == 'http' else hub.commit(REPO)}/config.json" in resolved


def test_the_plain_http_client_follows_the_hubs_url_layout(hub, tmp_path):
    assert fetch(hub, tmp_path / "out", client="http").returncode == 0
    paths = [path for _, path, _ in hub.requests if REPO in path]
    assert paths[0] == f"/api/models/{REPO}/revision/main"
    assert set(paths[1:]) >= {f"/{REPO}/resolve/main/config.json", f"/{REPO}/resolve/main/model.safetensors"}


@pytest.mark.parametrize("client", ["hub", "http"])
def test_a_missing_token_fails_naming_the_secret_in_the_termination_message(hub, tmp_path, client):
    log = tmp_path / "termination-log"
    proc = fetch(hub, tmp_path / "out", "--termination-log", str(log), token=None, client=client)
    assert proc.returncode == 1
    message = log.read_text()
    assert f"hf://{REPO}: access denied (HTTP 401)" in message and "spec.model.download.tokenSecret" in message
    assert message in proc.stderr
    assert not (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("client", ["hub", "http"])
def test_an_unknown_revision_is_reported_as_such(hub, tmp_path, client):
    proc = fetch(hub, tmp_path / "out", "--revision", "v9", client=client)
    assert proc.returncode == 1
    assert "v9" in proc.stderr and "revision" in proc.stderr


def test_a_repository_that_is_not_a_checkpoint_is_refused_after_the_download(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "README.txt").write_text("no model here")
    with Hub({REPO: docs}) as hub:
        proc = fetch(hub, tmp_path / "out", token=None, client="http")
    assert proc.returncode == 1 and "no config.json after the download" in proc.stderr
    assert not (tmp_path / "out" / MARKER).exists()


def test_a_checked_download_is_not_fetched_again(hub, tmp_path):
    assert fetch(hub, tmp_path / "out", client="http").returncode == 0
    before = len(hub.requests)
    proc = fetch(hub, tmp_path / "out")
    assert proc.returncode == 0 and len(hub.requests) == before  # a restarted pod on a persistent cache


def test_only_hf_uris_are_fetched_as_the_crd_admits_them():
    from vskipper.fetch import _REPO
    from vskipper_operator.crd import HF_REPO_RE

    assert _REPO.pattern == HF_REPO_RE
    assert parse_uri("hf://Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    for uri in ("s3://bucket/llama", "hf://Qwen", "https://huggingface.co/Qwen/Qwen3-8B", "hf://a/b/c"):
        with pytest.raises(FetchError, match="expected hf://ORG/NAME"):
            parse_uri(uri)


def _kubelet_env(container: dict, secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[(ref["name"], ref["key"])]
    return env


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's `$(VAR)` expansion of a container's args from its environment."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), a) for a in args]


@pytest.mark.server  # real SGLang servers
def test_the_planned_pod_downloads_what_its_server_then_serves(hub, tmp_path, cli_env):
    """The init container and the server container of a planned hf:// Deployment, run as the kubelet runs them
    (the cache volume is a folder here, Secrets are resolved, `$(VAR)` expanded): the download lands where the
    server reads, `vskipper serve --dry-run` accepts it through the image's entrypoint, and a real server on CPU
    answers a completion with the API key and refuses one without. The key travels in the environment alone: no
    command line holds it, the dry run prints it masked, and the server's log never shows it."""
    from vskipper.sglang.launch import http, serve

    spec = resource(model={"path": f"hf://{REPO}", "preset": "llama-3-8b",
                           "download": {"tokenSecret": {"name": "hf-token"}, "endpoint": hub.url}},
                    serving={"image": "vskipper:test", "apiKeySecret": {"name": "llama-api"}},
                    skipper={"name": "flexidepth", "params": {"skip_ratio": 0.5}})
    result = plan(spec, [node("a100-0", A100)])
    pod = next(o for o in result.objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    (init,), (server,) = pod["initContainers"], pod["containers"]
    secrets = {("hf-token", "token"): TOKEN, ("llama-api", "api-key"): "sk-standin"}
    cache = tmp_path / "cache"

    def local(a: str) -> str:
        return a.replace(MODEL_CACHE, str(cache), 1) if a.startswith(MODEL_CACHE) else a

    init_env = {k: local(v) for k, v in _kubelet_env(init, secrets).items()}
    proc = subprocess.run([sys.executable if a == "python" else a for a in init["command"]]
                          + [local(a) for a in init["args"]],
                          capture_output=True, text=True, timeout=120,
                          env={**cli_env, **init_env})
    assert proc.returncode == 0, proc.stderr
    assert any(auth == f"Bearer {TOKEN}" for _, _, auth in hub.requests)

    arm_file = tmp_path / "arm.json"
    arm_file.write_text(next(o for o in result.objects if o["kind"] == "ConfigMap")["data"]["arm.json"])
    server_env = _kubelet_env(server, secrets)
    launch = image_launch(RUNTIME_DOCKERFILE)
    argv = _expand(container_argv(server, launch), server_env)
    args = [str(arm_file) if a == ARM_FILE else local(a) for a in argv[len(launch.entrypoint):]]
    model = Path(args[args.index("--model") + 1])
    assert model.parent.parent.parent.parent == cache and (model / "config.json").is_file()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vskipper").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m vskipper.cli "$@"\n')
    (bin_dir / "vskipper").chmod(0o755)
    dry = subprocess.run([sys.executable, str(launch.source_of(launch.entrypoint[0])), *args, "--platform", "cpu",
                          "--dry-run"], capture_output=True, text=True, timeout=120,
                         env={**cli_env, **server_env, "PATH": f"{bin_dir}:{cli_env['PATH']}"})
    assert dry.returncode == 0, dry.stderr
    command = json.loads(dry.stdout)["command"]
    assert command[command.index("--model-path") + 1] == str(model)
    assert "sk-standin" not in dry.stdout + dry.stderr and "--api-key" not in command
    assert json.loads(dry.stdout)["environment"]["VSKIPPER_API_KEY"] == "***"

    # A real server on the downloaded checkpoint, with the API key the Secret gave the pod's environment.
    with serve(model, tmp_path / "serve", arm=args[args.index("--arm") + 1],
               enter_tokens=int(args[args.index("--enter-tokens") + 1]),
               exit_tokens=int(args[args.index("--exit-tokens") + 1]),
               env={"VSKIPPER_API_KEY": server_env["VSKIPPER_API_KEY"]}) as running:
        body = {"model": "default", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        assert http(running.url + "/v1/completions", body)[0] == 401
        req = urllib.request.Request(
            running.url + "/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Bearer sk-standin"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
        assert answer["choices"][0]["text"] is not None and answer["usage"]["completion_tokens"] >= 1
        assert http(running.url + "/ready")[0] == 200  # the readiness probe's endpoint, without the key
        log = running.log.read_text()
        assert "server_args=" in log and "sk-standin" not in log, log[-2000:]  # SGLang logs its arguments
