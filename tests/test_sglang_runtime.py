"""The scheduler-side runtime without a server: per-request modes from the mode switch, counters, state file.

SGLang's ForwardBatch is stood in by a plain object carrying the fields the runtime reads (forward mode, request
ids, sequence lengths, extend lengths); everything else is the real runtime, switch, skipper and tape.
"""

from __future__ import annotations

import json
import platform
import re
import zlib
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch

from vskipper.arms import Arm, get_arm
from vskipper.constants import CONSTANTS
from vskipper.sglang.admission import AdmissionLimits
from vskipper.sglang.runtime import Runtime
from vskipper.sglang.spec import ServeConfigError, ServeSpec, check_arm_for_model
from vskipper.skippers.base import LayerRoute


@dataclass
class _Mode:
    decode: bool

    def is_decode(self) -> bool:
        return self.decode

    def is_extend(self) -> bool:
        return not self.decode


@dataclass
class Batch:
    forward_mode: _Mode
    rids: list
    seq_lens_cpu: torch.Tensor
    extend_seq_lens_cpu: list | None = None

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.seq_lens_cpu

    @property
    def batch_size(self) -> int:
        return len(self.rids)


def prefill(rids, lens, extend=None):
    return Batch(_Mode(False), list(rids), torch.tensor(lens), list(extend or lens))


def decode(rids, lens):
    return Batch(_Mode(True), list(rids), torch.tensor(lens))


def run_pass(rt: Runtime, batch: Batch, layers=(2, 3), on_tape: bool = False, padding: int = 0):
    """One pass through the runtime, its routes recorded as the torch execution records them, or (`on_tape`)
    by the triton execution's maps launches, which also write each layer's counts into the tape; `padding` rows
    past the pass as a replayed graph's (dense: RUN), covered by the maps."""
    rows = sum(batch.extend_seq_lens_cpu) if not batch.forward_mode.is_decode() else len(batch.rids)
    hidden = torch.randn(rows, 8)
    step = rt.plan(batch, hidden, torch.arange(rows))
    if step.routed:
        for layer in layers:
            route = step.skipper.route(layer, hidden, step.state, None)
            if not on_tape:
                step.tape.record(layer, route, step.dense_rows)
                continue
            dense = step.dense_rows if step.dense_rows is not None else torch.zeros(rows, dtype=torch.bool)
            padded = LayerRoute(torch.cat([route.run_mask.reshape(-1), torch.zeros(padding, dtype=torch.bool)]),
                                torch.cat([route.weights.reshape(-1), torch.ones(padding)]))
            step.builder.record_and_build(step.tape, layer, padded, torch.cat([dense, torch.ones(padding) > 0]))
    rt.finish(step, on_tape=on_tape)
    return step


def runtime(arm: Arm, tmp_path, enter=0, exit_=0) -> Runtime:
    return Runtime(ServeSpec(arm, enter, exit_, tmp_path / "state.json"), "ddllama", (2, 3), "DDLlamaForCausalLM")


def test_hybrid_decode_routes_from_the_enter_crossing_and_promotes_running_requests_once(tmp_path):
    arm = Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}})
    rt = runtime(arm, tmp_path, enter=100, exit_=50)
    run_pass(rt, prefill(["a"], [40]))
    assert not run_pass(rt, decode(["a"], [41])).routed  # V 41 < enter
    step = run_pass(rt, decode(["a", "b"], [60, 45]))  # V 105 >= enter: routing on, a promoted, b starts routed
    assert step.routed and step.dense_rows is None
    att = rt.attestation()
    assert att["promotions_total"] == 1
    assert att["passes_total"]["decode"] == {"dense": 1, "routed": 1}
    assert att["rows_total"]["decode"] == {"run": 2, "project_only": 2}  # ratio 0.5 of 2 layers, 2 rows
    assert att["rows_per_layer_total"] == {"2": {"run": 2, "project_only": 0}, "3": {"run": 0, "project_only": 2}}


def test_a_steady_decode_batch_hands_the_same_plan_tensors_until_its_requests_change(tmp_path):
    """While a decode batch's requests stand, its steps carry the same host tensors of request keys and
    dense-mode rows (the plan buffers then rewrite only the request slots) and the longest request's tokens,
    read once; a request joining builds new ones."""
    rt = runtime(Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}}), tmp_path)
    first = run_pass(rt, decode(["a", "b"], [60, 45]))
    again = run_pass(rt, decode(["a", "b"], [61, 46]))
    assert first.routed and again.keys is first.keys and (again.context, first.context) == (61, 60)
    joined = run_pass(rt, decode(["a", "b", "c"], [62, 47, 9]))
    assert joined.keys is not first.keys and joined.keys.tolist()[:2] == first.keys.tolist()
    # A batch with dense-mode rows: its dense rows are built once while its routed flags stand.
    routed, keys = torch.tensor([True, False, True]), torch.tensor([1, 2, 3])
    steps = [rt._step("decode", 3, torch.float32, "cpu", flags, keys, False) for flags in (routed, routed)]
    assert steps[0].dense_rows.tolist() == [False, True, False] and steps[1].dense_rows is steps[0].dense_rows
    assert rt._step("decode", 3, torch.float32, "cpu", routed.clone(), keys, False).dense_rows is not \
        steps[0].dense_rows


def test_a_routed_pass_is_counted_once_its_tape_counts_reach_the_host_and_the_state_file_waits_for_them(tmp_path):
    """The forward's pass never waits for its own counts: the attestation counts those copied by the time it is
    read, and a state document counts every pass still in flight first (`Runtime.state_document`)."""
    from types import SimpleNamespace

    from test_mixed_deferred import ManualReads

    arm = Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}})
    rt = runtime(arm, tmp_path)
    rt._route_reads = reads = ManualReads()
    rt._writer = SimpleNamespace(changed=lambda: None)  # the state writer thread, never due here
    run_pass(rt, decode(["a", "b"], [60, 45]))
    att = rt.attestation()
    assert att["passes_total"]["decode"]["routed"] == 1
    assert att["rows_total"]["decode"] == {"run": 0, "project_only": 0} and len(reads) == 1
    reads.events[0].done = True
    run_pass(rt, decode(["a", "b"], [61, 46]))  # takes the first pass's counts; its own are on their way
    assert rt.attestation()["rows_total"]["decode"] == {"run": 2, "project_only": 2} and len(reads) == 1
    lock_held = []
    for event in reads.events[1:]:  # the second pass's copy, still in flight: the document waits for it
        event.synchronize = lambda event=event: (lock_held.append(rt._state_lock._is_owned()),
                                                 setattr(event, "done", True))
    document = json.loads(rt.state_document())
    assert document["rows_total"]["decode"] == {"run": 4, "project_only": 4} and len(reads) == 0
    # waited for outside the lock the forward's thread takes to count each pass (it would stall that thread)
    assert lock_held == [False]
    assert document["rows_per_layer_total"] == {"2": {"run": 4, "project_only": 0},
                                                "3": {"run": 0, "project_only": 4}}


def _counted_pass_by_pass(passes) -> dict:
    """The counters of routed passes, each pass and layer counted on its own (the obvious reference)."""
    from collections import Counter

    from vskipper.sglang.runtime import COHORT_BUCKETS

    rows = {p: {"run": 0, "project_only": 0} for p in ("prefill", "decode")}
    per_layer, sizes = {}, Counter()
    for run, routes in passes:
        for layer, n_run in zip(routes.layers, run, strict=True):
            per = per_layer.setdefault(layer, {"run": 0, "project_only": 0})
            per["run"] += n_run - routes.dense_count
            per["project_only"] += routes.rows - n_run
            rows[routes.phase]["run"] += n_run - routes.dense_count
            rows[routes.phase]["project_only"] += routes.rows - n_run
            sizes[next((f"le_{b}" for b in COHORT_BUCKETS if n_run <= b), "gt_1024")] += 1
    return {"rows": rows, "rows_per_layer": per_layer, "cohort_sizes": dict(sizes)}


def test_routed_passes_are_counted_together_as_each_pass_and_layer_counted_alone(tmp_path, monkeypatch):
    """Passes whose counts reached the host wait and are counted in one reduction: per phase and layer, with
    dense-mode rows left out of the RUN rows and in the cohort sizes (bucket edges and past the last), exactly
    as counting each pass and layer alone; probe passes' shares reach the switch in the order they ran."""
    from vskipper.sglang.runtime import FOLD_PASSES, PassRoutes

    rt = runtime(Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}}), tmp_path)
    shares = []
    monkeypatch.setattr(rt.switch, "record_prefill_share", lambda share, when: shares.append((share, when)))
    passes = [([4, 0], PassRoutes("decode", (2, 3), 4, 0, False, 1.0)),
              ([3, 1], PassRoutes("decode", (2, 3), 4, 1, False, 2.0)),  # one dense-mode row (RUN on the tape)
              ([1025, 2], PassRoutes("prefill", (2, 3), 1030, 2, True, 3.0)),
              ([8, 9], PassRoutes("prefill", (2, 3), 16, 0, True, 4.0)),
              ([2, 16], PassRoutes("decode", (2, 3), 16, 0, False, 5.0))]
    rt._arrived = list(passes)
    rt._count_arrived()
    expected = _counted_pass_by_pass(passes)
    c = rt.counters
    assert (c.rows, c.rows_per_layer, dict(c.cohort_sizes)) == \
        (expected["rows"], expected["rows_per_layer"], expected["cohort_sizes"])
    # a probe's share: its Project-Only rows over its routed-mode rows, every layer ((5 + 1028) of 2 x 1028)
    assert shares == [((5 + 1028) / (2 * 1028), 3.0), ((8 + 7) / 32, 4.0)] and rt._arrived == []
    # Without a reader, the scheduler counts them itself once FOLD_PASSES wait; before that they wait.
    rt = runtime(Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}}), tmp_path)
    rt._writer = SimpleNamespace(changed=lambda: None)
    for i in range(FOLD_PASSES - 1):
        run_pass(rt, decode(["a", "b"], [60 + i, 45 + i]))
    assert len(rt._arrived) == FOLD_PASSES - 1 and rt.counters.rows["decode"]["run"] == 0
    run_pass(rt, decode(["a", "b"], [200, 200]))
    assert rt._arrived == [] and rt.counters.rows["decode"] == {"run": 2 * FOLD_PASSES, "project_only": 2 * FOLD_PASSES}


def test_a_pass_counted_from_the_counts_its_maps_wrote_on_the_tape_counts_as_one_counted_from_its_run_mask(
        tmp_path):
    """The triton execution's maps launches write each layer's (RUN, Project-Only) rows into the tape, and its
    passes are counted from them with no launch of their own (`finish(on_tape=True)`): the same counters, cohort
    sizes and probe shares as counting the run mask, dense-mode rows included, and where a replayed graph's
    maps also covered padding rows past the pass (RUN)."""
    counted = {}
    for on_tape in (False, True):
        (tmp_path / str(on_tape)).mkdir()
        always = runtime(get_arm("random-r50-d50-always"), tmp_path / str(on_tape))
        run_pass(always, prefill(["a", "b"], [9, 7]), on_tape=on_tape)
        for i in range(3):
            run_pass(always, decode(["a", "b"], [10 + i, 8 + i]), on_tape=on_tape, padding=5)
        # a running request stays dense when routing turns on (no promotion): a dense-mode row in a routed pass
        mixed = runtime(Arm.from_dict({"skipper": "random_skip", "params": {"r": 0.5, "d": 0.5}, "promotion": False}),
                        tmp_path / str(on_tape), enter=100, exit_=50)
        run_pass(mixed, decode(["a"], [20]), on_tape=on_tape)
        step = run_pass(mixed, decode(["a", "b"], [21, 90]), on_tape=on_tape, padding=5)
        assert step.routed and step.dense_count == 1
        counted[on_tape] = [(att["rows_total"], att["rows_per_layer_total"], att["run_cohort_size_passes_total"])
                            for att in (always.attestation(), mixed.attestation())]
    assert counted[True] == counted[False]
    rows = counted[True][0][0]
    assert all(rows[phase][action] > 0 for phase in ("prefill", "decode") for action in ("run", "project_only"))


def test_a_request_that_starts_decoding_after_routing_turned_off_decodes_dense_beside_routed_ones(tmp_path):
    arm = Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 1.0}})
    rt = runtime(arm, tmp_path, enter=100, exit_=50)
    run_pass(rt, decode(["a"], [120]))  # on; a routed
    step = run_pass(rt, decode(["c"], [10]))  # a finished (left the batch); V 10 <= exit: off; c dense
    assert not step.routed
    step = run_pass(rt, decode(["c", "d"], [11, 200]))  # on again; c promoted; d routed
    assert step.routed and step.dense_rows is None
    # The first crossing found nobody decoding dense: no promotion is recorded for it.
    assert rt.attestation()["switch"]["decisions_total"] == {"route_on": 2, "promote": 1, "route_off": 1}


def test_no_promotion_arm_keeps_running_dense_requests_dense_in_a_routed_pass(tmp_path):
    arm = Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 1.0}, "promotion": False})
    rt = runtime(arm, tmp_path, enter=100, exit_=50)
    run_pass(rt, decode(["a"], [20]))
    step = run_pass(rt, decode(["a", "b"], [21, 90]))  # V 111: on; a stays dense, b routed
    assert step.routed and step.dense_rows.tolist() == [True, False]
    assert rt.attestation()["rows_total"]["decode"] == {"run": 0, "project_only": 2}  # only b's rows count


def test_an_interleaving_server_runs_every_other_routed_pass_of_a_phase_all_run_and_counts_only_its_routed_rows(
        tmp_path):
    """`VSKIPPER_INTERLEAVE_CONTROL=1` (a measurement mode): the routed arm's decode passes alternate between the
    skipper's routes and every row RUN through the routed layers (a dense-mode row each: the s = 0 control's
    work), and so do its prefill passes, each phase apart from the other. The control passes' rows are not
    counted as routed rows."""
    arm = Arm.from_dict({"skipper": "random_skip", "params": {"r": 1.0, "d": 0.5}, "prefill": "routed",
                         "decode": "routed"})
    rt = Runtime(ServeSpec(arm, 0, 0, tmp_path / "state.json", interleave_control=True), "ddllama", (2, 3),
                 "DDLlamaForCausalLM")
    first = run_pass(rt, prefill(["a", "b"], [6, 6]))
    assert first.routed and not first.control and first.dense_rows is None
    steps = [run_pass(rt, decode(["a", "b"], [7 + i, 7 + i])) for i in range(4)]
    assert [s.control for s in steps] == [False, True, False, True]
    assert all(s.routed for s in steps)
    assert [s.dense_rows is None for s in steps] == [True, False, True, False]
    assert all(s.dense_rows.tolist() == [True, True] and s.dense_count == 2 for s in steps[1::2])
    second = run_pass(rt, prefill(["c"], [4]))  # prefill's own alternation: its second routed pass is a control
    assert second.routed and second.control and second.dense_rows.tolist() == [True] * 4
    assert run_pass(rt, decode(["a", "b", "c"], [11, 11, 5])).control is False  # decode's goes on where it was
    assert not run_pass(rt, prefill(["d"], [3])).control
    att = rt.attestation()
    assert att["passes_total"]["decode"] == {"dense": 0, "routed": 5}
    assert att["passes_total"]["prefill"] == {"dense": 0, "routed": 3}
    # 2 layers x 2 rows x the 2 routed passes of two rows, and 2 x 3 of the last: the control passes count no row
    assert sum(att["rows_total"]["decode"].values()) == 2 * 2 * 2 + 2 * 3
    assert sum(att["rows_total"]["prefill"].values()) == 2 * 12 + 2 * 3  # the prefill control's 4 rows: none
    with pytest.raises(ServeConfigError, match="VSKIPPER_INTERLEAVE_CONTROL=1 interleaves a routed arm's "
                                               "passes with all-RUN ones, and arm 'dense' does not route"):
        Runtime(ServeSpec(get_arm("dense"), 0, 0, None, interleave_control=True), "ddllama", (2, 3),
                "DDLlamaForCausalLM")


def test_prefill_mode_is_fixed_at_admission_and_kept_across_chunks(tmp_path):
    arm = Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}, "prefill": "dense",
                         "decode": "routed"})
    rt = runtime(arm, tmp_path)  # prefill dense, decode always routed
    assert not run_pass(rt, prefill(["a"], [600], [600])).routed
    assert not run_pass(rt, prefill(["a", "b"], [1200, 30], [600, 30])).routed  # a's second chunk, b admitted
    att = rt.attestation()
    assert att["requests_total"]["prefill"] == {"dense": 2}
    assert att["switch"]["admitted_prefill_rounds"] == 2
    assert run_pass(rt, decode(["a", "b"], [1201, 31])).routed


def test_a_prefill_pass_plans_each_token_by_its_requests_prefill_mode(tmp_path):
    """A prefill pass's tokens take their request's key and mode: every token routed (a routed arm's usual
    round) needs no per-row flags, a round of both modes marks its dense-mode tokens, and a round with none
    routed is not routed at all."""
    from vskipper.sglang.runtime import request_key
    from vskipper.switch import Mode

    rt = runtime(Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}, "prefill": "routed",
                                "decode": "routed"}), tmp_path)
    batch = prefill(["a", "b"], [3, 2])
    step = rt.decide(batch, 5, torch.float32, "cpu")
    assert step.routed and step.dense_rows is None and step.dense_count == 0
    assert step.keys.tolist() == [request_key("a")] * 3 + [request_key("b")] * 2
    rt._requests["a"].prefill_mode = Mode.DENSE  # a round of both modes (a's chunk admitted dense)
    step = rt.decide(batch, 5, torch.float32, "cpu")
    assert step.routed and step.dense_rows.tolist() == [True] * 3 + [False] * 2 and step.dense_count == 3
    rt._requests["b"].prefill_mode = Mode.DENSE
    assert not rt.decide(batch, 5, torch.float32, "cpu").routed


def test_counters_are_written_to_the_state_file_after_every_pass(tmp_path):
    rt = runtime(get_arm("dense"), tmp_path)
    run_pass(rt, prefill(["a"], [5]))
    run_pass(rt, decode(["a"], [6]))
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["passes_total"] == {"prefill": {"dense": 1, "routed": 0}, "decode": {"dense": 1, "routed": 0}}
    assert state["arm"]["name"] == "dense"
    assert state["constants"]["enter_factor"] == 1.25
    # which machine served: the host, and on CUDA the device's name and UUID (none on CPU)
    assert state["machine"] == {"host": platform.node(), "device_name": None, "device_uuid": None}


def test_a_cuda_runtime_names_its_device_by_uuid(monkeypatch):
    """Two machines of one GPU kind tell apart by the device's UUID (what the headline's pairing checks); faked
    here, as this machine has no CUDA device."""
    from vskipper.sglang.runtime import machine_identity

    class Props:
        name = "NVIDIA H200"
        uuid = "4e6b2a5c-1d2f-4c1b-9a0e-7f3d2c1b0a99"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    assert machine_identity("cuda:0") == {"host": platform.node(), "device_name": "NVIDIA H200",
                                          "device_uuid": "4e6b2a5c-1d2f-4c1b-9a0e-7f3d2c1b0a99"}
    assert machine_identity("cpu")["device_uuid"] is None and machine_identity(None)["device_name"] is None
    # the runtime attests what it read of its own device, once, at its start
    spec = ServeSpec(get_arm("dense"), 0, 0, None)
    assert Runtime(spec, "ddllama", (2, 3), "DDLlamaForCausalLM", "cuda:0").attestation()["machine"][
        "device_uuid"] == "4e6b2a5c-1d2f-4c1b-9a0e-7f3d2c1b0a99"
    assert Runtime(spec, "ddllama", (2, 3), "DDLlamaForCausalLM").attestation()["machine"]["device_uuid"] is None


def test_request_keys_are_cached_as_every_pass_of_a_request_asks_again():
    from vskipper.sglang.runtime import request_key

    request_key.cache_clear()
    assert request_key("r-1") == request_key("r-1") == zlib.crc32(b"r-1")
    assert request_key.cache_info().hits == 1


def test_trained_gate_on_another_model_family_is_refused_naming_the_field():
    with pytest.raises(ServeConfigError, match="field 'skipper' is 'qwen3_hard_gate'.*this checkpoint is 'ddllama'"):
        check_arm_for_model(get_arm("qwen3-always-route"), "ddllama")
    with pytest.raises(ServeConfigError, match="field 'skipper' is 'flexidepth'.*this checkpoint is 'qwen3_skipper'"):
        check_arm_for_model(get_arm("always-route"), "qwen3_skipper")
    check_arm_for_model(get_arm("random-r50-d50"), "ddllama")  # untrained skippers route any skipper checkpoint
    check_arm_for_model(get_arm("random-r50-d50"), "qwen3_skipper")


def test_routed_arms_are_served_on_both_skipper_families_and_refused_on_a_checkpoint_without_routed_layers():
    check_arm_for_model(get_arm("always-route"), "ddllama")
    check_arm_for_model(get_arm("qwen3-always-route"), "qwen3_skipper")
    check_arm_for_model(get_arm("dense"), "qwen3")
    with pytest.raises(ServeConfigError, match="field 'skipper' is 'random_skip', but a checkpoint of model_type "
                                               "'qwen3' has no routed layers"):
        check_arm_for_model(get_arm("random-r50-d50"), "qwen3")


def test_a_static_depth_arm_switches_on_the_share_its_routed_layers_carry_out_and_is_refused_where_none():
    """The server's own routed layers decide, whatever the operator was told: 0.75 of 2 layers projects one (the
    prefill rule reads s = 0.5); 0.25 of them projects none and the start is refused, naming the parameter."""
    def arm(ratio):
        return Arm.from_dict({"name": "tail", "skipper": "static_depth", "params": {"ratio": ratio},
                              "prefill": "hybrid", "decode": "dense"})

    rt = Runtime(ServeSpec(arm(0.75), 0, 0, None), "ddllama", (2, 3), "DDLlamaForCausalLM")
    assert rt.switch.prefill_share_estimate == 0.5
    att = rt.attestation()
    assert att["served_skip_ratio"] == 0.5 and att["arm"]["declared_skip_ratio"] == 0.75
    with pytest.raises(ServeConfigError, match=r"arm 'tail': field 'params'\.ratio: 0\.25 of 2 routed layers "
                                               r"projects no layer"):
        Runtime(ServeSpec(arm(0.25), 0, 0, None), "ddllama", (2, 3), "DDLlamaForCausalLM")


def test_a_routed_arm_on_a_qwen3_checkpoint_routes_its_passes(tmp_path):
    arm = Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}, "prefill": "routed", "decode": "routed"})
    rt = Runtime(ServeSpec(arm, 0, 0, tmp_path / "state.json"), "qwen3_skipper", (0, 3),
                 "Qwen3SkipperForCausalLM")
    assert run_pass(rt, prefill(["a"], [6]), layers=(0, 3)).routed
    assert run_pass(rt, decode(["a"], [7]), layers=(0, 3)).routed
    att = json.loads((tmp_path / "state.json").read_text())
    assert att["model"] == {"model_type": "qwen3_skipper", "class": "Qwen3SkipperForCausalLM",
                            "routed_layers": [0, 3]}
    assert att["passes_total"] == {"prefill": {"dense": 0, "routed": 1}, "decode": {"dense": 0, "routed": 1}}
    assert att["rows_per_layer_total"] == {"0": {"run": 7, "project_only": 0}, "3": {"run": 0, "project_only": 7}}
    with pytest.raises(ServeConfigError, match="field 'skipper' is 'flexidepth'"):
        Runtime(ServeSpec(get_arm("always-route"), 0, 0, None), "qwen3_skipper", (0, 3), "Qwen3SkipperForCausalLM")


def test_serve_spec_round_trips_through_the_environment(tmp_path):
    spec = ServeSpec(get_arm("no-promotion"), 200000, 160000, tmp_path / "s.json")
    back = ServeSpec.from_env(spec.to_env())
    assert back.arm == spec.arm and (back.enter_tokens, back.exit_tokens) == (200000, 160000)
    assert back.tile_table is None
    tuned = ServeSpec(get_arm("always-route"), 0, 0, None, tile_table=tmp_path / "tiles.json")
    assert ServeSpec.from_env(tuned.to_env()).tile_table == tmp_path / "tiles.json"
    with pytest.raises(ServeConfigError, match="VSKIPPER_SERVED_ARM is not set"):
        ServeSpec.from_env({})


def test_a_served_prefill_floor_travels_to_the_switch_and_is_attested_beside_the_thresholds(tmp_path):
    spec = ServeSpec(get_arm("prefill-only"), 0, 0, tmp_path / "s.json", prefill_floor_tokens=2048)
    back = ServeSpec.from_env(spec.to_env())
    assert back.prefill_floor_tokens == 2048
    rt = Runtime(back, "ddllama", (2, 3), "DDLlamaForCausalLM")
    assert rt.switch.constants.prefill_min_prompt_tokens == 2048
    assert rt.switch.constants == replace(CONSTANTS, prefill_min_prompt_tokens=2048)
    att = rt.attestation()
    assert att["thresholds"]["prefill_floor_tokens"] == 2048 and att["thresholds"]["prefill_floor_source"] == "flags"
    assert att["constants"]["prefill_min_prompt_tokens"] == CONSTANTS.prefill_min_prompt_tokens  # the module's
    assert rt.switch.preview_prefill(2000).mode.value == "dense"  # over the constant's floor, under the served one
    plain = Runtime(ServeSpec(get_arm("prefill-only"), 0, 0, None), "ddllama", (2, 3), "DDLlamaForCausalLM")
    assert plain.switch.constants is CONSTANTS
    assert plain.attestation()["thresholds"]["prefill_floor_source"] == "vskipper.constants"
    dense = Runtime(ServeSpec(get_arm("dense"), 0, 0, None), "ddllama", (2, 3), "DDLlamaForCausalLM")
    assert dense.attestation()["thresholds"]["prefill_floor_tokens"] is None


@pytest.mark.parametrize("arm, floor, message", [
    ("prefill-only", 0, "--prefill-floor-tokens must be a positive integer, got 0"),
    ("prefill-only", True, "must be a positive integer, got True"),
    ("decode-only", 2048, "arm 'decode-only' does not switch prefill (field 'prefill' is 'dense')"),
    ("always-route", 2048, "field 'prefill' is 'routed'"),
])
def test_a_prefill_floor_is_refused_where_it_would_not_apply_or_is_not_a_token_count(arm, floor, message):
    with pytest.raises(ServeConfigError, match=re.escape(message)):
        ServeSpec(get_arm(arm), 0, 0, None, prefill_floor_tokens=floor)
    env = ServeSpec(get_arm("prefill-only"), 0, 0, None).to_env()
    with pytest.raises(ServeConfigError, match="VSKIPPER_SERVED_PREFILL_FLOOR_TOKENS must be an integer"):
        ServeSpec.from_env({**env, "VSKIPPER_SERVED_PREFILL_FLOOR_TOKENS": "2k"})


# -- admission rounds and prefix-cache namespaces (the scheduler hooks' runtime side) -------------------------------

def waiting(rid: str, tokens: int, extra_key: str | None = None, output: int = 0, max_new: int = 16,
            prefix: int = 0):
    """The fields of SGLang's Req the runtime reads and writes (`prefix`: tokens its prefix lookup matched)."""
    return SimpleNamespace(rid=rid, origin_input_ids=[7] * tokens, output_ids=[8] * output, extra_key=extra_key,
                           sampling_params=SimpleNamespace(max_new_tokens=max_new), prefix_indices=[0] * prefix)


OPEN = AdmissionLimits()  # no limit: every waiting request is a candidate
PREFILL_SWITCHED = {"skipper": "static_depth", "params": {"ratio": 0.5}, "prefill": "hybrid", "decode": "dense"}


def test_waiting_requests_are_keyed_by_the_previewed_mode_and_keep_their_own_key(tmp_path):
    rt = runtime(Arm.from_dict(PREFILL_SWITCHED), tmp_path)
    a, b = waiting("a", 1000), waiting("b", 700, extra_key="lora-7")
    assert rt.key_candidates([a, b], OPEN).mode.value == "routed"  # 1700 >= floor: the first probe
    assert (a.extra_key, b.extra_key) == ("vsk:routed", "vsk:routed|lora-7")
    rt.key_candidates([b], OPEN)
    assert b.extra_key == "vsk:dense|lora-7"  # 700 < floor: re-keyed from its own key, never stacked


def test_the_round_is_decided_on_what_sglang_admitted_and_rekeyed_when_nothing_was_reused(tmp_path):
    rt = runtime(Arm.from_dict(PREFILL_SWITCHED), tmp_path)
    a, b = waiting("a", 1000), waiting("b", 700)
    assert rt.key_candidates([a, b], OPEN).mode.value == "routed"  # the candidates: 1700 >= floor
    decision = rt.admit([a])  # SGLang admitted a only: 1000 < floor
    assert decision.mode.value == "dense" and a.extra_key == "vsk:dense"
    assert not run_pass(rt, prefill(["a"], [1000])).routed
    att = rt.attestation()
    assert [(d["kind"], d["count"]) for d in att["switch"]["recent_decisions"]] == [("prefill_dense", 1000)]
    assert att["admission_rounds_total"] == {"rekeyed": 1} and att["requests_total"]["prefill"] == {"dense": 1}


def test_a_round_that_reused_prefix_kv_of_the_previewed_mode_is_bound_to_it(tmp_path):
    rt = runtime(Arm.from_dict(PREFILL_SWITCHED), tmp_path)
    a, b = waiting("a", 1000, prefix=512), waiting("b", 700)
    rt.key_candidates([a, b], OPEN)
    decision = rt.admit([a])  # a matched 512 tokens in the routed namespace: its KV must extend it
    assert decision.mode.value == "routed" and "prefix reuse" in decision.reason and a.extra_key == "vsk:routed"
    assert run_pass(rt, prefill(["a"], [1000], extend=[488])).routed
    att = rt.attestation()
    assert [(d["kind"], d["count"]) for d in att["switch"]["recent_decisions"]] == [("prefill_routed", 1000)]
    assert att["admission_rounds_total"] == {"bound": 1}


def test_the_candidate_round_is_what_sglangs_limits_let_in(tmp_path):
    rt = runtime(Arm.from_dict(PREFILL_SWITCHED), tmp_path)
    queue = [waiting("a", 1000, max_new=100), waiting("b", 1000, max_new=100)]
    assert rt.key_candidates(queue, AdmissionLimits(prefill_tokens=1000)).mode.value == "dense"  # a fills it
    assert rt.key_candidates(queue, AdmissionLimits(prefill_tokens=1200)).mode.value == "routed"  # b crosses: whole
    assert rt.key_candidates(queue, AdmissionLimits(requests=1)).mode.value == "dense"  # one free request slot
    # b's prefill plus its reserved output and a page no longer fit the free KV tokens.
    assert rt.key_candidates(queue, AdmissionLimits(kv_tokens=2100)).mode.value == "dense"
    assert rt.key_candidates(queue, AdmissionLimits(kv_tokens=2202)).mode.value == "routed"
    assert rt.key_candidates([waiting("c", 900, output=700)], OPEN).mode.value == "routed"  # retracted: re-prefill


def test_a_round_is_committed_with_its_previewed_decision_and_never_without_one(tmp_path):
    rt = runtime(Arm.from_dict(PREFILL_SWITCHED), tmp_path)
    with pytest.raises(RuntimeError, match="without a preview"):
        rt.admit([waiting("a", 10)])
    rt.key_candidates([waiting("a", 2000)], OPEN)
    rt.admit([waiting("a", 2000)])
    decisions = rt.attestation()["switch"]["recent_decisions"]
    assert [(d["kind"], d["count"]) for d in decisions] == [("prefill_routed", 2000)]


def test_generated_kv_is_inserted_only_when_decode_ran_in_the_prefill_mode(tmp_path):
    rt = runtime(Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}}), tmp_path, enter=3000,
                 exit_=2500)  # hybrid prefill and decode
    queue = [waiting("routed-dense", 2000), waiting("routed-routed", 2000)]
    rt.key_candidates(queue, OPEN)
    rt.admit(queue)
    rt.key_candidates([waiting("dense-promoted", 100)], OPEN)
    rt.admit([waiting("dense-promoted", 100)])
    run_pass(rt, prefill(["routed-dense", "routed-routed"], [2000, 2000]))
    run_pass(rt, prefill(["dense-promoted"], [100]))
    run_pass(rt, decode(["routed-dense", "dense-promoted"], [2001, 101]))  # V 2102 < enter: both decode dense
    run_pass(rt, decode(["routed-dense", "dense-promoted", "routed-routed"], [2002, 102, 2001]))  # on: promoted
    assert rt.kv_insert_limit("routed-routed", 2010, 2000) == 2010  # routed prefill, routed decode
    assert rt.kv_insert_limit("routed-dense", 2010, 2000) == 2000  # routed prefill, dense-then-routed decode
    assert rt.kv_insert_limit("dense-promoted", 110, 100) == 100  # dense prefill, promoted mid-decode
    assert rt.kv_insert_limit("never-seen", 50, 40) == 50
    assert rt.attestation()["prefix_cache"]["withheld_generated_kv_tokens_total"] == 20


def test_a_retracted_request_is_admitted_again_under_its_record_and_counted_once(tmp_path):
    rt = runtime(Arm.from_dict(PREFILL_SWITCHED), tmp_path)
    rt.key_candidates([waiting("a", 2000)], OPEN)
    rt.admit([waiting("a", 2000)])
    run_pass(rt, prefill(["a"], [2000]))
    run_pass(rt, decode(["a"], [2001]))
    assert "a" in rt.switch.running() and rt.attestation()["resident_tokens"] == 2001
    rt.release("a", finished=False)  # SGLang retracted it: its KV row is freed, it waits in the queue
    assert "a" not in rt.switch.running() and rt.attestation()["resident_tokens"] == 0
    back = waiting("a", 2000, output=2)
    rt.key_candidates([back], OPEN)
    rt.admit([back])
    run_pass(rt, prefill(["a"], [2002]))
    run_pass(rt, decode(["a"], [2003]))
    att = rt.attestation()
    assert att["requests_total"] == {"prefill": {"routed": 1}, "decode": {"dense": 1}}
    assert att["retractions_total"] == 1 and att["requests_tracked"] == 1
    rt.release("a", finished=True)
    assert rt.attestation()["requests_tracked"] == 0


def test_the_insert_limit_never_frees_kv_the_cache_protects_or_that_a_readmission_prefilled(tmp_path):
    """A request retracted after 300 output tokens re-prefills prompt + 300 in its new prefill mode, and SGLang's
    cache then protects that whole prefix for it: the limit keeps it, and only the tokens decoded in another mode
    after that are withheld."""
    rt = runtime(Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}, "prefill": "dense"}),
                 tmp_path, enter=0, exit_=0)  # dense prefill, routed decode: modes always differ
    back = waiting("a", 200, output=300)
    rt.key_candidates([back], OPEN)
    rt.admit([back])
    run_pass(rt, prefill(["a"], [500]))
    run_pass(rt, decode(["a"], [501]))
    assert rt.kv_insert_limit("a", 510, protected=500) == 500  # not the original 200-token prompt
    assert rt.kv_insert_limit("a", 510, protected=505) == 505  # whatever the tree already owns stays owned
    assert rt.attestation()["prefix_cache"]["withheld_generated_kv_tokens_total"] == 10 + 5


def test_records_leave_with_their_requests_however_they_leave(tmp_path):
    rt = runtime(Arm.from_dict(PREFILL_SWITCHED), tmp_path)
    queue = [waiting(rid, 10) for rid in ("one-token", "aborted-in-prefill", "retracted-then-aborted")]
    rt.key_candidates(queue, OPEN)
    rt.admit(queue)
    run_pass(rt, prefill([r.rid for r in queue], [10, 10, 10]))
    rt.release("one-token", finished=True)  # finished on its prefill pass, never decoded
    rt.release("aborted-in-prefill", finished=True)
    rt.release("retracted-then-aborted", finished=False)
    rt.abort_queued("retracted-then-aborted")  # aborted while waiting to be admitted again
    rt.abort_queued("never-admitted")
    assert rt.attestation()["requests_tracked"] == 0


def test_health_probes_are_not_counted_as_traffic(tmp_path):
    rt = runtime(Arm.from_dict(PREFILL_SWITCHED), tmp_path)
    probe = waiting("HEALTH_CHECK_0f3a", 1)
    rt.key_candidates([probe], OPEN)
    assert rt.admit([probe]).reason == "health check"
    run_pass(rt, prefill([probe.rid], [1]))
    att = rt.attestation()
    assert att["requests_total"]["prefill"] == {} and att["passes_total"]["prefill"] == {"dense": 0, "routed": 0}
    assert att["health_check_passes_total"] == {"prefill": 1} and att["switch"]["recent_decisions"] == []


def test_arms_that_never_route_keep_sglangs_single_namespace(tmp_path):
    rt = runtime(get_arm("dense"), tmp_path)
    req = waiting("a", 2000, extra_key="user-key")
    rt.key_candidates([req], OPEN)
    rt.admit([req])
    assert req.extra_key == "user-key"
    assert rt.attestation()["prefix_cache"]["namespaces"] == []


def test_a_routed_server_without_its_scheduler_hooks_is_refused_naming_the_plugin():
    pytest.importorskip("sglang")
    from vskipper.sglang.hooks import check_applied

    with pytest.raises(ServeConfigError, match="entry point group 'sglang.srt.plugins', name 'vskipper'"):
        check_applied()  # this process never loaded SGLang's plugins


# -- SGLang's multi-process layout ----------------------------------------------------------------------------------

def test_only_the_first_tensor_parallel_rank_of_a_replica_reports(tmp_path):
    from vskipper.sglang.replicas import Placement

    arm = get_arm("dense")
    spec = ServeSpec(arm, 0, 0, tmp_path / "state.json")
    second_tp = Runtime(spec, "ddllama", (2, 3), "DDLlamaForCausalLM", placement=Placement(attn_tp_rank=1))
    run_pass(second_tp, prefill(["a"], [5]))
    assert not (tmp_path / "state.json").exists()  # the TP peer computed the same pass; rank 0 counts it
    replica = Runtime(spec, "ddllama", (2, 3), "DDLlamaForCausalLM", placement=Placement(dp_rank=1))
    run_pass(replica, prefill(["b"], [5]))
    assert json.loads((tmp_path / "state.dp1-adp0.json").read_text())["placement"]["replica"] == "dp1-adp0"


def test_replica_attestations_merge_into_one_with_counters_summed(tmp_path):
    from vskipper.sglang.replicas import Placement, merge_attestations, replica_state_files

    arm = Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}, "prefill": "routed", "decode": "routed"})
    spec = ServeSpec(arm, 0, 0, tmp_path / "state.json")
    replicas = [Runtime(spec, "ddllama", (2, 3), "DDLlamaForCausalLM", placement=Placement(dp_rank=k))
                for k in range(2)]
    for k, rt in enumerate(replicas):
        for i in range(k + 1):
            run_pass(rt, prefill([f"r{k}-{i}"], [4]))
        run_pass(rt, decode([f"r{k}-0"], [5]))
    files = replica_state_files(tmp_path / "state.json")
    assert [f.name for f in files] == ["state.json", "state.dp1-adp0.json"]
    merged = merge_attestations([json.loads(f.read_text()) for f in files])
    assert merged["passes_total"] == {"prefill": {"dense": 0, "routed": 3}, "decode": {"dense": 0, "routed": 2}}
    assert merged["rows_total"]["prefill"]["run"] + merged["rows_total"]["prefill"]["project_only"] == 3 * 4 * 2
    assert merged["requests_total"]["prefill"] == {"routed": 3}
    assert merged["prefix_cache"]["withheld_generated_kv_tokens_total"] == 0
    assert merged["arm"] == replicas[0].attestation()["arm"]
    assert [r["placement"]["replica"] for r in merged["replicas"]] == ["dp0-adp0", "dp1-adp0"]
    # each replica's own machine (one host here: told apart by a device each, as on a GPU server of several)
    parts = [json.loads(f.read_text()) for f in files]
    for k, part in enumerate(parts):
        part["machine"] = {**part["machine"], "device_uuid": f"gpu-{k}"}
    assert [r["machine"]["device_uuid"] for r in merge_attestations(parts)["replicas"]] == ["gpu-0", "gpu-1"]
    assert [r["machine"] for r in merged["replicas"]] == [rt.machine for rt in replicas]
    single = merge_attestations([json.loads(files[0].read_text())])
    assert "replicas" not in single and single["passes_total"]["prefill"]["routed"] == 1


def test_routed_arms_are_refused_under_pipeline_parallelism(tmp_path):
    from vskipper.sglang.replicas import Placement

    with pytest.raises(ServeConfigError, match="--pp-size 2"):
        Runtime(ServeSpec(get_arm("always-route"), 0, 0, None), "ddllama", (2, 3), "DDLlamaForCausalLM",
                placement=Placement(pp_size=2))


def test_a_server_runtime_writes_its_state_off_the_forward_path_and_fresh_for_each_read(tmp_path):
    """With its writer started (as in a server) a pass only marks the state changed; the file is written in the
    writer's thread, and a read of the attestation gets the counters of every pass finished before it."""
    import asyncio
    import threading

    from vskipper.sglang.server import fresh_attestation

    rt = runtime(Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}, "prefill": "routed", "decode": "routed"}),
                 tmp_path)
    writers = []
    write = rt.write_state

    def recorded(*args, **kwargs):
        writers.append(threading.current_thread().name)
        write(*args, **kwargs)

    rt.write_state = recorded
    rt.start_state_writer()
    run_pass(rt, prefill(["a"], [5]))
    for n in range(3):
        run_pass(rt, decode(["a"], [6 + n]))
    att = asyncio.run(fresh_attestation(tmp_path / "state.json", timeout=30))
    assert att["passes_total"]["decode"] == {"dense": 0, "routed": 3}
    assert att["passes_total"]["prefill"] == {"dense": 0, "routed": 1}
    assert att["answered"] is True
    assert writers and set(writers) == {"vskipper-state-writer"}
    # a document a reader asked for holds this process's threads' CPU (read outside the state lock), the writer's
    # own among them; one written for no reader does not read them
    names = {t["name"] for t in att["threads"].values()}
    assert {"MainThread", "vskipper-state-writer"} <= names
    assert all(t["cpu_s"] >= 0 and t["waits"] >= 0 for t in att["threads"].values())
    assert json.loads(rt.state_document())["threads"] is None
    assert att["allocator"] is None  # the CUDA allocator's counters: none on CPU


def test_a_read_no_writer_answers_in_time_is_served_the_latest_state_marked_unanswered(tmp_path):
    """Past its wait, a read of the attestation serves what the scheduler last wrote, saying it was not written
    for this read (`answered`: its counters may lack the latest passes; the readers read again)."""
    import asyncio

    from vskipper.sglang.server import fresh_attestation

    rt = runtime(get_arm("dense"), tmp_path)  # no writer thread: the runtime writes its state at each pass itself
    run_pass(rt, prefill(["a"], [5]))
    att = asyncio.run(fresh_attestation(tmp_path / "state.json", timeout=0.05))
    assert att["answered"] is False and att["passes_total"]["prefill"] == {"dense": 1, "routed": 0}
    assert asyncio.run(fresh_attestation(tmp_path / "missing.json", timeout=0.01)) is None


def test_state_files_of_another_run_are_never_merged(tmp_path, monkeypatch):
    from vskipper.sglang.replicas import (
        ENV_RUN_ID,
        Placement,
        of_run,
        remove_state_files,
        replica_state_files,
    )

    arm = get_arm("dense")
    spec = ServeSpec(arm, 0, 0, tmp_path / "state.json")
    monkeypatch.setenv(ENV_RUN_ID, "earlier")
    Runtime(spec, "ddllama", (2, 3), "DDLlamaForCausalLM", placement=Placement(dp_rank=1))  # a dp=2 run
    monkeypatch.setenv(ENV_RUN_ID, "now")
    Runtime(spec, "ddllama", (2, 3), "DDLlamaForCausalLM")  # this run serves with dp=1
    parts = [json.loads(f.read_text()) for f in replica_state_files(tmp_path / "state.json")]
    assert len(parts) == 2 and [p["run_id"] for p in of_run(parts, "now")] == ["now"]
    remove_state_files(tmp_path / "state.json")  # what a new server does before its schedulers start
    assert not any(f.exists() for f in replica_state_files(tmp_path / "state.json"))


def test_an_interleaving_server_keeps_a_share_probe_routed_and_its_alternation_skips_the_probe(tmp_path):
    """A hybrid prefill arm's share probe measures the skipper's share: under `VSKIPPER_INTERLEAVE_CONTROL=1` its
    pass keeps the routes (and its share is recorded), and the alternation goes on from the next routed pass."""
    rt = Runtime(ServeSpec(Arm.from_dict(PREFILL_SWITCHED), 0, 0, tmp_path / "state.json", interleave_control=True),
                 "ddllama", (2, 3), "DDLlamaForCausalLM")
    kinds = []
    for rid in ("a", "b", "c"):
        req = waiting(rid, 2000)
        rt.key_candidates([req], OPEN)
        decision = rt.admit([req])
        step = run_pass(rt, prefill([rid], [2000]))
        kinds.append((decision.probe, step.routed, step.control))
    assert kinds == [(True, True, False), (False, True, False), (False, True, True)]
    decisions = [d["kind"] for d in rt.attestation()["switch"]["recent_decisions"]]
    assert "probe" in decisions


def test_a_decode_batch_of_the_same_requests_keeps_its_rows_until_a_promotion_or_a_request_change_moves_them(
        tmp_path):
    """The runtime reuses a decode batch's per-row flags and keys while the same requests decode: a promotion,
    a request joining and a request leaving each give the rows they would get decided afresh."""
    from vskipper.sglang.runtime import request_key

    rt = runtime(Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}}), tmp_path, enter=100,
                 exit_=50)
    run_pass(rt, prefill(["a", "b"], [40, 40]))
    assert not run_pass(rt, decode(["a", "b"], [41, 41])).routed
    assert not run_pass(rt, decode(["a", "b"], [42, 42])).routed  # the same requests, still dense
    step = run_pass(rt, decode(["a", "b"], [50, 50]))  # V 100 >= enter: both promoted, the same requests
    assert step.routed and step.dense_rows is None and step.dense_count == 0
    assert step.keys.tolist() == [request_key("a"), request_key("b")]
    kept = run_pass(rt, decode(["a", "b"], [51, 51]))  # the same requests, no promotion: the rows kept as they are
    assert kept.keys is step.keys
    run_pass(rt, prefill(["c"], [9]))
    step = run_pass(rt, decode(["a", "b", "c"], [52, 52, 10]))  # c joined: decided afresh
    assert step.routed and step.keys.tolist() == [request_key(r) for r in "abc"] and step.keys is not kept.keys
    kept = run_pass(rt, decode(["a", "b", "c"], [53, 53, 11]))
    assert kept.keys is step.keys
    step = run_pass(rt, decode(["a", "c"], [54, 12]))  # b left the batch
    assert step.rows == 2 and step.keys.tolist() == [request_key("a"), request_key("c")]
    assert rt.resident_tokens() == 66
    rt.release("c", finished=True)
    last = step.keys
    step = run_pass(rt, decode(["a", "c"], [55, 13]))  # a request released while SGLang still ran it decodes anew
    assert step.keys.tolist() == [request_key("a"), request_key("c")] and step.keys is not last
    assert rt.attestation()["requests_total"]["decode"] == {"dense": 2, "routed": 2}
