"""A/B cells and Q* sweeps: the protocol of the paper's section 4.1 in code.

`run_ab` measures one (suite, rate) cell for a baseline and one other arm:
1. the baseline generates naturally at the cell's rate; its per-request output lengths are recorded
   (skipped when lengths are given); that natural cell must pass accounting, declared cell size and zero-empty,
   else `CellRefused` is raised;
2. for each repetition, both arms run the matched lane on the same suite and arrival schedule (seed + rep),
   in alternating order; each pair goes through the gates (with the comparability gates: each arm executed
   its declared configuration, and the two arms differ only where allowed); a refused pair is kept in the
   result with its reasons and left out of the comparison;
3. the comparison is the mean per-repetition % change of every metric with a 95% t interval; for the rates
   (`GEOMETRIC`) also the geometric mean change with the interval of the mean log-ratio (`loadgen.stats`).

`run_ladder` runs the baseline's natural lane at contiguous integer rates and applies the Q* rule to the
in-window output token rate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadgen.client import Endpoint
from loadgen.driver import client_session, matched_plan, natural_plan, record_lengths, run_cell
from loadgen.gates import GateReport, accounting, declared_cell_size, gate_pair, zero_empty
from loadgen.metrics import flat_metrics
from loadgen.qstar import QStar, find_q_star
from loadgen.records import CellResult
from loadgen.stats import Interval, RatioInterval, arm_order, geometric_comparison, paired_comparison
from loadgen.suite import Suite
from vskipper.arms import Arm

COMPARED = ("e2e_mean", "e2e_p50", "e2e_p90", "e2e_p99", "tpot_mean", "tpot_p99", "ttft_mean", "ttft_p99",
            "makespan_s", "drain_s", "window_output_tok_s", "window_req_s", "makespan_req_s")
# the rates, compared also by their geometric mean change: an overload window's completions swing the per-repetition
# ratio widely, and the mean of % changes weighs a doubling twice as much as a halving
GEOMETRIC = ("window_output_tok_s", "window_req_s", "makespan_req_s")


@dataclass(frozen=True)
class ArmTarget:
    """One arm under test: its name, where it is served, (for vSkipper arms) the design it must attest, and the
    configuration the experiment declares it executes (a possibly partial attested `executed` object)."""

    name: str
    endpoint: Endpoint
    design: Arm | None = None
    execution: Mapping[str, Any] | None = None


@dataclass
class Repetition:
    index: int
    order: tuple[str, str]
    baseline: CellResult
    treated: CellResult
    gates: GateReport

    def as_dict(self) -> dict:
        return {"index": self.index, "order": list(self.order), "gates": self.gates.as_dict(),
                "baseline": self.baseline.as_dict(), "arm": self.treated.as_dict()}


@dataclass
class ABResult:
    baseline: str
    treated: str
    rate: float
    label: str
    suite_name: str
    suite_digest: str
    lengths: dict[str, int]
    length_cell: CellResult | None
    repetitions: list[Repetition] = field(default_factory=list)
    comparison: dict[str, Interval] = field(default_factory=dict)
    # metrics left out of the comparison, and why (a repetition without it, or a baseline of 0)
    not_compared: dict[str, str] = field(default_factory=dict)
    # the rates' geometric mean changes (`GEOMETRIC`); a rate of 0 in either arm leaves it out, said in not_compared
    geometric: dict[str, RatioInterval] = field(default_factory=dict)

    @property
    def accepted(self) -> list[Repetition]:
        return [r for r in self.repetitions if r.gates.passed]

    def compare(self, metrics: Iterable[str] = COMPARED) -> dict[str, Interval]:
        reps = self.accepted
        self.not_compared = {}
        self.geometric = {}
        if not reps:
            self.comparison = {}
            return self.comparison
        base = [flat_metrics(r.baseline.summary) for r in reps]
        treated = [flat_metrics(r.treated.summary) for r in reps]
        names = []
        for m in metrics:
            lacking = [r.index for r, b, t in zip(reps, base, treated, strict=True) if m not in b or m not in t]
            zero = [r.index for r, b in zip(reps, base, strict=True) if b.get(m) == 0]
            if lacking or zero:
                self.not_compared[m] = "; ".join(
                    part for part in (f"repetitions {lacking} lack it" if lacking else "",
                                      f"the baseline's is 0 in repetitions {zero}" if zero else "") if part)
            else:
                names.append(m)
        self.comparison = paired_comparison(base, treated, names)
        rates = []
        for m in (m for m in names if m in GEOMETRIC):
            zero = [r.index for r, t in zip(reps, treated, strict=True) if not t[m] > 0]
            if zero:
                self.not_compared[f"{m} (geometric)"] = f"the arm's is 0 in repetitions {zero}"
            else:
                rates.append(m)
        self.geometric = geometric_comparison(base, treated, rates)
        return self.comparison

    def as_dict(self) -> dict:
        return {"baseline": self.baseline, "arm": self.treated, "rate": self.rate, "label": self.label,
                "suite": {"name": self.suite_name, "digest": self.suite_digest},
                "lengths": self.lengths,
                "length_cell": self.length_cell.as_dict() if self.length_cell else None,
                "repetitions_run": len(self.repetitions), "repetitions_accepted": len(self.accepted),
                "comparison": {k: v.as_dict() for k, v in self.comparison.items()},
                "not_compared": dict(self.not_compared),
                "geometric": {k: v.as_dict() for k, v in self.geometric.items()},
                "repetitions": [r.as_dict() for r in self.repetitions]}


def gate_length_cell(cell: CellResult, suite: Suite, empty_exceptions: Sequence[str] = ()) -> GateReport:
    """The natural-lane run whose lengths the matched lane replays must itself be a valid cell."""
    report = GateReport()
    report.add("accounting", accounting(cell))
    report.add("declared_cell_size", declared_cell_size(cell, suite.digest, suite.ids))
    report.add("zero_empty", zero_empty(cell, empty_exceptions))
    return report


async def run_ab(baseline: ArmTarget, treated: ArmTarget, suite: Suite, rate: float, *, repetitions: int,
                 seed: int = 0, label: str = "", context_len: int | None = None,
                 max_new_tokens: int | None = None, lengths: Mapping[str, int] | None = None,
                 empty_exceptions: Sequence[str] = (), expect_engaged: bool = True,
                 progress: bool = False) -> ABResult:
    if repetitions < 1:
        raise ValueError(f"repetitions must be >= 1, got {repetitions}")
    arms = {t.name: t.design for t in (baseline, treated) if t.design is not None}
    declared = {t.name: t.execution for t in (baseline, treated) if t.execution is not None}
    targets = {baseline.name: baseline, treated.name: treated}
    async with client_session() as session:
        length_cell = None
        if lengths is None:
            plan = natural_plan(suite, rate, seed, context_len=context_len, max_new_tokens=max_new_tokens)
            length_cell = await run_cell(baseline.endpoint, plan, baseline.name, progress=progress,
                                         session=session)
            length_gates = gate_length_cell(length_cell, suite, empty_exceptions)
            length_gates.raise_if_refused()
            lengths = record_lengths(length_cell)
        result = ABResult(baseline.name, treated.name, rate, label, suite.name, suite.digest, dict(lengths),
                          length_cell)
        for rep in range(repetitions):
            order = arm_order(rep, baseline.name, treated.name)
            plan = matched_plan(suite, rate, seed + rep, lengths, repetition=rep)
            cells = {}
            for name in order:
                t = targets[name]
                cells[name] = await run_cell(t.endpoint, plan, name, progress=progress, session=session)
            report = gate_pair(cells[baseline.name], cells[treated.name], suite_digest=suite.digest,
                               request_ids=suite.ids, arms=arms, empty_exceptions=empty_exceptions,
                               expect_engaged=expect_engaged, declared_execution=declared)
            result.repetitions.append(Repetition(rep, order, cells[baseline.name], cells[treated.name], report))
    result.compare()
    return result


@dataclass
class LadderResult:
    cells: list[CellResult]
    q_star: QStar

    def as_dict(self) -> dict:
        return {"q_star": self.q_star.as_dict(),
                "cells": [{"rate": c.rate, "summary": c.summary} for c in self.cells]}


async def run_ladder(target: ArmTarget, suite: Suite, rates: Sequence[int], *, seed: int = 0,
                     context_len: int | None = None, max_new_tokens: int | None = None,
                     progress: bool = False) -> LadderResult:
    cells = []
    async with client_session() as session:
        for rate in rates:
            plan = natural_plan(suite, rate, seed, context_len=context_len, max_new_tokens=max_new_tokens)
            cells.append(await run_cell(target.endpoint, plan, target.name, progress=progress, session=session))
    tok = {}
    for c in cells:
        if c.summary["window_output_tok_s"] is None:
            raise ValueError(f"ladder: rate {c.rate} has no injection window (one request?)")
        tok[int(c.rate)] = c.summary["window_output_tok_s"]
    return LadderResult(cells, find_q_star(tok))
