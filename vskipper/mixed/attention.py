"""Paged KV cache and the reference attention that reads it (runs anywhere torch runs, CPU included).

Layout (the same as SGLang's token-to-KV pool): per layer a K pool and a V pool of shape
[num_slots, kv_heads, head_dim]; slot 0 is reserved and never owned by a request (padding rows write there,
masked reads point there). A request's tokens live in pages of `page_size` slots; `req_to_token[r, p]` is the
slot of position p of the request held in request slot r.

`paged_attention` is causal over a request's own positions: a row (request r, position p) reads exactly the
slots req_to_token[r, 0..p]. Every other index it forms is slot 0, and whatever it gathers there is replaced by
zeros with a select before use, so the content of any slot it does not own never reaches an output, whatever
that content is (NaN included).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

NULL_SLOT = 0
PREFILL_READ_BLOCK = 128  # positions per block of a request's reading rows (`prefill_attention`)
# `prefill_attention` reads several requests in one SDPA call, each request an entry of the call's batch with its
# reading rows padded to the most any request has (`_batched_read`), where no request's keys span more than one
# block of positions (BATCHED_READ_MAX_SPAN: the per-request read would take each request in one block too, so the
# one call computes what it computes, plus the padding) and the call's query-key products (requests x padded rows x
# span x heads x head_dim) stay within BATCHED_READ_MACS (its mask's and scores' memory); else request by request in
# causal blocks. The one call spares about two dozen small ops a request; over longer spans it computes every key
# for every row where the blocks skip those above the diagonal, which costs more than the ops it spares
# (`benchmarks/prefill_read_bench.py --requests`).
BATCHED_READ_MAX_SPAN = PREFILL_READ_BLOCK
BATCHED_READ_MACS = 1 << 27


class PagedKVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 max_requests: int, max_context: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        if num_pages < 2:
            raise ValueError("num_pages must be at least 2 (page 0 is reserved)")
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.max_context = max_context
        shape = (num_layers, self.num_slots, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.req_to_token = torch.zeros(max_requests, max_context, dtype=torch.int64, device=device)

    def assign_pages(self, request: int, pages: Sequence[int]) -> None:
        """Give request slot `request` the pages `pages` (in position order). Page 0 is reserved."""
        pages = list(pages)
        if any(p <= 0 or p * self.page_size >= self.num_slots for p in pages):
            raise ValueError(f"pages must be in 1..{self.num_slots // self.page_size - 1}, got {pages}")
        positions = torch.arange(min(len(pages) * self.page_size, self.max_context))
        page_ids = torch.tensor(pages, dtype=torch.int64)[positions // self.page_size]
        self.req_to_token[request].zero_()
        self.req_to_token[request, : len(positions)] = (page_ids * self.page_size
                                                         + positions % self.page_size).to(self.req_to_token.device)

    def write_slots(self, req_indices: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Each row's own slot; padding rows get the reserved slot."""
        slots = self.req_to_token[req_indices, positions]
        return torch.where(valid, slots, torch.zeros_like(slots))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
                                / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Llama/Qwen layout) on x [rows, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, req_to_token: torch.Tensor,
                    req_indices: torch.Tensor, positions: torch.Tensor, scale: float,
                    reads: torch.Tensor | None = None, length: int | None = None) -> torch.Tensor:
    """Causal attention of q [rows, heads, head_dim] over each row's own request pages; [rows, heads, head_dim].

    k_pool / v_pool: [num_slots, kv_heads, head_dim] (one layer). Grouped-query: heads // kv_heads query heads
    share a KV head. The context is bounded by `length` (at least the largest position + 1, planned on the host),
    else by the largest position among the rows (a host read). `reads` (bool [rows]) masks whole rows: a row outside it reads no
    slot at all and its output is zero (selected, since its softmax is 0/0).
    """
    rows, heads, head_dim = q.shape
    if rows == 0:
        return q.new_zeros(q.shape)
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    if length is None:
        length = int(positions.max()) + 1
    j = torch.arange(length, device=q.device)
    own = j[None, :] <= positions[:, None]  # [rows, length]
    if reads is not None:
        own = own & reads.view(-1, 1)
    slots = torch.where(own, req_to_token[req_indices][:, :length], torch.zeros((), dtype=torch.int64,
                                                                              device=q.device))
    keep = own[:, :, None, None]
    k = torch.where(keep, k_pool[slots], torch.zeros((), dtype=k_pool.dtype, device=q.device)).float()
    v = torch.where(keep, v_pool[slots], torch.zeros((), dtype=v_pool.dtype, device=q.device)).float()
    qf = q.float().view(rows, kv_heads, group, head_dim)
    scores = torch.einsum("rkgd,rtkd->rkgt", qf, k) * scale
    scores = torch.where(own[:, None, None, :], scores, torch.full((), float("-inf"), device=q.device))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("rkgt,rtkd->rkgd", probs, v)
    if reads is not None:
        out = torch.where(reads.view(-1, 1, 1, 1), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.reshape(rows, heads, head_dim).to(q.dtype)


def _batched_read(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, req_to_token: torch.Tensor,
                  req: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor | None:
    """The reading rows q [n, heads, head_dim] (their requests `req` and positions `pos`, in batch order) of
    several requests in one SDPA call, or None where that call would cost more than the per-request read
    (`BATCHED_READ_MAX_SPAN`, `BATCHED_READ_MACS`).

    Each run of consecutive rows of one request (a prefill batch holds a request's rows together: one run a
    request) is one entry of the call's batch: its rows padded to the longest run's, over its request's slots
    req_to_token[r, 0..span), each row masked to its own positions up to its own. Keys past a run's largest
    position gather its request's first slot and padding rows read that slot alone: no slot a request does not own
    is read, and padding rows' outputs are dropped."""
    n, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    requests, which, counts = torch.unique_consecutive(req, return_inverse=True, return_counts=True)
    runs = requests.shape[0]
    if runs < 2:
        return None
    lengths = counts.new_zeros(runs).scatter_reduce(0, which, (pos + 1).to(counts.dtype), "amax", include_self=False)
    span, width = torch.stack([lengths.max(), counts.max()]).tolist()
    if span > BATCHED_READ_MAX_SPAN or runs * width * span * heads * head_dim > BATCHED_READ_MACS:
        return None
    j = torch.arange(span, device=q.device)
    slots = req_to_token.index_select(0, requests)[:, :span]
    slots = torch.where(j[None, :] < lengths[:, None], slots, slots[:, :1]).reshape(-1)  # [runs * span]
    k = k_pool.index_select(0, slots).to(q.dtype).view(runs, span, kv_heads, head_dim).transpose(1, 2)
    v = v_pool.index_select(0, slots).to(q.dtype).view(runs, span, kv_heads, head_dim).transpose(1, 2)
    # row i's place among the runs' padded rows: its run's first place plus its rank within the run
    first = torch.cumsum(counts, 0) - counts
    place = which * width + torch.arange(n, device=q.device) - first.index_select(0, which)
    padded = q.new_zeros(runs * width, heads, head_dim).index_copy_(0, place, q)
    padded_pos = pos.new_zeros(runs * width).index_copy_(0, place, pos)  # padding rows: position 0
    mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(j[None, :] > padded_pos[:, None],
                                                                         float("-inf"))
    # grouped-query heads folded into the query rows, as the per-request read folds them
    mask = mask.view(runs, width, 1, span).expand(runs, width, group, span).reshape(runs, 1, width * group, span)
    qf = padded.view(runs, width, kv_heads, group, head_dim).transpose(1, 2).reshape(runs, kv_heads, width * group,
                                                                                     head_dim)
    o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)  # [runs, kv_heads, width * group, hd]
    o = o.view(runs, kv_heads, width, group, head_dim).transpose(1, 2).reshape(runs * width, heads, head_dim)
    return o.index_select(0, place)


def _own_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's K and V at `slots`, as SDPA takes them: [1, kv_heads, len(slots), head_dim], contiguous."""
    return (k_pool.index_select(0, slots).to(dtype).transpose(0, 1).contiguous().unsqueeze(0),
            v_pool.index_select(0, slots).to(dtype).transpose(0, 1).contiguous().unsqueeze(0))


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, req_to_token: torch.Tensor,
                      req_indices: torch.Tensor, positions: torch.Tensor, scale: float,
                      reads: torch.Tensor | None = None, block: int = PREFILL_READ_BLOCK) -> torch.Tensor:
    """The same causal attention as `paged_attention`, per request with torch's fused SDPA (prefill only).

    Rows are grouped by request on the host (prefill runs outside graph capture); each request's own slots
    req_to_token[r, 0..max position] are gathered once, so memory grows with rows x context per request, not
    with the square of the batch. Only slots the request owns are read; rows outside `reads` read nothing and
    get zeros. Several requests of short spans are read in one masked call instead (`_batched_read`).

    A request's reading rows are read in blocks of `block` positions, each over the keys up to its last row's
    position only: a causal SDPA skips the key blocks above the diagonal, an SDPA with an explicit mask computes
    them all, so one call over every key would cost a subset of rows about what a causal read of all rows costs.

    Grouped-query heads are folded into the query rows: the query heads that share a KV head are rows of that
    head's one query matrix, (row, head in group) in order, each with its row's mask. Every SDPA call then
    multiplies each KV block once for the whole group, with a taller query block. (Left to SDPA's own grouped
    query, the CPU kernel's read of a subset of rows took about 13% longer at 1k tokens; an unfolded layout
    without a batch dimension falls back to the unfused math kernel, about 4x slower.)
    """
    rows, heads, head_dim = q.shape
    out = q.new_zeros(q.shape)
    if rows == 0:
        return out
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    live = torch.ones_like(req_indices, dtype=torch.bool) if reads is None else reads
    sel = live.nonzero().view(-1)
    if sel.numel() == 0:
        return out
    req, pos = req_indices.index_select(0, sel), positions.index_select(0, sel)
    o = _batched_read(q.index_select(0, sel), k_pool, v_pool, req_to_token, req, pos, scale)
    if o is not None:
        return out.index_copy_(0, sel, o)
    for r in torch.unique(req).tolist():
        sel = ((req_indices == r) & live).nonzero().view(-1)
        pos, order = positions.index_select(0, sel).sort()
        sel = sel.index_select(0, order)
        n = sel.shape[0]
        k, v = _own_kv(k_pool, v_pool, req_to_token[r, : int(pos[-1]) + 1], q.dtype)
        # [1, kv_heads, n * group, head_dim]: query row i's heads of KV head h are rows i * group .. of head h
        qf = q.index_select(0, sel).view(n, kv_heads, group, head_dim).transpose(0, 1).reshape(
            1, kv_heads, n * group, head_dim)
        outs, start = [], 0
        for m in torch.unique_consecutive(torch.div(pos, block, rounding_mode="floor"), return_counts=True)[1].tolist():
            length = int(pos[start + m - 1]) + 1
            hidden = torch.arange(length, device=q.device)[None, :] > pos[start:start + m, None]  # [m, length]
            mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(hidden, float("-inf"))
            mask = mask[:, None, :].expand(m, group, length).reshape(m * group, length)
            outs.append(F.scaled_dot_product_attention(qf[:, :, start * group:(start + m) * group], k[:, :, :length],
                                                       v[:, :, :length], attn_mask=mask, scale=scale))
            start += m
        o = torch.cat(outs, dim=2).view(kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, heads, head_dim)
        out.index_copy_(0, sel, o)
    return out
