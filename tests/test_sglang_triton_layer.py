"""The served routed layer's triton execution (`vskipper.sglang.models.routed.CohortExecution`) under
TRITON_INTERPRET=1: SGLang's own decoder layers and KV pool (`tests/sglang_layer_world.py`), the count-bounded
cohort GEMMs and the RUN-masked decode read of `vskipper.mixed.kernels`, against the torch execution of the same
routed-layer body. Which execution a process takes, and why, is attested."""

from __future__ import annotations

import os

import pytest
import torch
from sglang_layer_world import ARCHS, LayerWorld

from vskipper.mixed import kernels
from vskipper.mixed import routed_layer as body
from vskipper.sglang.models import routed as served

assert os.environ.get("TRITON_INTERPRET") == "1", "the triton execution tests need TRITON_INTERPRET=1 (conftest.py)"

@pytest.fixture(scope="module", params=ARCHS)
def world(request, tmp_path_factory):
    return LayerWorld.prefilled(request.param, tmp_path_factory.mktemp("triton-layer"), 5, {0: 5, 1: 3, 2: 7, 3: 4})


def _pass(world: LayerWorld, extend: dict[int, int], x, run, w, execution):
    """One routed pass with `execution` from the world's current KV state; the output and this layer's KV
    after it. The KV state and request lengths are restored."""
    kv0, lengths0 = world.kv(), list(world.lengths)
    world.slot.execution = execution
    try:
        y = world.routed(world.batch(extend), x, run, w)
        return y, world.kv()
    finally:
        world.slot.execution = served.TORCH_EXECUTION
        world.restore(kv0, lengths0)


@pytest.mark.parametrize("run", [[True, False, True, False], [False, False, False, True], [True] * 4,
                                 [False] * 4])
def test_the_triton_execution_of_a_decode_pass_equals_the_torch_execution(world, run, monkeypatch):
    """Outputs and the KV written, with both cohorts, all-RUN and all-Project-Only routes; the pass really ran
    the cohort GEMMs (one MLP and one projector launch) and the masked decode read (once)."""
    calls = {"cohort_ffn": [], "masked_read": 0}

    def cohort_ffn(backend, *args, **kwargs):
        calls["cohort_ffn"].append((backend, kwargs["op"], kwargs["tiles"]))
        return real_ffn(backend, *args, **kwargs)

    def masked_read(*args, **kwargs):
        calls["masked_read"] += 1
        return real_read(*args, **kwargs)

    real_ffn, real_read = body.cohort_ffn, kernels.masked_decode_attention
    monkeypatch.setattr(body, "cohort_ffn", cohort_ffn)
    monkeypatch.setattr(kernels, "masked_decode_attention", masked_read)
    extend = {0: 1, 1: 1, 2: 1, 3: 1}
    x = world.hidden(4)
    run_t = torch.tensor(run)
    w = torch.where(run_t, torch.ones(4), torch.rand(4, generator=world.gen) * 0.8 + 0.1)
    triton = served.cohort_execution([world.layer], torch.device("cpu"), "triton")
    assert triton.decode == "triton"
    y_triton, kv_triton = _pass(world, extend, x, run_t, w, triton)
    assert calls == {"cohort_ffn": [("triton", "mlp", None), ("triton", "proj", None)], "masked_read": 1}
    y_torch, kv_torch = _pass(world, extend, x, run_t, w, served.TORCH_EXECUTION)
    torch.testing.assert_close(y_triton, y_torch, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_triton, kv_torch, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("run", [[True, False, False, True], [False, True, True, True], [False] * 4])
def test_project_only_rows_never_enter_q_the_read_or_o_proj_of_the_triton_execution(world, run, monkeypatch):
    """The rows each kernel of a mixed decode pass covers (the batch rows idx[m], m < count, of a count-bounded
    GEMM; the reading slots of the masked read): Q, the read and o_proj the RUN rows alone, at their own
    positions and requests; the MLP the RUN rows, the adapter the Project-Only rows. K/V goes through the K/V
    rows of qkv_proj for every row; no module of SGLang's attention or MLP runs its own forward."""
    layer = world.layer
    seen: dict[str, object] = {}

    def rows_of(idx, count):
        return sorted(idx[: int(count)].tolist())

    def gemm(u, idx, count, w, *args, **kwargs):
        seen["q"] = rows_of(idx, count)
        return real["gemm"](u, idx, count, w, *args, **kwargs)

    def scatter(a, idx, count, w, y, *args, **kwargs):
        seen["o_proj"] = rows_of(idx, count)
        return real["scatter"](a, idx, count, w, y, *args, **kwargs)

    def read(q, k_pool, v_pool, req_to_token, req, positions, reads, *args, **kwargs):
        seen["read"] = (req[reads].tolist(), positions[reads].tolist())
        return real["read"](q, k_pool, v_pool, req_to_token, req, positions, reads, *args, **kwargs)

    def ffn(backend, x, idx, count, *args, **kwargs):
        seen[kwargs["op"]] = rows_of(idx, count)
        return real["ffn"](backend, x, idx, count, *args, **kwargs)

    def projection(qkv_proj, rows, u):
        seen["kv" if rows.start == layer.self_attn.q_size else "qkv_rows"] = u.shape[0]
        return real["projection"](qkv_proj, rows, u)

    real = {"gemm": kernels.cohort_gemm, "scatter": kernels.cohort_scatter_add, "ffn": body.cohort_ffn,
            "read": kernels.masked_decode_attention, "projection": served.row_projection}
    monkeypatch.setattr(kernels, "cohort_gemm", gemm)
    monkeypatch.setattr(kernels, "cohort_scatter_add", scatter)
    monkeypatch.setattr(kernels, "masked_decode_attention", read)
    monkeypatch.setattr(body, "cohort_ffn", ffn)
    monkeypatch.setattr(served, "row_projection", projection)
    modules = (layer.self_attn, layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp,
               layer.mlp.gate_up_proj, layer.mlp.down_proj)
    handles = [m.register_forward_pre_hook(lambda m, args: seen.setdefault("forwards", []).append(type(m)))
               for m in modules]
    run_t = torch.tensor(run)
    w = torch.where(run_t, torch.ones(4), torch.full((4,), 0.5))
    reqs = [2, 0, 3, 1]  # batch row i decodes request reqs[i], at its length
    positions = [world.lengths[r] for r in reqs]
    try:
        _pass(world, dict.fromkeys(reqs, 1), world.hidden(4), run_t, w,
              served.cohort_execution([layer], torch.device("cpu"), "triton"))
    finally:
        for h in handles:
            h.remove()
    run_rows = [i for i, r in enumerate(run) if r]
    proj_rows = [i for i, r in enumerate(run) if not r]
    assert seen == {"kv": 4, "q": run_rows, "read": ([reqs[i] for i in run_rows], [positions[i] for i in run_rows]),
                    "o_proj": run_rows, "mlp": run_rows, "proj": proj_rows}


def test_a_prefill_pass_runs_the_torch_execution_whatever_the_decode_execution(world, monkeypatch):
    calls = []
    monkeypatch.setattr(body, "cohort_ffn", lambda *a, **k: calls.append(a))
    extend = {1: 3, 3: 2}
    x = world.hidden(5)
    run = torch.tensor([True, False, True, False, True])
    w = torch.where(run, torch.ones(5), torch.full((5,), 0.4))
    y_triton, kv_triton = _pass(world, extend, x, run, w,
                                served.cohort_execution([world.layer], torch.device("cpu"), "triton"))
    y_torch, kv_torch = _pass(world, extend, x, run, w, served.TORCH_EXECUTION)
    assert calls == []
    torch.testing.assert_close(y_triton, y_torch, rtol=0, atol=0)
    torch.testing.assert_close(kv_triton, kv_torch, rtol=0, atol=0)


def test_the_execution_is_torch_on_cpu_and_triton_needs_one_rank_and_plain_mlp_weights(world, monkeypatch):
    cpu = torch.device("cpu")
    # auto: triton only on CUDA; on CPU the torch execution's decode read is per row
    assert served.cohort_execution([world.layer], cpu) == served.CohortExecution("torch", decode_read="backend")
    assert served.cohort_execution([world.layer], cpu).attestation() == {
        "decode": "torch", "decode_read": "backend", "prefill": "torch", "prefill_read": "rows", "tiles": None}
    assert served.cohort_execution([world.layer], torch.device("cuda"), "torch").decode_read == "masked"
    with pytest.raises(ValueError, match="decode_read must be one of"):
        served.CohortExecution("torch", decode_read="padded")
    assert served.cohort_execution([world.layer], cpu, "triton").attestation() == {
        "decode": "triton", "prefill": "torch", "prefill_read": "rows", "tiles": "interpreter tile"}
    # On CUDA prefill reads through SGLang's attention backend, whichever execution decodes.
    assert served.cohort_execution([world.layer], torch.device("cuda"), "torch").prefill_read == "backend"
    monkeypatch.setattr(world.layer.mlp.down_proj, "tp_size", 2, raising=False)
    split = served.cohort_execution([world.layer], cpu, "triton")
    assert split.decode == "torch"
    assert split.attestation()["why"] == "layer 2: the MLP is split over 2 tensor-parallel ranks"
    monkeypatch.setattr(world.layer.mlp.down_proj, "tp_size", 1, raising=False)
    monkeypatch.setattr(world.layer.mlp.gate_up_proj, "quant_method", object())
    assert served.cohort_execution([world.layer], cpu, "triton").reason == \
        "layer 2: mlp.gate_up_proj is quantized or packed"
    monkeypatch.undo()
    # The attention cohort GEMMs read o_proj and the Q rows of qkv_proj as plain weights, with no o_proj bias.
    attn = world.layer.self_attn
    assert served.project_only_q([attn.qkv_proj], served.cohort_execution([world.layer], cpu, "triton")) == \
        "decode: skipped (the RUN cohort's count-bounded Q GEMM); prefill: skipped: K/V rows of qkv_proj"
    monkeypatch.setattr(attn.o_proj, "bias", torch.nn.Parameter(torch.zeros(attn.o_proj.weight.shape[0])))
    assert served.cohort_execution([world.layer], cpu, "triton").reason == \
        "layer 2: self_attn.o_proj has a bias (the scattered o_proj adds none)"
    monkeypatch.undo()
    monkeypatch.setattr(attn.o_proj, "quant_method", object())
    assert served.cohort_execution([world.layer], cpu, "triton").reason == \
        "layer 2: self_attn.o_proj is quantized or packed"
    monkeypatch.undo()
    monkeypatch.setattr(attn.o_proj, "tp_size", 2, raising=False)
    assert served.cohort_execution([world.layer], cpu, "triton").reason == \
        "layer 2: the attention is split over 2 tensor-parallel ranks"
