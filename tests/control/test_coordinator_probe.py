"""runtime/coordinator_probe.py on real loopback sockets: a port whose process takes no connection
(as a stopped one) is STOPPED over one held connection however often it is asked; a running
gRPC server is RUNNING; a closed port, a process that dies while held and a proxy that closes
are GONE; a coordinator continued and stopped again is seen as it is; no answer at all counts as
STOPPED for a while, then as GONE."""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from hetlaunch.runtime import coordinator_probe
from hetlaunch.runtime.coordinator_probe import GONE, RUNNING, STOPPED, CoordinatorProbe

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def silent_listener():
    """A listening socket nothing accepts from: what the kernel offers for a stopped process."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield sock
    sock.close()


def _address(listener: socket.socket) -> str:
    return f"127.0.0.1:{listener.getsockname()[1]}"


def _queued(listener: socket.socket) -> int:
    """How many connections wait in the listener's accept queue (accepted here to count them)."""
    listener.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            listener.setblocking(True)
            return count
        conn.close()
        count += 1


def _eventually(probe: CoordinatorProbe, want: str) -> list[str]:
    """What the probe said, asked until it says `want` (the other side may act a moment later)."""
    said = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (not said or said[-1] != want):
        said.append(probe.state())
        time.sleep(0.02)
    return said


def test_a_port_nothing_accepts_from_is_stopped_over_one_held_connection(silent_listener):
    probe = CoordinatorProbe(_address(silent_listener))
    assert [probe.state() for _ in range(20)] == [STOPPED] * 20
    # one connection for the whole silence: one per check filled a stopped coordinator's queue
    assert _queued(silent_listener) == 1
    probe.close()


def test_a_process_that_dies_while_held_is_gone(silent_listener):
    probe = CoordinatorProbe(_address(silent_listener))
    assert probe.state() == STOPPED
    silent_listener.close()  # the process died: its queued connections are reset
    assert probe.state() == GONE


def test_a_running_grpc_server_is_running_and_a_closed_port_is_gone():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert CoordinatorProbe(f"127.0.0.1:{port}").state() == RUNNING  # its HTTP/2 settings came at once
    finally:
        server.stop(None).wait()
    assert CoordinatorProbe(f"127.0.0.1:{port}").state() == GONE  # refused


def _serve_once(listener: socket.socket, say: bytes) -> list[socket.socket]:
    """Accept one connection and send `say` on it (keeping it open), or close it at once."""
    held: list[socket.socket] = []

    def serve():
        conn, _ = listener.accept()
        if say:
            conn.sendall(say)
            held.append(conn)
        else:
            conn.close()
    threading.Thread(target=serve, daemon=True).start()
    return held


def test_a_proxy_that_closes_the_connection_is_gone(silent_listener):
    """An `ssh -L` or TCP proxy in front of a coordinator that is gone accepts, then closes."""
    _serve_once(silent_listener, b"")
    said = _eventually(CoordinatorProbe(_address(silent_listener)), GONE)
    assert said[-1] == GONE and set(said) <= {STOPPED, GONE}, said


def test_a_coordinator_continued_and_stopped_again_is_seen_as_it_is_now(silent_listener):
    """It remembered "running" for the rest of the silence, so a second stop before the next
    answered heartbeat read as not stopped, and the agent left (a review)."""
    probe = CoordinatorProbe(_address(silent_listener))
    assert probe.state() == STOPPED
    held = _serve_once(silent_listener, b"\x00")  # continued: the held connection is taken and answered
    said = _eventually(probe, RUNNING)
    assert said[-1] == RUNNING, said
    assert probe.state() == STOPPED  # stopped again: nothing takes the next connection
    probe.close()
    for conn in held:
        conn.close()


def test_no_answer_counts_as_stopped_for_a_while_then_as_gone(monkeypatch):
    """A full accept queue drops the connection's SYN: the connect times out. So does one to a dead
    host. Neither is an answer: the probe gives the benefit of the doubt for UNANSWERED_GRACE_S."""
    monkeypatch.setattr(coordinator_probe, "CONNECT_TIMEOUT_S", 0.3)
    monkeypatch.setattr(coordinator_probe, "UNANSWERED_GRACE_S", 1.0)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filling = []
        while len(filling) < 64:  # connect until the queue is full: the next one gets no answer
            try:
                filling.append(socket.create_connection(listener.getsockname(), timeout=0.3))
            except TimeoutError:
                break
        try:
            probe = CoordinatorProbe(_address(listener))
            first = probe.state()
            time.sleep(1.1)
            assert (first, probe.state()) == (STOPPED, GONE)
        finally:
            for conn in filling:
                conn.close()


def test_descriptors_past_1023_are_probed(silent_listener):
    """select() refused them ("filedescriptor out of range"), which would have ended the heartbeat
    thread of an agent with many files open (agents may hold up to 65,536)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.fail(f"this machine allows {hard} open files: the test needs 1,200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    spare = [os.dup(0) for _ in range(1100)]
    try:
        probe = CoordinatorProbe(_address(silent_listener))
        assert probe.state() == STOPPED and probe._sock.fileno() > 1023
        probe.close()
    finally:
        for fd in spare:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("client_auth", [False, True], ids=["tls", "mutual-tls"])
def test_a_running_tls_coordinator_answers_the_probes_hello_and_a_silent_port_does_not(tmp_path, client_auth,
                                                                                     silent_listener):
    """TLS servers speak only once spoken to: without a handshake of its own, the probe read a
    running TLS coordinator as stopped (an agent stayed up to 10 minutes, not 10 s)."""
    from hetlaunch.launcher.certs import init_certs
    from hetlaunch.runtime.tls import server_credentials

    init_certs(tmp_path, ["127.0.0.1"])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(
        str(tmp_path / "coordinator.pem"), str(tmp_path / "coordinator.key"),
        str(tmp_path / "ca.pem") if client_auth else None))
    server.start()
    try:
        assert CoordinatorProbe(f"127.0.0.1:{port}", tls=True).state() == RUNNING
    finally:
        server.stop(None).wait()
    stopped = CoordinatorProbe(_address(silent_listener), tls=True)
    assert [stopped.state() for _ in range(5)] == [STOPPED] * 5
    assert _queued(silent_listener) == 1
    stopped.close()
