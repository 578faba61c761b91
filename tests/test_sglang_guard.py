"""The request guard in front of SGLang's scheduler, without a server: the rules (`check_request`) and the ASGI
middleware that applies them (driven by hand with ASGI messages, as uvicorn would).

The server test (tests/test_sglang_serve.py, TestDenseArm) sends the same kinds of request to the real SGLang
server on all three APIs and checks that it keeps serving."""

from __future__ import annotations

import asyncio
import json

import pytest

from vskipper.sglang.guard import BadRequest, RequestGuard, check_request, vocab_size

VOCAB = 100


@pytest.mark.parametrize("path,body,field", [
    ("/generate", {"input_ids": [1, 100]}, "input_ids[1]"),
    ("/generate", {"input_ids": [[1], [True]]}, "input_ids[1][0]"),  # a bool is no token id
    ("/generate", {"sampling_params": [{"top_k": 5}, {"top_k": 2.5}]}, "sampling_params[1].top_k"),
    ("/generate", {"sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos"),
    ("/generate", {"sampling_params": {"logit_bias": {"x": 1}}}, "sampling_params.logit_bias.x"),
    ("/generate", {"top_logprobs_num": [1, 101]}, "top_logprobs_num[1]"),
    ("/generate", {"token_ids_logprob": [-1]}, "token_ids_logprob[0]"),
    ("/generate", [1, 2], "body"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 100]]}, "prompt[1][1]"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 101}, "top_logprobs"),
    ("/v1/chat/completions", {"logit_bias": {"100": 5}}, "logit_bias.100"),
])
def test_each_rule_names_the_field(path, body, field):
    with pytest.raises(BadRequest) as info:
        check_request(path, body, VOCAB)
    assert info.value.field == field and str(info.value).startswith(field)


@pytest.mark.parametrize("path,body", [
    ("/generate", {"input_ids": [0, 99], "top_logprobs_num": 100, "sampling_params": {"max_new_tokens": 3,
                                                                                       "temperature": 0}}),
    ("/generate", {"text": "hello", "sampling_params": {"temperature": 0.7, "stop_token_ids": [99]}}),
    ("/v1/completions", {"prompt": ["a", "b"], "logprobs": 5, "logit_bias": {"99": -100}}),
    ("/v1/chat/completions", {"messages": [], "top_logprobs": 100, "stop_token_ids": [0]}),
])
def test_valid_requests_pass_up_to_the_vocabulary_edge(path, body):
    check_request(path, body, VOCAB)


def _drive(guard: RequestGuard, path: str, body: bytes, chunks: int = 2) -> tuple[list[dict], bytes | None]:
    """Send one POST through the guard in `chunks` body messages; (messages sent back, body the app read)."""
    seen: dict = {}

    async def app(scope, receive, send):
        parts, more = [], True
        while more:
            message = await receive()
            parts.append(message["body"])
            more = message.get("more_body", False)
        seen["body"] = b"".join(parts)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard.app = app
    size = -(-len(body) // chunks)
    incoming = [{"type": "http.request", "body": body[i:i + size], "more_body": i + size < len(body)}
                for i in range(0, len(body), size)]
    sent: list[dict] = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    asyncio.run(guard({"type": "http", "method": "POST", "path": path}, receive, send))
    return sent, seen.get("body")


def test_the_middleware_refuses_with_400_before_the_app_and_hands_good_bodies_on_unchanged():
    guard = RequestGuard(None, VOCAB)
    sent, read = _drive(guard, "/v1/completions", json.dumps({"prompt": [5, 100], "stream": True}).encode())
    assert read is None and sent[0]["status"] == 400
    error = json.loads(sent[1]["body"])
    assert error["error"]["param"] == "prompt[1]" and "vocabulary" in error["message"]
    good = json.dumps({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}).encode()
    sent, read = _drive(guard, "/generate", good, chunks=3)
    assert read == good and sent[0]["status"] == 200


def test_the_vocabulary_comes_from_the_checkpoint_and_a_config_without_one_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 128256}))
    assert vocab_size(tmp_path) == 128256
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_size(tmp_path)
