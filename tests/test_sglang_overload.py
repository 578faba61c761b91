"""The real SGLang 0.5.21 server on CPU under overload and under malformed requests.

Overload: 24 concurrent requests (200 prompt + 128 output tokens) into a 4096-token KV pool make SGLang retract
running requests and re-admit them later (a re-admitted request re-prefills its prompt plus the tokens it had
generated). SGLang admits a round only while every new request's prompt plus its whole output fits beside what
the running requests still reserve, a share of their remaining output (the new-token ratio; the servers start it
at 0.3 instead of 0.7, and `ignore_eos` would make it 1, so the requests ask for their exact length with
`min_new_tokens`). A round alone therefore never overflows the pool (a dozen fit exactly): the first 8 requests
are sent alone and, once they decode, the other 16, of which about 8 are admitted beside them; the pool overflows
about 60 decode steps later. Each routed arm must complete every request with exactly the tokens asked for, stay healthy, and pass
SGLang's own idle pool-accounting check (a double free of KV slots makes it raise `pool memory leak detected` the
first time the scheduler idles). The hybrid arm's thresholds are low enough that prefill and decode modes differ
for most requests, which is what sends the prefix-cache insert through vSkipper's limit: its first round (a dozen
prompts, over the 1536-token prefill floor) prefills routed, and a request retracted from it is re-admitted in a
small round that prefills dense while decode stays routed.

Bad requests: each gets a 400 that names the field, on /generate, /v1/completions and /v1/chat/completions
(streaming too), and the server keeps serving. A vocabulary-range id, or a top-logprob count above the
vocabulary, would otherwise kill SGLang's scheduler and every request in flight with it.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("sglang")

from tests.sglang_world import http, serve  # noqa: E402

pytestmark = pytest.mark.server  # every test overloads a real SGLang server

POOL_TOKENS = 4096
CONCURRENT, PROMPT_TOKENS, OUTPUT_TOKENS = 24, 200, 128
FIRST_ROUND = 8  # 1600 prompt tokens: over the prefill floor, a routed round for the hybrid arm
ONE_TOKEN_REQUESTS, QUEUED_REQUESTS = 16, 24  # the queued ones' tokens are more than the pool holds
HYBRID_ENTER, HYBRID_EXIT = 1500, 1000  # resident tokens: the running batch crosses both under this load
LOAD_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def served_model(served_flexidepth):
    return served_flexidepth


def _prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def _generate(url: str, ids: list[int], n: int, rid: str | None = None) -> tuple[int, dict | str]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "min_new_tokens": n}}
    if rid is not None:
        body["rid"] = rid
    status, text = http(url + "/generate", body, timeout=LOAD_TIMEOUT_S)
    return status, (json.loads(text) if status == 200 else text)


def _decoding(att: dict) -> int:
    return sum(att["requests_total"]["decode"].values())


def _wait_until_decoding(server, n: int, since: dict) -> None:
    """Poll the attestation until `n` more requests than in `since` have started decoding."""
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while _decoding(server.get_json("/vskipper/attestation")) - _decoding(since) < n:
        assert time.monotonic() < deadline, f"{n} requests never started decoding"
        assert server.proc.poll() is None, server.log.read_text()[-3000:]
        time.sleep(0.05)


def _settle(server) -> None:
    """Wait until the scheduler has idled once after the load, and prove it survived its idle checks.

    SGLang answers /health_generate only from a fully idle scheduler, right before that same idle step runs its
    pool-accounting check; the request after it is scheduled only once that check has passed."""
    deadline = time.monotonic() + 120
    while http(server.url + "/health_generate", timeout=30)[0] != 200:
        assert time.monotonic() < deadline, "the scheduler never became idle after the load"
        assert server.proc.poll() is None, server.log.read_text()[-3000:]
    status, out = _generate(server.url, _prompt(999, 16), 4)
    assert status == 200 and len(out["output_ids"]) == 4, out


ARMS = {
    "hybrid": dict(arm="hybrid", enter_tokens=HYBRID_ENTER, exit_tokens=HYBRID_EXIT),
    "decode-only-always": dict(arm="decode-only-always"),
    "always-route": dict(arm="always-route"),
}
OVERCOMMIT_ENV = {"SGLANG_INIT_NEW_TOKEN_RATIO": "0.3"}


@pytest.fixture(scope="module", params=sorted(ARMS))
def overloaded(request, served_model, tmp_path_factory):
    """One routed arm's server after the overload: (arm, server, [(status, output)], log text, attestation before
    the load, attestation after it)."""
    name = request.param
    with serve(served_model, tmp_path_factory.mktemp(f"overload-{name}"), **ARMS[name], env=OVERCOMMIT_ENV,
               extra=("--max-total-tokens", str(POOL_TOKENS), "--enable-metrics")) as server:
        before = server.get_json("/vskipper/attestation")  # SGLang's start-up warm-up request is counted here
        with ThreadPoolExecutor(CONCURRENT) as pool:
            first = [pool.submit(_generate, server.url, _prompt(i), OUTPUT_TOKENS) for i in range(FIRST_ROUND)]
            _wait_until_decoding(server, FIRST_ROUND, before)
            rest = [pool.submit(_generate, server.url, _prompt(i), OUTPUT_TOKENS)
                    for i in range(FIRST_ROUND, CONCURRENT)]
            results = [f.result() for f in first + rest]
        _settle(server)
        yield name, server, results, server.log.read_text(), before, server.get_json("/vskipper/attestation")


def test_overload_retracts_requests_and_every_request_completes(overloaded):
    name, server, results, log, _, _ = overloaded
    assert "KV cache pool is full. Retract requests." in log, f"{name}: the load did not make SGLang retract"
    failed = [(status, out) for status, out in results if status != 200]
    assert not failed, f"{name}: {len(failed)} of {CONCURRENT} requests failed, first: {failed[0]}"
    assert all(len(out["output_ids"]) == OUTPUT_TOKENS for _, out in results)


def test_overload_leaves_the_kv_pool_consistent_and_the_server_healthy(overloaded):
    name, server, _, log, _, _ = overloaded
    assert server.proc.poll() is None
    assert http(server.url + "/health")[0] == 200
    for symptom in ("memory leak detected", "Traceback", "AssertionError"):
        assert symptom not in log, f"{name}: {symptom!r} in the server log:\n{log[-3000:]}"


def test_overload_counts_each_request_once_and_keeps_no_record_behind(overloaded):
    name, _, _, _, before, after = overloaded

    def counted(att: dict, phase: str) -> int:
        return sum(att["requests_total"][phase].values())

    for phase in ("prefill", "decode"):  # the load plus the settling request; health probes are not requests
        assert counted(after, phase) - counted(before, phase) == CONCURRENT + 1, (name, after["requests_total"])
    assert after["retractions_total"] > 0
    assert after["requests_tracked"] == 0 and after["resident_tokens"] == 0, name
    assert after["health_check_passes_total"].get("prefill", 0) >= 1


def test_one_token_requests_and_queue_aborts_leave_no_record_behind(overloaded):
    name, server, *_ = overloaded
    with ThreadPoolExecutor(ONE_TOKEN_REQUESTS) as pool:  # finish on their prefill pass: they never decode
        assert all(s == 200 for s, _ in pool.map(lambda i: _generate(server.url, _prompt(100 + i, 8), 1),
                                                 range(ONE_TOKEN_REQUESTS)))
    rids = [f"queued-{name}-{i}" for i in range(QUEUED_REQUESTS)]
    with ThreadPoolExecutor(len(rids)) as pool:  # more than the pool holds: the later ones wait in the queue
        pending = [pool.submit(_generate, server.url, _prompt(200 + i), OUTPUT_TOKENS, rid)
                   for i, rid in enumerate(rids)]
        for rid in rids[::2]:
            assert http(server.url + "/abort_request", {"rid": rid})[0] == 200
        statuses = [f.result()[0] for f in pending]
    assert all(statuses[i] == 200 for i in range(1, len(rids), 2)), statuses  # the others completed
    _settle(server)
    att = server.get_json("/vskipper/attestation")
    assert att["requests_tracked"] == 0 and att["resident_tokens"] == 0, (name, att["requests_tracked"])
