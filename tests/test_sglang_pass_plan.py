"""Decode-graph readiness on CPU: a routed pass's per-row plan lives in static, model-owned buffers written
before the forward (`vskipper.mixed.plan_buffers`, `SkipperCausalLM.prepare_pass`); a routed pass never replays
a captured dense graph, and the passes replayed and run eagerly are counted per phase and mode
(`vskipper.sglang.replay`). No CUDA graph is captured here: the buffers' reuse is shown by two routed passes with
different routes through the same buffers, each equal to an eager pass with fresh tensors."""

from __future__ import annotations

import json
import time

import pytest
import torch
from sglang_layer_world import ARCHS, LayerWorld
from torch.utils._python_dispatch import TorchDispatchMode

from vskipper.mixed.plan_buffers import PlanBuffers
from vskipper.mixed.tape import tape_capacity
from vskipper.sglang.replay import ReplayLedger, RoutedReplayError

# -- the replay veto and its counts ----------------------------------------------------------------------------


def test_the_veto_refuses_a_routed_pass_a_graph_and_lets_a_dense_pass_replay():
    ledger = ReplayLedger({"decode": False})
    assert ledger.veto("decode", routed=True, graph_can_run=True) is False
    assert ledger.veto("decode", routed=False, graph_can_run=True) is True
    assert ledger.veto("decode", routed=True, graph_can_run=False) is False  # nothing to veto: not counted
    assert ledger.veto("prefill", routed=True, graph_can_run=True) is False
    assert ledger.vetoed == {"prefill": 1, "decode": 1}
    with_variant = ReplayLedger({"decode": True})
    assert with_variant.veto("decode", routed=True, graph_can_run=True) is True
    assert with_variant.vetoed == {"prefill": 0, "decode": 0}


def test_passes_are_counted_per_phase_and_mode_and_a_routed_replay_without_a_variant_is_an_error():
    ledger = ReplayLedger()
    ledger.record("decode", routed=False, replayed=True)
    ledger.record("decode", routed=False, replayed=True)
    ledger.record("decode", routed=True, replayed=False)
    ledger.record("prefill", routed=True, replayed=False)
    with pytest.raises(RoutedReplayError, match="routed decode pass replayed.*--cuda-graph-backend-decode"):
        ledger.record("decode", routed=True, replayed=True)
    with pytest.raises(ValueError, match="phase must be one of"):
        ledger.record("idle", routed=False, replayed=False)
    assert ledger.attestation() == {
        "passes_total": {"prefill": {"dense": {"replayed": 0, "eager": 0}, "routed": {"replayed": 0, "eager": 1}},
                         "decode": {"dense": {"replayed": 2, "eager": 0}, "routed": {"replayed": 0, "eager": 1}}},
        "routed_replays_vetoed_total": {"prefill": 0, "decode": 0},
        "routed_graph_variants": {"prefill": False, "decode": False}}
    ReplayLedger({"decode": True}).record("decode", routed=True, replayed=True)  # a captured routed variant


# -- the static plan buffers -----------------------------------------------------------------------------------


def test_plan_buffers_keep_their_storage_pad_past_the_rows_and_refuse_growth_once_frozen():
    buffers = PlanBuffers(6)
    ptrs = [buffers.req_rows.data_ptr(), buffers.request_keys.data_ptr(), buffers.dense_rows.data_ptr()]
    buffers.write(torch.tensor([3, 1, 2]), torch.tensor([7, 8, 9]), torch.tensor([False, True, False]))
    buffers.write(torch.tensor([0, 2]), torch.tensor([5, 6]))
    assert [buffers.req_rows.data_ptr(), buffers.request_keys.data_ptr(), buffers.dense_rows.data_ptr()] == ptrs
    assert buffers.req_rows.tolist() == [0, 2, 0, 0, 0, 0]
    assert buffers.request_keys.tolist() == [5, 6, 0, 0, 0, 0]
    assert buffers.dense_rows.tolist() == [False, False, True, True, True, True]  # padding RUNs
    assert buffers.valid.tolist() == [True, True, False, False, False, False]
    assert {k: v.tolist() for k, v in buffers.views().items()} == {
        "req_rows": [0, 2], "request_keys": [5, 6], "dense_rows": [False, False], "valid": [True, True]}
    with pytest.raises(ValueError, match="'req_rows' has 2 rows, request_keys has 1"):
        buffers.write(torch.tensor([0, 2]), torch.tensor([5]))
    buffers.write(torch.arange(8), torch.arange(8))  # eager: grows, to twice the capacity
    assert buffers.capacity == 12 and buffers.valid.tolist() == [True] * 8 + [False] * 4
    buffers.write(torch.arange(30), torch.arange(30))  # or to the pass
    assert buffers.capacity == 30
    buffers.frozen = True
    with pytest.raises(ValueError, match="31 rows exceeds the plan buffers' capacity 30"):
        buffers.write(torch.arange(31), torch.arange(31))


class _Writes(TorchDispatchMode):
    """The copies and fills that land in `storage` (a byte tensor), by the op's name."""

    def __init__(self, storage: torch.Tensor) -> None:
        super().__init__()
        self.lo, self.hi = storage.data_ptr(), storage.data_ptr() + storage.numel()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("copy_", "fill_") and self.lo <= args[0].data_ptr() < self.hi:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_a_staged_plan_reaches_the_device_storage_in_one_copy_and_equals_the_plan_written_in_place():
    """Off the host the plan is staged on the host and copied once into the storage the fields view; a field
    handed over on the device adds its own copy. Any sequence of passes leaves the same fields, padding
    included, as writing in place, and as one write into fresh buffers (a write without request slots: every
    other field), and the fields' addresses never move once frozen."""
    gen = torch.Generator().manual_seed(0)
    staged, in_place = PlanBuffers(8, staged=True), PlanBuffers(8, staged=False)
    staged.frozen = True
    ptrs = [getattr(staged, f).data_ptr() for f in ("req_rows", "request_keys", "dense_rows", "valid")]
    for i, rows in enumerate((5, 5, 2, 8, 1, 1, 7, 3, 6, 6, 2, 4)):
        req = None if i in (3, 5, 6, 9) else torch.randint(0, 50, (rows,), generator=gen)
        keys = torch.randint(0, 2**40, (rows,), generator=gen)
        dense = None if rows % 2 or i in (8, 9) else torch.rand(rows, generator=gen) < 0.5
        with _Writes(staged.storage) as writes:
            staged.write(req, keys, dense)
        assert writes.ops == ["copy_"]
        in_place.write(req, keys, dense)
        fresh = PlanBuffers(8)
        fresh.write(req, keys, dense)
        for field in ("request_keys", "dense_rows", "valid") + (("req_rows",) if req is not None else ()):
            assert torch.equal(getattr(staged, field), getattr(in_place, field)), (rows, field)
            assert torch.equal(getattr(in_place, field), getattr(fresh, field)), (rows, field)
    assert [getattr(staged, f).data_ptr() for f in ("req_rows", "request_keys", "dense_rows", "valid")] == ptrs
    device_rows = torch.tensor([4, 5, 6]).as_subclass(_DeviceTensor)  # stands in for a tensor off the host
    with _Writes(staged.storage) as writes:
        staged.write(device_rows, torch.tensor([1, 2, 3]))
    assert writes.ops == ["copy_", "copy_"]  # the staged copy, then the device field into its view
    assert staged.req_rows.tolist() == [4, 5, 6, 0, 0, 0, 0, 0] and staged.valid.sum() == 3


def test_a_plan_whose_keys_and_dense_rows_are_the_last_writes_tensors_rewrites_only_its_request_slots():
    """A decode batch whose requests did not change hands the runtime's same host tensors again: the buffers
    then write only the request slots (off the host, from the device: no staging, no host-to-device copy), and
    the fields equal a full write's. A new tensor, equal or not, or another row count writes in full."""
    keys, dense = torch.tensor([7, 8, 9]), torch.tensor([False, True, False])
    for staged in (False, True):
        buffers, fresh = PlanBuffers(6, staged=staged), PlanBuffers(6, staged=staged)
        slots = torch.tensor([3, 1, 2])
        buffers.write(slots if not staged else slots.as_subclass(_DeviceTensor), keys, dense)
        for req in ([4, 0, 5], [1, 1, 1]):
            req = torch.tensor(req)
            with _Writes(buffers.storage) as writes:
                buffers.write(req if not staged else req.as_subclass(_DeviceTensor), keys, dense)
            assert writes.ops == ["copy_"], (staged, writes.ops)  # the request slots alone
            fresh.write(req, keys.clone(), dense.clone())
            for field in ("req_rows", "request_keys", "dense_rows", "valid"):
                assert torch.equal(getattr(buffers, field), getattr(fresh, field)), (staged, field)
        with _Writes(buffers.storage) as writes:
            buffers.write(torch.tensor([0, 1, 2]), keys.clone(), dense)  # new keys, though equal: written
        assert len(writes.ops) == (1 if staged else 3), (staged, writes.ops)  # the staged copy, or each field
        with _Writes(buffers.storage) as writes:
            buffers.write(torch.tensor([0, 1]), keys[:2], None)  # another row count: written, padding included
        assert writes.ops == ["copy_"] if staged else len(writes.ops) >= 3, (staged, writes.ops)
        assert buffers.request_keys.tolist()[:3] == [7, 8, 0] and buffers.valid.tolist()[:3] == [True, True, False]


def test_the_host_staging_stays_on_the_host_when_the_model_is_built_under_a_default_device():
    """SGLang's loader builds the model with its device as torch's default device (`with torch.device(...)`): on a
    GPU, staging tensors allocated without a device went to the GPU, where torch refuses to pin them ("Only dense
    CPU tensors can be pinned", the server's start failed). The staging is placed on the host explicitly. ('meta'
    stands in for the GPU: no GPU runs here.)"""
    with torch.device("meta"):
        buffers = PlanBuffers(8, "meta", staged=True)
    assert buffers.storage.device.type == "meta"
    assert [stage.storage.device.type for stage in buffers._stages] == ["cpu"] * len(buffers._stages)


class _DeviceTensor(torch.Tensor):
    @property
    def device(self):
        return torch.device("meta")


def test_an_eager_plan_writes_no_request_slots_and_only_what_changed():
    """Without request slots a standing plan writes nothing, and a plan without dense-mode rows fills none of
    the rows already False (only those the padding had set). An eager decode pass whose requests stand reads
    SGLang's slots where they lie and writes nothing at all; slots the kernels could not read as the buffers'
    field would hold them are written there."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from vskipper.sglang.models.routed import SkipperCausalLM
    from vskipper.sglang.runtime import Step

    buffers = PlanBuffers(6)
    keys = torch.tensor([7, 8, 9])
    for expected, write in ((["copy_", "fill_", "fill_"], keys),  # keys, dense-mode rows False, valid rows
                            ([], keys),  # standing
                            (["copy_"], torch.tensor([1, 2, 3])),  # new keys; the dense-mode rows stay False
                            (["copy_"] + ["fill_"] * 4, torch.tensor([1, 2])),  # fewer rows: row 2's padding
                            (["copy_", "fill_", "fill_"], torch.tensor([1, 2, 3]))):  # row 2 False, valid again
        with _Writes(buffers.storage) as writes:
            buffers.write(None, write)
        assert writes.ops == expected, (write.tolist(), writes.ops)
    assert buffers.dense_rows.tolist() == [False] * 3 + [True] * 3 and buffers.valid.sum() == 3
    model = SimpleNamespace(buffers=PlanBuffers(8), graph_buffers=None,
                            runtime=SimpleNamespace(on_graph_tape=lambda step: False))
    slots, dense = torch.tensor([4, 1, 6]), torch.tensor([False, True, False])
    fb = SimpleNamespace(req_pool_indices=slots, forward_mode=ForwardMode.DECODE)
    for expected in (["copy_", "copy_", "fill_"], []):  # keys, dense-mode rows, valid rows; then nothing
        step = Step("decode", True, rows=3, keys=keys, dense_rows=dense, context=5)
        with _Writes(model.buffers.storage) as writes:
            plan = SkipperCausalLM.write_plan(model, fb, step)
        assert writes.ops == expected and plan.req_rows is slots and plan.context == 5
        assert step.keys.tolist() == [7, 8, 9] and step.dense_rows.tolist() == [False, True, False]
    # slots the kernels could not read as the buffers' field (int32, strided, unaligned): the buffers take them
    for odd in (slots.to(torch.int32), torch.tensor([4, 0, 1, 0, 6])[::2], torch.tensor([0, 4, 1, 6])[1:]):
        fb = SimpleNamespace(req_pool_indices=odd, forward_mode=ForwardMode.DECODE)
        step = Step("decode", True, rows=3, keys=keys, dense_rows=dense, context=5)
        plan = SkipperCausalLM.write_plan(model, fb, step)
        assert plan.req_rows.data_ptr() == model.buffers.req_rows.data_ptr() and plan.req_rows.tolist() == [4, 1, 6]


def test_an_eager_prefill_plan_reads_its_request_slots_where_they_lie_on_the_models_device():
    """An eager pass needs no fixed address: where its request slots are on the buffers' device (SGLang's own,
    expanded on the device; or a CPU batch's, expanded on the host), `write_plan` hands them to the pass as they
    are and the buffers take only the keys (and dense-mode rows) in the one staged copy. Where `plan_pass` expands
    them on the host off the device (SGLang's host mirrors), they ride in that one copy. (The staged buffers stand
    for a GPU's: their device says 'meta', their storage stays on the host, so that the test reads it.)"""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from vskipper.sglang.models.routed import SkipperCausalLM
    from vskipper.sglang.runtime import Step

    on_device = torch.tensor([2, 5]).as_subclass(_DeviceTensor)
    for mirrors in (True, False):
        buffers = PlanBuffers(8, staged=True)
        buffers.device = torch.device("meta")
        model = SimpleNamespace(buffers=buffers, graph_buffers=None,
                                runtime=SimpleNamespace(on_graph_tape=lambda step: False))
        fb = SimpleNamespace(req_pool_indices=on_device, extend_seq_lens=torch.tensor([3, 1]),
                             req_pool_indices_cpu=torch.tensor([2, 5]) if mirrors else None,
                             extend_seq_lens_cpu=[3, 1] if mirrors else None, forward_mode=ForwardMode.EXTEND)
        step = Step("prefill", True, rows=4, keys=torch.tensor([7, 7, 7, 9]))
        with _Writes(buffers.storage) as writes:
            plan = SkipperCausalLM.write_plan(model, fb, step)
        assert writes.ops == ["copy_"]  # the staged copy alone
        assert plan.req_rows.tolist() == [2, 2, 2, 5] and step.keys.tolist() == [7, 7, 7, 9]
        assert buffers.req_rows.tolist()[:4] == ([2, 2, 2, 5] if mirrors else [0] * 4)
        assert (plan.req_rows.data_ptr() == buffers.req_rows.data_ptr()) is mirrors
    # a CPU batch on CPU buffers (written in place): the slots expanded on the host, read where they lie
    model = SimpleNamespace(buffers=PlanBuffers(8), graph_buffers=None,
                            runtime=SimpleNamespace(on_graph_tape=lambda step: False))
    fb = SimpleNamespace(req_pool_indices=torch.tensor([2, 5]), extend_seq_lens=torch.tensor([3, 1]),
                         extend_seq_lens_cpu=[3, 1], forward_mode=ForwardMode.EXTEND)
    step = Step("prefill", True, rows=4, keys=torch.tensor([7, 7, 7, 9]), dense_rows=torch.tensor([0, 0, 0, 1]) > 0)
    with _Writes(model.buffers.storage) as writes:
        plan = SkipperCausalLM.write_plan(model, fb, step)
    assert writes.ops == ["copy_", "copy_", "fill_"]  # keys, dense-mode rows, the valid rows
    assert plan.req_rows.tolist() == [2, 2, 2, 5] and model.buffers.req_rows.tolist()[:4] == [0] * 4
    assert step.dense_rows.tolist() == [False, False, False, True] and plan.read_pairs == 0
    # one request (3 new tokens after 2 cached): its causal read's pairs over the whole sequence go with the plan,
    # which the sized read decides by
    fb = SimpleNamespace(req_pool_indices=torch.tensor([5]), extend_seq_lens=torch.tensor([3]),
                         extend_seq_lens_cpu=[3], seq_lens_cpu=torch.tensor([5]), forward_mode=ForwardMode.EXTEND)
    plan = SkipperCausalLM.write_plan(model, fb, Step("prefill", True, rows=3, keys=torch.tensor([9, 9, 9])))
    assert plan.req_rows.tolist() == [5, 5, 5] and plan.read_pairs == 5 * 6 // 2


# -- two routed decode passes through the same buffers ---------------------------------------------------------

PROMPTS = {0: 6, 1: 4, 2: 5, 3: 7}


@pytest.fixture(scope="module", params=ARCHS)
def world(request, tmp_path_factory):
    return LayerWorld.prefilled(request.param, tmp_path_factory.mktemp("plan"), 11, PROMPTS)


def _routed_pass(world: LayerWorld, x, keys, dense, buffers: PlanBuffers | None, skipper=None):
    """One routed decode pass of every request, RandomSkip(r=1, d=0.5) on this layer, dense-mode rows `dense`.
    With `buffers` the plan (request slots, keys, dense rows) is written into them and the pass reads their
    views; without, it reads fresh tensors. Returns the output, the tape's run mask and this layer's KV; the
    world's KV state is restored."""
    from vskipper.mixed.cohorts import CohortBuilder
    from vskipper.mixed.tape import RouteTape
    from vskipper.sglang.models.routed import PassPlan, plan_pass
    from vskipper.sglang.runtime import Step
    from vskipper.skippers.base import BatchContext
    from vskipper.skippers.random_skip import RandomSkip

    kv0, lengths0 = world.kv(), list(world.lengths)
    fb = world.batch({r: 1 for r in PROMPTS})
    rows = x.shape[0]
    planned = plan_pass(fb, rows)
    if buffers is None:
        req_rows, keys_v, dense_v = planned.req_rows.clone(), keys.clone(), dense.clone()
    else:
        buffers.write(planned.req_rows, keys, dense)
        v = buffers.views(rows)
        req_rows, keys_v, dense_v = v["req_rows"], v["request_keys"], v["dense_rows"]
    lid = world.layer.layer_id
    skipper = skipper or RandomSkip(r=1.0, d=0.5, seed=3)
    tape = RouteTape(rows, (lid,))
    step = Step("decode", True, skipper, None, tape, CohortBuilder(rows), dense_v, rows, keys=keys_v)
    step.state = skipper.prepare_batch(BatchContext(x, torch.ones(rows, dtype=torch.bool), (lid,), "decode",
                                                    keys_v, fb.positions))
    world.slot.step, world.slot.plan = step, PassPlan(req_rows, planned.context)
    try:
        with world.context(), torch.no_grad():
            y = world.layer.mixed_depth(step, fb.positions, x, fb).output()
        return y, tape.run[0, :rows].clone(), world.kv()
    finally:
        world.slot.step = world.slot.plan = None
        world.restore(kv0, lengths0)


def test_two_routed_decode_passes_through_the_same_static_buffers_equal_eager_passes(world):
    buffers = PlanBuffers(8)
    ptr = buffers.request_keys.data_ptr()
    x = world.hidden(4)
    passes = [(torch.tensor([11, 12, 13, 14]), torch.tensor([False, False, True, False])),
              (torch.tensor([901, 902, 903, 904]), torch.tensor([False, False, False, False]))]
    runs = []
    for keys, dense in passes:
        y_static, run_static, kv_static = _routed_pass(world, x, keys, dense, buffers)
        y_eager, run_eager, kv_eager = _routed_pass(world, x, keys, dense, None)
        assert torch.equal(run_static, run_eager)
        assert run_static[dense].all()  # the dense-mode row read from the buffers RUNs
        torch.testing.assert_close(y_static, y_eager, rtol=0, atol=0)
        torch.testing.assert_close(kv_static, kv_eager, rtol=0, atol=0)
        runs.append(run_static)
    assert buffers.request_keys.data_ptr() == ptr
    assert not torch.equal(runs[0], runs[1])  # the second pass routed differently through the same buffers
    assert (~runs[0]).any() and (~runs[1]).any()


def test_a_routed_decode_graph_captured_from_static_storage_replays_each_later_plan_as_its_eager_pass(world,
                                                                                                      tmp_path):
    """What SGLang's decode graph runner captures for the routed variant (`SkipperCausalLM.capture_pass`): the
    layer run once more with the capture step, built a single time over the frozen graph plan buffers and the
    runtime's graph tape, after each later pass's plan was written into them, as a replay does. With the triton
    execution (the one captured on CUDA; here under TRITON_INTERPRET=1, no CUDA graph), each such "replay" equals
    that pass run eagerly with fresh tensors and the torch execution; the pass's own step counts its routes from
    the graph tape the capture step wrote."""
    from vskipper.arms import get_arm
    from vskipper.sglang.models import routed as served
    from vskipper.sglang.models.routed import PassPlan, plan_pass
    from vskipper.sglang.runtime import Runtime
    from vskipper.sglang.spec import ServeSpec

    lid, rows = world.layer.layer_id, len(PROMPTS)
    rt = Runtime(ServeSpec(get_arm("random-r75-d50-always"), 0, 0, tmp_path / "state.json"),
                 world.config.model_type, (lid,), "test")
    rt.reserve_graph_tape(8, torch.float32, "cpu")
    assert rt._graph_tape.capacity % 16 == 0  # each layer's row 16-byte aligned, for the kernels writing it
    graph_buffers = PlanBuffers(8)
    graph_buffers.frozen = True
    views = graph_buffers.views(rows)
    capture = rt.capture_step(rows, views["dense_rows"], views["request_keys"])
    capture_plan = PassPlan(views["req_rows"], 0)
    x = world.hidden(rows)
    runs = []
    for keys, dense in ((torch.tensor([11, 12, 13, 14]), torch.tensor([False, True, False, False])),
                        (torch.tensor([901, 902, 903, 904]), torch.tensor([False] * 4))):
        # The pass as the runtime decides it: its step records on the graph tape, its plan goes to the buffers.
        step = rt._step("decode", rows, torch.float32, "cpu", ~dense, keys, False)
        assert rt.on_graph_tape(step)
        kv0, lengths0 = world.kv(), list(world.lengths)
        fb = world.batch({r: 1 for r in PROMPTS})
        graph_buffers.write(plan_pass(fb, rows).req_rows, step.keys, step.dense_rows)
        world.slot.execution = served.cohort_execution([world.layer], torch.device("cpu"), "triton")
        world.slot.step, world.slot.plan = capture, capture_plan
        try:
            with world.context(), torch.no_grad():
                rt.prepare_state(capture, x, fb.positions)
                y_replay = world.layer.mixed_depth(capture, fb.positions, x, fb).output()
            kv_replay = world.kv()
        finally:
            world.slot.step = world.slot.plan = None
            world.slot.execution = served.TORCH_EXECUTION
            world.restore(kv0, lengths0)
        y_eager, run_eager, kv_eager = _routed_pass(world, x, keys, dense, None, skipper=rt.skipper)
        torch.testing.assert_close(y_replay, y_eager, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv_replay, kv_eager, rtol=1e-4, atol=1e-4)
        assert torch.equal(step.tape.run[0, :rows], run_eager)
        assert step.tape.run_counts(rows).tolist() == [int(run_eager.sum())]
        runs.append(run_eager)
    assert not torch.equal(runs[0], runs[1]) and (~runs[0]).any() and (~runs[1]).any()
    with pytest.raises(ValueError, match="which a captured graph holds"):
        graph_buffers.write(torch.zeros(9, dtype=torch.int64), torch.zeros(9, dtype=torch.int64))
    eager = rt._step("decode", 9, torch.float32, "cpu", torch.ones(9, dtype=torch.bool),
                     torch.arange(9), False)
    assert not rt.on_graph_tape(eager)  # above the largest captured batch: the eager tape


def test_the_decode_graph_runner_gets_a_routed_variant_only_for_an_arm_routing_decode_where_one_can_be_captured(
        tmp_path):
    """`SkipperCausalLM.decode_graph_variants`, called before SGLang captures: static storage for the largest
    captured batch, the variant of each pass by its mode; nothing for a dense arm, a blocked execution or a
    speculative runner (their routed passes stay eager through the veto)."""
    from types import SimpleNamespace

    from vskipper.arms import get_arm
    from vskipper.sglang.models import routed as served
    from vskipper.sglang.runtime import Runtime, Step
    from vskipper.sglang.spec import ServeSpec

    def model(arm: str, blocker=None):
        rt = Runtime(ServeSpec(get_arm(arm), 0, 0, tmp_path / f"{arm}.json"), "ddllama", (2,), "test")
        m = SimpleNamespace(runtime=rt, graph_blocker=blocker, graph_buffers=None, ledger=ReplayLedger(),
                            slot=served.StepSlot(),
                            model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=torch.zeros(1))))
        m.pass_is_routed = lambda fb: served.SkipperCausalLM.pass_is_routed(m, fb)
        return m

    runner = SimpleNamespace(capture_bs=[1, 2, 4, 8, 6], captured_req_width=1)
    routed = model("random-r75-d50-always")
    variants = served.SkipperCausalLM.decode_graph_variants(routed, runner)
    assert variants.capture_labels == (served.DENSE_VARIANT, served.ROUTED_VARIANT)
    assert routed.graph_buffers.capacity == 8 and routed.graph_buffers.frozen
    assert routed.ledger.routed_graphs == {"prefill": False, "decode": True}
    capture = routed.runtime.capture_step(8, torch.zeros(8, dtype=torch.bool), torch.zeros(8))
    assert capture.tape is routed.runtime._graph_tape  # the largest captured batch's, its rows 16-byte aligned
    assert capture.tape.capacity == tape_capacity(8) and routed.runtime._graph_rows == 8
    fb = object()
    assert variants.select(fb) == served.DENSE_VARIANT  # nothing prepared (a capture or an idle pass)
    for is_routed, label in ((True, served.ROUTED_VARIANT), (False, served.DENSE_VARIANT)):
        routed.slot.prepared = served.PreparedPass(fb, Step("decode", is_routed), None)
        assert variants.select(fb) == label
    for m, r in ((model("dense"), runner), (model("prefill-only"), runner),
                 (model("always-route", "no CUDA graphs on cpu"), runner),
                 (model("always-route"), SimpleNamespace(capture_bs=[4], captured_req_width=3))):
        assert served.SkipperCausalLM.decode_graph_variants(m, r) is None
        assert m.graph_buffers is None and not m.ledger.routed_graphs["decode"]
    with pytest.raises(RuntimeError, match="no graph tape holds a routed decode graph of 9 rows"):
        routed.runtime.capture_step(9, torch.zeros(9, dtype=torch.bool), torch.zeros(9))


# -- in a server -----------------------------------------------------------------------------------------------


@pytest.mark.server  # real SGLang servers
def test_a_served_routed_arm_plans_every_pass_before_the_forward_and_counts_them_eager(shared_servers):
    """Through SGLang's own ModelRunner.forward: every pass's plan is written before the forward (none in it),
    no routed pass replays, and the per-mode counts of eager passes equal the runtime's pass counts (totals since
    the shared server started, whatever other tests sent it)."""
    server = shared_servers.get("always-route")["always-route"]
    before = server.get_json("/vskipper/attestation")["passes_total"]["decode"]["routed"]
    for prompt in ([5, 6, 7, 8], [9, 10, 11, 12, 13, 14]):
        assert len(server.generate_ids(prompt, 6)) == 6
    deadline = time.monotonic() + 30
    while True:
        att = server.get_json("/vskipper/attestation")
        if att["passes_total"]["decode"]["routed"] - before >= 10 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    writes = att["plan_writes_total"]
    assert writes["in_forward"] == 0 and writes["before_forward"] > 0, json.dumps(writes)
    for phase in ("prefill", "decode"):
        assert att["graph_passes_total"][phase]["routed"] == {"replayed": 0,
                                                              "eager": att["passes_total"][phase]["routed"]}
        assert att["graph_passes_total"][phase]["dense"]["replayed"] == 0
    assert att["passes_total"]["decode"]["routed"] - before >= 10
    assert att["routed_replays_vetoed_total"] == {"prefill": 0, "decode": 0}  # graphs are off on CPU
    execution = att["execution"]
    assert att["routed_graph_variants"] == {"prefill": False, "decode": False}
    assert execution["cuda_graphs"]["routed_variant"] == "none: routed passes run eagerly (no CUDA graphs on cpu)"
    assert execution["routed_layers_backend"] == {"decode": "torch", "decode_read": "backend", "prefill": "torch",
                                                 "prefill_read": "sized", "tiles": None}
