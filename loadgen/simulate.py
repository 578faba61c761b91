"""`loadgen simulate`: a discrete-event model of continuous batching, for planning beyond one measured GPU.

Model (its assumptions, stated once):
- One server, one stream: each iteration runs either one prefill pass or one decode step, never both (SGLang's
  default schedule). A waiting request is admitted as soon as it has arrived and fits (running rows below
  `max_running`, resident KV below `kv_capacity_tokens`, the round below `max_prefill_tokens`; the first waiting
  request is always admitted into an empty round); pending prefill runs before the next decode step.
- A pass's latency is a line per mode: intercept + per_row * rows + per_resident_token * resident KV tokens.
  A prefill round has rows = its prompt tokens and resident tokens = the same prompt tokens. A decode step has one
  row per running request, and each request's resident tokens are its prompt plus the tokens generated so far.
  A decode step with rows in both modes pays the routed intercept if any row is routed, and each row's own slopes.
- The prefill pass yields each admitted request's first token; each decode step yields one token per running
  request. Requests finish at their given output length (the matched lane: no stopping decisions).
- Modes come from the foundation's `vskipper.switch.ModeSwitch` with the arm's switch settings and the
  given thresholds: decode mode fixed at decode start, promotion at the enter crossing, hysteresis on the
  resident KV tokens; prefill mode per admission round, with probes answered by `project_share`, from the
  prefill floor `prefill_floor_tokens` where given (a served `--prefill-floor-tokens`), else the constants'.
- No network, tokenizer, prefix cache, chunked prefill, preemption or CUDA-graph effects; time is exact.

Because waiting time is the integral of backlog, a small per-step saving near the knee (where the server is
barely keeping up) removes a large part of the queue: the model reproduces by construction the queueing
amplification the paper reports, large latency gains from small per-step savings, and almost none far below it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from loadgen.arrivals import poisson_arrivals
from loadgen.metrics import flat_metrics, summarize
from loadgen.records import RequestRecord
from loadgen.stats import pct_change
from vskipper.constants import CONSTANTS
from vskipper.switch import Mode, ModeSwitch, Policy, SwitchSettings


@dataclass(frozen=True)
class StepLine:
    intercept_s: float
    per_row_s: float
    per_resident_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("intercept_s", "per_row_s", "per_resident_token_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"step line: {name} must be >= 0, got {getattr(self, name)!r}")

    def seconds(self, rows: int, resident_tokens: int) -> float:
        return self.intercept_s + self.per_row_s * rows + self.per_resident_token_s * resident_tokens

    @classmethod
    def parse(cls, text: str, where: str = "line") -> StepLine:
        """'intercept,per_row,per_resident_token' in seconds."""
        parts = [p for p in text.split(",") if p.strip()]
        if len(parts) not in (2, 3):
            raise ValueError(f"{where}: expected 'intercept,per_row[,per_resident_token]' seconds, got {text!r}")
        try:
            return cls(*(float(p) for p in parts))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class SimConfig:
    decode_dense: StepLine
    decode_routed: StepLine
    prefill_dense: StepLine
    prefill_routed: StepLine
    enter_tokens: int
    exit_tokens: int
    max_running: int = 256
    kv_capacity_tokens: int = 10**9
    max_prefill_tokens: int = 16384
    project_share: float = 0.5
    prefill_floor_tokens: int | None = None  # the served prefill floor; None: vskipper.constants'

    def line(self, phase: str, mode: Mode) -> StepLine:
        routed = mode is Mode.ROUTED
        if phase == "prefill":
            return self.prefill_routed if routed else self.prefill_dense
        return self.decode_routed if routed else self.decode_dense


@dataclass
class _Live:
    index: int
    prompt: int
    target: int
    generated: int = 0


def simulate(arrivals: Sequence[float], prompt_tokens: Sequence[int], output_tokens: Sequence[int],
             config: SimConfig, settings: SwitchSettings) -> tuple[list[RequestRecord], dict]:
    """Replay one arrival schedule; returns per-request records (simulated seconds) and pass counters."""
    n = len(arrivals)
    if not (len(prompt_tokens) == len(output_tokens) == n):
        raise ValueError("simulate: arrivals, prompt_tokens and output_tokens must have the same length")
    if any(o < 1 for o in output_tokens):
        raise ValueError("simulate: every output length must be >= 1")
    constants = CONSTANTS if config.prefill_floor_tokens is None else \
        replace(CONSTANTS, prefill_min_prompt_tokens=config.prefill_floor_tokens)
    switch = ModeSwitch(settings, config.enter_tokens, config.exit_tokens, constants=constants,
                        declared_project_share=config.project_share)
    order = sorted(range(n), key=lambda i: arrivals[i])
    records = [RequestRecord(index=i, request_id=str(i), scheduled_s=arrivals[i], prompt_tokens=prompt_tokens[i],
                             max_new_tokens=output_tokens[i], ignore_eos=True, submit_s=arrivals[i],
                             output_ids=None) for i in range(n)]
    passes = {"prefill": {"dense": 0, "routed": 0}, "decode": {"dense": 0, "routed": 0}}
    waiting: deque[int] = deque()
    running: list[_Live] = []
    nxt, done, t = 0, 0, 0.0

    def emit(live: _Live, now: float) -> bool:
        rec = records[live.index]
        live.generated += 1
        rec.token_times_s.append(now)
        if rec.first_token_s is None:
            rec.first_token_s = now
        if live.generated >= live.target:
            rec.finish_s, rec.output_tokens, rec.finish_reason = now, live.generated, "length"
            return True
        return False

    while done < n:
        while nxt < n and arrivals[order[nxt]] <= t:
            waiting.append(order[nxt])
            nxt += 1
        if not waiting and not running:
            t = arrivals[order[nxt]]
            continue
        resident = sum(r.prompt + r.generated for r in running)
        batch: list[int] = []
        tokens = 0
        while waiting and len(running) + len(batch) < config.max_running:
            i = waiting[0]
            fits = tokens + prompt_tokens[i] <= config.max_prefill_tokens and \
                resident + tokens + prompt_tokens[i] <= config.kv_capacity_tokens
            if batch and not fits:
                break
            if not batch and not fits and running:
                break  # wait for memory to free up
            batch.append(waiting.popleft())
            tokens += prompt_tokens[i]
        if batch:
            decision = switch.admit_prefill(tokens, t)
            if decision.probe:
                switch.record_prefill_share(config.project_share, t)
            t += config.line("prefill", decision.mode).seconds(tokens, tokens)
            passes["prefill"][decision.mode.value] += 1
            for i in batch:
                live = _Live(i, prompt_tokens[i], output_tokens[i])
                if emit(live, t):
                    done += 1
                else:
                    switch.start_decode(i)
                    running.append(live)
            continue
        switch.observe(resident, t)
        modes = [switch.decode_mode(r.index) for r in running]
        any_routed = any(m is Mode.ROUTED for m in modes)
        step = (config.decode_routed if any_routed else config.decode_dense).intercept_s
        for live, mode in zip(running, modes, strict=True):
            line = config.line("decode", mode)
            step += line.per_row_s + line.per_resident_token_s * (live.prompt + live.generated)
        t += step
        passes["decode"]["routed" if any_routed else "dense"] += 1
        still = []
        for live in running:
            if emit(live, t):
                switch.finish(live.index)
                done += 1
            else:
                still.append(live)
        running = still
    return records, {"passes_total": passes, "switch": switch.attestation(recent=0)}


@dataclass(frozen=True)
class Prediction:
    rate: float
    baseline: dict
    treated: dict
    change_pct: dict[str, float]

    def as_dict(self) -> dict:
        return {"rate": self.rate, "baseline": self.baseline, "arm": self.treated, "change_pct": self.change_pct}


PREDICTED = ("e2e_mean", "e2e_p99", "ttft_mean", "ttft_p99", "tpot_mean", "makespan_s")


DENSE = SwitchSettings(Policy.DENSE, Policy.DENSE)  # the baseline arm routes nothing


def predict(prompt_tokens: Sequence[int], output_tokens: Sequence[int], rates: Sequence[float],
            config: SimConfig, arm_settings: SwitchSettings, *, seed: int = 0,
            baseline_settings: SwitchSettings = DENSE) -> list[Prediction]:
    """For each offered rate: both arms on the same seeded arrivals; the arm's % change against the baseline."""
    out = []
    for rate in rates:
        arrivals = poisson_arrivals(len(prompt_tokens), rate, seed)
        summaries = []
        for settings in (baseline_settings, arm_settings):
            records, counters = simulate(arrivals, prompt_tokens, output_tokens, config, settings)
            s = summarize(records, rate)
            s["passes_total"] = counters["passes_total"]
            summaries.append(s)
        b, a = (flat_metrics(s) for s in summaries)
        change = {m: pct_change(a[m], b[m]) for m in PREDICTED if m in a and m in b and b[m] != 0}
        out.append(Prediction(rate, summaries[0], summaries[1], change))
    return out
