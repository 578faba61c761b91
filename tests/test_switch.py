"""The mode switch's invariants, under arbitrary interleavings of load, arrivals and completions."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vskipper.arms import ARMS
from vskipper.constants import CONSTANTS
from vskipper.switch import DecisionKind, Mode, ModeSwitch, Policy, SwitchSettings

ENTER, EXIT = 200_000, 160_000
V = st.integers(min_value=0, max_value=400_000)


class DecodeSwitchMachine(RuleBasedStateMachine):
    """Drives a hybrid switch (with or without promotion) and checks it against a plain model of the rules."""

    @initialize(promotion=st.booleans())
    def setup(self, promotion):
        self.sw = ModeSwitch(SwitchSettings(Policy.HYBRID, Policy.HYBRID, promotion), ENTER, EXIT)
        self.on = False
        self.ever_routed: set[int] = set()
        self.promoted_once: set[int] = set()
        self.next_rid = 0
        self.now = 0.0
        self.crossings = 0

    @rule(v=V)
    def observe(self, v):
        self.now += 1.0
        before = {rid: m for rid, m in self.sw.running().items()}
        promoted = self.sw.observe(v, self.now)
        crossed = not self.on and v >= ENTER
        self.on = (v > EXIT) if self.on else (v >= ENTER)
        self.crossings += crossed
        assert self.sw.routing_on == self.on  # hysteresis: state kept strictly between the thresholds
        if crossed and self.sw.settings.promotion:
            assert set(promoted) == {rid for rid, m in before.items() if m is Mode.DENSE}
        else:
            assert promoted == []  # promotion happens only at the off->on crossing, and not in the ablation
        for rid in promoted:
            assert rid not in self.promoted_once  # a request is promoted at most once
            self.promoted_once.add(rid)

    @rule()
    def start(self):
        rid = self.next_rid
        self.next_rid += 1
        mode = self.sw.start_decode(rid)
        assert mode is (Mode.ROUTED if self.on else Mode.DENSE)  # pinned to routed while routing is on

    @precondition(lambda self: self.sw.running())
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sw.running())))
        self.sw.finish(rid)

    @invariant()
    def routed_requests_never_revert(self):
        modes = self.sw.running()
        for rid in self.ever_routed & set(modes):
            assert modes[rid] is Mode.ROUTED
        self.ever_routed |= {rid for rid, m in modes.items() if m is Mode.ROUTED}

    @invariant()
    def every_crossing_is_recorded(self):
        att = self.sw.attestation()
        assert att["decisions_total"].get(DecisionKind.ROUTE_ON.value, 0) == self.crossings
        if not self.sw.settings.promotion:
            assert att["promoted_requests_total"] == 0


DecodeSwitchMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestDecodeSwitch = DecodeSwitchMachine.TestCase


def test_promotion_happens_once_at_the_crossing():
    sw = ModeSwitch(ARMS["hybrid"].switch_settings(), ENTER, EXIT)
    assert [sw.start_decode(i) for i in range(3)] == [Mode.DENSE] * 3
    assert sw.observe(ENTER, 1.0) == [0, 1, 2]
    assert sw.observe(ENTER + 1, 2.0) == []  # still on: no second promotion
    assert sw.start_decode(3) is Mode.ROUTED
    sw.observe(EXIT, 3.0)  # exit threshold reached: routing off, routed requests stay routed
    assert not sw.routing_on and set(sw.running().values()) == {Mode.ROUTED}
    assert sw.start_decode(4) is Mode.DENSE
    kinds = [d.kind for d in sw.decisions()]
    assert kinds == [DecisionKind.ROUTE_ON, DecisionKind.PROMOTE, DecisionKind.ROUTE_OFF]
    rec = sw.decisions()[0]
    assert (rec.time, rec.resident_tokens, rec.enter_tokens, rec.exit_tokens) == (1.0, ENTER, ENTER, EXIT)
    assert sw.decisions()[1].count == 3


def test_no_promotion_ablation_leaves_running_dense_requests_dense():
    sw = ModeSwitch(ARMS["no-promotion"].switch_settings(), ENTER, EXIT)
    sw.start_decode("a")
    assert sw.observe(10 * ENTER, 1.0) == []
    assert sw.decode_mode("a") is Mode.DENSE and sw.start_decode("b") is Mode.ROUTED


@pytest.mark.parametrize("name,first,after_load", [
    ("always-route", Mode.ROUTED, Mode.ROUTED),
    ("dense", Mode.DENSE, Mode.DENSE),
    ("prefill-only", Mode.DENSE, Mode.DENSE),
    ("decode-only", Mode.DENSE, Mode.ROUTED),
])
def test_fixed_and_per_phase_settings(name, first, after_load):
    sw = ModeSwitch(ARMS[name].switch_settings(), ENTER, EXIT)
    assert sw.start_decode(0) is first
    sw.observe(10 * ENTER, 1.0)
    assert sw.start_decode(1) is after_load


@given(rounds=st.lists(st.integers(min_value=0, max_value=5000), min_size=1, max_size=400),
       share=st.one_of(st.none(), st.floats(min_value=0, max_value=1)))
@settings(max_examples=200, deadline=None)
def test_prefill_rule_and_probe_cadence(rounds, share):
    sw = ModeSwitch(ARMS["hybrid"].switch_settings(), ENTER, EXIT, declared_project_share=share)
    floor, period = CONSTANTS.prefill_min_prompt_tokens, CONSTANTS.prefill_probe_period_batches
    due = False
    for i, tokens in enumerate(rounds):
        due = due or i % period == 0
        estimate = sw.prefill_share_estimate
        before = (sw.attestation(), sw.counters.prefill_rounds.copy())
        for peek in (tokens, 5000 - tokens):  # a scheduler previews candidate rounds before it forms one
            sw.preview_prefill(peek)
        assert (sw.attestation(), sw.counters.prefill_rounds) == before  # previews change nothing
        preview = sw.preview_prefill(tokens)
        decision = sw.admit_prefill(tokens, float(i))
        assert decision == preview
        if tokens < floor:
            assert decision.mode is Mode.DENSE and not decision.probe  # counted before prefix hits
            continue
        # A probe falls due every `period` admitted rounds and runs on the next round that meets the floor.
        assert decision.probe == due
        if decision.probe:
            due = False
            sw.record_prefill_share(0.5, float(i))
            assert decision.mode is Mode.ROUTED
        else:
            expected = estimate is not None and estimate > CONSTANTS.prefill_min_project_share
            assert (decision.mode is Mode.ROUTED) == expected


def test_probe_refreshes_the_share_estimate():
    sw = ModeSwitch(ARMS["hybrid"].switch_settings(), ENTER, EXIT, declared_project_share=0.5)
    assert sw.admit_prefill(2000, 0.0).probe
    sw.record_prefill_share(0.2, 0.0)  # the skipper projected less than declared: stop routing prefill
    assert [sw.admit_prefill(2000, float(i)).mode for i in range(1, 64)] == [Mode.DENSE] * 63
    probe = sw.admit_prefill(2000, 64.0)
    assert probe.probe and probe.mode is Mode.ROUTED
    sw.record_prefill_share(0.6, 64.0)
    assert sw.admit_prefill(2000, 65.0).mode is Mode.ROUTED
    assert sw.admit_prefill(1535, 66.0).mode is Mode.DENSE
    assert sw.attestation()["probes_total"] == 2


def test_bad_switch_arguments_name_the_field():
    with pytest.raises(ValueError, match="enter_tokens"):
        ModeSwitch(ARMS["hybrid"].switch_settings(), 100, 200)
    with pytest.raises(ValueError, match="exit_tokens"):
        ModeSwitch(ARMS["hybrid"].switch_settings(), 100, -1)
    with pytest.raises(ValueError, match="switch.decode"):
        SwitchSettings("hybrid", "sometimes")
    sw = ModeSwitch(ARMS["hybrid"].switch_settings(), ENTER, EXIT)
    with pytest.raises(ValueError, match="resident_tokens"):
        sw.observe(-5, 0.0)
    sw.start_decode("r")
    with pytest.raises(ValueError, match="already decoding"):
        sw.start_decode("r")


def test_attestation_is_json_ready_and_carries_the_thresholds():
    import json

    sw = ModeSwitch(ARMS["hybrid"].switch_settings(), ENTER, EXIT)
    sw.observe(ENTER, 0.5)
    att = json.loads(json.dumps(sw.attestation()))
    assert att["enter_tokens"] == ENTER and att["exit_tokens"] == EXIT
    assert att["settings"] == {"prefill": "hybrid", "decode": "hybrid", "promotion": True}
    assert att["recent_decisions"][0]["kind"] == "route_on"
    assert att["constants"] == __import__("vskipper.constants").constants.attestation()


def test_a_crossing_with_nobody_running_dense_records_no_promotion():
    sw = ModeSwitch(ARMS["hybrid"].switch_settings(), ENTER, EXIT)
    assert sw.observe(ENTER, 1.0) == []
    assert [d.kind for d in sw.decisions()] == [DecisionKind.ROUTE_ON]
    assert sw.attestation()["promoted_requests_total"] == 0


def test_a_round_bound_by_prefix_reuse_runs_in_that_mode_and_says_why():
    sw = ModeSwitch(ARMS["hybrid"].switch_settings(), ENTER, EXIT, declared_project_share=0.9)
    floor = CONSTANTS.prefill_min_prompt_tokens
    decision = sw.admit_prefill(floor - 1, 1.0, bound=Mode.ROUTED)
    assert decision.mode is Mode.ROUTED and not decision.probe and "prefix reuse" in decision.reason
    (record,) = sw.decisions()
    assert record.kind is DecisionKind.PREFILL_ROUTED and record.count == floor - 1  # the admitted round's size
    assert sw.admit_prefill(floor - 1, 2.0, bound=Mode.DENSE).mode is Mode.DENSE  # the rule agrees: unchanged
