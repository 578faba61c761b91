"""What the load generator expects the runtime to attest, in one place.

The runtime serves a JSON document at an HTTP GET path (default `/vskipper/attestation`, configurable with
`--attestation-path`). The mechanism and served-design gates read it before and after each cell. Required:

    {
      "passes_total": {"prefill": {"dense": int, "routed": int},
                       "decode":  {"dense": int, "routed": int}},   # cumulative, monotonic
      "arm": { ... }                                                 # vskipper.arms.Arm.as_dict() of the served arm
    }

Optional: "scheduler_passes_total": {"prefill": int, "decode": int}, the scheduler's own pass counts; when
present, the per-mode counters of a phase must sum to it over the cell. "executed": {field: value}, the
configuration the server executes as read from SGLang after boot (attention backends, sampling backend, decode
graph batch sizes, chunked-prefill size, max running requests, `kv_pool` {tokens, bytes}, dtypes, page size,
parallel sizes, scheduler policy, overlap scheduler, SGLang version, vSkipper profile; see
`vskipper.sglang.executed`); the execution-difference and cross-arm identity gates read it. "answered": false
where the server could not write the document for this read in time and served its latest one instead (its
counters may lack the last passes): the load generator reads again, up to `READ_ATTEMPTS` reads in all. Other
keys (switch attestation, constants, ...) are kept in `raw` untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vskipper.metrics_names import MODES, PHASES

DEFAULT_ATTESTATION_PATH = "/vskipper/attestation"
READ_ATTEMPTS = 3  # reads of a document the server served late ("answered": false) before it is taken as it is


def answered(data: Any) -> bool:
    """Whether a document was written for the read that fetched it: every one that does not say otherwise."""
    return not (isinstance(data, Mapping) and data.get("answered") is False)


def read_answered(read: Callable[[], Any]) -> Any:
    """A document from `read()` (one GET of the server's attestation), read again where the server served one older
    than the read (`answered`), up to `READ_ATTEMPTS` reads, the last taken as it is."""
    for _ in range(READ_ATTEMPTS):
        data = read()
        if answered(data):
            break
    return data


class AttestationError(ValueError):
    pass


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AttestationError(f"{where}: must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Attestation:
    passes_total: dict[str, dict[str, int]]
    arm: dict[str, Any] | None = None
    scheduler_passes_total: dict[str, int] | None = None
    executed: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> Attestation:
        if not isinstance(data, Mapping):
            raise AttestationError(f"attestation: must be a JSON object, got {type(data).__name__}")
        passes = data.get("passes_total")
        if not isinstance(passes, Mapping):
            raise AttestationError("attestation.passes_total: required, an object {phase: {mode: count}}")
        parsed: dict[str, dict[str, int]] = {}
        for phase in PHASES:
            per_mode = passes.get(phase)
            if not isinstance(per_mode, Mapping):
                raise AttestationError(f"attestation.passes_total.{phase}: required, an object {{mode: count}}")
            parsed[phase] = {m: _count(per_mode.get(m, 0), f"attestation.passes_total.{phase}.{m}")
                             for m in MODES}
        arm = data.get("arm")
        if arm is not None and not isinstance(arm, Mapping):
            raise AttestationError(f"attestation.arm: must be an object, got {type(arm).__name__}")
        sched = data.get("scheduler_passes_total")
        sched_parsed = None
        if sched is not None:
            if not isinstance(sched, Mapping):
                raise AttestationError("attestation.scheduler_passes_total: must be an object {phase: count}")
            sched_parsed = {p: _count(sched.get(p, 0), f"attestation.scheduler_passes_total.{p}") for p in PHASES}
        executed = data.get("executed")
        if executed is not None and not isinstance(executed, Mapping):
            raise AttestationError(f"attestation.executed: must be an object, got {type(executed).__name__}")
        return cls(parsed, dict(arm) if arm is not None else None, sched_parsed,
                   dict(executed) if executed is not None else None, dict(data))

    def as_dict(self) -> dict:
        return dict(self.raw) or {"passes_total": self.passes_total, "arm": self.arm,
                                  "scheduler_passes_total": self.scheduler_passes_total}


@dataclass(frozen=True)
class PassDelta:
    """Passes executed between two attestations; `regressions` lists counters that went backwards."""

    passes: dict[str, dict[str, int]]
    scheduler: dict[str, int] | None
    regressions: tuple[str, ...]


def pass_delta(before: Attestation, after: Attestation) -> PassDelta:
    passes: dict[str, dict[str, int]] = {}
    regressions: list[str] = []
    for phase in PHASES:
        passes[phase] = {}
        for mode in MODES:
            d = after.passes_total[phase][mode] - before.passes_total[phase][mode]
            if d < 0:
                regressions.append(f"passes_total.{phase}.{mode}")
            passes[phase][mode] = d
    sched = None
    if before.scheduler_passes_total is not None and after.scheduler_passes_total is not None:
        sched = {p: after.scheduler_passes_total[p] - before.scheduler_passes_total[p] for p in PHASES}
        regressions += [f"scheduler_passes_total.{p}" for p in PHASES if sched[p] < 0]
    return PassDelta(passes, sched, tuple(regressions))
