"""The HTTP server of the Prometheus endpoint (`coordinator.metrics_port`): prometheus-client's WSGI
app, served so that a stranger's connections cost the coordinator little.

prometheus-client's own server gives every connection a thread and waits on it without end: a
hostile review's connections that sent `GET /metrics HTTP/1.1` and then nothing grew the
coordinator to 659 threads in 80 s, kept until the job ended. Here a connection is served for
READ_S at most, whatever it sends, at most MAX_CONNECTIONS are served at once (more are closed unanswered),
and what a broken client causes is never printed on the coordinator's console.
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

READ_S = 10.0  # a request must come whole this soon; a scrape takes milliseconds
MAX_CONNECTIONS = 32  # served at once; Prometheus scrapes one at a time


class _Handler(WSGIRequestHandler):
    """A connection has READ_S in all, not per read: the socket's own timeout alone let a client
    that sends a byte now and then hold its place for days (a review of this file)."""
    timeout = READ_S  # on the socket too: a read that waits past the deadline ends at once

    def setup(self) -> None:
        super().setup()
        self._deadline = threading.Timer(READ_S, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def _cut(self) -> None:
        try:
            self.connection.shutdown(socket.SHUT_RDWR)  # the reads and writes in progress end; finish() closes
        except OSError:
            pass

    def finish(self) -> None:
        self._deadline.cancel()
        try:
            super().finish()
        except OSError:
            pass  # the deadline cut it

    def log_message(self, format, *args) -> None:
        """Nothing on the console per request."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # never waited for at close

    def __init__(self, address: tuple[str, int], family: int):
        self.address_family = family
        self._places = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:
        if not self._places.acquire(blocking=False):
            self.shutdown_request(request)  # closed unanswered: the served ones keep their threads
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._places.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._places.release()

    def handle_error(self, request, client_address) -> None:
        """A client that stalled, reset or sent garbage: its connection ends, nothing is printed."""


def can_listen(host: str, port: int) -> None:
    """OSError where serve_metrics could not listen on host:port (a port in use): `up` asks before
    its agents start and profile, where the server starts only once the plan is made. A port taken
    in between is still said then."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds (allow_reuse_address)
        probe.bind((host, port))


def serve_metrics(host: str, port: int, app) -> tuple[WSGIServer, threading.Thread]:
    """Serve the WSGI `app` on host:port (port 0: any free one) from a daemon thread."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server = _Server((host, port), family)
    server.set_app(app)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread
