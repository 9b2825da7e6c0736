"""Calls that open and never send their message: what a client holding server threads does.

A client-streaming call on a unary method whose request iterator never yields sends its headers
and nothing else; the server sees a call waiting for its one message."""

from __future__ import annotations

import threading

import grpc


def _silent(stop: threading.Event):
    stop.wait()
    return
    yield  # a generator that yields nothing until the test ends


def stall(address: str, method: str, count: int, metadata=(), serializer=None, deserializer=None, credentials=None):
    """`count` calls of `method` that send their headers and never their message: (futures, stop, channels)."""
    stop = threading.Event()
    channels = [grpc.secure_channel(address, credentials) if credentials is not None else grpc.insecure_channel(address)
                for _ in range(4)]
    calls = [channels[i % 4].stream_unary(method, request_serializer=serializer, response_deserializer=deserializer)
             .future(_silent(stop), metadata=metadata, timeout=60) for i in range(count)]
    return calls, stop, channels


def settle(calls, stop, channels):
    stop.set()
    for call in calls:
        call.cancel()
    for channel in channels:
        channel.close()


def code_of(call, timeout: float):
    try:
        call.result(timeout=timeout)
    except grpc.FutureTimeoutError:
        return None
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK
