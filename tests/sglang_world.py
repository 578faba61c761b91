"""Helpers for the SGLang server tests: `serve` and `launched` (vskipper.sglang.launch: `vskipper serve` in its
own session, wait for /health, always kill) with the test servers' common flags; `SharedServers`, the servers
several test modules share (tests/conftest.py starts each once per session); a greedy torch reference through
`vskipper.mixed` (the plain BenchStack forward, dense or routed)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from vskipper.sglang import launch
from vskipper.sglang.launch import Server, http, stop_all

__all__ = ["ROOT", "SHARED", "Server", "SharedServers", "greedy_reference", "http", "launched", "serve",
           "servable_tiny_model"]

ROOT = Path(__file__).resolve().parents[1]
# Every test server sleeps while idle: an idle SGLang scheduler otherwise polls its sockets in a busy loop, and
# on two cores a server waiting for the next test (or several started side by side) takes a core from the rest.
TEST_SERVER_FLAGS = ("--sleep-on-idle",)
# The servers test modules share, on the tiny FlexiDepth checkpoint, by name: `serve` keyword arguments.
SHARED = {
    "dense": dict(arm="dense", extra=("--enable-metrics",)),
    "always-route": dict(arm="always-route", extra=("--enable-metrics",)),
}


@contextmanager
def launched(model, workdir: Path, *, extra: Sequence[str] = (), **kwargs) -> Iterator[Server]:
    """`vskipper.sglang.launch.launched` with the test servers' flags: started, not yet ready. A test server is
    killed when its block ends, not drained (SGLang's graceful shutdown takes about 5 s per server, and what a
    test checks happened before)."""
    kwargs.setdefault("graceful", False)
    with launch.launched(model, workdir, extra=(*extra, *TEST_SERVER_FLAGS), **kwargs) as server:
        yield server


@contextmanager
def serve(model, workdir: Path, **kwargs) -> Iterator[Server]:
    """`launched`, then wait for `/health`: yields a serving Server; stops it after."""
    with launched(model, workdir, **kwargs) as server:
        yield server.wait_ready()


class SharedServers:
    """The `SHARED` servers, each started on first use and kept until the session ends. `get` starts the named
    servers that are not running side by side, then waits for each."""

    def __init__(self, model: Path, workdir: Path, stack: ExitStack) -> None:
        self.model, self.workdir, self.stack = model, workdir, stack
        self.servers: dict[str, Server] = {}
        stack.callback(lambda: stop_all(list(self.servers.values())))

    def get(self, *names: str) -> dict[str, Server]:
        for name in names:
            if name not in self.servers:
                self.servers[name] = self.stack.enter_context(
                    launched(self.model, self.workdir / name, **SHARED[name]))
        return {name: self.servers[name].wait_ready() for name in names}


def servable_tiny_model(directory: Path, arch: str = "flexidepth-llama") -> Path:
    """A tiny random checkpoint with its tiny tokenizer in `directory`: what `vskipper serve` can load."""
    from vskipper.checkpoint import make_tiny_model, write_tiny_tokenizer

    path = make_tiny_model(arch, directory)
    write_tiny_tokenizer(path)
    return path


@torch.no_grad()
def greedy_reference(model_dir: Path, prompt: list[int], n: int, skipper=None, decode_skipper="same") -> list[int]:
    """Greedy tokens from the plain torch BenchStack, one request: prefill routed by `skipper` (dense when
    None), decode by `decode_skipper` (the same skipper unless given; None decodes dense)."""
    from vskipper.mixed.bench_stack import BenchStack, ForwardBatch

    model = BenchStack.from_pretrained(model_dir, backend="torch")
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
