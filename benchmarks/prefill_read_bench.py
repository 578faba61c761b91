#!/usr/bin/env python3
"""The prefill read of the RUN rows alone, against the causal read of every row, in one process (CPU).

`--requests` prompts of `--tokens` positions each in a KV pool of shuffled slots; a random `--run` share of their
rows RUN (the rest Project-Only, reading nothing). The reads, alternated round by round, each round's best of a few
calls, one torch thread:

  folded    `vskipper.mixed.attention.prefill_attention` as a routed layer runs it on CPU: the RUN rows of several
            short prompts in one SDPA call (each padded to the most reading rows), else per request in blocks of
            positions, grouped-query heads folded into the query rows
  loop      (several requests) the same read held to its per-request blocks
  one-call  (several requests) the same read held to its one padded call, whatever the spans
  sdpa-gqa  the per-request blocks with SDPA's own grouped query (`enable_gqa`) over [1, heads, rows, head_dim]:
            the form before the fold
  causal    every row, SDPA's causal kernel with `enable_gqa` per request, as SGLang's torch-native backend calls
            it for a dense layer's prefill
  backend   the torch execution's read through SGLang's torch-native backend (`PREFILL_READS['backend']`): the RUN
            rows' queries in their batch rows (zeros elsewhere) as `q_kv` rotates them there, the backend's own
            extend loop over every row, the RUN rows' outputs taken back; `causal` with the backend's and the
            routed layer's own costs
  gather    what the layer's read of the RUN rows pays before `folded` and the backend's read does not: its
            queries gathered out of those batch rows (one `index_select`)

Printed: each read's median ms, folded over causal and over backend (folded with its gather, as a routed layer
reads either way) beside the share of query-key pairs the RUN rows have (the limit: a read whose cost per pair
equals the causal kernel's costs that share), folded over sdpa-gqa, and with several requests one-call over loop;
last, which read the torch execution's sized read (`PREFILL_READS['sized']`) takes at this pass.

Run:  python benchmarks/prefill_read_bench.py [--tokens 1024] [--requests 1] [--run 0.5] [--rounds 11]
      python benchmarks/prefill_read_bench.py --requests 8 --tokens 128 --heads 4,2,16 --dtype float32
      (the host benchmark's tiny model)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vskipper.mixed import attention  # noqa: E402
from vskipper.mixed.attention import PREFILL_READ_BLOCK, prefill_attention  # noqa: E402
from vskipper.sglang.standalone import init_sglang  # noqa: E402

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


def torch_native_read(q, shape, running, k_pool, v_pool, req_to_token, scale):
    """(the read, the gather) of the RUN rows q (request by request, `running` their positions) of `shape` =
    (requests, tokens) fresh prompts. The read: through SGLang's torch-native backend's extend loop over every row,
    as the torch execution's 'backend' read calls it (the queries in their batch rows, where `q_kv` rotated them;
    the loop; the RUN rows' outputs taken back). The gather: the RUN rows' queries out of those batch rows, which
    the execution's read of the RUN rows alone pays before it reads."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from vskipper.sglang.models.routed import in_batch_slots

    reqs, n = shape
    heads, head_dim = q.shape[1:]
    backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=None))
    rows = torch.cat([r * n + running[r] for r in range(reqs)])
    lens = torch.full((reqs,), n)
    slots, prefix = torch.arange(reqs), torch.zeros(reqs, dtype=torch.int64)
    gqa = heads != k_pool.shape[1]
    q_slots = in_batch_slots(q.view(q.shape[0], -1), rows, reqs * n)

    def call():
        q_rows = q_slots.view(reqs * n, heads, head_dim)
        out = torch.empty_like(q_rows)
        backend._run_sdpa_forward_extend(q_rows, out, k_pool, v_pool, req_to_token, slots, lens, prefix, lens,
                                         scaling=scale, enable_gqa=gqa, causal=True)
        return out.index_select(0, rows)

    return call, lambda: q_slots.index_select(0, rows)


def best_ms(fn, calls: int = 3) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="positions of each prompt")
    p.add_argument("--requests", type=int, default=1, help="prompts in the pass")
    p.add_argument("--run", type=float, default=0.5, help="the share of rows that RUN")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--heads", default=f"{HEADS},{KV_HEADS},{HEAD_DIM}", help="heads,kv_heads,head_dim")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = p.parse_args(argv)
    if args.tokens < 2 or args.requests < 1 or not 0.0 < args.run <= 1.0 or args.rounds < 1:
        raise SystemExit("--tokens must be at least 2, --requests at least 1, --run in (0, 1], --rounds at least 1")
    try:
        heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    except ValueError:
        raise SystemExit(f"--heads takes heads,kv_heads,head_dim, got {args.heads!r}") from None
    if min(heads, kv_heads, head_dim) < 1 or heads % kv_heads:
        raise SystemExit(f"--heads {args.heads}: each at least 1, and heads a multiple of kv_heads")
    torch.set_num_threads(1)
    init_sglang("cpu")  # SGLang's modules (its torch-native backend) import after its CPU context is published
    gen = torch.Generator().manual_seed(0)
    n, reqs, dt, scale = args.tokens, args.requests, getattr(torch, args.dtype), head_dim ** -0.5
    slots = 4 * n * reqs
    k_pool = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dt)
    v_pool = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dt)
    req_to_token = (torch.randperm(slots - 1, generator=gen)[:n * reqs] + 1).view(reqs, n)
    running = [(torch.rand(n, generator=gen) < args.run).nonzero().view(-1) for _ in range(reqs)]
    if any(r.numel() == 0 for r in running):
        raise SystemExit("a prompt has no row that runs at this --run")
    q_all = torch.randn(reqs, n, heads, head_dim, generator=gen).to(dt)
    # the RUN rows of every request in batch order (request by request, in position order, as a prefill pass holds
    # them), their request slots and positions
    q = torch.cat([q_all[r].index_select(0, rows) for r, rows in enumerate(running)])
    req = torch.cat([torch.full((rows.shape[0],), r) for r, rows in enumerate(running)])
    pos = torch.cat(running)
    kv = [(k_pool[req_to_token[r]].transpose(0, 1).unsqueeze(0).contiguous(),
           v_pool[req_to_token[r]].transpose(0, 1).unsqueeze(0).contiguous()) for r in range(reqs)]
    q_causal = [q_all[r].transpose(0, 1).unsqueeze(0).contiguous() for r in range(reqs)]

    def folded():
        return prefill_attention(q, k_pool, v_pool, req_to_token, req, pos, scale)

    def held(**bounds):  # the read under other bounds of its one call (`attention.BATCHED_READ_*`)
        with patch.multiple(attention, **bounds):
            return folded()

    def sdpa_gqa():
        return torch.cat([sdpa_gqa_read(q[req == r], *kv[r], running[r], scale) for r in range(reqs)])

    def causal():
        return [F.scaled_dot_product_attention(q_causal[r], *kv[r], is_causal=True, scale=scale, enable_gqa=True)
                for r in range(reqs)]

    backend_read, gather = torch_native_read(q, q_all.shape[:2], running, k_pool, v_pool, req_to_token, scale)
    reads = {"folded": folded}
    if reqs > 1:
        reads["loop"] = lambda: held(BATCHED_READ_MACS=0)
        reads["one-call"] = lambda: held(BATCHED_READ_MACS=1 << 62, BATCHED_READ_MAX_SPAN=1 << 62)
    reads.update({"sdpa-gqa": sdpa_gqa, "causal": causal, "backend": backend_read, "gather": gather})
    tol = 0.02 if dt == torch.bfloat16 else 1e-4
    for name in reads.keys() - {"folded", "causal", "gather"}:
        torch.testing.assert_close(reads[name](), reads["folded"](), rtol=tol, atol=tol)
    assert torch.equal(gather().view(q.shape), q)
    for fn in reads.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in reads}
    for _ in range(args.rounds):
        for name, fn in reads.items():
            times[name].append(best_ms(fn))
    med = {name: statistics.median(t) for name, t in times.items()}
    pairs = float(sum((rows + 1).sum() for rows in running)) / (reqs * n * (n + 1) / 2)
    print(f"{reqs} x {n} tokens, {q.shape[0]} RUN rows ({pairs:.3f} of the causal pairs); heads {heads}/{kv_heads} "
          f"of {head_dim}, {args.dtype}, one thread, medians of {args.rounds} rounds")
    for name, ms in med.items():
        print(f"  {name:9s} {ms:7.2f} ms")
    print(f"folded over causal {med['folded'] / med['causal']:.3f} (limit: the pairs' share {pairs:.3f}); "
          f"folded with its gather over backend {(med['folded'] + med['gather']) / med['backend']:.3f}; "
          f"folded over sdpa-gqa {med['folded'] / med['sdpa-gqa']:.3f}"
          + (f"; one-call over loop {med['one-call'] / med['loop']:.3f}" if reqs > 1 else ""))
    from vskipper.sglang.models.routed import SIZED_READ_MACS, sized_read_takes_backend

    pairs = n * (n + 1) // 2 if reqs == 1 else 0  # `PassPlan.read_pairs`: one request's, none for several
    macs = pairs * heads * head_dim
    taken = "backend" if sized_read_takes_backend(pairs, heads, head_dim) else "folded"
    print(f"the sized read (a CPU server's) takes {taken} here: "
          + (f"{macs / 1e6:.2f} M query-key products against its {SIZED_READ_MACS / 1e6:.2f} M" if reqs == 1
             else "several requests"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
