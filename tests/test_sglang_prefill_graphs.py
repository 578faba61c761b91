"""A routed prefill pass's routed layers replayed from captured segments (`vskipper.sglang.prefill_graphs`), beside
the same passes eager: the real model class with SGLang's KV pool, request-to-token pool and torch-native backend
(`benchmarks/host_time_bench.ServedModel`), the triton execution under the Triton interpreter, the read through
SGLang's backend.

No CUDA graph is captured on CPU: `RerunGraph` stands in, a replay running the captured function again and copying
its outputs into the capture's, so a segment that closed over one pass's tensors reads them again at the next
(as a graph reads its captured addresses). What only a device shows (a value looked up anew at each call that a
graph keeps from its capture, a kernel that runs outside the capture, a launch CUDA refuses to capture) no test
here can: a served arm checks each segment's first replays against its eager runs on the device
(`SegmentGraphs.check`, in the attestation and the device run's summary). SGLang's torch-native backend reads a
prefill's new K/V from the pool, not from the operands the read is handed, which the device's Triton backend reads:
the tests check those operands against the pool."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("sglang")

from benchmarks.host_time_bench import ARMS, CONTEXT, ServedModel, Shape, same_kv  # noqa: E402
from vskipper.checkpoint import TinySize, make_tiny_model  # noqa: E402
from vskipper.mixed.segment_graphs import CaptureFailed, RerunGraph, SegmentGraphs, copy_into, tensors  # noqa: E402

REQUESTS = 8
SIZES = (16, 64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model("flexidepth-llama", tmp_path_factory.mktemp("tiny") / "m", TinySize(layers=4))


def served(checkpoint, monkeypatch, arm: str = "s=0.5", sizes=SIZES,
           operands: ReadOperands | None = None, read: str = "backend") -> list[ServedModel]:
    """A model whose routed prefill passes replay (first) beside one that runs them eagerly, one checkpoint, the
    same KV pool contents, both prefilling with `read`; `operands` installed once SGLang is set up."""
    from vskipper.sglang import active, prefill_graphs
    from vskipper.sglang.configs import register_configs
    from vskipper.sglang.standalone import init_sglang

    monkeypatch.setattr(active, "_ACTIVE", [])
    monkeypatch.setattr(active, "_RUNTIME", [])
    monkeypatch.setattr(prefill_graphs, "PREFILL_GRAPH_STAND_IN", RerunGraph)
    init_sglang("cpu")
    register_configs()
    if operands is not None:
        operands.install(monkeypatch)
    slots = REQUESTS * (CONTEXT + 64) + 1
    built = [ServedModel(ARMS[arm], checkpoint, REQUESTS, slots, execution="triton", prefill_read=read,
                         prefill_graphs=graphs) for graphs in (sizes, ())]
    same_kv(built)
    return built


def made_with_keys(monkeypatch, graphs: SegmentGraphs, graph_class) -> None:
    """Each graph of `graphs` made by `graph_class(key)`, the key of the segment it is made for."""
    real_run, making = graphs.run, [None]

    def run(key, fn):
        making[0] = key
        return real_run(key, fn)

    monkeypatch.setattr(graphs, "run", run)
    monkeypatch.setattr(graphs, "_make", lambda: graph_class(making[0]))


def boot(monkeypatch, model: ServedModel, chunk: int | None = None) -> None:
    """What the server does once SGLang's scheduler is built: the hook after `get_init_info`, handed a scheduler
    whose runner serves `model` (its prefill chunked at `chunk` tokens; None: a scheduler that names no budget)."""
    from types import SimpleNamespace

    from vskipper.sglang import active, hooks

    monkeypatch.setattr(active, "_ACTIVE", [model.model])
    hooks.after_boot_capture(None, SimpleNamespace(chunked_prefill_size=chunk, tp_worker=SimpleNamespace(
        model_runner=SimpleNamespace(model=model.model, attn_backend=model.backend))))


class ReadOperands:
    """Once installed (after SGLang is set up for the CPU): every prefill read handed its new tokens' K/V as
    operands (a routed layer's, which writes them itself first) is checked: those operands are the K/V the pool
    (`pool`, the model's whose pass runs) holds at the pass's slots, as the device's Triton backend, which reads
    them, needs them. The reads checked are counted (`checked`)."""

    def __init__(self) -> None:
        self.checked: list[int] = []
        self.pool = None

    def install(self, monkeypatch) -> None:
        from sglang.srt.layers.radix_attention import RadixAttention

        real, operands = RadixAttention.forward, self

        def forward(self, q, k, v, forward_batch, save_kv_cache=True, **kwargs):
            if k is not None and not save_kv_cache and not forward_batch.forward_mode.is_decode():
                loc = forward_batch.out_cache_loc
                for got, pool in ((k, operands.pool.k_buffer), (v, operands.pool.v_buffer)):
                    torch.testing.assert_close(got.reshape(loc.shape[0], -1),
                                               pool[self.layer_id][loc].reshape(loc.shape[0], -1), rtol=0, atol=0)
                operands.checked.append(self.layer_id)
            return real(self, q, k, v, forward_batch, save_kv_cache, **kwargs)

        monkeypatch.setattr(RadixAttention, "forward", forward)


def both(graphed: ServedModel, eager: ServedModel, shape: Shape, first: int, seed: int, operands=None):
    """One prefill pass of `shape` from request slot `first` on each model, the same token ids: (the graphed
    pass's logits, the eager pass's, each model's whole K and V pools but SGLang's padding slot 0)."""
    ids = torch.randint(3, 500, (shape.rows,), generator=torch.Generator().manual_seed(seed))
    out = []
    for m in (graphed, eager):
        fb = m.batch(shape, first)
        fb.input_ids = ids.clone()
        if operands is not None:
            operands.pool = m.pool
        m.model.prepare_pass(fb)
        with m.context():
            logits = m.model.forward(fb.input_ids, fb.positions, fb).next_token_logits
        m.model.finish_pass(fb, False)
        out.append((logits, [b[1:].clone() for b in m.pool.k_buffer + m.pool.v_buffer]))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def assert_same(graphed: ServedModel, eager: ServedModel, shape: Shape, first: int, seed: int,
                operands=None) -> None:
    """The pass's logits and the whole KV pools (every other request's slots too) alike on both models, and the
    graphed pass's reads handed the K/V it wrote (one read a routed layer)."""
    read = len(operands.checked) if operands is not None else 0
    got, want, got_kv, want_kv = both(graphed, eager, shape, first, seed, operands)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for g, w in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    if operands is not None:  # the graphed model's routed layers and the eager model's each read once
        assert len(operands.checked) - read == 2 * len(graphed.model.routed_layers)


@pytest.mark.parametrize("read", ["backend", "packed"])
def test_routed_prefill_passes_replayed_at_each_count_equal_the_eager_passes(checkpoint, monkeypatch, read):
    """Passes of other lengths, prompts and request slots through the captures of two counts: one of exactly a
    count, shorter ones padded to it (after a longer one, whose rows are padding now: their KV slots must not be
    written again, their request slots and positions are reset), one too long for any (eager); each pass's logits
    and the whole KV pools equal the eager model's, both runtimes counted the same rows. The backend read: each
    read is handed the K/V its layer wrote, two segments a routed layer. The packed read: one segment a routed
    layer, the read inside it over the static request slots and positions."""
    read_operands = ReadOperands() if read == "backend" else None
    graphed, eager = served(checkpoint, monkeypatch, operands=read_operands, read=read)
    graphs = graphed.model.slot.prefill_graphs
    routed = len(graphed.model.routed_layers)
    per_layer = 2 if read == "backend" else 1
    passes = [(Shape("prefill", 1, 16), 0), (Shape("prefill", 2, 5), 2), (Shape("prefill", 3, 20), 1),
              (Shape("prefill", 1, 64), 4), (Shape("prefill", 2, 7), 5), (Shape("prefill", 1, 90), 6),
              (Shape("prefill", 4, 9), 0)]
    for seed, (shape, first) in enumerate(passes):
        assert_same(graphed, eager, shape, first, seed, read_operands)
    # the state and each routed layer's segments captured once per count, replayed at every later pass there
    assert graphs.graphs.counts == {"captured": 2 * (1 + per_layer * routed), "replayed": 4 * (1 + per_layer * routed)}
    assert graphs.passes == {"by_tokens": {"16": 3, "64": 3},
                             "eager": {"longer than every count": 1, "its count's capture failed or strayed": 0}}
    got, want = graphed.model.runtime.attestation(), eager.model.runtime.attestation()
    assert got["rows_total"] == want["rows_total"]
    rows = got["rows_total"]["prefill"]
    assert rows["project_only"] > 0 and rows["run"] > 0
    assert got["prefill_graphs"]["tokens"] == list(SIZES) and got["prefill_graphs"]["read"] == read
    check = got["prefill_graphs"]["capture_check"]
    assert check["segments"] == check["rechecked"] == 2 * (1 + per_layer * routed)  # each count's second pass
    assert check["worst_difference"] < 1e-5 and check["worst_recheck"] < 1e-5
    assert got["prefill_graphs"]["failed"] == {"16": None, "64": None}
    assert got["prefill_graphs"]["memory"] == {"reserved_bytes": 0, "free_after_boot_bytes": None}  # no CUDA here


def test_a_replayed_pass_routes_its_own_rows_not_the_captures(checkpoint, monkeypatch):
    """Two passes of one count over other requests: the graph tape holds each pass's own routes (RandomSkip
    hashes each row's request and position), so the second replay routed otherwise than the capture; the padding
    rows past a pass's own are RUN at every layer."""
    graphed, eager = served(checkpoint, monkeypatch)
    tape = graphed.model.slot.prefill_graphs.tape
    assert_same(graphed, eager, Shape("prefill", 2, 8), 0, 1)
    first = tape.run[:, :16].clone()
    assert_same(graphed, eager, Shape("prefill", 2, 5), 3, 2)  # 10 rows at the count of 16
    assert not torch.equal(first[:, :10], tape.run[:, :10])
    assert tape.run[:, 10:16].all() and not tape.run[:, :10].all()


def test_the_s0_control_replays_every_row_run(checkpoint, monkeypatch, caplog):
    """... and its start says that its checks compared no Project-Only row (the projector's path unchecked)."""
    graphed, eager = served(checkpoint, monkeypatch, arm="s=0")
    boot(monkeypatch, graphed)
    rows = graphed.model.runtime.attestation()["prefill_graphs"]["boot_rows"]
    assert rows["project_only"] == 0 and rows["run"] == 2 * sum(SIZES) * len(graphed.model.routed_layers)
    assert rows["unchecked"].startswith("no row of the checks at start took Project-Only")
    assert "no row of the checks at start took Project-Only" in caplog.text
    assert_same(graphed, eager, Shape("prefill", 2, 6), 0, 3)
    assert_same(graphed, eager, Shape("prefill", 1, 16), 2, 4)
    assert graphed.model.runtime.attestation()["rows_total"]["prefill"]["project_only"] == 0


def test_prefill_graphs_are_refused_by_name_where_they_cannot_be_captured(checkpoint, monkeypatch):
    """On CPU without the stand-in; with SGLang's hierarchical cache and the packed read; with the torch execution
    (the triton execution's two reads both serve, `GRAPH_READS`)."""
    from vskipper.sglang import prefill_graphs
    from vskipper.sglang.spec import ServeConfigError

    graphed, _ = served(checkpoint, monkeypatch)
    model = graphed.model
    monkeypatch.setattr(prefill_graphs, "PREFILL_GRAPH_STAND_IN", None)
    with pytest.raises(ServeConfigError, match="VSKIPPER_PREFILL_GRAPHS: no CUDA graphs on cpu"):
        model.prefill_graphs_for(SIZES)
    monkeypatch.setattr(prefill_graphs, "PREFILL_GRAPH_STAND_IN", RerunGraph)
    from vskipper.sglang.models.routed import TORCH_EXECUTION

    assert not prefill_graphs.hierarchical_cache()  # off here
    real, backend = prefill_graphs.hierarchical_cache, model.slot.execution
    monkeypatch.setattr(prefill_graphs, "hierarchical_cache", lambda: True)
    assert model.prefill_graphs_for(SIZES) is not None  # the backend read, eager, waits for the prefix K/V itself
    model.slot.execution = dataclasses.replace(backend, prefill_read="packed")
    with pytest.raises(ServeConfigError, match=r"VSKIPPER_PREFILL_GRAPHS: SGLang's hierarchical cache "
                                               r"\(--enable-hierarchical-cache\) loads a layer's prefix K/V"):
        model.prefill_graphs_for(SIZES)
    monkeypatch.setattr(prefill_graphs, "hierarchical_cache", real)
    model.slot.execution = TORCH_EXECUTION
    with pytest.raises(ServeConfigError, match="the torch execution"):
        model.prefill_graphs_for(SIZES)
    assert model.prefill_graphs_for(()) is None


def test_the_spec_reads_the_counts_and_refuses_a_list_it_cannot_capture_by_name():
    from vskipper.arms import get_arm
    from vskipper.sglang.spec import ENV_PREFILL_GRAPHS, ServeConfigError, ServeSpec

    arm = get_arm("dense")
    spec = ServeSpec(arm, 0, 0, prefill_graphs=(1024, 2048))
    assert spec.to_env()[ENV_PREFILL_GRAPHS] == "1024,2048"
    assert ServeSpec.from_env(spec.to_env()).prefill_graphs == (1024, 2048)
    assert ServeSpec.from_env(ServeSpec(arm, 0, 0).to_env()).prefill_graphs == ()
    for bad in ((2048, 1024), (0,), (1024, 1024)):
        with pytest.raises(ServeConfigError, match=ENV_PREFILL_GRAPHS):
            ServeSpec(arm, 0, 0, prefill_graphs=bad)
    with pytest.raises(ServeConfigError, match=f"{ENV_PREFILL_GRAPHS} must list token counts"):
        ServeSpec.from_env({**spec.to_env(), ENV_PREFILL_GRAPHS: "1024;2048"})
    assert spec.prefill_graph_counts() == (1024, 2048)


def test_auto_asks_four_counts_an_octave_up_to_2048_tokens():
    """"auto" asks for `AUTO_PREFILL_GRAPHS`: a pass pads by less than a quarter of its rows, from 16 tokens to
    2048; the spec keeps the word (the counts the server's budget reaches are chosen as it starts)."""
    from vskipper.arms import get_arm
    from vskipper.sglang.spec import AUTO_PREFILL_GRAPHS, ENV_PREFILL_GRAPHS, ServeConfigError, ServeSpec

    arm = get_arm("dense")
    spec = ServeSpec.from_env({**ServeSpec(arm, 0, 0).to_env(), ENV_PREFILL_GRAPHS: " auto "})
    assert spec.prefill_graphs == "auto" and spec.to_env()[ENV_PREFILL_GRAPHS] == "auto"
    counts = spec.prefill_graph_counts()
    assert counts == AUTO_PREFILL_GRAPHS and counts[:6] == (16, 20, 24, 28, 32, 40) and counts[-1] == 2048
    assert list(counts) == sorted(set(counts)) and len(counts) == 4 * 7 + 1
    assert all((b - a) / a <= 0.25 for a, b in zip(counts, counts[1:], strict=False))  # padding under a quarter
    for bad in ("AUTO", "all", ""):
        with pytest.raises(ServeConfigError, match=f"{ENV_PREFILL_GRAPHS} must be 'auto' or list token counts"):
            ServeSpec(arm, 0, 0, prefill_graphs=bad)
    with pytest.raises(ServeConfigError, match=f"{ENV_PREFILL_GRAPHS} must list token counts"):
        ServeSpec.from_env({**spec.to_env(), ENV_PREFILL_GRAPHS: "1024,auto"})


def test_the_counts_a_chunk_reaches_run_up_to_the_least_that_holds_it():
    """Only a chunked prefill bounds a pass: unchunked, SGLang admits a round's first prompt whole, however long."""
    from types import SimpleNamespace

    from vskipper.sglang.hooks import prefill_chunk
    from vskipper.sglang.prefill_graphs import reached_by

    assert prefill_chunk(SimpleNamespace(chunked_prefill_size=8192, max_prefill_tokens=16384)) == 8192
    for unchunked in (None, -1, 0):
        assert prefill_chunk(SimpleNamespace(chunked_prefill_size=unchunked, max_prefill_tokens=16384)) is None

    sizes = (16, 64, 256)
    assert reached_by(sizes, None) == sizes
    assert reached_by(sizes, 10) == reached_by(sizes, 16) == (16,)
    assert reached_by(sizes, 17) == reached_by(sizes, 64) == (16, 64)
    assert reached_by(sizes, 65) == reached_by(sizes, 4096) == sizes


def test_a_segment_runs_eagerly_captures_and_replays_and_its_outputs_are_the_captures():
    """The segment graphs themselves: the first call warms, captures and replays (three runs of the function
    under the stand-in), later calls replay once each, the outputs handed back are the same tensors every time,
    refilled; a function that closed over a tensor reads it again, as a graph reads its address."""
    static = torch.zeros(3)
    calls = []

    def fn():
        calls.append(1)
        return {"double": static * 2, "pair": (static + 1, static.sum())}

    graphs = SegmentGraphs(torch.device("cpu"))
    first = graphs.run("k", fn)
    assert len(calls) == 3 and graphs.counts == {"captured": 1, "replayed": 0}
    static.copy_(torch.tensor([1.0, 2.0, 3.0]))
    again = graphs.run("k", fn)
    # replayed, then run eagerly again beside the replay once (its recheck)
    assert again is first and len(calls) == 5 and graphs.counts == {"captured": 1, "replayed": 1}
    torch.testing.assert_close(again["double"], torch.tensor([2.0, 4.0, 6.0]))
    torch.testing.assert_close(again["pair"][1], torch.tensor(6.0))
    assert graphs.check["segments"] == 1 and graphs.check["worst_difference"] == 0.0
    held, fresh = {"t": torch.zeros(2), "layers": frozenset({1})}, {"t": torch.ones(2), "layers": frozenset({2})}
    copy_into(held, fresh)  # a constant of the function (a set of layers) is left as it is
    assert held["layers"] == frozenset({1}) and held["t"].tolist() == [1.0, 1.0]


def test_a_capture_whose_replay_differs_from_its_eager_run_is_named_with_its_difference():
    """A function that is not the same twice over the same inputs (here it counts its calls): the check names the
    segment and how far its replay strayed."""
    calls = []

    def fn():
        calls.append(1)
        return (torch.full((2,), float(len(calls))), torch.tensor([len(calls)]))

    graphs = SegmentGraphs(torch.device("cpu"))
    graphs.run("ok", lambda: torch.ones(2))
    graphs.run(("drifts", 1), fn)
    assert graphs.check == {"segments": 2, "worst_difference": 2.0, "worst_segment": "('drifts', 1)",
                            "rechecked": 0, "worst_recheck": 0.0, "worst_recheck_segment": None, "empty": [],
                            "not_finite": []}
    graphs.run(("drifts", 1), fn)  # replayed (the 4th call), then run again (the 5th): rechecked once
    graphs.run(("drifts", 1), fn)
    assert len(calls) == 6 and graphs.check["rechecked"] == 1 and graphs.check["worst_recheck"] == 1.0
    assert graphs.check["worst_recheck_segment"] == "('drifts', 1)"
    # a segment whose outputs are static storage its every run writes: the checks compare copies taken between
    # the runs, and a recheck leaves the replay's outputs there
    static, runs = torch.zeros(2), []

    def writes_static():
        runs.append(1)
        return static.fill_(float(len(runs) ** 2))

    graphs = SegmentGraphs(torch.device("cpu"))
    graphs.run("static", writes_static)  # eager 1, captured 4, replayed 9
    assert graphs.check["worst_difference"] == 8.0 and graphs.check["worst_segment"] == "'static'"
    assert graphs.run("static", writes_static) is static and static.tolist() == [16.0, 16.0]  # the replay's
    assert graphs.check["rechecked"] == 1 and graphs.check["worst_recheck"] == pytest.approx(9 / 25)


def test_a_replay_that_writes_nothing_is_flagged_and_a_non_finite_difference_stays_json():
    """A kernel that ran outside its capture (here: the function runs at the capture, the replay does nothing):
    the capture's outputs are poisoned before its first replay, so the eager run's values against NaN read as
    `NOT_FINITE`; NaN or infinity on one side alone reads so too, the same on both sides not at all."""
    import json

    from vskipper.mixed.segment_graphs import NOT_FINITE, difference

    class RanOutside:
        def capture(self, fn):
            return fn()

        def replay(self):
            pass

    static = torch.zeros(3)
    graphs = SegmentGraphs(torch.device("cpu"), graph=RanOutside)
    graphs.run("outside", lambda: static.copy_(torch.tensor([1.0, 2.0, 3.0])))
    assert graphs.check["worst_difference"] == NOT_FINITE and graphs.check["worst_segment"] == "'outside'"
    assert graphs.check["not_finite"] == ["'outside'"]
    json.dumps(graphs.check, allow_nan=False)
    nan, inf = float("nan"), float("inf")
    assert difference(torch.tensor([nan, 1.0]), torch.tensor([1.0, 1.0])) == NOT_FINITE
    assert difference(torch.tensor([inf, 1.0]), torch.tensor([1.0, 1.0])) == NOT_FINITE
    assert difference(torch.tensor([nan, inf, 2.0]), torch.tensor([nan, inf, 1.0])) == 1.0  # the finite pair only
    assert difference(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0])) == 0.5


def test_a_count_whose_capture_fails_serves_its_passes_eagerly_and_says_why(checkpoint, monkeypatch):
    """A capture CUDA refuses (here the second routed layer's segment after its read): that pass's later segments
    run eagerly and it counts as eager, every later pass of that count runs eagerly whole, no count captures after
    it (on CUDA the shared pool may be unusable), a count captured before it still replays; every pass equals the
    eager model's."""
    from vskipper.sglang import prefill_graphs

    graphed, eager = served(checkpoint, monkeypatch)
    refused = (16, graphed.model.routed_layers[1], "out")

    class Refusing(RerunGraph):
        def __init__(self, key):
            super().__init__()
            self.key = key

        def capture(self, fn):
            if self.key == refused:
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().capture(fn)

    graphs = graphed.model.slot.prefill_graphs
    made_with_keys(monkeypatch, graphs.graphs, Refusing)
    assert prefill_graphs.PREFILL_GRAPH_STAND_IN is RerunGraph
    for seed, (shape, first) in enumerate([(Shape("prefill", 1, 40), 4), (Shape("prefill", 2, 8), 0),
                                           (Shape("prefill", 1, 12), 3), (Shape("prefill", 1, 50), 5)]):
        assert_same(graphed, eager, shape, first, seed)
    assert graphs.failed == {"16": "RuntimeError: operation not permitted when stream is capturing", "64": None}
    assert graphs.passes == {"by_tokens": {"16": 0, "64": 2},
                             "eager": {"longer than every count": 0, "its count's capture failed or strayed": 2}}
    assert graphs.graphs.broken.startswith(f"{refused!r}: RuntimeError")
    with pytest.raises(CaptureFailed, match="no capture after a failed one"):
        graphs.graphs.run("another", lambda: torch.zeros(1))


def test_replayed_passes_equal_eager_ones_where_the_add_norm_works_in_place(checkpoint, monkeypatch):
    """SGLang's RMSNorm with a residual as its CUDA kernel runs it, both in place (the CPU's torch path makes new
    tensors): the next layer's add-norm then writes into the static rows a routed layer's hand-off lies in."""
    from vskipper.sglang import standalone

    real_init, calls = standalone.init_sglang, []

    def init(*args, **kwargs):
        out = real_init(*args, **kwargs)
        from sglang.srt.layers import layernorm

        real = layernorm.RMSNorm.forward_native

        def in_place(self, x, residual=None, post_residual_addition=None, quant_linear=None):
            if residual is None or post_residual_addition is not None:
                return real(self, x, residual, post_residual_addition)
            normed, summed = real(self, x, residual)
            residual.copy_(summed)
            x.copy_(normed)
            calls.append(1)
            return x, residual

        monkeypatch.setattr(layernorm.RMSNorm, "forward_native", in_place)
        return out

    monkeypatch.setattr(standalone, "init_sglang", init)
    graphed, eager = served(checkpoint, monkeypatch)
    # the model's last layer is routed: its hand-off leaves the model for the final norm, and SGLang may keep what
    # the norm returns beyond the pass. It is handed on as copies, never as the static rows the next pass writes.
    model = graphed.model.model
    assert graphed.model.routed_layers[-1] == model.end_layer - 1
    final, real_norm = [], model.norm.forward

    def norm(x, residual=None, *args, **kwargs):
        final.append((x, residual))
        return real_norm(x, residual, *args, **kwargs)

    monkeypatch.setattr(model.norm, "forward", norm)
    for seed, (shape, first) in enumerate([(Shape("prefill", 1, 16), 0), (Shape("prefill", 2, 5), 2),
                                           (Shape("prefill", 3, 20), 1), (Shape("prefill", 1, 60), 4)]):
        assert_same(graphed, eager, shape, first, seed)
    assert calls  # the in-place add-norm ran
    graphs = graphed.model.slot.prefill_graphs
    assert sum(graphs.passes["by_tokens"].values()) == 4
    static = {t.untyped_storage().data_ptr() for t in graphs._outputs.values()}
    assert len(final) == 4 and static
    assert all(t.untyped_storage().data_ptr() not in static for pair in final for t in pair)


def test_flexidepth_passes_replayed_route_with_the_fused_gate_as_the_eager_passes_do(checkpoint, monkeypatch):
    """FlexiDepth always-route over the checkpoint's routers: the fused gate's two launches are inside each routed
    layer's segment before the read, over the layer's static LN1 rows (the padding rows' too, routed RUN)."""
    from vskipper.arms import get_arm

    monkeypatch.setitem(ARMS, "fd", get_arm("always-route"))
    graphed, eager = served(checkpoint, monkeypatch, arm="fd")
    assert graphed.model.slot.fused_gate
    for seed, (shape, first) in enumerate([(Shape("prefill", 2, 8), 0), (Shape("prefill", 1, 11), 2),
                                           (Shape("prefill", 3, 7), 3)]):
        assert_same(graphed, eager, shape, first, seed)
    got, want = graphed.model.runtime.attestation(), eager.model.runtime.attestation()
    assert got["rows_total"] == want["rows_total"] and got["prefill_graphs"]["passes"]["by_tokens"]["16"] == 2


@pytest.mark.parametrize("read", ["backend", "packed"])
def test_every_count_captured_and_checked_at_boot_serves_its_passes_without_a_capture(checkpoint, monkeypatch,
                                                                                    read):
    """The server captures every count once SGLang's scheduler is built (the hook after `get_init_info`, handed the
    scheduler): two passes a count, of no request, counted nowhere, the KV slots and request rows they write put
    back as they were (the whole pool is compared with the eager model's below). Every segment is then captured
    and rechecked before the first served pass, and the served passes replay only, equal to the eager model's,
    their rows counted as the eager model counts them."""
    graphed, eager = served(checkpoint, monkeypatch, read=read)
    graphs = graphed.model.slot.prefill_graphs
    routed = len(graphed.model.routed_layers)
    per_pass = 1 + (2 if read == "backend" else 1) * routed
    segments = 2 * per_pass
    boot(monkeypatch, graphed)
    check = graphs.graphs.check
    assert graphs.graphs.counts == {"captured": segments, "replayed": segments}  # the second pass replayed each
    assert check["segments"] == check["rechecked"] == segments and not check["not_finite"]
    assert check["worst_difference"] < 1e-5 and check["worst_recheck"] < 1e-5
    att = graphed.model.runtime.attestation()
    assert all(s is not None and s >= 0 for s in att["prefill_graphs"]["captured_at_boot_s"].values())
    assert att["prefill_graphs"]["passes"]["by_tokens"] == {"16": 0, "64": 0}
    rows = att["prefill_graphs"]["boot_rows"]  # both branches replayed and checked; every row-visit counted
    assert rows["project_only"] > 0 and rows["unchecked"] is None
    assert rows["run"] + rows["project_only"] == 2 * sum(SIZES) * routed
    kv = att["prefill_graphs"]["kv_write_check"]
    if read == "backend":  # each routed layer's K/V in the pool as its first replay after the capture left them
        assert kv["compared"] == 2 * routed and kv["worst_difference"] == 0.0 and kv["not_compared"] is None
    else:
        assert kv == {"compared": 0, "worst_difference": None, "worst_at": None,
                      "not_compared": "the packed read reads its K/V inside the segment"}
    assert att["rows_total"] == eager.model.runtime.attestation()["rows_total"]
    passes = [(Shape("prefill", 2, 5), 2), (Shape("prefill", 1, 64), 4), (Shape("prefill", 3, 7), 0)]
    for seed, (shape, first) in enumerate(passes):
        assert_same(graphed, eager, shape, first, seed)
    assert graphs.graphs.counts["captured"] == segments
    assert graphs.graphs.counts["replayed"] == segments + 3 * per_pass  # the boot's and three passes'
    assert graphs.passes["by_tokens"] == {"16": 1, "64": 2}  # 10 rows; 64; 21
    assert graphed.model.runtime.attestation()["rows_total"] == eager.model.runtime.attestation()["rows_total"]


def test_a_kv_write_that_does_not_replay_is_caught_at_start_and_its_counts_serve_eagerly(checkpoint, monkeypatch):
    """With the backend read the boot's read reads no pool, so a K/V write that runs in every eager run but not in
    a replay (as a kernel outside a CUDA capture) leaves the pool holding the first pass's K/V at the second's
    slots: the start compares them right after the second pass's replays, before their eager reruns write the
    pool again, and refuses the counts, whose passes then run eagerly."""
    graphed, eager = served(checkpoint, monkeypatch)
    replaying = [False]
    real_replay = RerunGraph.replay

    def replay(self):
        replaying[0] = True
        try:
            return real_replay(self)
        finally:
            replaying[0] = False

    pool_class = type(graphed.pool)
    real_write = pool_class.set_kv_buffer

    def outside_the_capture(self, *args, **kwargs):
        return None if replaying[0] else real_write(self, *args, **kwargs)

    monkeypatch.setattr(RerunGraph, "replay", replay)
    monkeypatch.setattr(pool_class, "set_kv_buffer", outside_the_capture)
    boot(monkeypatch, graphed)
    att = graphed.model.runtime.attestation()["prefill_graphs"]
    for count in ("16", "64"):
        assert att["failed"][count].startswith("the K/V the pool holds strayed from what layer ")
        assert att["failed"][count].endswith("its write did not replay")
    assert att["kv_write_check"]["worst_difference"] > 0.05
    # no count serves replays: the checks vouch for none, and nothing is said to have gone unchecked
    assert att["boot_rows"] == {"run": 0, "project_only": 0, "unchecked": None}
    monkeypatch.setattr(pool_class, "set_kv_buffer", real_write)
    assert_same(graphed, eager, Shape("prefill", 2, 5), 2, 0)
    assert graphed.model.slot.prefill_graphs.passes["eager"]["its count's capture failed or strayed"] == 1


def test_the_boot_leaves_out_the_counts_no_pass_of_the_prefill_chunk_reaches(checkpoint, monkeypatch):
    """Under a prefill chunk of 12 tokens no pass holds more than 12 rows: the start captures 16 alone, and 64,
    which no pass reaches, is left out (attested with the budget). A pass of 12 rows replays at 16; one longer
    than the budget (which SGLang's chunked prefill does not make) runs eagerly, as longer than every count."""
    graphed, eager = served(checkpoint, monkeypatch)
    graphs = graphed.model.slot.prefill_graphs
    boot(monkeypatch, graphed, chunk=12)
    per_pass = 1 + 2 * len(graphed.model.routed_layers)
    assert graphs.graphs.counts == {"captured": per_pass, "replayed": per_pass}  # 16's segments alone
    att = graphed.model.runtime.attestation()["prefill_graphs"]
    assert att["reach"] == {"asked": "counts", "prefill_chunk": 12, "left_out": [64]}
    assert att["captured_at_boot_s"]["64"] is None and att["captured_at_boot_s"]["16"] is not None
    assert graphs.x.shape[0] == graphs.loc.shape[0] == 16  # the storage sized for the counts kept
    assert att["failed"] == {"16": None, "64": None}
    for seed, (shape, first) in enumerate([(Shape("prefill", 2, 6), 0), (Shape("prefill", 1, 40), 2)]):
        assert_same(graphed, eager, shape, first, seed)
    assert graphs.passes == {"by_tokens": {"16": 1, "64": 0},
                             "eager": {"longer than every count": 1, "its count's capture failed or strayed": 0}}
    assert graphs.graphs.counts["captured"] == per_pass


def test_the_boot_passes_differ_as_served_passes_do_and_keep_each_request_within_its_row():
    """The second boot pass of a count, which rechecks each segment's replay, differs from the first in every
    per-pass input a segment could wrongly keep from its capture: fewer rows (padded), other requests and their
    positions, other keys, dense-mode rows; each request's KV slots are written into its own request row (never
    the padding request 0), kept to be put back, and a request never spans more rows than a request row holds."""
    from vskipper.sglang.prefill_graphs import PrefillGraphs

    req_to_token = torch.zeros(6, 40, dtype=torch.int32)
    slots = 1 + torch.arange(64)
    kept: dict = {}
    gen = torch.Generator().manual_seed(0)
    n0, pos0, req0, keys0, dense0 = PrefillGraphs._boot_pass(64, 0, req_to_token, slots, kept, gen)
    n1, pos1, req1, keys1, dense1 = PrefillGraphs._boot_pass(64, 1, req_to_token, slots, kept, gen)
    assert n0 == 64 and n1 == 48
    assert pos0.tolist() == list(range(40)) + list(range(24))  # a request row holds 40: two requests
    assert pos1.tolist() == list(range(24)) * 2
    assert req0.tolist() == [1] * 40 + [2] * 24 and req1.tolist() == [3] * 24 + [4] * 24
    assert set(keys0[:40].tolist()).isdisjoint(keys1.tolist()) and keys1[0] != keys1[-1]
    assert not dense0.any() and dense1.tolist() == [False] * 24 + [True] * 24
    assert req_to_token[3, :24].tolist() == list(range(1, 25)) and req_to_token[4, :24].tolist() == list(range(25, 49))
    assert req_to_token[0].eq(0).all() and sorted(kept) == [1, 2, 3, 4]
    assert all(held.eq(0).all() for held in kept.values())  # as they were before the passes


def test_a_model_of_another_runner_or_without_prefill_graphs_captures_nothing_at_boot(checkpoint, monkeypatch):
    """The boot hook captures only for the skipper model the scheduler's runner serves, and only where its spec
    asks for prefill graphs."""
    from types import SimpleNamespace

    from vskipper.sglang import active, hooks

    graphed, eager = served(checkpoint, monkeypatch)
    graphs = graphed.model.slot.prefill_graphs

    def scheduler(model):
        return SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(
            model=model, attn_backend=graphed.backend)))

    monkeypatch.setattr(active, "_ACTIVE", [graphed.model])
    hooks.after_boot_capture(None, scheduler(eager.model))
    monkeypatch.setattr(active, "_ACTIVE", [eager.model])
    hooks.after_boot_capture(None, scheduler(eager.model))  # no graphs asked for: nothing to capture
    assert eager.model.slot.prefill_graphs is None and "prefill_graphs" not in eager.model.runtime.attestation()
    assert graphs.graphs.counts == {"captured": 0, "replayed": 0}
    assert set(graphs.boot.values()) == {None}


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    return make_tiny_model("qwen3-skipper", tmp_path_factory.mktemp("tiny-qwen3") / "m", TinySize(layers=4))


@pytest.mark.parametrize("arm,read", [("s=0.5", "backend"), ("qwen3", "backend"), ("qwen3", "packed")])
def test_qwen3_passes_replayed_equal_the_eager_passes(qwen3_checkpoint, monkeypatch, arm, read):
    """Qwen3's layers through the same segments: q_norm and k_norm inside the segment before the read, the layer's
    fold handing its sum on in place (into the static rows the next routed layer copies from), RandomSkip and the
    trained gate's fused route; captured at boot, then passes of both counts and one longer than either, equal to
    the eager model's."""
    from vskipper.arms import get_arm

    if arm == "qwen3":
        monkeypatch.setitem(ARMS, "qwen3", get_arm("qwen3-always-route"))
    graphed, eager = served(qwen3_checkpoint, monkeypatch, arm=arm, read=read)
    assert type(graphed.model).__name__ == "Qwen3SkipperForCausalLM"
    assert graphed.model.slot.fused_gate == (arm == "qwen3")
    boot(monkeypatch, graphed)
    graphs = graphed.model.slot.prefill_graphs
    captured, replayed = graphs.graphs.counts["captured"], graphs.graphs.counts["replayed"]
    for seed, (shape, first) in enumerate([(Shape("prefill", 2, 8), 0), (Shape("prefill", 1, 40), 2),
                                           (Shape("prefill", 3, 30), 3), (Shape("prefill", 1, 16), 6)]):
        assert_same(graphed, eager, shape, first, seed)
    assert graphs.graphs.counts["captured"] == captured and graphs.failed == {"16": None, "64": None}
    per_pass = 1 + (2 if read == "backend" else 1) * len(graphed.model.routed_layers)
    assert graphs.graphs.counts["replayed"] - replayed == 3 * per_pass  # three passes replayed, one eager
    assert graphs.passes["by_tokens"] == {"16": 2, "64": 1} and graphs.passes["eager"]["longer than every count"] == 1
    got, want = graphed.model.runtime.attestation(), eager.model.runtime.attestation()
    assert got["rows_total"] == want["rows_total"]
    assert got["rows_total"]["prefill"]["project_only"] > 0


def test_the_prefill_read_asked_for_replaces_the_executions_choice_and_is_refused_by_name_where_it_cannot_serve(
        checkpoint, monkeypatch):
    """`VSKIPPER_PREFILL_READ`: the triton execution prefills with the read asked for (its own choice kept in
    `prefill_read_why`), and its prefill graphs with it; an unknown read, or one asked of the torch execution, is
    refused naming the variable."""
    from vskipper.arms import get_arm
    from vskipper.sglang import active, prefill_graphs
    from vskipper.sglang.configs import register_configs
    from vskipper.sglang.spec import ENV_PREFILL_READ, ServeConfigError, ServeSpec
    from vskipper.sglang.standalone import init_sglang

    monkeypatch.setattr(active, "_ACTIVE", [])
    monkeypatch.setattr(active, "_RUNTIME", [])
    monkeypatch.setattr(prefill_graphs, "PREFILL_GRAPH_STAND_IN", RerunGraph)
    init_sglang("cpu")  # before SGLang's layers are imported (the model module imports them)
    register_configs()
    from vskipper.sglang.models.routed import TORCH_EXECUTION, asked_prefill_read
    slots = REQUESTS * (CONTEXT + 64) + 1
    model = ServedModel(ARMS["s=0.5"], checkpoint, REQUESTS, slots, execution="triton", prefill_graphs=SIZES,
                        asked_read="backend").model  # the interpreter's choice is the packed read
    execution = model.slot.execution
    assert execution.prefill_read == "backend" and model.slot.prefill_graphs.packed is False
    assert execution.prefill_read_why == f"{ENV_PREFILL_READ}=backend, in place of the execution's choice: packed"
    assert model.runtime.attestation()["prefill_graphs"]["read"] == "backend"
    assert asked_prefill_read(execution, "auto") is execution
    with pytest.raises(ServeConfigError, match=f"{ENV_PREFILL_READ}=packed: the triton execution's prefill read, "
                                               "and the routed layers run the torch execution"):
        asked_prefill_read(TORCH_EXECUTION, "packed")
    with pytest.raises(ServeConfigError, match=f"{ENV_PREFILL_READ} must be one of auto, packed, backend"):
        ServeSpec(get_arm("always-route"), 0, 0, prefill_read="rows")
    spec = ServeSpec(get_arm("always-route"), 0, 0, prefill_read="packed")
    assert ServeSpec.from_env(spec.to_env()).prefill_read == "packed"
    assert ENV_PREFILL_READ not in ServeSpec(get_arm("always-route"), 0, 0).to_env()


@pytest.mark.parametrize("stray", ["one", "nan"])
def test_a_count_whose_replays_stray_at_start_serves_its_passes_eagerly_and_says_why(checkpoint, monkeypatch,
                                                                                   stray):
    """A graph whose replay leaves other values than its eager run (here every replay of count 16's segments adds
    one to its outputs, or leaves NaN, as a replay of something else than the eager run would) is found by the
    checks at start: that count is marked failed, named with the segment and how far it strayed, and its passes run
    eagerly, equal to the eager model's; the other count replays."""
    graphed, eager = served(checkpoint, monkeypatch, read="packed")
    graphs = graphed.model.slot.prefill_graphs

    class Straying(RerunGraph):
        def __init__(self, key):
            super().__init__()
            self.key = key

        def replay(self):
            super().replay()
            if self.key[0] == 16:
                for t in tensors(self.outputs):
                    if t.is_floating_point():
                        t.add_(1.0) if stray == "one" else t.fill_(float("nan"))

    made_with_keys(monkeypatch, graphs.graphs, Straying)
    boot(monkeypatch, graphed)
    assert graphs.failed["64"] is None
    assert graphs.failed["16"].startswith("segment (16, ") and "replay strayed from its eager run by" in \
        graphs.failed["16"]
    for seed, (shape, first) in enumerate([(Shape("prefill", 2, 8), 0), (Shape("prefill", 1, 40), 2)]):
        assert_same(graphed, eager, shape, first, seed)
    assert graphs.passes == {"by_tokens": {"16": 0, "64": 1},
                             "eager": {"longer than every count": 0, "its count's capture failed or strayed": 1}}
