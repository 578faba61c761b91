"""Ports of a launched server: the HTTP port is drawn below the kernel's ephemeral range, and a server whose start
dies of a port collision is started again.

The collision is real: the test holds the port SGLang's scheduler binds for torch.distributed's store (pinned with
SGLang's own `--nccl-port`), so the real scheduler dies with EADDRINUSE as it did when an outgoing connection took
the port SGLang had picked; the port is let go once that start has died.
"""

from __future__ import annotations

import socket
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
