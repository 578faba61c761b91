"""The gathered cuBLAS forms of the count-bounded cohort GEMMs: what a tile table serves where torch beat its tile.

Each form takes the arguments of its kernel in `vskipper.mixed.kernels` and runs over every slot of the cohort map
(its capacity C, the captured batch), not over the count: it gathers the C rows `idx` names (slots at and past the
count name row 0), multiplies them on cuBLAS, and drops the slots at and past the count with `torch.where` (so
whatever those rows computed, NaN included, never lands) before anything is stored or added. Every shape is C's
and the count stays a device value: no host read, so a captured graph replays these as it replays the kernels.

In the memory-bound regime (C at or below the device's ridge rows) a GEMM reads each weight once whatever the
count, as the tile does, so the form costs cuBLAS's time over C rows: the tuner's `torch_ms` (`vskipper.mixed.tuner`
times these functions). `TileTable.gathers` picks, per operation and capacity, the form or the tile.

Contracts as the kernels', except where noted:

  gathered_gemm        A[m] = X[idx[m]] @ W^T for m < count; rows >= count of `out` untouched (zeros without it)
  batch_rows_gemm      A[r] = X[r] @ W^T for every row r of X: the form of `cohort_gemm(batch_rows=True)`, whose
                       cohort rows land in their batch rows and whose other rows hold no meaning, so nothing is
                       gathered or masked (where X has C rows, the same cuBLAS GEMM over C rows)
  gathered_gate_up     A[m] = silu(X[idx[m]] W_gate^T) * (X[idx[m]] W_up^T) for m < count; without `out`, rows
                       >= count hold values of no meaning (the kernel leaves them unwritten). Where W_up's rows
                       follow W_gate's in memory (the halves of SGLang's merged `gate_up_proj`), one GEMM over
                       both (`merged_rows`): the gathered rows are read once and one launch serves both halves
  gathered_down        Y[idx[m]] += weights[idx[m]] * (A[m] @ W_down^T) for m < count: it adds, so where the
                       kernel would store (`accumulate` False) the caller zeroes Y first (`kernels.cohort_ffn_pair`)
  gathered_scatter_add Y[idx[m]] += A[m] @ W^T for m < count
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def live_slots(idx: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """bool [C]: the slots below the device-side count."""
    return torch.arange(idx.shape[0], device=idx.device) < count


def _masked(live: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.where(live[:, None], values, torch.zeros((), dtype=values.dtype, device=values.device))


def gathered_gemm(x: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, w: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    live = live_slots(idx, count)
    values = x.index_select(0, idx) @ w.t()
    if out is None:
        return _masked(live, values)
    return out.copy_(torch.where(live[:, None], values, out))


def batch_rows_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


def merged_rows(top: torch.Tensor, bottom: torch.Tensor) -> torch.Tensor | None:
    """[top; bottom] as one view of their storage where `bottom`'s rows follow `top`'s in memory (the two halves of
    a merged weight), else None. Reads metadata only: nothing on the device."""
    if (top.dim() != 2 or top.shape[1:] != bottom.shape[1:] or top.stride() != bottom.stride()
            or top.dtype != bottom.dtype or top.device != bottom.device
            or top.untyped_storage().data_ptr() != bottom.untyped_storage().data_ptr()
            or bottom.storage_offset() != top.storage_offset() + top.shape[0] * top.stride(0)):
        return None
    return top.as_strided((top.shape[0] + bottom.shape[0], top.shape[1]), top.stride())


def gathered_gate_up(x: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, w_gate: torch.Tensor,
                     w_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    a = x.index_select(0, idx)
    merged = merged_rows(w_gate, w_up)
    if merged is None:
        act = F.silu(a @ w_gate.t()) * (a @ w_up.t())
    else:
        both = a @ merged.t()
        n = w_gate.shape[0]
        act = F.silu(both[:, :n]) * both[:, n:]
    if out is None:
        return act
    return out.copy_(torch.where(live_slots(idx, count)[:, None], act, out))


def gathered_down(a: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, weights: torch.Tensor,
                  w_down: torch.Tensor, y: torch.Tensor) -> None:
    # scaled in fp32, as the kernel's epilogue scales its fp32 accumulator (one rounding to y's dtype after)
    values = (a @ w_down.t()).float() * weights.index_select(0, idx).view(-1, 1).float()
    y.index_add_(0, idx, _masked(live_slots(idx, count), values).to(y.dtype))


def gathered_scatter_add(a: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, w: torch.Tensor,
                         y: torch.Tensor) -> None:
    y.index_add_(0, idx, _masked(live_slots(idx, count), a @ w.t()).to(y.dtype))
