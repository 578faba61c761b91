"""The headline A/B of the device run on GSM8K-shaped load: what it computes without a server.

The `ladder` and `headline` stages of `benchmarks/gpu/run.py` serve one arm at a time with the whole device: dense
first (upstream's Q* ladder, then its side of every cell), then each routed arm on the same cells. Since no two arms
run side by side, a pair is the same cell served to each arm in turn: the same suite (the same prompts and forced
output lengths), the same seeded arrival schedule and rate, the prefix cache flushed before each cell. This module
holds the arithmetic: the suite's shape, the ladder's next rate, the schedule of cells, the thresholds from a
measured tau, the pairing of cells into loadgen's A/B results (its gates and paired intervals), and the figures
beside their limits and the paper's.

The paper's GSM8K workload: 5-shot prompts with the chat template, upstream's mean output of 116 tokens at its knee,
3,600 requests a cell, Q* = 13 req/s on the A100 (ladder 8-18) and 14 on the H100 (12-22). It gives no prompt
length: its suites leave 6,171-7,988 tokens of the 8,192-token context, so their prompts hold 204-2,021 tokens,
and GSM8K's prefix-cache hit share is 1.7%: each prompt is its own. Random weights (`--load-format dummy`) never
stop on their own, so the output lengths come from the suite and every lane forces them (`ignore_eos`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from loadgen.attestation import PHASES, Attestation, AttestationError, answered, pass_delta
from loadgen.experiment import ABResult, Repetition
from loadgen.gates import gate_pair
from loadgen.qstar import CELL_FACTORS, cell_rates, find_q_star
from loadgen.records import CellResult
from loadgen.suite import Suite, SuiteRequest
from vskipper.arms import Arm
from vskipper.constants import CONSTANTS
from vskipper.roofline import rounded_thresholds

LOADS = tuple(CELL_FACTORS)  # below (0.75 Q*), knee (0.95 Q*), overload (1.25 Q*)
KNEE = "knee"
OVERLOAD = "overload"
BASELINE = "dense"
OWN_LADDER = "this run's ladder"  # a ladder's `q_star_from` where it climbed itself (`run.py --earlier` otherwise)
# The order the cells are served in: the knee (the paper's headline figure) first, then overload (its throughput
# figure), then below the knee.
SERVE_ORDER = (KNEE, OVERLOAD, "below")
LADDER_START_FACTOR = 0.75  # the ladder's first rate, as a share of the calibration burst's request rate

# The paper's GSM8K figures, FlexiDepth on Llama-3-8B against upstream SGLang: mean % change with its 95% half-width
# over paired repetitions (E2E, TPOT, TTFT mean and p99, makespan) per load, request throughput in the injection
# window at 1.25 Q*, and always-route's mean E2E change at the knee (the ablation, n = 1).
PAPER = {
    "A100": {"n": 6, "q_star": 13, "window_req_s": (11.3, 0.2), "always_e2e_knee": -46.5, "loads": {
        "below": {"e2e_mean": (-6.6, 1.5), "e2e_p99": (-9.7, 2.8), "tpot_mean": (-6.8, 1.6), "tpot_p99": (-10.0, 3.7),
                  "ttft_mean": (-7.1, 1.2), "ttft_p99": (-4.4, 4.8), "makespan_s": (-0.5, 0.1)},
        "knee": {"e2e_mean": (-36.8, 2.0), "e2e_p99": (-37.3, 2.5), "tpot_mean": (-35.6, 1.8), "tpot_p99": (-15.3, 3.8),
                 "ttft_mean": (-66.0, 6.8), "ttft_p99": (-74.5, 3.0), "makespan_s": (-1.4, 0.1)},
        "overload": {"e2e_mean": (-25.7, 0.7), "e2e_p99": (-21.2, 0.6), "tpot_mean": (-10.5, 0.2),
                     "tpot_p99": (-18.9, 1.7), "ttft_mean": (-41.5, 1.1), "ttft_p99": (-40.7, 0.9),
                     "makespan_s": (-7.2, 0.2)}}},
    "H100": {"n": 3, "q_star": 14, "window_req_s": (19.3, 3.4), "loads": {
        "below": {"e2e_mean": (-6.0, 3.2), "e2e_p99": (-8.8, 5.2), "tpot_mean": (-6.3, 3.5), "tpot_p99": (-9.8, 9.1),
                  "ttft_mean": (-5.2, 0.2), "ttft_p99": (-9.8, 6.4), "makespan_s": (-0.5, 0.3)},
        "knee": {"e2e_mean": (-39.4, 0.2), "e2e_p99": (-34.2, 9.6), "tpot_mean": (-31.4, 7.6), "tpot_p99": (-11.5, 7.9),
                 "ttft_mean": (-91.7, 4.8), "ttft_p99": (-93.0, 2.2), "makespan_s": (-2.3, 2.2)},
        "overload": {"e2e_mean": (-35.8, 3.4), "e2e_p99": (-32.1, 3.0), "tpot_mean": (-15.7, 1.5),
                     "tpot_p99": (-24.4, 9.3), "ttft_mean": (-51.8, 3.8), "ttft_p99": (-50.8, 2.4),
                     "makespan_s": (-9.8, 1.1)}}},
}
PAPER_KNEE_E2E = PAPER["A100"]["loads"][KNEE]["e2e_mean"][0]  # the figure to beat: -36.8% mean E2E at the knee
# "never worse than dense beyond noise" made a number: a hybrid arm below V* serves dense passes, and an increase of
# its mean E2E below this is the noise the goal allows; the goal holds where the whole 95% interval lies below it
NOT_WORSE_MARGIN_PCT = 5.0
# the injection window over the dense arm's mean E2E below which the window's completions measure latency as much
# as throughput (requests submitted in its last E2E cannot finish inside it)
WINDOW_OVER_E2E = 3.0
PAPER_OUTPUT_TOKENS = 116
TABLE_METRICS = ("e2e_mean", "e2e_p99", "tpot_mean", "tpot_p99", "ttft_mean", "ttft_p99", "makespan_s")


# -- the suite -------------------------------------------------------------------------------------------------------

def gsm8k_suite(name: str, requests: int, seed: int, vocab: int, prompt_tokens: tuple[int, int],
                output_tokens: tuple[int, int]) -> Suite:
    """`requests` token-id prompts of GSM8K's shape: prompt and forced output lengths drawn uniformly from the
    (inclusive) ranges, random token ids (the weights are random too); the same arguments give the same suite."""
    for field_name, (lo, hi) in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{field_name}: need 1 <= low <= high, got ({lo}, {hi})")
    if requests < 1:
        raise ValueError(f"requests: need at least 1, got {requests}")
    rng = random.Random(seed)
    out = []
    for i in range(requests):
        length = rng.randint(*prompt_tokens)
        ids = tuple(rng.randrange(10, vocab - 10) for _ in range(length))
        out.append(SuiteRequest(f"{name}:{i}", ids, scored=False, max_new_tokens=rng.randint(*output_tokens)))
    return Suite(name, tuple(out))


def forced_lengths(suite: Suite) -> dict[str, int]:
    """The output length each request is served with (`ignore_eos`): the suite's own."""
    missing = [r.id for r in suite.requests if r.max_new_tokens is None]
    if missing:
        raise ValueError(f"suite {suite.name!r}: request {missing[0]!r} has no max_new_tokens")
    return {r.id: r.max_new_tokens for r in suite.requests}


def suite_shape(suite: Suite) -> dict:
    prompts = [r.prompt_tokens for r in suite.requests]
    outputs = [r.max_new_tokens for r in suite.requests]
    return {"requests": len(suite), "digest": suite.digest,
            "prompt_tokens": {"min": min(prompts), "max": max(prompts), "mean": sum(prompts) / len(prompts)},
            "output_tokens": {"min": min(outputs), "max": max(outputs), "mean": sum(outputs) / len(outputs)}}


# -- upstream's Q* ladder --------------------------------------------------------------------------------------------

def cell_requests(rate: float, window_s: float, min_requests: int) -> int:
    """Requests of a cell declared over about `window_s` seconds at `rate` (its duration is requests / rate)."""
    return max(min_requests, round(rate * window_s))


def ladder_start(estimate_req_s: float, at_most: int | None = None) -> int:
    """The ladder's first rate: below the request rate a closed burst sustained, so the ladder climbs to its knee;
    no higher than `at_most` where given (a plan whose burst is too short to measure a rate the server sustains)."""
    if not estimate_req_s > 0:
        raise ValueError(f"estimate_req_s: must be > 0, got {estimate_req_s!r}")
    if at_most is not None and at_most < 1:
        raise ValueError(f"at_most: must be >= 1 req/s, got {at_most!r}")
    start = max(1, math.floor(LADDER_START_FACTOR * estimate_req_s))
    return start if at_most is None else min(start, at_most)


def next_ladder_rate(tok_s: Mapping[int, float], start: int, max_rates: int) -> int | None:
    """The next integer rate the ladder runs, or None when it is done: climb by one from `start` until the Q* rule
    sees two rates past its Q* that no longer grow; step down below `start` while no rate counts as growth (the
    ladder began at or past the knee); stop at `max_rates` rates whatever the rule says (the result then tells)."""
    if not tok_s:
        return start
    rates = sorted(tok_s)
    if len(rates) >= max_rates:
        return None
    if len(rates) < 3:  # the rule judges a rate by its successor: nothing counts before three rates
        return rates[-1] + 1
    q = find_q_star(tok_s)
    if q.q_star == rates[0] and rates[0] > 1:
        return rates[0] - 1
    if q.plateau_reached and q.q_star <= rates[-1] - 2:
        return None
    return rates[-1] + 1


# -- the cells -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    """One (load, repetition) cell: every arm serves it with the same suite, rate and arrival seed."""

    load: str
    repetition: int
    rate: float
    requests: int
    seed: int  # the arrival schedule's

    @property
    def key(self) -> str:
        return f"{self.load}-rep{self.repetition}"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> Cell:
        return cls(d["load"], d["repetition"], d["rate"], d["requests"], d["seed"])


def schedule(q_star: int, window_s: float, min_requests: int, repetitions: int) -> list[Cell]:
    """The headline cells: 0.75 / 0.95 / 1.25 x Q* (loadgen's cell rates), `repetitions` each, load-major in the
    order they are served (`SERVE_ORDER`: a run stopped by its time keeps the knee); a load's repetitions share its
    suite and differ in their arrival seeds."""
    if repetitions < 1:
        raise ValueError(f"repetitions: need at least 1, got {repetitions}")
    if q_star < 1:
        raise ValueError(f"q_star: must be a positive rate, got {q_star!r}")
    rates = cell_rates(q_star)
    return [Cell(load, rep, rates[load], cell_requests(rates[load], window_s, min_requests),
                 100 * (LOADS.index(load) + 1) + rep) for load in SERVE_ORDER for rep in range(repetitions)]


def load_suite(load: str, requests: int, vocab: int, prompt_tokens: Sequence[int],
               output_tokens: Sequence[int]) -> Suite:
    """A load's GSM8K-shaped suite of the ladder, drawn from the load's seed (`suite_seed`)."""
    return gsm8k_suite(f"gsm8k-shaped-{load}", requests, suite_seed(load), vocab, tuple(prompt_tokens),
                       tuple(output_tokens))


def max_running(sglang_flags: Sequence[str]) -> int | None:
    """The `--max-running-requests` among a server's SGLang flags, or None."""
    flags = list(sglang_flags)
    return int(flags[flags.index("--max-running-requests") + 1]) if "--max-running-requests" in flags else None


def suite_seed(load: str) -> int:
    return 1000 + LOADS.index(load)


def prefill_floor(speedups: Sequence[Mapping] | None) -> dict | None:
    """The device's prefill floor from the sweep's prefill lengths and rounds (`run.py`'s `prefill_speedup` and
    `prefill_round_speedup`: dense's time to the first token of one prompt, or of a round of several (`prompts`),
    over the always-route arm's, with its range over every pairing of the two arms' repetitions): the shortest
    measured length from which routed prefill gains beyond that spread (the range's low end over 1) at it and at
    every longer length, single prompts and rounds alike. A served round's floor counts its prompts' tokens
    together, so a round of several prompts that loses where one prompt of their length gains holds the floor above
    their length. Where even the longest gains nothing beyond its spread, the floor is past it: no measured length
    is routed. {prefill_floor_tokens, prefill_floor_source}, or None where the sweep measured no prefill."""
    rows = sorted((r for r in speedups or () if r.get("range")), key=lambda r: r["tokens"])
    if not rows:
        return None
    floor = None
    for row in reversed(rows):
        if row["range"][0] <= 1.0:
            break
        floor = row
    if floor is None:
        longest = rows[-1]
        return {"prefill_floor_tokens": longest["tokens"] + 1,
                "prefill_floor_source": f"routed prefill gained beyond its spread at no measured length (the longest, "
                                        f"{longest['tokens']} tokens: dense / routed time {_span(longest)}): the "
                                        f"floor is past it"}
    return {"prefill_floor_tokens": floor["tokens"],
            "prefill_floor_source": f"the shortest measured length from which routed prefill gains beyond its spread "
                                    f"(dense / routed time {_span(floor)} at {floor['tokens']} tokens)"}


def _span(row: Mapping) -> str:
    rounds = f" in a round of {row['prompts']} prompts" if row.get("prompts") else ""
    return f"{row['dense_over_routed_time']:.3f}, {row['range'][0]:.3f}-{row['range'][1]:.3f}{rounds}"


def thresholds_from_tau(rule: Mapping, sweep: Mapping | None, step: int) -> tuple[dict | None, str]:
    """The hybrid arm's thresholds with the sweep's measured tau in the rule, V* scaling with tau (the device, skip
    ratio, routed layers and KV width unchanged), and the sweep's measured prefill floor (`prefill_floor`): (thresholds,
    where they come from), or (None, why there are none).

    The tau served is the upper end of its 95% interval where the sweep resampled one (`tau_ms_interval`): the arm
    routes where the routed step is faster than dense's beyond the sweep's noise. At the point estimate the H200's
    tau (-0.046 ms, 95% [-0.37, 0.21]) gave V* = 0, and that arm routed 91-99% of its decode passes at 0.75 Q*,
    where they cost 9.9-10.0 ms against dense's 9.5-9.7 (lease-4). A tau at or below zero leaves the rule no fixed
    cost to cover: V* is zero, and the arm serves at the least thresholds the step expresses (exit one step, a served
    exit being positive, and enter one above it), routing at nearly every load."""
    if sweep is None:
        return None, "the sweep stage has not run: no measured tau"
    comparison = sweep.get("comparison") or {}
    point = comparison.get("tau_ms")
    if point is None:
        return None, "the sweep measured no tau (it needs the dense and always-route latency lines)"
    interval = comparison.get("tau_ms_interval")
    tau = interval[1] if interval else point
    which = f"measured tau {point:.3g} ms" + (f", 95% [{interval[0]:.3g}, {interval[1]:.3g}], served at its upper "
                                              "end" if interval else "")
    floor = comparison.get("prefill_floor") or prefill_floor(comparison.get("prefill_speedup")) or {}
    if not tau > 0:
        exit_, enter = rounded_thresholds(0.0, step, CONSTANTS.enter_factor, least=step)
        v_star, source = 0.0, f"{which} <= 0 (sweep): no fixed cost for the rule to cover, V* = 0, the least thresholds"
    else:
        v_star = rule["v_star_tokens"] * tau / rule["tau_ms"]
        exit_, enter = rounded_thresholds(v_star, step, CONSTANTS.enter_factor, least=step)  # a served exit is > 0
        source = f"{which} (sweep; the rule's is {rule['tau_ms']:.3g} ms)"
        if (enter, exit_) == (rule["enter_tokens"], rule["exit_tokens"]) and not floor:
            return None, (f"the measured tau ({tau:.3g} ms) gives the rule's thresholds (enter {enter} / exit "
                          f"{exit_}) and the sweep measured no prefill floor: the rule's arm serves them")
    return {"enter_tokens": enter, "exit_tokens": exit_, "v_star_tokens": v_star, "tau_ms": tau,
            **({"tau_ms_interval": list(interval)} if interval else {}), **floor, "source": source}, source


# -- what the queueing model predicts from the sweep's lines ----------------------------------------------------------

MODEL_METRICS = ("e2e_mean", "ttft_mean", "tpot_mean")


PREFILL_FROM = {"forward": "the forward of each prompt (SGLang's stamps: the pass in the scheduler)",
                "ttft": "each prompt's time to its first token (the client's: the HTTP, the hand-over to the "
                        "scheduler and the output ride on it)"}


def prefill_source(arms: Sequence[Mapping]) -> str:
    """`PREFILL_FROM`'s key for lines fitted over these sweep arms: "forward" where every prefill length of every
    arm has its forward part, else "ttft"."""
    cells = [p for arm in arms for p in arm.get("prefill") or []]
    return "forward" if cells and all((p.get("ttft_parts_s") or {}).get("forward") for p in cells) else "ttft"


def model_lines(dense: Mapping, routed: Mapping, source: str | None = None) -> dict | None:
    """The queueing model's per-pass lines (`loadgen.simulate.StepLine`) from two of the sweep's arms, dense and
    always-route: decode, each arm's latency line of a step over the resident tokens (its intercept, its slope a
    resident token); prefill, the least-squares line of one prompt's pass over its tokens. The pass is the forward
    part of its time to the first token (`ttft_parts_s`: what the scheduler spends on it) where both arms' every
    length has it; otherwise the whole time to the first token, whose HTTP, hand-over and output the model then
    charges to the pass, though a server overlaps them with other passes (on the H200, 7.5 ms a pass: the model's
    dense queued more than the served cells). `prefill_from` names which (`PREFILL_FROM`). None where either arm
    lacks a decode line or two prefill lengths. `source` sets the part where lines of several pairs must agree
    (`prefill_source` over all their arms)."""
    import statistics

    from loadgen.simulate import StepLine

    source = source or prefill_source((dense, routed))
    if source not in PREFILL_FROM:
        raise ValueError(f"prefill lines from {source!r}: expected one of {', '.join(PREFILL_FROM)}")
    lines: dict = {"prefill_from": source}
    for side, arm in (("dense", dense), ("routed", routed)):
        decode = arm.get("line")
        prefill = [(p["tokens"], p["ttft_parts_s"]["forward"] if source == "forward" else p["ttft_s"])
                   for p in arm.get("prefill") or []]
        if not decode or len(prefill) < 2:
            return None
        slope, intercept = statistics.linear_regression(*zip(*prefill, strict=True))
        lines[f"decode_{side}"] = StepLine(max(0.0, decode["intercept_s"]), 0.0, max(0.0, decode["slope_s_per_token"]))
        lines[f"prefill_{side}"] = StepLine(max(0.0, intercept), max(0.0, slope))
    return lines


def limit_lines(lines: Mapping, config: Mapping, skip: float, lengths: Sequence[int],
                bandwidth_gbps: float | None = None) -> dict:
    """`model_lines` with the routed lines at the skip's physical limit: what a routed pass would cost if it saved
    all that a share `skip` of the routed layers' rows Project-Only allows, and paid nothing else for routing.

    Decode is bound by the bytes a step reads (`vskipper.modelspec.decode_bytes`): dense's intercept and the
    adapter's weights read at the device's bandwidth (`bandwidth_gbps`; where it is not known, the adapter is not
    charged, which leaves the limit a bound still), its slope a resident token as the KV read (Project-Only rows
    read none at the routed layers). Prefill is bound by its work (`vskipper.modelspec.flop_limit`, a
    Project-Only row paying its K/V and the projector only): at each of `lengths` (the sweep's prompt lengths)
    dense's line with its part per token divided by the FLOP limit there, its intercept as it is (what a pass costs
    beyond its work), and the least-squares line over them. Dense's lines are the sweep's, so the model's dense against these is the most
    this skip could change the served load, not a measurement. A bound within the sweep's noise: a routed line
    measured below it (as the H200's decode intercept, 0.12 ms under, inside tau's 95% interval) is noise or a
    cost dense's line carries that routing does not."""
    import statistics

    from loadgen.simulate import StepLine
    from vskipper.modelspec import decode_bytes, flop_limit

    decode, prefill = lines["decode_dense"], lines["prefill_dense"]
    adapter_s = adapter_read_s(config, skip, bandwidth_gbps)
    kv = (decode_bytes(config, 1, skip) - decode_bytes(config, 0, skip)) / (
        decode_bytes(config, 1, 0.0) - decode_bytes(config, 0, 0.0))
    points = [(t, prefill.intercept_s + prefill.per_row_s * t / flop_limit(config, t, 1, skip)) for t in lengths]
    if len({t for t, _ in points}) < 2:
        raise ValueError(f"the prefill limit's line needs two prompt lengths, got {list(lengths)}")
    slope, intercept = statistics.linear_regression(*zip(*points, strict=True))
    return {**lines, "decode_routed": StepLine(decode.intercept_s + adapter_s, 0.0, decode.per_resident_token_s * kv),
            "prefill_routed": StepLine(max(0.0, intercept), max(0.0, slope))}


def adapter_read_s(config: Mapping, skip: float, bandwidth_gbps: float | None) -> float:
    """Seconds a decode step at `skip` spends reading the adapter's weights at `bandwidth_gbps` (0 where it is not
    known)."""
    from vskipper.modelspec import DTYPE_BYTES, decode_bytes

    if not bandwidth_gbps:
        return 0.0
    dtype_bytes = DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2)
    return (decode_bytes(config, 0, skip, dtype_bytes) - decode_bytes(config, 0, 0.0, dtype_bytes)) / (
        bandwidth_gbps * 1e9)


def model_prediction(lines: Mapping, arm: Arm, thresholds: Mapping, suite: Suite, cells: Sequence[Cell],
                     kv_pool_tokens: int | None, max_running: int | None) -> dict:
    """What the queueing model (`loadgen.simulate`: one server, continuous batching, each pass costing its line)
    predicts for `arm` against dense on one load's cells: the same suite, rate and seeded arrivals as each
    repetition, the arm at the served thresholds and prefill floor. Per metric of `MODEL_METRICS` the mean % change
    over the repetitions, each repetition's, the share of the arm's passes that routed, and the model's dense mean
    E2E of each repetition (`dense_e2e_mean_s`, to set beside the cells' measured one). The model's dense is the
    sweep's dense, not the cells' measured one: it says what the sweep's per-pass costs alone make of a load, the
    queueing included (a cell's own costs, batching and compiles aside)."""
    from loadgen.metrics import flat_metrics
    from loadgen.simulate import SimConfig, predict

    config = SimConfig(lines["decode_dense"], lines["decode_routed"], lines["prefill_dense"], lines["prefill_routed"],
                       enter_tokens=thresholds["enter_tokens"], exit_tokens=thresholds["exit_tokens"],
                       max_running=max_running or 10**9, kv_capacity_tokens=kv_pool_tokens or 10**12,
                       project_share=arm.declared_skip_ratio() or 0.0,
                       prefill_floor_tokens=thresholds.get("prefill_floor_tokens"))
    prompts = [r.prompt_tokens for r in suite.requests]
    outputs = [r.max_new_tokens for r in suite.requests]
    reps, routed, dense_e2e = [], dict.fromkeys(PHASES, 0), []
    total = dict.fromkeys(PHASES, 0)
    for cell in cells:
        (p,) = predict(prompts[:cell.requests], outputs[:cell.requests], [cell.rate], config, arm.switch_settings(),
                       seed=cell.seed)
        reps.append({m: p.change_pct.get(m) for m in MODEL_METRICS})
        dense_e2e.append(flat_metrics(p.baseline).get("e2e_mean"))
        for phase in PHASES:
            routed[phase] += p.treated["passes_total"][phase]["routed"]
            total[phase] += sum(p.treated["passes_total"][phase].values())
    out = {m: sum(r[m] for r in reps) / len(reps) if all(r[m] is not None for r in reps) else None
           for m in MODEL_METRICS}
    return {**out, "reps": reps, "routed_share": {ph: routed[ph] / total[ph] if total[ph] else None for ph in PHASES},
            "dense_e2e_mean_s": dense_e2e, "prefill_from": lines.get("prefill_from")}


def skip_limit(dense: Mapping | None, config: Mapping, cells: Sequence[Cell], suites: Mapping[str, Suite],
               kv_pool_tokens: int | None, max_running: int | None, d: float,
               bandwidth_gbps: float | None = None, source: str | None = None) -> dict | None:
    """The most RandomSkip r = 1 at `d` (a share d of every routed layer's rows Project-Only) could change each
    load, as the queueing model sees it: always-route with every routed pass at the skip's physical limit
    (`limit_lines`, from the sweep's `dense` arm: its decode line and prefill times) against that dense, on the
    cells' suites, rates and seeded arrivals (the adapter's read charged at `bandwidth_gbps`, the device's, where
    known; the prefill lines from `source`, as `model_lines`). A limit of the skip on the device and load, beside
    which the headline's figures and the paper's stand. None where the sweep's dense has no lines."""
    lines = model_lines(dense, dense, source) if dense else None
    if lines is None:
        return None
    arm = always_route(d)
    skip = arm.declared_skip_ratio()
    limit = limit_lines(lines, config, skip, [p["tokens"] for p in dense["prefill"]], bandwidth_gbps)
    loads = _predict_loads(limit, arm, cells, suites, kv_pool_tokens, max_running)
    return {"skip": skip, "arm": arm.name, "layers_skipped": skip * len(config["routing_layers"]),
            "layers": config["num_hidden_layers"], "bandwidth_gbps": bandwidth_gbps,
            "prefill_from": lines["prefill_from"],
            "adapter_ms": adapter_read_s(config, skip, bandwidth_gbps) * 1e3, "loads": loads}


LIMIT_PARTS = ("measured", "decode at the limit", "prefill at the limit", "both at the limit")


def limit_parts(dense: Mapping, routed: Mapping, config: Mapping, cells: Sequence[Cell], suites: Mapping[str, Suite],
                kv_pool_tokens: int | None, max_running: int | None, d: float,
                bandwidth_gbps: float | None = None, source: str | None = None) -> dict | None:
    """Where the sweep's always-route arm at `d` (`routed`) falls short of the skip's limit, phase by phase: the
    queueing model's prediction for it against dense on the cells with its routed lines as the sweep measured
    them, with its decode line at the limit and its prefill as measured, the other way round, and both at the
    limit (`LIMIT_PARTS`). The phase whose line at the limit closes the gap is where the served routed path loses
    what the skip allows; with the same `source` as `skip_limit`, its "both at the limit" is `skip_limit`'s. None
    where either arm lacks its lines."""
    measured = model_lines(dense, routed, source)
    if measured is None:
        return None
    arm = always_route(d)
    limit = limit_lines(measured, config, arm.declared_skip_ratio(), [p["tokens"] for p in dense["prefill"]],
                        bandwidth_gbps)
    mixes = dict(zip(LIMIT_PARTS, (measured, {**measured, "decode_routed": limit["decode_routed"]},
                                   {**measured, "prefill_routed": limit["prefill_routed"]}, limit), strict=True))
    return {"arm": arm.name, "parts": {part: _predict_loads(lines, arm, cells, suites, kv_pool_tokens, max_running)
                                       for part, lines in mixes.items()}}


def always_route(d: float) -> Arm:
    """RandomSkip r = 1 at `d`, routed in both phases: the sweep's always-route arm at d = 0.5."""
    return Arm.from_dict({"name": f"random-r1-d{d:g}-always", "skipper": "random_skip",
                          "params": {"r": 1.0, "d": d}, "prefill": "routed", "decode": "routed"})


def _predict_loads(lines: Mapping, arm: Arm, cells: Sequence[Cell], suites: Mapping[str, Suite],
                   kv_pool_tokens: int | None, max_running: int | None) -> dict:
    """`model_prediction` of an arm that always routes, per load the cells hold."""
    return {load: model_prediction(lines, arm, {"enter_tokens": 0, "exit_tokens": 0}, suites[load],
                                   [c for c in cells if c.load == load], kv_pool_tokens, max_running)
            for load in LOADS if any(c.load == load for c in cells)}


def kv_pool_of(headline: Mapping) -> int | None:
    """The KV pool (tokens) the headline's arms served with, each alone with the device (the first that says)."""
    pools = [a["kv_pool_tokens"] for a in (headline.get("arms") or {}).values() if a.get("kv_pool_tokens")]
    return pools[0] if pools else None


def drawn_suites(ladder: Mapping, vocab: int) -> dict[str, Suite]:
    """The ladder's suite of each load drawn again from its seed (a results folder keeps their digests, not their
    token ids), each checked against the digest the ladder served."""
    plan, cells = ladder["plan"], [Cell.from_dict(c) for c in ladder["cells"]]
    suites = {}
    for load, doc in ladder["suites"].items():
        requests = next(c.requests for c in cells if c.load == load)
        suite = load_suite(load, requests, vocab, plan["prompt_tokens"], plan["output_tokens"])
        if suite.digest != doc["digest"]:
            raise ValueError(f"ladder.suites.{load}: drawn again from seed {suite_seed(load)}, digest "
                             f"{suite.digest[:12]} is not the one served, {doc['digest'][:12]}")
        suites[load] = suite
    return suites


def resident_ceiling(kv_pool_tokens: int, max_running: int | None, longest_request: int) -> int:
    """The most resident KV tokens the cells can hold: the pool, or the running-request cap times the longest
    request (prompt and output) where that is less."""
    if max_running is None:
        return kv_pool_tokens
    return min(kv_pool_tokens, max_running * longest_request)


# -- pairing ---------------------------------------------------------------------------------------------------------

def pair_load(label: str, arm: Arm, display: str, suite: Suite, rate: float,
              pairs: Sequence[tuple[int, CellResult, CellResult]], *, expect_engaged: bool) -> ABResult:
    """One load's cells of one arm against dense's as loadgen's A/B result: every gate per repetition (both cells
    attested: mechanism evidence, served design, cross-arm identity, work identity, accounting, declared cell size),
    then the paired % changes with their 95% intervals over the accepted repetitions. Dense always ran first."""
    designs = {BASELINE: _dense_arm(), arm.name: arm}
    result = ABResult(BASELINE, display, rate, label, suite.name, suite.digest, forced_lengths(suite), None)
    for rep, base, treated in pairs:
        for cell, name in ((base, BASELINE), (treated, arm.name)):
            if cell.arm_name != name:
                raise ValueError(f"repetition {rep}: cell.arm is {cell.arm_name!r}, expected {name!r}")
        gates = gate_pair(base, treated, suite_digest=suite.digest, request_ids=suite.ids, arms=designs,
                          expect_engaged=expect_engaged)
        result.repetitions.append(Repetition(rep, (BASELINE, arm.name), base, treated, gates))
    result.compare()
    return result


def _dense_arm() -> Arm:
    from vskipper.arms import get_arm

    return get_arm(BASELINE)


def routed_share(cells: Sequence[CellResult]) -> dict[str, float | None]:
    """Per phase, the share of the cells' passes that ran routed (from each cell's attestations)."""
    routed = dict.fromkeys(PHASES, 0)
    total = dict.fromkeys(PHASES, 0)
    for cell in cells:
        try:
            delta = pass_delta(Attestation.from_json(cell.attestation_before),
                               Attestation.from_json(cell.attestation_after))
        except (AttestationError, TypeError):
            continue
        for phase in PHASES:
            routed[phase] += delta.passes[phase].get("routed", 0)
            total[phase] += sum(delta.passes[phase].values())
    return {p: (routed[p] / total[p] if total[p] else None) for p in PHASES}


def attested_clock(doc: dict | None) -> dict | None:
    """The part clock an attestation carries (`part_clock`), marked `late` where the server served its latest
    document past the read's wait (`loadgen.attestation.answered`: its clock may lack the last passes, which then
    fall into the next reading's window); None where it carries none."""
    clock = (doc or {}).get("part_clock")
    return clock if clock is None or answered(doc) else {**clock, "late": True}


def pass_spans(before: dict | None, after: dict | None, phase: str) -> dict | None:
    """The passes of `phase` between two readings of a server's clock (`run.pass_clock`): the host's ms a pass (its
    forward: on a GPU the launches, which the device runs behind), the device's span of a pass in ms (from the
    first kernel's start to the last's end, waits for the host's launches included: None on CPU, or where the
    server's timing events failed, `device_error`), how many passes each counts, and the forward's thread's CPU
    ms, waits and gc ms a pass (None where its reads failed, `thread_error`, or the server did not attest them);
    None where either reading is missing or no pass of the phase ran between them."""
    from benchmarks.bench_cpu import run_clock

    if before is None or after is None:
        return None
    clock = run_clock(before, after, phase)
    if not clock["passes"]:
        return None
    # the device's figure only where it timed every pass the host did (a late reading, events failed midway: None)
    device = clock["device"] if clock["device_passes"] == clock["passes"] else None
    spans = {"host_ms": clock["model"], "device_ms": device, "passes": clock["passes"],
             "device_passes": clock["device_passes"], "tokens": clock["tokens"],
             # the forward's thread a pass, and the garbage collector's ms in it (None: not attested)
             "cpu_ms": clock["cpu"], "waits": clock["waits"], "gc_ms": clock["gc"]}
    if (after.get("errors") or {}).get("device"):  # the server's timing events failed: its device spans stopped
        spans["device_error"] = after["errors"]["device"]
    if (after.get("errors") or {}).get("thread"):  # its reads of the forward's thread failed: figures stopped
        spans["thread_error"] = after["errors"]["thread"]
    if before.get("late") or after.get("late"):  # a window that may hold a pass too few or too many
        spans["late"] = True
    return spans


def pass_span_means(cells: Sequence[CellResult]) -> dict[str, dict | None]:
    """Per phase, the host's and the device's ms a pass over every pass of the cells, and the forward's thread's CPU
    ms and waits a pass, from the clock each cell's attestations carry before and after it (`part_clock`: the pass
    spans every server of the device run times; each cell's `pass_spans`, weighed by its passes; the device's None
    unless it timed every cell's every pass, the thread's unless every cell's clock read it, `thread_error` the
    first cell's where its reads failed; `late`, the cells a reading of which the server served late): None for a
    phase where no cell's attestations carry a clock or no pass of it ran."""
    out: dict[str, dict | None] = {}
    for phase in PHASES:
        spans = []
        for cell in cells:
            try:
                spans.append(pass_spans(attested_clock(cell.attestation_before),
                                        attested_clock(cell.attestation_after), phase))
            except (KeyError, TypeError, AttributeError):  # not a clock's record: the cell adds nothing
                continue
        spans = [s for s in spans if s]
        passes = sum(s["passes"] for s in spans)
        device_passes = sum(s["device_passes"] for s in spans)
        timed = all(s["device_ms"] is not None for s in spans)
        out[phase] = {"host_ms": sum(s["host_ms"] * s["passes"] for s in spans) / passes,
                      "device_ms": sum(s["device_ms"] * s["device_passes"] for s in spans) / device_passes
                      if timed else None, "passes": passes, "device_passes": device_passes,
                      "tokens": sum(s.get("tokens", 0) for s in spans),
                      **{k: sum(s[k] * s["passes"] for s in spans) / passes  # the forward's thread, where attested
                         if all(s.get(k) is not None for s in spans) else None for k in ("cpu_ms", "waits", "gc_ms")},
                      "late": sum(1 for s in spans if s.get("late")),
                      **next(({"thread_error": s["thread_error"]} for s in spans if s.get("thread_error")),
                             {})} if passes else None
    return out


KIND_FIELDS = ("passes_total", "tokens_total", "device_seconds_total", "device_passes_total")


def pass_kind_means(cells: Sequence[CellResult]) -> dict[str, dict[str, dict]] | None:
    """Per phase, the cells' routed passes and their dense ones apart (the clock's `routed_total`, the dense ones
    the totals less it): passes, tokens, and the device's seconds over the passes its clock reached. None where a
    cell's clock does not count routed passes apart."""
    def delta(before: Mapping, after: Mapping, field: str, phase: str) -> float:
        return after.get(field, {}).get(phase, 0) - before.get(field, {}).get(phase, 0)

    sums: dict[str, dict[str, dict[str, float]]] = {}
    for cell in cells:
        before, after = (attested_clock(doc) for doc in (cell.attestation_before, cell.attestation_after))
        if not (before and after and "routed_total" in before and "routed_total" in after):
            return None
        for phase in PHASES:
            total = {f: delta(before, after, f, phase) for f in KIND_FIELDS}
            routed = {f: delta(before["routed_total"], after["routed_total"], f, phase) for f in KIND_FIELDS}
            kinds = sums.setdefault(phase, {kind: dict.fromkeys(KIND_FIELDS, 0) for kind in ("routed", "dense")})
            for f in KIND_FIELDS:
                kinds["routed"][f] += routed[f]
                kinds["dense"][f] += total[f] - routed[f]
    return sums or None


def absolute_means(cells: Sequence[CellResult]) -> dict[str, float | None]:
    """One arm's absolute figures over repetitions: mean E2E / TTFT / TPOT (s), requests completed per second of
    the injection window and of the whole cell (its makespan), and the window's length (s)."""
    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    return {"e2e_mean_s": mean(c.summary["e2e"]["mean"] for c in cells),
            "ttft_mean_s": mean(c.summary["ttft"]["mean"] for c in cells),
            "tpot_mean_s": mean(c.summary["tpot"]["mean"] for c in cells),
            "window_req_s": mean(c.summary.get("window_req_s") for c in cells),
            "makespan_req_s": mean(c.summary.get("makespan_req_s") for c in cells),
            "window_s": mean(c.summary.get("window_s") for c in cells)}


def load_doc(result: ABResult, requests: int) -> dict:
    """What the summary reads of one load of one arm (the cells themselves stay in their files). The routed share
    `routed_share` is over every repetition run (whether the arm routed at all); the figures set beside the
    comparison's intervals (the routed share they were measured at, each side's absolute means, pass spans and
    kinds) are over the repetitions the comparison took (its gates passed), or over every one run where none
    passed (`means_over`)."""
    taken = result.accepted or result.repetitions
    return {"rate": result.rate, "requests": requests, "repetitions_run": len(result.repetitions),
            "repetitions_accepted": len(result.accepted),
            "comparison": {k: v.as_dict() for k, v in result.comparison.items()},
            "geometric": {k: v.as_dict() for k, v in result.geometric.items()},
            "not_compared": dict(result.not_compared),
            "gates": [{"repetition": r.index, "passed": r.gates.passed, "checked": list(dict.fromkeys(r.gates.checked)),
                       "refusals": [str(f) for f in r.gates.refusals]} for r in result.repetitions],
            "routed_share": routed_share([r.treated for r in result.repetitions]),
            "means_over": "accepted" if result.accepted else "run",
            "routed_share_compared": routed_share([r.treated for r in taken]),
            "dense": absolute_means([r.baseline for r in taken]),
            "arm": absolute_means([r.treated for r in taken]),
            "pass_spans": {"dense": pass_span_means([r.baseline for r in taken]),
                           "arm": pass_span_means([r.treated for r in taken])},
            "pass_kinds": pass_kind_means([r.treated for r in taken]),
            "provenance": {"dense": provenance([r.baseline for r in taken]),
                           "arm": provenance([r.treated for r in taken])},
            "compiles": {"dense": [window_compiles(r.baseline) for r in result.repetitions],
                         "arm": [window_compiles(r.treated) for r in result.repetitions]}}


def provenance(cells: Sequence[CellResult]) -> dict[str, list[str] | None]:
    """Which server starts (`run_id`) and machines (the device's UUID, else the host's name; every replica's of a
    server of several) served an arm's cells, from their attestations before and after each cell; each None where
    some attestation does not say (older ones name no machine)."""

    def machine_of(doc: Mapping | None) -> str | None:
        return ((doc or {}).get("device_uuid") or (doc or {}).get("host")) or None

    docs = [doc or {} for cell in cells for doc in (cell.attestation_before, cell.attestation_after)]
    starts = [doc.get("run_id") for doc in docs]
    machines = [machine_of(m.get("machine")) for doc in docs for m in (doc, *(doc.get("replicas") or ()))]
    return {"starts": sorted(set(starts)) if docs and all(starts) else None,
            "machines": sorted(set(machines)) if docs and all(machines) else None}


def served_apart(cell: Mapping) -> str:
    """Where a load's compared cells came from more than one server start of an arm (a lease's arm split over two
    calls), or from more than one machine (a second call on a machine of the same kind, another GPU): said beside
    its figures, which then hold the starts' or the machines' difference too; '' otherwise."""
    sides = cell.get("provenance") or {}
    notes = [f"{'dense' if side == 'dense' else 'the arm'}'s cells came from {len(starts)} server starts"
             for side in ("dense", "arm") if len(starts := (sides.get(side) or {}).get("starts") or ()) > 1]
    machines = [(sides.get(side) or {}).get("machines") for side in ("dense", "arm")]
    if all(machines) and len(both := set(machines[0]) | set(machines[1])) > 1:
        notes.append(f"the cells were served on {len(both)} machines: pairs across machines")
    return _and(*notes)


def window_compiles(cell: CellResult) -> dict | None:
    """The Triton kernels the server compiled inside a cell's window (the difference of its two attestations'
    `triton_compiles`: each one held the passes behind it while it compiled): how many, their seconds, per kernel,
    and the kernels it loaded from Triton's cache there (first launched while serving: on a machine whose cache
    lacks them, compilations too); None where an attestation does not count them."""
    return compiles_between(*((doc or {}).get("triton_compiles") for doc in (cell.attestation_before,
                                                                              cell.attestation_after)))


def compiles_between(before: Mapping | None, after: Mapping | None) -> dict | None:
    """The compilations between two readings of a server's `triton_compiles` (`window_compiles`); None where either
    reading does not count them."""
    if not (before and after and before.get("watched") and after.get("watched")):
        return None

    def grown(field: str) -> dict:
        was = before.get(field) or {}
        return {k: n - was.get(k, 0) for k, n in (after.get(field) or {}).items() if n - was.get(k, 0)}

    return {"compiles": after["compiles_total"] - before["compiles_total"],
            "seconds": after["compile_seconds_total"] - before["compile_seconds_total"],
            "kernels": grown("compiles_by_kernel"), "cache_loads": grown("cache_loads_by_kernel")}


# -- the figures beside their limits and the paper's ------------------------------------------------------------------

def beats(iv: Mapping | None, target: float) -> str:
    """Whether a % change is below `target` beyond its 95% interval."""
    if iv is None:
        return "not measured"
    if iv.get("half_width") is None:
        return f"n = {iv['n']}: no interval"
    if iv["high"] < target:
        return "met"
    return "not met" if iv["low"] > target else "not resolved"


def not_worse(iv: Mapping | None) -> str:
    """Whether a % change (negative is better) is shown to stay within `NOT_WORSE_MARGIN_PCT` of dense: holds
    where the whole 95% interval lies at or below the margin, fails where it lies wholly above it, and is not
    resolved where it straddles it (3 repetitions' t interval is wide: a wide one must not read as a pass)."""
    if iv is None:
        return "not measured"
    if iv.get("half_width") is None:
        return f"n = {iv['n']}: no interval"
    if iv["high"] <= NOT_WORSE_MARGIN_PCT:
        return "holds"
    if iv["low"] > NOT_WORSE_MARGIN_PCT:
        return f"fails: resolved increase beyond +{NOT_WORSE_MARGIN_PCT:.0f}%, low {iv['low']:+.1f}%"
    return f"not resolved: the interval reaches {iv['high']:+.1f}%"


def compiled_in(cell: Mapping) -> str:
    """'a Triton compile inside k of n repetitions' windows' where a compared repetition's window (either arm's)
    held one: a stall a warm server would not pay, inside the figure; '' otherwise."""
    taken = [g["passed"] for g in cell.get("gates") or ()]
    compiles = cell.get("compiles") or {}
    if not any(taken):
        taken = [True] * len(taken)

    def counted(side: str, i: int) -> int:
        seen = compiles.get(side) or ()
        return ((seen[i] if i < len(seen) else None) or {}).get("compiles") or 0

    hit = [any(counted(side, i) for side in ("dense", "arm")) for i, used in enumerate(taken) if used]
    return f"a Triton compile inside {sum(hit)} of {len(hit)} repetitions' windows" if any(hit) else ""


def _and(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def _iv(iv: Mapping | None) -> str:
    if iv is None:
        return "n/a"
    if iv.get("statistic") == "geometric":  # its interval is not symmetric about the change
        bounds = "" if iv.get("low") is None else f" [{iv['low']:+.1f}, {iv['high']:+.1f}]"
        return f"geometric {iv['mean']:+.1f}{bounds} (n = {iv['n']})"
    hw = iv.get("half_width")
    return f"{iv['mean']:+.1f}" + ("" if hw is None else f" ± {hw:.1f}") + f" (n = {iv['n']})"


def _paper(pair: tuple[float, float | None] | None) -> str:
    if pair is None:
        return "n/a"
    return f"{pair[0]:+.1f}" + (" (n = 1)" if pair[1] is None else f" ± {pair[1]:.1f}")


def figure_rows(headline: Mapping) -> list[dict]:
    """The headline's figures, one row each: what was measured, its goal, the paper's on the A100 and the H100, the
    skip's limit (`skip_limit`) and the verdict. The goals: the hybrid arms' knee beats the paper's -36.8%, and
    wherever a hybrid arm stayed below V* (it ran no routed decode pass) it is never worse than dense beyond noise.
    The skip's limit is the queueing model's mean E2E change with always-route's passes at the skip's physical
    limit (`skip_limit`), for the hybrid arms too: at the limit a routed pass costs no more than a dense one but
    for the adapter's read (below a few thousand resident tokens on Llama-3-8B's shape), so staying dense gains a
    hybrid arm no more than that. Where the paper's figure lies beyond it, the verdict says so (a goal this skip
    cannot reach on this device and load, by the model); where a measured change lies beyond it, that it is a
    question."""
    limits = (headline.get("skip_limit") or {}).get("loads") or {}
    rows = []
    for key, arm in headline.get("arms", {}).items():
        role = arm["role"]
        for load, cell in (arm.get("loads") or {}).items():
            e2e = cell["comparison"].get("e2e_mean")
            bound = (limits.get(load) or {}).get("e2e_mean")
            what = f"mean E2E change at {CELL_FACTORS[load]} Q*"
            if role == "hybrid":
                paper = {dev: PAPER[dev]["loads"][load]["e2e_mean"] for dev in PAPER}
                # the routed share of the repetitions compared (older documents: of every one run)
                below_v_star = cell.get("routed_share_compared", cell["routed_share"]).get("decode") == 0
                notes = _and(compiled_in(cell), served_apart(cell))
                if load == KNEE:
                    verdict = _past_limit(beats(e2e, PAPER_KNEE_E2E), e2e, bound)
                    if bound is not None and bound > PAPER_KNEE_E2E and verdict == beats(e2e, PAPER_KNEE_E2E):
                        verdict += f" (the goal lies beyond the skip's limit, {bound:+.1f}%)"
                    verdict = _and(verdict, notes)
                    rows.append(_row(key, what, e2e, f"below {PAPER_KNEE_E2E:+.1f}% (the paper's)", paper, verdict,
                                     bound))
                if below_v_star:
                    rows.append(_row(key, what + " (below V*: no routed decode pass)", e2e,
                                     f"within +{NOT_WORSE_MARGIN_PCT:.0f}% of dense", paper,
                                     _and(_past_limit(not_worse(e2e), e2e, bound), notes), bound))
                elif load != KNEE:
                    rows.append(_row(key, what, e2e, "none set", paper, _and(_past_limit("", e2e, bound), notes),
                                     bound))
                if load == OVERLOAD:
                    rows += throughput_rows(key, cell, notes)
            else:  # always-route (the paper's ablation at the knee, n = 1) and the s = 0 control (not in the paper)
                paper = {"A100": (PAPER["A100"]["always_e2e_knee"], None)} if role == "always" else {}
                bound = bound if role == "always" else None
                rows.append(_row(key, what, e2e, "none set", paper, _and(_past_limit("", e2e, bound),
                                                                          compiled_in(cell), served_apart(cell)),
                                 bound))
    return rows


def p99_reach(headline: Mapping) -> list[str]:
    """What a cell's p99 reaches beside the paper's: taken over each cell's own requests (the loads' counts here),
    the paper's over its GSM8K cell of 3,600."""
    counts = sorted({c["requests"] for arm in headline.get("arms", {}).values()
                     for c in (arm.get("loads") or {}).values() if c.get("requests")})
    if not counts:
        return []
    held = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return [f"A cell's p99 is taken over its own {held} requests (within its {math.ceil(counts[-1] / 100)} largest "
            "values), the paper's over its GSM8K cell of 3,600: the same name, not the same reach into the tail."]


def throughput_rows(key: str, cell: Mapping, notes: str) -> list[dict]:
    """The overload's request throughput: in the injection window (the paper's figure), with what its window's
    length makes of it, and over each cell's whole makespan (the rate the server cleared the backlog at). Each
    beside its geometric mean change (`loadgen.stats.ratio_interval`), where the cell has one, and where the two
    statistics differ in sign, the verdict says that the per-repetition ratios spread too widely to read the mean
    of % changes."""
    factor = CELL_FACTORS[OVERLOAD]
    window, e2e = ((cell.get("dense") or {}).get(k) for k in ("window_s", "e2e_mean_s"))
    short = (f"the window ({window:.0f} s) is under {WINDOW_OVER_E2E:.0f}x dense's mean E2E ({e2e:.1f} s): its "
             "completions measure latency as much as throughput" if window and e2e and window < WINDOW_OVER_E2E * e2e
             else "")
    paper = {dev: PAPER[dev]["window_req_s"] for dev in PAPER}
    rows = []
    for metric, figure, paper_of, window_note in (
            ("window_req_s", "request throughput in the injection window", paper, short),
            ("makespan_req_s", "requests completed per second of the cell's makespan", {}, "")):
        iv, geo = cell["comparison"].get(metric), (cell.get("geometric") or {}).get(metric)
        left_out = (cell.get("not_compared") or {}).get(f"{metric} (geometric)")
        row = _row(key, f"{figure} at {factor} Q*", iv, "none set", paper_of,
                   _and(window_note, statistics_disagree(iv, geo), f"no geometric change: {left_out}" if left_out
                        else "", notes))
        rows.append(dict(row, geometric=geo))
    return rows


def statistics_disagree(iv: Mapping | None, geo: Mapping | None) -> str:
    """A note where the mean of % changes and the geometric mean change differ in sign: the mean is then carried
    by the repetitions whose ratio is far above 1, and neither reads as the cell's change."""
    if not iv or not geo or (iv["mean"] > 0) == (geo["mean"] > 0) or 0 in (iv["mean"], geo["mean"]):
        return ""
    return (f"the mean of % changes ({iv['mean']:+.1f}%) and the geometric mean ({geo['mean']:+.1f}%) differ in "
            "sign: the repetitions' ratios spread too widely to read either")


def _past_limit(verdict: str, iv: Mapping | None, bound: float | None) -> str:
    """The verdict, and where the measured change lies beyond the skip's limit (its whole 95% interval; the mean,
    said so, where it has none), that it is a question, not a win."""
    if iv is None or bound is None:
        return verdict
    resolved = iv.get("half_width") is not None
    if (iv["high"] if resolved else iv["mean"]) >= bound:
        return verdict
    past = (f"beyond the skip's limit ({bound:+.1f}%{'' if resolved else ', by its mean alone'}): a question, "
            "not a win")
    return f"{verdict}, but {past}" if verdict else past


def _row(arm: str, figure: str, iv, goal: str, paper: Mapping, verdict: str, skip_limit: float | None = None) -> dict:
    return {"arm": arm, "figure": figure, "measured": iv, "limit": goal,
            "paper_a100": paper.get("A100"), "paper_h100": paper.get("H100"), "skip_limit": skip_limit,
            "verdict": verdict}


def figure_lines(rows: Sequence[Mapping]) -> list[str]:
    lines = ["| arm | figure | measured, % | goal | paper A100 (n = 6) | paper H100 (n = 3) | the skip's limit "
             "(model), % | verdict |", "|---|---|---:|---|---:|---:|---:|---|"]
    lines += [f"| {r['arm']} | {r['figure']} | {_iv(r['measured'])}"
              + (f"; {_iv(r['geometric'])}" if r.get("geometric") else "") + f" | {r['limit']} | {_paper(r['paper_a100'])} | "
              f"{_paper(r['paper_h100'])} | {_pct(r.get('skip_limit'))} | {r['verdict']} |" for r in rows]
    return lines


def skip_limit_lines(limit: Mapping | None) -> list[str]:
    """The skip's limit per load (`skip_limit`), in words and a table."""
    if not limit:
        return []
    rows = [f"| {CELL_FACTORS[load]} Q* | " + " | ".join(_pct(p.get(m)) for m in MODEL_METRICS) + " |"
            for load, p in limit["loads"].items()]
    layers = (f", {limit['layers_skipped']:g} of {limit['layers']} layers skipped on average"
              if limit.get("layers_skipped") is not None else "")
    return [f"The skip's limit: what the queueing model (`loadgen.simulate`) predicts for {limit['arm']} (s = "
            f"{limit['skip']:g} at every routed layer{layers}, every pass routed) against dense when each routed "
            "pass costs "
            "only what the skip's physical limit allows (`headline.limit_lines`: decode at the bytes a step reads, "
            + (f"the adapter's read {limit['adapter_ms']:.3f} ms a step at {limit['bandwidth_gbps']:g} GB/s, "
               if limit.get("bandwidth_gbps") else "the adapter's read not charged (no device bandwidth), ")
            + "prefill at its FLOPs, from the sweep's dense lines"
            + (f", a prefill pass's from {PREFILL_FROM[limit['prefill_from']]}"
               if limit.get("prefill_from") in PREFILL_FROM else "")
            + "), on the cells' suites, rates and arrivals. A "
            "served arm's measured change beyond it is a question, and a goal beyond it needs another skip or load:",
            "", "| load | E2E | TTFT | TPOT |", "|---|---|---|---|", *rows, ""]


def paper_table_lines() -> list[str]:
    """The paper's GSM8K rows in loadgen's table layout, to read beside each arm's."""
    head = ["E2E mean", "E2E p99", "TPOT mean", "TPOT p99", "TTFT mean", "TTFT p99", "makespan"]
    lines = ["| paper | load | n | " + " | ".join(head) + " |", "|---|---|---:|" + "---:|" * len(head)]
    for dev, doc in PAPER.items():
        for load in LOADS:
            values = [_paper(doc["loads"][load][m]) for m in TABLE_METRICS]
            lines.append(f"| {dev} | {CELL_FACTORS[load]} Q* | {doc['n']} | " + " | ".join(values) + " |")
    return lines


def headline_lines(ladder: Mapping | None, headline: Mapping | None) -> list[str]:
    """The summary's section: the suite, the ladder and Q*, which thresholds served, the figures beside their limits
    and the paper's, then each arm's table."""
    if not ladder:
        return []
    lines = ["## Headline A/B: GSM8K-shaped load, one server at a time", ""]
    shape = ladder.get("shape") or {}
    if shape:
        p, o = shape["prompt_tokens"], shape["output_tokens"]
        lines += [f"Suite per load: prompts of {p['min']}-{p['max']} tokens (mean {p['mean']:.0f}), forced outputs of "
                  f"{o['min']}-{o['max']} tokens (mean {o['mean']:.0f}; the paper's upstream mean at its knee: "
                  f"{PAPER_OUTPUT_TOKENS}); the prefix cache flushed before every cell.", ""]
    q = ladder.get("q_star")
    if q:
        rates = q["rates"]
        lines += [f"Upstream's Q* ladder (dense, in-window output tok/s at {rates[0]}-{rates[-1]} req/s): Q* = "
                  f"{q['q_star']} req/s ({q['tok_s_at_q_star']:.4g} tok/s; plateau reached: "
                  f"{'yes' if q['plateau_reached'] else 'no, the ladder stopped at its bound'}); the paper's: "
                  f"{PAPER['A100']['q_star']} on the A100, {PAPER['H100']['q_star']} on the H100."
                  + (f" The rates are those of {ladder['q_star_from']}: dense's cells here ran at its Q*, not climbed "
                     "again." if ladder.get("q_star_from", OWN_LADDER) != OWN_LADDER else ""), ""]
    if ladder.get("left"):
        lines += [f"Ladder stage left for the next run: {', '.join(ladder['left'])}", ""]
    if not headline:
        return lines
    lines += ["Thresholds:", ""]
    for key, arm in headline["arms"].items():
        if arm["role"] != "hybrid":
            continue
        if arm.get("skipped"):
            lines.append(f"- {key}: not served: {arm['skipped']}")
            continue
        served = (arm.get("served") or {}).get("thresholds") or {}
        ceiling = arm.get("resident_ceiling_tokens")
        planned = arm["thresholds"]
        floor = (f"; prefill floor {served.get('prefill_floor_tokens')} prompt tokens a round (attested source: "
                 f"{served.get('prefill_floor_source')}"
                 + (f"; {planned['prefill_floor_source']})" if planned.get("prefill_floor_source") else ")")
                 if served.get("prefill_floor_tokens") is not None else "")
        lines.append(f"- {key}: enter {served.get('enter_tokens')} / exit {served.get('exit_tokens')} resident KV "
                     f"tokens served (attested source: {served.get('source')}; from {planned['source']}){floor}; "
                     f"KV pool {arm.get('kv_pool_tokens')} tokens, at most {ceiling} resident in these cells"
                     + (" (below the enter threshold: decode cannot route)"
                        if ceiling is not None and served.get("enter_tokens", 0) > ceiling else ""))
    lines += ["", *figure_lines(headline["figures"]), "", *skip_limit_lines(headline.get("skip_limit")),
              *limit_parts_lines(headline.get("limit_parts")),
              "Mean % change against dense over paired repetitions (the same cell served to each arm in turn, dense "
              "first), ± the 95% t half-width; negative is better, except request throughput. A rate's "
              "geometric mean change (the per-repetition ratios' geometric mean) stands beside it, its 95% "
              "interval in brackets. Verdicts need "
              "n >= 2. Here the routed arms skip with RandomSkip (r = 1, d = 0.5) on random weights against "
              "vSkipper's dense arm; the paper's figures are FlexiDepth's trained router against upstream SGLang.",
              *p99_reach(headline), ""]
    for key, arm in headline["arms"].items():
        if arm.get("skipped") or not arm.get("table"):
            continue
        compared = {load: c.get("routed_share_compared", c["routed_share"]) for load, c in arm["loads"].items()}
        shares = "; ".join(f"{CELL_FACTORS[load]} Q*: prefill {_share(c['prefill'])}, decode {_share(c['decode'])}"
                           for load, c in compared.items())
        lines += [arm["table"], f"Routed share of {key}'s passes in the repetitions compared: {shares}."
                  + (f" Not engaged: {arm['not_engaged']}." if arm.get("not_engaged") else ""), ""]
        lines += model_table(key, arm.get("model"), arm["loads"])
        if arm.get("model") and arm.get("model_note"):
            lines += [arm["model_note"], ""]
        lines += pass_span_table(key, arm["loads"])
        lines += pass_kind_table(key, arm["loads"])
        lines += compile_lines(key, arm["loads"])
    lines += ["The paper's GSM8K rows (FlexiDepth on Llama-3-8B against upstream SGLang):", "",
              *paper_table_lines(), ""]
    if headline.get("left"):
        lines += [f"Headline stage left for the next run: {', '.join(headline['left'])}", ""]
    return lines


def model_table(key: str, model: Mapping | None, loads: Mapping) -> list[str]:
    """The queueing model's prediction for arm `key` beside what its cells measured, per load: the % change of mean
    E2E, TTFT and TPOT against dense (`model_prediction`), the measured one with its interval."""
    if not model:
        return []
    rows = []
    for load, predicted in model.items():
        measured = (loads.get(load) or {}).get("comparison") or {}
        limit = predicted.get("at_limit") or {}
        cells = [f"{_pct(predicted.get(m))} / {_pct(limit.get(m))} / {_iv(measured.get(m))}" for m in MODEL_METRICS]
        shares = predicted["routed_share"]
        rows.append(f"| {CELL_FACTORS[load]} Q* | {' | '.join(cells)} | {_share(shares['prefill'])}, "
                    f"{_share(shares['decode'])} |")
    source = next(iter(model.values())).get("prefill_from")
    return ["What the queueing model (`loadgen.simulate`: each pass costing the sweep's line of its phase and mode, "
            + (f"a prefill pass's from {PREFILL_FROM[source]}, " if source in PREFILL_FROM else "")
            + f"the cells' suites, rates and arrivals, {key} at the thresholds and floor it served) predicts against "
            "dense, then the same with the routed passes at the skip's physical limit (`headline.limit_lines`), "
            "beside the cells' measured change (% change of the mean, predicted / at the limit / measured); a "
            "measured change beyond the prediction is a cost the served cells paid that the sweep's passes did not, "
            "and one beyond the limit is a question"
            + (" (its TTFT leaves out each request's HTTP, hand-over and output, which the client's holds: its TTFT "
               "change is the larger for it)" if source == "forward" else "") + ":", "",
            "| load | E2E | TTFT | TPOT | routed share predicted (prefill, decode) |", "|---|---|---|---|---|",
            *rows, "", *model_dense_lines(model, loads)]


def model_dense_lines(model: Mapping, loads: Mapping) -> list[str]:
    """The model's dense mean E2E beside the cells' measured dense, per load: how far the sweep's lines describe the
    served load at all (a model whose dense queues more than the cells' predicts larger changes)."""
    parts = []
    for load, predicted in model.items():
        modelled = [e for e in predicted.get("dense_e2e_mean_s") or [] if e is not None]
        measured = ((loads.get(load) or {}).get("dense") or {}).get("e2e_mean_s")
        if modelled and measured:
            parts.append(f"{CELL_FACTORS[load]} Q* {min(modelled):.2f}-{max(modelled):.2f} s against "
                         f"{measured:.2f} s ({sum(modelled) / len(modelled) / measured - 1:+.0%})")
    return [f"The model's dense mean E2E beside the cells' measured dense (mean over the repetitions): "
            f"{'; '.join(parts)}.", ""] if parts else []


def limit_parts_lines(found: Mapping | None) -> list[str]:
    """`limit_parts` as a table: the model's mean E2E change per load with each mix of measured and limit lines."""
    if not found:
        return []
    loads = list(next(iter(found["parts"].values())))
    return [f"Where the sweep's {found['arm']} falls short of the skip's limit (`headline.limit_parts`): the queueing "
            "model's mean E2E change against dense with its routed lines as the sweep measured them, then with one "
            "phase's line or both at the limit; the phase whose limit closes the gap is where routing loses what "
            "the skip allows:", "",
            "| lines | " + " | ".join(f"{CELL_FACTORS[load]} Q*" for load in loads) + " |",
            "|---|" + "---:|" * len(loads),
            *(f"| {part} | " + " | ".join(_pct(by[load]["e2e_mean"]) for load in loads) + " |"
              for part, by in found["parts"].items()), ""]


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f}%"


def pass_span_table(key: str, loads: Mapping) -> list[str]:
    """Each load's passes of dense and of arm `key` as their servers timed them (`pass_span_means`, ms a pass over
    every pass of the repetitions' cells), per phase, on the device and the host, and the forward's thread's CPU
    ms, waits and gc ms a pass beside the host's (dense / arm): what a pass cost each arm, and whether a host time
    was spent computing or waiting (where the arms batched their requests otherwise, their passes differ in size,
    and so in cost)."""
    rows, late, stopped = [], 0, {}
    for load, doc in loads.items():
        spans = doc.get("pass_spans") or {}
        for phase in PHASES:
            dense, arm = (spans.get("dense") or {}).get(phase), (spans.get("arm") or {}).get(phase)
            if dense and arm:
                thread = " | ".join(f"{figure(dense.get(k), f)} / {figure(arm.get(k), f)}"
                                    for k, f in (("cpu_ms", ".2f"), ("waits", ".1f"), ("gc_ms", ".2f")))
                rows.append(f"| {CELL_FACTORS[load]} Q* | {phase} | {_ms(dense['device_ms'])} | {_ms(arm['device_ms'])} | "
                            f"{_ms(dense['host_ms'])} | {_ms(arm['host_ms'])} | {thread} | {dense['passes']} | "
                            f"{arm['passes']} | {_per_pass(dense)} | {_per_pass(arm)} |")
                late += dense.get("late", 0) + arm.get("late", 0)
                for side, name in ((dense, "dense"), (arm, key)):
                    if side.get("thread_error"):
                        stopped.setdefault(name, side["thread_error"])
    if not rows:
        return []
    note = [f"{late} cell windows are bounded by a reading the server served late: a pass of such a window may be "
            "counted in no cell.", ""] if late else []
    note += [f"The reads of {name}'s forward thread stopped: {error}." for name, error in stopped.items()]
    note += [""] if stopped else []
    return [f"{key}'s passes against dense's as the servers timed them (ms a pass over the cells' passes; device: "
            "each pass's span on the device; host: its forward's launches; thread CPU: the CPU time of the thread "
            "that ran the forward, which fills a host time spent computing, and waits: how often it gave up the "
            "processor; gc: the garbage collector's ms; tokens a pass: the rows a pass ran, so that passes of "
            "different sizes are not read as the same work):", "",
            f"| load | phase | dense device ms | {key} device ms | dense host ms | {key} host ms | thread CPU ms "
            f"(dense / {key}) | waits (dense / {key}) | gc ms (dense / {key}) | dense passes | {key} passes | "
            f"dense tokens a pass | "
            f"{key} tokens a pass |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows, "", *note]


def pass_kind_table(key: str, loads: Mapping) -> list[str]:
    """Arm `key`'s routed passes beside its dense ones at each load (`pass_kind_means`): a hybrid arm runs both,
    and what a routed pass costs a token beside a dense pass of the same server tells where routing pays."""
    rows = []
    for load, doc in loads.items():
        for phase, kinds in (doc.get("pass_kinds") or {}).items():
            for kind in ("routed", "dense"):
                k = kinds.get(kind) or {}
                passes, tokens = k.get("passes_total"), k.get("tokens_total")
                if not passes:
                    continue
                seconds, timed = k["device_seconds_total"], k["device_passes_total"] == passes
                device = f"{1e3 * seconds / passes:.2f}" if timed else "n/a"
                per_token = f"{1e6 * seconds / tokens:.1f}" if timed and tokens else "n/a"
                per_pass = f"{tokens / passes:.1f}" if tokens else "n/a"
                rows.append(f"| {CELL_FACTORS[load]} Q* | {phase} | {kind} | {passes} | {per_pass} | {device} | "
                            f"{per_token} |")
    if not rows:
        return []
    return [f"{key}'s routed passes beside its dense ones (device ms a pass and us a token: what a routed pass "
            "costs against a dense one of the same server):", "",
            "| load | phase | kind | passes | tokens a pass | device ms a pass | device us a token |",
            "|---|---|---|---:|---:|---:|---:|", *rows, ""]


def compile_lines(key: str, loads: Mapping) -> list[str]:
    """The cells inside whose window a server compiled Triton kernels (`window_compiles`), dense's and arm
    `key`'s: a compilation holds every pass behind it, so such a cell measures the compiler too."""
    found, counted = [], False
    for load, doc in loads.items():
        for side, name in (("dense", "dense"), ("arm", key)):
            for rep, c in enumerate((doc.get("compiles") or {}).get(side) or []):
                counted = counted or c is not None
                if c and (c["compiles"] or c.get("cache_loads")):
                    found.append(f"{name} at {CELL_FACTORS[load]} Q*, repetition {rep}: {compiles_text(c)}")
    if found:
        return ["Triton kernels first launched inside a cell's window, built there (each held the passes behind "
                "it while it compiled) or loaded from Triton's cache (built on a machine whose cache lacks it): "
                + "; ".join(found) + ".", ""]
    return [f"No Triton kernel first launched inside any cell's window of {key} or dense.", ""] if counted else []


def compiles_text(c: Mapping) -> str:
    """One window's compilations (`compiles_between`) in words: how many built, their seconds and kernels, and the
    kernels loaded from Triton's cache."""
    built = ", ".join(f"{k} x{n}" for k, n in sorted(c["kernels"].items()))
    loaded = ", ".join(f"{k} x{n}" for k, n in sorted((c.get("cache_loads") or {}).items()))
    return (f"{c['compiles']} built" + (f" ({c['seconds']:.2f} s; {built})" if c["compiles"] else "")
            + (f", loaded from the cache: {loaded}" if loaded else ""))


def _per_pass(spans: Mapping) -> str:
    """The tokens a pass ran over the spans' passes (n/a where the clock counted none)."""
    return f"{spans['tokens'] / spans['passes']:.1f}" if spans.get("tokens") else "n/a"


def figure(value: float | None, fmt: str = ".3g") -> str:
    """A figure of a table: `value` in format `fmt`, n/a where there is none."""
    return "n/a" if value is None else format(value, fmt)


def _ms(value: float | None) -> str:
    return figure(value, ".2f")


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"
