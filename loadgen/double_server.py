"""A stand-in streaming server for tests and the demo: it is NOT vSkipper's runtime and runs no model.

It speaks the two protocols the client drives (SGLang's `/generate` SSE stream and `/v1/completions`) and the
attestation contract of `loadgen.attestation`, so the load generator can be exercised end to end on loopback.
Behind the protocol sits a toy continuous-batching engine on the event loop: each admission round is one
prefill pass (`prefill_base_s + prefill_per_token_s * prompt tokens`, which also yields each admitted request's
first token), then decode steps (`decode_base_s + decode_per_row_s * running rows`) give every running request
one token. Latency therefore grows with load, like a real server's.

Generated tokens are deterministic: request r's k-th token is (sum(input_ids) + 7k) % vocab, and its natural
length is 1 + (sum(input_ids) * 2654435761 % 1009) % natural_max (capped by max_new_tokens, after which it
stops with "length"); with ignore_eos it generates exactly max_new_tokens. Passes are counted per phase under
the mode the configured arm declares for that phase; the attested `executed` configuration is the configured one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from loadgen.attestation import DEFAULT_ATTESTATION_PATH
from vskipper.switch import PHASES


@dataclass
class DoubleConfig:
    prefill_base_s: float = 0.002
    prefill_per_token_s: float = 0.00002
    decode_base_s: float = 0.002
    decode_per_row_s: float = 0.0002
    natural_max: int = 24
    vocab: int = 32000
    incremental_ids: bool = False  # stream output_ids as increments instead of the cumulative list
    arm: dict[str, Any] | None = None  # attested as the served design
    executed: dict[str, Any] = field(default_factory=lambda: {"profile": "stand-in", "kv_pool": {"tokens": 0}})
    routed_phases: tuple[str, ...] = ()  # phases whose passes count as routed
    attestation_path: str = DEFAULT_ATTESTATION_PATH
    fail_every: int = 0  # > 0: every n-th request answers HTTP 500 (to exercise the accounting gate)
    late_attestations: int = 0  # the first n attestation reads answer late: "answered": false, no pass counted
    admit_after: int = 0  # > 0: admit nothing until this many requests wait (a client that caps concurrency stalls)


@dataclass
class _Req:
    input_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool
    natural_max: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)

    @property
    def target(self) -> int:
        if self.ignore_eos:
            return self.max_new_tokens
        return min(self.max_new_tokens, natural_length(self.input_ids, self.natural_max))


def natural_length(input_ids: list[int], natural_max: int) -> int:
    return 1 + (sum(input_ids) * 2654435761 % 1009) % natural_max


class DoubleServer:
    def __init__(self, config: DoubleConfig | None = None) -> None:
        self.config = config or DoubleConfig()
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._wake = asyncio.Event()
        self._engine: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self._requests = itertools.count(1)
        self.passes = {p: {"dense": 0, "routed": 0} for p in PHASES}
        self.attestation_reads = 0
        self.url = ""

    # ---- engine --------------------------------------------------------------------------------------------
    def _count(self, phase: str) -> None:
        mode = "routed" if phase in self.config.routed_phases else "dense"
        self.passes[phase][mode] += 1

    def _emit(self, req: _Req) -> None:
        k = len(req.generated)
        req.generated.append((sum(req.input_ids) + 7 * k) % self.config.vocab)
        req.queue.put_nowait(len(req.generated))

    async def _loop(self) -> None:
        c = self.config
        while len(self._waiting) < c.admit_after:
            self._wake.clear()
            await self._wake.wait()
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
            if self._waiting:
                batch, self._waiting = self._waiting, []
                await asyncio.sleep(c.prefill_base_s + c.prefill_per_token_s * sum(len(r.input_ids) for r in batch))
                self._count("prefill")
                for r in batch:
                    self._emit(r)
                    if len(r.generated) < r.target:
                        self._running.append(r)
                    else:
                        r.queue.put_nowait(None)
                continue
            await asyncio.sleep(c.decode_base_s + c.decode_per_row_s * len(self._running))
            self._count("decode")
            still = []
            for r in self._running:
                self._emit(r)
                if len(r.generated) < r.target:
                    still.append(r)
                else:
                    r.queue.put_nowait(None)
            self._running = still

    # ---- HTTP ----------------------------------------------------------------------------------------------
    async def _parse(self, request: web.Request, api: str) -> _Req:
        body = await request.json()
        if api == "generate":
            sp = body.get("sampling_params") or {}
            ids, n, eos = body.get("input_ids"), sp.get("max_new_tokens", 16), sp.get("ignore_eos", False)
        else:
            ids, n, eos = body.get("prompt"), body.get("max_tokens", 16), body.get("ignore_eos", False)
        if not isinstance(ids, list) or not ids:
            raise web.HTTPBadRequest(text="input_ids: required")
        return _Req(list(ids), int(n), bool(eos), self.config.natural_max)

    async def _serve(self, request: web.Request, api: str) -> web.StreamResponse:
        number = next(self._requests)
        req = await self._parse(request, api)
        if self.config.fail_every and number % self.config.fail_every == 0:
            raise web.HTTPInternalServerError(text="injected failure")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self._waiting.append(req)
        self._wake.set()
        sent = 0
        while True:
            done = await req.queue.get() is None
            if not done and len(req.generated) == sent:
                continue  # its token already went out with an earlier chunk
            finish = None
            if done:
                finish = "length" if len(req.generated) >= req.max_new_tokens else "stop"
            chunk = self._chunk(api, req, sent, finish, number)
            sent = len(req.generated)
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if done:
                break
        if api == "completions":
            usage = {"prompt_tokens": len(req.input_ids), "completion_tokens": len(req.generated),
                     "total_tokens": len(req.input_ids) + len(req.generated)}
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _chunk(self, api: str, req: _Req, sent: int, finish: str | None, number: int) -> dict:
        new = req.generated[sent:]
        if api == "generate":
            reason = None
            if finish == "length":
                reason = {"type": "length", "length": len(req.generated)}
            elif finish == "stop":
                reason = {"type": "stop", "matched": 2}
            ids = new if self.config.incremental_ids else list(req.generated)
            text = "".join(f" t{t}" for t in (new if self.config.incremental_ids else req.generated))
            return {"text": text, "output_ids": ids,
                    "meta_info": {"id": f"req-{number}", "prompt_tokens": len(req.input_ids),
                                  "completion_tokens": len(req.generated), "cached_tokens": 0,
                                  "finish_reason": reason}}
        return {"id": f"cmpl-{number}", "object": "text_completion",
                "choices": [{"index": 0, "text": "".join(f" t{t}" for t in new), "finish_reason": finish}]}

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "generate")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def _attestation(self, request: web.Request) -> web.Response:
        self.attestation_reads += 1
        late = self.attestation_reads <= self.config.late_attestations
        passes = {p: {m: 0 for m in modes} for p, modes in self.passes.items()} if late else self.passes
        sched = {p: sum(m.values()) for p, m in passes.items()}
        doc = {"passes_total": passes, "scheduler_passes_total": sched, "arm": self.config.arm,
               "executed": self.config.executed}
        return web.json_response({**doc, "answered": False} if late else doc)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> DoubleServer:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get(self.config.attestation_path, self._attestation)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        self.url = f"http://{bound[0]}:{bound[1]}"
        self._engine = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> None:
        if self._engine is not None:
            self._engine.cancel()
            try:
                await self._engine
            except asyncio.CancelledError:
                pass
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> DoubleServer:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()


# ---- a separate process, so the client's work does not perturb the server's timing ---------------------------

def _config_from_json(text: str) -> DoubleConfig:
    data = json.loads(text)
    if "routed_phases" in data:
        data["routed_phases"] = tuple(data["routed_phases"])
    return DoubleConfig(**data)


class DoubleServerProcess:
    """Runs a DoubleServer in a child Python process; `url` is set once it listens."""

    def __init__(self, config: DoubleConfig | None = None) -> None:
        self.config = config or DoubleConfig()
        self.url = ""
        self._proc = None

    def __enter__(self) -> DoubleServerProcess:
        import dataclasses
        import subprocess
        import sys

        payload = json.dumps(dataclasses.asdict(self.config))
        self._proc = subprocess.Popen([sys.executable, "-m", "loadgen.double_server", "--config", payload],
                                      stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline().strip()
        if not line.startswith("listening "):
            self._proc.kill()
            raise RuntimeError(f"stand-in server did not start (said {line!r})")
        self.url = line.split(" ", 1)[1]
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)


async def _serve_forever(config: DoubleConfig, port: int) -> None:
    server = await DoubleServer(config).start(port=port)
    print(f"listening {server.url}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m loadgen.double_server",
                                     description="stand-in streaming server (no model) for tests and the demo")
    parser.add_argument("--config", default="{}", help="DoubleConfig fields as JSON")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        asyncio.run(_serve_forever(_config_from_json(args.config), args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
