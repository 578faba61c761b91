"""The open-loop driver and the two lanes.

A cell sends every request of the suite at its seeded Poisson arrival time over the declared duration
(requests / rate), with no client-side concurrency cap, and waits for every request to finish. Nothing is cut
off: a cell's statistics cover all of its requests.

Lanes:
- natural: each request generates to its own stop, capped by its remaining context window
  (context_len - prompt tokens, or the suite's per-request cap); a stop at that cap counts as a context-limit hit.
- matched: each request replays, with ignore_eos, the output length the baseline generated for it naturally
  at the cell's rate (`record_lengths`), so both arms do the same work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from loadgen.arrivals import declared_duration, poisson_arrivals
from loadgen.client import Endpoint, fetch_attestation, stream_request
from loadgen.metrics import summarize_cell
from loadgen.records import CellResult, RequestRecord
from loadgen.suite import Suite

LANES = ("natural", "matched")


@dataclass(frozen=True)
class CellPlan:
    suite: Suite
    rate: float
    lane: str
    seed: int
    max_new_tokens: Mapping[str, int]  # per request id
    repetition: int = 0

    def __post_init__(self) -> None:
        if self.lane not in LANES:
            raise ValueError(f"lane must be one of {LANES}, got {self.lane!r}")
        declared_duration(len(self.suite), self.rate)
        missing = [r.id for r in self.suite.requests if r.id not in self.max_new_tokens]
        if missing:
            raise ValueError(f"plan: no max_new_tokens for request {missing[0]!r}")

    @property
    def duration_s(self) -> float:
        return declared_duration(len(self.suite), self.rate)

    @property
    def ignore_eos(self) -> bool:
        return self.lane == "matched"


def natural_plan(suite: Suite, rate: float, seed: int, *, context_len: int | None = None,
                 max_new_tokens: int | None = None, repetition: int = 0) -> CellPlan:
    """Each request may generate up to its remaining context window (or a suite / global cap)."""
    caps: dict[str, int] = {}
    for r in suite.requests:
        cap = r.max_new_tokens or max_new_tokens
        if context_len is not None:
            remaining = context_len - r.prompt_tokens
            if remaining < 1:
                raise ValueError(f"request {r.id!r}: prompt of {r.prompt_tokens} tokens leaves no room in "
                                 f"context_len {context_len}")
            cap = min(cap, remaining) if cap else remaining
        if not cap:
            raise ValueError(f"request {r.id!r}: natural lane needs context_len or a max_new_tokens cap")
        caps[r.id] = cap
    return CellPlan(suite, rate, "natural", seed, caps, repetition)


def matched_plan(suite: Suite, rate: float, seed: int, lengths: Mapping[str, int], repetition: int = 0) -> CellPlan:
    """Replay the recorded lengths with ignore_eos (a recorded 0 replays as 1: servers need >= 1 new token)."""
    missing = [r.id for r in suite.requests if r.id not in lengths]
    if missing:
        raise ValueError(f"matched lane: no recorded length for request {missing[0]!r}")
    return CellPlan(suite, rate, "matched", seed, {rid: max(1, int(n)) for rid, n in lengths.items()}, repetition)


def record_lengths(cell: CellResult) -> dict[str, int]:
    """The per-request output lengths of a natural-lane cell, for the matched lane."""
    if cell.lane != "natural":
        raise ValueError(f"record_lengths: needs a natural-lane cell, got lane {cell.lane!r}")
    bad = [r.request_id for r in cell.records if not r.ok]
    if bad:
        raise ValueError(f"record_lengths: {len(bad)} requests did not complete (first {bad[0]!r})")
    return {r.request_id: r.output_tokens for r in cell.records}


def client_session() -> aiohttp.ClientSession:
    """The HTTP session cells run on: no timeouts (a cell waits for every request), no connection cap (open loop),
    and one connection per request: a pooled keep-alive connection that the server closes while it sits idle
    (SGLang's uvicorn closes them after 5 s, aiohttp would keep them 15 s) fails the next request sent on it."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=None),
                                 connector=aiohttp.TCPConnector(limit=0, force_close=True))


async def run_cell(endpoint: Endpoint, plan: CellPlan, arm_name: str, *, progress: bool = False,
                   session: aiohttp.ClientSession | None = None) -> CellResult:
    arrivals = poisson_arrivals(len(plan.suite), plan.rate, plan.seed)
    cell = CellResult(arm_name=arm_name, lane=plan.lane, rate=plan.rate, duration_s=plan.duration_s, seed=plan.seed,
                      suite_name=plan.suite.name, suite_digest=plan.suite.digest, suite_size=len(plan.suite),
                      repetition=plan.repetition)
    own = session is None
    if own:
        session = client_session()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(plan.suite), desc=f"{arm_name} {plan.lane} {plan.rate:g} req/s", unit="req")
    try:
        cell.attestation_before = await fetch_attestation(session, endpoint)
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        def started() -> None:
            cell.started += 1

        async def one(rec: RequestRecord, ids) -> None:
            await stream_request(session, endpoint, rec, ids, clock, on_start=started)
            if rec.ok:
                cell.completed += 1
            if bar is not None:
                bar.update(1)

        tasks = []
        for i, (req, at) in enumerate(zip(plan.suite.requests, arrivals, strict=True)):
            rec = RequestRecord(index=i, request_id=req.id, scheduled_s=at, prompt_tokens=req.prompt_tokens,
                                max_new_tokens=plan.max_new_tokens[req.id], ignore_eos=plan.ignore_eos)
            cell.records.append(rec)
            delay = at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            cell.submitted += 1
            tasks.append(asyncio.create_task(one(rec, req.input_ids)))
        await asyncio.gather(*tasks)
        cell.attestation_after = await fetch_attestation(session, endpoint)
    finally:
        if bar is not None:
            bar.close()
        if own:
            await session.close()
    summarize_cell(cell)
    return cell
