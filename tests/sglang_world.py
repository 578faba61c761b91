"""Helpers for the SGLang server tests: start `vskipper serve` in its own session, wait, always kill; a greedy
torch reference through `vskipper.mixed` (the plain MixedDepthModel forward, dense or routed)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def get_json(self, path: str) -> dict:
        status, text = http(self.url + path)
        assert status == 200, f"GET {path}: {status} {text[:300]}"
        return json.loads(text)

    def post_json(self, path: str, body: dict) -> dict:
        status, text = http(self.url + path, body)
        assert status == 200, f"POST {path}: {status} {text[:300]}"
        return json.loads(text)

    def generate_ids(self, input_ids: list[int], n: int) -> list[int]:
        out = self.post_json("/generate", {"input_ids": input_ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": n, "ignore_eos": True}})
        return out["output_ids"]

    def metrics(self) -> str:
        status, text = http(self.url + "/metrics")
        assert status == 200, text[:300]
        return text


@contextmanager
def serve(model: Path, tmp: Path, arm: str | None = None, arm_file: Path | None = None,
          extra: tuple[str, ...] = (), enter_tokens: int | None = None, exit_tokens: int | None = None,
          env: dict[str, str] | None = None):
    """`vskipper serve` on a free port; yields a Server once /health answers; kills the session after."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    cmd = [sys.executable, "-m", "vskipper.cli", "serve", "--model", str(model), "--port", str(port),
           "--state-file", str(tmp / f"state-{port}.json")]
    cmd += ["--arm", arm] if arm else ["--arm-file", str(arm_file)]
    if enter_tokens is not None:
        cmd += ["--enter-tokens", str(enter_tokens), "--exit-tokens", str(exit_tokens)]
    cmd += ["--", "--dtype", "float32", *extra]
    env = dict(os.environ, **(env or {}), PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(proc, port, log)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if http(server.url + "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not up in {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)


@torch.no_grad()
def greedy_reference(model_dir: Path, prompt: list[int], n: int, skipper=None, decode_skipper="same") -> list[int]:
    """Greedy tokens from the plain torch MixedDepthModel, one request: prefill routed by `skipper` (dense when
    None), decode by `decode_skipper` (the same skipper unless given; None decodes dense)."""
    from vskipper.mixed.layers import ForwardBatch, MixedDepthModel

    model = MixedDepthModel.from_pretrained(model_dir, backend="torch")
    page = 16
    ctx = len(prompt) + n + page
    kv = model.new_kv_cache(num_pages=ctx // page + 2, page_size=page, max_requests=1, max_context=ctx)
    kv.assign_pages(0, range(1, ctx // page + 2))
    ids = torch.tensor(prompt)
    batch = ForwardBatch(torch.arange(len(prompt)), torch.zeros(len(prompt), dtype=torch.int64),
                         torch.ones(len(prompt), dtype=torch.bool), "prefill",
                         request_keys=torch.zeros(len(prompt), dtype=torch.int64))
    hidden = model(ids, batch, kv, skipper)
    out = [int(model.logits(hidden[-1:]).argmax(-1))]
    if decode_skipper == "same":
        decode_skipper = skipper
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        batch = ForwardBatch(torch.tensor([pos]), torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.bool),
                             "decode", request_keys=torch.zeros(1, dtype=torch.int64))
        hidden = model(torch.tensor([out[-1]]), batch, kv, decode_skipper)
        out.append(int(model.logits(hidden).argmax(-1)))
    return out
