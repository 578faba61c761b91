"""A served model's routed decode graph, replayed through the model's own hooks as SGLang's decode graph runner
drives them (`SkipperCausalLM`: `decode_graph_variants` before the capture, `forward` under the routed variant
for the capture batch (`capture_pass`), then for each later batch the hook around `ModelRunner.forward`:
`prepare_pass` (the runtime's decision, its plan written into the graph's static buffers), the replay of the
batch padded to the graph's size, `finish_pass` of a replayed pass). The real model class with SGLang's KV pool,
request-to-token pool and torch-native backend (`benchmarks/host_time_bench.ServedModel`), the triton execution
under the Triton interpreter.

No CUDA graph is captured on CPU, and a CPU model has no routed variant to capture (`routed_graph_blocker`): the
test lifts the blocker and stands in for the graph by running the captured function again at each replay, over
the padded batch's tensors, as a replay reads whatever its static storage holds. What a CUDA graph alone can get
wrong (a captured address that moves) only the device shows (`benchmarks/gpu/check_served.py` replays a graph of
the routed layer there)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

pytest.importorskip("sglang")

from benchmarks.host_time_bench import ARMS, CONTEXT, ServedModel, Shape, same_kv  # noqa: E402
from vskipper.checkpoint import TinySize, make_tiny_model  # noqa: E402

ROWS, GRAPH = 3, 4  # a batch of 3 replays the graph captured for 4 (SGLang's next capture size)
REQUESTS = 8
SEED = 1  # the token ids the FlexiDepth tests draw


def arm(name: str):
    """The host benchmark's arms (dense, s = 0, s = 0.5: RandomSkip) or a catalogued one (always-route:
    FlexiDepth's gate, the checkpoint's routers)."""
    from vskipper.arms import get_arm

    return ARMS[name] if name in ARMS else get_arm(name)


@pytest.fixture
def models(tmp_path, monkeypatch):
    """Two models of the s = 0.5 arm from one checkpoint, the triton execution, the same KV pool contents: the
    first replays, the second runs the same batches eagerly."""
    return served_pair(tmp_path, monkeypatch, "s=0.5")


def served_pair(tmp_path, monkeypatch, arm_name: str) -> list[ServedModel]:
    from vskipper.sglang import active
    from vskipper.sglang.configs import register_configs
    from vskipper.sglang.standalone import init_sglang

    monkeypatch.setattr(active, "_ACTIVE", [])  # this test's models serve only here
    monkeypatch.setattr(active, "_RUNTIME", [])
    init_sglang("cpu")
    register_configs()
    checkpoint = make_tiny_model("flexidepth-llama", tmp_path / "tiny", TinySize(layers=4))
    slots = REQUESTS * (CONTEXT + 64) + 1
    built = [ServedModel(arm(arm_name), checkpoint, REQUESTS, slots, execution="triton") for _ in range(2)]
    same_kv(built)
    return built


def padded(fb, rows: int):
    """SGLang's graph runner's copy of decode batch `fb` padded to `rows`: request slot 0, one token of context,
    KV slot 0, position 0 (`StandaloneLayer.padded`'s policy)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

    pad = rows - fb.batch_size

    def cat(t, value):
        return torch.cat([t, torch.full((pad,), value, dtype=t.dtype)])

    seq = cat(fb.seq_lens, 1)  # the Triton backend's fill (the torch-native backend captures no graph)
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=rows, input_ids=cat(fb.input_ids, 0),
                        req_pool_indices=cat(fb.req_pool_indices, 0), seq_lens=seq, out_cache_loc=cat(fb.out_cache_loc, 0),
                        seq_lens_sum=int(seq.sum()), seq_lens_cpu=seq.clone(), positions=cat(fb.positions, 0),
                        capture_hidden_mode=CaptureHiddenMode.NULL)


def replay_beside_eager(graphed: ServedModel, eager: ServedModel, batches=(1, 4)):
    """The graph captured on `graphed` through its hooks, then replayed for a batch of `ROWS` requests from each
    first request slot in `batches`, each batch also run eagerly on `eager`: per batch (the replay's logits of
    the batch's rows, the eager pass's, each layer's K at the batch's KV slots before, after the replay and after
    the eager pass, the graph tape's route of the batch's rows)."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.runner_utils import capture_mode

    from vskipper.sglang.models.routed import ROUTED_VARIANT

    model = graphed.model
    model.graph_blocker = None  # CPU: no CUDA graph, the capture stood in for (see the module's docstring)
    runner = SimpleNamespace(capture_bs=[1, 2, GRAPH], captured_req_width=1)
    variants = model.decode_graph_variants(runner)
    assert variants is not None and model.graph_buffers.capacity == GRAPH

    def replayed(fb):
        """The routed variant's graph run over `fb`'s tensors (the capture, and each replay after it)."""
        capture_mode._set_capture_attention_variant(ROUTED_VARIANT)
        try:
            with graphed.context():
                return model.forward(fb.input_ids, fb.positions, fb)
        finally:
            capture_mode._set_capture_attention_variant(None)

    # The capture: the graph runner's static batch of the graph's size (every row padding: slot 0, KV slot 0).
    capture = padded(graphed.batch(Shape("decode", 1), 1), GRAPH)
    capture.req_pool_indices[0], capture.out_cache_loc[0], capture.positions[0] = 0, 0, 0
    replayed(capture)
    results = []
    for first in batches:
        fb = graphed.batch(Shape("decode", ROWS), first)
        twin = eager.batch(Shape("decode", ROWS), first)
        twin.input_ids = fb.input_ids.clone()
        before = [b[fb.out_cache_loc].clone() for b in graphed.pool.k_buffer]
        model.prepare_pass(fb)  # the hook around ModelRunner.forward, before the graph runner replays
        assert variants.select(fb) == ROUTED_VARIANT and model.graph_veto(fb, True)
        out = replayed(padded(fb, GRAPH))
        model.finish_pass(fb, replayed=True)
        eager.model.prepare_pass(twin)
        with eager.context():
            want = eager.model.forward(twin.input_ids, twin.positions, twin)
        eager.model.finish_pass(twin, replayed=False)
        results.append((out.next_token_logits[:ROWS], want.next_token_logits, before,
                        [b[fb.out_cache_loc] for b in graphed.pool.k_buffer],
                        [b[fb.out_cache_loc] for b in eager.pool.k_buffer],
                        model.runtime._graph_tape.run[:, :ROWS].clone()))
    return results


def test_a_routed_decode_graph_replayed_through_the_models_hooks_equals_the_eager_pass(models):
    graphed, eager = models
    results = replay_beside_eager(graphed, eager)
    for got, want, before, got_k, want_k, _ in results:  # two batches of other requests through one graph
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for g, w, b in zip(got_k, want_k, before, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
            assert not torch.equal(g, b)  # the pass wrote its K there
    # Both runtimes counted the same rows, one from the graph tape, the other from its eager tape.
    replayed_att, eager_att = graphed.model.runtime.attestation(), eager.model.runtime.attestation()
    assert replayed_att["rows_total"] == eager_att["rows_total"]
    assert replayed_att["rows_total"]["decode"]["project_only"] > 0 and replayed_att["rows_total"]["decode"]["run"] > 0
    assert replayed_att["graph_passes_total"]["decode"]["routed"] == {"replayed": 2, "eager": 0}
    assert not torch.equal(results[0][-1], results[1][-1])  # the second batch routed otherwise through the graph


def test_a_flexidepth_decode_graph_routes_with_the_fused_gate_as_the_eager_pass_does(tmp_path, monkeypatch):
    """FlexiDepth's always-route arm (the hybrid arm's decode) through the routed graph variant: the capture and
    each replay route every routed layer with the fused gate (`vskipper.mixed.router`, two launches a layer), over
    the graph tape, and equal the eager passes of the same batches, logits, K and routes alike."""
    from vskipper.mixed.launches import interpreted_launches

    graphed, eager = served_pair(tmp_path, monkeypatch, "always-route")
    torch.manual_seed(SEED)  # the batches' token ids: a draw whose rows route both ways over the tiny checkpoint
    launched = Counter()
    with interpreted_launches(launched):
        results = replay_beside_eager(graphed, eager)
    routed, passes = len(graphed.model.routed_layers), 1 + 2 * 2  # the capture, two replays, two eager passes
    assert launched["gate_norm_tanh_kernel"] == launched["gate_decide_kernel"] == routed * passes
    for got, want, _before, got_k, want_k, _route in results:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for g, w in zip(got_k, want_k, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    routes = torch.cat([r[-1] for r in results])
    assert routes.any() and not routes.all()  # both branches taken in the graph's routes
    eager_rows = eager.model.runtime.attestation()["rows_total"]
    assert graphed.model.runtime.attestation()["rows_total"] == eager_rows


def test_the_triton_execution_computes_random_skips_routes_in_one_launch_and_attests_it(models):
    """The served model's triton execution hands RandomSkip's per-pass routes to the fused launch
    (`vskipper.mixed.routes`): the pass's state is the one the skipper's chain computes, and the attestation says
    which computed it."""
    from vskipper.mixed.launches import LaunchCount, interpreted_launches
    from vskipper.skippers.base import BatchContext

    m = models[0]
    assert "random_routes_kernel" in m.runtime.execution["skipper_state"]
    prepared = []
    prepare_state = m.runtime.prepare_state

    def kept(step, hidden, positions, fused=False):
        prepare_state(step, hidden, positions, fused)
        prepared.append((fused, step, hidden, positions))

    m.runtime.prepare_state = kept
    count = LaunchCount()
    try:
        with interpreted_launches(count.triton), count:
            m.whole(m.batch(Shape("prefill", 2, 16), 0))
    finally:
        del m.runtime.prepare_state
    assert count.triton["random_routes_kernel"] == 1
    assert not {"bitwise_xor", "__rshift__", "remainder"} & set(count.ops)  # the chain's operators are gone
    ((fused, step, hidden, positions),) = prepared
    chain = m.runtime.skipper.prepare_batch(BatchContext(hidden, torch.ones(step.rows, dtype=torch.bool),
                                                         m.runtime.routed_layers, step.phase, step.keys, positions))
    assert fused and not chain["run"].all() and chain["run"].any()
    assert torch.equal(step.state["run"], chain["run"]) and torch.equal(step.state["weights"], chain["weights"])


def test_a_plan_written_where_the_graph_does_not_read_it_strays(models):
    """The same replay with each pass's plan written into the eager buffers instead of the graph's (as if the
    model took its replayed pass for an eager one): the graph reads the capture's padding plan, and the batch's
    logits stray."""
    graphed, eager = models
    model = graphed.model
    write_plan = model.write_plan

    def into_the_eager_buffers(fb, step):
        held, model.graph_buffers = model.graph_buffers, model.buffers
        try:
            return write_plan(fb, step)
        finally:
            model.graph_buffers = held

    model.write_plan = into_the_eager_buffers
    (got, want, *_), = replay_beside_eager(graphed, eager, batches=(1,))
    assert not torch.allclose(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("arm_name", "execution"), [("dense", "triton"), ("s=0", "triton"), ("s=0.5", "triton"),
                                                     ("always-route", "triton"), ("s=0.5", "torch")])
def test_a_served_models_whole_forward_makes_the_host_wait_for_no_device_value(tmp_path, monkeypatch, arm_name,
                                                                               execution):
    """The real model's whole forward after its hook's `prepare_pass` (embedding, dense and routed layers, the
    skipper's per-pass state, the tape, the logits), prefill and decode: with the triton execution no operator
    that would make the host wait for the device (`vskipper.mixed.host_waits.HostWaitDetector`: a scalar read, an output shaped
    by device values, a tensor literal) outside SGLang's attention backend, which a dense pass calls alike, in a
    routed arm as in dense. The torch execution, which packs its cohorts with `nonzero`, is the detector's
    control: there it sees the wait."""
    from vskipper.mixed.host_waits import HostWaitDetector
    from vskipper.sglang import active
    from vskipper.sglang.configs import register_configs
    from vskipper.sglang.standalone import init_sglang

    monkeypatch.setattr(active, "_ACTIVE", [])
    monkeypatch.setattr(active, "_RUNTIME", [])
    init_sglang("cpu")
    register_configs()
    checkpoint = make_tiny_model("flexidepth-llama", tmp_path / "tiny", TinySize(layers=4))
    m = ServedModel(arm(arm_name), checkpoint, REQUESTS, REQUESTS * (CONTEXT + 64) + 1, execution=execution)
    waits, sites = {}, {}
    for phase, shape, first in (("prefill", Shape("prefill", 2, 16), 4), ("decode", Shape("decode", 3), 0)):
        m.whole(m.batch(shape, first))  # the first pass of a shape: the plan buffers and the tape sized
        fb = m.batch(shape, first)
        detector = HostWaitDetector()
        for name in ("forward_extend", "forward_decode"):
            monkeypatch.setattr(m.backend, name, detector.exempt(getattr(m.backend, name)))
        m.model.prepare_pass(fb)
        with detector, m.context():
            m.model.forward(fb.input_ids, fb.positions, fb)
        m.model.finish_pass(fb, False)
        waits[phase] = detector.waits
        sites[phase] = {w.where.split(":")[0] for w in detector.found if w.what == "aten.nonzero.default"}
    counted = m.runtime.attestation()["passes_total"]
    assert counted["prefill"]["routed" if arm_name != "dense" else "dense"] == 2  # served as the arm serves
    if execution == "triton":
        assert waits == {"prefill": [], "decode": []}
    else:
        assert "aten.nonzero.default" in waits["prefill"] and "aten.nonzero.default" in waits["decode"]
        # each at the frame of vSkipper's code that packs its rows (the layer; prefill's packed read too)
        assert sites == {"prefill": {"vskipper/mixed/routed_layer.py", "vskipper/mixed/attention.py"},
                         "decode": {"vskipper/mixed/routed_layer.py"}}


@pytest.mark.parametrize(("arm_name", "prefill_read"), [("s=0.5", "packed"), ("s=0.5", "backend"),
                                                        ("always-route", "backend")])
def test_every_triton_launch_a_served_pass_makes_is_a_variant_compiled_before_serving(tmp_path, monkeypatch,
                                                                                      arm_name, prefill_read):
    """The served model runs its routed layer's Triton launches when it is built (`warm_layer`: the cohort maps
    with dense-mode rows and without, the routed body at a pass in each range of its tiles; `warm_routes`: the
    skipper's fused routes; `warm_gate`: a trained gate's two kernels), so that no pass
    while serving compiles one and holds the passes behind it (the maps compiled four times while serving on the
    H200, 1.3-1.7 s each). Each launch is keyed as Triton's JIT keys its compiled variants (every argument's
    specialization, the switches, the block sizes and warps): the prefill passes of 2 x 16 and 3 x 7 tokens and a
    decode pass of 3 rows, at every routed layer (each a row of the skipper's [layers, rows] routes, aligned or
    not), launch only variants the build launched, but for the reads, which need the engine's KV pool (the packed
    prefill read here; the masked decode read compiles when decode graphs are captured). So do they where the
    prefill reads through SGLang's backend (as a GPU's table may choose), whose o_proj gathers its operand from
    the read's batch rows, another variant than a decode pass's of the same size. With every argument of
    the maps' launch specialized, as the JIT does by default, they would not: the key is the one that tells."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.interpreter import InterpretedFunction

    from vskipper.mixed import kernels, router, routes
    from vskipper.sglang import active
    from vskipper.sglang.configs import register_configs
    from vskipper.sglang.standalone import init_sglang

    reads = {"packed_prefill_kernel", "masked_decode_split_kernel", "masked_decode_merge_kernel"}
    launches: list[tuple[str, str, tuple, tuple]] = []  # (when, kernel, its key, its key by the JIT's default)
    when = ["build"]

    class Recorder:
        def __init__(self, name: str, kernel) -> None:
            self.name, self.kernel = name, kernel
            self.kept = set(kernel.kwargs.get("do_not_specialize") or ())

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                bound = dict(zip(self.kernel.arg_names, args, strict=False))

                def key(kept):
                    return (*(native_specialize_impl(CUDABackend, bound[n], False, n not in kept, True)
                              for n in self.kernel.arg_names if n in bound), *sorted(kwargs.items()))

                launches.append((when[0], self.name, key(self.kept), key(set())))
                return self.kernel[grid](*args, **kwargs)
            return launch

    for module in (kernels, routes, router):
        jitted = {name: obj for name, obj in vars(module).items()
                  if isinstance(obj, InterpretedFunction) and not name.startswith("_")}
        for name, kernel in jitted.items():
            monkeypatch.setattr(module, name, Recorder(name, kernel))
    monkeypatch.setattr(active, "_ACTIVE", [])
    monkeypatch.setattr(active, "_RUNTIME", [])
    init_sglang("cpu")
    register_configs()
    from vskipper.sglang.models import routed as served  # after SGLang's platform is set

    chosen = served.cohort_execution  # the interpreter's packed read, or the read a GPU's table may choose
    monkeypatch.setattr(served, "cohort_execution",
                        lambda *a, **k: dataclasses.replace(chosen(*a, **k), prefill_read=prefill_read))
    checkpoint = make_tiny_model("flexidepth-llama", tmp_path / "tiny", TinySize(layers=4))
    m = ServedModel(arm(arm_name), checkpoint, REQUESTS, REQUESTS * (CONTEXT + 64) + 1, execution="triton")
    assert m.model.slot.execution.prefill_read == prefill_read
    when[0] = "serving"
    for shape, first in ((Shape("prefill", 2, 16), 0), (Shape("prefill", 3, 7), 2), (Shape("decode", 3), 0)):
        m.whole(m.batch(shape, first))
    built = {(name, key) for w, name, key, _ in launches if w == "build"}
    served = {(name, key) for w, name, key, _ in launches if w == "serving" and name not in reads}
    # RandomSkip's routes in one launch a pass (`vskipper.mixed.routes`), FlexiDepth's gate in two a routed layer
    # (`vskipper.mixed.router`), compiled at the build as well
    routes = {"random_routes_kernel"} if arm_name == "s=0.5" else {"gate_norm_tanh_kernel", "gate_decide_kernel"}
    assert {name for name, _ in built} >= {"cohort_maps_kernel", "cohort_gemm_kernel", *routes}
    assert {name for name, _ in served} >= {"cohort_maps_kernel", "cohort_gemm_kernel", *routes}
    assert served <= built, sorted(name for name, _ in served - built)
    # o_proj's two forms served: its operand packed (decode) and, through the backend's read, in batch rows
    gathers = {("GATHER_A", True) in key for name, key in served if name == "cohort_down_scatter_kernel"}
    assert gathers == ({False, True} if prefill_read == "backend" else {False})
    assert {name for w, name, *_ in launches if w == "serving"} & reads  # the reads ran, and are not warmed
    maps = {w: {default for at, name, _, default in launches if name == "cohort_maps_kernel" and at == w}
            for w in ("build", "serving")}
    assert len({key for w, name, key, _ in launches if name == "cohort_maps_kernel" and w == "build"}) == 2
    assert not maps["serving"] <= maps["build"]  # by the JIT's default the served maps would compile anew


def test_the_triton_execution_routes_a_trained_gate_in_two_launches_a_layer_as_its_own_route_does(tmp_path,
                                                                                                  monkeypatch):
    """FlexiDepth's always-route arm over the checkpoint's routers: in the triton execution each routed layer's
    route comes from the fused gate (`vskipper.mixed.router`: the router's two GEMMs and two launches, attested as
    `execution.skipper_route`), with none of the gate's own chain (its sigmoid, tanh, the threshold's compare), and
    the pass's tape holds the routes and weights the torch execution's own `route` records, prefill and decode."""
    from vskipper.mixed.launches import LaunchCount, interpreted_launches
    from vskipper.sglang import active
    from vskipper.sglang.configs import register_configs
    from vskipper.sglang.standalone import init_sglang

    monkeypatch.setattr(active, "_ACTIVE", [])
    monkeypatch.setattr(active, "_RUNTIME", [])
    init_sglang("cpu")
    register_configs()
    checkpoint = make_tiny_model("flexidepth-llama", tmp_path / "tiny", TinySize(layers=4))
    slots = REQUESTS * (CONTEXT + 64) + 1
    fused, own = (ServedModel(arm("always-route"), checkpoint, REQUESTS, slots, execution=e)
                  for e in ("triton", "torch"))
    assert "vskipper.mixed.router" in fused.runtime.execution["skipper_route"]
    assert own.runtime.execution["skipper_route"] == "the skipper's own route"
    routed, taken = fused.model.routed_layers, []
    for shape, first in ((Shape("prefill", 2, 16), 4), (Shape("decode", 3), 0)):
        tapes = []
        for m in (fused, own):
            torch.manual_seed(SEED)  # the same token ids
            fb = m.batch(shape, first)
            count = LaunchCount()
            with interpreted_launches(count.triton), count:
                m.whole(fb)
            tapes.append(m.runtime._tape)  # an eager pass's tape (no graph captured here), kept till the next
            if m is fused:
                assert count.triton["gate_norm_tanh_kernel"] == count.triton["gate_decide_kernel"] == len(routed)
                assert not {"sigmoid", "tanh", "gt"} & set(count.ops)
        for layer in routed:
            (run_f, w_f), (run_o, w_o) = (t.layer(layer, shape.rows) for t in tapes)
            assert torch.equal(run_f, run_o)
            torch.testing.assert_close(w_f, w_o, rtol=1e-5, atol=1e-6)
            taken.append(run_f)
    taken = torch.cat(taken)
    assert taken.any() and not taken.all()  # both branches taken
