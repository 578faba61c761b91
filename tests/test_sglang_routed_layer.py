"""The served routed layer in this process (`tests/sglang_layer_world.py`): SGLang's own Llama and Qwen3 decoder
layers, KV pool and torch-native attention backend, with vSkipper's routed body. What each cohort computes, what
each sub-module sees, and that a routed decode pass reads no tensor value on the host."""

from __future__ import annotations

import pytest
import torch
from mixed_world import HostReadDetector, ScalarReadDetector
from sglang_layer_world import ARCHS, LayerWorld

from vskipper.sglang.models import routed as served
from vskipper.sglang.models.routed import in_batch_slots


@pytest.fixture(scope="module", params=ARCHS)
def world(request, tmp_path_factory):
    return LayerWorld.prefilled(request.param, tmp_path_factory.mktemp("layer"), 3, {0: 5, 1: 3, 2: 7, 3: 4})


def _routed_and_dense(world: LayerWorld, extend: dict[int, int], run: list[bool]):
    """The same pass twice from the same KV state: routed with `run`, then dense. Returns the outputs, the KV
    at this layer after each, the input and the route."""
    kv0, lengths0 = world.kv(), list(world.lengths)
    fb = world.batch(extend)
    x = world.hidden(fb.positions.shape[0])
    run_t, w = world.route(run)
    y = world.routed(fb, x, run_t, w)
    kv_routed = world.kv()
    world.restore(kv0, lengths0)
    y_dense = world.dense(world.batch(extend), x)
    kv_dense = world.kv()
    world.restore(kv0, lengths0)
    return y, y_dense, kv_routed, kv_dense, x, run_t, w


def _count_qkv_rows(layer, seen: dict[str, int], monkeypatch) -> None:
    """Rows that enter the fused qkv_proj's linear method, by the weight rows they meet: 'q' (its Q rows), 'kv'
    (its K/V rows), 'qkv' (the whole projection, upstream's forward)."""
    attn = layer.self_attn
    method = attn.qkv_proj.quant_method
    assert method is not attn.o_proj.quant_method  # o_proj's calls are not counted here
    weight = attn.qkv_proj.weight
    kv_start = weight[attn.q_size:].data_ptr()
    parts = {(weight.data_ptr(), attn.q_size): "q", (kv_start, 2 * attn.kv_size): "kv",
             (weight.data_ptr(), weight.shape[0]): "qkv"}
    apply = method.apply

    def counted(module, x, bias=None):
        name = parts[module.weight.data_ptr(), module.weight.shape[0]]
        seen[name] = seen.get(name, 0) + x.shape[0]
        return apply(module, x, bias)

    monkeypatch.setattr(method, "apply", counted)


def _adapter(world: LayerWorld, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    layer = world.layer
    with torch.no_grad():
        return x + w.view(-1, 1) * layer.router_proj(layer.post_attention_layernorm(x))


# (phase, the torch execution's decode read): prefill reads per request whatever the decode read
PHASE_READS = [("decode", "masked"), ("decode", "backend"), ("prefill", "masked")]


@pytest.mark.parametrize(("phase", "decode_read"), PHASE_READS)
def test_run_rows_equal_the_dense_layer_and_project_only_rows_take_the_adapter_with_their_kv_written(
        world, phase, decode_read, monkeypatch):
    """RUN rows compute what SGLang's dense layer computes, attending to every token's K/V, Project-Only tokens'
    of this very pass included (prefill); Project-Only rows get x + w * Proj(LN2 x); every row's K/V in the pool
    equals the dense layer's (Invariant 1). Both decode reads (`DECODE_READS`)."""
    monkeypatch.setattr(world.slot, "execution", served.CohortExecution("torch", decode_read=decode_read))
    if phase == "decode":
        extend, run = {0: 1, 1: 1, 2: 1, 3: 1}, [True, False, True, False]
    else:  # two requests extend their prompts with new tokens, Project-Only tokens before RUN ones
        extend, run = {1: 4, 3: 3}, [False, True, False, True, True, False, True]
    y, y_dense, kv_routed, kv_dense, x, run_t, w = _routed_and_dense(world, extend, run)
    torch.testing.assert_close(y[run_t], y_dense[run_t], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y[~run_t], _adapter(world, x[~run_t], w[~run_t]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_routed, kv_dense, rtol=1e-4, atol=1e-4)


def test_a_prefill_read_through_sglangs_backend_gives_the_same_layer_and_skips_q_o_proj_and_the_mlp(world,
                                                                                                   monkeypatch):
    """The prefill read of the CUDA execution (`PREFILL_READS['backend']`) on SGLang's torch-native backend: RUN
    rows equal the dense layer, Project-Only rows the adapter, the KV the dense layer's; the backend is called once
    over every row (Project-Only rows with a zero query), while Q, o_proj and the MLP see the RUN rows only and
    K/V every row."""
    layer = world.layer
    seen: dict[str, int] = {}
    queries: list[torch.Tensor] = []
    modules = {"o_proj": layer.self_attn.o_proj, "gate_up_proj": layer.mlp.gate_up_proj}
    _count_qkv_rows(layer, seen, monkeypatch)

    def count(name):
        def hook(module, args):
            seen[name] = seen.get(name, 0) + args[0].shape[0]
        return hook

    extend_fn = world.backend.forward_extend

    def extend(q, *args, **kwargs):
        queries.append(q.clone())
        seen["backend"] = seen.get("backend", 0) + q.shape[0]
        return extend_fn(q, *args, **kwargs)

    monkeypatch.setattr(world.backend, "forward_extend", extend)
    monkeypatch.setattr(world.slot, "execution", served.CohortExecution("torch", prefill_read="backend"))
    placed = []  # the RUN rows' queries placed in batch slots: once, for RoPE, and the read takes them there
    monkeypatch.setattr(served, "in_batch_slots", lambda *a, **k: placed.append(1) or in_batch_slots(*a, **k))
    run = [False, True, False, True, True, False, True]
    handles = [m.register_forward_pre_hook(count(name)) for name, m in modules.items()]
    try:
        y, y_dense, kv_routed, kv_dense, x, run_t, w = _routed_and_dense(world, {1: 4, 3: 3}, run)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(y[run_t], y_dense[run_t], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y[~run_t], _adapter(world, x[~run_t], w[~run_t]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_routed, kv_dense, rtol=1e-4, atol=1e-4)
    n_run = sum(run)
    # The dense pass that follows the routed one adds its len(run) rows to each module and to the backend.
    assert seen == {"q": n_run, "kv": len(run), "qkv": len(run), "o_proj": n_run + len(run),
                    "gate_up_proj": n_run + len(run), "backend": 2 * len(run)}
    routed_q = queries[0].view(len(run), -1)
    assert (routed_q[~run_t] == 0).all() and (routed_q[run_t] != 0).any()
    assert len(placed) == 1


def test_a_backend_read_takes_packed_queries_in_any_row_order_and_q_kvs_own_with_a_reads_mask(world):
    """`LayerOps.read` through SGLang's backend: a packed q is placed in its batch slots whatever the order of its
    rows, even when they are every row of the pass; the queries `q_kv` handed over in batch slots are read as they
    are, with a `reads` mask too (its slots outside read zeros). Each equals the RUN rows' own read."""
    kv0, lengths0 = world.kv(), list(world.lengths)
    fb = world.batch({1: 4, 3: 3})
    n = fb.positions.shape[0]
    layer = world.layer
    try:
        with world.context(), torch.no_grad():
            u = layer.input_layernorm(world.hidden(n))

            def ops(read):
                return served.SGLangLayerOps(layer, fb.positions, fb, served.plan_pass(fb, n), prefill_read=read)

            every, reverse = torch.arange(n), torch.arange(n - 1, -1, -1)
            backend, rows = ops("backend"), ops("rows")
            q, k, v = backend.q_kv(u, every)  # in batch slots
            backend.write_kv(k, v)
            expected = rows.read(q, every)
            torch.testing.assert_close(backend.read(q, every), expected)
            torch.testing.assert_close(backend.read(q.index_select(0, reverse), reverse), expected[reverse])
            some = torch.tensor([1, 3, 4, 6])
            q, _, _ = backend.q_kv(u, some)
            reads = torch.tensor([True, False, True, True])
            out = backend.read(q, some, reads)
            torch.testing.assert_close(out[reads], expected[some][reads])
            assert (out[~reads] == 0).all()
    finally:
        world.restore(kv0, lengths0)


@pytest.mark.parametrize(("extend", "threshold", "through"), [
    ({1: 6}, served.SIZED_READ_MACS, "backend"),  # one short prompt (its prefix of 3 included)
    ({1: 6}, 1, "rows"),  # one prompt whose read is over the threshold
    ({1: 4, 3: 3}, served.SIZED_READ_MACS, "rows"),  # two prompts: the RUN rows' batched read
])
def test_the_sized_prefill_read_reads_a_short_prompt_through_sglangs_backend_and_every_other_pass_by_its_rows(
        world, extend, threshold, through, monkeypatch):
    """`PREFILL_READS['sized']` (the torch execution's on CPU): a pass of one request whose causal read over its
    whole sequence is below `SIZED_READ_MACS` reads through SGLang's backend, once over every row; one over it,
    and a pass of several requests, read the RUN rows alone (`prefill_attention`). Either way the layer computes
    what the dense layer computes."""
    reads: dict[str, int] = {}

    def counted(read, name):
        def wrapper(q, *args, **kwargs):
            reads[name] = reads.get(name, 0) + q.shape[0]
            return read(q, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(world.slot, "execution", served.CohortExecution("torch", prefill_read="sized"))
    monkeypatch.setattr(served, "SIZED_READ_MACS", threshold)
    monkeypatch.setattr(served, "prefill_attention", counted(served.prefill_attention, "rows"))
    monkeypatch.setattr(world.backend, "forward_extend", counted(world.backend.forward_extend, "backend"))
    rows = sum(extend.values())
    run = ([False, True] * rows)[:rows]
    y, y_dense, kv_routed, kv_dense, x, run_t, w = _routed_and_dense(world, extend, run)
    torch.testing.assert_close(y[run_t], y_dense[run_t], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y[~run_t], _adapter(world, x[~run_t], w[~run_t]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_routed, kv_dense, rtol=1e-4, atol=1e-4)
    # the dense pass after the routed one reads every row through the backend
    assert reads == ({"backend": 2 * rows} if through == "backend" else {"rows": sum(run), "backend": rows})


def test_a_pass_plan_holds_the_causal_pairs_of_a_one_request_prefill_alone(world):
    """`PassPlan.read_pairs`: the pairs of one request's causal read over its whole sequence, prefix included (as
    SGLang's torch-native backend computes them); 0 for several requests and for decode."""
    lengths0 = list(world.lengths)
    try:
        prefix = world.lengths[1]
        one = served.plan_pass(world.batch({1: 6}), 6)
        assert one.read_pairs == (prefix + 6) * (prefix + 7) // 2
        assert served.plan_pass(world.batch({0: 2, 2: 3}), 5).read_pairs == 0
        assert served.plan_pass(world.batch({0: 1, 1: 1}), 2).read_pairs == 0  # decode
    finally:
        world.lengths = lengths0


def test_an_all_project_only_pass_writes_every_rows_kv_and_runs_only_the_adapter(world):
    y, _, kv_routed, kv_dense, x, run_t, w = _routed_and_dense(world, {0: 1, 2: 1, 3: 1}, [False] * 3)
    torch.testing.assert_close(y, _adapter(world, x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_routed, kv_dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("phase", "decode_read"), PHASE_READS)
def test_project_only_rows_never_enter_q_the_attention_read_o_proj_or_the_mlp(world, phase, decode_read,
                                                                             monkeypatch):
    """Rows each sub-module of the served layer sees in a mixed pass: Q (the Q rows of the fused qkv_proj), the
    attention read, o_proj and the MLP see the RUN rows only; K/V (its K/V rows) every row, once; the adapter the
    Project-Only rows only. SGLang's own attention backend reads only where the decode read is its own
    (`backend`), and then the RUN rows only. The RUN rows' queries and every row's keys take one rotary call."""
    layer = world.layer
    seen: dict[str, int] = {}
    _count_qkv_rows(layer, seen, monkeypatch)
    rotary_calls = []
    rope = layer.self_attn.rotary_emb.register_forward_pre_hook(lambda module, args: rotary_calls.append(args))

    def count(name):
        def hook(module, args):
            seen[name] = seen.get(name, 0) + args[0].shape[0]
        return hook

    modules = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
               "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj,
               "adapter": layer.router_proj}  # qkv_proj's forward: never called by a mixed pass
    handles = [m.register_forward_pre_hook(count(name)) for name, m in modules.items()]

    def counted(read, name):
        def wrapper(q, *args, **kwargs):
            seen[name] = seen.get(name, 0) + q.shape[0]
            return read(q, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(world.slot, "execution", served.CohortExecution("torch", decode_read=decode_read))
    monkeypatch.setattr(served, "paged_attention", counted(served.paged_attention, "read"))
    monkeypatch.setattr(served, "prefill_attention", counted(served.prefill_attention, "read"))
    monkeypatch.setattr(world.backend, "forward_decode", counted(world.backend.forward_decode, "backend"))
    monkeypatch.setattr(world.backend, "forward_extend", counted(world.backend.forward_extend, "backend"))
    extend = {0: 1, 1: 1, 2: 1, 3: 1} if phase == "decode" else {0: 3, 2: 4}
    run = [True, False, False, True] if phase == "decode" else [False, True, True, False, False, True, False]
    kv0, lengths0 = world.kv(), list(world.lengths)
    try:
        fb = world.batch(extend)
        world.routed(fb, world.hidden(len(run)), *world.route(run))
    finally:
        for h in (*handles, rope):
            h.remove()
        world.restore(kv0, lengths0)
    n_run = sum(run)
    assert len(rotary_calls) == 1
    assert rotary_calls[0][1].shape[0] == len(run) and rotary_calls[0][2].shape[0] == len(run)
    read = "backend" if (phase, decode_read) == ("decode", "backend") else "read"
    assert seen == {"q": n_run, "kv": len(run), read: n_run, "o_proj": n_run, "gate_up_proj": n_run,
                    "down_proj": n_run, "adapter": len(run) - n_run}


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_without_a_kv_row_view_the_whole_qkv_proj_runs_once_and_run_rows_take_their_q_from_it(world, phase,
                                                                                               monkeypatch):
    """A quantized or packed qkv_proj has no view of its K/V rows (`kv_only_supported`): the mixed pass runs the
    whole projection once over every row, K/V for every row and Q kept for the RUN rows (computed and dropped for
    Project-Only ones, as attested), never a second projection; the layer computes what it computes with the
    row view."""
    seen: dict[str, int] = {}
    _count_qkv_rows(world.layer, seen, monkeypatch)
    extend = {0: 1, 1: 1, 2: 1, 3: 1} if phase == "decode" else {0: 3, 2: 4}
    run = [True, False, False, True] if phase == "decode" else [False, True, True, False, False, True, False]
    world.gen.manual_seed(0)
    y_view = _routed_and_dense(world, extend, run)[0]  # with the row view; then the same input and route without
    seen.clear()
    world.gen.manual_seed(0)
    monkeypatch.setattr(served, "kv_only_supported", lambda qkv_proj: False)
    y, y_dense, kv_routed, kv_dense, x, run_t, w = _routed_and_dense(world, extend, run)
    assert seen == {"qkv": 2 * len(run)}  # the routed pass's one projection, then the dense pass's
    torch.testing.assert_close(y[run_t], y_dense[run_t], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y[~run_t], _adapter(world, x[~run_t], w[~run_t]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_routed, kv_dense, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, y_view, rtol=1e-4, atol=1e-4)


def test_a_routed_decode_pass_of_the_served_layer_reads_no_tensor_value_on_the_host(world):
    """Cohort sizes are shapes, the context bound is planned on the host before the forward, the counters are
    read after it: the layer's forward itself reads nothing back, Python-level or inside an operator (the masked
    decode read, which the torch execution takes off CPU; on CPU it reads through SGLang's backend). The
    same detectors see the reads of SGLang's torch-native decode backend (its per-request loop over seq_lens)."""
    assert world.slot.execution.decode_read == "masked"
    kv0, lengths0 = world.kv(), list(world.lengths)
    try:
        fb = world.batch({0: 1, 1: 1, 2: 1, 3: 1})
        x = world.hidden(4)
        detectors = (HostReadDetector(), ScalarReadDetector())
        world.routed(fb, x, *world.route([False, True, True, False]), watch=_both(*detectors))
        assert [d.reads for d in detectors] == [[], []]
        world.restore(kv0, lengths0)
        fb = world.batch({0: 1, 1: 1, 2: 1, 3: 1})
        dense_reads = (HostReadDetector(), ScalarReadDetector())
        with _both(*dense_reads), world.context(), torch.no_grad():
            world.layer.self_attn(positions=fb.positions, hidden_states=x, forward_batch=fb)
        assert dense_reads[1].reads  # its slices by seq_lens[i] read each length inside the operator
    finally:
        world.restore(kv0, lengths0)


class _both:
    def __init__(self, *modes):
        self.modes = modes

    def __enter__(self):
        for m in self.modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self.modes):
            m.__exit__(*exc)


def test_a_routed_prefill_refuses_sglangs_prefill_graphs_naming_the_flag_and_decode_graphs_are_kept():
    """A replayed graph skips the model's Python forward: a routed phase may replay only graphs that hold a routed
    variant. Decode graphs do (the model's `SkipperGraphVariants`); prefill graphs do not, so an arm that routes
    prefill must run it eagerly."""
    from vskipper.arms import get_arm

    with pytest.raises(served.ServeConfigError, match="routes prefill.*--cuda-graph-backend-prefill tc_piecewise.*"
                                                      "--cuda-graph-backend-prefill disabled"):
        served.refuse_graph_replay(get_arm("always-route"), {"decode": "full", "prefill": "tc_piecewise"})
    served.refuse_graph_replay(get_arm("decode-only"), {"decode": "full", "prefill": "tc_piecewise"})
    served.refuse_graph_replay(get_arm("always-route"), {"decode": "full", "prefill": "disabled"})
    served.refuse_graph_replay(get_arm("dense"), {"decode": "full", "prefill": "full"})
    assert served.graph_backends() == {"decode": "disabled", "prefill": "disabled"}  # nothing published here
