"""The part clock (`vskipper.sglang.part_times`): exclusive times per phase, layer kind and part, on a fake clock;
then on the served routed layer in this process (`tests/sglang_layer_world.py`), the parts a mixed pass and a
dense pass of SGLang's real layer take."""

from __future__ import annotations

import pytest
import torch
from pass_modes import Mode
from sglang_layer_world import LayerWorld

from vskipper.sglang.part_times import (
    CONTROL_PHASE,
    FORWARD_THREAD_FIELDS,
    PARTS,
    ROUTED_FIELDS,
    PartClock,
    PassClock,
    gc_time,
    thread_usage,
)
from vskipper.sglang.spec import (
    ENV_INTERLEAVE_CONTROL,
    ENV_PART_CLOCK,
    ENV_PASS_SPANS,
    ServeConfigError,
    ServeSpec,
    part_clock_from_env,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_part_is_charged_its_own_time_to_the_layer_kind_that_calls_it_and_a_shared_module_is_wrapped_once():
    t = FakeClock()
    # the forward's thread on the CPU half the time, one wait a second of the pass
    # and the garbage collector a second each ten of the clock, a collection each fifty
    clock = PartClock(clock=t, usage=lambda: (t.now / 2, int(t.now), 0),
                      collector=lambda: (float(int(t.now) // 10), int(t.now) // 50))

    class Shared:
        def forward(self):
            t.now += 1.0

    shared = Shared()

    class Layer:
        def forward(self):
            t.now += 10.0  # the layer's own glue
            shared.forward()

    routed, dense = Layer(), Layer()
    clock.wrap(routed, "forward", "glue", "routed")
    clock.wrap(dense, "forward", "glue", "dense")
    clock.wrap(shared, "forward", "rope")
    clock.wrap(shared, "forward", "rope")  # a second layer holding the same module: wrapped once

    def one_pass():
        t.now += 100.0  # embedding and logits
        routed.forward()
        dense.forward()
        dense.forward()

    clock.around_pass(Mode(True), one_pass, tokens=4)
    clock.around_pass(Mode(False), lambda: routed.forward(), tokens=9)
    assert clock.attestation() == {
        "parts": True, "passes_total": {"decode": 1, "prefill": 1}, "tokens_total": {"decode": 4, "prefill": 9},
        "seconds_total": {"decode": {"outside": {"outside": 100.0}, "routed": {"glue": 10.0, "rope": 1.0},
                                     "dense": {"glue": 20.0, "rope": 2.0}},
                          "prefill": {"outside": {"outside": 0.0}, "routed": {"glue": 10.0, "rope": 1.0}}},
        "device_seconds_total": {}, "device_passes_total": {}, "errors": {},  # no device here (no timing events)
        "forward_thread": {"cpu_seconds_total": {"decode": 66.5, "prefill": 5.5},
                           "waits_total": {"decode": 133, "prefill": 11},
                           "preempted_total": {"decode": 0, "prefill": 0},
                           "gc_seconds_total": {"decode": 13.0, "prefill": 1.0},
                           "gc_collections_total": {"decode": 2, "prefill": 0}},
        # every timed call counted (the pass's own `outside` too); what one costs is measured where installed
        "calls_total": {"decode": 7, "prefill": 3}, "call_cost_s": None,
        "routed_total": {field: {} for field in ROUTED_FIELDS}}  # no pass here routed


def test_a_part_that_raises_is_still_charged_and_the_clock_keeps_counting():
    t = FakeClock()
    clock = PartClock(clock=t)

    class Boom:
        def forward(self):
            t.now += 3.0
            raise ValueError("bad row")

    boom = Boom()
    clock.wrap(boom, "forward", "mlp", "routed")
    with pytest.raises(ValueError, match="bad row"):
        clock.around_pass(Mode(True), boom.forward)
    assert clock.seconds["decode"]["routed"]["mlp"] == 3.0
    assert clock.passes["decode"] == 1 and clock._children == []


def test_the_serve_spec_carries_the_part_clock_through_the_environment_and_refuses_other_values():
    from vskipper.arms import get_arm

    spec = ServeSpec(get_arm("dense"), 0, 0, part_clock=True)
    env = spec.to_env()
    assert env[ENV_PART_CLOCK] == "1" and ServeSpec.from_env(env).part_clock
    assert ENV_PART_CLOCK not in ServeSpec(get_arm("dense"), 0, 0).to_env()
    assert not part_clock_from_env({})
    with pytest.raises(ServeConfigError, match=f"{ENV_PART_CLOCK} must be 0 or 1, got 'yes'"):
        ServeSpec.from_env({**env, ENV_PART_CLOCK: "yes"})


def test_the_serve_spec_carries_the_pass_spans_through_the_environment_and_refuses_other_values():
    from vskipper.arms import get_arm

    env = ServeSpec(get_arm("dense"), 0, 0, pass_spans=True).to_env()
    assert env[ENV_PASS_SPANS] == "1" and ServeSpec.from_env(env).pass_spans
    assert not ServeSpec.from_env(env).part_clock and ENV_PART_CLOCK not in env
    assert not ServeSpec.from_env(ServeSpec(get_arm("dense"), 0, 0).to_env()).pass_spans
    with pytest.raises(ServeConfigError, match=f"{ENV_PASS_SPANS} must be 0 or 1, got 'true'"):
        ServeSpec.from_env({**env, ENV_PASS_SPANS: "true"})


def test_the_serve_spec_carries_the_interleaved_control_through_the_environment():
    from vskipper.arms import get_arm

    env = ServeSpec(get_arm("always-route"), 0, 0, interleave_control=True).to_env()
    assert env[ENV_INTERLEAVE_CONTROL] == "1" and ServeSpec.from_env(env).interleave_control
    assert not ServeSpec.from_env(ServeSpec(get_arm("always-route"), 0, 0).to_env()).interleave_control
    with pytest.raises(ServeConfigError, match=f"{ENV_INTERLEAVE_CONTROL} must be 0 or 1, got 'on'"):
        ServeSpec.from_env({**env, ENV_INTERLEAVE_CONTROL: "on"})


def test_a_step_runs_from_a_pass_start_to_the_next_and_counts_only_where_the_next_decodes_the_same_rows():
    t = FakeClock()
    clock = PassClock(clock=t)
    for kind, rows, seconds in [("decode", 16, 0.25), (CONTROL_PHASE, 16, 0.5), ("decode", 16, 0.25),
                                (CONTROL_PHASE, 15, 7.0),  # a request left: the routed step before it is not kept
                                ("decode", 15, 0.25), (None, 0, 9.0),  # a prefill pass: neither step is kept
                                (CONTROL_PHASE, 15, 1.0), ("decode", 15, 0.0)]:
        clock.start(kind, rows)
        t.now += seconds
    assert clock.attestation() == {"passes_total": {"decode": 1, CONTROL_PHASE: 3},
                                   "seconds_total": {"decode": 0.25, CONTROL_PHASE: 8.5}}


def test_an_interleaved_control_pass_is_a_phase_of_its_own_in_the_part_clock():
    t = FakeClock()
    clock = PartClock(clock=t, usage=None, collector=None)  # the thread's usage not read: its totals stay empty

    def run():
        t.now += 2.0

    clock.around_pass(Mode(True), run, control=True, tokens=16)
    clock.around_pass(Mode(True), run, tokens=16)
    clock.around_pass(Mode(False), run, control=True, tokens=1024)
    clock.around_pass(Mode(False), run, tokens=1)  # a prompt the radix cache held but for its last token
    phases = (CONTROL_PHASE, "decode", "prefill_control", "prefill")
    assert clock.attestation() == {"parts": True, "passes_total": dict.fromkeys(phases, 1),
                                   "tokens_total": dict(zip(phases, (16, 16, 1024, 1), strict=True)),
                                   "seconds_total": {phase: {"outside": {"outside": 2.0}} for phase in phases},
                                   "device_seconds_total": {}, "device_passes_total": {}, "errors": {},
                                   "forward_thread": {field: {} for field in FORWARD_THREAD_FIELDS},
                                   "calls_total": dict.fromkeys(phases, 1), "call_cost_s": None,
                                   "routed_total": {field: {} for field in ROUTED_FIELDS}}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return LayerWorld.prefilled("flexidepth-llama", tmp_path_factory.mktemp("clock"), 5, {0: 5, 1: 3, 2: 7, 3: 4})


def _mixed_then_dense(world, clock: PartClock, phase: str, monkeypatch) -> tuple[dict, dict, int, int]:
    """The clock installed on the served layer (the server's execution on CPU: decode reads through SGLang's
    attention layer over the RUN rows), then a mixed pass with every other row RUN and a dense pass of the same
    rows: (the routed layer's parts the mixed pass charged, those the dense pass charged, the RUN rows, the rows)."""
    from vskipper.sglang.models import routed as served

    monkeypatch.setattr(world.slot, "execution", served.cohort_execution([world.layer], torch.device("cpu")))
    layer = world.layer
    clock.install([(layer.layer_id, layer)], (layer.layer_id,))
    monkeypatch.setattr(world.slot, "part_clock", clock)
    clock.wrap(world.pool, "set_kv_buffer", "kv_write")
    # The world runs the routed body by `mixed_depth`, which the layer's forward calls in a server.
    clock.wrap(layer, "mixed_depth", "glue", "routed")
    extend = {0: 1, 1: 1, 2: 1, 3: 1} if phase == "decode" else {0: 3, 2: 4}
    kv0, lengths0 = world.kv(), list(world.lengths)
    try:
        fb = world.batch(extend)
        rows = fb.positions.shape[0]
        run = torch.arange(rows) % 2 == 0
        x = world.hidden(rows)
        clock.around_pass(fb.forward_mode, lambda: world.routed(fb, x, run, torch.ones(rows)))
        mixed = dict(clock.seconds[phase]["routed"])
        world.restore(kv0, lengths0)
        fb = world.batch(extend)
        with world.context(), torch.no_grad():
            clock.around_pass(fb.forward_mode, lambda: layer(fb.positions, x, fb, None))
        dense = {part: v - mixed.get(part, 0) for part, v in clock.seconds[phase]["routed"].items()
                 if v - mixed.get(part, 0)}
    finally:
        world.restore(kv0, lengths0)
    return mixed, dense, int(run.sum()), rows


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_on_sglangs_layer_a_mixed_pass_times_q_and_kv_apart_and_a_dense_pass_the_fused_projection(world, phase,
                                                                                                  monkeypatch):
    """A mixed pass of the served layer: Q (RUN rows) and K/V (every row) are told apart by the weight rows they
    multiply, the K/V write is the pool's, the read is SGLang's attention layer; the rest of the layer is glue. A
    dense pass runs the fused projection, and its attention layer's K/V write is not charged to the read."""
    clock = PartClock()
    mixed, _, _, _ = _mixed_then_dense(world, clock, phase, monkeypatch)
    assert set(mixed) == {"q", "kv", "rope", "kv_write", "read", "o", "mlp", "ln1", "ln2", "projector", "glue"}
    parts = clock.attestation()["seconds_total"][phase]["routed"]
    assert set(parts) == set(mixed) | {"qkv"} and set(parts) <= set(PARTS)
    assert all(v > 0 for v in parts.values())
    assert clock.passes[phase] == 2


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_on_sglangs_layer_each_projection_is_charged_to_its_part_by_the_rows_it_ran(world, phase, monkeypatch):
    """The parts told apart by the weight rows they multiply are charged each its own call: on a clock that moves
    only inside the layer's projections, by (the rows a projection ran) x (its weight's rows), a mixed pass with
    half its rows RUN charges Q its RUN rows, K/V every row, o_proj, the MLP the RUN rows and the adapter the
    Project-Only rows; a dense pass charges the fused projection, o_proj and the MLP every row. A label swapped
    or a projection charged to the wrong part moves these sums."""
    t = FakeClock()
    layer = world.layer
    attn = layer.self_attn
    units = {"mlp": 1_000_000, "projector": 1_000}  # a module's charge per row, where no weight is handed over

    def charging(fn, charge):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            t.now += charge(*args, **kwargs)
            return out
        return call

    monkeypatch.setattr(attn.qkv_proj.quant_method, "apply", charging(
        attn.qkv_proj.quant_method.apply, lambda module, x, *a, **k: x.shape[0] * module.weight.shape[0]))
    # o_proj at 7 a weight row: its weight has as many rows as Q's in this model, and a swap must still show
    monkeypatch.setattr(attn.o_proj, "forward", charging(
        attn.o_proj.forward, lambda x, *a, **k: x.shape[0] * attn.o_proj.weight.shape[0] * 7))
    for name in units:
        module = layer.mlp if name == "mlp" else layer.router_proj
        monkeypatch.setattr(module, "forward", charging(module.forward,
                                                        lambda x, *a, _u=units[name], **k: x.shape[0] * _u))
    mixed, dense, n_run, rows = _mixed_then_dense(world, PartClock(clock=t), phase, monkeypatch)
    mixed = {part: v for part, v in mixed.items() if v}
    q, kv, hidden = attn.q_size, 2 * attn.kv_size, attn.o_proj.weight.shape[0]
    assert mixed == {"q": n_run * q, "kv": rows * kv, "o": n_run * hidden * 7, "mlp": n_run * units["mlp"],
                     "projector": (rows - n_run) * units["projector"]}
    assert dense == {"qkv": rows * (q + kv), "o": rows * hidden * 7, "mlp": rows * units["mlp"]}


class FakeEvent:
    """A CUDA timing event stood in for: recorded at the fake clock's time, complete once `done` says so."""

    def __init__(self, t: FakeClock, done, capture: list[bool]) -> None:
        self.t, self.done, self.at, self.capture = t, done, None, capture

    def record(self) -> None:
        self.at = self.t.now

    def query(self) -> bool:
        assert not self.capture[0], "an event queried while a graph is captured (illegal in CUDA)"
        return self.done(self)

    def elapsed_time(self, end: FakeEvent) -> float:  # milliseconds, as torch's
        return (end.at - self.at) * 1e3 + 5.0  # the device took 5 ms longer than the host's launches


def test_each_pass_is_timed_on_the_device_once_its_end_event_completes_and_never_in_a_graph_capture():
    """On a GPU the part clock records timing events around each pass and counts a pass's device time once its end
    event has completed, in order and without waiting (a pass still running is counted at a later pass); no event
    is recorded while a CUDA graph is captured. On CPU (no events) it keeps no device time."""
    t = FakeClock()
    complete: set[int] = set()
    made: list[FakeEvent] = []
    capture = [False]

    def event():
        made.append(FakeEvent(t, lambda e: id(e) in complete, capture))
        return made[-1]

    clock = PartClock(clock=t, events=event, capturing=lambda: capture[0])

    def work(seconds):
        def run():
            t.now += seconds
        return run

    clock.around_pass(Mode(decode=False), work(0.010))  # a prefill of 10 ms on the host, still on the device
    assert clock.device_passes == {} and len(made) == 2
    capture[0] = True
    clock.around_pass(Mode(decode=True), work(0.001))  # captured: no event recorded, none queried
    capture[0] = False
    assert len(made) == 2
    complete.add(id(made[1]))  # the prefill's end reached
    clock.around_pass(Mode(decode=True), work(0.002))  # settles the prefill; this decode still runs
    assert clock.device_passes == {"prefill": 1}
    assert clock.device_seconds["prefill"] == pytest.approx(0.015)
    complete.add(id(made[3]))
    clock.settle()
    att = clock.attestation()
    assert att["device_passes_total"] == {"prefill": 1, "decode": 1}
    assert att["errors"] == {}  # no event touched in the capture (the fakes' asserts would have stopped the spans)
    assert att["device_seconds_total"]["decode"] == pytest.approx(0.007)
    assert att["passes_total"] == {"prefill": 1, "decode": 2}  # the captured pass counted on the host alone
    cpu = PartClock(clock=t)
    cpu.around_pass(Mode(decode=True), work(0.001))
    assert cpu.attestation()["device_passes_total"] == {}


def test_a_clock_of_spans_alone_wraps_nothing_and_times_each_pass_whole_on_the_host_and_the_device():
    """`pass_spans` alone: no part is wrapped (the layers' calls run as they are), each pass's forward is its host
    span (`outside`), and a reader on another thread waits for the device's end of the passes timed so far and
    counts each of them (`read_device`), the last one too."""
    t = FakeClock()
    made: list[FakeEvent] = []
    waited: list[FakeEvent] = []
    capture = [False]

    def event():
        e = FakeEvent(t, lambda e: e in waited, capture)

        def synchronize():
            assert not capture[0], "an event waited for while a graph is captured (illegal in CUDA)"
            waited.append(e)

        e.synchronize = synchronize
        made.append(e)
        return e

    clock = PartClock(clock=t, events=event, parts=False)

    class Module:
        def forward(self):
            t.now += 1.0

    module = Module()
    original = module.forward
    clock.wrap(module, "forward", "glue", "routed")
    clock.install([], ())
    assert module.forward == original  # nothing wrapped

    def prefill():
        t.now += 0.004
        module.forward()

    clock.around_pass(Mode(decode=False), prefill, tokens=1024)
    assert clock.device_passes == {}  # the pass still runs on the device: counted at a later read
    assert clock.read_device() is True and waited == [made[1]]
    att = clock.attestation()
    assert att["parts"] is False and att["passes_total"] == {"prefill": 1} and att["tokens_total"] == {"prefill": 1024}
    assert att["seconds_total"] == {"prefill": {"outside": {"outside": pytest.approx(1.004)}}}
    assert att["device_passes_total"] == {"prefill": 1} and att["errors"] == {}
    assert att["device_seconds_total"]["prefill"] == pytest.approx(1.009)  # the fake device's 5 ms more


def test_a_routed_pass_is_counted_apart_as_well_so_a_hybrid_arms_dense_passes_are_the_totals_less_it():
    """A routed pass counts in the totals and again in `routed_total` (passes, tokens, its forward's host seconds,
    its device span once the device reached its end); a dense pass only in the totals."""
    t = FakeClock()
    capture = [False]
    waited = [0]  # the forward's thread computes 3/4 of each pass, and waits once a pass

    def usage():
        waited[0] += 1
        return 0.75 * t.now, waited[0] // 2, 0

    clock = PartClock(clock=t, events=lambda: FakeEvent(t, lambda e: True, capture), parts=False, usage=usage)

    def work(seconds):
        def run():
            t.now += seconds
        return run

    clock.around_pass(Mode(decode=False), work(0.040), tokens=1000)  # dense
    clock.around_pass(Mode(decode=False), work(0.060), tokens=2000, routed=True)
    clock.around_pass(Mode(decode=True), work(0.010), tokens=30, routed=True)
    clock.settle()
    att = clock.attestation()
    assert att["passes_total"] == {"prefill": 2, "decode": 1} and att["tokens_total"]["prefill"] == 3000
    routed = att["routed_total"]
    assert routed["passes_total"] == {"prefill": 1, "decode": 1}
    assert all(type(n) is int for f in ("passes_total", "tokens_total", "device_passes_total") for n in routed[f].values())
    assert routed["tokens_total"] == {"prefill": 2000, "decode": 30}
    assert routed["host_seconds_total"]["prefill"] == pytest.approx(0.060)
    assert routed["cpu_seconds_total"]["prefill"] == pytest.approx(0.045) and routed["waits_total"]["prefill"] == 1
    assert att["forward_thread"]["cpu_seconds_total"]["prefill"] == pytest.approx(0.075)
    assert att["forward_thread"]["waits_total"] == {"prefill": 2, "decode": 1}
    assert routed["device_passes_total"] == {"prefill": 1, "decode": 1}
    assert routed["device_seconds_total"]["prefill"] == pytest.approx(0.065)  # the fake device's 5 ms more
    assert att["device_seconds_total"]["prefill"] == pytest.approx(0.110)
    assert set(routed) == set(ROUTED_FIELDS)


def test_the_state_document_holds_the_device_span_of_every_pass_timed_before_it(tmp_path):
    """The runtime's state writer waits for the device's end of the passes its model's clock timed (outside its
    lock), then counts them: a reading after a request holds that request's last pass, not one pass behind."""
    import json

    from vskipper.arms import get_arm
    from vskipper.sglang.runtime import Runtime

    t = FakeClock()
    waited: list[FakeEvent] = []

    def event():
        e = FakeEvent(t, lambda e: e in waited, [False])
        e.synchronize = lambda: waited.append(e)
        return e

    runtime = Runtime(ServeSpec(get_arm("dense"), 0, 0, tmp_path / "state.json", pass_spans=True), "ddllama", (2,),
                      "test")
    clock = PartClock(clock=t, events=event, parts=False)
    runtime.model_counters["part_clock"] = clock.live()
    runtime.part_clock = clock

    def prefill():
        t.now += 0.002

    clock.around_pass(Mode(decode=False), prefill, tokens=64)  # the last pass: nothing after it settles it
    doc = json.loads(runtime.state_document())["part_clock"]
    assert doc["parts"] is False and doc["device_passes_total"] == {"prefill": 1}
    assert doc["device_seconds_total"]["prefill"] == pytest.approx(0.007)


@pytest.mark.parametrize("hook", ["around_decode_capture", "around_prefill_capture"])
def test_a_graph_capture_holds_the_state_and_the_clocks_timing_events_from_the_state_writer(monkeypatch, tmp_path,
                                                                                           hook):
    """SGLang's decode and prefill graph captures (the hooks around the graph runners' `capture`) run with the
    model's runtime taking no state document (which waits for the device's copies and timing events), the state
    writer's attempt refused, to be taken again after the capture: its read of the clock waits for no event and
    queries none meanwhile. Another model's capture holds nothing."""
    from types import SimpleNamespace

    from vskipper.arms import get_arm
    from vskipper.sglang import active, hooks
    from vskipper.sglang.runtime import GraphCapturing, Runtime

    t, capturing, waited = FakeClock(), [False], []

    def event():
        e = FakeEvent(t, lambda e: e in waited, capturing)  # its query refuses a capture

        def synchronize():
            assert not capturing[0], "an event waited for while a graph is captured (illegal in CUDA)"
            waited.append(e)

        e.synchronize = synchronize
        return e

    clock = PartClock(clock=t, events=event, parts=False)
    clock.around_pass(Mode(decode=True), lambda: None)  # a pass the device has not finished yet
    rt = Runtime(ServeSpec(get_arm("dense"), 0, 0, tmp_path / "state.json", pass_spans=True), "ddllama", (2,), "test")
    rt.model_counters["part_clock"] = clock.live()
    rt.part_clock = clock
    model = SimpleNamespace(part_clock=clock, runtime=rt, decode_graph_variants=lambda runner: None)
    monkeypatch.setattr(active, "_ACTIVE", [model])

    def capture(runner):
        capturing[0] = True
        try:
            with pytest.raises(GraphCapturing, match="being captured"):
                rt.write_state()
        finally:
            capturing[0] = False
        return "captured"

    (tmp_path / "state.json").unlink(missing_ok=True)  # the runtime's own first state, written when built
    assert getattr(hooks, hook)(capture, SimpleNamespace(model_runner=SimpleNamespace(model=model))) == "captured"
    assert waited == [] and clock.errors == {} and not (tmp_path / "state.json").exists()
    rt.write_state()  # after the capture: written, the pass read on the device
    assert len(waited) == 1 and clock.device_passes == {"decode": 1} and (tmp_path / "state.json").is_file()
    other = SimpleNamespace(model_runner=SimpleNamespace(model=object()))  # not this process's skipper model
    assert getattr(hooks, hook)(lambda runner: rt.write_state() or True, other) is True


def test_sglangs_metadata_glue_graph_captures_while_serving_with_the_state_held_and_runs_otherwise_unheld(
        monkeypatch, tmp_path):
    """SGLang's opt-in metadata glue graph (`MetadataGlueGraph`, the real class) captures in the serving loop, at a
    batch size's third decode replay: that run holds the skipper model's runtime from taking a state document, as
    the graph runners' captures do; its warm-up runs and its replays do not, so a state document meanwhile is
    written. CUDA's stream, graph and capture are stood in for (no GPU here); the glue's own state machine and
    the hook are SGLang's and vSkipper's."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.runner.metadata_glue_graph import MetadataGlueGraph

    from vskipper.arms import get_arm
    from vskipper.sglang import active, hooks
    from vskipper.sglang.runtime import GraphCapturing, Runtime

    capturing = [False]

    class Capture:
        def __init__(self, graph, stream=None) -> None:
            pass

        def __enter__(self):
            capturing[0] = True

        def __exit__(self, *exc):
            capturing[0] = False

    monkeypatch.setattr(torch.cuda, "Stream", object)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    rt = Runtime(ServeSpec(get_arm("dense"), 0, 0, tmp_path / "state.json", pass_spans=True), "ddllama", (2,), "test")
    monkeypatch.setattr(active, "_ACTIVE", [SimpleNamespace(runtime=rt)])
    written: list[str] = []

    class Backend:
        attn_backend_list = None
        forward_metadata = None

        def init_forward_metadata_out_graph(self, fb_view):
            try:
                rt.write_state()
                written.append("captured" if capturing[0] else "eager")
            except GraphCapturing:
                written.append("held")

    glue, backend = MetadataGlueGraph("cpu"), Backend()
    key = (4, "DECODE", "DECODE")
    assert hooks.glue_captures(glue, key) is False  # a key's first run warms up
    for _ in range(4):  # two warm-ups, the capture, a replay (the backend's prep is not run again)
        hooks.around_glue_graph_run(MetadataGlueGraph.run, glue, backend, None, key)
    assert written == ["eager", "eager", "held"] and not glue.disabled
    assert hooks.glue_captures(glue, key) is False  # captured: replays from now on
    glue.disabled = True  # a failed capture turns the glue off for good: its runs are eager, unheld
    assert hooks.glue_captures(glue, (8, "DECODE", "DECODE")) is False
    assert hooks.glue_captures(SimpleNamespace(), key) is True  # a glue kept otherwise: held to be safe


def test_the_writers_thread_reads_the_device_while_the_passes_go_on_and_waits_out_a_capture(tmp_path):
    """A real second thread as the state writer: it waits for the end of the passes timed so far and counts them
    while the forward's thread goes on timing passes; while that thread captures a graph it reads nothing, and
    reads again once the capture ends (`Runtime.capturing_graphs`)."""
    import threading

    from vskipper.arms import get_arm
    from vskipper.sglang.runtime import GraphCapturing, Runtime

    t = FakeClock()
    done = threading.Event()

    class Slow(FakeEvent):
        def synchronize(self) -> None:  # the device reaches the pass's end a little later
            done.wait(5)

    clock = PartClock(clock=t, events=lambda: Slow(t, lambda e: done.is_set(), [False]), parts=False)
    clock.around_pass(Mode(decode=True), lambda: None)
    reads: list[bool] = []
    writer = threading.Thread(target=lambda: reads.append(clock.read_device()))
    writer.start()
    for _ in range(3):  # the forward's thread is not held up by the reader's wait
        clock.around_pass(Mode(decode=True), lambda: None)
    assert writer.is_alive()  # still waiting for the device
    done.set()
    writer.join(5)
    assert reads == [True] and clock.device_passes["decode"] >= 1
    rt = Runtime(ServeSpec(get_arm("dense"), 0, 0, tmp_path / "state.json", pass_spans=True), "ddllama", (2,), "test")
    rt.part_clock = clock

    def document() -> None:
        try:
            rt.state_document()
            reads.append(True)
        except GraphCapturing:
            reads.append(False)

    with rt.capturing_graphs():
        late = threading.Thread(target=document)
        late.start()
        late.join(5)
    assert reads == [True, False]
    document()
    assert reads == [True, False, True]
    assert clock.device_passes["decode"] == 4 and clock.errors == {}


@pytest.mark.parametrize("fails", ["record", "query", "synchronize"])
def test_a_timing_event_that_fails_stops_the_device_spans_and_says_why_but_never_fails_the_pass(fails):
    """A failing timing event (its record, its query, or the reader's wait for it) stops the device's spans: the
    pass runs and is timed on the host, the passes after it too (no event made), and the attestation names the
    first error."""
    t = FakeClock()
    error = "CUDA error: an illegal memory access was encountered"

    class Broken(FakeEvent):
        def record(self) -> None:
            if fails == "record":
                raise RuntimeError(error)
            super().record()

        def query(self) -> bool:
            if fails == "query":
                raise RuntimeError(error)
            return False  # still running: only the reader's wait settles it

        def synchronize(self) -> None:
            if fails == "synchronize":
                raise RuntimeError(error)

    made: list[FakeEvent] = []

    def event():
        made.append(Broken(t, lambda e: True, [False]))
        return made[-1]

    clock = PartClock(clock=t, events=event, parts=False)
    ran = []
    clock.around_pass(Mode(decode=True), lambda: ran.append(1))
    assert clock.read_device() is False
    clock.around_pass(Mode(decode=True), lambda: ran.append(2))
    att = clock.attestation()
    assert ran == [1, 2] and att["passes_total"] == {"decode": 2} and len(made) == 2  # no event after the failure
    assert att["device_passes_total"] == {} and att["errors"] == {"device": f"RuntimeError: {error}"}
    assert clock.read_device() is False  # the spans stay stopped


def test_the_state_writers_thread_takes_the_models_gpu_and_touches_no_cuda_off_it(monkeypatch):
    """The state writer waits on the model's device (its copies, its timing events) from a thread of its own,
    whose CUDA calls would otherwise go to GPU 0: it makes the model's GPU its own first, and off CUDA does
    nothing."""
    from vskipper.sglang import runtime

    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    runtime.bind_device("cuda:1")
    runtime.bind_device("cpu")
    runtime.bind_device(None)
    assert bound == [torch.device("cuda:1")]



def test_the_state_writer_takes_the_models_device_when_it_starts_and_writes_on_if_it_cannot(monkeypatch, tmp_path,
                                                                                             capsys):
    """`StateWriter.run` binds the model's device first; where that fails it says so and goes on to its loop."""
    from vskipper.arms import get_arm
    from vskipper.sglang import runtime

    rt = runtime.Runtime(ServeSpec(get_arm("dense"), 0, 0, tmp_path / "state.json"), "ddllama", (2,), "test")
    rt.device = "cuda:1"
    calls = []

    def refuse(device):
        calls.append(("bind", device))
        raise RuntimeError(f"no {device} here")

    class Stop(Exception):
        pass

    others = runtime.read_state_request  # other tests' writer threads may still poll theirs

    def polled(base):  # the loop's first look for a request: the run ends here
        if base != tmp_path / "state.json":
            return others(base)
        calls.append(("poll", base))
        raise Stop

    monkeypatch.setattr(runtime, "bind_device", refuse)
    monkeypatch.setattr(runtime, "read_state_request", polled)
    with pytest.raises(Stop):
        runtime.StateWriter(rt).run()  # the thread's body, here in the test's thread
    assert calls == [("bind", "cuda:1"), ("poll", tmp_path / "state.json")]
    assert "the state writer could not take the model's device cuda:1: no cuda:1 here" in capsys.readouterr().err


def test_the_forward_threads_usage_is_the_kernels_account_of_the_calling_thread_alone():
    """`thread_usage` reads the calling thread's CPU seconds and context switches (Linux: RUSAGE_THREAD): a thread
    that computes gains CPU seconds, one that sleeps gains waits and next to no CPU, and another thread's work is
    not in it."""
    import threading
    import time

    if thread_usage() is None:
        pytest.skip("no per-thread usage on this platform")
    cpu0, _, _ = thread_usage()
    end = time.perf_counter() + 10.0
    while thread_usage()[0] - cpu0 < 0.02 and time.perf_counter() < end:  # computing, however busy the machine
        sum(range(1000))
    cpu1, waits1, _ = thread_usage()
    assert cpu1 - cpu0 >= 0.02
    for _ in range(5):
        time.sleep(0.002)  # waiting
    cpu2, waits2, _ = thread_usage()
    assert waits2 - waits1 >= 5 and cpu2 - cpu1 < 0.01
    other = threading.Thread(target=lambda: sum(range(3_000_000)))
    other.start()
    other.join()  # a wait of this thread's (the join), the other thread's CPU not in its account
    cpu3, _, _ = thread_usage()
    assert cpu3 - cpu2 < 0.02


def test_a_garbage_collection_inside_a_pass_is_charged_to_its_phase():
    """`gc_time` counts the interpreter's collections from `gc.callbacks` (a collection holds every thread), and
    the clock charges those that ran during a pass to the pass's phase."""
    import gc

    seconds, count = gc_time()
    gc.collect()
    after = gc_time()
    assert after[1] >= count + 1 and after[0] > seconds
    clock = PartClock(usage=None)
    clock.around_pass(Mode(decode=False), gc.collect, tokens=8)
    clock.around_pass(Mode(decode=True), lambda: None, tokens=1)
    thread = clock.attestation()["forward_thread"]
    assert thread["gc_collections_total"]["prefill"] >= 1 and thread["gc_seconds_total"]["prefill"] > 0
    # a decode pass that collected nothing, unless the interpreter's own thresholds set one off meanwhile
    assert thread["gc_collections_total"]["decode"] in (0, 1)


def test_the_clock_measures_what_a_wrapped_call_costs_the_host_without_counting_its_own_measurement():
    """`calibrate` times a wrapped call against the same call unwrapped on a scratch clock: a few microseconds on
    any host, and nothing of it in this clock's passes, parts or calls; `install` measures it."""
    clock = PartClock()
    cost = clock.calibrate(calls=500, rounds=3)
    assert 0.0 < cost < 1e-3 and clock.call_cost_s == cost
    assert clock.calls == {} and clock.passes == {} and clock.seconds == {}

    installed = PartClock()
    installed.install([], ())  # no layer to wrap: the measurement alone
    assert installed.call_cost_s is not None and installed.call_cost_s > 0.0


def test_a_failing_read_of_the_forward_threads_usage_never_fails_the_pass():
    """The thread's usage read before the pass or after it raises: the pass returns its result and is counted,
    the usage is read no more and the attestation says why; the device's spans are untouched."""
    t = FakeClock()
    reads = [0]

    def usage():
        reads[0] += 1
        if reads[0] == 2:
            raise OSError("getrusage went away")
        return t.now, 0, 0

    clock = PartClock(clock=t, usage=usage, collector=None)

    def run():
        t.now += 1.0
        return "logits"

    assert clock.around_pass(Mode(decode=True), run, tokens=4) == "logits"
    assert clock.around_pass(Mode(decode=True), run, tokens=4) == "logits"
    att = clock.attestation()
    assert att["passes_total"] == {"decode": 2} and reads[0] == 2 and clock.usage is None
    assert att["errors"] == {"thread": "OSError: getrusage went away"}
    assert att["forward_thread"]["cpu_seconds_total"] == {}
