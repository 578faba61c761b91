"""A guard in front of SGLang's scheduler: requests that would kill it get a 400 naming the field.

SGLang 0.5.21 passes a token id outside the model's vocabulary (or negative) straight to the embedding, and a
top-logprob count above the vocabulary straight to `topk`: either raises inside the scheduler process, and the
whole server dies with every request in flight. Its native `/generate` also turns a string where a number
belongs into a 500 with a traceback. The guard reads each request body before SGLang's handlers do, on the three
generation APIs, streaming or not, and refuses such a request with 400 and the field's path
(`sampling_params.max_new_tokens`, `input_ids[1][3]`, `top_logprobs`). The OpenAI APIs keep their own
pydantic type checks; the guard adds the vocabulary rules to them.

`check_request` is pure; `install_request_guard` wraps SGLang's FastAPI app in an ASGI middleware that buffers the
body once and hands the same bytes on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

GENERATE, COMPLETIONS, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
GUARDED_PATHS = (GENERATE, COMPLETIONS, CHAT)


class BadRequest(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _token_id(field: str, value: Any, vocab: int) -> None:
    if not _is_int(value):
        raise BadRequest(field, f"a token id must be an integer, got {value!r}")
    if not 0 <= value < vocab:
        raise BadRequest(field, f"token id {value} is outside the model's vocabulary [0, {vocab})")


def _token_ids(field: str, value: Any, vocab: int, nested: bool = True) -> None:
    """A list of token ids, or (nested) a list of such lists."""
    if not isinstance(value, list):
        raise BadRequest(field, f"expected a list of token ids, got {type(value).__name__}")
    for i, item in enumerate(value):
        if nested and isinstance(item, list):
            _token_ids(f"{field}[{i}]", item, vocab, nested=False)
        else:
            _token_id(f"{field}[{i}]", item, vocab)


def _logit_bias(field: str, value: Any, vocab: int) -> None:
    if not isinstance(value, dict):
        raise BadRequest(field, f"expected an object of token id -> bias, got {type(value).__name__}")
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadRequest(f"{field}.{key}", "a logit_bias key must be a token id") from None
        _token_id(f"{field}.{key}", token, vocab)
        if not _is_number(bias):
            raise BadRequest(f"{field}.{key}", f"a bias must be a number, got {bias!r}")


def _top_count(field: str, value: Any, vocab: int) -> None:
    if not _is_int(value):
        raise BadRequest(field, f"expected an integer, got {value!r}")
    if not 0 <= value <= vocab:
        raise BadRequest(field, f"{value} is outside [0, {vocab}] (the model's vocabulary)")


def _typed(field: str, value: Any, kind: str) -> None:
    ok = {"int": _is_int, "number": _is_number, "bool": lambda v: isinstance(v, bool)}[kind]
    if value is not None and not ok(value):
        raise BadRequest(field, f"expected {'an integer' if kind == 'int' else 'a ' + kind}, got {value!r}")


# SGLang's SamplingParams fields whose wrong type reaches the scheduler as a 500 (the native API has no schema).
SAMPLING_TYPES = {
    "max_new_tokens": "int", "min_new_tokens": "int", "top_k": "int", "n": "int", "sampling_seed": "int",
    "temperature": "number", "top_p": "number", "min_p": "number", "frequency_penalty": "number",
    "presence_penalty": "number", "repetition_penalty": "number",
    "ignore_eos": "bool", "skip_special_tokens": "bool", "no_stop_trim": "bool",
}


def _sampling_params(field: str, params: Any, vocab: int) -> None:
    if not isinstance(params, dict):
        raise BadRequest(field, f"expected an object, got {type(params).__name__}")
    for name, kind in SAMPLING_TYPES.items():
        _typed(f"{field}.{name}", params.get(name), kind)
    if params.get("stop_token_ids") is not None:
        _token_ids(f"{field}.stop_token_ids", params["stop_token_ids"], vocab, nested=False)
    if params.get("logit_bias") is not None:
        _logit_bias(f"{field}.logit_bias", params["logit_bias"], vocab)


def _one_or_list(field: str, value: Any, check: Callable[[str, Any], None]) -> None:
    if isinstance(value, list):
        for i, item in enumerate(value):
            check(f"{field}[{i}]", item)
    else:
        check(field, value)


def _generate(body: dict, vocab: int) -> None:
    if body.get("input_ids") is not None:
        _token_ids("input_ids", body["input_ids"], vocab)
    if body.get("sampling_params") is not None:
        _one_or_list("sampling_params", body["sampling_params"], lambda f, p: _sampling_params(f, p, vocab))
    if body.get("top_logprobs_num") is not None:
        _one_or_list("top_logprobs_num", body["top_logprobs_num"], lambda f, n: _top_count(f, n, vocab))
    if body.get("token_ids_logprob") is not None:
        _token_ids("token_ids_logprob", body["token_ids_logprob"], vocab)
    _typed("logprob_start_len", body.get("logprob_start_len"), "int")


def _openai_common(body: dict, vocab: int) -> None:
    if body.get("stop_token_ids") is not None:
        _token_ids("stop_token_ids", body["stop_token_ids"], vocab, nested=False)
    if body.get("logit_bias") is not None:
        _logit_bias("logit_bias", body["logit_bias"], vocab)


def _completions(body: dict, vocab: int) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, str) for p in prompt):
        _token_ids("prompt", prompt, vocab)
    if body.get("logprobs") is not None:
        _top_count("logprobs", body["logprobs"], vocab)
    _openai_common(body, vocab)


def _chat(body: dict, vocab: int) -> None:
    if body.get("top_logprobs") is not None:
        _top_count("top_logprobs", body["top_logprobs"], vocab)
    _openai_common(body, vocab)


CHECKS = {GENERATE: _generate, COMPLETIONS: _completions, CHAT: _chat}


def check_request(path: str, body: Any, vocab: int) -> None:
    """Raise BadRequest (naming the field) for a request body the scheduler must not see."""
    if not isinstance(body, dict):
        raise BadRequest("body", f"expected a JSON object, got {type(body).__name__}")
    CHECKS[path](body, vocab)


def vocab_size(model_dir: str | Path) -> int:
    """The model's vocabulary: the rows of its embedding, as config.json gives them."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not _is_int(size) or size <= 0:
        raise ValueError(f"--model {model_dir}: config.json has no positive 'vocab_size' ({size!r})")
    return size


def error_body(path: str, exc: BadRequest) -> dict:
    """OpenAI's error shape on every API (SGLang's native errors use the same `error.message`)."""
    return {"error": {"message": str(exc), "type": "BadRequestError", "param": exc.field, "code": 400},
            "object": "error", "message": str(exc)}


class RequestGuard:
    """ASGI middleware: POSTs to the guarded paths are read whole, checked, then handed on unchanged."""

    def __init__(self, app, vocab: int) -> None:
        self.app = app
        self.vocab = vocab

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "").rstrip("/") if scope["type"] == "http" else ""
        if path not in CHECKS or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = None  # not JSON: SGLang's own handler answers it
        if body is not None:
            try:
                check_request(path, body, self.vocab)
            except BadRequest as exc:
                return await _send_json(send, 400, error_body(path, exc))
        return await self.app(scope, _replay([{"type": "http.request", "body": raw, "more_body": False}], receive),
                              send)


def _replay(messages: list[dict], receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


async def _send_json(send, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def install_request_guard(app, vocab: int) -> None:
    """Put the guard in front of SGLang's FastAPI app (before the server starts)."""
    app.add_middleware(RequestGuard, vocab=vocab)
