"""What one request and one cell leave behind: raw per-request records and the cell's counters.

Times are seconds on the driver's monotonic clock relative to the cell's start (the scheduled arrival 0).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# The stamps `RequestRecord.ttft_parts` reads from SGLang's meta_info (0.5.21, with --enable-metrics): when the
# tokenizer received the request, the scheduler first ran it forward and processed its prefill's result (wall
# clock), and the tokenizer's time to its first token.
SERVER_TIMES = ("request_received_ts", "forward_entry_time", "prefill_finished_time", "first_token_latency")


@dataclass
class RequestRecord:
    index: int
    request_id: str
    scheduled_s: float  # arrival time in the schedule
    prompt_tokens: int
    max_new_tokens: int
    ignore_eos: bool
    submit_s: float | None = None  # when the request was sent
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # one entry per output token
    finish_s: float | None = None
    output_ids: list[int] | None = None  # server-reported, when the endpoint reports ids
    output_tokens: int = 0  # server-reported count (completion_tokens), else len(output_ids)
    finish_reason: str | None = None  # "stop" | "length" | ...
    text: str = ""
    error: str | None = None
    # SGLang's own stamps of the request (`SERVER_TIMES`), from its events' meta_info where the server runs with
    # --enable-metrics: wall-clock seconds, and the tokenizer's own first-token latency
    server_times: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_s is not None

    @property
    def e2e_s(self) -> float | None:
        if not self.ok or self.submit_s is None:
            return None
        return self.finish_s - self.submit_s

    @property
    def ttft_s(self) -> float | None:
        if not self.ok or self.submit_s is None or self.first_token_s is None:
            return None
        return self.first_token_s - self.submit_s

    @property
    def tpot_s(self) -> float | None:
        """Mean inter-token interval: (last token - first token) / (tokens - 1); None below 2 tokens."""
        if not self.ok or self.output_tokens < 2 or not self.token_times_s or self.first_token_s is None:
            return None
        return (self.token_times_s[-1] - self.first_token_s) / (self.output_tokens - 1)

    def ttft_parts(self) -> dict[str, float] | None:
        """Where the time to the first token went, in seconds, from SGLang's stamps (None without them): from the
        tokenizer's receipt to the scheduler's first forward of the request (`scheduled`: the hand-over and the
        queue), from there to the scheduler's processing of the prefill's result (`forward`: the pass's launches,
        the device, and whatever the scheduler ran before it read the result), from there to the tokenizer's
        first token (`output`), and the rest of the client's TTFT (`http`: the request's way in and the first
        token's way out). `forward` is read on the scheduler's clock alone, `http` from durations; `scheduled`
        and `output` each span the tokenizer's clock and the scheduler's, which SGLang sets once per process from
        `time.time() - time.perf_counter()` (two calls a busy host can preempt between): each may be off by
        that difference, milliseconds on a loaded host, and their sum is not."""
        t = self.server_times
        if self.ttft_s is None or not all(k in t for k in SERVER_TIMES):
            return None
        received = t["request_received_ts"]
        scheduled = t["forward_entry_time"] - received
        forward = t["prefill_finished_time"] - t["forward_entry_time"]
        first = t["first_token_latency"]
        return {"scheduled": scheduled, "forward": forward, "output": first - scheduled - forward,
                "http": self.ttft_s - first}

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(e2e_s=self.e2e_s, ttft_s=self.ttft_s, tpot_s=self.tpot_s)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class CellResult:
    """One arm's run of one cell (suite x rate x lane x repetition)."""

    arm_name: str
    lane: str  # natural | matched
    rate: float
    duration_s: float
    seed: int
    suite_name: str
    suite_digest: str
    suite_size: int
    repetition: int = 0
    records: list[RequestRecord] = field(default_factory=list)
    submitted: int = 0  # requests handed to the client at their arrival time
    started: int = 0  # requests whose HTTP exchange began (a response status arrived)
    completed: int = 0  # requests whose stream ended normally
    attestation_before: dict | None = None
    attestation_after: dict | None = None
    summary: dict | None = None

    @property
    def reported(self) -> int:
        return len(self.records)

    def as_dict(self) -> dict[str, Any]:
        return {
            "arm": self.arm_name, "lane": self.lane, "rate": self.rate, "duration_s": self.duration_s,
            "seed": self.seed, "suite": {"name": self.suite_name, "digest": self.suite_digest,
                                         "size": self.suite_size},
            "repetition": self.repetition, "submitted": self.submitted, "started": self.started,
            "completed": self.completed, "reported": self.reported,
            "attestation_before": self.attestation_before, "attestation_after": self.attestation_after,
            "summary": self.summary, "records": [r.as_dict() for r in self.records],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CellResult:
        suite = d["suite"]
        return cls(arm_name=d["arm"], lane=d["lane"], rate=d["rate"], duration_s=d["duration_s"], seed=d["seed"],
                   suite_name=suite["name"], suite_digest=suite["digest"], suite_size=suite["size"],
                   repetition=d.get("repetition", 0),
                   records=[RequestRecord.from_dict(r) for r in d["records"]], submitted=d["submitted"],
                   started=d["started"], completed=d["completed"],
                   attestation_before=d.get("attestation_before"), attestation_after=d.get("attestation_after"),
                   summary=d.get("summary"))
