"""What a call costs the coordinator before it is known to be one of the job's: nothing that can
run out.

gRPC's synchronous server gives every call a thread of a fixed pool, and a call that asks for one
request message holds its thread until that message arrives. So a client that opened calls and
never sent their message held a thread each, even without the token (the token was checked only
once the message came): 21 such calls took the pool, heartbeats stopped being served, and every
node was declared lost. Here, on the server's own thread before any pool thread is taken:

* a call to our service without the job's token is refused on its metadata alone, by a handler
  that never reads a message;
* health checks (open to all, by design) are capped at HEALTH_MAX at a time; more are refused
  at once; Watch, whose stream holds its thread for as long as the client keeps it open, is not
  served (8 Watch calls held every place for the whole job, a hostile review): poll Check;
* every call that expects one request message is turned into one that reads it itself, with a
  bound (READ_S): a call whose message does not come in time is cancelled and its thread freed.

Blocking waits on the rendezvous store are capped in launcher/rendezvous_store.py. With mutual
TLS, a client without a certificate of the job's CA never gets this far: the handshake refuses it.
"""

from __future__ import annotations

import heapq
import hmac
import itertools
import threading
import time

import grpc

from hetlaunch.runtime.auth import TOKEN_METADATA_KEY

READ_S = 20.0  # a request message must arrive this soon after its call opens
HEALTH_MAX = 8  # health checks served at a time
HEALTH_PREFIX = "/grpc.health.v1.Health/"
HEALTH_WATCH = HEALTH_PREFIX + "Watch"


def pool_threads(most_nodes: int) -> int:
    """Threads enough for every agent's command stream, heartbeat, reports and store calls at
    once, plus the health checks and slack: what the guard lets in can never take them all."""
    return 6 * most_nodes + HEALTH_MAX + 16


class _Reaper:
    """Cancels calls whose request message has not come by their deadline (one thread for all)."""

    def __init__(self):
        self._heap: list[tuple[float, int, grpc.ServicerContext]] = []
        self._done: set[int] = set()
        self._ids = itertools.count()
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="call-reaper", daemon=True).start()

    def watch(self, context: grpc.ServicerContext) -> int:
        with self._cv:
            key = next(self._ids)
            heapq.heappush(self._heap, (time.monotonic() + READ_S, key, context))
            self._cv.notify()
            return key

    def done(self, key: int) -> None:
        with self._cv:
            self._done.add(key)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                deadline, key, context = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(min(left, 1.0))
                    continue
                heapq.heappop(self._heap)
                late = key not in self._done
                self._done.discard(key)
            if late:
                context.cancel()


class CallGuard(grpc.ServerInterceptor):
    """The job's token on every call to our service; bounded reads and capped health checks."""

    def __init__(self, token: str, service: str):
        self._token = token.encode()
        self._service = f"/{service}/"
        self._reaper = _Reaper()
        self._health = threading.BoundedSemaphore(HEALTH_MAX)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method == HEALTH_WATCH:
            return _refusal(grpc.StatusCode.UNIMPLEMENTED, "health Watch is not served: poll Check", streaming=True)
        if method.startswith(HEALTH_PREFIX):
            handler = continuation(handler_call_details)
            if handler is None:
                return None
            if not self._health.acquire(blocking=False):
                return _refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {HEALTH_MAX} health checks at once",
                                handler.response_streaming)
            return self._bounded(handler, release=self._health.release)
        if not method.startswith(self._service):
            return continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_METADATA_KEY, "")
        if not (isinstance(sent, str) and hmac.compare_digest(sent.encode(), self._token)):
            return _refusal(grpc.StatusCode.UNAUTHENTICATED, "missing join token" if not sent else "wrong join token",
                            streaming=True)
        handler = continuation(handler_call_details)
        return None if handler is None else self._bounded(handler)

    def _bounded(self, handler: grpc.RpcMethodHandler, release=None) -> grpc.RpcMethodHandler:
        """The same method, reading its one request message itself within READ_S."""
        if handler.request_streaming:
            return handler  # reads as it goes (uploads): each message is the handler's to wait for
        reaper = self._reaper

        def first(requests, context):
            key = reaper.watch(context)
            try:
                return next(requests)  # cancelled by the reaper: raises (gRPC's own error, quietly)
            except StopIteration:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a request message was expected")
            finally:
                reaper.done(key)

        if handler.response_streaming:
            def stream(requests, context):
                try:
                    yield from handler.unary_stream(first(requests, context), context)
                finally:
                    if release is not None:
                        release()
            return grpc.stream_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                         handler.response_serializer)

        def unary(requests, context):
            try:
                return handler.unary_unary(first(requests, context), context)
            finally:
                if release is not None:
                    release()
        return grpc.stream_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)


def _refusal(code: grpc.StatusCode, message: str, streaming: bool) -> grpc.RpcMethodHandler:
    """A handler that ends the call at once and never waits for (or reads) its request."""
    def deny(requests, context):
        context.abort(code, message)

    def deny_stream(requests, context):
        context.abort(code, message)
        yield  # a generator: the streaming form

    if streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    return grpc.stream_unary_rpc_method_handler(deny)
