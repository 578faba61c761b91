"""Ports of a launched server: the HTTP port is drawn below the kernel's ephemeral range, a server whose start
dies of a port collision is started again, and a request the server drops says what became of it.

The collision is real: the test holds the port SGLang's scheduler binds for torch.distributed's store (pinned with
SGLang's own `--nccl-port`), so the real scheduler dies with EADDRINUSE as it did when an outgoing connection took
the port SGLang had picked; the port is let go once that start has died.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
from sglang_world import launched

from vskipper.sglang import launch


def test_free_port_is_drawn_below_the_ephemeral_range_and_is_free():
    floor = launch.ephemeral_floor()
    ports = {launch.free_port() for _ in range(20)}
    if floor - launch.PORT_FLOOR >= 1000:
        assert all(launch.PORT_FLOOR <= p < floor for p in ports)
    assert len(ports) > 1  # drawn at random, not the same one every time
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def _hold(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _wait_exit(server, timeout: float = 180) -> int:
    deadline = time.monotonic() + timeout
    while server.proc.poll() is None:
        assert time.monotonic() < deadline, server.log.read_text()[-2000:]
        time.sleep(0.5)
    return server.proc.returncode


def test_a_start_that_dies_of_a_port_collision_is_started_again_and_serves(served_flexidepth, tmp_path):
    port = launch.free_port()
    held = _hold(port)
    with launched(served_flexidepth, tmp_path, arm="dense", extra=("--nccl-port", str(port))) as server:
        try:
            _wait_exit(server)
        finally:
            held.close()
        first = server.log.read_text()
        assert "address already in use" in first.lower(), first[-2000:]
        server.wait_ready()
        assert server.relaunches == 1
        assert server.generate_ids([1, 2, 3], 2)
        assert launch._STARTED_AGAIN in server.log.read_text()


def test_a_start_that_dies_of_anything_else_is_not_started_again(served_flexidepth, tmp_path):
    with launched(served_flexidepth, tmp_path, arm="dense", extra=("--no-such-sglang-flag",)) as server:
        with pytest.raises(RuntimeError, match="server exited"):
            server.wait_ready()
        assert server.relaunches == 0


def _drop_one_connection(listener: socket.socket) -> None:
    """Read one whole request (head, then the body its Content-Length gives), then close without a response, as
    a server's process that dies mid-request leaves it (a close with the body unread would reset instead)."""
    conn, _ = listener.accept()
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += conn.recv(65536)
    conn.close()


def test_a_request_the_server_drops_raises_server_gone_with_its_state_and_log_tail(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("... loaded\nScheduler hit an exception: the cause\n")
    port = launch.free_port()
    listener = _hold(port)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        server = launch.Server(alive, port, log, graceful=False)
        threading.Thread(target=_drop_one_connection, args=(listener,), daemon=True).start()
        with pytest.raises(launch.ServerGone, match="(?s)POST /generate on port .*(RemoteDisconnected|"
                                                    "ConnectionResetError).*the server still runs.*Scheduler hit "
                                                    "an exception: the cause") as gone:
            server.generate_ids([1, 2], 2)
        assert isinstance(gone.value, OSError)  # callers that catch OSError still catch it
    finally:
        listener.close()
        alive.kill()
        alive.wait()
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    exited.wait()
    with pytest.raises(launch.ServerGone, match="(?s)GET /vskipper/attestation on port .*the server exited with 3"
                                                ".*the cause"):
        launch.Server(exited, port, log).get_json("/vskipper/attestation")
