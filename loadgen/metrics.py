"""Cell metrics: latency distributions over requests, makespan, drain and in-window throughput.

- E2E = finish - submit, TTFT = first token - submit, TPOT = a request's mean inter-token interval; each as a
  mean and p50/p90/p99 over requests (TPOT over requests with >= 2 output tokens).
- The injection window runs from the first to the last submission. Makespan = last completion - first
  submission; drain = last completion - last submission.
- Saturated throughput: output tokens emitted and requests completed *inside* the injection window, per second
  of window.
- Offered rate = the declared rate; injected rate = (submissions - 1) / window.
"""

from __future__ import annotations

from collections.abc import Sequence

from loadgen.records import CellResult, RequestRecord
from loadgen.stats import describe

LATENCIES = ("e2e", "ttft", "tpot")


def summarize(records: Sequence[RequestRecord], offered_rate: float | None = None,
              context_limit_hits: int | None = None) -> dict:
    ok = [r for r in records if r.ok]
    out: dict = {"requests": len(records), "completed": len(ok), "errors": sum(r.error is not None for r in records),
                 "offered_rate": offered_rate}
    for name in LATENCIES:
        vals = [getattr(r, f"{name}_s") for r in ok]
        out[name] = describe([v for v in vals if v is not None])
    out["output_tokens"] = sum(r.output_tokens for r in ok)
    out["mean_output_tokens"] = out["output_tokens"] / len(ok) if ok else None
    out["empty_generations"] = sum(r.output_tokens == 0 for r in ok)
    out["context_limit_hits"] = context_limit_hits
    submits = sorted(r.submit_s for r in records if r.submit_s is not None)
    finishes = [r.finish_s for r in ok]
    if not submits or not finishes:
        out.update(makespan_s=None, drain_s=None, window_s=None, injected_rate=None, window_output_tok_s=None,
                   window_req_s=None, makespan_req_s=None)
        return out
    start, end, last = submits[0], submits[-1], max(finishes)
    window = end - start
    out["makespan_s"] = last - start
    out["drain_s"] = last - end
    out["window_s"] = window
    out["injected_rate"] = (len(submits) - 1) / window if window > 0 else None
    if window > 0:
        tokens_in = sum(1 for r in ok for t in r.token_times_s if start <= t <= end)
        done_in = sum(1 for t in finishes if start <= t <= end)
        out["window_output_tok_s"] = tokens_in / window
        out["window_req_s"] = done_in / window
    else:
        out["window_output_tok_s"] = out["window_req_s"] = None
    out["whole_cell_output_tok_s"] = out["output_tokens"] / out["makespan_s"] if out["makespan_s"] > 0 else None
    # requests completed per second of the whole cell: in overload, where the drain holds the backlog, the rate the
    # server cleared it at (the window's count, over a window not much longer than a request, measures latency too)
    out["makespan_req_s"] = len(ok) / out["makespan_s"] if out["makespan_s"] > 0 else None
    return out


def context_limit_hits(records: Sequence[RequestRecord]) -> int:
    """Natural-lane requests that stopped at their remaining context window rather than at a stop token."""
    return sum(1 for r in records if r.ok and not r.ignore_eos and r.finish_reason == "length")


def summarize_cell(cell: CellResult) -> dict:
    hits = context_limit_hits(cell.records) if cell.lane == "natural" else None
    cell.summary = summarize(cell.records, cell.rate, hits)
    return cell.summary


def flat_metrics(summary: dict) -> dict[str, float]:
    """The scalar metrics compared between arms: e2e_mean, e2e_p99, ..., makespan, window throughput."""
    out: dict[str, float] = {}
    for name in LATENCIES:
        for stat in ("mean", "p50", "p90", "p99"):
            v = summary[name][stat]
            if v is not None:
                out[f"{name}_{stat}"] = v
    for key in ("makespan_s", "drain_s", "window_output_tok_s", "window_req_s", "makespan_req_s"):
        if summary.get(key) is not None:
            out[key] = summary[key]
    return out
