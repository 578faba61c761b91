"""Arms: every named serving configuration validates, maps to the right switch settings, and bad ones are
refused at startup with the offending field named."""

import pytest

from vskipper.arms import ARMS, Arm, get_arm
from vskipper.skippers import SkipperConfigError, SkipperEntry, register_skipper, unregister_skipper
from vskipper.switch import Policy


def test_builtin_arms_cover_the_paper_settings():
    for name in ("dense", "hybrid", "always-route", "decode-only", "prefill-only", "no-promotion",
                 "static-depth-50", "qwen3-hybrid", "random-r50-d50", "random-r75-d75-always"):
        assert name in ARMS
    s = ARMS["hybrid"].switch_settings()
    assert (s.prefill, s.decode, s.promotion) == (Policy.HYBRID, Policy.HYBRID, True)
    s = ARMS["always-route"].switch_settings()
    assert (s.prefill, s.decode) == (Policy.ROUTED, Policy.ROUTED)
    s = ARMS["decode-only"].switch_settings()
    assert (s.prefill, s.decode) == (Policy.DENSE, Policy.HYBRID)
    s = ARMS["dense"].switch_settings()
    assert (s.prefill, s.decode) == (Policy.DENSE, Policy.DENSE) and not s.routes_any
    assert ARMS["no-promotion"].switch_settings().promotion is False


def test_declared_skip_ratios_feed_the_rule():
    assert ARMS["hybrid"].declared_skip_ratio() == 0.5
    assert ARMS["random-r75-d50"].declared_skip_ratio() == pytest.approx(0.375)
    assert ARMS["dense"].declared_skip_ratio() is None


def test_arm_from_dict_resolves_defaults():
    arm = Arm.from_dict({"name": "mine", "skipper": "random_skip", "params": {"r": 0.5, "d": 0.25},
                         "prefill": "dense", "decode": "routed"})
    assert arm.params == {"r": 0.5, "d": 0.25, "seed": 0}
    assert arm.switch_settings().as_dict() == {"prefill": "dense", "decode": "routed", "promotion": True}
    assert Arm.from_dict(arm.fields()) == arm  # an arm file round-trips
    assert Arm.from_dict({"skipper": None}).routed_phases == ()  # null skipper: dense unless told otherwise


@pytest.mark.parametrize("data,match", [
    ({"skipper": "nope"}, "field 'skipper': unknown skipper 'nope'"),
    ({"skipper": "random_skip", "params": {"r": 2, "d": 0.5}}, r"field 'params'.r must be in \[0.0, 1.0\]"),
    ({"skipper": "static_depth"}, "field 'params'.ratio: required"),
    ({"skipper": "flexidepth", "decode": "sometimes"}, "field 'decode' must be one of dense, routed, hybrid"),
    ({"skipper": "flexidepth", "prefill": "always-route"}, "field 'prefill' must be one of dense, routed, hybrid"),
    ({"skipper": "flexidepth", "promotion": "yes"}, "field 'promotion' must be true or false"),
    ({"skipper": "flexidepth", "phase": "both"}, "arm.phase: unknown field"),
    ({"skipper": "flexidepth", "phases": "both"}, "arm.phases: no longer a field: use 'prefill' and 'decode'"),
    ({"skipper": "flexidepth", "mode_switch": False}, "arm.mode_switch: no longer a field"),
    ({"decode": "hybrid"}, "arm.skipper: required"),
    ({"skipper": None, "decode": "hybrid"}, "dense arm"),
    ({"skipper": "flexidepth", "prefill": "dense", "decode": "dense"}, "both 'dense' but skipper 'flexidepth'"),
    ({"skipper": "flexidepth", "prefill": "routed", "decode": "hybrid"}, "both route but with different policies"),
])
def test_bad_arms_name_the_field(data, match):
    with pytest.raises(SkipperConfigError, match=match):
        Arm.from_dict(data, name="bad")


def test_an_arm_cannot_route_a_phase_its_skipper_cannot_serve():
    register_skipper(SkipperEntry("decode_only_policy", "x:y", phases=frozenset({"decode"})))
    try:
        assert Arm.from_dict({"skipper": "decode_only_policy", "prefill": "dense"}).routed_phases == ("decode",)
        with pytest.raises(SkipperConfigError, match="field 'prefill' is 'hybrid' but .* cannot serve prefill"):
            Arm.from_dict({"skipper": "decode_only_policy"}, name="x")
    finally:
        unregister_skipper("decode_only_policy")


def test_unknown_arm_lists_the_known_ones():
    with pytest.raises(SkipperConfigError, match="unknown arm 'fast'.*hybrid"):
        get_arm("fast")
