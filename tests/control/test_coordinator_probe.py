"""runtime/coordinator_probe.py on real sockets: a port whose process takes no connection (as a
stopped one) is "stopped" over one held connection however often it is asked; a running gRPC
server, a closed port, a proxy that closes, a process that dies while held: not stopped."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from hetlaunch.runtime.coordinator_probe import CoordinatorProbe

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def silent_listener():
    """A listening socket nothing accepts from: what the kernel offers for a stopped process."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield sock
    sock.close()


def _queued(listener: socket.socket) -> int:
    """How many connections wait in the listener's accept queue (accepted here to count them)."""
    listener.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def test_a_port_nothing_accepts_from_is_stopped_over_one_held_connection(silent_listener):
    probe = CoordinatorProbe(f"127.0.0.1:{silent_listener.getsockname()[1]}")
    assert all(probe.stopped() for _ in range(20))
    # one connection for the whole silence: one per check filled a stopped coordinator's queue
    assert _queued(silent_listener) == 1
    probe.end_silence()


def test_a_process_that_dies_while_held_is_gone(silent_listener):
    probe = CoordinatorProbe(f"127.0.0.1:{silent_listener.getsockname()[1]}")
    assert probe.stopped()
    silent_listener.close()  # the process died: its queued connections are reset
    assert not probe.stopped()


def test_a_running_grpc_server_is_not_stopped_and_a_closed_port_is_gone():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert not CoordinatorProbe(f"127.0.0.1:{port}").stopped()  # its HTTP/2 settings came at once
    finally:
        server.stop(None).wait()
    assert not CoordinatorProbe(f"127.0.0.1:{port}").stopped()  # refused


def _until_not_stopped(probe: CoordinatorProbe) -> bool:
    """Ask until the probe says "not stopped" (what the other side does may come a moment later)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not probe.stopped():
            return True
        time.sleep(0.05)
    return False


def _serve_once(listener: socket.socket, say: bytes) -> threading.Thread:
    """Accept one connection, send `say` on it (nothing: close it at once), and leave it so."""
    held = []

    def serve():
        conn, _ = listener.accept()
        if say:
            conn.sendall(say)
            held.append(conn)  # kept open: a running server goes on
        else:
            conn.close()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_proxy_that_closes_the_connection_is_not_stopped(silent_listener):
    """An `ssh -L` or TCP proxy in front of a coordinator that is gone accepts, then closes."""
    _serve_once(silent_listener, b"")
    assert _until_not_stopped(CoordinatorProbe(f"127.0.0.1:{silent_listener.getsockname()[1]}"))


def test_the_verdict_is_asked_afresh_after_the_coordinator_answered(silent_listener):
    """Said "not stopped" once (a running server's first bytes), a later silence is asked about
    again on a new connection, which nothing accepts now."""
    probe = CoordinatorProbe(f"127.0.0.1:{silent_listener.getsockname()[1]}")
    _serve_once(silent_listener, b"\x00").join(timeout=0)
    assert _until_not_stopped(probe)
    assert not probe.stopped()  # the verdict holds for the rest of this silence
    probe.end_silence()
    assert probe.stopped()
    probe.end_silence()
