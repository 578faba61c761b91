"""The continuous-batching simulator: exact on a hand-computed timeline, the queueing amplification near the
knee, and the foundation's switch deciding the modes."""

import json

import numpy as np
import pytest

from loadgen.cli import main as cli_main
from loadgen.simulate import SimConfig, StepLine, predict, simulate
from vskipper.arms import ARMS, get_arm

DENSE = StepLine(0.010, 0.00005, 2e-7)
ROUTED = StepLine(0.010, 0.000045, 1.8e-7)  # 10% cheaper per row and per resident token
PREFILL_D = StepLine(0.005, 0.00004)
PREFILL_R = StepLine(0.005, 0.000036)


def config(**kw):
    return SimConfig(DENSE, ROUTED, PREFILL_D, PREFILL_R, enter_tokens=kw.pop("enter", 0),
                     exit_tokens=kw.pop("exit", 0), max_running=kw.pop("max_running", 64), **kw)


def workload(n=400, seed=0):
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(600, 1000, n)], [int(x) for x in rng.integers(50, 150, n)]


def test_single_request_timeline_is_the_sum_of_its_pass_lines():
    records, counters = simulate([0.5], [100], [3], config(), ARMS["dense"].switch_settings())
    (r,) = records
    prefill = 0.005 + 0.00004 * 100
    step1 = 0.010 + 0.00005 + 2e-7 * 101
    step2 = 0.010 + 0.00005 + 2e-7 * 102
    assert r.first_token_s == pytest.approx(0.5 + prefill)
    assert r.token_times_s == pytest.approx([0.5 + prefill, 0.5 + prefill + step1, 0.5 + prefill + step1 + step2])
    assert r.ttft_s == pytest.approx(prefill) and r.output_tokens == 3
    assert counters["passes_total"] == {"prefill": {"dense": 1, "routed": 0}, "decode": {"dense": 2, "routed": 0}}


def test_small_per_step_savings_become_large_latency_gains_near_the_knee():
    prompts, outputs = workload()
    preds = {p.rate: p.change_pct for p in predict(prompts, outputs, [4, 14, 24], config(),
                                                   get_arm("always-route").switch_settings())}
    # far below the knee the gain is the per-step saving diluted by fixed costs: a few percent
    assert -6 < preds[4]["e2e_mean"] < 0
    # at the knee the same 10% per-step saving removes most of the queue: TTFT falls by far more than 10%
    assert preds[14]["ttft_mean"] < -30
    assert preds[14]["e2e_mean"] < 3 * preds[4]["e2e_mean"]
    # in overload both arms queue; the gain shrinks from its peak at the knee
    assert preds[24]["ttft_mean"] > preds[14]["ttft_mean"]


def test_a_prefill_floor_routes_only_rounds_from_it():
    """The served floor in place of the constants' 1,536: rounds of one prompt of 600-1,000 tokens route with a floor
    of 500 and never with one of 2,000."""
    prompts, outputs = workload(60)
    prefill_only = get_arm("prefill-only").switch_settings()
    (low,) = predict(prompts, outputs, [1], config(prefill_floor_tokens=500), prefill_only)
    (high,) = predict(prompts, outputs, [1], config(prefill_floor_tokens=2000), prefill_only)
    assert low.treated["passes_total"]["prefill"]["dense"] == 0 < low.treated["passes_total"]["prefill"]["routed"]
    assert high.treated["passes_total"]["prefill"]["routed"] == 0


def test_hybrid_arm_routes_decode_only_above_the_enter_threshold():
    prompts, outputs = workload(200)
    hybrid = get_arm("hybrid").switch_settings()
    low, high = predict(prompts, outputs, [2, 14], config(enter=40_000, exit=30_000), hybrid)
    assert low.treated["passes_total"]["decode"]["routed"] == 0
    assert high.treated["passes_total"]["decode"]["routed"] > 0
    assert low.baseline["passes_total"]["decode"]["routed"] == 0 == high.baseline["passes_total"]["prefill"]["routed"]


def test_step_line_and_config_errors_name_the_field():
    with pytest.raises(ValueError, match="--decode-dense: expected"):
        StepLine.parse("0.01", "--decode-dense")
    with pytest.raises(ValueError, match="per_row_s must be >= 0"):
        StepLine(0.01, -1.0)
    with pytest.raises(ValueError, match="output length must be >= 1"):
        simulate([0.0], [10], [0], config(), ARMS["dense"].switch_settings())


def test_simulate_cli_derives_thresholds_from_the_roofline_and_writes_predictions(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = cli_main(["simulate", "--rates", "4,14", "--requests", "120", "--arm", "hybrid", "--device",
                   "A100-SXM4-80GB", "--decode-dense", "0.01,0.00005,2e-7", "--decode-routed",
                   "0.01,0.000045,1.8e-7", "--prefill-dense", "0.005,0.00004", "--prefill-routed",
                   "0.005,0.000036", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert (data["exit_tokens"], data["enter_tokens"]) == (160_000, 200_000)  # the paper's A100 thresholds
    assert [p["rate"] for p in data["predictions"]] == [4.0, 14.0]
    assert "e2e_mean" in capsys.readouterr().out
