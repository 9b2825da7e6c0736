"""Whether a coordinator that answers nothing is stopped (there, and coming back), running, or gone.

An agent that `up` did not start cannot see `up` stopped (Ctrl-Z on another host): its heartbeats
time out as they would were `up` gone, and it left after 10 s. What tells them apart is a TCP
connection to the coordinator's port. The kernel of the coordinator's host completes one for a
stopped process and holds it, silent: STOPPED. A running gRPC server sends its HTTP/2 settings at
once: RUNNING (the agent's own connection is what broke, or the coordinator is busy). A dead
process's host refuses or resets it, and a proxy whose coordinator is gone closes it: GONE.

One connection is held for as long as the coordinator stays stopped: a connection per check
stayed queued at the stopped process, and a few thousand of them (every agent, once a second)
filled its accept queue (a review). Nothing but a held connection is remembered, so a coordinator
continued and stopped again is seen as it is now (a remembered "running" outlived a second stop).
A connect that times out, or a held connection whose TCP keepalive goes unanswered (a dead host,
a cut link, a lost packet, a full accept queue), is no answer: it counts as STOPPED for
UNANSWERED_GRACE_S in a row, then as GONE.

Behind TLS a server sends nothing first, so the probe starts a TLS handshake itself (its
ClientHello, nothing secret; no certificate is checked): a running server answers it, a stopped
one cannot (without, a running TLS coordinator read as stopped, and the agent stayed 10 minutes).
Not told apart: a hung coordinator looks stopped (the agent's wait is bounded:
agent_job.SILENT_COORDINATOR_WAIT_S); agents past the coordinator host's accept queue
(net.core.somaxconn: 4,096 on Linux 5.4 and later, 128 before) get no answer, and leave a
stopped coordinator once the grace runs out.
"""

from __future__ import annotations

import errno
import select
import socket
import ssl
import threading
import time

STOPPED, RUNNING, GONE = "stopped", "running", "gone"
CONNECT_TIMEOUT_S = 2.0
FIRST_WORD_S = 0.25  # how long a running server's first bytes may take to arrive after the connect
UNANSWERED_GRACE_S = 20.0
# TCP keepalive on the held connection: a host that died after it was made stops answering in about 8 s.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 2, 2, 3
# No answer, not a refusal: a timeout, a name server that did not answer (EAI_AGAIN), a route that
# is missing for now (a flap says so as much as a dead host does).
_NO_ANSWER = (errno.ETIMEDOUT, errno.EAGAIN, socket.EAI_AGAIN, errno.EHOSTUNREACH, errno.ENETUNREACH)


class CoordinatorProbe:
    def __init__(self, address: str, tls: bool = False):
        host, _, port = address.rpartition(":")
        self._host, self._port = host.strip("[]"), port
        self._tls = tls
        self._lock = threading.Lock()  # the heartbeat loop and report senders ask from their threads
        self._sock: socket.socket | None = None
        self._unanswered_since: float | None = None

    def state(self) -> str:
        """STOPPED, RUNNING or GONE, as a TCP connection to the coordinator's port says now."""
        with self._lock:
            try:
                verdict = self._look()
            except Exception:  # never the caller's thread (the heartbeat loop) for a probe's fault
                self._close()
                verdict = None
            if verdict is None:  # no answer: the benefit of the doubt, for a while
                now = time.monotonic()
                self._unanswered_since = self._unanswered_since or now
                return STOPPED if now - self._unanswered_since < UNANSWERED_GRACE_S else GONE
            self._unanswered_since = None
            return verdict

    def stopped(self) -> bool:
        return self.state() == STOPPED

    def close(self) -> None:
        """The coordinator answered (or the job ended): the held connection goes. Never waits on
        a look under way (a connect, a name lookup): the heartbeat loop calls this after every
        answer, and a wait here was a heartbeat missed; that look's connection goes next time."""
        if self._lock.acquire(blocking=False):
            try:
                self._close()
                self._unanswered_since = None
            finally:
                self._lock.release()

    def _look(self) -> str | None:
        if self._sock is None:
            try:
                self._sock = _connect(self._host, int(self._port))
            except (socket.timeout, TimeoutError):
                return None
            except OSError as err:
                return None if err.errno in _NO_ANSWER else GONE  # refused, reset, an unknown name
            except ValueError:
                return GONE  # not an address (the agent's own --coordinator)
            if self._tls:
                self._sock = _TLS_HELLO.wrap_socket(self._sock, do_handshake_on_connect=False)
                try:
                    self._answered()  # the ClientHello goes out
                except OSError:
                    pass  # a reset: said below
            poller = select.poll()  # not select(): it refuses descriptors past 1,023
            poller.register(self._sock, select.POLLIN)
            poller.poll(FIRST_WORD_S * 1000)
        try:
            verdict = self._answered()
        except OSError as err:
            self._close()
            return None if err.errno in _NO_ANSWER else GONE  # keepalive unanswered; reset
        if verdict != STOPPED:
            self._close()
        return verdict

    def _answered(self) -> str:
        """STOPPED while nothing came on the held connection, RUNNING once a server spoke on it,
        GONE once it was closed; OSError for a reset or an unanswered keepalive."""
        if not self._tls:
            try:
                first = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return STOPPED
            return RUNNING if first else GONE  # a running server's HTTP/2 settings; closed
        try:
            self._sock.do_handshake()  # sends the ClientHello, then reads what came back
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return STOPPED  # no answer to it yet
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            return GONE
        except ssl.SSLError:
            return RUNNING  # it answered, if only to refuse us (no client certificate): it runs
        return RUNNING

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _hello_context() -> ssl.SSLContext:
    """A handshake that checks nothing: what the server answers is all the probe wants."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


_TLS_HELLO = _hello_context()


def _connect(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    sock.setblocking(False)  # peeked at, never waited on (with a timeout, recv waited it out)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, option):  # Linux; elsewhere the system's keepalive times
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    return sock
