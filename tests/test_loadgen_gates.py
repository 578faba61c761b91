"""Cell gates refuse constructed bad cells with their named reason; metrics on a hand-built cell."""

import copy
import math

import pytest

from loadgen.attestation import Attestation, AttestationError
from loadgen.gates import (
    CellRefused,
    accounting,
    cross_arm_identity,
    declared_cell_size,
    execution_difference,
    gate_pair,
    mechanism_evidence,
    served_design,
    work_identity,
    zero_empty,
)
from loadgen.metrics import flat_metrics, summarize_cell
from loadgen.records import CellResult, RequestRecord
from vskipper.arms import get_arm

IDS = [f"gsm8k:test:{i}" for i in range(4)]
DIGEST = "d" * 64


def make_cell(arm="upstream", lane="matched", lengths=(3, 5, 2, 4), rate=2.0, step=0.1) -> CellResult:
    records = []
    for i, (rid, n) in enumerate(zip(IDS, lengths, strict=True)):
        t0 = i / rate
        first = t0 + 0.2
        times = [first + k * step for k in range(n)]
        records.append(RequestRecord(index=i, request_id=rid, scheduled_s=t0, prompt_tokens=10, max_new_tokens=n,
                                     ignore_eos=lane == "matched", submit_s=t0,
                                     first_token_s=first if n else None, token_times_s=times,
                                     finish_s=(times[-1] if n else first), output_ids=list(range(n)),
                                     output_tokens=n, finish_reason="length"))
    cell = CellResult(arm_name=arm, lane=lane, rate=rate, duration_s=len(IDS) / rate, seed=1, suite_name="t",
                      suite_digest=DIGEST, suite_size=len(IDS), records=records, submitted=4, started=4,
                      completed=4)
    summarize_cell(cell)
    return cell


def attest(prefill=(5, 0), decode=(50, 0), arm=None, sched=None):
    d = {"passes_total": {"prefill": {"dense": prefill[0], "routed": prefill[1]},
                          "decode": {"dense": decode[0], "routed": decode[1]}}}
    if arm is not None:
        d["arm"] = arm
    if sched is not None:
        d["scheduler_passes_total"] = sched
    return d


def test_metrics_follow_the_definitions_on_a_hand_built_cell():
    cell = make_cell()
    s = cell.summary
    # E2E of request 0: 3 tokens, first at 0.2, last at 0.4
    assert cell.records[0].e2e_s == pytest.approx(0.4)
    assert cell.records[0].tpot_s == pytest.approx(0.1)
    assert s["ttft"]["mean"] == pytest.approx(0.2)
    assert s["tpot"]["mean"] == pytest.approx(0.1)
    # window = first to last submission = 0 .. 1.5 s; last completion 1.5 + 0.2 + 0.3 = 2.0
    assert s["window_s"] == pytest.approx(1.5)
    assert s["makespan_s"] == pytest.approx(2.0)
    assert s["drain_s"] == pytest.approx(0.5)
    assert s["injected_rate"] == pytest.approx(2.0)
    assert s["output_tokens"] == 14
    in_window = sum(1 for r in cell.records for t in r.token_times_s if t <= 1.5)
    assert s["window_output_tok_s"] == pytest.approx(in_window / 1.5)
    assert s["window_req_s"] == pytest.approx(sum(r.finish_s <= 1.5 for r in cell.records) / 1.5)
    assert s["makespan_req_s"] == pytest.approx(len(cell.records) / 2.0)  # every request, over the whole cell
    assert flat_metrics(s)["e2e_p99"] == pytest.approx(s["e2e"]["p99"])
    assert flat_metrics(s)["makespan_req_s"] == s["makespan_req_s"]


def test_work_identity_refuses_a_request_with_a_different_token_count():
    base, arm = make_cell(), make_cell("hybrid", lengths=(3, 5, 2, 5))
    assert work_identity(base, make_cell("hybrid")) == []
    (r,) = work_identity(base, arm)
    assert r.gate == "work_identity" and "gsm8k:test:3 (upstream 4 vs hybrid 5)" in r.reason


def test_work_identity_refuses_counts_that_disagree_with_the_reported_ids():
    arm = make_cell("hybrid")
    arm.records[1].output_ids = arm.records[1].output_ids[:-1]
    reasons = [r.reason for r in work_identity(make_cell(), arm)]
    assert any("reported token count differs from its output ids for gsm8k:test:1" in x for x in reasons)
    arm.records[1].output_ids = None
    assert any("no output ids" in r.reason for r in work_identity(make_cell(), arm))


def test_accounting_refuses_lost_requests_errors_and_a_filtered_tail():
    assert accounting(make_cell()) == []
    lost = make_cell()
    lost.completed = 3
    assert "counts differ: submitted=4, started=4, completed=3, reported=4" in accounting(lost)[0].reason
    err = make_cell()
    err.records[2].error = "HTTP 500"
    summarize_cell(err)
    reasons = [r.reason for r in accounting(err)]
    assert any("1 requests failed, first gsm8k:test:2: HTTP 500" in x for x in reasons)
    tail = make_cell()
    tail.summary = dict(tail.summary, requests=3)
    assert "filtered tail" in accounting(tail)[0].reason


def test_declared_cell_size_refuses_another_suite_or_duration():
    assert declared_cell_size(make_cell(), DIGEST, IDS) == []
    (r,) = declared_cell_size(make_cell(), "e" * 64, IDS)
    assert r.gate == "declared_cell_size" and "digest" in r.reason
    short = make_cell()
    short.duration_s = 1.0
    assert "duration 1 s is not requests / rate = 4 / 2 = 2 s" in declared_cell_size(short, DIGEST, IDS)[0].reason
    missing = make_cell()
    missing.records.pop()
    assert "1 missing (gsm8k:test:3)" in declared_cell_size(missing, DIGEST, IDS)[0].reason


def test_zero_empty_refuses_an_empty_natural_generation_unless_declared():
    cell = make_cell(lane="natural", lengths=(3, 0, 2, 4))
    (r,) = zero_empty(cell)
    assert r.gate == "zero_empty" and "gsm8k:test:1" in r.reason
    assert zero_empty(cell, exceptions=["gsm8k:test:1"]) == []
    assert zero_empty(make_cell(lane="matched", lengths=(3, 0, 2, 4))) == []


def test_mechanism_evidence_requires_routed_passes_on_declared_phases():
    always = get_arm("always-route")
    ok_after = attest(prefill=(5, 4), decode=(50, 100))
    assert mechanism_evidence(always, attest(), ok_after) == []
    (r,) = mechanism_evidence(always, attest(), attest(prefill=(9, 0), decode=(50, 100)))
    assert r.gate == "mechanism_evidence" and "no routed prefill pass executed" in r.reason
    hybrid = get_arm("hybrid")
    never = attest(prefill=(9, 0), decode=(150, 0))
    assert "no routed pass executed" in mechanism_evidence(hybrid, attest(), never)[0].reason
    assert mechanism_evidence(hybrid, attest(), never, expect_engaged=False) == []


def test_mechanism_evidence_refuses_routing_on_a_dense_arm_and_backwards_counters():
    dense = get_arm("dense")
    assert mechanism_evidence(dense, attest(), attest(prefill=(9, 0), decode=(90, 0))) == []
    (r,) = mechanism_evidence(dense, attest(), attest(prefill=(9, 0), decode=(90, 3)))
    assert "does not route decode but the server ran 3 routed decode passes" in r.reason
    (r,) = mechanism_evidence(dense, attest(decode=(90, 0)), attest(decode=(10, 0)))
    assert "counters went backwards" in r.reason and "passes_total.decode.dense" in r.reason
    (r,) = mechanism_evidence(dense, None, attest())
    assert "no attestation read before the cell" in r.reason


def test_mechanism_evidence_checks_per_mode_counters_against_the_scheduler():
    arm = get_arm("always-route")
    before = attest(sched={"prefill": 5, "decode": 50})
    after = attest(prefill=(5, 4), decode=(50, 100), sched={"prefill": 9, "decode": 149})
    (r,) = mechanism_evidence(arm, before, after)
    assert "decode: per-mode passes sum to 100 but the scheduler ran 99" in r.reason


def test_served_design_names_every_field_that_differs():
    arm = get_arm("hybrid")
    assert served_design(arm, attest(arm=arm.as_dict())) == []
    served = copy.deepcopy(arm.as_dict())
    served["promotion"] = False
    (r,) = served_design(arm, attest(arm=served))
    assert r.gate == "served_design" and "promotion served False, intended True" in r.reason
    assert "attests no served arm" in served_design(arm, attest())[0].reason


def test_attestation_parser_names_the_bad_field():
    with pytest.raises(AttestationError, match=r"attestation.passes_total.decode.routed"):
        Attestation.from_json(attest(decode=(3, -1)))
    with pytest.raises(AttestationError, match=r"attestation.passes_total: required"):
        Attestation.from_json({"arm": {}})


def test_gate_pair_collects_refusals_and_raises_them_together():
    base = make_cell()
    arm = make_cell("always-route", lengths=(3, 5, 2, 5))
    arm.attestation_before = attest(arm=get_arm("always-route").as_dict())
    arm.attestation_after = attest(decode=(50, 9), arm=get_arm("always-route").as_dict())
    report = gate_pair(base, arm, suite_digest=DIGEST, request_ids=IDS, arms={"always-route": get_arm("always-route")})
    gates = {r.gate for r in report.refusals}
    assert gates == {"work_identity", "mechanism_evidence"}
    with pytest.raises(CellRefused, match="work_identity"):
        report.raise_if_refused()


def test_the_length_recording_run_is_refused_when_it_has_an_empty_generation():
    from loadgen.experiment import gate_length_cell
    from loadgen.suite import Suite, SuiteRequest

    suite = Suite("t", tuple(SuiteRequest(i, (1, 2)) for i in IDS))
    cell = make_cell(lane="natural", lengths=(3, 0, 2, 4))
    cell.suite_digest = suite.digest
    report = gate_length_cell(cell, suite)
    assert [r.gate for r in report.refusals] == ["zero_empty"]
    assert gate_length_cell(cell, suite, ["gsm8k:test:1"]).passed


# -- comparability: execution difference and cross-arm identity ------------------------------------------------

EXECUTED = {"attention_backend": {"prefill": "torch_native", "decode": "torch_native"},
            "sampling_backend": "pytorch", "decode_graph_batch_sizes": [1, 2, 4], "chunked_prefill_size": 4096,
            "max_running_requests": 64, "kv_pool": {"tokens": 393_319, "bytes": 393_319 * 131_072},
            "dtype": "float16", "page_size": 1, "tp_size": 1, "profile": "cpu", "sglang_version": "0.5.21"}


def served(arm_name="dense", executed=None, **changes):
    """An attestation of a server running `arm_name` with EXECUTED changed at dotted paths."""
    arm = get_arm(arm_name)
    executed = copy.deepcopy(EXECUTED if executed is None else executed)
    for path, value in changes.items():
        node = executed
        *parents, leaf = path.split("__")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return dict(attest(arm=arm.as_dict()), executed=executed, skipper={"name": arm.skipper},
                thresholds={"enter_tokens": 200_000 if arm_name == "hybrid" else 0, "exit_tokens": 0},
                constants={"enter_factor": 1.25}, model={"class": "DDLlamaForCausalLM"})


def test_execution_difference_names_each_declared_field_the_server_did_not_execute():
    declared = {"attention_backend": {"decode": "torch_native"}, "decode_graph_batch_sizes": (1, 2, 4),
                "chunked_prefill_size": 4096}
    assert execution_difference("dense", declared, served()) == []
    refusals = execution_difference("dense", declared, served(chunked_prefill_size=2048,
                                                              attention_backend__decode="triton"))
    reasons = sorted(r.reason for r in refusals)
    assert [r.gate for r in refusals] == ["execution_difference"] * 2
    assert reasons == ["arm 'dense': executed.attention_backend.decode executed 'triton', declared 'torch_native'",
                       "arm 'dense': executed.chunked_prefill_size executed 2048, declared 4096"]
    (r,) = execution_difference("dense", {"kv_dtype": "fp8_e4m3"}, served())
    assert "executed.kv_dtype is not attested (declared 'fp8_e4m3')" in r.reason
    (r,) = execution_difference("dense", declared, attest())
    assert "attests no executed configuration" in r.reason


def test_cross_arm_identity_allows_only_arm_skipper_and_thresholds_to_differ():
    refusals, details = cross_arm_identity("dense", served("dense"), "hybrid", served("hybrid"))
    assert refusals == []
    assert {"arm.name", "skipper.name", "thresholds.enter_tokens"} <= set(details["allowed_differences"])
    assert details["kv_pool"]["smaller_by_tokens"] == 0
    (r,) = cross_arm_identity("dense", served(), "hybrid", served("hybrid", chunked_prefill_size=8192))[0]
    assert r.gate == "cross_arm_identity"
    assert r.reason.startswith("executed.chunked_prefill_size: baseline 'dense' 4096, arm 'hybrid' 8192")
    hybrid = served("hybrid")
    hybrid["model"] = {"class": "LlamaForCausalLM"}
    (r,) = cross_arm_identity("dense", served(), "hybrid", hybrid)[0]
    assert "model.class: baseline 'dense' 'DDLlamaForCausalLM', arm 'hybrid' 'LlamaForCausalLM'" in r.reason


def test_cross_arm_identity_refuses_a_larger_kv_pool_on_the_arm_and_reports_a_smaller_one():
    """The paper's A100 cell: the routed arm's router and adapter weights cost 3,840 of 393,319 KV tokens."""
    smaller = served("hybrid", kv_pool={"tokens": 393_319 - 3_840, "bytes": (393_319 - 3_840) * 131_072})
    refusals, details = cross_arm_identity("dense", served(), "hybrid", smaller)
    assert refusals == []
    kv = details["kv_pool"]
    assert kv["smaller_by_tokens"] == 3_840 and kv["smaller_by_bytes"] == 3_840 * 131_072
    assert kv["smaller_by_share"] == pytest.approx(0.0098, abs=5e-5)
    larger = served("hybrid", kv_pool={"tokens": 400_000, "bytes": 400_000 * 131_072})
    reasons = [r.reason for r in cross_arm_identity("dense", served(), "hybrid", larger)[0]]
    assert reasons == ["executed.kv_pool.bytes: arm 'hybrid' 52428800000 is larger than baseline 'dense' "
                       "51553107968 (the arm's KV pool may not exceed the baseline's)",
                       "executed.kv_pool.tokens: arm 'hybrid' 400000 is larger than baseline 'dense' 393319 "
                       "(the arm's KV pool may not exceed the baseline's)"]
    (r,) = cross_arm_identity("dense", attest(), "hybrid", smaller)[0]
    assert "arm 'dense': the server attests no executed configuration" in r.reason


def test_gate_pair_runs_the_comparability_gates_and_the_table_shows_them():
    from loadgen.experiment import ABResult, Repetition
    from loadgen.report import markdown_table

    base, arm = make_cell("dense"), make_cell("hybrid")
    base.attestation_after = served("dense")
    arm.attestation_after = served("hybrid", kv_pool={"tokens": 390_000, "bytes": 390_000 * 131_072})
    declared = {"dense": {"chunked_prefill_size": 4096}, "hybrid": {"chunked_prefill_size": 2048}}
    report = gate_pair(base, arm, suite_digest=DIGEST, request_ids=IDS, declared_execution=declared)
    assert report.checked.count("execution_difference") == 2 and report.checked[-1] == "cross_arm_identity"
    (r,) = report.refusals
    assert r.reason == "arm 'hybrid': executed.chunked_prefill_size executed 4096, declared 2048"
    assert report.as_dict()["details"]["cross_arm_identity"]["kv_pool"]["smaller_by_tokens"] == 3_319
    result = ABResult("dense", "hybrid", 2.0, "", "t", DIGEST, {}, None,
                      [Repetition(0, ("dense", "hybrid"), base, arm, report)])
    table = markdown_table([result])
    assert ("- 2req-s hybrid: execution_difference passed 0/1; cross_arm_identity passed 1/1; KV pool hybrid "
            "390000 vs dense 393319 tokens (smaller by 3319 tokens, 0.84% of the baseline's pool)") in table
    assert "rep 0: execution_difference: arm 'hybrid': executed.chunked_prefill_size" in table


def test_a_metric_a_repetition_lacks_or_whose_baseline_is_zero_is_named_not_silently_dropped():
    """The comparison leaves out a metric a compared repetition lacks (an empty window) or whose baseline is 0 (no
    % change of it): the result and the table say which and why, instead of an unexplained n/a."""
    from loadgen.experiment import ABResult, Repetition
    from loadgen.gates import GateReport
    from loadgen.report import markdown_table

    reps = []
    for i in range(2):
        base, arm = make_cell("dense"), make_cell("hybrid")
        if i == 1:
            base.summary["e2e"]["p99"] = None  # as an empty sample leaves it
            base.summary["makespan_s"] = 0.0
        reps.append(Repetition(i, ("dense", "hybrid"), base, arm, GateReport()))
    result = ABResult("dense", "hybrid", 2.0, "", "t", DIGEST, {}, None, reps)
    result.compare()
    assert "e2e_mean" in result.comparison and "e2e_p99" not in result.comparison
    assert result.not_compared["e2e_p99"] == "repetitions [1] lack it"
    assert result.not_compared["makespan_s"] == "the baseline's is 0 in repetitions [1]"
    assert result.as_dict()["not_compared"] == result.not_compared
    table = markdown_table([result])
    assert "Metrics not compared (n/a above):" in table and "- 2req-s hybrid e2e_p99: repetitions [1] lack it" in table


def test_the_rates_are_also_compared_by_their_geometric_mean_change():
    """The rates (`GEOMETRIC`) get a geometric mean change beside the mean of % changes; a repetition where the
    arm's rate is 0 (no completion in its window) leaves the geometric one out, named, and keeps the other."""
    from loadgen.experiment import GEOMETRIC, ABResult, Repetition
    from loadgen.gates import GateReport
    from loadgen.metrics import flat_metrics

    reps = []
    for i, scale in enumerate((1.5, 0.6)):
        base, arm = make_cell("dense"), make_cell("hybrid")
        for key in GEOMETRIC:
            arm.summary[key] = base.summary[key] * scale
        if i == 1:
            arm.summary["window_output_tok_s"] = 0.0
        reps.append(Repetition(i, ("dense", "hybrid"), base, arm, GateReport()))
    result = ABResult("dense", "hybrid", 2.0, "", "t", DIGEST, {}, None, reps)
    result.compare()
    assert set(result.geometric) == {"window_req_s", "makespan_req_s"}
    geo = result.geometric["window_req_s"]
    assert geo.mean == pytest.approx(100 * (math.sqrt(1.5 * 0.6) - 1)) and geo.n == 2
    assert result.comparison["window_req_s"].mean == pytest.approx((50.0 - 40.0) / 2)
    assert result.not_compared == {"window_output_tok_s (geometric)": "the arm's is 0 in repetitions [1]"}
    assert "window_output_tok_s" in result.comparison
    assert result.as_dict()["geometric"]["window_req_s"]["statistic"] == "geometric"
    assert all(key in flat_metrics(reps[0].baseline.summary) for key in GEOMETRIC)
