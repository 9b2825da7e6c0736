"""Whether a coordinator that answers nothing is stopped (there, and coming back) or gone.

An agent that `up` did not start cannot see `up` stopped (Ctrl-Z on another host): its heartbeats
time out as they would were `up` gone, and it left after 10 s. What tells them apart is a TCP
connection: the kernel of the coordinator's host completes one for a stopped process and holds
it; a dead process's host refuses or resets it, a dead host or a cut link never answers or stops
answering TCP keepalive, a proxy whose coordinator is gone closes it, and a running gRPC server
sends its HTTP/2 settings at once (so it is not stopped: the agent's own connection is what
broke, and it leaves as before). One connection is held for the whole silence: a connection per
check stayed queued at the stopped process, and a few thousand of them (every agent, once a
second) filled its accept queue, after which the checks said "gone" (a review).

Not told apart: a coordinator behind TLS whose process runs but whose connection to this agent
broke (TLS servers send nothing first) until the server gives the silent handshake up (2 min by
default); the agent's wait is bounded anyway (agent_job.SILENT_COORDINATOR_WAIT_S).
"""

from __future__ import annotations

import select
import socket
import threading

CONNECT_TIMEOUT_S = 2.0
FIRST_WORD_S = 0.25  # how long a running server's first bytes may take to arrive after the connect
# TCP keepalive on the held connection: a host that died after it was made is found in about 8 s.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 2, 2, 3


class CoordinatorProbe:
    def __init__(self, address: str):
        host, _, port = address.rpartition(":")
        self._host, self._port = host.strip("[]"), port
        self._lock = threading.Lock()  # the heartbeat loop and report senders ask from their threads
        self._sock: socket.socket | None = None
        self._verdict: bool | None = None  # for this silence, once the connection said "not stopped"

    def stopped(self) -> bool:
        """True while the held connection is open and the coordinator sends nothing on it."""
        with self._lock:
            if self._verdict is not None:
                return self._verdict
            if self._sock is None:
                try:
                    self._sock = _connect(self._host, int(self._port))
                except (OSError, ValueError):
                    return self._decide(False)  # refused, unreachable, a bad address: gone
                select.select([self._sock], [], [], FIRST_WORD_S)
            try:
                self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True  # held open, silent: the process is stopped
            except OSError:
                return self._decide(False)  # reset, or keepalive timed out: gone
            return self._decide(False)  # closed (b""), or a running server's first bytes

    def end_silence(self) -> None:
        """The coordinator answered: the next silence is asked about afresh."""
        with self._lock:
            self._verdict = None
            self._close()

    def _decide(self, verdict: bool) -> bool:
        self._verdict = verdict
        self._close()
        return verdict

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _connect(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    sock.setblocking(False)  # peeked at, never waited on (with a timeout, recv waited it out)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, option):  # Linux; elsewhere the system's keepalive times
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    return sock
