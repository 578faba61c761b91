"""The torch attention reads of `vskipper.mixed.attention` against the padded, masked reference read."""

import pytest
import torch

from vskipper.mixed.attention import paged_attention, prefill_attention


@pytest.mark.parametrize("block", [1, 3, 8, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_the_blocked_prefill_read_equals_the_reference_and_reads_only_owned_slots(block, heads, kv_heads):
    """Two requests' prefill rows, interleaved and out of position order, a subset of them reading: each reading
    row attends causally to its own request's slots, whichever block it falls in; the other rows get zeros. Every
    slot no request owns holds NaN, so any read of one would show."""
    gen = torch.Generator().manual_seed(block)
    head_dim, slots = 16, 64
    k_pool = torch.full((slots, kv_heads, head_dim), float("nan"))
    v_pool = torch.full((slots, kv_heads, head_dim), float("nan"))
    r2t = torch.zeros(2, 24, dtype=torch.int64)
    owned = torch.randperm(slots - 1, generator=gen)[:41] + 1
    r2t[0, :20], r2t[1, :21] = owned[:20], owned[20:]
    k_pool[owned] = torch.randn(41, kv_heads, head_dim, generator=gen)
    v_pool[owned] = torch.randn(41, kv_heads, head_dim, generator=gen)
    req = torch.tensor([0] * 20 + [1] * 9)
    pos = torch.cat([torch.arange(20), torch.arange(12, 21)])
    perm = torch.randperm(req.shape[0], generator=gen)
    req, pos = req[perm], pos[perm]
    q = torch.randn(req.shape[0], heads, head_dim, generator=gen)
    reads = torch.rand(req.shape[0], generator=gen) < 0.6

    got = prefill_attention(q, k_pool, v_pool, r2t, req, pos, 0.25, reads, block=block)
    expected = paged_attention(q, k_pool, v_pool, r2t, req, pos, 0.25, reads)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got[~reads] == 0).all() and not got.isnan().any()
