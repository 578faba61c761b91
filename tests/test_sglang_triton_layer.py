"""The served routed layer's triton execution (`vskipper.sglang.models.routed.CohortExecution`) under
TRITON_INTERPRET=1: SGLang's own decoder layers and KV pool (`tests/sglang_layer_world.py`), the count-bounded
cohort GEMMs and the RUN-masked decode read of `vskipper.mixed.kernels`, against the torch execution of the same
routed-layer body. Which execution a process takes, and why, is attested."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from sglang_layer_world import ARCHS, LayerWorld

from vskipper.mixed import kernels
from vskipper.mixed.tiles import OPERATIONS, ReadTile, ReadTiming, tile_table_for
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
    the cohort GEMMs (the MLP and the projector, one pair of launches) and the masked decode read (once)."""
    calls = {"cohort_ffn_pair": [], "masked_read": 0}

    def cohort_ffn_pair(*args, **kwargs):
        calls["cohort_ffn_pair"].append(kwargs["tiles"])
        return real_ffn(*args, **kwargs)

    def masked_read(*args, **kwargs):
        calls["masked_read"] += 1
        return real_read(*args, **kwargs)

    real_ffn, real_read = kernels.cohort_ffn_pair, kernels.masked_decode_attention
    monkeypatch.setattr(kernels, "cohort_ffn_pair", cohort_ffn_pair)
    monkeypatch.setattr(kernels, "masked_decode_attention", masked_read)
    extend = {0: 1, 1: 1, 2: 1, 3: 1}
    x = world.hidden(4)
    run_t, w = world.route(run)
    triton = served.cohort_execution([world.layer], torch.device("cpu"), "triton")
    assert triton.decode == "triton"
    y_triton, kv_triton = _pass(world, extend, x, run_t, w, triton)
    assert calls == {"cohort_ffn_pair": [None], "masked_read": 1}
    y_torch, kv_torch = _pass(world, extend, x, run_t, w, served.TORCH_EXECUTION)
    torch.testing.assert_close(y_triton, y_torch, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_triton, kv_torch, rtol=1e-4, atol=1e-4)


def test_a_triton_decode_layer_launches_no_gather_scatter_or_fill_of_its_own(world):
    """What vSkipper's own code launches in a routed decode layer of the triton execution, in order (SGLang's
    modules launch what they launch in a dense layer: the K/V rows' GEMM, RoPE, the KV write, the norms): the
    cohort maps, which record the skipper's route into the tape in the same launch (no copy of their own), the
    count-bounded Q GEMM storing each RUN row's query in its batch row (K stays a view of the projection; Qwen3's
    q_norm and k_norm are SGLang's `apply_qk_norm`, as its own layer calls it), the masked read (split and merge:
    each slot's query, request and position gathered by the kernel), o_proj's scatter onto the residual the layer
    hands over (no copy of it first), the MLP's and the adapter's gate-up in one launch and their down GEMMs in
    another; then the hand-off's sum onto that residual (the Qwen3 layer's; the Llama layer leaves it to the next
    layer's add-norm). No gather of queries, requests or positions, no scatter into batch slots, no zero fill, no
    copy of the route or of the residual, no launch of the adapter's own: on a GPU each of those is a launch of
    its own in every routed layer's step."""
    launches = _own_launches(world, served.cohort_execution([world.layer], torch.device("cpu"), "triton"),
                             {0: 1, 1: 1, 2: 1, 3: 1}, [True, False, True, False])
    assert launches == [
        "cohort_maps_kernel", "cohort_gemm_kernel", "masked_decode_split_kernel",
        "masked_decode_merge_kernel", "cohort_down_scatter_kernel", "grouped_gate_up_kernel",
        "grouped_down_scatter_kernel", "add_"]


def test_a_layer_whose_table_timed_the_ffns_faster_apart_launches_them_apart_and_attests_it(world):
    """Where the table's `ffn_pair` measured the two cohort FFNs faster apart, the routed layer launches the MLP's
    and the adapter's pairs one after the other (four launches where grouped takes two), and its execution attests
    the range as `ffn_apart`."""
    from mixed_world import gathering_table

    from vskipper.mixed.tiles import PairTiming

    table = gathering_table(set())
    table.ffn_pair = [(1, 16, PairTiming(2.0, 1.0)), (17, None, PairTiming(1.0, 2.0))]
    execution = served.CohortExecution("triton", table, prefill_read="packed")
    assert execution.attestation()["ffn_apart"] == [[1, 16]]
    assert not any(line.startswith("FFN pair") for line in execution.attestation()["tiles_lack"])
    launches = _own_launches(world, execution, {0: 1, 1: 1, 2: 1, 3: 1}, [True, False, True, False])
    assert launches[-5:] == ["cohort_gate_up_kernel", "cohort_down_scatter_kernel", "cohort_gate_up_kernel",
                             "cohort_down_scatter_kernel", "add_"]


def test_a_layer_whose_table_splits_k_at_decode_counts_reduces_after_each_split_gemm_and_attests_it(world):
    """A table whose Q, o_proj and down tiles split K at the decode counts: each of those GEMMs launches its reduce
    after it (the two FFNs' down GEMMs grouped in one split launch, then a reduce each, where the pair was not
    timed; apart, each with its reduce, where it timed apart faster), the pass's output and KV equal the torch
    execution's either way, and the execution attests the split ranges."""
    from mixed_world import INTERPRETER_ENTRY

    from vskipper.mixed.tiles import COUNT_RANGES, OPERATIONS, SPLIT_OPERATIONS, PairTiming, parse_tile_table

    tiles = {op: [{"rows": [lo, hi], **INTERPRETER_ENTRY, **({"split_k": 2} if op in SPLIT_OPERATIONS and
                                                                hi is not None and hi <= 512 else {})}
                  for lo, hi in COUNT_RANGES] for op in OPERATIONS}
    table = parse_tile_table({"device": "H200", "dtype": "float32", "source": "test", "tiles": tiles}, 227 * 1024)
    grouped = served.CohortExecution("triton", table, prefill_read="packed")
    assert grouped.attestation()["split_k"] == {op: [[1, 512, 2]] for op in SPLIT_OPERATIONS}
    run = [True, False, True, False]
    assert _own_launches(world, grouped, {0: 1, 1: 1, 2: 1, 3: 1}, run) == [
        "cohort_maps_kernel", "cohort_gemm_kernel", "split_k_reduce_kernel", "masked_decode_split_kernel",
        "masked_decode_merge_kernel", "cohort_down_scatter_kernel", "split_k_reduce_kernel",
        "grouped_gate_up_kernel", "grouped_down_scatter_kernel", "split_k_reduce_kernel", "split_k_reduce_kernel",
        "add_"]
    extend = {0: 1, 1: 1, 2: 1, 3: 1}
    x = world.hidden(4)
    run_t, w = world.route(run)
    y_torch, kv_torch = _pass(world, extend, x, run_t, w, served.TORCH_EXECUTION)
    y_grouped, kv_grouped = _pass(world, extend, x, run_t, w, grouped)
    torch.testing.assert_close(y_grouped, y_torch, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_grouped, kv_torch, rtol=1e-4, atol=1e-4)
    table.ffn_pair = [(1, None, PairTiming(2.0, 1.0))]
    execution = served.CohortExecution("triton", table, prefill_read="packed")
    assert execution.attestation()["split_k"] == {op: [[1, 512, 2]] for op in SPLIT_OPERATIONS}
    launches = _own_launches(world, execution, {0: 1, 1: 1, 2: 1, 3: 1}, run)
    assert launches == [
        "cohort_maps_kernel", "cohort_gemm_kernel", "split_k_reduce_kernel", "masked_decode_split_kernel",
        "masked_decode_merge_kernel", "cohort_down_scatter_kernel", "split_k_reduce_kernel",
        "cohort_gate_up_kernel", "cohort_down_scatter_kernel", "split_k_reduce_kernel", "cohort_gate_up_kernel",
        "cohort_down_scatter_kernel", "split_k_reduce_kernel", "add_"]
    y_split, kv_split = _pass(world, extend, x, run_t, w, execution)
    torch.testing.assert_close(y_split, y_torch, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_split, kv_torch, rtol=1e-4, atol=1e-4)


def _own_launches(world: LayerWorld, execution, extend: dict[int, int], run: list[bool]) -> list[str]:
    """What vSkipper's own code launches in one routed pass of `execution` (`OwnLaunches`), x handed over as both
    families' layers hand it past a first layer."""
    from mixed_world import OwnLaunches

    launches = OwnLaunches()
    kv0, lengths0 = world.kv(), list(world.lengths)
    world.slot.execution = execution
    try:
        world.routed(world.batch(extend), world.hidden(len(run)), *world.route(run), watch=launches.triton(),
                     x_owned=True)
    finally:
        world.slot.execution = served.TORCH_EXECUTION
        world.restore(kv0, lengths0)
    return launches.launches


def _handed_over(world: LayerWorld, monkeypatch, delta: float) -> list[bool]:
    """Every pass of the world's layer routed, its body replaced by one that records whether the layer handed x
    over (the list returned fills as the layer runs) and hands on (delta everywhere, x)."""
    from vskipper.mixed.routed_layer import Handoff

    owned: list[bool] = []

    def mixed_depth(step, positions, x, forward_batch, u=None, x_owned=False):
        owned.append(x_owned)
        return Handoff(torch.full_like(x, delta), x)

    monkeypatch.setattr(world.layer, "mixed_depth", mixed_depth)
    monkeypatch.setattr(world.layer, "routed_step", lambda: object())
    return owned


def test_the_llama_layer_hands_over_the_residual_its_add_norm_formed_never_the_embeddings(tmp_path, monkeypatch):
    """The Llama layer hands the body the residual its fused add-norm formed (upstream's own layer updates that
    buffer in place), never the embeddings a first layer reads."""
    world = LayerWorld("flexidepth-llama", tmp_path)
    owned = _handed_over(world, monkeypatch, delta=0.0)
    fb, x = world.batch({0: 1, 1: 1}), world.hidden(2)
    with world.context(), torch.no_grad():
        world.layer.forward(fb.positions, x, fb, None)  # a first layer: x is the embeddings
        world.layer.forward(fb.positions, x, fb, torch.zeros_like(x))
    assert owned == [False, True]


def test_the_qwen3_layer_forms_y_on_a_residual_no_one_else_holds_never_on_the_embeddings(tmp_path, monkeypatch):
    """Through SGLang's layer-boundary stream, the Qwen3 layer hands the body x and forms y on it where x is a sum
    the fold formed (a dense layer's pending output added to the residual) or a routed layer's written y; a first
    layer's embeddings it leaves as they came, y a new tensor."""
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
    from sglang.srt.layers.layer_boundary.residual.add_norm import Add

    world = LayerWorld("qwen3-skipper", tmp_path)
    owned = _handed_over(world, monkeypatch, delta=1.0)
    fb, embeddings = world.batch({0: 1, 1: 1}), world.hidden(2)
    kept = embeddings.clone()
    with world.context(), torch.no_grad():
        residual_batch.start(fb)
        y_first = world.layer.forward(fb.positions, embeddings, fb)  # a first layer: x is the embeddings
        assert torch.equal(embeddings, kept) and torch.equal(y_first, kept + 1)
        y_next = world.layer.forward(fb.positions, y_first, fb)  # after a routed layer: x is its y
        written = y_next.clone()
        output = torch.full_like(y_next, 2.0)  # a dense layer's output, left pending as upstream's layer leaves it
        y_last = world.layer.forward(fb.positions, residual_batch.current(fb).leave(output, Add()), fb)
    assert owned == [False, True, True]
    assert y_next is y_first and torch.equal(y_next, kept + 1 + 1)  # formed on the written y
    assert y_last is not y_next and torch.equal(y_next, written)  # formed on the fold's sum, the residual kept
    assert torch.equal(y_last, written + 2 + 1)


@pytest.mark.parametrize("execution", ["triton", "torch"])
@pytest.mark.parametrize("run", [[True, False, True, False], [True] * 4, [False] * 4])
def test_a_residual_handed_over_holds_the_layers_residual_and_one_kept_is_left_as_it_came(world, execution, run):
    """With x handed over (the Llama layer's add-norm residual, the Qwen3 layer's folded one) the body adds
    o_proj's output onto x in place: x then holds the hand-off's residual (h at RUN rows, x at Project-Only rows),
    and the hand-off's sum in place forms on x the output a kept x gives; a kept x (the embeddings at a first
    layer, the hosts that read it again) is untouched. Both executions, with both cohorts, all-RUN (the torch
    execution's fast path) and all-Project-Only."""
    chosen = served.TORCH_EXECUTION if execution == "torch" else served.cohort_execution(
        [world.layer], torch.device("cpu"), "triton")
    extend, x, route = {0: 1, 1: 1, 2: 1, 3: 1}, world.hidden(4), world.route(run)
    kept = x.clone()
    y_kept, _ = _pass(world, extend, x, *route, chosen)
    assert torch.equal(x, kept)
    kv0, lengths0 = world.kv(), list(world.lengths)
    world.slot.execution = chosen
    try:
        out = world.routed(world.batch(extend), x, *route, x_owned=True, handoff=True)
    finally:
        world.slot.execution = served.TORCH_EXECUTION
        world.restore(kv0, lengths0)
    assert out.residual is x
    runs, proj = ([i for i, r in enumerate(run) if r == flag] for flag in (True, False))
    assert not torch.isclose(x[runs], kept[runs]).all(dim=1).any()  # RUN rows: h = x + o_proj(...)
    assert torch.equal(x[proj], kept[proj])  # Project-Only rows: h = x
    y_owned = out.output(in_place=True)  # the Qwen3 layer's sum: y forms on x
    assert y_owned is x
    torch.testing.assert_close(y_owned, y_kept, rtol=1e-5, atol=1e-5)


def _watch_kernels(world: LayerWorld, monkeypatch) -> dict[str, object]:
    """Spies on what each kernel of a triton pass covers, filled in as the pass runs: the batch rows idx[m],
    m < count, of each count-bounded GEMM (`q`, `o_proj`, `mlp`, `proj`); the rows of the K/V projection (`kv`)
    or of a whole qkv_proj (`qkv_rows`); the (requests, positions) the masked decode read or the packed prefill
    read reads (`read`); the rows whose query SGLang's prefill read receives non-zero (`queries`); and any forward
    of SGLang's attention or MLP modules (`forwards`: the triton execution runs none)."""
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

    def spy_read(name):  # the masked decode read and the packed prefill read: what each slot of `reads` reads
        def read(q, k_pool, v_pool, req_to_token, req, positions, reads, *args, **kwargs):
            idx = kwargs.get("idx")  # the decode read gathers each slot's row from the batch rows
            rows = (req, positions) if idx is None else (req[idx], positions[idx])
            seen["read"] = (rows[0][reads].tolist(), rows[1][reads].tolist())
            return real[name](q, k_pool, v_pool, req_to_token, req, positions, reads, *args, **kwargs)
        return read

    def extend(q, *args, **kwargs):
        seen["queries"] = q.reshape(q.shape[0], -1).abs().sum(-1).nonzero().view(-1).tolist()
        return real["extend"](q, *args, **kwargs)

    def ffn(x, weights, y, mlp, proj, **kwargs):
        seen["mlp"], seen["proj"] = rows_of(mlp.idx, mlp.count), rows_of(proj.idx, proj.count)
        return real["ffn"](x, weights, y, mlp, proj, **kwargs)

    def projection(qkv_proj, rows, u):
        seen["kv" if rows.start == layer.self_attn.q_size else "qkv_rows"] = u.shape[0]
        return real["projection"](qkv_proj, rows, u)

    real = {"gemm": kernels.cohort_gemm, "scatter": kernels.cohort_scatter_add, "ffn": kernels.cohort_ffn_pair,
            "read": kernels.masked_decode_attention, "projection": served.row_projection,
            "extend": world.backend.forward_extend, "packed": kernels.packed_prefill_attention}
    monkeypatch.setattr(kernels, "cohort_gemm", gemm)
    monkeypatch.setattr(kernels, "cohort_scatter_add", scatter)
    monkeypatch.setattr(kernels, "masked_decode_attention", spy_read("read"))
    monkeypatch.setattr(kernels, "cohort_ffn_pair", ffn)
    monkeypatch.setattr(served, "row_projection", projection)
    monkeypatch.setattr(world.backend, "forward_extend", extend)
    monkeypatch.setattr(kernels, "packed_prefill_attention", spy_read("packed"))
    for m in (layer.self_attn, layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp, layer.mlp.gate_up_proj,
              layer.mlp.down_proj):
        def forward(*args, _m=m, _forward=m.forward, **kwargs):
            seen.setdefault("forwards", []).append(type(_m))
            return _forward(*args, **kwargs)

        monkeypatch.setattr(m, "forward", forward)
    return seen


@pytest.mark.parametrize("run", [[True, False, False, True], [False, True, True, True], [False] * 4])
def test_project_only_rows_never_enter_q_the_read_or_o_proj_of_the_triton_execution(world, run, monkeypatch):
    """The rows each kernel of a mixed decode pass covers: Q, the read and o_proj the RUN rows alone, at their
    own positions and requests; the MLP the RUN rows, the adapter the Project-Only rows. K/V goes through the K/V
    rows of qkv_proj for every row; no module of SGLang's attention or MLP runs its own forward."""
    seen = _watch_kernels(world, monkeypatch)
    run_t = torch.tensor(run)
    w = torch.where(run_t, torch.ones(4), torch.full((4,), 0.5))
    reqs = [2, 0, 3, 1]  # batch row i decodes request reqs[i], at its length
    positions = [world.lengths[r] for r in reqs]
    _pass(world, dict.fromkeys(reqs, 1), world.hidden(4), run_t, w,
          served.cohort_execution([world.layer], torch.device("cpu"), "triton"))
    run_rows = [i for i, r in enumerate(run) if r]
    proj_rows = [i for i, r in enumerate(run) if not r]
    read = ([world.request_slot(reqs[i]) for i in run_rows], [positions[i] for i in run_rows])
    assert seen == {"kv": 4, "q": run_rows, "read": read, "o_proj": run_rows, "mlp": run_rows, "proj": proj_rows}


# Prefill routes over two requests extending their prompts (three and two new tokens): both cohorts, all RUN, all
# Project-Only, and a request whose tokens all project beside one whose tokens all RUN.
PREFILL_EXTEND = {1: 3, 3: 2}
PREFILL_RUNS = [[True, False, True, False, True], [True] * 5, [False] * 5, [False, False, False, True, True]]


def _triton(world: LayerWorld, prefill_read: str = "packed") -> served.CohortExecution:
    return replace(served.cohort_execution([world.layer], torch.device("cpu"), "triton"), prefill_read=prefill_read)


def test_a_triton_prefill_layer_with_the_packed_read_launches_no_gather_or_scatter_of_queries(world):
    """A routed prefill layer with the packed prefill read launches what a decode layer launches (the read's one
    kernel in place of the split and merge, writing its slots' zeros itself): Q stored in the RUN tokens' batch
    rows, rotated beside every token's key, and gathered by the read with each slot's request and position. No
    placing of packed queries in batch slots, no gathers of queries, requests or positions, no zero fill."""
    launches = _own_launches(world, _triton(world, "packed"), PREFILL_EXTEND, PREFILL_RUNS[0])
    assert launches == [
        "cohort_maps_kernel", "cohort_gemm_kernel", "packed_prefill_kernel", "cohort_down_scatter_kernel",
        "grouped_gate_up_kernel", "grouped_down_scatter_kernel", "add_"]


def test_a_triton_prefill_layer_reading_through_sglangs_backend_places_its_queries_once(world):
    """A routed prefill layer whose table reads through SGLang's attention backend: the Q GEMM stores each RUN
    token's query in its batch row, as for the packed read, into storage zero-filled first (a Project-Only token
    enters the backend's read with a zero query). RoPE rotates them beside every token's key, the backend reads
    every batch row, and o_proj reads the RUN tokens' outputs from their batch rows in its operand load. No
    placing of packed queries in batch slots, no select of queries, no gather of outputs."""
    launches = _own_launches(world, _triton(world, "backend"), PREFILL_EXTEND, PREFILL_RUNS[0])
    assert launches == [
        "cohort_maps_kernel", "zeros", "cohort_gemm_kernel", "cohort_down_scatter_kernel", "grouped_gate_up_kernel",
        "grouped_down_scatter_kernel", "add_"]


@pytest.mark.parametrize("prefill_read", ["packed", "backend"])
@pytest.mark.parametrize("run", PREFILL_RUNS)
def test_the_triton_execution_of_a_prefill_pass_equals_the_torch_execution(world, run, prefill_read, monkeypatch):
    """Outputs and the KV written against the torch execution (its per-request read), whatever the route; the
    pass ran the cohort GEMMs (the MLP and the projector, one pair of launches) and read once, over the packed
    slots (`packed_prefill_attention`) or through SGLang's attention backend, never the masked decode read."""
    calls = {"cohort_ffn_pair": 0, "packed": 0, "extend": 0, "masked_read": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(kernels, "cohort_ffn_pair", counted("cohort_ffn_pair", kernels.cohort_ffn_pair))
    monkeypatch.setattr(world.backend, "forward_extend", counted("extend", world.backend.forward_extend))
    monkeypatch.setattr(kernels, "packed_prefill_attention", counted("packed", kernels.packed_prefill_attention))
    monkeypatch.setattr(kernels, "masked_decode_attention", counted("masked_read", kernels.masked_decode_attention))
    x = world.hidden(len(run))
    run_t, w = world.route(run)
    triton = _triton(world, prefill_read)
    assert triton.prefill == "triton"
    y_triton, kv_triton = _pass(world, PREFILL_EXTEND, x, run_t, w, triton)
    assert calls == {"cohort_ffn_pair": 1, "packed": prefill_read == "packed",
                     "extend": prefill_read == "backend", "masked_read": 0}
    y_torch, kv_torch = _pass(world, PREFILL_EXTEND, x, run_t, w, served.TORCH_EXECUTION)
    torch.testing.assert_close(y_triton, y_torch, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_triton, kv_torch, rtol=1e-4, atol=1e-4)


# Q's form: in its batch rows (`cohort_gemm(batch_rows=True)`), whichever read
GATHERED_FORMS = ("batch_rows_gemm", "gathered_gate_up", "gathered_down", "gathered_scatter_add")


@pytest.mark.parametrize(("extend", "run", "prefill_read"),
                         [({0: 1, 1: 1, 2: 1, 3: 1}, [True, False, True, False], "packed"),
                          (PREFILL_EXTEND, PREFILL_RUNS[0], "packed"),
                          (PREFILL_EXTEND, PREFILL_RUNS[0], "backend")],
                         ids=["decode", "prefill-packed", "prefill-backend"])
def test_a_triton_pass_whose_table_gathers_every_gemm_equals_the_torch_execution(world, extend, run, prefill_read,
                                                                                 monkeypatch):
    """The served layer's GEMMs in the gathered cuBLAS form, as a table that measured cuBLAS faster on a catalogued
    GPU serves them: SGLang's own weight views (qkv_proj's Q rows, gate_up_proj's halves, o_proj, down_proj, the
    adapter's) feed the four forms (Q's in its batch rows, whichever read: through SGLang's prefill backend the
    Project-Only rows' own queries, whose outputs o_proj does not read; o_proj's operand gathered from the read's
    batch rows there; the MLP's gate and up in one GEMM), the pass equals the
    torch execution, and the attestation lists the slot counts each operation serves gathered (up to the H200's
    ridge, 206 rows)."""
    from mixed_world import gathering_table

    from vskipper.mixed import gathered

    calls, merges = [], []
    for name in {*GATHERED_FORMS, "gathered_gemm"}:
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    monkeypatch.setattr(gathered, "merged_rows", lambda *a, real=gathered.merged_rows: merges.append(real(*a))
                        or merges[-1])
    x = world.hidden(len(run))
    run_t, w = world.route(run)
    execution = served.CohortExecution("triton", gathering_table(), prefill_read=prefill_read)
    y_gathered, kv_gathered = _pass(world, extend, x, run_t, w, execution)
    assert set(calls) == set(GATHERED_FORMS)
    # The MLP's gate and up (gate_up_proj's halves) in one GEMM; the adapter's, weights of their own, in two.
    assert [m is not None for m in merges] == [True, False]
    y_torch, kv_torch = _pass(world, extend, x, run_t, w, served.TORCH_EXECUTION)
    torch.testing.assert_close(y_gathered, y_torch, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_gathered, kv_torch, rtol=1e-4, atol=1e-4)
    ranges = [[1, 16], [17, 32], [33, 64], [65, 128], [129, 206]]
    assert execution.attestation()["gathered"] == {op: ranges for op in OPERATIONS}
    assert execution.attestation()["ffn_apart"] == []  # the table timed no FFN pair: grouped where not gathered
    assert any(line.startswith("FFN pair timings") for line in execution.attestation()["tiles_lack"])  # it says so


@pytest.mark.parametrize("prefill_read", ["packed", "backend"])
@pytest.mark.parametrize("run", PREFILL_RUNS[:1] + PREFILL_RUNS[3:])
def test_project_only_tokens_of_a_triton_prefill_compute_only_their_kv_and_the_adapter(world, run, prefill_read,
                                                                                       monkeypatch):
    """The rows each kernel of a mixed prefill pass covers: K/V every token (the K/V rows of qkv_proj), Q, o_proj
    and the MLP the RUN tokens alone, the adapter the Project-Only tokens. The packed read reads the RUN tokens'
    slots alone, at their own requests and positions; SGLang's backend reads a query for every token, non-zero for
    the RUN tokens only (a Project-Only token's slot holds zeros). No module of SGLang's attention or MLP runs its
    own forward."""
    seen = _watch_kernels(world, monkeypatch)
    run_t, w = world.route(run)
    lengths = list(world.lengths)
    _pass(world, PREFILL_EXTEND, world.hidden(len(run)), run_t, w, _triton(world, prefill_read))
    run_rows = [i for i, r in enumerate(run) if r]
    proj_rows = [i for i, r in enumerate(run) if not r]
    tokens = [(r, lengths[r] + i) for r, n in PREFILL_EXTEND.items() for i in range(n)]  # (request, position)
    read = {"read": ([world.request_slot(tokens[i][0]) for i in run_rows], [tokens[i][1] for i in run_rows])} \
        if prefill_read == "packed" else {"queries": run_rows}
    assert seen == {"kv": len(run), "q": run_rows, "o_proj": run_rows, "mlp": run_rows, "proj": proj_rows, **read}


# (phase, new tokens per request, each row's request key)
WAIT_PASSES = [("prefill", PREFILL_EXTEND, [7, 7, 7, 9, 9]), ("decode", {0: 1, 1: 1, 2: 1, 3: 1}, [3, 5, 7, 9])]


@pytest.mark.parametrize("execution", ["triton", "gathered", "torch"])
@pytest.mark.parametrize(("phase", "extend", "keys"), WAIT_PASSES, ids=[p[0] for p in WAIT_PASSES])
def test_a_routed_pass_of_the_triton_execution_makes_the_host_wait_for_no_device_value(world, execution, phase,
                                                                                       extend, keys):
    """The sync-free routed pass, prefill and decode: RandomSkip routes it (its per-pass state included, in the
    one launch the runtime takes for the triton execution), the tape records it, the cohorts are packed, and the
    layer runs, with no operator that would make the host wait for the device (a scalar read, an output shaped by
    device values, a tensor literal copied from the host) outside SGLang's attention backend, which a dense pass
    calls alike. The torch execution packs its cohorts with
    `nonzero`, which the detector sees: it would see a wait in the triton execution too. 'gathered' is the triton
    execution with every GEMM in the gathered cuBLAS form (a table that measured cuBLAS faster). The triton
    execution's maps leave the layer's counts on the tape, where the pass is counted from."""
    from mixed_world import gathering_table

    from vskipper.mixed.cohorts import CohortBuilder
    from vskipper.mixed.host_waits import HostWaitDetector
    from vskipper.mixed.routes import fused_state
    from vskipper.mixed.tape import RouteTape
    from vskipper.sglang.models.routed import plan_pass
    from vskipper.sglang.runtime import Step
    from vskipper.skippers.base import BatchContext
    from vskipper.skippers.random_skip import RandomSkip

    rows, lid = sum(extend.values()), world.layer.layer_id
    kv0, lengths0 = world.kv(), list(world.lengths)
    fb = world.batch(extend)
    x = world.hidden(rows)
    skipper = RandomSkip(r=1.0, d=0.5, seed=5)
    keys = torch.tensor(keys)
    step = Step(phase, True, skipper, None, RouteTape(rows, (lid,)), CohortBuilder(rows), None, rows, keys=keys)
    world.slot.step, world.slot.plan = step, plan_pass(fb, rows)
    world.slot.execution = (served.CohortExecution("triton", gathering_table(), prefill_read="packed")
                            if execution == "gathered" else
                            served.cohort_execution([world.layer], torch.device("cpu"), execution))
    detector = HostWaitDetector()
    for name in ("forward_extend", "forward_decode"):
        setattr(world.backend, name, detector.exempt(getattr(world.backend, name)))
    try:
        with world.context(), torch.no_grad(), detector:
            # the state as the runtime prepares it for each execution (`Runtime.prepare_state`): the triton
            # execution's in one launch; the torch execution's on CPU by numpy, whose tensors torch lifts
            batch = BatchContext(x, torch.ones(rows, dtype=torch.bool), (lid,), phase, keys, fb.positions)
            step.state = skipper.prepare_batch(batch) if execution == "torch" else fused_state(skipper, batch)
            world.layer.mixed_depth(step, fb.positions, x, fb)
    finally:
        del world.backend.forward_extend, world.backend.forward_decode
        world.slot.step = world.slot.plan = None
        world.slot.execution = served.TORCH_EXECUTION
        world.restore(kv0, lengths0)
    run = step.tape.run[0, :rows]
    assert run.any() and (~run).any(), "the route should hold both cohorts"
    if execution != "torch":
        assert detector.waits == []
        # the maps' launch left the layer's counts on the tape: the pass is counted from them, no launch
        assert step.tape.counts[0].tolist() == [int(run.sum()), rows - int(run.sum())]
    else:
        assert "aten.nonzero.default" in detector.waits


def test_the_execution_is_torch_on_cpu_and_triton_needs_one_rank_and_plain_mlp_weights(world, monkeypatch):
    cpu = torch.device("cpu")
    # auto: triton only on CUDA; on CPU the torch execution's decode read is per row, its prefill read by size
    assert served.cohort_execution([world.layer], cpu) == served.CohortExecution("torch", decode_read="backend",
                                                                                 prefill_read="sized")
    assert served.cohort_execution([world.layer], cpu).attestation() == {
        "decode": "torch", "decode_read": "backend", "prefill": "torch", "prefill_read": "sized", "tiles": None}
    assert served.cohort_execution([world.layer], torch.device("cuda"), "torch").decode_read == "masked"
    with pytest.raises(ValueError, match="decode_read must be one of"):
        served.CohortExecution("torch", decode_read="padded")
    assert served.cohort_execution([world.layer], cpu, "triton").attestation() == {
        "decode": "triton", "prefill": "triton", "prefill_read": "packed", "tiles": "interpreter tile"}
    for read in ("rows", "sized"):
        with pytest.raises(ValueError, match="the triton execution prefills with prefill_read 'packed' or 'backend'"):
            served.CohortExecution("triton", prefill_read=read)
    # On a GPU the attestation names the device table and the packed read's launch, and whether it was measured.
    table = tile_table_for("H100-SXM")
    assert served.CohortExecution("triton", table, prefill_read="packed").attestation()["prefill_read_tile"] == {
        "block_rows": 64, "block_n": 64, "num_warps": 4, "num_stages": 2, "measured": False}
    table.read = ReadTile(128, 32, 8, 3)
    assert served.CohortExecution("triton", table, prefill_read="packed").attestation()["prefill_read_tile"] == {
        "block_rows": 128, "block_n": 32, "num_warps": 8, "num_stages": 3, "measured": True}
    # On CUDA prefill reads through SGLang's attention backend, whichever execution decodes.
    assert served.cohort_execution([world.layer], torch.device("cuda"), "torch").prefill_read == "backend"
    # The triton execution on CUDA reads packed, unless the device's table measured that no faster than the read
    # replacing it (the H200's, against SDPA: it has no time of the server's backend), and says what it weighed;
    # a table that never timed the read says nothing. (No GPU here: the device's table is handed in.)
    for product, read in (("NVIDIA H200", "backend"), ("NVIDIA H100 80GB HBM3", "packed")):
        monkeypatch.setattr(kernels, "device_tile_table", lambda device, path=None, p=product: tile_table_for(p))
        on_gpu = served.cohort_execution([world.layer], torch.device("cuda"), "triton", attention_backend="triton")
        assert (on_gpu.decode, on_gpu.prefill_read) == ("triton", read)
        assert ("prefill_read_why" in on_gpu.attestation()) == (read == "backend")
    monkeypatch.setattr(kernels, "device_tile_table", lambda device, path=None: tile_table_for("NVIDIA H200"))
    assert served.cohort_execution([world.layer], torch.device("cuda"), "triton", attention_backend="triton"
                                   ).attestation()["prefill_read_why"] == (
        "the table measured the packed read of half a prompt's rows at 0.13791 ms, every row's causal read by SDPA "
        "(the triton backend's own read not timed) at 0.08535 ms")
    # a table that timed the server's backend weighs the packed read against it
    timed = tile_table_for("NVIDIA H200")
    timed.read_timing = ReadTiming(0.138, 0.085, 0.29, "triton")
    monkeypatch.setattr(kernels, "device_tile_table", lambda device, path=None: timed)
    on_triton = served.cohort_execution([world.layer], torch.device("cuda"), "triton", attention_backend="triton")
    assert on_triton.prefill_read == "packed" and "by the triton attention backend at 0.29 ms" in \
        on_triton.attestation()["prefill_read_why"]
    assert served.cohort_execution([world.layer], torch.device("cuda"), "triton").prefill_read == "backend"
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
        "skipped: the RUN cohort's count-bounded Q GEMM"
    # set and put back by hand: pytest's monkeypatch restores what the instance's own dict held, and a parameter
    # lives in the module's parameter table, so its undo would delete the registered (None) bias
    attn.o_proj.bias = torch.nn.Parameter(torch.zeros(attn.o_proj.weight.shape[0]))
    try:
        assert served.cohort_execution([world.layer], cpu, "triton").reason == \
            "layer 2: self_attn.o_proj has a bias (the scattered o_proj adds none)"
    finally:
        attn.o_proj.bias = None
    assert "bias" in attn.o_proj._parameters and attn.o_proj.bias is None
    monkeypatch.setattr(attn.o_proj, "quant_method", object())
    assert served.cohort_execution([world.layer], cpu, "triton").reason == \
        "layer 2: self_attn.o_proj is quantized or packed"
    monkeypatch.undo()
    monkeypatch.setattr(attn.o_proj, "tp_size", 2, raising=False)
    assert served.cohort_execution([world.layer], cpu, "triton").reason == \
        "layer 2: the attention is split over 2 tensor-parallel ranks"


def test_the_serve_spec_carries_the_execution_asked_for_and_refuses_another_naming_the_variable():
    from vskipper.arms import get_arm
    from vskipper.sglang.spec import ENV_EXECUTION, ServeConfigError, ServeSpec

    env = ServeSpec(get_arm("always-route"), 0, 0, execution="triton").to_env()
    assert env[ENV_EXECUTION] == "triton" and ServeSpec.from_env(env).execution == "triton"
    assert ENV_EXECUTION not in ServeSpec(get_arm("always-route"), 0, 0).to_env()
    assert ServeSpec.from_env(ServeSpec(get_arm("always-route"), 0, 0).to_env()).execution == "auto"
    with pytest.raises(ServeConfigError, match="VSKIPPER_COHORT_EXECUTION must be one of auto, torch, triton, got 'cuda'"):
        ServeSpec.from_env({**env, ENV_EXECUTION: "cuda"})


def test_the_weight_views_a_routed_layer_takes_each_pass_follow_its_weights_to_new_storage(world):
    """The Q, K/V, o_proj and MLP weight views are made once per module and reused every pass while the weights
    stay where they are (a reload in place shows through the views), and made anew from a reload into new storage
    (`kept`)."""
    layer, a = world.layer, world.layer.self_attn
    gate, up, down = served.mlp_weights(layer)
    w_q, _, w_o = served.attention_weights(layer)
    assert served.mlp_weights(layer)[0] is gate and served.attention_weights(layer)[0] is w_q
    u = torch.randn(3, a.qkv_proj.weight.shape[1], dtype=a.qkv_proj.weight.dtype)
    kv_rows = slice(a.q_size, None)
    params = (layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight, a.qkv_proj.weight, a.o_proj.weight)
    originals = [p.data for p in params]
    try:
        for p in params:
            p.data = p.data.clone() + 0.5  # new storage, new values
        gate2, up2, down2 = served.mlp_weights(layer)
        w_q2, _, w_o2 = served.attention_weights(layer)
        assert gate2.data_ptr() == params[0].data_ptr() and down2.data_ptr() == params[1].data_ptr()
        torch.testing.assert_close(torch.cat([gate2, up2]), params[0])
        torch.testing.assert_close(w_q2, params[2][: a.q_size])
        assert w_o2.data_ptr() == params[3].data_ptr()
        expected = u @ params[2][kv_rows].t() + (0 if a.qkv_proj.bias is None else a.qkv_proj.bias[kv_rows])
        torch.testing.assert_close(served.row_projection(a.qkv_proj, kv_rows, u), expected)
        with torch.no_grad():
            params[2].add_(1.0)  # in place: the views made from this storage see it
        torch.testing.assert_close(served.attention_weights(layer)[0], params[2][: a.q_size])
        torch.testing.assert_close(served.row_projection(a.qkv_proj, kv_rows, u),
                                   expected + u @ torch.ones_like(params[2][kv_rows]).t())
    finally:
        for p, data in zip(params, originals, strict=True):
            p.data = data
    assert served.mlp_weights(layer)[2].data_ptr() == originals[1].data_ptr()


def test_a_routed_layers_parts_are_kept_without_a_module_lookup_and_follow_a_module_or_parameter_set_anew(
        world, monkeypatch):
    """A routed layer's modules and weight views (`layer_parts`) are looked up once: a later pass finds them
    kept with no call of nn.Module's `__getattr__` (about a microsecond each on the host, some thirty a routed layer
    a pass before), and a submodule or a parameter set anew on the layer, or a module added where none was (a
    Llama layer's q_norm), is found at the next pass."""
    layer = world.layer
    parts = served.layer_parts(layer)
    assert served.layer_parts(layer) is parts and parts.projector is layer.router_proj
    calls = []
    real = torch.nn.Module.__getattr__

    def counted(self, name):
        calls.append(name)
        return real(self, name)

    monkeypatch.setattr(torch.nn.Module, "__getattr__", counted)
    assert served.layer_parts(layer) is parts
    assert calls == []
    monkeypatch.setattr(torch.nn.Module, "__getattr__", real)
    a = layer.self_attn
    norm, o_weight, had_q_norm = layer.post_attention_layernorm, a.o_proj.weight, "q_norm" in a._modules
    try:
        layer.post_attention_layernorm = torch.nn.Identity()
        assert served.layer_parts(layer).post_attention_layernorm is layer.post_attention_layernorm
        a.o_proj.weight = torch.nn.Parameter(o_weight.detach().clone(), requires_grad=False)
        assert served.attention_weights(layer)[2] is a.o_proj.weight
        if not had_q_norm:
            a.q_norm = torch.nn.Identity()
            assert served.layer_parts(layer).q_norm is a.q_norm
    finally:
        layer.post_attention_layernorm, a.o_proj.weight = norm, o_weight
        if not had_q_norm and "q_norm" in a._modules:
            del a.q_norm
    parts = served.layer_parts(layer)
    assert parts.post_attention_layernorm is norm and parts.attention[2] is o_weight
    assert (parts.q_norm is None) == (not had_q_norm)


def test_a_part_that_is_no_submodule_parameter_or_instance_attribute_is_refused_by_name():
    """What cannot be checked with a dict lookup (a property, a class attribute) is never kept silently."""

    class Owner(torch.nn.Module):
        @property
        def derived(self):
            return 1

    with pytest.raises(TypeError, match="Owner.derived is no submodule, parameter or instance attribute"):
        served.kept(Owner(), "k", ("derived",), lambda derived: derived)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_a_routed_layers_pass_looks_up_module_attributes_less_often_than_the_dense_layer(world, phase, monkeypatch):
    """nn.Module's `__getattr__` costs the host about a microsecond a call. Once its parts are kept
    (`layer_parts`), a routed pass of the triton execution (half its rows Project-Only) calls it less often than the
    dense layer's forward over the same batch does: what is left are SGLang's own modules' lookups, which the
    dense layer makes too (its norms' weights, the rotary embedding's caches). Before the parts were kept the
    routed body looked up some thirty attributes of its own a pass, more than the dense layer's whole forward."""
    extend = {0: 1, 1: 1, 2: 1, 3: 1} if phase == "decode" else {0: 3, 2: 2}
    rows = sum(extend.values())
    x, (run, w) = world.hidden(rows), world.route([i % 2 == 0 for i in range(rows)])
    calls: dict[str, int] = {}
    real = torch.nn.Module.__getattr__

    def counted(self, name):
        calls[watching] = calls.get(watching, 0) + 1
        return real(self, name)

    triton = served.cohort_execution([world.layer], torch.device("cpu"), "triton")
    kv0, lengths0 = world.kv(), list(world.lengths)
    world.slot.execution = triton
    try:
        world.routed(world.batch(extend), x.clone(), run, w)  # the parts looked up once
        world.restore(kv0, lengths0)
        fbs = {"routed": world.batch(extend)}
        world.restore(kv0, lengths0)
        fbs["dense"] = world.batch(extend)
        monkeypatch.setattr(torch.nn.Module, "__getattr__", counted)
        watching = "routed"
        world.routed(fbs["routed"], x.clone(), run, w)
        watching = "dense"
        world.dense(fbs["dense"], x.clone())
        monkeypatch.setattr(torch.nn.Module, "__getattr__", real)
    finally:
        world.slot.execution = served.TORCH_EXECUTION
        world.restore(kv0, lengths0)
    assert 0 < calls.get("routed", 0) < calls["dense"], calls
