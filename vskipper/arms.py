"""Serving configurations ("arms"): which skipper, with which parameters, routing which phases, switched how.

Every arm the project serves or benchmarks is a named entry of `ARMS`; a user can also pass an arm as a dict
(from YAML/JSON or a SkipperDeployment's spec) to `Arm.from_dict`. `Arm.validate()` refuses, before anything is
loaded, an unknown skipper, bad parameters, and a phase the skipper cannot serve, with the field named.

Pure Python: no torch (the registry's declarations are enough to validate).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vskipper.skippers.registry import PHASES, SkipperConfigError, get_entry
from vskipper.switch import Policy, SwitchSettings

PHASE_CHOICES = {"both": PHASES, "decode": ("decode",), "prefill": ("prefill",), "none": ()}
_FIELDS = ("name", "skipper", "params", "phases", "mode_switch", "promotion")


@dataclass(frozen=True)
class Arm:
    name: str
    skipper: str | None  # None: the upstream-equivalent dense arm
    params: Mapping[str, Any] = field(default_factory=dict)
    phases: str = "both"  # both | decode | prefill | none
    mode_switch: bool = True  # True: hybrid (the profitability switch); False: always route the phases
    promotion: bool = True  # False: the no-promotion ablation

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], name: str | None = None) -> Arm:
        if not isinstance(data, Mapping):
            raise SkipperConfigError(f"arm must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise SkipperConfigError(f"arm.{unknown[0]}: unknown field (allowed: {', '.join(_FIELDS)})")
        values = dict(data)
        values.setdefault("name", name or "custom")
        if "skipper" not in values:
            raise SkipperConfigError("arm.skipper: required (a registered skipper name, or null for dense)")
        return cls(**values).validate()

    def validate(self) -> Arm:
        where = f"arm {self.name!r}"
        for key in ("mode_switch", "promotion"):
            if not isinstance(getattr(self, key), bool):
                raise SkipperConfigError(f"{where}: field {key!r} must be true or false, got {getattr(self, key)!r}")
        if self.phases not in PHASE_CHOICES:
            raise SkipperConfigError(
                f"{where}: field 'phases' must be one of {sorted(PHASE_CHOICES)}, got {self.phases!r}")
        if self.skipper is None:
            if self.phases != "none" or self.params:
                raise SkipperConfigError(f"{where}: field 'skipper' is null (dense arm): phases must be 'none' "
                                         "and params empty")
            return self
        if self.phases == "none":
            raise SkipperConfigError(f"{where}: field 'phases' is 'none' but skipper {self.skipper!r} is set")
        entry = get_entry(self.skipper, where=f"{where}: field 'skipper'")
        resolved = entry.validate_params(self.params, where=f"{where}: field 'params'")
        missing = [p for p in PHASE_CHOICES[self.phases] if p not in entry.phases]
        if missing:
            raise SkipperConfigError(
                f"{where}: field 'phases' is {self.phases!r} but skipper {self.skipper!r} cannot serve "
                f"{', '.join(missing)} (it serves {', '.join(sorted(entry.phases))})")
        object.__setattr__(self, "params", resolved)
        return self

    @property
    def routed_phases(self) -> tuple[str, ...]:
        return PHASE_CHOICES[self.phases]

    def switch_settings(self) -> SwitchSettings:
        on = Policy.HYBRID if self.mode_switch else Policy.ROUTED

        def policy(phase: str) -> Policy:
            return on if phase in self.routed_phases else Policy.DENSE

        return SwitchSettings(policy("prefill"), policy("decode"), promotion=self.promotion)

    def declared_skip_ratio(self) -> float | None:
        if self.skipper is None:
            return None
        return get_entry(self.skipper).declared_skip_ratio(self.params)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "skipper": self.skipper, "params": dict(self.params), "phases": self.phases,
                "mode_switch": self.mode_switch, "promotion": self.promotion,
                "switch": self.switch_settings().as_dict(), "declared_skip_ratio": self.declared_skip_ratio()}


def _arms() -> dict[str, Arm]:
    fd = "flexidepth"
    arms = [
        Arm("dense", None, phases="none"),
        Arm("hybrid", fd),
        Arm("always-route", fd, mode_switch=False),
        Arm("decode-only", fd, phases="decode"),
        Arm("prefill-only", fd, phases="prefill"),
        Arm("decode-only-always", fd, phases="decode", mode_switch=False),
        Arm("no-promotion", fd, promotion=False),
        Arm("qwen3-hybrid", "qwen3_hard_gate"),
        Arm("qwen3-always-route", "qwen3_hard_gate", mode_switch=False),
        Arm("static-depth-50", "static_depth", {"ratio": 0.5}),
    ]
    for r in (25, 50, 75):
        for d in (25, 50, 75):
            params = {"r": r / 100, "d": d / 100}
            arms.append(Arm(f"random-r{r}-d{d}", "random_skip", params))
            arms.append(Arm(f"random-r{r}-d{d}-always", "random_skip", params, mode_switch=False))
    return {arm.name: arm.validate() for arm in arms}


ARMS: dict[str, Arm] = _arms()


def get_arm(name: str) -> Arm:
    arm = ARMS.get(name)
    if arm is None:
        raise SkipperConfigError(f"arm: unknown arm {name!r} (known: {', '.join(sorted(ARMS))})")
    return arm
