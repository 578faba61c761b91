"""`vskipper serve` as a child process: start it, wait for `/health`, talk to it, always stop it.

The demo and the server tests both start servers this way. Each server runs in its own session (process group),
so the terminal's Ctrl-C reaches only the caller, whose `finally` then ends the whole group (SGLang's HTTP
process, scheduler and detokenizer) with SIGTERM, and SIGKILL if it lingers.

Ports: SGLang picks its own internal port (torch.distributed's store) as "any free port" and binds it seconds later,
in the scheduler; on a busy host an outgoing connection's source port can take it in between, and the scheduler dies
with EADDRINUSE. The HTTP port is therefore picked outside the kernel's ephemeral range (no source port lands there),
and a server that dies of a port collision before it answers is started again (`RELAUNCHES` times).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from vskipper.serveargs import serve_argv

STARTUP_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 60
STOP_TIMEOUT_S = 20
RELAUNCHES = 2
# Below the kernel's ephemeral range; the lowest port `free_port` picks.
PORT_FLOOR = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_COLLISION = "address already in use"
LOG_TAIL_CHARS = 3000  # how much of a server's log an error shows
_STARTED_AGAIN = "\n--- started again: the start above died of a port collision ---\n"
# The directory holding the imported `vskipper` package: put on the child's path so it serves this same code.
_CODE_ROOT = Path(__file__).resolve().parents[2]


def ephemeral_floor() -> int:
    """The lowest port the kernel hands out as an outgoing connection's source port (Linux's default 32768)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A loopback port free now, drawn at random below the ephemeral range, so that no outgoing connection takes
    it before the server binds it, and side-by-side callers rarely draw the same one; the kernel's pick where that
    range leaves no room below it."""
    top = ephemeral_floor()
    if top - PORT_FLOOR >= 1000:
        for _ in range(200):
            port = random.randrange(PORT_FLOOR, top)
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, str]:
    """GET (no body) or POST a JSON body; (status, text), also for HTTP error statuses."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def serve_command(model: str | Path, port: int, state_file: Path, *, arm: str | None = None,
                  arm_file: Path | None = None, enter_tokens: int | None = None, exit_tokens: int | None = None,
                  dtype: str | None = "float32", extra: Sequence[str] = (), platform: str | None = None,
                  tile_table: Path | None = None, prefill_floor_tokens: int | None = None,
                  stand_in_ops: str | None = None) -> list[str]:
    """The `vskipper serve` command line for one server on 127.0.0.1:port (SGLang flags after `--`); `platform`
    (cpu | gpu) overrides serve's detection; `tile_table`, a table measured on this GPU (`--tile-table`);
    `prefill_floor_tokens`, the prefill switch's floor (`--prefill-floor-tokens`); `stand_in_ops`, the CUDA
    stand-ins' RMSNorm, SiLU-and-mul and RoPE (`--stand-in-ops`; None: serve's default)."""
    if (arm is None) == (arm_file is None):
        raise ValueError("serve_command: pass exactly one of arm and arm_file")
    thresholds = enter_tokens is not None or exit_tokens is not None
    flags = serve_argv({"model": model, "arm": arm, "arm_file": arm_file, "port": port, "state_file": state_file,
                        "enter_tokens": enter_tokens if thresholds else None,
                        "exit_tokens": exit_tokens if thresholds else None, "platform": platform,
                        "tile_table": tile_table, "prefill_floor_tokens": prefill_floor_tokens,
                        "stand_in_ops": stand_in_ops})
    return [sys.executable, "-m", "vskipper.cli", "serve", *flags, "--", *(("--dtype", dtype) if dtype else ()),
            *extra]


class ServerGone(ConnectionError):
    """A request the server dropped or refused (its connection reset, closed without a response, refused): the
    message says whether the server's process still runs and ends with its log's tail, where the cause is."""


class Server:
    """A started `vskipper serve` child process on a loopback port."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path, graceful: bool = True,
                 relaunch: Callable[[], subprocess.Popen] | None = None) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"
        # graceful: SIGTERM first (SGLang drains its requests, about 5 s); otherwise the group is killed at once
        self.graceful = graceful
        # Starts the same command again, its output appended to the same log (see the module's note on ports).
        self.relaunch = relaunch
        self.relaunches = 0

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> Server:
        """Block until `/health` answers 200; raises with the log's tail if the process exits or time runs out.
        A server that died of a port collision is started again, up to `RELAUNCHES` times."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                this_start = tail.rsplit(_STARTED_AGAIN, 1)[-1]
                if self.relaunch is not None and self.relaunches < RELAUNCHES and _COLLISION in this_start.lower():
                    self._signal_group(signal.SIGKILL)  # whatever of the dead start still runs
                    self.relaunches += 1
                    self.proc = self.relaunch()
                    deadline = time.monotonic() + timeout
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{tail}")
            try:
                if http(self.url + "/health", timeout=5)[0] == 200:
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not up in {timeout:g} s:\n{self.log_tail()}")
            time.sleep(1)

    def terminate(self) -> None:
        """Send SIGTERM (SIGKILL where not graceful) to the server's whole process group, without waiting."""
        self._signal(signal.SIGTERM if self.graceful else signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self._signal_group(sig)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL if it lingers; where not graceful,
        SIGKILL at once (idempotent)."""
        if self.proc.poll() is not None:
            return
        self.terminate()
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def request(self, path: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, str]:
        """`http` on this server: GET (no body) or POST; (status, text). A request the server drops or refuses
        raises `ServerGone`, which says whether the process still runs and ends with its log's tail."""
        try:
            return http(self.url + path, body, timeout)
        except OSError as exc:
            method = "GET" if body is None else "POST"
            exit_code = self.proc.poll()
            state = "still runs" if exit_code is None else f"exited with {exit_code}"
            raise ServerGone(f"{method} {path} on port {self.port}: {exc!r}; the server {state}; "
                             f"its log ({self.log}) ends:\n{self.log_tail()}") from exc

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(unreadable: {exc})"

    def get_json(self, path: str) -> dict:
        status, text = self.request(path)
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status} {text[:300]}")
        return json.loads(text)

    def post_json(self, path: str, body: dict) -> dict:
        status, text = self.request(path, body)
        if status != 200:
            raise RuntimeError(f"POST {path}: HTTP {status} {text[:300]}")
        return json.loads(text)

    def generate_ids(self, input_ids: list[int], n: int) -> list[int]:
        out = self.post_json("/generate", {"input_ids": input_ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": n, "ignore_eos": True}})
        return out["output_ids"]

    def metrics(self) -> str:
        status, text = self.request("/metrics")
        if status != 200:
            raise RuntimeError(f"GET /metrics: HTTP {status} {text[:300]}")
        return text


def stop_all(servers: Sequence[Server]) -> None:
    """Stop several servers side by side (SGLang takes a few seconds to wind down after SIGTERM)."""
    for server in servers:
        server.terminate()
    for server in servers:
        server.stop()


@contextmanager
def launched(model: str | Path, workdir: Path, *, arm: str | None = None, arm_file: Path | None = None,
             enter_tokens: int | None = None, exit_tokens: int | None = None, dtype: str | None = "float32",
             extra: Sequence[str] = (), env: Mapping[str, str] | None = None,
             platform: str | None = None, graceful: bool = True, tile_table: Path | None = None,
             prefill_floor_tokens: int | None = None, stand_in_ops: str | None = None) -> Iterator[Server]:
    """Start `vskipper serve` on a free port (log and state file in `workdir`) without waiting for it; the
    server is stopped when the block exits, however it exits (`graceful`: see `Server`). `env` adds variables
    to the server's environment (TRITON_INTERPRET only where `env` sets it: a test serving the triton execution on
    CPU)."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"server-{port}.log"
    cmd = serve_command(model, port, workdir / f"state-{port}.json", arm=arm, arm_file=arm_file,
                        enter_tokens=enter_tokens, exit_tokens=exit_tokens, dtype=dtype, extra=extra,
                        platform=platform, tile_table=tile_table, prefill_floor_tokens=prefill_floor_tokens,
                        stand_in_ops=stand_in_ops)
    asked = dict(env or {})
    env = dict(os.environ, **asked,
               PYTHONPATH=os.pathsep.join(p for p in (str(_CODE_ROOT), os.environ.get("PYTHONPATH")) if p))
    if "TRITON_INTERPRET" not in asked:
        env.pop("TRITON_INTERPRET", None)

    def spawn(mode: str = "w") -> subprocess.Popen:
        with open(log, mode) as out:
            if mode == "a":
                out.write(_STARTED_AGAIN)
                out.flush()
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)

    server = Server(spawn(), port, log, graceful, relaunch=lambda: spawn("a"))
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def serve(model: str | Path, workdir: Path, *, arm: str | None = None, arm_file: Path | None = None,
          enter_tokens: int | None = None, exit_tokens: int | None = None, dtype: str | None = "float32",
          extra: Sequence[str] = (), env: Mapping[str, str] | None = None,
          prefill_floor_tokens: int | None = None) -> Iterator[Server]:
    """`launched`, then wait for `/health`: yields a serving Server; stops it after."""
    with launched(model, workdir, arm=arm, arm_file=arm_file, enter_tokens=enter_tokens, exit_tokens=exit_tokens,
                  dtype=dtype, extra=extra, env=env, prefill_floor_tokens=prefill_floor_tokens) as server:
        yield server.wait_ready()
