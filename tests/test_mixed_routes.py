"""`vskipper.mixed.routes`: a skipper's per-pass routes in one Triton launch (RandomSkip's), under the interpreter,
against the skipper's own chain of tensor ops bit for bit; and the served model's use of it in the triton
execution (attested, and the chain's launches gone from a pass)."""

from __future__ import annotations

import os

import pytest
import torch
from mixed_world import HostReadDetector

from vskipper.mixed.launches import LaunchCount, interpreted_launches
from vskipper.mixed.routes import fused_form, fused_state
from vskipper.skippers.base import BatchContext
from vskipper.skippers.random_skip import RandomSkip, reference_routes
from vskipper.skippers.static_depth import StaticDepth

assert os.environ.get("TRITON_INTERPRET") == "1", "the kernel tests need TRITON_INTERPRET=1 (see conftest.py)"


def _batch(rows: int, layers: int, seed: int = 0, dtype=torch.bfloat16) -> BatchContext:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-2 ** 62, 2 ** 62, (rows,), generator=g)  # signed keys: the fold's arithmetic shifts
    positions = torch.randint(0, 200_000, (rows,), generator=g)
    valid = torch.rand(rows, generator=g) > 0.2  # padding rows RUN with unit weight
    return BatchContext(torch.empty(rows, 8, dtype=dtype), valid, tuple(range(3, 3 + layers)), "prefill", keys,
                        positions)


@pytest.mark.parametrize("r, d, seed", [(1.0, 0.5, 0), (0.0, 0.5, 0), (0.6, 0.3, 7), (0.5, 1.0, 123_456_789)])
@pytest.mark.parametrize("rows, layers", [(1, 1), (5, 4), (1500, 16)])
def test_the_fused_routes_equal_random_skips_own_bit_for_bit(r, d, seed, rows, layers):
    """Every layer's run flags, the unit weights (in the hidden states' dtype) and the layer index: what
    `prepare_batch` returns, so that `route` reads either alike; across a block boundary of rows too."""
    skipper, batch = RandomSkip(r, d, seed), _batch(rows, layers, seed)
    want, got = skipper.prepare_batch(batch), fused_state(skipper, batch)
    assert torch.equal(got["run"], want["run"]) and got["run"].shape == (layers, rows, 1)
    assert torch.equal(got["weights"], want["weights"]) and got["weights"].dtype == torch.bfloat16
    assert got["index"] == want["index"]
    for layer in batch.routed_layers:
        assert torch.equal(skipper.route(layer, None, got).run_mask, skipper.route(layer, None, want).run_mask)
    row = 0 if rows == 1 else rows // 2  # and the pure-Python reference for a valid row
    if bool(batch.valid_rows[row]):
        expected = reference_routes(seed, int(batch.request_keys[row]), int(batch.positions[row]), r, d, layers)
        assert [not bool(got["run"][j, row, 0]) for j in range(layers)] == expected


def test_the_fused_routes_read_nothing_on_the_host_and_launch_once():
    skipper, batch = RandomSkip(1.0, 0.5), _batch(64, 16)
    count, reads = LaunchCount(), HostReadDetector()
    with interpreted_launches(count.triton, run=True), count, reads:
        fused_state(skipper, batch)
    assert reads.reads == [] and dict(count.triton) == {"random_routes_kernel": 1}
    assert sum(count.ops.values()) == 0  # the chain's ~50 operators are gone; the outputs are allocations only
    chained, on_cpu = LaunchCount(), LaunchCount()
    keys, pos, valid = batch.request_keys, batch.positions, batch.valid_rows
    with chained:  # the chain of tensor ops a device runs without the fused form
        skipper._run(keys, pos, valid, torch.arange(len(batch.routed_layers)))
    assert sum(chained.ops.values()) >= 40
    with on_cpu:  # on CPU the chain runs as numpy's ufuncs: the tensors it returns are all torch sees
        skipper.prepare_batch(batch)
    assert sum(on_cpu.ops.values()) <= 2


def test_a_skipper_without_a_fused_form_keeps_its_own_and_random_skip_needs_keys_and_positions():
    batch = _batch(4, 2)
    assert fused_state(StaticDepth(0.5), batch) is None and fused_form(StaticDepth(0.5)) is None
    assert "random_routes_kernel" in fused_form(RandomSkip(1.0, 0.5))
    with pytest.raises(ValueError, match="random_skip needs per-row request_keys and positions"):
        fused_state(RandomSkip(1.0, 0.5), BatchContext(batch.hidden_states, batch.valid_rows, (3,), "decode"))
