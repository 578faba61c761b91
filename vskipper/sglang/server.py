"""The server process `vskipper serve` starts: SGLang 0.5.21's own HTTP server, with vSkipper registered.

    python -m vskipper.sglang.server [SGLang launch flags]     (environment: see `serve_environment`)

Before SGLang starts anything it
  1. registers the skipper config classes with transformers (here and, through the model package, in the
     scheduler process),
  2. checks that the checkpoint's architecture resolves, through SGLang's own registry with the external model
     package, to vSkipper's class (never to the Transformers fallback) and refuses to start otherwise,
  3. adds `GET /vskipper/attestation` to SGLang's FastAPI app: the schedulers' attestation, written fresh for the
     read (each scheduler's state writer answers the read's request stamp), plus the SGLang version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path

from vskipper.serveargs import API_KEY_ENV
from vskipper.sglang import SGLANG_VERSION
from vskipper.sglang.configs import register_configs
from vskipper.sglang.guard import install_request_guard, vocab_size
from vskipper.sglang.replicas import (
    ENV_RUN_ID,
    merge_attestations,
    of_run,
    remove_state_files,
    replica_state_files,
    request_state,
)
from vskipper.sglang.spec import (
    ENV_STATE,
    MODEL_PACKAGE,
    ServeConfigError,
    ServeSpec,
    check_arm_for_model,
    checkpoint_config,
)

ATTESTATION_PATH = "/vskipper/attestation"
FRESH_STATE_TIMEOUT_S = 2.0  # how long a read waits for the schedulers to answer it (then: their latest state)

register_configs()


def resolve_model_class(model_dir: str | Path) -> tuple[str, type]:
    """(architecture, class) as SGLang's registry resolves them with the external package; refuses anything but
    a vSkipper class."""
    from sglang.srt.models.registry import ModelRegistry

    from vskipper.sglang.models import ARCHITECTURES

    config = checkpoint_config(model_dir)
    archs = config.get("architectures") or []
    if not archs or archs[0] not in ARCHITECTURES:
        raise ServeConfigError(f"--model {model_dir}: config field 'architectures' is {archs!r}; vSkipper serves "
                               f"{', '.join(ARCHITECTURES)}")
    cls = ModelRegistry.models.get(archs[0])
    if cls is None or not cls.__module__.startswith(MODEL_PACKAGE):
        raise ServeConfigError(f"architecture {archs[0]!r} did not resolve to vSkipper's model class "
                               f"(got {cls!r}); is SGLANG_EXTERNAL_MODEL_PACKAGE={MODEL_PACKAGE}?")
    return archs[0], cls


def _state_parts(state_file: Path) -> list[dict]:
    parts = []
    for path in replica_state_files(state_file):
        try:
            parts.append(json.loads(path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            continue
    return of_run(parts, os.environ.get(ENV_RUN_ID))


def _merged(parts: list[dict]) -> dict | None:
    return {**merge_attestations(parts), "sglang_version": SGLANG_VERSION} if parts else None


def read_attestation(state_file: Path) -> dict | None:
    """The server's attestation as its replicas last wrote it, merged (None until the first is written)."""
    return _merged(_state_parts(state_file))


async def fresh_attestation(state_file: Path, timeout: float = FRESH_STATE_TIMEOUT_S) -> dict | None:
    """The server's attestation written for this read: every replica's state answers a new request stamp (or,
    past `timeout`, whatever they last wrote). `answered` says which: False where a replica's state is older than
    the read (its counters may lack the latest passes)."""
    stamp = request_state(state_file)
    deadline = time.monotonic() + timeout
    while True:
        parts = _state_parts(state_file)
        answered = bool(parts) and all(p.get("state_request", 0) >= stamp for p in parts)
        if answered or time.monotonic() > deadline:
            merged = _merged(parts)
            return None if merged is None else {**merged, "answered": answered}
        await asyncio.sleep(0.005)


def add_attestation_route(app, state_file: Path) -> None:
    from fastapi.responses import JSONResponse

    @app.get(ATTESTATION_PATH)
    async def vskipper_attestation():
        data = await fresh_attestation(state_file)
        if data is None:
            return JSONResponse({"error": "the scheduler has not written its attestation yet"}, status_code=503)
        return JSONResponse(data)


def _model_path(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--model-path" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--model-path="):
            return arg.split("=", 1)[1]
    raise ServeConfigError("--model-path is required")


def with_api_key(argv: list[str], environ) -> tuple[list[str], str | None]:
    """SGLang's arguments with the API key of `API_KEY_ENV` (a Secret's, in a pod) added, for this process's
    parser alone: (the arguments, the key, or None where none is set). A `--api-key` given as a flag wins."""
    key = environ.get(API_KEY_ENV) or None
    if key is None or any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        return argv, None
    return [*argv, "--api-key", key], key


def mask_in_logs(secret: str) -> None:
    """Every log record of this process has `secret` masked (SGLang logs its resolved arguments, the API key
    among them, when it starts)."""
    make = logging.getLogRecordFactory()

    def record(*args, **kwargs):
        rec = make(*args, **kwargs)
        try:
            message = rec.getMessage()
        except Exception:  # a malformed record fails where logging reports it (at emit), not in the caller
            return rec
        if secret in message:
            rec.msg, rec.args = message.replace(secret, "***"), None
        return rec

    logging.setLogRecordFactory(record)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        spec = ServeSpec.from_env()
        model_dir = _model_path(argv)
        check_arm_for_model(spec.arm, checkpoint_config(model_dir).get("model_type", ""))
        arch, cls = resolve_model_class(model_dir)
        vocab = vocab_size(model_dir)
    except (ServeConfigError, ValueError) as exc:
        print(f"vskipper serve: error: {exc}", file=sys.stderr)
        return 2
    print(f"vskipper: architecture {arch} resolved to {cls.__module__}.{cls.__name__}", file=sys.stderr)
    if spec.state_file is None:
        raise SystemExit(f"{ENV_STATE} must be set")

    from sglang.launch_server import run_server
    from sglang.srt.entrypoints import http_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    os.environ[ENV_RUN_ID] = uuid.uuid4().hex  # inherited by the scheduler processes SGLang spawns
    remove_state_files(spec.state_file)
    add_attestation_route(http_server.app, spec.state_file)
    install_request_guard(http_server.app, vocab)
    load_plugins()
    argv, key = with_api_key(argv, os.environ)
    if key is not None:
        mask_in_logs(key)
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
