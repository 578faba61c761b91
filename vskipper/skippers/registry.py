"""Skipper registry: names -> builders, with each skipper's parameters, actions and phases declared up front.

The registry itself is pure Python (the operator validates a resource's skipper section with it, without torch);
an entry's `target` ("module:Class") is imported only when a skipper is built. Third-party skippers register
with `register_skipper(...)` or through the `vskipper.skippers` entry-point group (each entry point names a
callable that returns a `SkipperEntry`).
"""

from __future__ import annotations

import enum
import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from vskipper.switch import PHASES

_REQUIRED = object()


class Action(str, enum.Enum):
    RUN = "run"  # the row runs the whole layer: attention over its context, then the MLP
    PROJECT_ONLY = "project_only"  # the row writes its own K/V, reads none, and takes the projector's update


WHOLE_LAYER_ACTIONS = frozenset({Action.RUN, Action.PROJECT_ONLY})

# Projector kinds: what a Project-Only row computes instead of the MLP.
FLEXIDEPTH_ADAPTER = "flexidepth_adapter"  # up(silu(gate v) * down v), weights from the checkpoint


class SkipperConfigError(ValueError):
    """A skipper or arm configuration that cannot be served; the message names the offending field."""


@dataclass(frozen=True)
class ParamSpec:
    kind: type
    default: Any = _REQUIRED
    minimum: float | None = None
    maximum: float | None = None
    help: str = ""

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def check(self, where: str, value: Any) -> Any:
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if self.kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, self.kind) or (self.kind is not bool and isinstance(value, bool)):
            raise SkipperConfigError(f"{where} must be of type {self.kind.__name__}, got {value!r}")
        if self.kind is float and not math.isfinite(value):
            raise SkipperConfigError(f"{where} must be finite, got {value!r}")
        lo, hi = self.minimum, self.maximum
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise SkipperConfigError(f"{where} must be in [{lo}, {hi}], got {value!r}")
        return value


@dataclass(frozen=True)
class SkipperEntry:
    name: str
    target: str | Callable[..., Any]  # "module:Class" or a callable taking the validated params as keywords
    params: Mapping[str, ParamSpec] = field(default_factory=dict)
    actions: frozenset[Action] = WHOLE_LAYER_ACTIONS
    phases: frozenset[str] = frozenset(PHASES)
    requires_router_weights: bool = False
    projector_kind: str = FLEXIDEPTH_ADAPTER
    description: str = ""
    # Declared fraction s of routed decisions that project, from validated params (feeds the roofline rule).
    skip_ratio: Callable[[Mapping[str, Any]], float] | None = None
    # The fraction that actually projects over a model's routed layers, where it differs from `skip_ratio` (a
    # skipper that picks whole layers projects a whole number of them). Raises SkipperConfigError, naming the
    # parameter, where the params declare skipping that those layers cannot carry out.
    layer_skip_ratio: Callable[[Mapping[str, Any], int, str], float] | None = None

    def validate_params(self, params: Mapping[str, Any] | None, where: str = "params") -> dict[str, Any]:
        params = dict(params or {})
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            allowed = ", ".join(sorted(self.params)) or "none"
            raise SkipperConfigError(
                f"{where}.{unknown[0]}: unknown parameter for skipper {self.name!r} (allowed: {allowed})")
        resolved = {}
        for key, spec in self.params.items():
            if key in params:
                resolved[key] = spec.check(f"{where}.{key}", params[key])
            elif spec.required:
                raise SkipperConfigError(f"{where}.{key}: required by skipper {self.name!r} ({spec.help})")
            else:
                resolved[key] = spec.default
        return resolved

    def declared_skip_ratio(self, params: Mapping[str, Any], routed_layers: int | None = None,
                            where: str = "params") -> float | None:
        """The share s the params declare; given the model's routed layers, the share those layers carry out."""
        if routed_layers is not None and self.layer_skip_ratio is not None:
            return float(self.layer_skip_ratio(params, routed_layers, where))
        return None if self.skip_ratio is None else float(self.skip_ratio(params))


_REGISTRY: dict[str, SkipperEntry] = {}
_entry_points_loaded = False


def register_skipper(entry: SkipperEntry, *, overwrite: bool = False) -> SkipperEntry:
    if not entry.name or not isinstance(entry.name, str):
        raise SkipperConfigError(f"skipper name must be a non-empty string, got {entry.name!r}")
    if entry.name in _REGISTRY and not overwrite:
        raise SkipperConfigError(f"skipper {entry.name!r} is already registered")
    check_actions(entry.name, entry.actions)
    bad_phases = sorted(set(entry.phases) - set(PHASES))
    if bad_phases or not entry.phases:
        raise SkipperConfigError(f"skipper {entry.name!r}: phases must be a non-empty subset of {PHASES}")
    _REGISTRY[entry.name] = entry
    return entry


def unregister_skipper(name: str) -> None:
    _REGISTRY.pop(name, None)


def check_actions(name: str, actions: Any) -> None:
    """Refuse any action set outside the whole-layer {RUN, PROJECT_ONLY} set the runtime executes."""
    try:
        parsed = {Action(a) for a in actions}
    except (TypeError, ValueError):
        raise SkipperConfigError(
            f"skipper {name!r}: supported_actions {sorted(map(str, actions))} fall outside "
            f"{{run, project_only}}") from None
    if not parsed:
        raise SkipperConfigError(f"skipper {name!r}: supported_actions is empty")


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group="vskipper.skippers"):
        entry = ep.load()()
        if entry.name not in _REGISTRY:
            register_skipper(entry)


def get_entry(name: str, where: str = "skipper") -> SkipperEntry:
    _load_entry_points()
    entry = _REGISTRY.get(name)
    if entry is None:
        raise SkipperConfigError(f"{where}: unknown skipper {name!r} (known: {', '.join(sorted(_REGISTRY))})")
    return entry


def registered() -> dict[str, SkipperEntry]:
    _load_entry_points()
    return dict(_REGISTRY)


def build_skipper(name: str, params: Mapping[str, Any] | None = None, where: str = "skipper"):
    """Validate params and build the skipper object (this imports torch through the plugin module)."""
    entry = get_entry(name, where)
    resolved = entry.validate_params(params, where=f"{where}.params" if where != "skipper" else "params")
    target = entry.target
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
    skipper = target(**resolved)
    # The object must live up to the entry: a plugin cannot widen its actions after registration.
    check_actions(name, getattr(skipper, "supported_actions", ()))
    declared = frozenset(Action(a) for a in skipper.supported_actions)
    if not declared <= entry.actions:
        raise SkipperConfigError(
            f"skipper {name!r}: built object declares actions {sorted(a.value for a in declared)} "
            f"beyond its registration {sorted(a.value for a in entry.actions)}")
    return skipper


def tail_count(routed_layers: int, ratio: float) -> int:
    """How many of a model's routed layers a static tail fraction `ratio` projects (whole layers, rounded down)."""
    return int(routed_layers * ratio + 1e-9)


def _static_depth_share(params: Mapping[str, Any], routed_layers: int, where: str) -> float:
    ratio = params["ratio"]
    if routed_layers < 1:
        raise SkipperConfigError(f"{where}.ratio: the model has no routed layer to project ({routed_layers})")
    take = tail_count(routed_layers, ratio)
    if ratio > 0 and take == 0:
        least = math.ceil(1e4 / routed_layers) / 1e4  # 1/L rounded up to 4 places: itself projects a layer
        raise SkipperConfigError(
            f"{where}.ratio: {ratio} of {routed_layers} routed layers projects no layer, so the arm would serve "
            f"every row dense while declaring s = {ratio}; the least ratio that projects a layer is "
            f"1/{routed_layers} (at least {least:g}; 0 for an all-RUN control)")
    return take / routed_layers


def _unit(help_text: str, default: Any = _REQUIRED) -> ParamSpec:
    return ParamSpec(float, default, 0.0, 1.0, help_text)


register_skipper(SkipperEntry(
    name="flexidepth",
    target="vskipper.skippers.trained_gate:FlexiDepthGate",
    params={"skip_ratio": ParamSpec(float, 0.5, 0.0, 1.0,
                                    "declared decode skip ratio s the thresholds are derived from")},
    requires_router_weights=True,
    description="FlexiDepth trained router: RUN when w > 0.5; RUN weighted by w, Project-Only by 1 - w",
    skip_ratio=lambda p: p["skip_ratio"],
))
register_skipper(SkipperEntry(
    name="qwen3_hard_gate",
    target="vskipper.skippers.trained_gate:HardGate",
    params={"skip_ratio": ParamSpec(float, 0.25, 0.0, 1.0,
                                    "declared skip ratio (e.g. a routing probe's estimate)")},
    requires_router_weights=True,
    description="straight-through hard gate (Qwen3 skippers): RUN when w > 0.5, unit branch weights",
    skip_ratio=lambda p: p["skip_ratio"],
))
register_skipper(SkipperEntry(
    name="random_skip",
    target="vskipper.skippers.random_skip:RandomSkip",
    params={
        "r": _unit("fraction of rows routed around layers"),
        "d": _unit("fraction of routed layers a selected row projects"),
        "seed": ParamSpec(int, 0, 0, 2**31 - 1, "hash seed"),
    },
    description="seeded hash of (seed, request, position): a fraction r of rows projects at a fraction d of layers",
    skip_ratio=lambda p: p["r"] * p["d"],
))
register_skipper(SkipperEntry(
    name="static_depth",
    target="vskipper.skippers.static_depth:StaticDepth",
    params={"ratio": _unit("tail fraction of the routed layers every valid row projects")},
    description="a fixed tail of the routed layers is projected for every valid row",
    skip_ratio=lambda p: p["ratio"],
    layer_skip_ratio=_static_depth_share,
))
