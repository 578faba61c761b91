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
- execution_difference: every field of the configuration the experiment declares for an arm equals what that
  arm's server attests it executed (`executed`, read from SGLang after boot, never the launch flags).
- cross_arm_identity: the two arms' resolved configurations (the attested `executed`, `execution`, `model` and
  `constants`, and the allow-listed `arm`, `skipper`, `thresholds`) differ only in the allow-list; the arm's KV
  pool may be smaller than the baseline's (its router and adapter weights take KV budget) but never larger. The
  gate reports the pool difference in tokens and as a share of the baseline's pool.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadgen.attestation import PHASES, Attestation, AttestationError, pass_delta
from loadgen.records import CellResult
from vskipper.arms import Arm
from vskipper.switch import Policy

DURATION_TOLERANCE = 1e-6
# What two arms' resolved configurations may differ in, and the attested sections compared beside them.
ALLOWED_DIFFERENCES = ("arm", "skipper", "thresholds")
COMPARED_SECTIONS = ("executed", "execution", "model", "constants", *ALLOWED_DIFFERENCES)
KV_POOL_FIELDS = ("executed.kv_pool.tokens", "executed.kv_pool.bytes")  # the arm's may be smaller, never larger
_ABSENT = "<absent>"


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
    details: dict[str, Any] = field(default_factory=dict)  # gate -> what it measured (kept when it passes)

    @property
    def passed(self) -> bool:
        return not self.refusals

    def add(self, gate: str, refusals: Iterable[Refusal], details: Any = None) -> None:
        self.checked.append(gate)
        self.refusals.extend(refusals)
        if details is not None:
            self.details[gate] = details

    def raise_if_refused(self) -> None:
        if self.refusals:
            raise CellRefused(self.refusals)

    def as_dict(self) -> dict:
        return {"passed": self.passed, "checked": list(self.checked),
                "refusals": [{"gate": r.gate, "reason": r.reason} for r in self.refusals],
                "details": dict(self.details)}


def _examples(items: Sequence[str], k: int = 3) -> str:
    shown = ", ".join(items[:k])
    return shown + (f" and {len(items) - k} more" if len(items) > k else "")


def work_identity(baseline: CellResult, treated: CellResult) -> list[Refusal]:
    gate = "work_identity"
    out: list[Refusal] = []
    for cell in (baseline, treated):
        no_ids = [r.request_id for r in cell.records if r.ok and r.output_ids is None]
        if no_ids:
            out.append(Refusal(gate, f"arm {cell.arm_name!r} reported no output ids for {_examples(no_ids)}: "
                                     "work identity needs the raw server-reported ids"))
        bad = [r.request_id for r in cell.records
               if r.ok and r.output_ids is not None and len(r.output_ids) != r.output_tokens]
        if bad:
            out.append(Refusal(gate, f"arm {cell.arm_name!r}: reported token count differs from its output ids "
                                     f"for {_examples(bad)}"))
    a = {r.request_id: r for r in baseline.records}
    b = {r.request_id: r for r in treated.records}
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))
        out.append(Refusal(gate, f"the arms served different requests ({len(only)} not in both: "
                                 f"{_examples(only)})"))
    diff = []
    for rid in sorted(set(a) & set(b)):
        na = len(a[rid].output_ids) if a[rid].output_ids is not None else a[rid].output_tokens
        nb = len(b[rid].output_ids) if b[rid].output_ids is not None else b[rid].output_tokens
        if na != nb:
            diff.append(f"{rid} ({baseline.arm_name} {na} vs {treated.arm_name} {nb})")
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
    always = [p for p in declared if getattr(arm, p) is Policy.ROUTED]
    switched = [p for p in declared if getattr(arm, p) is Policy.HYBRID]
    missing = [p for p in always if routed[p] == 0]
    if missing:
        out.append(Refusal(gate, f"arm {arm.name!r} always routes {', '.join(always)} but no routed "
                                 f"{' or '.join(missing)} pass executed"))
    if switched and expect_engaged and all(routed[p] == 0 for p in switched):
        out.append(Refusal(gate, f"arm {arm.name!r} declares routing on {', '.join(switched)} but no routed "
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


def flatten(value: Any, prefix: str) -> dict[str, Any]:
    """Dotted field paths to leaf values (a non-empty object is a branch; anything else, lists too, a leaf)."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}"))
        return out
    return {prefix: value}


def execution_difference(arm_name: str, declared: Mapping[str, Any], attested: Any) -> list[Refusal]:
    """Every field the experiment declares for the arm (a possibly partial `executed` object) equals what the
    arm's server attests it executed; one refusal per field, naming it and both values."""
    gate = "execution_difference"
    att, refused = _attestation(attested, "after", gate)
    if refused:
        return [Refusal(gate, f"arm {arm_name!r}: {r.reason}") for r in refused]
    if att.executed is None:
        return [Refusal(gate, f"arm {arm_name!r}: the server attests no executed configuration "
                              "(attestation.executed)")]
    want = flatten(json.loads(json.dumps(dict(declared))), "executed")  # tuples compare as the JSON lists
    got = flatten(att.executed, "executed")
    out = []
    for path, value in want.items():
        if path not in got:
            out.append(Refusal(gate, f"arm {arm_name!r}: {path} is not attested (declared {value!r})"))
        elif got[path] != value:
            out.append(Refusal(gate, f"arm {arm_name!r}: {path} executed {got[path]!r}, declared {value!r}"))
    return out


def _configuration(att: Attestation) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section in COMPARED_SECTIONS:
        if section in att.raw:
            out.update(flatten(att.raw[section], section))
    return out


def cross_arm_identity(baseline_name: str, baseline: Any, treated_name: str, treated: Any,
                       allowed: Sequence[str] = ALLOWED_DIFFERENCES) -> tuple[list[Refusal], dict[str, Any]]:
    """The two arms' resolved configurations differ only in `allowed` (top-level sections); the treated arm's KV
    pool may not be larger than the baseline's. Returns (refusals, details: the allowed differences and the KV pool
    difference in tokens, bytes and as a share of the baseline's pool)."""
    gate = "cross_arm_identity"
    parsed, out = {}, []
    for name, data in ((baseline_name, baseline), (treated_name, treated)):
        att, refused = _attestation(data, "after", gate)
        out += [Refusal(gate, f"arm {name!r}: {r.reason}") for r in refused]
        if att is not None and att.executed is None:
            out.append(Refusal(gate, f"arm {name!r}: the server attests no executed configuration "
                                     "(attestation.executed)"))
        parsed[name] = att
    if out:
        return out, {}
    base, mine = _configuration(parsed[baseline_name]), _configuration(parsed[treated_name])
    allowed_diffs = []
    for path in sorted(set(base) | set(mine)):
        b, a = base.get(path, _ABSENT), mine.get(path, _ABSENT)
        if a == b:
            continue
        if path.split(".", 1)[0] in allowed:
            allowed_diffs.append(path)
        elif path in KV_POOL_FIELDS and isinstance(a, int) and isinstance(b, int) and a < b:
            continue  # a smaller pool on the arm: reported below
        elif path in KV_POOL_FIELDS and isinstance(a, int) and isinstance(b, int):
            out.append(Refusal(gate, f"{path}: arm {treated_name!r} {a!r} is larger than baseline {baseline_name!r} "
                                     f"{b!r} (the arm's KV pool may not exceed the baseline's)"))
        else:
            out.append(Refusal(gate, f"{path}: baseline {baseline_name!r} {b!r}, arm {treated_name!r} {a!r} "
                                     f"(only {', '.join(allowed)} may differ)"))
    details: dict[str, Any] = {"allowed_differences": allowed_diffs}
    tokens = (base.get(KV_POOL_FIELDS[0]), mine.get(KV_POOL_FIELDS[0]))
    if all(isinstance(t, int) for t in tokens):
        kv_bytes = (base.get(KV_POOL_FIELDS[1]), mine.get(KV_POOL_FIELDS[1]))
        details["kv_pool"] = {
            "baseline_tokens": tokens[0], "arm_tokens": tokens[1], "smaller_by_tokens": tokens[0] - tokens[1],
            "smaller_by_share": (tokens[0] - tokens[1]) / tokens[0] if tokens[0] else None,
            "baseline_bytes": kv_bytes[0], "arm_bytes": kv_bytes[1],
            "smaller_by_bytes": kv_bytes[0] - kv_bytes[1] if all(isinstance(b, int) for b in kv_bytes) else None}
    return out, details


def gate_pair(baseline: CellResult, treated: CellResult, *, suite_digest: str, request_ids: Sequence[str],
              arms: Mapping[str, Arm] | None = None, empty_exceptions: Iterable[str] = (),
              expect_engaged: bool = True,
              declared_execution: Mapping[str, Mapping[str, Any]] | None = None) -> GateReport:
    """Run every gate that applies to a paired (baseline, treated) cell. `declared_execution` maps an arm's name to
    the configuration the experiment declares it executes; the cross-arm identity gate runs when both cells
    were read an attestation."""
    report = GateReport()
    if treated.lane == "matched":
        report.add("work_identity", work_identity(baseline, treated))
    for cell in (baseline, treated):
        report.add("accounting", accounting(cell))
        report.add("declared_cell_size", declared_cell_size(cell, suite_digest, request_ids))
        report.add("zero_empty", zero_empty(cell, empty_exceptions))
        if arms and cell.arm_name in arms and (cell.attestation_before is not None
                                          or cell.attestation_after is not None):
            spec = arms[cell.arm_name]
            report.add("mechanism_evidence", mechanism_evidence(spec, cell.attestation_before,
                                                                cell.attestation_after,
                                                                expect_engaged=expect_engaged))
            report.add("served_design", served_design(spec, cell.attestation_after))
        if declared_execution and cell.arm_name in declared_execution:
            report.add("execution_difference", execution_difference(cell.arm_name, declared_execution[cell.arm_name],
                                                                    cell.attestation_after))
    if baseline.attestation_after is not None and treated.attestation_after is not None:
        report.add("cross_arm_identity", *cross_arm_identity(baseline.arm_name, baseline.attestation_after, treated.arm_name,
                                                             treated.attestation_after))
    return report
