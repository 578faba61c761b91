"""Helpers for the SGLang server tests: `serve` (vskipper.sglang.launch: `vskipper serve` in its own session,
wait for /health, always kill); a greedy torch reference through `vskipper.mixed` (the plain BenchStack
forward, dense or routed)."""

from __future__ import annotations

from pathlib import Path

import torch

from vskipper.sglang.launch import Server, http, serve

__all__ = ["ROOT", "Server", "greedy_reference", "http", "serve", "servable_tiny_model"]

ROOT = Path(__file__).resolve().parents[1]


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
