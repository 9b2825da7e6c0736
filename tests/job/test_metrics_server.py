"""The Prometheus endpoint's server (launcher/metrics_server.py) against connections that never
finish their request: prometheus-client's own gave each a thread and waited without end (a
hostile review grew the coordinator to 659 threads in 80 s). Real sockets on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import urllib.request

import pytest

from conftest import wait_for
from hetlaunch.launcher import metrics_server

pytestmark = pytest.mark.quick


def _app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hetlaunch_step 7\n"]


@pytest.fixture
def served(monkeypatch):
    monkeypatch.setattr(metrics_server, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(metrics_server._Handler, "timeout", 60.0)  # the stalled ones outlive the test's checks
    server, thread = metrics_server.serve_metrics("127.0.0.1", 0, _app)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _scrape(server) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as reply:
        return reply.read()


def _stalled(server) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", server.server_port), timeout=10)
    conn.sendall(b"GET /metrics HTTP/1.1\r\n")  # and nothing more
    return conn


def _closed_by_server(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.timeout(60)
def test_connections_past_the_cap_are_closed_and_the_served_ones_end_with_their_client(served):
    assert _scrape(served) == b"hetlaunch_step 7\n"
    held = [_stalled(served) for _ in range(4)]
    wait_for(lambda: _serving_threads() == 4, 10, "the four stalled connections to get a thread each")
    extra = [_stalled(served) for _ in range(10)]
    assert all(_closed_by_server(c) for c in extra)  # closed unanswered, no thread taken
    assert _serving_threads() == 4
    for conn in held + extra:
        conn.close()
    wait_for(lambda: _scrape_or_none(served) == b"hetlaunch_step 7\n", 20, "a scrape to be served again")


def _serving_threads() -> int:
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def _scrape_or_none(server) -> bytes | None:
    try:
        return _scrape(server)
    except OSError:
        return None


@pytest.mark.timeout(60)
def test_a_request_that_never_finishes_is_dropped_after_the_read_timeout(served, monkeypatch):
    monkeypatch.setattr(metrics_server._Handler, "timeout", 1.0)
    conn = _stalled(served)
    assert _closed_by_server(conn)  # within READ_S (here 1 s); the socket's own timeout is 10 s
    conn.close()
    assert _scrape(served) == b"hetlaunch_step 7\n"


@pytest.mark.timeout(60)
def test_a_request_dripped_a_byte_at_a_time_is_cut_at_the_deadline(served, monkeypatch):
    """The socket's read timeout alone let a client that sends a byte every so often hold its
    place for days; each connection now has READ_S in all (here 1 s; a byte every 0.2 s)."""
    import time

    monkeypatch.setattr(metrics_server, "READ_S", 1.0)
    monkeypatch.setattr(metrics_server._Handler, "timeout", 1.0)
    conn = _stalled(served)
    conn.settimeout(0.2)
    started, cut = time.monotonic(), False
    while time.monotonic() - started < 30 and not cut:
        try:
            conn.sendall(b"X")
            cut = conn.recv(1) == b""
        except socket.timeout:
            continue  # nothing back yet: still served
        except OSError:
            cut = True
    conn.close()
    assert cut, "the dripping connection was still served after 30 s"
    assert _scrape(served) == b"hetlaunch_step 7\n"
