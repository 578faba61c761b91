"""Serving configurations ("arms"): which skipper, with which parameters, and the switch's policy for each phase.

Every arm the project serves or benchmarks is a named entry of `ARMS`; a user can also pass an arm as a dict
(from YAML/JSON or a SkipperDeployment's spec) to `Arm.from_dict`. `Arm.validate()` refuses, before anything is
loaded, an unknown skipper, bad parameters, a policy that is not the switch's, and a phase the skipper cannot
serve, with the field named.

Pure Python: no torch (the registry's declarations are enough to validate).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vskipper.skippers.registry import PHASES, SkipperConfigError, get_entry
from vskipper.switch import Policy, SwitchSettings

_FIELDS = ("name", "skipper", "params", "prefill", "decode", "promotion")
# Fields of the earlier arm format, refused with what replaced them.
_REPLACED = {"phases": "'prefill' and 'decode' (each dense | routed | hybrid)",
             "mode_switch": "'prefill' and 'decode': hybrid switches a phase, routed always routes it"}
_POLICIES = ", ".join(p.value for p in Policy)


@dataclass(frozen=True)
class Arm:
    """An arm: the skipper, its parameters, and the switch's own settings, one policy per phase (the values
    `vskipper.switch.Policy` takes and a SkipperDeployment's spec.switch uses)."""

    name: str
    skipper: str | None  # None: the upstream-equivalent dense arm
    params: Mapping[str, Any] = field(default_factory=dict)
    prefill: Policy = Policy.HYBRID
    decode: Policy = Policy.HYBRID
    promotion: bool = True  # False: the no-promotion ablation

    def __post_init__(self) -> None:
        for phase in PHASES:  # the switch's own values, whatever spelling they came in (an enum or its value)
            value = getattr(self, phase)
            try:
                object.__setattr__(self, phase, Policy(value))
            except ValueError:
                raise SkipperConfigError(f"arm {self.name!r}: field {phase!r} must be one of {_POLICIES}, "
                                         f"got {value!r}") from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], name: str | None = None) -> Arm:
        if not isinstance(data, Mapping):
            raise SkipperConfigError(f"arm must be a mapping, got {type(data).__name__}")
        for old, new in _REPLACED.items():
            if old in data:
                raise SkipperConfigError(f"arm.{old}: no longer a field: use {new}")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise SkipperConfigError(f"arm.{unknown[0]}: unknown field (allowed: {', '.join(_FIELDS)})")
        values = dict(data)
        values.setdefault("name", name or "custom")
        if "skipper" not in values:
            raise SkipperConfigError("arm.skipper: required (a registered skipper name, or null for dense)")
        if values["skipper"] is None:  # a dense arm routes nothing unless it says otherwise (and is refused)
            values.setdefault("prefill", Policy.DENSE)
            values.setdefault("decode", Policy.DENSE)
        return cls(**values).validate()

    def validate(self) -> Arm:
        where = f"arm {self.name!r}"
        if not isinstance(self.promotion, bool):
            raise SkipperConfigError(f"{where}: field 'promotion' must be true or false, got {self.promotion!r}")
        routed = self.routed_phases
        if self.skipper is None:
            if routed or self.params:
                raise SkipperConfigError(f"{where}: field 'skipper' is null (dense arm): prefill and decode must "
                                         "be 'dense' and params empty")
            return self
        if not routed:
            raise SkipperConfigError(f"{where}: fields 'prefill' and 'decode' are both 'dense' but skipper "
                                     f"{self.skipper!r} is set")
        if len(routed) == 2 and self.prefill is not self.decode:
            raise SkipperConfigError(f"{where}: fields 'prefill' ({self.prefill.value}) and 'decode' "
                                     f"({self.decode.value}) both route but with different policies: a server "
                                     "switches the phases it routes the same way")
        entry = get_entry(self.skipper, where=f"{where}: field 'skipper'")
        resolved = entry.validate_params(self.params, where=f"{where}: field 'params'")
        missing = [p for p in routed if p not in entry.phases]
        if missing:
            raise SkipperConfigError(
                f"{where}: field {missing[0]!r} is {getattr(self, missing[0]).value!r} but skipper "
                f"{self.skipper!r} cannot serve {', '.join(missing)} (it serves {', '.join(sorted(entry.phases))})")
        object.__setattr__(self, "params", resolved)
        return self

    @property
    def routed_phases(self) -> tuple[str, ...]:
        """The phases this arm routes, always or when the switch says so."""
        return tuple(p for p in PHASES if getattr(self, p) is not Policy.DENSE)

    def switch_settings(self) -> SwitchSettings:
        return SwitchSettings(self.prefill, self.decode, promotion=self.promotion)

    def declared_skip_ratio(self, routed_layers: int | None = None) -> float | None:
        """The share s of routed decisions that project, as the params declare it; given the model's routed
        layers, as those layers carry it out (SkipperConfigError where they cannot)."""
        if self.skipper is None:
            return None
        return get_entry(self.skipper).declared_skip_ratio(self.params, routed_layers,
                                                            where=f"arm {self.name!r}: field 'params'")

    def fields(self) -> dict[str, Any]:
        """The arm as `from_dict` takes it (an arm file, the served configuration)."""
        return {"name": self.name, "skipper": self.skipper, "params": dict(self.params),
                "prefill": self.prefill.value, "decode": self.decode.value,
                "promotion": self.promotion}

    def as_dict(self) -> dict[str, Any]:
        """`fields()` and the skip ratio the parameters declare (what a server attests)."""
        return {**self.fields(), "declared_skip_ratio": self.declared_skip_ratio()}


def _arms() -> dict[str, Arm]:
    fd = "flexidepth"
    dense, routed = Policy.DENSE, Policy.ROUTED
    arms = [
        Arm("dense", None, prefill=dense, decode=dense),
        Arm("hybrid", fd),
        Arm("always-route", fd, prefill=routed, decode=routed),
        Arm("decode-only", fd, prefill=dense),
        Arm("prefill-only", fd, decode=dense),
        Arm("decode-only-always", fd, prefill=dense, decode=routed),
        Arm("no-promotion", fd, promotion=False),
        Arm("qwen3-hybrid", "qwen3_hard_gate"),
        Arm("qwen3-always-route", "qwen3_hard_gate", prefill=routed, decode=routed),
        Arm("static-depth-50", "static_depth", {"ratio": 0.5}),
    ]
    for r in (25, 50, 75):
        for d in (25, 50, 75):
            params = {"r": r / 100, "d": d / 100}
            arms.append(Arm(f"random-r{r}-d{d}", "random_skip", params))
            arms.append(Arm(f"random-r{r}-d{d}-always", "random_skip", params, prefill=routed, decode=routed))
    return {arm.name: arm.validate() for arm in arms}


ARMS: dict[str, Arm] = _arms()


def get_arm(name: str) -> Arm:
    arm = ARMS.get(name)
    if arm is None:
        raise SkipperConfigError(f"arm: unknown arm {name!r} (known: {', '.join(sorted(ARMS))})")
    return arm
