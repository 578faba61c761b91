"""End to end on loopback: the real client and open-loop driver against the test double server.

The double (tests/loadgen_double_server.py) stands in for vSkipper's server so that the driver's accounting, gates and
reports can be checked in seconds, with failures and late attestations injected at will; the real SGLang servers are
driven by the serve tests. Every cell here is bounded (tens of requests, well under a second of injection each).
"""

import asyncio
import json

import pytest

from loadgen.client import Endpoint
from loadgen.driver import matched_plan, natural_plan, record_lengths, run_cell
from loadgen.experiment import ArmTarget, run_ab, run_ladder
from loadgen.gates import accounting, gate_pair
from loadgen.qstar import find_q_star
from loadgen.records import CellResult
from loadgen.report import write_report
from loadgen.suite import Suite, SuiteRequest
from tests.loadgen_double_server import DoubleConfig, DoubleServer, natural_length
from vskipper.arms import get_arm


def make_suite(n=24, prompt=20, name="toy"):
    return Suite(name, tuple(SuiteRequest(f"toy:test:{i}", tuple(range(3 + i, 3 + i + prompt))) for i in range(n)))


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("incremental", [False, True])
def test_generate_stream_records_the_server_reported_ids_and_token_times(incremental):
    suite = make_suite(12)

    async def go():
        async with DoubleServer(DoubleConfig(incremental_ids=incremental)) as srv:
            plan = natural_plan(suite, rate=40.0, seed=3, max_new_tokens=64)
            return await run_cell(Endpoint(srv.url, attestation_path=None), plan, "upstream")

    cell = run(go())
    assert cell.submitted == cell.started == cell.completed == cell.reported == 12
    for req, rec in zip(suite.requests, cell.records, strict=True):
        n = natural_length(list(req.input_ids), 24)
        assert rec.output_tokens == n == len(rec.token_times_s)
        assert rec.output_ids == [(sum(req.input_ids) + 7 * k) % 32000 for k in range(n)]
        assert rec.text == "".join(f" t{t}" for t in rec.output_ids)  # cumulative or incremental text alike
        assert rec.finish_reason == "stop"
        assert rec.submit_s >= rec.scheduled_s - 1e-3
        assert rec.submit_s <= rec.first_token_s <= rec.token_times_s[-1] <= rec.finish_s
        assert rec.token_times_s == sorted(rec.token_times_s)
    assert cell.summary["empty_generations"] == 0 and cell.summary["context_limit_hits"] == 0


def test_completions_endpoint_counts_tokens_from_usage():
    suite = make_suite(8)

    async def go():
        async with DoubleServer() as srv:
            plan = matched_plan(suite, 40.0, 1, {r.id: 5 for r in suite.requests})
            return await run_cell(Endpoint(srv.url, api="completions", attestation_path=None), plan, "upstream")

    cell = run(go())
    assert all(r.ok and r.output_tokens == 5 and r.output_ids is None for r in cell.records)
    assert all(r.finish_reason == "length" and r.tpot_s is not None for r in cell.records)


def test_natural_lane_counts_context_limit_hits():
    suite = make_suite(10, prompt=20)

    async def go():
        async with DoubleServer() as srv:
            plan = natural_plan(suite, 50.0, 0, context_len=25)  # 5 tokens of room per request
            return await run_cell(Endpoint(srv.url, attestation_path=None), plan, "upstream")

    cell = run(go())
    expected = sum(natural_length(list(r.input_ids), 24) >= 5 for r in suite.requests)
    assert expected > 0
    assert cell.summary["context_limit_hits"] == expected
    assert all(r.output_tokens <= 5 for r in cell.records)


def test_open_loop_has_no_concurrency_cap_and_serves_every_request():
    """The server admits nothing until all 40 requests wait, so an injector that held any back until others
    finished would stall here: the bound on the cell is a failure, never a wait. No assertion reads a wall-clock
    lag: on a loaded host the event loop itself can lag by hundreds of milliseconds."""
    suite = make_suite(40)
    slow = DoubleConfig(decode_base_s=0.01, natural_max=40, admit_after=40)

    async def go():
        async with DoubleServer(slow) as srv:
            plan = matched_plan(suite, 200.0, 5, {r.id: 30 for r in suite.requests})
            return await asyncio.wait_for(run_cell(Endpoint(srv.url, attestation_path=None), plan, "upstream"), 30)

    cell = run(go())
    records = cell.records
    assert cell.submitted == cell.completed == 40
    assert max(r.submit_s for r in records) < min(r.first_token_s for r in records)  # all 40 in flight at once
    assert all(r.submit_s >= r.scheduled_s - 1e-3 for r in records)  # none injected ahead of its arrival time
    assert [r.submit_s for r in records] == sorted(r.submit_s for r in records)  # in the schedule's order
    # a prefill and 29 decode steps of at least 10 ms each follow the last arrival
    assert cell.summary["drain_s"] >= 30 * slow.decode_base_s


def test_failed_requests_are_recorded_and_refused_by_the_accounting_gate():
    suite = make_suite(9)

    async def go():
        async with DoubleServer(DoubleConfig(fail_every=4)) as srv:
            plan = matched_plan(suite, 50.0, 0, {r.id: 3 for r in suite.requests})
            return await run_cell(Endpoint(srv.url, attestation_path=None), plan, "upstream")

    cell = run(go())
    failed = [r for r in cell.records if r.error]
    assert len(failed) == 2 and failed[0].error.startswith("HTTP 500")
    reasons = " ".join(r.reason for r in accounting(cell))
    assert "completed=7" in reasons and "2 requests failed" in reasons


def test_mechanism_and_design_gates_read_the_servers_attestation():
    suite = make_suite(10)
    hybrid = get_arm("always-route")
    wrong = dict(hybrid.as_dict(), prefill="dense")

    async def go():
        async with DoubleServer(DoubleConfig(arm=wrong, routed_phases=("decode",))) as srv:
            lengths = {r.id: 4 for r in suite.requests}
            ep = Endpoint(srv.url)
            up = await run_cell(ep, matched_plan(suite, 50.0, 0, lengths), "upstream")
            arm = await run_cell(ep, matched_plan(suite, 50.0, 0, lengths), "always-route")
            return up, arm

    up, arm = run(go())
    report = gate_pair(up, arm, suite_digest=suite.digest, request_ids=suite.ids,
                       arms={"always-route": hybrid})
    by_gate = {r.gate: r.reason for r in report.refusals}
    assert set(by_gate) == {"mechanism_evidence", "served_design"}
    assert "no routed prefill pass executed" in by_gate["mechanism_evidence"]
    assert "prefill served 'dense', intended 'routed'" in by_gate["served_design"]


def test_matched_work_ab_against_two_servers_passes_the_gates_and_resolves_the_faster_arm(tmp_path):
    suite = make_suite(30)
    arm = get_arm("always-route")
    # 4x apart, and each step long beside the client's own work per step (a few ms of Python, in this process):
    # on a loaded two-core host that work can stretch several-fold and once swamped 2 ms steps.
    slow = DoubleConfig(decode_base_s=0.032, decode_per_row_s=0.0032)
    fast = DoubleConfig(decode_base_s=0.008, decode_per_row_s=0.0008, arm=arm.as_dict(),
                        routed_phases=("prefill", "decode"))

    async def go():
        async with DoubleServer(slow) as a, DoubleServer(fast) as b:
            return await run_ab(ArmTarget("upstream", Endpoint(a.url, attestation_path=None)),
                                ArmTarget("always-route", Endpoint(b.url), arm), suite, 60.0, repetitions=3,
                                seed=11, max_new_tokens=32)

    res = run(go())
    assert [r.order for r in res.repetitions] == [("upstream", "always-route"), ("always-route", "upstream"),
                                                 ("upstream", "always-route")]
    assert all(r.gates.passed for r in res.repetitions), [r.gates.refusals for r in res.repetitions]
    assert res.lengths == record_lengths(res.length_cell)
    for rep in res.repetitions:
        assert [r.output_tokens for r in rep.treated.records] == [res.lengths[r.request_id] for r in rep.treated.records]
    # every repetition finds the faster arm (4x apart: the client's lag, shared by both, cannot undo that), and so
    # does the comparison's mean; whether three paired changes resolve is the interval's question, asked of known
    # samples in test_loadgen_stats (a loaded host's lag, uneven across repetitions, widens this one's)
    def tpot(cell):
        timed = [r.tpot_s for r in cell.records if r.tpot_s is not None]  # none for a one-token output
        return sum(timed) / len(timed)

    assert all(tpot(rep.treated) < tpot(rep.baseline) for rep in res.repetitions)
    change = res.comparison["tpot_mean"]
    assert change.n == 3 and change.mean < 0

    paths = write_report([res], tmp_path, title="toy")
    table = paths["table"].read_text()
    assert "| Rate | arm | n | E2E mean | E2E p99 | TPOT mean" in table
    assert f"| 60req-s | always-route | 3 | {res.comparison['e2e_mean'].format()} |" in table
    for key in ("latency_vs_load", "change_map"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cells = sorted((tmp_path / "cells").glob("*.json"))
    assert len(cells) == 1 + 2 * 3  # the length-recording run and both arms of each repetition
    again = CellResult.from_dict(json.loads((tmp_path / "cells" / "60req-s-always-route-rep1-always-route.json")
                                            .read_text()))
    assert [r.output_ids for r in again.records] == [r.output_ids for r in res.repetitions[1].treated.records]
    assert again.summary == res.repetitions[1].treated.summary


def test_ladder_applies_the_q_star_rule_to_the_in_window_output_rate_of_each_natural_cell():
    """Wiring only: the rule itself is tested on constructed ladders (test_loadgen_stats.py)."""
    suite = make_suite(20, prompt=10)

    async def go():
        async with DoubleServer() as srv:
            return await run_ladder(ArmTarget("upstream", Endpoint(srv.url, attestation_path=None)), suite,
                                    [20, 21, 22], seed=2, max_new_tokens=64)

    res = run(go())
    assert [c.lane for c in res.cells] == ["natural"] * 3
    tok = {int(c.rate): c.summary["window_output_tok_s"] for c in res.cells}
    assert res.q_star == find_q_star(tok)


def test_ab_command_runs_cells_against_server_processes_and_writes_the_report(tmp_path, capsys):
    from loadgen.cli import main as cli_main
    from loadgen.double_server import DoubleServerProcess

    suite_path = make_suite(16).save(tmp_path / "suite.jsonl")
    arm = get_arm("decode-only-always")
    served = DoubleConfig(decode_per_row_s=0.0001, arm=arm.as_dict(), routed_phases=arm.routed_phases)
    with DoubleServerProcess() as a, DoubleServerProcess(served) as b:
        rc = cli_main(["ab", "--suite", str(suite_path), "--baseline-url", a.url, "--arm-url", b.url, "--arm",
                       arm.name, "--rates", "40", "--repetitions", "2", "--max-new-tokens", "32", "--out",
                       str(tmp_path / "out")])
    assert rc == 0
    summary = json.loads((tmp_path / "out" / "ab-40req-s-decode-only-always.json").read_text())
    assert summary["repetitions_accepted"] == 2
    assert all(r["gates"]["passed"] for r in summary["repetitions"])
    assert "| 40req-s | decode-only-always | 2 |" in capsys.readouterr().out


def test_ab_command_refuses_an_arm_whose_attested_execution_is_not_the_declared_one(tmp_path, capsys):
    from loadgen.cli import main as cli_main
    from loadgen.double_server import DoubleServerProcess

    suite_path = make_suite(8).save(tmp_path / "suite.jsonl")
    arm = get_arm("decode-only-always")
    served = DoubleConfig(arm=arm.as_dict(), routed_phases=arm.routed_phases,
                          executed={"profile": "stand-in", "chunked_prefill_size": 2048})
    declared = tmp_path / "execution.json"
    declared.write_text(json.dumps({"chunked_prefill_size": 4096}))
    with DoubleServerProcess() as a, DoubleServerProcess(served) as b:
        rc = cli_main(["ab", "--suite", str(suite_path), "--baseline-url", a.url, "--arm-url", b.url, "--arm",
                       arm.name, "--rates", "40", "--repetitions", "1", "--max-new-tokens", "8", "--execution",
                       str(declared), "--out", str(tmp_path / "out")])
    assert rc == 3
    table = capsys.readouterr().out
    assert ("execution_difference: arm 'decode-only-always': executed.chunked_prefill_size executed 2048, "
            "declared 4096") in table
    assert "execution_difference passed 0/1; cross_arm_identity not run" in table  # the baseline attests nothing


@pytest.mark.server
def test_demo_writes_the_table_the_cells_and_the_plots(tmp_path):
    from loadgen.demo import DEMO_RATES, run_demo

    res = asyncio.run(run_demo(tmp_path, repetitions=1))
    assert [r.rate for r in res["results"]] == list(DEMO_RATES.values())
    assert all(r.accepted for r in res["results"])  # every pair passed its gates
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {label} | always-route | 1 |" in table for label in DEMO_RATES)
    assert (tmp_path / "latency_vs_load.png").stat().st_size > 0 and (tmp_path / "change_map.png").stat().st_size > 0
    assert len(list((tmp_path / "cells").glob("*.json"))) == 3 * 3


@pytest.mark.parametrize(("late", "reads", "answered"), [(0, 1, True), (2, 3, True), (5, 3, False)])
def test_an_attestation_the_server_served_late_is_read_again_and_the_last_read_taken_as_it_is(late, reads, answered):
    """A server that could not write its document for a read in time serves its latest one, marked "answered":
    false, whose counters may lack the last passes: the client reads again, up to READ_ATTEMPTS reads."""
    from loadgen.attestation import READ_ATTEMPTS
    from loadgen.client import fetch_attestation
    from loadgen.driver import client_session

    suite = make_suite(3)

    async def go():
        async with DoubleServer(DoubleConfig(late_attestations=late)) as srv:
            ep = Endpoint(srv.url)
            await run_cell(Endpoint(srv.url, attestation_path=None), matched_plan(suite, 50.0, 0, {
                r.id: 2 for r in suite.requests}), "upstream")
            srv.attestation_reads = 0
            async with client_session() as session:
                doc = await fetch_attestation(session, ep)
            return doc, srv.attestation_reads

    doc, n = run(go())
    assert READ_ATTEMPTS == 3 and n == reads
    assert doc.get("answered", True) is answered
    assert doc["scheduler_passes_total"]["prefill"] > 0 if answered else doc["scheduler_passes_total"]["prefill"] == 0
