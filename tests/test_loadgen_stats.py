"""Paired statistics, Q* and the GSM8K quality helpers, checked against scipy on fixed data."""

import math

import numpy as np
import pytest
from scipy import stats as st

from loadgen.qstar import cell_rates, find_q_star
from loadgen.quality import (
    INVALID,
    composite_extract,
    difference_in_differences,
    exact_match,
    flexible_extract,
    score_gsm8k,
    score_gsm8k_records,
    strict_match,
)
from loadgen.stats import (
    arm_order,
    describe,
    geometric_comparison,
    mean_interval,
    paired_comparison,
    pct_change,
    percentile,
    ratio_interval,
)

SAMPLE = [-6.1, -7.9, -5.2, -6.6, -8.0, -5.8]


def test_mean_interval_matches_scipy_t_interval():
    iv = mean_interval(SAMPLE)
    lo, hi = st.t.interval(0.95, len(SAMPLE) - 1, loc=np.mean(SAMPLE), scale=st.sem(SAMPLE))
    assert iv.mean == pytest.approx(np.mean(SAMPLE))
    assert iv.low == pytest.approx(lo)
    assert iv.high == pytest.approx(hi)
    # t_{0.975, 5} = 2.5706: the interval uses the t quantile, not the normal 1.96
    assert iv.half_width == pytest.approx(2.570581836 * np.std(SAMPLE, ddof=1) / math.sqrt(6))


def test_interval_excluding_zero_is_resolved_and_one_containing_zero_is_not():
    assert mean_interval(SAMPLE).resolved
    noisy = [-4.0, 3.0, -1.0, 2.5]
    iv = mean_interval(noisy)
    assert iv.low < 0 < iv.high and not iv.resolved
    # the same conclusion as scipy's one-sample t test at 5%
    assert (st.ttest_1samp(noisy, 0.0).pvalue < 0.05) == iv.resolved
    assert (st.ttest_1samp(SAMPLE, 0.0).pvalue < 0.05) == mean_interval(SAMPLE).resolved


def test_single_repetition_is_never_resolved():
    iv = mean_interval([-40.0])
    assert iv.n == 1 and math.isnan(iv.half_width) and not iv.resolved
    assert iv.as_dict()["half_width"] is None
    assert iv.format() == "-40.0"


def test_percentiles_match_scipy_and_describe_reports_mean_and_tails():
    data = [0.8, 1.1, 2.4, 0.3, 5.0, 1.7, 3.3, 0.9, 2.2, 9.5]
    for q in (50, 90, 99):
        assert percentile(data, q) == pytest.approx(st.scoreatpercentile(data, q))
    d = describe(data)
    assert d["n"] == 10 and d["mean"] == pytest.approx(np.mean(data))
    assert d["p99"] == pytest.approx(st.scoreatpercentile(data, 99))
    assert describe([])["mean"] is None


def test_paired_comparison_takes_per_repetition_percent_changes():
    base = [{"e2e_mean": 10.0}, {"e2e_mean": 12.0}, {"e2e_mean": 8.0}]
    arm = [{"e2e_mean": 9.0}, {"e2e_mean": 10.8}, {"e2e_mean": 7.6}]
    res = paired_comparison(base, arm, ["e2e_mean"])["e2e_mean"]
    changes = [-10.0, -10.0, -5.0]
    assert res.mean == pytest.approx(np.mean(changes))
    lo, _ = st.t.interval(0.95, 2, loc=np.mean(changes), scale=st.sem(changes))
    assert res.low == pytest.approx(lo)
    with pytest.raises(ValueError, match="baseline is 0"):
        pct_change(1.0, 0.0)
    with pytest.raises(ValueError, match="2 baseline repetitions vs 1"):
        paired_comparison(base[:2], arm[:1], ["e2e_mean"])


def test_geometric_change_is_the_mean_log_ratio_with_its_t_interval_taken_back_to_percent():
    """H200 lease-4's in-window request rates at 1.25 Q* (dense, then the hybrid arm, per repetition): the mean of
    % changes is +34.4%, carried by the third repetition's 2.7x, while the geometric mean is -7.2%. The interval is
    scipy's t interval of the log-ratios, exponentiated: not symmetric about the change."""
    dense, hybrid = [7.3681, 6.5657, 3.7580], [2.0932, 6.8179, 10.1875]
    ratios = [h / d for h, d in zip(hybrid, dense, strict=True)]
    logs = np.log(ratios)
    lo, hi = st.t.interval(0.95, 2, loc=logs.mean(), scale=st.sem(logs))
    iv = ratio_interval(ratios)
    assert iv.mean == pytest.approx(100 * (math.exp(logs.mean()) - 1)) and iv.mean == pytest.approx(-7.2, abs=0.05)
    assert (iv.low, iv.high) == (pytest.approx(100 * (math.exp(lo) - 1)), pytest.approx(100 * (math.exp(hi) - 1)))
    assert iv.high - iv.mean > iv.mean - iv.low and not iv.resolved
    changes = paired_comparison([{"r": d} for d in dense], [{"r": h} for h in hybrid], ["r"])["r"]
    assert changes.mean == pytest.approx(34.4, abs=0.1)  # the mean of % changes, opposite in sign
    # a halving and a doubling cancel, where the mean of % changes reads +25%
    assert ratio_interval([0.5, 2.0]).mean == pytest.approx(0.0, abs=1e-12)
    assert mean_interval([-50.0, 100.0]).mean == 25.0
    steady = ratio_interval([1.10, 1.12, 1.11, 1.09])
    assert steady.resolved and steady.low > 0 and steady.format() == (
        f"{steady.mean:+.1f} [{steady.low:+.1f}, {steady.high:+.1f}]")
    one = ratio_interval([1.5])
    assert one.low is None and not one.resolved and one.format() == "+50.0"
    assert one.as_dict() == {"statistic": "geometric", "mean": pytest.approx(50.0), "half_width": None, "low": None,
                             "high": None, "n": 1, "confidence": 0.95, "resolved": False}
    with pytest.raises(ValueError, match="finite and positive"):
        ratio_interval([1.0, 0.0])
    with pytest.raises(ValueError, match="empty"):
        ratio_interval([])


def test_geometric_comparison_pairs_repetitions_and_refuses_a_rate_of_zero():
    base = [{"q": 10.0}, {"q": 8.0}]
    arm = [{"q": 11.0}, {"q": 8.8}]
    res = geometric_comparison(base, arm, ["q"])["q"]
    assert res.mean == pytest.approx(10.0) and res.n == 2
    with pytest.raises(ValueError, match="repetition 1's 'q' is not positive in both arms"):
        geometric_comparison(base, [{"q": 11.0}, {"q": 0.0}], ["q"])
    with pytest.raises(ValueError, match="2 baseline repetitions vs 1"):
        geometric_comparison(base, arm[:1], ["q"])


def test_arms_alternate_order_across_repetitions():
    orders = [arm_order(i, "upstream", "hybrid") for i in range(4)]
    assert orders == [("upstream", "hybrid"), ("hybrid", "upstream")] * 2


# ---- Q* -------------------------------------------------------------------------------------------------------

def test_q_star_is_the_last_rate_whose_growth_the_next_rate_confirms():
    # grows up to 13, then flat within 1%: Q* = 13 (the paper's GSM8K ladder shape)
    ladder = {8: 700, 9: 780, 10: 860, 11: 940, 12: 1010, 13: 1079, 14: 1080, 15: 1079, 16: 1081, 17: 1078,
              18: 1080}
    q = find_q_star(ladder)
    assert q.q_star == 13
    assert q.plateau_reached
    assert q.growth_above_pct == pytest.approx((1080 / 1079 - 1) * 100)
    assert q.cells() == {"below": 9.75, "knee": 12.35, "overload": 16.25}


def test_q_star_ignores_a_spike_that_the_next_rate_does_not_confirm():
    # 12 jumps 5% over the running max but 13 falls back: 12 is not growth, Q* stays at 11
    ladder = {9: 500, 10: 600, 11: 700, 12: 735, 13: 702, 14: 704}
    assert find_q_star(ladder).q_star == 11


def test_q_star_growth_below_one_percent_does_not_count():
    ladder = {1: 100.0, 2: 100.9, 3: 101.8, 4: 102.7}  # +0.9% steps
    assert find_q_star(ladder).q_star == 1


def test_q_star_reports_a_ladder_that_never_reaches_the_plateau():
    q = find_q_star({r: 100.0 * r for r in range(1, 7)})
    assert q.q_star == 5 and not q.plateau_reached


def test_q_star_rejects_non_contiguous_ladders():
    with pytest.raises(ValueError, match="contiguous integers, found 3 then 5"):
        find_q_star({2: 10.0, 3: 11.0, 5: 12.0})
    with pytest.raises(ValueError, match="positive integers"):
        find_q_star({1.5: 10.0, 2.5: 11.0})
    with pytest.raises(ValueError, match="q_star must be > 0"):
        cell_rates(0)


# ---- GSM8K filter and DiD ----------------------------------------------------------------------------------

def test_strict_match_reads_the_marked_answer_past_a_confidence_epilogue():
    text = "She pays 6 * 99 = 594 dollars.\n#### 594\nConfidence: 95%"
    assert strict_match(text) == "594"
    assert flexible_extract(text) == "95"  # flexible alone takes the last number
    assert composite_extract(text) == "594"
    assert score_gsm8k(text, "6 * 99 = <<6*99=594>>594\n#### 594") == 1


def test_composite_falls_back_to_flexible_extraction_when_strict_does_not_parse():
    text = "The total is 21 dollars.\n#### $21"
    assert strict_match(text) == INVALID
    assert flexible_extract(text) == "$21"
    assert composite_extract(text) == "$21"
    assert exact_match("$21", "#### 21")  # lm-eval ignores '$' on both sides
    assert score_gsm8k("no digits here", "#### 3") == 0
    assert composite_extract("no digits") == INVALID


def test_exact_match_ignores_commas_case_and_a_trailing_period():
    assert exact_match("1,234.", "#### 1234")
    assert not exact_match("1,235", "#### 1234")


def test_difference_in_differences_matches_a_paired_t_interval():
    rng = np.random.default_rng(7)
    a, b, c, d = (rng.integers(0, 2, 200).astype(float) for _ in range(4))
    iv = difference_in_differences(a, b, c, d)
    diffs = 100 * ((d - c) - (b - a))
    lo, hi = st.t.interval(0.95, 199, loc=diffs.mean(), scale=st.sem(diffs))
    assert iv.mean == pytest.approx(diffs.mean())
    assert (iv.low, iv.high) == (pytest.approx(lo), pytest.approx(hi))
    # equivalently: the paired t test of (D - C) against (B - A)
    assert st.ttest_rel(d - c, b - a).statistic == pytest.approx(iv.mean / (iv.half_width / st.t.ppf(0.975, 199)))
    with pytest.raises(ValueError, match="same documents"):
        difference_in_differences([1], [1], [1], [1, 0])


def test_served_generations_are_scored_per_scored_document_only():
    from loadgen.records import RequestRecord
    from loadgen.suite import Suite, SuiteRequest

    suite = Suite("g", (SuiteRequest("gsm8k:test:0", (1,), doc={"answer": "x\n#### 594"}),
                        SuiteRequest("gsm8k:test:1", (2,), doc={"answer": "#### 21"}),
                        SuiteRequest("gsm8k:train:5", (3,), scored=False)))

    def rec(rid, text, error=None):
        return RequestRecord(0, rid, 0.0, 1, 8, False, submit_s=0.0, finish_s=1.0, text=text, error=error)

    records = [rec("gsm8k:test:0", "#### 594\nConfidence: 95%"), rec("gsm8k:test:1", "#### $21"),
               rec("gsm8k:train:5", "anything")]
    assert score_gsm8k_records(records, suite) == {"gsm8k:test:0": 1, "gsm8k:test:1": 1}
    records[1] = rec("gsm8k:test:1", "#### 21", error="HTTP 500")
    assert score_gsm8k_records(records, suite)["gsm8k:test:1"] == 0


def test_a_records_ttft_splits_by_sglangs_stamps_where_the_server_gave_them():
    """SGLang's stamps (with --enable-metrics) split the client's TTFT: the hand-over to the scheduler, its forward
    up to the prefill's result, the output to the tokenizer's first token, and the HTTP rest; without every stamp,
    no split."""
    from loadgen.records import SERVER_TIMES, RequestRecord

    rec = RequestRecord(0, "r0", 0.0, 1024, 1, True, submit_s=10.0, first_token_s=10.060, finish_s=10.061)
    assert rec.ttft_parts() is None
    rec.server_times = {"request_received_ts": 1000.002, "forward_entry_time": 1000.005,
                        "prefill_finished_time": 1000.050, "first_token_latency": 0.052}
    parts = rec.ttft_parts()
    assert set(rec.server_times) == set(SERVER_TIMES)
    assert parts == pytest.approx({"scheduled": 0.003, "forward": 0.045, "output": 0.004, "http": 0.008})
    assert RequestRecord.from_dict(rec.as_dict()).ttft_parts() == parts  # kept with the cell's records
