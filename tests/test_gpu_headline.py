"""The headline A/B's arithmetic (benchmarks/gpu/headline.py), without a server: the GSM8K-shaped suites, the
ladder's next rate, the schedule of cells, thresholds from a measured tau, the pairing of cells into loadgen's
gates and intervals, and the figures beside their limits and the paper's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu import headline
from benchmarks.gpu.run import Plan
from loadgen.metrics import flat_metrics, summarize_cell
from loadgen.qstar import find_q_star
from loadgen.records import CellResult, RequestRecord
from loadgen.stats import paired_comparison
from vskipper.arms import Arm

HYBRID = Arm.from_dict({"name": "random-r1-d0.5-hybrid", "skipper": "random_skip", "params": {"r": 1.0, "d": 0.5},
                        "prefill": "hybrid", "decode": "hybrid"})


def test_gsm8k_suite_draws_the_same_prompts_and_forced_lengths_from_the_same_seed():
    a = headline.gsm8k_suite("knee", 50, 3, 1000, (700, 1100), (58, 174))
    assert a.digest == headline.gsm8k_suite("knee", 50, 3, 1000, (700, 1100), (58, 174)).digest
    assert a.digest != headline.gsm8k_suite("knee", 50, 4, 1000, (700, 1100), (58, 174)).digest
    assert all(700 <= r.prompt_tokens <= 1100 and 58 <= r.max_new_tokens <= 174 for r in a.requests)
    assert all(10 <= t < 990 for r in a.requests for t in r.input_ids)
    assert len({r.input_ids for r in a.requests}) == 50  # each prompt its own: GSM8K's cache share is 1.7%
    lengths = headline.forced_lengths(a)
    assert lengths == {r.id: r.max_new_tokens for r in a.requests}
    shape = headline.suite_shape(a)
    assert shape["requests"] == 50 and shape["digest"] == a.digest
    assert shape["output_tokens"]["mean"] == pytest.approx(sum(lengths.values()) / 50)


def test_gsm8k_suite_names_the_field_at_fault():
    with pytest.raises(ValueError, match=r"prompt_tokens: need 1 <= low <= high, got \(9, 8\)"):
        headline.gsm8k_suite("x", 2, 0, 100, (9, 8), (1, 2))
    with pytest.raises(ValueError, match="output_tokens"):
        headline.gsm8k_suite("x", 2, 0, 100, (1, 2), (0, 2))
    with pytest.raises(ValueError, match="requests: need at least 1"):
        headline.gsm8k_suite("x", 0, 0, 100, (1, 2), (1, 2))


def _ladder(curve, start: int, max_rates: int = 20) -> dict[int, float]:
    """Run the ladder's rule against a throughput curve: {rate: tok/s} as the stage would measure it."""
    tok: dict[int, float] = {}
    while (rate := headline.next_ladder_rate(tok, start, max_rates)) is not None:
        assert rate not in tok and rate >= 1
        tok[rate] = curve(rate)
    return tok


def test_ladder_climbs_from_its_start_and_stops_two_rates_past_q_star():
    tok = _ladder(lambda r: 100.0 * min(r, 13), start=9)  # saturates at 13 req/s
    assert sorted(tok) == list(range(9, 16))
    q = find_q_star(tok)
    assert q.q_star == 13 and q.plateau_reached  # the rule's knee: the last rate whose successor still grew


def test_ladder_steps_down_when_it_started_past_the_knee():
    tok = _ladder(lambda r: 100.0 * min(r, 6), start=9)
    assert min(tok) == 5 and find_q_star(tok).q_star == 6  # 9, 10, 11 flat: down to 8, 7, 6, 5
    assert sorted(tok) == list(range(5, 12))


def test_ladder_stops_at_its_bound_and_the_rule_says_no_plateau():
    tok = _ladder(lambda r: 100.0 * r, start=4, max_rates=5)  # never saturates
    assert sorted(tok) == [4, 5, 6, 7, 8]
    assert not find_q_star(tok).plateau_reached


def test_ladder_start_is_below_the_bursts_rate_and_never_zero():
    assert headline.ladder_start(20.0) == 15 and headline.ladder_start(0.5) == 1
    assert headline.ladder_start(110.0, at_most=3) == 3 and headline.ladder_start(2.0, at_most=3) == 1
    with pytest.raises(ValueError, match="at_most: must be >= 1 req/s, got 0"):
        headline.ladder_start(20.0, at_most=0)
    with pytest.raises(ValueError, match="estimate_req_s"):
        headline.ladder_start(0.0)


def test_schedule_runs_every_load_at_its_share_of_q_star_with_paired_repetitions():
    cells = headline.schedule(13, window_s=15.0, min_requests=24, repetitions=3)
    # served knee first (a run stopped by its time keeps the paper's headline figure), then overload, then below
    assert [(c.load, c.repetition) for c in cells] == [(load, r) for load in ("knee", "overload", "below")
                                                       for r in range(3)]
    rates = {c.load: c.rate for c in cells}
    assert rates == {"below": 9.75, "knee": 12.35, "overload": 16.25}  # the paper's A100 offered rates
    requests = {c.load: c.requests for c in cells}
    assert requests == {"below": 146, "knee": 185, "overload": 244}  # about 15 s of arrivals each
    assert len({c.seed for c in cells}) == 9  # a schedule of its own per (load, repetition)
    assert len({c.key for c in cells}) == 9
    assert headline.schedule(1, 1.0, 4, 1)[0].requests == 4  # the floor
    assert headline.Cell.from_dict(cells[4].as_dict()) == cells[4]
    with pytest.raises(ValueError, match="repetitions"):
        headline.schedule(13, 15.0, 24, 0)
    with pytest.raises(ValueError, match="q_star"):
        headline.schedule(0, 15.0, 24, 3)


RULE = {"enter_tokens": 340_000, "exit_tokens": 270_000, "v_star_tokens": 272_964.0, "tau_ms": 2.67,
        "source": "roofline:H100-SXM"}


def test_thresholds_from_a_measured_tau_scale_v_star_and_round_like_the_rule():
    th, source = headline.thresholds_from_tau(RULE, {"comparison": {"tau_ms": 2.295}}, 10_000)
    v_star = 272_964.0 * 2.295 / 2.67  # 234,622 tokens: the H100 bench's tau (benchmarks/results/H100-SXM)
    assert th["v_star_tokens"] == pytest.approx(v_star)
    assert (th["exit_tokens"], th["enter_tokens"]) == (230_000, 290_000)
    assert th["source"] == source and source.startswith("measured tau 2.29 ms")


def test_a_measured_tau_at_or_below_zero_serves_the_least_thresholds():
    """No fixed cost for the rule to cover (the H200's sweep: tau -0.046 ms): V* = 0, exit one step (a served exit
    is positive) and enter one step above it (`rounded_thresholds` keeps a band)."""
    for tau in (-0.046, 0.0):
        th, source = headline.thresholds_from_tau(RULE, {"comparison": {"tau_ms": tau}}, 10_000)
        assert (th["exit_tokens"], th["enter_tokens"], th["v_star_tokens"]) == (10_000, 20_000, 0.0)
        assert th["source"] == source and source.startswith(f"measured tau {tau:.3g} ms <= 0 (sweep)")
    th, source = headline.thresholds_from_tau(RULE, {"comparison": {"tau_ms": -0.5,
                                                                    "tau_ms_interval": [-0.8, -0.1]}}, 10_000)
    assert (th["exit_tokens"], th["enter_tokens"], th["tau_ms"]) == (10_000, 20_000, -0.1)
    assert source.startswith("measured tau -0.5 ms, 95% [-0.8, -0.1], served at its upper end <= 0 (sweep)")


def test_the_measured_arm_serves_the_upper_end_of_taus_interval():
    """The H200's tau, -0.046 ms, 95% [-0.37, 0.21]: at the point estimate V* = 0 and the arm routed at 0.75 Q*,
    where its decode passes cost 4% more than dense's (lease-4); at the upper end V* is 8% of the rule's and a light
    load stays dense."""
    th, source = headline.thresholds_from_tau(RULE, {"comparison": {"tau_ms": -0.046,
                                                                    "tau_ms_interval": [-0.31, 0.22]}}, 10_000)
    assert th["v_star_tokens"] == pytest.approx(272_964.0 * 0.22 / 2.67)  # 22,491 tokens
    assert (th["exit_tokens"], th["enter_tokens"], th["tau_ms"], th["tau_ms_interval"]) == \
        (20_000, 30_000, 0.22, [-0.31, 0.22])
    assert source == "measured tau -0.046 ms, 95% [-0.31, 0.22], served at its upper end (sweep; the rule's is 2.67 ms)"


def _speedups(*rows):
    return [{"tokens": t, "dense_over_routed_time": r, "range": [lo, hi]} for t, r, lo, hi in rows]


# host-lean-sweep's prefill on the H200 (benchmarks/results/H200/host-lean-sweep/sweep.json, rounded)
H200_PREFILL = _speedups((1024, 0.891, 0.855, 0.926), (2048, 1.058, 1.029, 1.096), (4096, 1.095, 1.080, 1.108))


def test_the_prefill_floor_is_the_shortest_length_from_which_routed_prefill_gains_beyond_its_spread():
    assert headline.prefill_floor(H200_PREFILL) == {
        "prefill_floor_tokens": 2048,
        "prefill_floor_source": "the shortest measured length from which routed prefill gains beyond its spread "
                                "(dense / routed time 1.058, 1.029-1.096 at 2048 tokens)"}
    # a gain whose spread reaches 1 is no gain; one at a shorter length with a loss after it is not the floor
    floor = headline.prefill_floor(_speedups((1024, 1.05, 1.01, 1.09), (1536, 1.02, 0.99, 1.05),
                                             (2048, 1.06, 1.02, 1.09), (4096, 1.1, 1.08, 1.12)))
    assert floor["prefill_floor_tokens"] == 2048
    assert headline.prefill_floor(list(reversed(H200_PREFILL)))["prefill_floor_tokens"] == 2048  # any order


def test_a_round_of_several_prompts_that_loses_holds_the_floor_above_its_length():
    """The floor counts a round's prompts together: where two prompts of 1,024 in one round lose while one prompt of
    2,048 gains, rounds of 2,048 tokens would lose, and the floor moves to the next length that gains."""
    rounds = [{"tokens": 2048, "prompts": 2, "dense_over_routed_time": 0.97, "range": [0.95, 0.99]}]
    floor = headline.prefill_floor(H200_PREFILL + rounds)
    assert floor["prefill_floor_tokens"] == 4096
    gains = [{**rounds[0], "dense_over_routed_time": 1.04, "range": [1.01, 1.06]}]
    floor = headline.prefill_floor(H200_PREFILL + gains)
    assert floor["prefill_floor_tokens"] == 2048


def test_where_routed_prefill_gains_at_no_measured_length_the_floor_is_past_the_longest():
    floor = headline.prefill_floor(_speedups((1024, 0.9, 0.85, 0.93), (4096, 1.01, 0.98, 1.04)))
    assert floor["prefill_floor_tokens"] == 4097
    assert floor["prefill_floor_source"].startswith("routed prefill gained beyond its spread at no measured length "
                                                    "(the longest, 4096 tokens: dense / routed time 1.010, 0.980-1.040)")
    assert headline.prefill_floor([]) is None and headline.prefill_floor(None) is None


def test_the_measured_arm_serves_the_sweeps_prefill_floor_beside_its_thresholds():
    sweep = {"comparison": {"tau_ms": 2.65, "prefill_speedup": H200_PREFILL}}  # the rule's thresholds, another floor
    th, _ = headline.thresholds_from_tau(RULE, sweep, 10_000)
    assert (th["enter_tokens"], th["exit_tokens"], th["prefill_floor_tokens"]) == (340_000, 270_000, 2048)
    assert th["prefill_floor_source"].startswith("the shortest measured length")
    given = {"prefill_floor_tokens": 3000, "prefill_floor_source": "given"}  # the sweep's own, where it holds one
    sweep["comparison"]["prefill_floor"] = given
    assert headline.thresholds_from_tau(RULE, sweep, 10_000)[0]["prefill_floor_tokens"] == 3000


def test_thresholds_from_tau_say_why_there_are_none():
    assert headline.thresholds_from_tau(RULE, None, 10_000) == (None, "the sweep stage has not run: no measured tau")
    assert "measured no tau" in headline.thresholds_from_tau(RULE, {"comparison": None}, 10_000)[1]
    th, why = headline.thresholds_from_tau(RULE, {"comparison": {"tau_ms": 2.65}}, 10_000)
    assert th is None and "gives the rule's thresholds (enter 340000 / exit 270000) and the sweep measured no " \
        "prefill floor" in why


def _sweep_arm(intercept_s, slope_s, prefill):
    return {"line": {"intercept_s": intercept_s, "slope_s_per_token": slope_s},
            "prefill": [{"tokens": t, "ttft_s": s} for t, s in prefill]}


# host-lean-sweep's H200 lines (rounded): decode over resident tokens, prefill over a prompt's tokens
H200_DENSE = _sweep_arm(0.01052, 3.82e-8, [(1024, 0.0528), (2048, 0.0815), (4096, 0.1593)])
H200_ALWAYS = _sweep_arm(0.01047, 3.21e-8, [(1024, 0.0592), (2048, 0.0771), (4096, 0.1456)])


def test_the_queueing_models_lines_are_the_sweeps_decode_lines_and_a_fit_of_its_prefill_times():
    lines = headline.model_lines(H200_DENSE, H200_ALWAYS)
    assert (lines["decode_dense"].intercept_s, lines["decode_dense"].per_resident_token_s) == (0.01052, 3.82e-8)
    assert lines["decode_routed"].per_row_s == 0.0 and lines["prefill_dense"].per_resident_token_s == 0.0
    # least squares over 1k / 2k / 4k: dense 13.9 ms + 35.2 us a token, routed 25.0 ms + 28.9 us
    assert lines["prefill_dense"].intercept_s == pytest.approx(0.0139, abs=2e-4)
    assert lines["prefill_dense"].per_row_s == pytest.approx(35.1e-6, abs=0.3e-6)
    assert lines["prefill_routed"].intercept_s == pytest.approx(0.0250, abs=2e-4)
    assert lines["prefill_routed"].per_row_s == pytest.approx(28.9e-6, abs=0.3e-6)
    assert headline.model_lines(H200_DENSE, {**H200_ALWAYS, "line": None}) is None
    assert headline.model_lines(H200_DENSE, {**H200_ALWAYS, "prefill": H200_ALWAYS["prefill"][:1]}) is None
    assert lines["prefill_from"] == "ttft"  # the landed sweep predates the stamps' parts


def _with_forward(arm: dict, overhead_s: float, lengths=None) -> dict:
    """The arm with each prefill length's forward part: its TTFT less `overhead_s` (at `lengths` only, if given)."""
    return {**arm, "prefill": [{**p, "ttft_parts_s": {"forward": p["ttft_s"] - overhead_s}}
                               if lengths is None or p["tokens"] in lengths else p for p in arm["prefill"]]}


def test_the_prefill_lines_take_the_forward_part_of_the_ttft_where_every_length_of_both_arms_has_it():
    """SGLang's stamps split a prompt's TTFT; the forward part is the pass in the scheduler, which the model charges
    a prefill pass. Where a length of either arm lacks it, both arms' lines stay on the whole TTFT."""
    dense, routed = _with_forward(H200_DENSE, 0.0075), _with_forward(H200_ALWAYS, 0.0075)
    lines = headline.model_lines(dense, routed)
    assert lines["prefill_from"] == "forward"
    assert lines["prefill_dense"].intercept_s == pytest.approx(0.0139 - 0.0075, abs=2e-4)
    assert lines["prefill_routed"].per_row_s == pytest.approx(28.9e-6, abs=0.3e-6)
    partial = headline.model_lines(dense, _with_forward(H200_ALWAYS, 0.0075, {1024, 2048}))
    assert partial["prefill_from"] == "ttft" and partial["prefill_dense"].intercept_s == pytest.approx(0.0139, abs=2e-4)


def test_the_queueing_model_predicts_nothing_for_an_arm_that_costs_what_dense_does_and_a_gain_where_it_costs_less():
    """The same suite, rate and seeded arrivals as each repetition of a load, the arm at its thresholds and floor:
    with the routed lines equal to dense's the prediction is exactly no change; with the H200's lines the hybrid
    arm at enter 40k / exit 30k and a floor of 2,048 gains a few percent at lease-4's knee, and thresholds out of
    reach keep its decode dense."""
    from vskipper.arms import Arm

    arm = Arm.from_dict({"name": "h", "skipper": "random_skip", "params": {"r": 1.0, "d": 0.5}})
    suite = headline.gsm8k_suite("s", 194, 1, 1000, (701, 1100), (58, 174))  # lease-4's knee: 16.15 req/s
    cells = [headline.Cell("knee", r, 16.15, 194, 200 + r) for r in range(2)]
    same = headline.model_lines(H200_DENSE, H200_DENSE)
    th = {"enter_tokens": 40_000, "exit_tokens": 30_000, "prefill_floor_tokens": 2048}
    flat = headline.model_prediction(same, arm, th, suite, cells, 842_145, 256)
    assert flat["e2e_mean"] == 0.0 and [r["e2e_mean"] for r in flat["reps"]] == [0.0, 0.0]
    lines = headline.model_lines(H200_DENSE, H200_ALWAYS)
    gain = headline.model_prediction(lines, arm, th, suite, cells, 842_145, 256)
    assert -15 < gain["e2e_mean"] < 0 and len(gain["reps"]) == 2
    light = headline.model_prediction(lines, arm, {**th, "enter_tokens": 10**9, "exit_tokens": 10**9 - 1}, suite,
                                      cells, 842_145, 256)
    assert light["routed_share"]["decode"] == 0.0  # never reaches enter: decode stays dense


H200_RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "H200"


def _lease_4():
    """The landed H200 runs (benchmarks/results/H200/README.md, lease-4): host-lean-sweep's arms and model config,
    lease-4's KV pool and, per load, its cells with their suites drawn again from their seeds (`drawn_suites`:
    digests checked)."""
    sweep = H200_RESULTS / "host-lean-sweep"
    arms = json.loads((sweep / "sweep.json").read_text())["arms"]
    config = json.loads((sweep / "model" / "config.json").read_text())
    ladder = json.loads((H200_RESULTS / "lease-4" / "ladder.json").read_text())
    pool = headline.kv_pool_of(json.loads((H200_RESULTS / "lease-4" / "headline.json").read_text()))
    assert pool == 842_145
    cells = [headline.Cell.from_dict(c) for c in ladder["cells"]]
    suites = headline.drawn_suites(ladder, config["vocab_size"])
    return arms, config, pool, {load: (suites[load], [c for c in cells if c.load == load]) for load in headline.LOADS}


RANDOM_SKIP = {"skipper": "random_skip", "params": {"r": 1.0, "d": 0.5}}


def test_what_the_queueing_model_makes_of_lease_4s_cells_from_the_h200_sweeps_lines():
    """At the thresholds lease-4's hybrid arm served (10k / 10k, the constants' floor) the model predicts a mean E2E
    change of about -3 / -5 / -8% at 0.75 / 0.95 / 1.25 Q*, where the cells measured +21 / +34 / -1% and the paper
    -6.6 / -36.8 / -25.7%: the sweep's per-pass costs leave the knee a few percent; always-route loses below the
    knee (its prefill's intercept)."""
    arms, _, pool, loads = _lease_4()
    lines = headline.model_lines(arms["dense"], arms["random-r1-d0.5-always"])
    hybrid, always = Arm.from_dict(RANDOM_SKIP), Arm.from_dict({**RANDOM_SKIP, "prefill": "routed", "decode": "routed"})
    predicted = {}
    for load, (suite, mine) in loads.items():
        for name, arm in (("hybrid", hybrid), ("always", always)):
            p = headline.model_prediction(lines, arm, {"enter_tokens": 10_000, "exit_tokens": 10_000}, suite, mine,
                                          pool, 256)
            predicted[name, load] = p["e2e_mean"]
    assert -4.5 < predicted["hybrid", "below"] < -1.5
    assert -6.5 < predicted["hybrid", "knee"] < -3.5
    assert -9.5 < predicted["hybrid", "overload"] < -6
    assert predicted["always", "below"] > 3


def test_the_models_dense_from_the_sweeps_ttft_queues_more_than_lease_4s_cells_and_from_the_cells_passes_not():
    """How far the sweep's lines describe lease-4's served load: with the prefill line fitted over each prompt's
    whole TTFT (all the landed sweep has) the model's dense mean E2E runs 15-30% over the cells' measured one at
    0.75 Q*; with the cells' own dense prefill passes (lease-4's pass spans: 41 us a token, through the origin) it
    comes within 10% at every load. The TTFT's HTTP, hand-over and output, which a server overlaps with other
    passes, made the model queue more. The skip's limit at the knee moves by about a point with it."""
    from loadgen.simulate import StepLine

    arms, config, pool, loads = _lease_4()
    doc = json.loads((H200_RESULTS / "lease-4" / "headline.json").read_text())["arms"]["hybrid-tau"]["loads"]
    spans = [doc[load]["pass_spans"]["dense"]["prefill"] for load in headline.LOADS]
    per_token = sum(s["device_ms"] * s["passes"] for s in spans) / sum(s["tokens"] for s in spans) / 1e3
    assert 40e-6 < per_token < 43e-6
    lines = headline.model_lines(arms["dense"], arms["random-r1-d0.5-always"])
    own = {**lines, "prefill_dense": StepLine(0.0, per_token)}
    measured = {load: doc[load]["dense"]["e2e_mean_s"] for load in headline.LOADS}
    always = headline.always_route(0.5)
    predicted = {}
    for load, (suite, mine) in loads.items():
        ttft = headline.model_prediction(lines, always, {"enter_tokens": 0, "exit_tokens": 0}, suite, mine, pool, 256)
        cells = headline.model_prediction(own, always, {"enter_tokens": 0, "exit_tokens": 0}, suite, mine, pool, 256)
        model = {name: sum(p["dense_e2e_mean_s"]) / len(mine) / measured[load] - 1
                 for name, p in (("ttft", ttft), ("cells", cells))}
        if load == "below":
            assert 0.15 < model["ttft"] < 0.30
        assert abs(model["cells"]) < 0.10, (load, model)
        predicted[load] = ttft
    text = "\n".join(headline.model_dense_lines(predicted, doc))  # as the summary sets them side by side
    assert text.startswith("The model's dense mean E2E beside the cells' measured dense")
    assert f"0.75 Q* {min(predicted['below']['dense_e2e_mean_s']):.2f}-" in text and "against 2.35 s (+" in text
    shifted = {**lines, "prefill_dense": StepLine(lines["prefill_dense"].intercept_s - 0.0075,
                                                  lines["prefill_dense"].per_row_s)}
    knee = loads["knee"]
    at = {name: headline.model_prediction(headline.limit_lines(ls, config, 0.5, [1024, 2048, 4096], 4800.0), always,
                                          {"enter_tokens": 0, "exit_tokens": 0}, *knee, pool, 256)["e2e_mean"]
          for name, ls in (("ttft", lines), ("shifted", shifted))}
    assert abs(at["ttft"] - at["shifted"]) < 1.5


def test_the_limit_lines_are_denses_scaled_by_the_bytes_and_the_work_the_skip_leaves():
    """Llama-3-8B's shape (16 of 32 layers routed): at s = 0.5 a decode step reads the adapter too (352 MB: 73 us
    at the H200's 4.8 TB/s) and 75% of the KV; a prefill token does 1/1.296 of the work. With nothing skipped the
    limit is dense."""
    arms, config, _, _ = _lease_4()
    lines = headline.model_lines(H200_DENSE, H200_ALWAYS)
    limit = headline.limit_lines(lines, config, 0.5, [1024, 2048, 4096], 4800.0)
    assert limit["decode_dense"] == lines["decode_dense"] and limit["prefill_dense"] == lines["prefill_dense"]
    assert headline.adapter_read_s(config, 0.5, 4800.0) == pytest.approx(16 * 3 * 4096 * 896 * 2 / 4.8e12)
    assert limit["decode_routed"].intercept_s == pytest.approx(0.01052 + 73.4e-6, rel=1e-4)
    assert limit["decode_routed"].per_resident_token_s == pytest.approx(3.82e-8 * 0.75)
    unknown = headline.limit_lines(lines, config, 0.5, [1024, 2048, 4096])  # no bandwidth: the adapter is free
    assert unknown["decode_routed"].intercept_s == 0.01052 and headline.adapter_read_s(config, 0.5, None) == 0.0
    assert limit["prefill_routed"].per_row_s == pytest.approx(lines["prefill_dense"].per_row_s / 1.296, rel=2e-3)
    assert limit["prefill_routed"].intercept_s == pytest.approx(lines["prefill_dense"].intercept_s, abs=1e-4)
    none = headline.limit_lines(lines, config, 0.0, [1024, 2048])
    assert none["decode_routed"] == lines["decode_dense"]
    assert none["prefill_routed"].per_row_s == pytest.approx(lines["prefill_dense"].per_row_s)
    with pytest.raises(ValueError, match="two prompt lengths"):
        headline.limit_lines(lines, config, 0.5, [1024, 1024])


def test_the_skips_limit_on_lease_4s_cells_lies_short_of_the_papers_knee():
    """With every routed pass at the skip's physical limit (RandomSkip d = 0.5 over 16 of 32 layers), always-route
    gains about -17 / -26 / -32% mean E2E at 0.75 / 0.95 / 1.25 Q* on lease-4's cells: the paper's -36.8% at the
    knee is beyond what this skip allows on the H200 at this load. The measured hybrid arm's thresholds and floor
    (enter 40k / exit 30k, 2,048) leave it about -5 / -8 / -13% at the limit."""
    arms, config, pool, loads = _lease_4()
    cells = [c for _, mine in loads.values() for c in mine]
    suites = {load: suite for load, (suite, _) in loads.items()}
    doc = headline.skip_limit(arms["dense"], config, cells, suites, pool, 256, 0.5, 4800.0)
    assert (doc["skip"], doc["arm"], doc["layers_skipped"], doc["layers"]) == (0.5, "random-r1-d0.5-always", 8, 32)
    assert doc["adapter_ms"] == pytest.approx(0.0734, abs=1e-4)
    bound = {load: p["e2e_mean"] for load, p in doc["loads"].items()}
    assert -19 < bound["below"] < -13 and -28 < bound["knee"] < -22 and -34 < bound["overload"] < -27
    assert all(p["routed_share"] == {"prefill": 1.0, "decode": 1.0} for p in doc["loads"].values())
    # with three quarters of the routed layers' rows Project-Only (12 of 32 layers) the knee's limit nears the
    # paper's figure
    assert -38 < headline.skip_limit(arms["dense"], config, cells, suites, pool, 256, 0.75, 4800.0)["loads"]["knee"][
        "e2e_mean"] < -32
    dense = headline.model_lines(arms["dense"], arms["dense"])
    limit = headline.limit_lines(dense, config, 0.5, [p["tokens"] for p in arms["dense"]["prefill"]], 4800.0)
    hybrid = Arm.from_dict(RANDOM_SKIP)
    tau = {"enter_tokens": 40_000, "exit_tokens": 30_000, "prefill_floor_tokens": 2048}
    at_tau = {load: headline.model_prediction(limit, hybrid, tau, suite, mine, pool, 256)["e2e_mean"]
              for load, (suite, mine) in loads.items()}
    assert all(bound[load] < at_tau[load] < 0 for load in loads)
    assert -6 < at_tau["below"] < -3 and -10 < at_tau["knee"] < -7 and -14 < at_tau["overload"] < -11
    lease_4 = {"enter_tokens": 10_000, "exit_tokens": 10_000}  # the thresholds and floor lease-4's arm served
    at_10k = {load: headline.model_prediction(limit, hybrid, lease_4, suite, mine, pool, 256)["e2e_mean"]
              for load, (suite, mine) in loads.items()}
    assert -10 < at_10k["below"] < -6.5 and -15 < at_10k["knee"] < -11.5 and -21 < at_10k["overload"] < -18


def test_what_always_route_lacks_of_its_limit_on_lease_4s_cells_is_in_prefill():
    """`limit_parts`: the sweep's always-route with its prefill line at the limit and its decode as measured gets
    nearly all of the limit at the knee (about -26%); with its decode at the limit and its prefill as measured it
    gets none (about +3%), as with both measured (about +5%)."""
    arms, config, pool, loads = _lease_4()
    cells = [c for _, mine in loads.values() for c in mine]
    suites = {load: suite for load, (suite, _) in loads.items()}
    doc = headline.limit_parts(arms["dense"], arms["random-r1-d0.5-always"], config, cells, suites, pool, 256, 0.5,
                               4800.0)
    assert doc["arm"] == "random-r1-d0.5-always" and tuple(doc["parts"]) == headline.LIMIT_PARTS
    knee = {part: by["knee"]["e2e_mean"] for part, by in doc["parts"].items()}
    assert 3 < knee["measured"] < 7 and 0 < knee["decode at the limit"] < 6
    assert abs(knee["prefill at the limit"] - knee["both at the limit"]) < 2 and knee["both at the limit"] < -22
    assert headline.limit_parts(arms["dense"], {**arms["random-r1-d0.5-always"], "line": None}, config, cells,
                                suites, pool, 256, 0.5) is None


def test_resident_ceiling_is_the_pool_or_the_running_cap_times_the_longest_request():
    assert headline.resident_ceiling(420_000, 256, 1274) == 326_144  # below the H100's 340k enter threshold
    assert headline.resident_ceiling(200_000, 256, 1274) == 200_000
    assert headline.resident_ceiling(4096, None, 41) == 4096


def _cell(arm: str, suite, rate: float, step: float, seed: int) -> CellResult:
    """A hand-built matched cell of the suite: each request its forced length, `step` seconds a token."""
    records = []
    for i, req in enumerate(suite.requests):
        t0 = i / rate
        first = t0 + 10 * step
        times = [first + k * step for k in range(req.max_new_tokens)]
        records.append(RequestRecord(i, req.id, t0, req.prompt_tokens, req.max_new_tokens, True, submit_s=t0,
                                     first_token_s=first, token_times_s=times, finish_s=times[-1],
                                     output_ids=list(range(req.max_new_tokens)), output_tokens=req.max_new_tokens,
                                     finish_reason="length"))
    cell = CellResult(arm, "matched", rate, len(suite) / rate, seed, suite.name, suite.digest, len(suite),
                      records=records, submitted=len(records), started=len(records), completed=len(records))
    summarize_cell(cell)
    return cell


def test_pair_load_gates_each_repetition_and_takes_loadgens_paired_intervals():
    suite = headline.gsm8k_suite("gsm8k-shaped-knee", 8, 1, 500, (20, 40), (4, 12))
    steps = ((0.010, 0.008), (0.011, 0.008), (0.012, 0.009))  # (dense, hybrid) seconds per token per repetition
    pairs = [(rep, _cell("dense", suite, 4.0, d, 200 + rep), _cell(HYBRID.name, suite, 4.0, h, 200 + rep))
             for rep, (d, h) in enumerate(steps)]
    ab = headline.pair_load("knee", HYBRID, "hybrid-rule", suite, 4.0, pairs, expect_engaged=True)
    assert len(ab.accepted) == 3 and all(r.order == ("dense", HYBRID.name) for r in ab.repetitions)
    assert {"work_identity", "accounting", "declared_cell_size"} <= set(ab.repetitions[0].gates.checked)
    expected = paired_comparison([flat_metrics(b.summary) for _, b, _ in pairs],
                                 [flat_metrics(t.summary) for _, _, t in pairs], ["e2e_mean", "tpot_p99"])
    for metric, iv in expected.items():
        assert ab.comparison[metric].mean == pytest.approx(iv.mean)
        assert ab.comparison[metric].half_width == pytest.approx(iv.half_width)
    doc = headline.load_doc(ab, len(suite))
    assert doc["repetitions_accepted"] == 3 and doc["comparison"]["e2e_mean"]["n"] == 3
    assert doc["comparison"]["e2e_mean"]["mean"] < 0 and doc["comparison"]["e2e_mean"]["resolved"]
    assert doc["routed_share"] == {"prefill": None, "decode": None}  # no attestation read
    assert doc["dense"]["e2e_mean_s"] > doc["arm"]["e2e_mean_s"]
    assert [g["passed"] for g in doc["gates"]] == [True] * 3
    assert set(doc["geometric"]) == {"window_output_tok_s", "window_req_s", "makespan_req_s"}
    assert doc["geometric"]["makespan_req_s"] == ab.geometric["makespan_req_s"].as_dict()
    assert doc["geometric"]["makespan_req_s"]["mean"] > 0  # the hybrid's faster steps finish the cell sooner
    assert doc["not_compared"] == ab.not_compared


def test_a_load_says_when_its_cells_came_from_several_server_starts_or_machines():
    """A lease's arm split over two calls serves a load's cells from two server starts, and a second call whose
    machine went back serves them on another GPU of the same kind: the load's document names the starts and
    machines from the cells' attestations, and its figures say so. Attestations that name no machine (before it
    was attested) leave the machines unknown, never a false "one machine"."""
    suite = headline.gsm8k_suite("gsm8k-shaped-knee", 8, 1, 500, (20, 40), (4, 12))

    def served(arm, step, seed, run, gpu):
        cell = _cell(arm, suite, 4.0, step, seed)
        doc = {"run_id": run, "machine": {"host": "h", "device_name": "NVIDIA H200", "device_uuid": gpu}}
        cell.attestation_before, cell.attestation_after = doc, dict(doc)
        return cell

    pairs = [(rep, served("dense", 0.010, 200 + rep, "d1", "gpu-a"),
              served(HYBRID.name, 0.008, 200 + rep, run, gpu))
             for rep, (run, gpu) in enumerate((("h1", "gpu-a"), ("h1", "gpu-a"), ("h2", "gpu-b")))]
    ab = headline.pair_load("knee", HYBRID, "hybrid-rule", suite, 4.0, pairs, expect_engaged=True)
    doc = headline.load_doc(ab, len(suite))
    assert doc["provenance"] == {"dense": {"starts": ["d1"], "machines": ["gpu-a"]},
                                 "arm": {"starts": ["h1", "h2"], "machines": ["gpu-a", "gpu-b"]}}
    note = "the arm's cells came from 2 server starts; the cells were served on 2 machines: pairs across machines"
    assert headline.served_apart(doc) == note
    rows = headline.figure_rows({"arms": {"hybrid-rule": {"role": "hybrid", "loads": {"knee": doc}}}})
    assert rows[0]["verdict"].endswith(note)
    # one start and one machine a side: nothing to say
    one = [(rep, served("dense", 0.010, 200 + rep, "d1", "gpu-a"), served(HYBRID.name, 0.008, 200 + rep, "h1",
                                                                           "gpu-a")) for rep in range(3)]
    ab = headline.pair_load("knee", HYBRID, "hybrid-rule", suite, 4.0, one, expect_engaged=True)
    assert headline.served_apart(headline.load_doc(ab, len(suite))) == ""
    # the host names the machine where no device UUID does (CPU); an attestation without a machine: unknown
    cpu = served("dense", 0.010, 1, "d1", None)
    assert headline.provenance([cpu]) == {"starts": ["d1"], "machines": ["h"]}
    old = _cell("dense", suite, 4.0, 0.010, 1)
    old.attestation_before = old.attestation_after = {"run_id": "d0"}
    assert headline.provenance([old, cpu]) == {"starts": ["d0", "d1"], "machines": None}
    assert headline.served_apart({"provenance": {"dense": headline.provenance([old]),
                                                 "arm": headline.provenance([cpu])}}) == ""
    assert headline.served_apart({}) == ""  # older documents carry none
    # dense served in one call, the arm's every cell in the next, on another GPU: each side on one machine
    apart = {"dense": {"starts": ["d1"], "machines": ["gpu-a"]}, "arm": {"starts": ["h1"], "machines": ["gpu-b"]}}
    assert headline.served_apart({"provenance": apart}) == ("the cells were served on 2 machines: pairs across "
                                                            "machines")
    # both readings of a cell count (a start between them), and every replica's machine
    restarted = served(HYBRID.name, 0.008, 1, "h1", "gpu-a")
    restarted.attestation_after = {**restarted.attestation_after, "run_id": "h2",
                                   "replicas": [{"machine": {"host": "h", "device_uuid": "gpu-a"}},
                                                {"machine": {"host": "h", "device_uuid": "gpu-c"}}]}
    assert headline.provenance([restarted]) == {"starts": ["h1", "h2"], "machines": ["gpu-a", "gpu-c"]}
    restarted.attestation_after["replicas"][1] = {"machine": None}  # a replica that names none: unknown
    assert headline.provenance([restarted])["machines"] is None


def test_pair_load_refuses_a_cell_of_another_arm_and_gates_a_changed_length():
    suite = headline.gsm8k_suite("s", 4, 2, 500, (20, 40), (4, 12))
    dense = _cell("dense", suite, 4.0, 0.01, 1)
    with pytest.raises(ValueError, match=r"repetition 0: cell.arm is 'random-r1-d0.5-always'"):
        headline.pair_load("knee", HYBRID, "h", suite, 4.0, [(0, dense, _cell("random-r1-d0.5-always", suite, 4.0,
                                                                                0.01, 1))], expect_engaged=True)
    other = _cell(HYBRID.name, suite, 4.0, 0.01, 1)
    other.records[0].output_ids.append(7)
    other.records[0].output_tokens += 1
    ab = headline.pair_load("knee", HYBRID, "h", suite, 4.0, [(0, dense, other)], expect_engaged=True)
    assert not ab.accepted and ab.comparison == {}
    assert any(f.gate == "work_identity" for f in ab.repetitions[0].gates.refusals)


def test_routed_share_sums_each_cells_attested_passes():
    suite = headline.gsm8k_suite("s", 2, 2, 500, (20, 40), (4, 12))
    cells = []
    for before, after in (((2, 0, 10, 0), (4, 2, 20, 30)), ((4, 2, 20, 30), (5, 2, 30, 30))):
        cell = _cell(HYBRID.name, suite, 4.0, 0.01, 1)
        cell.attestation_before, cell.attestation_after = ({"passes_total": {
            "prefill": {"dense": p[0], "routed": p[1]}, "decode": {"dense": p[2], "routed": p[3]}}}
            for p in (before, after))
        cells.append(cell)
    assert headline.routed_share(cells) == {"prefill": pytest.approx(2 / 5), "decode": pytest.approx(30 / 50)}


def test_pass_spans_weigh_every_pass_of_the_cells_from_the_clock_their_attestations_carry():
    """Each phase's host and device ms a pass over all the cells' passes (a cell of many passes weighs as many),
    from each cell's attestations' clock; a cell without one adds nothing, and a phase no pass ran is None."""
    suite = headline.gsm8k_suite("s", 2, 2, 500, (20, 40), (4, 12))

    def clock(decode_passes: int, host_s: float, device_s: float, tokens: int = 0,
              thread: tuple[float, int] | None = None) -> dict:
        return {"parts": False, "passes_total": {"decode": decode_passes}, "device_passes_total": {"decode": decode_passes},
                "seconds_total": {"decode": {"outside": {"outside": host_s}}}, "tokens_total": {"decode": tokens},
                "device_seconds_total": {"decode": device_s}, "errors": {},
                **({"forward_thread": {"cpu_seconds_total": {"decode": thread[0]},
                                       "waits_total": {"decode": thread[1]}}} if thread else {})}

    cells = []
    # the forward's thread: 10 passes of 0.5 ms CPU and 2 waits each, then 30 of 1 ms and 4
    for before, after in ((clock(0, 0.0, 0.0, thread=(0.0, 0)), clock(10, 0.01, 0.1, 640, (0.005, 20))),
                          (clock(10, 0.01, 0.1, 640, (0.005, 20)), clock(40, 0.07, 0.7, 640 + 30 * 96, (0.035, 140))),
                          (None, None), (clock(40, 0.07, 0.7), None), ({"part_clock": "lost"}, {})):
        cell = _cell(HYBRID.name, suite, 4.0, 0.01, 1)
        cell.attestation_before = None if before is None else {"part_clock": before}
        cell.attestation_after = None if after is None else {"part_clock": after}
        cells.append(cell)
    spans = headline.pass_span_means(cells)
    assert spans["prefill"] is None
    # 10 passes at 1 ms of host and 10 ms of device, then 30 at 2 ms and 20 ms: each pass weighs alike
    assert spans["decode"]["passes"] == 40 and spans["decode"]["host_ms"] == pytest.approx(70 / 40)
    assert spans["decode"]["device_ms"] == pytest.approx(700 / 40)
    assert spans["decode"]["cpu_ms"] == pytest.approx(35 / 40) and spans["decode"]["waits"] == pytest.approx(140 / 40)
    loads = {headline.KNEE: {"pass_spans": {"dense": spans, "arm": headline.pass_span_means(cells[1:2])}}}
    table = headline.pass_span_table("hybrid-rule", loads)
    # the passes' sizes beside them: 10 passes of 64 rows and 30 of 96 in dense's cells, the arm's 30 of 96
    assert spans["decode"]["tokens"] == 640 + 30 * 96
    # the thread's CPU, waits and gc beside the host's (dense / arm); gc not attested by these clocks: n/a
    assert "| 0.95 Q* | decode | 17.50 | 20.00 | 1.75 | 2.00 | 0.88 / 1.00 | 3.5 / 4.0 | n/a / n/a | 40 | 30 | " \
           "88.0 | 96.0 |" in table
    assert headline.pass_span_table("hybrid-rule", {headline.KNEE: {}}) == []
    # reads of the forward's thread that failed: no thread figures, and the table names the error
    failed = _cell(HYBRID.name, suite, 4.0, 0.01, 1)
    failed.attestation_before = {"part_clock": clock(10, 0.01, 0.1, 640, (0.005, 20))}
    failed.attestation_after = {"part_clock": dict(clock(40, 0.07, 0.7, 640 + 30 * 96, (0.035, 140)),
                                                   errors={"thread": "OSError: gone"})}
    arm = headline.pass_span_means([failed])["decode"]
    assert arm["thread_error"] == "OSError: gone" and arm["cpu_ms"] is None and arm["waits"] is None
    table = headline.pass_span_table("hybrid-rule", {headline.KNEE: {"pass_spans": {"dense": spans,
                                                                                     "arm": {"decode": arm}}}})
    assert "| 0.95 Q* | decode | 17.50 | 20.00 | 1.75 | 2.00 | 0.88 / n/a | 3.5 / n/a | n/a / n/a | 40 | 30 | " \
           "88.0 | 96.0 |" in table
    assert "The reads of hybrid-rule's forward thread stopped: OSError: gone." in table
    assert "thread_error" not in spans["decode"]
    # a server whose events stopped timed fewer passes on the device than on the host: no device figure
    short = _cell(HYBRID.name, suite, 4.0, 0.01, 1)
    stopped = dict(clock(40, 0.07, 0.4), device_passes_total={"decode": 20})
    short.attestation_before, short.attestation_after = {"part_clock": clock(0, 0.0, 0.0)}, {"part_clock": stopped}
    assert headline.pass_span_means([short])["decode"] == {"host_ms": pytest.approx(70 / 40), "device_ms": None,
                                                           "passes": 40, "device_passes": 20, "tokens": 0,
                                                           "cpu_ms": None, "waits": None, "gc_ms": None, "late": 0}
    # a reading the server served late (its document older than the read) is counted, and the table says so
    late = _cell(HYBRID.name, suite, 4.0, 0.01, 1)
    late.attestation_before = {"part_clock": clock(0, 0.0, 0.0)}
    late.attestation_after = {"part_clock": clock(10, 0.01, 0.1), "answered": False}
    assert headline.attested_clock(late.attestation_after)["late"] is True
    assert "late" not in headline.attested_clock(late.attestation_before) and headline.attested_clock(None) is None
    assert headline.pass_span_means([late, cells[1]])["decode"]["late"] == 1
    loads = {headline.KNEE: {"pass_spans": {"dense": spans, "arm": headline.pass_span_means([late])}}}
    assert "1 cell windows are bounded by a reading the server served late: a pass of such a window may be " \
           "counted in no cell." in headline.pass_span_table("hybrid-rule", loads)


def test_a_hybrid_arms_routed_passes_stand_beside_its_dense_ones_per_token():
    """The clock's `routed_total` splits an arm's passes: routed ones as counted, dense ones the totals less them,
    summed over the cells; the table puts each kind's device ms a pass and us a token side by side. A clock
    without the split (a server from before it) gives None and no table."""
    suite = headline.gsm8k_suite("s", 2, 2, 500, (20, 40), (4, 12))

    def clock(passes, tokens, device_s, routed) -> dict:
        r_passes, r_tokens, r_device = routed
        return {"passes_total": {"prefill": passes}, "tokens_total": {"prefill": tokens},
                "device_seconds_total": {"prefill": device_s}, "device_passes_total": {"prefill": passes},
                "routed_total": {"passes_total": {"prefill": r_passes}, "tokens_total": {"prefill": r_tokens},
                                 "device_seconds_total": {"prefill": r_device},
                                 "device_passes_total": {"prefill": r_passes}, "host_seconds_total": {}}}

    cells = []
    # each cell: 3 dense passes of 1,000 tokens at 40 ms, 1 routed pass of 2,000 tokens at 100 ms
    for n in range(2):
        cell = _cell(HYBRID.name, suite, 4.0, 0.01, 1)
        cell.attestation_before = {"part_clock": clock(4 * n, 5000 * n, 0.22 * n, (n, 2000 * n, 0.1 * n))}
        cell.attestation_after = {"part_clock": clock(4 * n + 4, 5000 * n + 5000, 0.22 * n + 0.22,
                                                      (n + 1, 2000 * n + 2000, 0.1 * n + 0.1))}
        cells.append(cell)
    kinds = headline.pass_kind_means(cells)
    assert kinds["prefill"]["routed"] == {"passes_total": 2, "tokens_total": 4000,
                                          "device_seconds_total": pytest.approx(0.2), "device_passes_total": 2}
    assert kinds["prefill"]["dense"]["passes_total"] == 6 and kinds["prefill"]["dense"]["tokens_total"] == 6000
    assert kinds["decode"]["routed"]["passes_total"] == 0
    table = headline.pass_kind_table("hybrid-tau", {headline.KNEE: {"pass_kinds": kinds}})
    assert "| 0.95 Q* | prefill | routed | 2 | 2000.0 | 100.00 | 50.0 |" in table
    assert "| 0.95 Q* | prefill | dense | 6 | 1000.0 | 40.00 | 40.0 |" in table
    assert not any("| decode |" in row for row in table)  # no pass of that phase ran
    old = _cell(HYBRID.name, suite, 4.0, 0.01, 1)
    old.attestation_before = old.attestation_after = {"part_clock": {"passes_total": {}}}
    assert headline.pass_kind_means([old]) is None
    assert headline.pass_kind_table("hybrid-tau", {headline.KNEE: {"pass_kinds": None}}) == []


def test_the_kernels_a_server_compiled_inside_a_cells_window_are_named_with_the_cell():
    """A cell's compilations are its two attestations' difference (`triton_compiles`), per kernel; a cell whose
    attestations do not count them has None, and the summary names only the cells that compiled."""
    suite = headline.gsm8k_suite("s", 2, 2, 500, (20, 40), (4, 12))

    def watch(n: int, seconds: float, kernels: dict, loads: dict | None = None) -> dict:
        return {"triton_compiles": {"watched": True, "compiles_total": n, "compile_seconds_total": seconds,
                                    "cache_loads_total": sum((loads or {}).values()), "compiles_by_kernel": kernels,
                                    "cache_loads_by_kernel": loads or {}, "recent": []}}

    cells = []
    for before, after in ((watch(30, 20.0, {"gemm": 30}), watch(34, 26.0, {"gemm": 30, "cohort_maps_kernel": 4})),
                          (watch(34, 26.0, {"gemm": 30}), watch(34, 26.0, {"gemm": 30})),
                          ({}, watch(1, 1.0, {"gemm": 1})),
                          (watch(34, 26.0, {"gemm": 30}, {"gemm": 2}), watch(34, 26.0, {"gemm": 30}, {"gemm": 5}))):
        cell = _cell(HYBRID.name, suite, 4.0, 0.01, 1)
        cell.attestation_before, cell.attestation_after = before, after
        cells.append(cell)
    got = [headline.window_compiles(c) for c in cells]
    assert got[0] == {"compiles": 4, "seconds": pytest.approx(6.0), "kernels": {"cohort_maps_kernel": 4},
                      "cache_loads": {}}
    assert got[1] == {"compiles": 0, "seconds": 0.0, "kernels": {}, "cache_loads": {}} and got[2] is None
    assert got[3]["cache_loads"] == {"gemm": 3}
    loads = {headline.KNEE: {"compiles": {"dense": [got[1], got[1]], "arm": got}}}
    assert headline.compile_lines("hybrid-tau", loads) == [
        "Triton kernels first launched inside a cell's window, built there (each held the passes behind it while "
        "it compiled) or loaded from Triton's cache (built on a machine whose cache lacks it): hybrid-tau at "
        "0.95 Q*, repetition 0: 4 built (6.00 s; cohort_maps_kernel x4); hybrid-tau at 0.95 Q*, repetition 3: 0 "
        "built, loaded from the cache: gemm x3.", ""]
    quiet = {headline.KNEE: {"compiles": {"dense": [got[1]], "arm": [got[1]]}}}  # nothing new in the windows
    assert headline.compile_lines("hybrid-tau", quiet) == [
        "No Triton kernel first launched inside any cell's window of hybrid-tau or dense.", ""]
    assert headline.compile_lines("hybrid-tau", {headline.KNEE: {"compiles": {"dense": [None], "arm": [None]}}}) == []


def _iv(mean, hw, n=3):
    return {"mean": mean, "half_width": hw, "low": None if hw is None else mean - hw,
            "high": None if hw is None else mean + hw, "n": n, "resolved": hw is not None and abs(mean) > hw}


def test_verdicts_need_an_interval_and_read_its_bounds():
    assert headline.beats(_iv(-45.0, 3.0), -36.8) == "met"
    assert headline.beats(_iv(-38.0, 3.0), -36.8) == "not resolved"
    assert headline.beats(_iv(-20.0, 3.0), -36.8) == "not met"
    assert headline.beats(_iv(-45.0, None, 1), -36.8) == "n = 1: no interval"
    assert headline.beats(None, -36.8) == "not measured"
    assert headline.not_worse(_iv(1.0, 2.0)) == "holds"
    assert headline.not_worse(_iv(9.0, 2.0)) == "fails: resolved increase beyond +5%, low +7.0%"
    assert headline.not_worse(_iv(1.75, 1.25)) == "holds"  # wholly above 0, within the margin: more repetitions
    assert headline.not_worse(_iv(5.0, 2.0)) == "not resolved: the interval reaches +7.0%"
    # a wide interval that is not wholly above 0 does not pass: lease-4's 0.75 Q* (+21.3 ± 24.2), and changes of
    # +45, +2 and +17 over three repetitions (+21.3 ± 54)
    assert headline.not_worse(_iv(21.3, 24.2)) == "not resolved: the interval reaches +45.5%"
    assert headline.not_worse(_iv(21.3, 54.0)) == "not resolved: the interval reaches +75.3%"
    assert headline.not_worse(_iv(2.0, 3.0)) == "holds"  # reaches +5.0%, the margin
    assert headline.not_worse(_iv(-1.0, None, 1)) == "n = 1: no interval"


def _doc(decode_share: float, loads=("below", "knee", "overload")) -> dict:
    cell = {"comparison": {"e2e_mean": _iv(-40.0, 2.0), "window_req_s": _iv(12.0, 1.0)},
            "routed_share": {"prefill": 0.4, "decode": decode_share}}
    return {"loads": dict.fromkeys(loads, cell)}


def test_figures_put_the_knee_beside_the_papers_and_check_never_worse_below_v_star():
    doc = {"arms": {"hybrid-rule": {"role": "hybrid", **_doc(0.0)}, "hybrid-tau": {"role": "hybrid", "skipped": "x"},
                    "always": {"role": "always", **_doc(1.0, ("knee",))},
                    "control": {"role": "control", **_doc(1.0, ("knee",))}}}
    rows = headline.figure_rows(doc)
    figures = [(r["arm"], r["figure"], r["limit"], r["verdict"]) for r in rows]
    below = "(below V*: no routed decode pass)"
    assert figures == [
        ("hybrid-rule", f"mean E2E change at 0.75 Q* {below}", "within +5% of dense", "holds"),
        ("hybrid-rule", "mean E2E change at 0.95 Q*", "below -36.8% (the paper's)", "met"),
        ("hybrid-rule", f"mean E2E change at 0.95 Q* {below}", "within +5% of dense", "holds"),
        ("hybrid-rule", f"mean E2E change at 1.25 Q* {below}", "within +5% of dense", "holds"),
        ("hybrid-rule", "request throughput in the injection window at 1.25 Q*", "none set", ""),
        ("hybrid-rule", "requests completed per second of the cell's makespan at 1.25 Q*", "none set", ""),
        ("always", "mean E2E change at 0.95 Q*", "none set", ""),
        ("control", "mean E2E change at 0.95 Q*", "none set", "")]
    assert rows[1]["paper_a100"] == (-36.8, 2.0) and rows[1]["paper_h100"] == (-39.4, 0.2)
    assert rows[4]["paper_a100"] == (11.3, 0.2) and rows[4]["paper_h100"] == (19.3, 3.4)
    lines = headline.figure_lines(rows)
    assert lines[3] == ("| hybrid-rule | mean E2E change at 0.95 Q* | -40.0 ± 2.0 (n = 3) | below -36.8% (the "
                        "paper's) | -36.8 ± 2.0 | -39.4 ± 0.2 | n/a | met |")
    assert ("| always | mean E2E change at 0.95 Q* | -40.0 ± 2.0 (n = 3) | none set | -46.5 (n = 1) | n/a | n/a |  |"
            in lines)
    routed = headline.figure_rows({"arms": {"hybrid-rule": {"role": "hybrid", **_doc(0.9)}}})
    assert [r["limit"] for r in routed] == ["none set", "below -36.8% (the paper's)", "none set", "none set",
                                            "none set"]


def test_a_figure_says_when_its_repetitions_compiled_and_when_its_window_measures_latency():
    """A Triton compile inside a compared repetition's window (either arm's) is named beside the verdict; a refused
    repetition's is not counted. The overload's in-window throughput says when the window is too short beside
    dense's mean E2E to measure throughput alone (lease-4: 12 s beside about 5 s); the makespan's rate stands
    beside it. The figures beside the intervals are over the compared repetitions: a refused repetition that
    routed decode does not make the arm look routed."""
    compile_ = {"compiles": 2, "seconds": 1.72, "kernels": {"gemm": 2}, "cache_loads": {}}
    cell = {"comparison": {"e2e_mean": _iv(-40.0, 2.0), "window_req_s": _iv(34.4, 308.5),
                           "makespan_req_s": _iv(-0.3, 6.0)},
            "routed_share": {"prefill": 0.4, "decode": 0.2}, "routed_share_compared": {"prefill": 0.4, "decode": 0.0},
            "gates": [{"passed": True}, {"passed": True}, {"passed": False}, {"passed": True}],
            "compiles": {"dense": [None, None, compile_, None], "arm": [compile_, None, None, None]},
            "dense": {"window_s": 12.0, "e2e_mean_s": 5.1}}
    doc = {"arms": {"hybrid-tau": {"role": "hybrid", "loads": {"knee": cell, "overload": cell}}}}
    rows = {r["figure"]: r["verdict"] for r in headline.figure_rows(doc)}
    note = "a Triton compile inside 1 of 3 repetitions' windows"
    assert rows["mean E2E change at 0.95 Q*"] == f"met; {note}"
    assert rows["mean E2E change at 0.95 Q* (below V*: no routed decode pass)"] == f"holds; {note}"
    assert rows["request throughput in the injection window at 1.25 Q*"] == (
        f"the window (12 s) is under 3x dense's mean E2E (5.1 s): its completions measure latency as much as "
        f"throughput; {note}")
    assert rows["requests completed per second of the cell's makespan at 1.25 Q*"] == note
    # beside each rate, its geometric mean change; where it differs in sign from the mean of % changes (lease-4's
    # in-window rate: +34.4 against -7.2), the verdict says neither reads as the cell's change
    geo = {"window_req_s": {"statistic": "geometric", "mean": -7.2, "half_width": None, "low": -94.4,
                            "high": 1445.1, "n": 3},
           "makespan_req_s": {"statistic": "geometric", "mean": -0.4, "half_width": None, "low": -5.9, "high": 5.4,
                              "n": 3}}
    both = headline.figure_rows({"arms": {"hybrid-tau": {"role": "hybrid",
                                                         "loads": {"overload": {**cell, "geometric": geo}}}}})
    window, makespan = (r for r in both if "Q*" in r["figure"] and "request" in r["figure"])
    assert window["verdict"] == (
        "the window (12 s) is under 3x dense's mean E2E (5.1 s): its completions measure latency as much as "
        "throughput; the mean of % changes (+34.4%) and the geometric mean (-7.2%) differ in sign: the repetitions' "
        f"ratios spread too widely to read either; {note}")
    assert makespan["verdict"] == note  # -0.3 and -0.4 agree
    lines = headline.figure_lines(both)
    assert "| +34.4 ± 308.5 (n = 3); geometric -7.2 [-94.4, +1445.1] (n = 3) | none set |" in lines[-2]
    assert "| -0.3 ± 6.0 (n = 3); geometric -0.4 [-5.9, +5.4] (n = 3) | none set |" in lines[-1]
    # a cell without geometric changes (older documents) reads as before
    assert not any("geometric" in line for line in headline.figure_lines(headline.figure_rows(doc)))
    assert headline.statistics_disagree(_iv(2.0, 1.0), {"mean": 0.0}) == ""
    # a window in which the arm completed nothing has no geometric change: the row says why
    empty = {**cell, "geometric": {}, "not_compared": {"window_req_s (geometric)": "the arm's is 0 in repetitions [0]"}}
    rows = {r["figure"]: r["verdict"] for r in headline.figure_rows(
        {"arms": {"hybrid-tau": {"role": "hybrid", "loads": {"overload": empty}}}})}
    assert "no geometric change: the arm's is 0 in repetitions [0]" in rows[
        "request throughput in the injection window at 1.25 Q*"]
    assert "geometric" not in rows["requests completed per second of the cell's makespan at 1.25 Q*"]
    # p99's reach, from the loads' request counts
    assert headline.p99_reach({"arms": {"a": {"loads": {"knee": {"requests": 153}, "overload": {"requests": 255}}},
                                        "b": {"skipped": "x"}}}) == [
        "A cell's p99 is taken over its own 153-255 requests (within its 3 largest values), the paper's over its "
        "GSM8K cell of 3,600: the same name, not the same reach into the tail."]
    assert headline.p99_reach({"arms": {}}) == []
    quiet = {**cell, "compiles": {"dense": [None] * 4, "arm": [None, None, compile_, None]}}  # the refused one
    assert headline.compiled_in(quiet) == ""
    refused = {**cell, "gates": [{"passed": False}] * 4}  # none compared: every repetition run counts
    assert headline.compiled_in(refused) == "a Triton compile inside 2 of 4 repetitions' windows"
    assert headline.compiled_in({**cell, "compiles": {"dense": [None], "arm": []}}) == ""  # fewer readings
    always = {"arms": {"always": {"role": "always", "loads": {"knee": cell}}}}
    assert headline.figure_rows(always)[0]["verdict"] == note


def test_figures_stand_beside_the_skips_limit_and_say_when_a_goal_or_a_result_lies_beyond_it():
    """The skip's limit (`skip_limit`) per load (made-up figures here): a measured change whose whole interval lies
    beyond the limit is a question, not a win (by its mean alone where it has no interval); a knee whose limit is
    short of the paper's -36.8% says its goal lies beyond it; the control has no limit."""
    limit = {"skip": 0.5, "arm": "random-r1-d0.5-always",
             "loads": {load: {"e2e_mean": e, "ttft_mean": e - 5, "tpot_mean": e + 1}
                       for load, e in (("below", -20.0), ("knee", -30.0), ("overload", -45.0))}}
    doc = {"arms": {"hybrid-tau": {"role": "hybrid", **_doc(0.9)},
                    "control": {"role": "control", **_doc(1.0, ("knee",))}}, "skip_limit": limit}
    rows = {(r["arm"], r["figure"]): r for r in headline.figure_rows(doc)}
    knee = rows["hybrid-tau", "mean E2E change at 0.95 Q*"]  # -40.0 ± 2.0
    assert knee["skip_limit"] == -30.0
    assert knee["verdict"] == "met, but beyond the skip's limit (-30.0%): a question, not a win"
    below = rows["hybrid-tau", "mean E2E change at 0.75 Q*"]
    assert below["verdict"] == "beyond the skip's limit (-20.0%): a question, not a win"
    assert rows["hybrid-tau", "mean E2E change at 1.25 Q*"]["verdict"] == ""  # within a -45% limit
    assert rows["control", "mean E2E change at 0.95 Q*"]["skip_limit"] is None
    assert "| -30.0% | met, but beyond" in "\n".join(headline.figure_lines(list(rows.values())))
    slower = {"arms": {"hybrid-tau": {"role": "hybrid", "loads": {"knee": {
        "comparison": {"e2e_mean": _iv(-10.0, 2.0)}, "routed_share": {"prefill": 0.4, "decode": 0.9}}}}},
        "skip_limit": limit}
    assert headline.figure_rows(slower)[0]["verdict"] == "not met (the goal lies beyond the skip's limit, -30.0%)"
    once = {"arms": {"hybrid-tau": {"role": "hybrid", "loads": {"knee": {
        "comparison": {"e2e_mean": _iv(-35.0, None, 1)}, "routed_share": {"prefill": 0.4, "decode": 0.9}}}}},
        "skip_limit": limit}
    assert headline.figure_rows(once)[0]["verdict"] == ("n = 1: no interval, but beyond the skip's limit (-30.0%, "
                                                         "by its mean alone): a question, not a win")
    text = headline.skip_limit_lines(limit)
    assert "random-r1-d0.5-always (s = 0.5 at every routed layer, every pass routed)" in text[0]
    assert "| 0.95 Q* | -30.0% | -35.0% | -29.0% |" in text
    assert headline.skip_limit_lines(None) == []


def test_an_older_headline_document_renders_without_the_limit():
    """lease-4's headline.json predates the skip's limit, the model's dense E2E and its prefill source: the summary
    renders it with none of them (`run.py summary` re-renders a folder's documents)."""
    doc = json.loads((H200_RESULTS / "lease-4" / "headline.json").read_text())
    ladder = json.loads((H200_RESULTS / "lease-4" / "ladder.json").read_text())
    text = "\n".join(headline.headline_lines(ladder, doc))
    assert "| hybrid-tau | mean E2E change at 0.95 Q* | +34.2 ± 85.6 (n = 3) |" in text
    assert "The skip's limit" not in text and "The model's dense mean E2E" not in text

def test_summary_section_says_which_thresholds_served_and_what_cannot_route():
    ladder = {"shape": {"prompt_tokens": {"min": 700, "max": 1100, "mean": 901.2},
                        "output_tokens": {"min": 58, "max": 174, "mean": 115.6}},
              "q_star": {"q_star": 14, "rates": [11, 12, 13, 14, 15, 16], "tok_s_at_q_star": 1226.0,
                         "plateau_reached": True}, "left": []}
    hybrid = {"role": "hybrid", "thresholds": {"source": "roofline:H100-SXM"}, "kv_pool_tokens": 420_000,
              "resident_ceiling_tokens": 326_144, "table": "### table", **_doc(0.0),
              "served": {"thresholds": {"enter_tokens": 340_000, "exit_tokens": 270_000,
                                        "source": "roofline:H100-SXM"}}}
    doc = {"arms": {"hybrid-rule": hybrid, "hybrid-tau": {"role": "hybrid", "skipped": "the sweep stage has not "
                                                                                      "run: no measured tau"}},
           "left": ["always: 3 cells"]}
    doc["figures"] = headline.figure_rows(doc)  # as the stage stores them
    text = "\n".join(headline.headline_lines(ladder, doc))
    assert "prompts of 700-1100 tokens (mean 901), forced outputs of 58-174 tokens (mean 116" in text
    assert "Q* = 14 req/s (1226 tok/s; plateau reached: yes); the paper's: 13 on the A100, 14 on the H100" in text
    assert ("- hybrid-rule: enter 340000 / exit 270000 resident KV tokens served (attested source: roofline:H100-SXM;"
            " from roofline:H100-SXM); KV pool 420000 tokens, at most 326144 resident in these cells (below the enter"
            " threshold: decode cannot route)") in text
    assert "- hybrid-tau: not served: the sweep stage has not run: no measured tau" in text
    assert "Routed share of hybrid-rule's passes in the repetitions compared: 0.75 Q*: prefill 40%, decode 0%; " \
           "0.95 Q*" in text
    # the share of the repetitions compared, where a refused one routed decode (the figures' below-V* rows agree)
    hybrid["loads"] = {load: {**c, "routed_share": {"prefill": 0.4, "decode": 0.1}} for load, c in
                       hybrid["loads"].items()}
    hybrid["loads"]["below"] = {**hybrid["loads"]["below"], "routed_share_compared": {"prefill": 0.4, "decode": 0.0}}
    doc["figures"] = headline.figure_rows(doc)
    text = "\n".join(headline.headline_lines(ladder, doc))
    assert "passes in the repetitions compared: 0.75 Q*: prefill 40%, decode 0%; 0.95 Q*: prefill 40%, decode 10%" \
        in text
    assert "mean E2E change at 0.75 Q* (below V*: no routed decode pass)" in text
    assert "| H100 | 0.95 Q* | 3 | -39.4 ± 0.2 | -34.2 ± 9.6 |" in text
    assert "Headline stage left for the next run: always: 3 cells" in text
    assert headline.headline_lines(None, None) == []


def test_device_plan_fits_the_headline_in_one_sessions_device_time():
    """The arithmetic behind the stage sizes: five server starts, the ladder, 33 cells (dense, the hybrid arm twice
    over three loads and three repetitions, always-route and the control at the knee), all under 30 minutes with
    the sweep and the kernels beside them (H100 timings: sweep 240 s, kernels 180 s, a start 45-90 s)."""
    plan = Plan.gpu()
    assert plan.repetitions >= 3 and plan.prompt_tokens == (700, 1100) and plan.output_tokens == (58, 174)
    assert sum(plan.output_tokens) / 2 == headline.PAPER_OUTPUT_TOKENS
    cells = 3 * 3 * 3 + 2 * plan.repetitions
    per_cell = plan.window_s * 1.3 + plan.cell_overhead_s  # a drain of about a third of the window at overload
    ladder = plan.ladder_max_rates // 2 * (plan.ladder_window_s * 1.2 + plan.cell_overhead_s)
    total = 5 * 90 + ladder + cells * per_cell + 240 + 180 + 30
    assert total < 30 * 60, total
    dry = Plan.dry()
    assert dry.repetitions == 1 and dry.engagement_optional and not plan.engagement_optional
