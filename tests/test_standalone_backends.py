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


def test_a_decode_batch_is_padded_as_sglangs_graph_runner_pads_it_and_a_prefill_is_refused(tmp_path):
    """SGLang's decode graph buffers pad a batch's tail per replay (`cuda_graph_buffer_registry`'s policy): request
    slot 0 (its request pool keeps it free), KV slot 0, position 0, and the backend's fill value of context (the
    Triton backend's: 1). The padding rows read request slot 0's one key, KV slot 0; the batch's rows read as
    they do unpadded."""
    world = LayerWorld(ARCHS[0], tmp_path, attention_backend="triton")
    prompts = world.batch({0: 5, 1: 3})
    world.dense(prompts, world.hidden(8))  # the prompts' K/V, which the decode step reads
    fb = world.batch({0: 1, 1: 1})
    padded = world.padded(fb, 4, "triton")
    assert padded.batch_size == 4 and fb.batch_size == 2  # the batch itself is left as it was
    assert padded.req_pool_indices.tolist() == [1, 2, 0, 0] and padded.seq_lens.tolist() == [6, 4, 1, 1]
    assert world.backend.get_cuda_graph_seq_len_fill_value() == 1
    assert padded.out_cache_loc[2:].tolist() == [0, 0] and padded.positions.tolist() == [5, 3, 0, 0]
    assert padded.seq_lens_sum == 12 and padded.seq_lens_cpu.tolist() == [6, 4, 1, 1]
    assert world.req_pool.req_to_token[0].eq(0).all()  # request slot 0: every position at KV slot 0
    metadata = world.backend.forward_metadata  # the Triton backend planned the padded batch: its four rows' keys
    assert metadata.kv_indptr.tolist() == [0, 6, 10, 11, 12]
    assert metadata.kv_indices[10:12].tolist() == [0, 0]
    x = world.hidden(4)
    torch.testing.assert_close(world.dense(padded, x)[:2], world.dense(fb, x[:2], backend="torch_native"),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="pads a decode batch to at least its 2 rows and at most the request "
                                         "pool's 4, got 1"):
        world.padded(fb, 1)
    with pytest.raises(ValueError, match="got 5"):
        world.padded(fb, 5)
    with pytest.raises(ValueError, match="pads a decode batch"):
        world.padded(world.batch({2: 4}), 4)
