#!/usr/bin/env python3
"""The prefill read of the RUN rows alone, against the causal read of every row, in one process (CPU).

One request's prompt of `--tokens` positions in a KV pool of shuffled slots; a random `--run` share of its rows
RUN (the rest Project-Only, reading nothing). Three reads, alternated round by round, each round's best of a few
calls, one torch thread:

  folded    `vskipper.mixed.attention.prefill_attention`: the RUN rows in blocks of positions, grouped-query
            heads folded into the query rows (what a routed layer runs on CPU)
  sdpa-gqa  the same blocks with SDPA's own grouped query (`enable_gqa`) over [1, heads, rows, head_dim]: the
            form before the fold
  causal    every row, SDPA's causal kernel with `enable_gqa`, as SGLang's torch-native backend calls it for a
            dense layer's prefill

Printed: each read's median ms, folded over causal beside the share of query-key pairs the RUN rows have (the
limit: a read whose cost per pair equals the causal kernel's costs that share), and folded over sdpa-gqa.

Run:  python benchmarks/prefill_read_bench.py [--tokens 1024] [--run 0.5] [--rounds 11]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vskipper.mixed.attention import PREFILL_READ_BLOCK, prefill_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 64  # bench-cpu's full size (GQA 16/4, heads of 64)


def sdpa_gqa_read(q, k, v, pos, scale, block=PREFILL_READ_BLOCK):
    """The blocked masked read of one request's RUN rows (q [n, heads, hd], sorted by position `pos`) with SDPA's
    own grouped query; k, v [1, kv_heads, length, hd]."""
    out = q.new_zeros(q.shape)
    qr = q.transpose(0, 1).unsqueeze(0)
    start = 0
    for m in torch.unique_consecutive(torch.div(pos, block, rounding_mode="floor"), return_counts=True)[1].tolist():
        p = pos[start:start + m]
        length = int(p[-1]) + 1
        mask = torch.arange(length)[None, :] <= p[:, None]
        o = F.scaled_dot_product_attention(qr[:, :, start:start + m], k[:, :, :length], v[:, :, :length],
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + m] = o[0].transpose(0, 1)
        start += m
    return out


def best_ms(fn, calls: int = 3) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--run", type=float, default=0.5, help="the share of rows that RUN")
    p.add_argument("--rounds", type=int, default=11)
    args = p.parse_args(argv)
    if args.tokens < 2 or not 0.0 < args.run <= 1.0 or args.rounds < 1:
        raise SystemExit("--tokens must be at least 2, --run in (0, 1], --rounds at least 1")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    n, dt, scale = args.tokens, torch.bfloat16, HEAD_DIM ** -0.5
    slots = 4 * n
    k_pool = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(dt)
    v_pool = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(dt)
    req_to_token = torch.zeros(1, n, dtype=torch.int64)
    req_to_token[0] = torch.randperm(slots - 1, generator=gen)[:n] + 1
    rows = (torch.rand(n, generator=gen) < args.run).nonzero().view(-1)
    if rows.numel() == 0:
        raise SystemExit("no row runs at this --run")
    q_all = torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(dt)
    q = q_all.index_select(0, rows)
    req = torch.zeros(rows.shape[0], dtype=torch.int64)
    k = k_pool[req_to_token[0]].transpose(0, 1).unsqueeze(0).contiguous()
    v = v_pool[req_to_token[0]].transpose(0, 1).unsqueeze(0).contiguous()
    q_causal = q_all.transpose(0, 1).unsqueeze(0).contiguous()

    reads = {
        "folded": lambda: prefill_attention(q, k_pool, v_pool, req_to_token, req, rows, scale),
        "sdpa-gqa": lambda: sdpa_gqa_read(q, k, v, rows, scale),
        "causal": lambda: F.scaled_dot_product_attention(q_causal, k, v, is_causal=True, scale=scale,
                                                         enable_gqa=True),
    }
    torch.testing.assert_close(reads["folded"](), reads["sdpa-gqa"](), rtol=0.02, atol=0.02)
    for fn in reads.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in reads}
    for _ in range(args.rounds):
        for name, fn in reads.items():
            times[name].append(best_ms(fn))
    med = {name: statistics.median(t) for name, t in times.items()}
    pairs = float((rows + 1).sum()) / (n * (n + 1) / 2)
    print(f"{n} tokens, {rows.shape[0]} RUN rows ({pairs:.3f} of the causal pairs); heads {HEADS}/{KV_HEADS} of "
          f"{HEAD_DIM}, bf16, one thread, medians of {args.rounds} rounds")
    for name, ms in med.items():
        print(f"  {name:9s} {ms:7.2f} ms")
    print(f"folded over causal {med['folded'] / med['causal']:.3f} (limit: the pairs' share {pairs:.3f}); "
          f"folded over sdpa-gqa {med['folded'] / med['sdpa-gqa']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
