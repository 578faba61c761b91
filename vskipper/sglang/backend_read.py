"""SGLang's own prefill read, for `vskipper tune-tiles` to weigh the packed read against.

Where the packed read of a routed prefill layer's RUN rows is no faster than the read that would replace it, the
triton execution reads through SGLang's attention backend instead (`TileTable.prefill_read`). That read is the
backend's, not SDPA's: on the device runs (`--attention-backend triton`, the stand-in profile's) SGLang's Triton
extend kernel, which took 2.35 ms over a 1,024-token prompt's 32 layers on the H200 (73 us a layer;
`benchmarks/results/H200/host-lean-sweep/profile/`), where the SDPA the tuner weighed the packed read against read a
2,048-token prompt in 85 us. The tuner times it here, as the backend calls it for a fresh prompt (no cached prefix,
every row causal), through the kernel entry point the backend imports.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vskipper.mixed.tuner import BackendRead

TRITON = "triton"  # as `--attention-backend` names it


def triton_extend_read(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                       ) -> Callable[[], torch.Tensor]:
    """SGLang's Triton extend kernel over one prompt in position order (q [T, heads, head_dim], k and v
    [T, kv_heads, head_dim]), as `TritonAttnBackend.forward_extend` launches it for a request with no prefix:
    one request, its K/V the extend's own, the pool not read (a prefix of no pages), causal, no mask or cap. The
    call returns the output [T, heads, head_dim]."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    tokens, kv_heads, head_dim = k.shape
    out = torch.empty_like(q)
    pool = torch.zeros(1, kv_heads, head_dim, dtype=k.dtype, device=k.device)  # the prefix's pages: none
    qo_indptr = torch.tensor([0, tokens], dtype=torch.int32, device=q.device)
    kv_indptr = torch.zeros(2, dtype=torch.int32, device=q.device)
    kv_indices = torch.zeros(0, dtype=torch.int64, device=q.device)

    def call() -> torch.Tensor:
        extend_attention_fwd(q, k, v, out, pool, pool, qo_indptr, kv_indptr, kv_indices, None, True, None, tokens,
                             1.0, 1.0, sm_scale=scale)
        return out

    return call


BACKEND_READS = {TRITON: BackendRead(TRITON, triton_extend_read)}
