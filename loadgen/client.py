"""Async streaming clients for SGLang's native `/generate` and the OpenAI-compatible `/v1/completions`.

`/generate` request: {"input_ids": [...], "sampling_params": {"max_new_tokens", "ignore_eos", "temperature": 0},
"stream": true}. The server answers with server-sent events `data: {json}` and a final `data: [DONE]`; each
JSON carries "text", "output_ids" and "meta_info" {"prompt_tokens", "completion_tokens", "finish_reason", ...}.
"output_ids" is cumulative by default and incremental when the server streams incremental output; the count
`completion_tokens` tells which (a chunk whose ids equal the count is cumulative); "text" follows the same
mode.

`/v1/completions` request: {"prompt": [token ids], "max_tokens", "ignore_eos", "temperature": 0,
"stream": true, "stream_options": {"include_usage": true}}; chunks carry choices[0].text and finish_reason, a
final chunk the usage. That endpoint reports no output ids, so work identity cannot be proven from it.

Each token is timestamped when the chunk carrying it arrives (a chunk with k new tokens gives k equal stamps).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from loadgen.attestation import DEFAULT_ATTESTATION_PATH, READ_ATTEMPTS, answered
from loadgen.records import SERVER_TIMES, RequestRecord

APIS = ("generate", "completions")


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    api: str = "generate"
    model: str = "default"
    attestation_path: str | None = DEFAULT_ATTESTATION_PATH  # None: the server attests nothing (upstream)

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"endpoint.api must be one of {APIS}, got {self.api!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint.base_url must start with http:// or https://, got {self.base_url!r}")

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path


def _finish_reason(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        return str(value.get("type")) if value.get("type") is not None else None
    return str(value)


async def _sse_events(response: aiohttp.ClientResponse):
    async for raw in response.content:
        line = raw.decode("utf-8").strip()
        if not line or not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            yield None
            return
        yield json.loads(payload)


def _stamp(record: RequestRecord, new_tokens: int, now: float) -> None:
    if new_tokens <= 0:
        return
    if record.first_token_s is None:
        record.first_token_s = now
    record.token_times_s.extend([now] * new_tokens)


async def _read_generate(response, record: RequestRecord, clock: Callable[[], float]) -> bool:
    ids: list[int] = []
    count = 0
    done = False
    incremental = False
    async for event in _sse_events(response):
        now = clock()
        if event is None:
            done = True
            break
        if "error" in event:
            raise RuntimeError(f"server error: {event['error']}")
        meta = event.get("meta_info") or {}
        chunk_ids = event.get("output_ids")
        reported = meta.get("completion_tokens")
        if chunk_ids is not None:
            chunk_ids = list(chunk_ids)
            if reported is not None and len(chunk_ids) == reported:
                ids = chunk_ids  # cumulative
            elif reported is not None and len(chunk_ids) == reported - count:
                ids = ids + chunk_ids  # incremental
                incremental = True
            elif reported is None and chunk_ids[: len(ids)] == ids and len(chunk_ids) > len(ids):
                ids = chunk_ids
            else:
                ids = ids + chunk_ids
        new_count = reported if reported is not None else len(ids)
        _stamp(record, new_count - count, now)
        count = max(count, new_count)
        text = event.get("text")
        if isinstance(text, str):
            record.text = record.text + text if incremental else text
        reason = _finish_reason(meta.get("finish_reason"))
        if reason is not None:
            record.finish_reason = reason
        if "prompt_tokens" in meta and isinstance(meta["prompt_tokens"], int):
            record.prompt_tokens = meta["prompt_tokens"]
        record.server_times.update({k: float(meta[k]) for k in SERVER_TIMES
                                    if isinstance(meta.get(k), (int, float)) and not isinstance(meta[k], bool)})
    record.output_ids = ids if ids or count == 0 else None
    record.output_tokens = count
    return done or record.finish_reason is not None


async def _read_completions(response, record: RequestRecord, clock: Callable[[], float]) -> bool:
    chunks = 0
    usage = None
    done = False
    async for event in _sse_events(response):
        now = clock()
        if event is None:
            done = True
            break
        if "error" in event:
            raise RuntimeError(f"server error: {event['error']}")
        for choice in event.get("choices") or []:
            text = choice.get("text") or ""
            if text:
                chunks += 1
                _stamp(record, 1, now)
                record.text += text
            if choice.get("finish_reason") is not None:
                record.finish_reason = _finish_reason(choice["finish_reason"])
        if event.get("usage"):
            usage = event["usage"]
    record.output_tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else chunks
    if usage and isinstance(usage.get("prompt_tokens"), int):
        record.prompt_tokens = usage["prompt_tokens"]
    record.output_ids = None
    return done or record.finish_reason is not None


def request_body(endpoint: Endpoint, input_ids: Sequence[int], max_new_tokens: int, ignore_eos: bool) -> dict:
    if endpoint.api == "generate":
        return {"input_ids": list(input_ids), "stream": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos,
                                    "temperature": 0.0}}
    return {"model": endpoint.model, "prompt": list(input_ids), "max_tokens": max_new_tokens,
            "ignore_eos": ignore_eos, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


async def stream_request(session: aiohttp.ClientSession, endpoint: Endpoint, record: RequestRecord,
                         input_ids: Sequence[int], clock: Callable[[], float],
                         on_start: Callable[[], None] | None = None) -> RequestRecord:
    """Send one request, stream it to its end and fill `record` (errors land in `record.error`)."""
    path = "/generate" if endpoint.api == "generate" else "/v1/completions"
    body = request_body(endpoint, input_ids, record.max_new_tokens, record.ignore_eos)
    record.submit_s = clock()
    try:
        async with session.post(endpoint.url(path), json=body) as response:
            if on_start is not None:
                on_start()
            if response.status != 200:
                text = (await response.text())[:200]
                record.error = f"HTTP {response.status}: {text}"
                return record
            reader = _read_generate if endpoint.api == "generate" else _read_completions
            finished = await reader(response, record, clock)
            if not finished:
                record.error = "stream ended before the request finished"
                return record
            record.finish_s = clock()
    except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def fetch_attestation(session: aiohttp.ClientSession, endpoint: Endpoint) -> dict | None:
    """The server's attestation document, or None when the endpoint declares none; read again where the server
    served one older than the read (`answered`), up to `READ_ATTEMPTS` reads, the last taken as it is."""
    if endpoint.attestation_path is None:
        return None
    for _ in range(READ_ATTEMPTS):
        async with session.get(endpoint.url(endpoint.attestation_path)) as response:
            if response.status != 200:
                raise RuntimeError(f"attestation: GET {endpoint.attestation_path} answered HTTP {response.status}")
            data = await response.json()
        if answered(data):
            break
    return data
