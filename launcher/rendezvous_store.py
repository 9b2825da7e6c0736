"""The data plane's rendezvous store, served on the control plane.

c10d needs a key-value store to rendezvous (ranks publish their addresses, wait for each
other). A `TCPStore` would listen on a port of its own with no authentication: anyone who can
reach it can list the keys and write into a rendezvous. Instead the coordinator keeps the keys
and serves them through its gRPC service (`StoreOp`), behind the same join token and TLS as
every other RPC; each worker reaches it with runtime/grpc_store.py.

Bounded: keys of at most 512 bytes, values of at most 1 MiB, at most 100,000 keys and 64 MiB in
all (c10d writes a few KiB a rank); a `get` or `wait` blocks at most until its deadline (and the
RPC's), and at most `max_blocked` of them block at once — each holds a thread of the
coordinator's server, and 40 blocking waits once took them all (see launcher/call_guard.py).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from hetlaunch.protos import control_pb2 as pb

MAX_KEY_BYTES = 512
MAX_VALUE_BYTES = 1 << 20
MAX_KEYS = 100_000
MAX_TOTAL_BYTES = 64 << 20
MAX_BLOCKED_PER_CALLER = 8  # waiting calls of one agent at once (its worker makes a group or two at a time)


class StoreRefused(ValueError):
    """An operation the store will not do (too large, too many keys, unknown op). `full`: refused
    for a limit of the store's (keys, bytes, waiting calls), not for what was asked."""

    def __init__(self, message: str, full: bool = False):
        super().__init__(message)
        self.full = full


class RendezvousStore:
    def __init__(self, max_blocked: int = 64, max_blocked_per_caller: int = MAX_BLOCKED_PER_CALLER) -> None:
        self._data: dict[str, bytes] = {}
        self._bytes = 0
        self._changed = threading.Condition()
        self._closed = False
        self._blocked = threading.BoundedSemaphore(max_blocked)
        self.max_blocked = max_blocked
        # One agent's worker waits on a key or two at a time (a rendezvous, a group being made
        # beside another); without a share of its own, one token holder took every waiting place
        # and the others' rendezvous were refused.
        self._blocked_by: dict[str, int] = {}
        self.max_blocked_per_caller = max_blocked_per_caller

    def blocked_calls(self) -> dict[str, int]:
        """Per caller, its calls waiting now."""
        with self._changed:
            return dict(self._blocked_by)

    def keep_only(self, prefix: str) -> None:
        """Drop every key outside `prefix` (a new generation: the old one's keys serve no one)."""
        with self._changed:
            for key in [k for k in self._data if not k.startswith(prefix)]:
                self._bytes -= len(self._data.pop(key))

    def close(self) -> None:
        """The coordinator is stopping: every blocked get and wait returns at once (a gRPC thread
        left waiting would keep the process from exiting)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _put(self, key: str, value: bytes) -> None:
        if len(key.encode()) > MAX_KEY_BYTES or len(value) > MAX_VALUE_BYTES:
            raise StoreRefused(f"key of {len(key.encode())} or value of {len(value)} bytes is over the limit")
        if key not in self._data and len(self._data) >= MAX_KEYS:
            raise StoreRefused(f"the store holds {MAX_KEYS} keys already", full=True)
        grown = self._bytes + len(value) - len(self._data.get(key, b""))
        if grown > MAX_TOTAL_BYTES:
            raise StoreRefused(f"the store would hold {grown} bytes, over its {MAX_TOTAL_BYTES >> 20} MiB", full=True)
        self._bytes = grown
        self._data[key] = value
        self._changed.notify_all()

    def _wait_for(self, keys: list[str], timeout_s: float, wanted: Callable[[], bool], caller: str) -> bool:
        if all(k in self._data for k in keys):
            return True
        held = self._blocked_by.get(caller, 0)  # under the lock: _handle holds it, wait() gives it back
        if held >= self.max_blocked_per_caller:
            raise StoreRefused(f"{held} store calls of this agent are waiting already", full=True)
        if not self._blocked.acquire(blocking=False):  # only a call that would block counts
            raise StoreRefused(f"{self.max_blocked} store calls are waiting already", full=True)
        self._blocked_by[caller] = held + 1
        try:
            deadline = time.monotonic() + max(0.0, timeout_s)
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed or not wanted():
                    return False
                self._changed.wait(min(left, 0.5))  # wake to notice a caller that went away
            return True
        finally:
            self._blocked.release()
            if self._blocked_by[caller] == 1:
                del self._blocked_by[caller]
            else:
                self._blocked_by[caller] -= 1

    def handle(self, request: pb.StoreRequest, limit_s: float,
               wanted: Callable[[], bool] = lambda: True, caller: str = "") -> pb.StoreResponse:
        """Do one operation for `caller` (its agent); `limit_s` caps any wait (the RPC's own
        deadline); a wait ends early once `wanted()` is false (the caller cancelled) or the store
        is closed."""
        return self._handle(request, min(request.timeout_s or limit_s, limit_s), wanted, caller)

    def _handle(self, request: pb.StoreRequest, timeout_s: float, wanted: Callable[[], bool],
                caller: str) -> pb.StoreResponse:
        op, keys = request.op, list(request.keys)
        with self._changed:
            if op == "set":
                self._put(keys[0], request.value)
                return pb.StoreResponse(ok=True)
            if op == "get":
                if not self._wait_for(keys[:1], timeout_s, wanted, caller):
                    return pb.StoreResponse(ok=False)
                return pb.StoreResponse(ok=True, value=self._data[keys[0]])
            if op == "add":
                try:
                    current = int(self._data.get(keys[0], b"0") or b"0")
                except ValueError:
                    raise StoreRefused(f"key {keys[0][:80]!r} does not hold a number") from None
                total = current + request.amount
                if not -(1 << 63) <= total < 1 << 63:  # checked before it is kept: the reply could not carry it
                    raise StoreRefused(f"key {keys[0][:80]!r} would hold {total}, beyond a 64-bit count")
                self._put(keys[0], str(total).encode())
                return pb.StoreResponse(ok=True, number=total)
            if op == "compare_set":
                current = self._data.get(keys[0])
                if (current is None and request.expected == b"") or current == request.expected:
                    self._put(keys[0], request.value)
                    return pb.StoreResponse(ok=True, value=request.value)
                return pb.StoreResponse(ok=True, value=current if current is not None else request.expected)
            if op == "wait":
                return pb.StoreResponse(ok=self._wait_for(keys, timeout_s, wanted, caller))
            if op == "check":
                return pb.StoreResponse(ok=all(k in self._data for k in keys))
            if op == "delete":
                removed = self._data.pop(keys[0], None)
                self._bytes -= len(removed or b"")
                return pb.StoreResponse(ok=removed is not None)
            if op == "num_keys":
                return pb.StoreResponse(ok=True, number=len(self._data))
        raise StoreRefused(f"unknown store operation {op!r}")
