"""The slow, obviously-correct mixed-depth forward: one row at a time, explicit loops, no cohorts.

It takes the routes as given (per routed layer: run bool [rows], weights [rows]) and applies, row by row, the
semantics spelled out in `vskipper.mixed.bench_stack`. The fast paths are checked against it; nothing serves with it.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from vskipper.mixed.attention import PagedKVCache
from vskipper.mixed.bench_stack import BenchStack, ForwardBatch


def _attend_one(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """q [heads, hd]; keys/values: one [kv_heads, hd] tensor per visible position."""
    heads, hd = q.shape
    k = torch.stack(keys).float()  # [t, kv_heads, hd]
    v = torch.stack(values).float()
    group = heads // k.shape[1]
    out = torch.empty(heads, hd)
    for head in range(heads):
        kh = head // group
        scores = (k[:, kh, :] @ q[head].float()) / math.sqrt(hd)
        out[head] = torch.softmax(scores, dim=0) @ v[:, kh, :]
    return out.to(q.dtype)


@torch.no_grad()
def reference_forward(model: BenchStack, input_ids: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache,
                      routes: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """Final-normed hidden states of every row; `routes` None means dense. Writes K/V into `kv`."""
    rows = batch.rows
    x = model.embed(input_ids)
    req, pos, valid = batch.req_indices.tolist(), batch.positions.tolist(), batch.valid.tolist()
    for layer in model.model.layers:
        lid = layer.layer_id
        attn = layer.self_attn
        run, weights = (routes[lid] if routes is not None and lid in routes
                        else (torch.ones(rows, dtype=torch.bool), None))
        # 1. every row writes its own K/V at this layer, whatever its route (Invariant 1)
        u = [layer.input_layernorm(x[i : i + 1]) for i in range(rows)]
        for i in range(rows):
            k, v = attn.project_kv(u[i], batch.positions[i : i + 1])
            slot = int(kv.req_to_token[req[i], pos[i]]) if valid[i] else 0
            kv.k[lid, slot] = k[0]
            kv.v[lid, slot] = v[0]
        # 2. each row's update
        y = torch.empty_like(x)
        for i in range(rows):
            xi = x[i : i + 1]
            w = 1.0 if weights is None else weights[i].to(x.dtype)
            if bool(run[i]):
                if valid[i]:
                    q = attn.project_q(u[i], batch.positions[i : i + 1])[0]
                    slots = [int(kv.req_to_token[req[i], t]) for t in range(pos[i] + 1)]
                    a = _attend_one(q, [kv.k[lid, s] for s in slots], [kv.v[lid, s] for s in slots])
                else:
                    a = torch.zeros(attn.heads, attn.head_dim, dtype=x.dtype)
                h = xi + attn.o_proj(a.reshape(1, -1))
                n = layer.post_attention_layernorm(h)
                mlp = layer.mlp
                y[i] = (h + w * mlp.down_proj(F.silu(mlp.gate_proj(n)) * mlp.up_proj(n)))[0]
            else:
                n = layer.post_attention_layernorm(xi)
                p = layer.router_proj
                y[i] = (xi + w * p.up_proj(F.silu(p.gate_proj(n)) * p.down_proj(n)))[0]
        x = y
    return model.model.norm(x)
