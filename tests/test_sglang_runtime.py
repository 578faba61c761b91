"""The scheduler-side runtime without a server: per-request modes from the mode switch, counters, state file.

SGLang's ForwardBatch is stood in by a plain object carrying the fields the runtime reads (forward mode, request
ids, sequence lengths, extend lengths); everything else is the real runtime, switch, skipper and tape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from vskipper.arms import Arm, get_arm
from vskipper.sglang.runtime import Runtime
from vskipper.sglang.spec import ServeConfigError, ServeSpec, check_arm_for_model


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


def run_pass(rt: Runtime, batch: Batch, layers=(2, 3)):
    rows = sum(batch.extend_seq_lens_cpu) if not batch.forward_mode.is_decode() else len(batch.rids)
    hidden = torch.randn(rows, 8)
    step = rt.plan(batch, hidden, torch.arange(rows))
    if step.routed:
        for layer in layers:
            route = step.skipper.route(layer, hidden, step.state, None)
            step.tape.record(layer, route, step.dense_rows)
            rt.record_layer(step, layer, step.tape.layer(layer, step.rows)[0])
    rt.finish(step)
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


def test_a_request_that_starts_decoding_after_routing_turned_off_decodes_dense_beside_routed_ones(tmp_path):
    arm = Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 1.0}})
    rt = runtime(arm, tmp_path, enter=100, exit_=50)
    run_pass(rt, decode(["a"], [120]))  # on; a routed
    step = run_pass(rt, decode(["c"], [10]))  # a finished (left the batch); V 10 <= exit: off; c dense
    assert not step.routed
    step = run_pass(rt, decode(["c", "d"], [11, 200]))  # on again; c promoted; d routed
    assert step.routed and step.dense_rows is None
    assert rt.attestation()["switch"]["decisions_total"] == {"route_on": 2, "promote": 2, "route_off": 1}


def test_no_promotion_arm_keeps_running_dense_requests_dense_in_a_routed_pass(tmp_path):
    arm = Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 1.0}, "promotion": False})
    rt = runtime(arm, tmp_path, enter=100, exit_=50)
    run_pass(rt, decode(["a"], [20]))
    step = run_pass(rt, decode(["a", "b"], [21, 90]))  # V 111: on; a stays dense, b routed
    assert step.routed and step.dense_rows.tolist() == [True, False]
    assert rt.attestation()["rows_total"]["decode"] == {"run": 0, "project_only": 2}  # only b's rows count


def test_prefill_mode_is_fixed_at_admission_and_kept_across_chunks(tmp_path):
    arm = Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}, "phases": "decode",
                         "mode_switch": False})
    rt = runtime(arm, tmp_path)  # prefill dense, decode always routed
    assert not run_pass(rt, prefill(["a"], [600], [600])).routed
    assert not run_pass(rt, prefill(["a", "b"], [1200, 30], [600, 30])).routed  # a's second chunk, b admitted
    att = rt.attestation()
    assert att["requests_total"]["prefill"] == {"dense": 2}
    assert att["switch"]["admitted_prefill_rounds"] == 2
    assert run_pass(rt, decode(["a", "b"], [1201, 31])).routed


def test_counters_are_written_to_the_state_file_after_every_pass(tmp_path):
    rt = runtime(get_arm("dense"), tmp_path)
    run_pass(rt, prefill(["a"], [5]))
    run_pass(rt, decode(["a"], [6]))
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["passes_total"] == {"prefill": {"dense": 1, "routed": 0}, "decode": {"dense": 1, "routed": 0}}
    assert state["arm"]["name"] == "dense"
    assert state["constants"]["enter_factor"] == 1.25


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


def test_a_routed_arm_on_a_qwen3_checkpoint_routes_its_passes(tmp_path):
    arm = Arm.from_dict({"skipper": "static_depth", "params": {"ratio": 0.5}, "mode_switch": False})
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
    with pytest.raises(ServeConfigError, match="VSKIPPER_ARM is not set"):
        ServeSpec.from_env({})
