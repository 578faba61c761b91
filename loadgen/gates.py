"""Cell gates: each can refuse a cell, with the gate's name and a reason a reader can act on.

- work_identity: both arms generated the same number of tokens for every request, read from the raw
  server-reported output ids (and the reported count must agree with those ids).
- accounting: submitted = started = completed = reported, zero errors, and the summary covers every record
  (no filtered tail).
- declared_cell_size: the cell ran the exact suite (digest, size, request ids) over duration = requests / rate.
- zero_empty: no empty generation in a natural-lane cell, except request ids declared as known exceptions.
- mechanism_evidence: between the attestations read before and after the cell, routed passes ran on the phases
  the arm declares (every declared phase for always-route arms, at least one for hybrid arms unless the cell is
  declared below the switch's engagement), none on a dense arm, counters never went backwards, and per-mode
  counters sum to the scheduler's pass count when it is attested.
- served_design: the arm the server attests equals the intended arm, field by field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadgen.attestation import PHASES, Attestation, AttestationError, pass_delta
from loadgen.records import CellResult
from vskipper.arms import Arm

DURATION_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Refusal:
    gate: str
    reason: str

    def __str__(self) -> str:
        return f"{self.gate}: {self.reason}"


class CellRefused(RuntimeError):
    def __init__(self, refusals: Sequence[Refusal]):
        self.refusals = list(refusals)
        super().__init__("cell refused: " + "; ".join(str(r) for r in self.refusals))


@dataclass
class GateReport:
    checked: list[str] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.refusals

    def add(self, gate: str, refusals: Iterable[Refusal]) -> None:
        self.checked.append(gate)
        self.refusals.extend(refusals)

    def raise_if_refused(self) -> None:
        if self.refusals:
            raise CellRefused(self.refusals)

    def as_dict(self) -> dict:
        return {"passed": self.passed, "checked": list(self.checked),
                "refusals": [{"gate": r.gate, "reason": r.reason} for r in self.refusals]}


def _examples(items: Sequence[str], k: int = 3) -> str:
    shown = ", ".join(items[:k])
    return shown + (f" and {len(items) - k} more" if len(items) > k else "")


def work_identity(baseline: CellResult, arm: CellResult) -> list[Refusal]:
    gate = "work_identity"
    out: list[Refusal] = []
    for cell in (baseline, arm):
        no_ids = [r.request_id for r in cell.records if r.ok and r.output_ids is None]
        if no_ids:
            out.append(Refusal(gate, f"arm {cell.arm!r} reported no output ids for {_examples(no_ids)}: "
                                     "work identity needs the raw server-reported ids"))
        bad = [r.request_id for r in cell.records
               if r.ok and r.output_ids is not None and len(r.output_ids) != r.output_tokens]
        if bad:
            out.append(Refusal(gate, f"arm {cell.arm!r}: reported token count differs from its output ids "
                                     f"for {_examples(bad)}"))
    a = {r.request_id: r for r in baseline.records}
    b = {r.request_id: r for r in arm.records}
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))
        out.append(Refusal(gate, f"the arms served different requests ({len(only)} not in both: "
                                 f"{_examples(only)})"))
    diff = []
    for rid in sorted(set(a) & set(b)):
        na = len(a[rid].output_ids) if a[rid].output_ids is not None else a[rid].output_tokens
        nb = len(b[rid].output_ids) if b[rid].output_ids is not None else b[rid].output_tokens
        if na != nb:
            diff.append(f"{rid} ({baseline.arm} {na} vs {arm.arm} {nb})")
    if diff:
        out.append(Refusal(gate, f"{len(diff)} requests generated different token counts: {_examples(diff)}"))
    return out


def accounting(cell: CellResult) -> list[Refusal]:
    gate = "accounting"
    out: list[Refusal] = []
    counts = {"submitted": cell.submitted, "started": cell.started, "completed": cell.completed,
              "reported": cell.reported}
    if len(set(counts.values())) != 1:
        out.append(Refusal(gate, "counts differ: " + ", ".join(f"{k}={v}" for k, v in counts.items())))
    errors = [r for r in cell.records if r.error is not None]
    if errors:
        out.append(Refusal(gate, f"{len(errors)} requests failed, first {errors[0].request_id}: {errors[0].error}"))
    unfinished = [r.request_id for r in cell.records if r.error is None and r.finish_s is None]
    if unfinished:
        out.append(Refusal(gate, f"{len(unfinished)} requests never finished: {_examples(unfinished)}"))
    if cell.summary is not None:
        summarised = cell.summary.get("requests")
        if summarised != cell.reported:
            out.append(Refusal(gate, f"filtered tail: the summary covers {summarised} of {cell.reported} "
                                     "reported requests"))
        elif cell.summary.get("completed") != cell.reported:
            out.append(Refusal(gate, f"filtered tail: {cell.summary.get('completed')} of {cell.reported} "
                                     "requests are in the latency statistics"))
    return out


def declared_cell_size(cell: CellResult, suite_digest: str, request_ids: Sequence[str]) -> list[Refusal]:
    gate = "declared_cell_size"
    out: list[Refusal] = []
    if cell.suite_digest != suite_digest:
        out.append(Refusal(gate, f"suite digest {cell.suite_digest[:12]} is not the declared {suite_digest[:12]}"))
    if cell.suite_size != len(request_ids):
        out.append(Refusal(gate, f"suite size {cell.suite_size} is not the declared {len(request_ids)}"))
    ran = [r.request_id for r in cell.records]
    if sorted(ran) != sorted(request_ids):
        missing = sorted(set(request_ids) - set(ran))
        extra = sorted(set(ran) - set(request_ids))
        dup = len(ran) - len(set(ran))
        out.append(Refusal(gate, f"requests are not the exact suite: {len(missing)} missing "
                                 f"({_examples(missing)}), {len(extra)} extra, {dup} duplicated"))
    if cell.rate <= 0:
        out.append(Refusal(gate, f"rate {cell.rate} is not positive"))
    else:
        expected = len(request_ids) / cell.rate
        if abs(cell.duration_s - expected) > DURATION_TOLERANCE * max(1.0, expected):
            out.append(Refusal(gate, f"duration {cell.duration_s:.6g} s is not requests / rate = "
                                     f"{len(request_ids)} / {cell.rate:g} = {expected:.6g} s"))
    late = [r.request_id for r in cell.records if r.scheduled_s > cell.duration_s + DURATION_TOLERANCE]
    if late:
        out.append(Refusal(gate, f"{len(late)} arrivals scheduled after the declared duration: {_examples(late)}"))
    return out


def zero_empty(cell: CellResult, exceptions: Iterable[str] = ()) -> list[Refusal]:
    gate = "zero_empty"
    if cell.lane != "natural":
        return []
    allowed = set(exceptions)
    empty = [r.request_id for r in cell.records if r.ok and r.output_tokens == 0 and r.request_id not in allowed]
    if empty:
        return [Refusal(gate, f"{len(empty)} empty generations in a natural-lane cell: {_examples(empty)}")]
    return []


def _attestation(data: Any, which: str, gate: str) -> tuple[Attestation | None, list[Refusal]]:
    if data is None:
        return None, [Refusal(gate, f"no attestation read {which} the cell")]
    try:
        return (data if isinstance(data, Attestation) else Attestation.from_json(data)), []
    except AttestationError as exc:
        return None, [Refusal(gate, f"attestation {which} the cell is malformed: {exc}")]


def mechanism_evidence(arm: Arm, before: Any, after: Any, *, expect_engaged: bool = True) -> list[Refusal]:
    """Refuse a cell whose declared mechanism never executed (or executed on a dense arm)."""
    gate = "mechanism_evidence"
    b, rb = _attestation(before, "before", gate)
    a, ra = _attestation(after, "after", gate)
    if rb or ra:
        return rb + ra
    delta = pass_delta(b, a)
    out: list[Refusal] = []
    if delta.regressions:
        out.append(Refusal(gate, "counters went backwards (server restarted during the cell?): "
                                 + ", ".join(delta.regressions)))
        return out
    total = sum(sum(m.values()) for m in delta.passes.values())
    if total == 0:
        out.append(Refusal(gate, "no passes executed between the attestations"))
    if delta.scheduler is not None:
        for phase in PHASES:
            per_mode = sum(delta.passes[phase].values())
            if per_mode != delta.scheduler[phase]:
                out.append(Refusal(gate, f"{phase}: per-mode passes sum to {per_mode} but the scheduler ran "
                                         f"{delta.scheduler[phase]}"))
    routed = {p: delta.passes[p]["routed"] for p in PHASES}
    declared = arm.routed_phases
    undeclared = [p for p in PHASES if p not in declared and routed[p] > 0]
    if undeclared:
        out.append(Refusal(gate, f"arm {arm.name!r} does not route {', '.join(undeclared)} but the server ran "
                                 + ", ".join(f"{routed[p]} routed {p} passes" for p in undeclared)))
    if declared:
        missing = [p for p in declared if routed[p] == 0]
        if not arm.mode_switch and missing:
            out.append(Refusal(gate, f"arm {arm.name!r} always routes {', '.join(declared)} but no routed "
                                     f"{' or '.join(missing)} pass executed"))
        elif arm.mode_switch and expect_engaged and len(missing) == len(declared):
            out.append(Refusal(gate, f"arm {arm.name!r} declares routing on {', '.join(declared)} but no routed "
                                     "pass executed in the cell"))
    return out


def served_design(intended: Arm, attested: Any) -> list[Refusal]:
    """The design the server attests equals the intended arm's `as_dict()`, field by field."""
    gate = "served_design"
    if isinstance(attested, Attestation):
        attested = attested.arm
    elif isinstance(attested, Mapping) and "passes_total" in attested:
        attested = attested.get("arm")
    if not isinstance(attested, Mapping):
        return [Refusal(gate, "the server attests no served arm")]
    want = intended.as_dict()
    diffs = []
    for key in sorted(set(want) | set(attested)):
        if key not in attested:
            diffs.append(f"{key} missing (intended {want[key]!r})")
        elif key not in want:
            diffs.append(f"{key} not part of an arm (served {attested[key]!r})")
        elif attested[key] != want[key]:
            diffs.append(f"{key} served {attested[key]!r}, intended {want[key]!r}")
    if diffs:
        return [Refusal(gate, f"served design differs from arm {intended.name!r}: " + "; ".join(diffs))]
    return []


def gate_pair(baseline: CellResult, arm: CellResult, *, suite_digest: str, request_ids: Sequence[str],
              arms: Mapping[str, Arm] | None = None, empty_exceptions: Iterable[str] = (),
              expect_engaged: bool = True) -> GateReport:
    """Run every gate that applies to a paired (baseline, arm) cell."""
    report = GateReport()
    if arm.lane == "matched":
        report.add("work_identity", work_identity(baseline, arm))
    for cell in (baseline, arm):
        report.add("accounting", accounting(cell))
        report.add("declared_cell_size", declared_cell_size(cell, suite_digest, request_ids))
        report.add("zero_empty", zero_empty(cell, empty_exceptions))
        if arms and cell.arm in arms and (cell.attestation_before is not None
                                          or cell.attestation_after is not None):
            spec = arms[cell.arm]
            report.add("mechanism_evidence", mechanism_evidence(spec, cell.attestation_before,
                                                                cell.attestation_after,
                                                                expect_engaged=expect_engaged))
            report.add("served_design", served_design(spec, cell.attestation_after))
    return report
