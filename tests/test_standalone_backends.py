"""A standalone served layer (`vskipper.sglang.standalone`) reads through SGLang's Triton attention backend, the one
the device runs' servers serve with, as it reads through the torch-native one: what lets the served-layer check
(`benchmarks/gpu/check_served.py`) run the servers' backend read against an independent reference. Here SGLang's
Triton kernels run in the Triton interpreter on CPU (its CUDA launch needs the GPU: the device run's check)."""

import pytest
import torch
from sglang_layer_world import ARCHS, LayerWorld


@pytest.mark.parametrize("arch", ARCHS)
def test_sglangs_triton_backend_reads_as_its_torch_native_one_in_prefill_chunks_and_decode(arch, tmp_path):
    world = LayerWorld(arch, tmp_path, attention_backend="triton")
    world.attention_backend("torch_native")  # built before the batches: each plans its metadata too
    for extend in ({0: 9, 2: 7}, {0: 4, 2: 6}, {0: 1, 2: 1}):  # prompts, a chunk over each prefix, a decode step
        fb = world.batch(extend)
        x = world.hidden(fb.positions.shape[0])
        got = world.dense(fb, x)  # through the world's backend: the Triton one
        want = world.dense(fb, x, backend="torch_native")  # writes the same K/V again
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_backend_the_standalone_layer_does_not_build_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="attention_backend must be one of torch_native, triton, got 'fa3'"):
        LayerWorld(ARCHS[0], tmp_path, attention_backend="fa3")
