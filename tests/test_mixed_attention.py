"""The torch attention reads of `vskipper.mixed.attention` against the padded, masked reference read."""

import pytest
import torch

from vskipper.mixed import attention
from vskipper.mixed.attention import paged_attention, prefill_attention


@pytest.fixture
def calls(monkeypatch) -> list:
    """One entry per SDPA call the reads make."""
    made: list = []
    sdpa = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **k: made.append(1) or sdpa(*a, **k))
    return made


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("block", [1, 3, 8, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_the_blocked_prefill_read_equals_the_reference_and_reads_only_owned_slots(block, heads, kv_heads, batched,
                                                                                  monkeypatch, calls):
    """Two requests' prefill rows, interleaved and out of position order, a subset of them reading: each reading
    row attends causally to its own request's slots, whichever block it falls in, or in the one masked call over
    both requests (`batched`: each run of one request's consecutive rows an entry of the call, padded to the
    longest run); the other rows get zeros. Every slot no request owns holds NaN, so any read of one would show."""
    monkeypatch.setattr(attention, "BATCHED_READ_MACS", 1 << 40 if batched else 0)
    monkeypatch.setattr(attention, "BATCHED_READ_MAX_SPAN", 1 << 40)
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
    if batched:
        assert len(calls) == 1
    else:
        assert len(calls) >= 2


def test_small_requests_are_read_in_one_call_and_larger_ones_request_by_request(calls):
    """The default choice: four prompts of 16 tokens are read in one call; two of 512 span more than the one call
    reads (it would compute every key of a request for every row, where the causal blocks skip half)."""
    for requests, length, expected in ((4, 16, 1), (2, 512, 2 * 512 // attention.PREFILL_READ_BLOCK)):
        calls.clear()
        r2t = (torch.arange(requests * length) + 1).view(requests, length)
        pool = torch.randn(requests * length + 1, 2, 16)
        req, pos = torch.arange(requests).repeat_interleave(length), torch.arange(length).repeat(requests)
        q = torch.randn(requests * length, 4, 16)
        got = prefill_attention(q, pool, pool, r2t, req, pos, 0.25)
        torch.testing.assert_close(got, paged_attention(q, pool, pool, r2t, req, pos, 0.25), rtol=1e-5, atol=1e-5)
        assert len(calls) == expected


def test_the_one_call_pads_each_request_to_the_longest_and_drops_the_padding(calls):
    """Three prompts held together in batch order (as a prefill batch holds them), with 2, 11 and 5 reading rows
    over spans of 3 to 16 keys: one call, each request padded to 11 rows; the padding rows' outputs are dropped and
    no row reads a slot its request does not own (those hold NaN)."""
    gen = torch.Generator().manual_seed(7)
    lengths = (3, 16, 9)
    k_pool = torch.full((40, 2, 16), float("nan"))
    v_pool = torch.full((40, 2, 16), float("nan"))
    r2t = torch.zeros(3, 20, dtype=torch.int64)
    owned = iter((torch.randperm(39, generator=gen) + 1).tolist())
    for r, n in enumerate(lengths):
        r2t[r, :n] = torch.tensor([next(owned) for _ in range(n)])
        k_pool[r2t[r, :n]] = torch.randn(n, 2, 16, generator=gen)
        v_pool[r2t[r, :n]] = torch.randn(n, 2, 16, generator=gen)
    req = torch.cat([torch.full((n,), r) for r, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    reads = torch.zeros(req.shape[0], dtype=torch.bool)
    reads[[1, 2]] = True  # request 0: 2 rows
    reads[3 + torch.arange(5, 16)] = True  # request 1: 11 rows
    reads[19 + torch.tensor([0, 2, 4, 6, 8])] = True  # request 2: 5 rows
    q = torch.randn(req.shape[0], 4, 16, generator=gen)

    got = prefill_attention(q, k_pool, v_pool, r2t, req, pos, 0.25, reads)
    torch.testing.assert_close(got, paged_attention(q, k_pool, v_pool, r2t, req, pos, 0.25, reads), rtol=1e-5,
                               atol=1e-5)
    assert len(calls) == 1
    assert (got[~reads] == 0).all() and not got.isnan().any()


@pytest.mark.parametrize(("req_dtype", "pos_dtype"), [(torch.int32, torch.int64), (torch.int64, torch.int32),
                                                      (torch.int32, torch.int32)])
def test_the_one_call_takes_request_slots_and_positions_of_any_integer_dtype(req_dtype, pos_dtype, calls):
    """SGLang's own tensors are int64, but the read is a library function: int32 slots or positions (or both) read
    the same, in one call."""
    r2t = (torch.arange(3 * 8) + 1).view(3, 8).to(torch.int32)
    pool = torch.randn(3 * 8 + 1, 2, 16)
    req, pos = torch.arange(3).repeat_interleave(8), torch.arange(8).repeat(3)
    q = torch.randn(24, 4, 16)
    expected = paged_attention(q, pool, pool, r2t.long(), req, pos, 0.25)
    got = prefill_attention(q, pool, pool, r2t, req.to(req_dtype), pos.to(pos_dtype), 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert len(calls) == 1
