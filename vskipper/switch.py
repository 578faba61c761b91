"""The profitability-aware mode switch: which requests run routed, per phase.

Decode. The switch holds a hysteresis state over the running batch's resident KV tokens V: routing turns on
when V >= enter and off when V <= exit, and keeps its state in between. A request's decode mode is fixed when it
starts decoding (after its prefill): routed while routing is on, dense otherwise. The off->on crossing promotes
the requests already decoding densely to routed, once (unless promotion is disabled, the ablation). A routed
request never returns to dense, even after routing turns off: turning off only affects requests that start later.

Prefill. The mode is fixed per admission round: routed when the round's prompt tokens (counted before
prefix-cache hits) reach the floor and the estimated Project-Only share exceeds the minimum. The estimate is
refreshed by a probe: every `probe_period` admitted batches a probe falls due, and the next round that meets the
floor runs routed so the runtime can measure the share it actually projected (`record_prefill_share`).

Every state change is recorded as a `Decision` (time, V, thresholds, what was decided) for attestation.
Pure Python: no torch, no I/O; time comes from the caller.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field

from vskipper.constants import CONSTANTS, SwitchConstants

# The two kinds of forward pass a mode is decided for; every per-phase table (arms, counters, metrics labels,
# attestations) is keyed by these names.
PHASES = ("prefill", "decode")


class Mode(str, enum.Enum):
    DENSE = "dense"
    ROUTED = "routed"


class Policy(str, enum.Enum):
    DENSE = "dense"  # never route this phase
    ROUTED = "routed"  # always route this phase (the switch is off)
    HYBRID = "hybrid"  # route when the profitability rule says so


@dataclass(frozen=True)
class SwitchSettings:
    prefill: Policy
    decode: Policy
    promotion: bool = True

    def __post_init__(self) -> None:
        for phase in PHASES:
            value = getattr(self, phase)
            if not isinstance(value, Policy):
                try:
                    object.__setattr__(self, phase, Policy(value))
                except ValueError:
                    raise ValueError(
                        f"switch.{phase} must be one of {[p.value for p in Policy]}, got {value!r}") from None

    @property
    def routes_any(self) -> bool:
        return self.prefill is not Policy.DENSE or self.decode is not Policy.DENSE

    def as_dict(self) -> dict:
        return {"prefill": self.prefill.value, "decode": self.decode.value, "promotion": self.promotion}


class DecisionKind(str, enum.Enum):
    ROUTE_ON = "route_on"  # decode: V crossed the enter threshold
    ROUTE_OFF = "route_off"  # decode: V fell to the exit threshold
    PROMOTE = "promote"  # decode: running dense requests promoted at the crossing
    PREFILL_ROUTED = "prefill_routed"
    PREFILL_DENSE = "prefill_dense"
    PROBE = "probe"  # a prefill share probe ran (value = the measured share)


@dataclass(frozen=True)
class Decision:
    time: float
    kind: DecisionKind
    resident_tokens: int
    enter_tokens: int
    exit_tokens: int
    count: int = 0  # promoted requests (PROMOTE) or prompt tokens (PREFILL_*)
    value: float | None = None  # the share estimate a prefill decision used, or a probe's measured share

    def as_dict(self) -> dict:
        d = asdict(self)
        d["kind"] = self.kind.value
        return d


@dataclass(frozen=True)
class PrefillDecision:
    mode: Mode
    probe: bool  # the runtime must report this round's Project-Only share via record_prefill_share()
    reason: str


@dataclass
class _Counters:
    decisions: Counter = field(default_factory=Counter)
    decode_started: Counter = field(default_factory=Counter)
    prefill_rounds: Counter = field(default_factory=Counter)
    promoted_requests: int = 0
    probes: int = 0


class ModeSwitch:
    def __init__(
        self,
        settings: SwitchSettings,
        enter_tokens: int,
        exit_tokens: int,
        *,
        declared_project_share: float | None = None,
        constants: SwitchConstants = CONSTANTS,
        history: int = 4096,
    ) -> None:
        for name, value in (("enter_tokens", enter_tokens), ("exit_tokens", exit_tokens)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"switch.{name} must be a non-negative integer, got {value!r}")
        if enter_tokens < exit_tokens:
            raise ValueError(
                f"switch.enter_tokens ({enter_tokens}) must be >= switch.exit_tokens ({exit_tokens})")
        if declared_project_share is not None and not 0.0 <= declared_project_share <= 1.0:
            raise ValueError(f"declared_project_share must be in [0, 1], got {declared_project_share!r}")
        self.settings = settings
        self.enter_tokens = enter_tokens
        self.exit_tokens = exit_tokens
        self.constants = constants
        self._routing_on = settings.decode is Policy.ROUTED
        self._modes: dict[Hashable, Mode] = {}
        self._last_v = 0
        self._share = declared_project_share
        self._admitted = 0
        self._probe_due = settings.prefill is Policy.HYBRID
        self._history: deque[Decision] = deque(maxlen=history)
        self._recorded = 0
        self.counters = _Counters()

    # ---- decode -------------------------------------------------------------------------------------------
    @property
    def routing_on(self) -> bool:
        return self._routing_on

    def observe(self, resident_tokens: int, now: float) -> list[Hashable]:
        """Feed the running batch's resident KV tokens for this step; returns the requests promoted now."""
        if not isinstance(resident_tokens, int) or resident_tokens < 0:
            raise ValueError(f"resident_tokens must be a non-negative integer, got {resident_tokens!r}")
        self._last_v = resident_tokens
        if self.settings.decode is not Policy.HYBRID:
            return []
        promoted: list[Hashable] = []
        if not self._routing_on and resident_tokens >= self.enter_tokens:
            self._routing_on = True
            self._record(now, DecisionKind.ROUTE_ON)
            if self.settings.promotion:
                promoted = [rid for rid, mode in self._modes.items() if mode is Mode.DENSE]
                for rid in promoted:
                    self._modes[rid] = Mode.ROUTED
                if promoted:  # a decision only when somebody changed mode
                    self.counters.promoted_requests += len(promoted)
                    self._record(now, DecisionKind.PROMOTE, count=len(promoted))
        elif self._routing_on and resident_tokens <= self.exit_tokens:
            self._routing_on = False
            self._record(now, DecisionKind.ROUTE_OFF)
        return promoted

    def start_decode(self, rid: Hashable) -> Mode:
        """Fix a request's decode mode once its prefill is done."""
        if rid in self._modes:
            raise ValueError(f"request {rid!r} already decoding in mode {self._modes[rid].value}")
        policy = self.settings.decode
        if policy is Policy.ROUTED or (policy is Policy.HYBRID and self._routing_on):
            mode = Mode.ROUTED
        else:
            mode = Mode.DENSE
        self._modes[rid] = mode
        self.counters.decode_started[mode.value] += 1
        return mode

    def decode_mode(self, rid: Hashable) -> Mode:
        return self._modes[rid]

    def finish(self, rid: Hashable) -> None:
        self._modes.pop(rid, None)

    def running(self) -> dict[Hashable, Mode]:
        return dict(self._modes)

    # ---- prefill ------------------------------------------------------------------------------------------
    @property
    def prefill_share_estimate(self) -> float | None:
        return self._share

    def preview_prefill(self, prompt_tokens: int) -> PrefillDecision:
        """The decision `admit_prefill(prompt_tokens, ...)` would take now, changing nothing.

        A scheduler keys the prefix cache by prefill mode, so it needs the mode before it matches prefixes and
        knows which requests the round admits; it commits the round with `admit_prefill` once it is formed."""
        return self._prefill_choice(prompt_tokens, self._probe_due_at_next_round())

    def admit_prefill(self, prompt_tokens: int, now: float, *, bound: Mode | None = None) -> PrefillDecision:
        """Decide the mode of one admission round from its prompt tokens (before prefix-cache hits).

        `bound`: the round reuses prefix KV that was computed in this mode, so it must run in it whatever the
        rule would choose; the decision says so, and a share probe runs only if the rule's choice was one."""
        self._probe_due = self._probe_due_at_next_round()
        decision = self._prefill_choice(prompt_tokens, self._probe_due)
        if bound is not None and bound is not decision.mode:
            decision = PrefillDecision(bound, False, f"bound to {bound.value} by prefix reuse "
                                                     f"(the rule chose {decision.mode.value}: {decision.reason})")
        self._admitted += 1
        if decision.probe:
            self._probe_due = False
        self.counters.prefill_rounds[decision.mode.value] += 1
        if self.settings.prefill is Policy.HYBRID:
            kind = DecisionKind.PREFILL_ROUTED if decision.mode is Mode.ROUTED else DecisionKind.PREFILL_DENSE
            self._record(now, kind, count=prompt_tokens, value=self._share)
        return decision

    def _probe_due_at_next_round(self) -> bool:
        period = self.constants.prefill_probe_period_batches
        return self._probe_due or (self.settings.prefill is Policy.HYBRID and self._admitted % period == 0)

    def _prefill_choice(self, prompt_tokens: int, probe_due: bool) -> PrefillDecision:
        if not isinstance(prompt_tokens, int) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be a non-negative integer, got {prompt_tokens!r}")
        c = self.constants
        policy = self.settings.prefill
        if policy is Policy.DENSE:
            return PrefillDecision(Mode.DENSE, False, "prefill policy is dense")
        if policy is Policy.ROUTED:
            return PrefillDecision(Mode.ROUTED, False, "prefill policy is always-route")
        if prompt_tokens < c.prefill_min_prompt_tokens:
            return PrefillDecision(Mode.DENSE, False,
                                   f"{prompt_tokens} prompt tokens < floor {c.prefill_min_prompt_tokens}")
        if probe_due:
            return PrefillDecision(Mode.ROUTED, True, "share probe due")
        if self._share is not None and self._share > c.prefill_min_project_share:
            return PrefillDecision(Mode.ROUTED, False, f"share {self._share:.3f} > {c.prefill_min_project_share}")
        return PrefillDecision(Mode.DENSE, False, f"share {self._share} <= {c.prefill_min_project_share}")

    def record_prefill_share(self, share: float, now: float) -> None:
        """Report the Project-Only share measured on a probe round."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {share!r}")
        self._share = float(share)
        self.counters.probes += 1
        self._record(now, DecisionKind.PROBE, value=self._share)

    # ---- attestation --------------------------------------------------------------------------------------
    def _record(self, now: float, kind: DecisionKind, count: int = 0, value: float | None = None) -> None:
        self.counters.decisions[kind.value] += 1
        self._recorded += 1
        self._history.append(
            Decision(now, kind, self._last_v, self.enter_tokens, self.exit_tokens, count, value))

    def decisions(self) -> list[Decision]:
        """The most recent decisions (a bounded window; `attestation()['decisions_recorded']` counts all)."""
        return list(self._history)

    def attestation(self, recent: int = 64) -> dict:
        return {
            "settings": self.settings.as_dict(),
            "constants": asdict(self.constants),
            "enter_tokens": self.enter_tokens,
            "exit_tokens": self.exit_tokens,
            "routing_on": self._routing_on,
            "resident_tokens": self._last_v,
            "prefill_share_estimate": self._share,
            "admitted_prefill_rounds": self._admitted,
            "decisions_total": dict(self.counters.decisions),
            "decode_started_total": dict(self.counters.decode_started),
            "prefill_rounds_total": dict(self.counters.prefill_rounds),
            "promoted_requests_total": self.counters.promoted_requests,
            "probes_total": self.counters.probes,
            "decisions_recorded": self._recorded,
            "recent_decisions": [d.as_dict() for d in list(self._history)[-recent:]],
        }
