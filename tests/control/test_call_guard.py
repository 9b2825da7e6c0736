"""Calls that open and never send their message cost the coordinator nothing it can run out of.

Before: a call without the token held a server thread until its message came (the token was
checked only then); 21 of them took the pool, heartbeats went unserved and every node was
declared lost. Real gRPC on 127.0.0.1, real stalled calls: a client-streaming call on a unary
method whose request iterator never yields sends headers and nothing else."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from hetlaunch.launcher import call_guard
from hetlaunch.launcher.coordinator import SERVICE_NAME
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import control_pb2_grpc
from hetlaunch.runtime.auth import TOKEN_METADATA_KEY
from coordinator_client import TOKEN, server  # noqa: F401 (a fixture)
from stalled_calls import code_of, settle, stall



def served_with_token(address: str) -> float:
    """Seconds an authenticated GetStatus takes (fails the test if it is not answered in 5 s)."""
    with grpc.insecure_channel(address) as channel:
        started = time.monotonic()
        control_pb2_grpc.CoordinatorStub(channel).GetStatus(pb.GetStatusRequest(), metadata=((TOKEN_METADATA_KEY, TOKEN),),
                                                           timeout=5)
        return time.monotonic() - started


@pytest.mark.timeout(60)
def test_64_stalled_calls_without_the_token_are_refused_at_once_and_hold_nothing(server):
    calls, stop, channels = stall(server.address, f"/{SERVICE_NAME}/Heartbeat", 64,
                                  serializer=pb.HeartbeatRequest.SerializeToString,
                                  deserializer=pb.HeartbeatResponse.FromString)
    try:
        assert [code_of(c, 10) for c in calls] == [grpc.StatusCode.UNAUTHENTICATED] * 64
        assert served_with_token(server.address) < 5
    finally:
        settle(calls, stop, channels)


@pytest.mark.timeout(60)
def test_health_watch_streams_are_refused_and_hold_no_place(server):
    """A Watch stream holds a server thread and a health place for as long as its client likes:
    8 of them shut every health check out until the job ended (a hostile review)."""
    with grpc.insecure_channel(server.address) as channel:
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch",
                                     request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                     response_deserializer=health_pb2.HealthCheckResponse.FromString)
        streams = [watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
                   for _ in range(2 * call_guard.HEALTH_MAX)]
        for stream in streams:
            with pytest.raises(grpc.RpcError) as refused:
                next(stream)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED and "poll Check" in refused.value.details()
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        assert check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


@pytest.mark.timeout(60)
def test_stalled_health_checks_are_capped_and_the_service_goes_on(server, monkeypatch):
    monkeypatch.setattr(call_guard, "READ_S", 1.0)
    calls, stop, channels = stall(server.address, "/grpc.health.v1.Health/Check", 16,
                                  serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                  deserializer=health_pb2.HealthCheckResponse.FromString)
    try:
        # Past the cap: refused at once. Those let in wait for their message at most READ_S.
        codes = [code_of(c, 15) for c in calls]
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 16 - call_guard.HEALTH_MAX, codes
        assert codes.count(grpc.StatusCode.CANCELLED) == call_guard.HEALTH_MAX, codes
        assert served_with_token(server.address) < 5
    finally:
        settle(calls, stop, channels)
    # The cap's places came back: a plain health check is served.
    with grpc.insecure_channel(server.address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        assert check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


@pytest.mark.timeout(60)
def test_a_token_holders_call_that_never_sends_its_message_is_cancelled(server, monkeypatch):
    monkeypatch.setattr(call_guard, "READ_S", 1.0)
    calls, stop, channels = stall(server.address, f"/{SERVICE_NAME}/GetStatus", 8,
                                  metadata=((TOKEN_METADATA_KEY, TOKEN),),
                                  serializer=pb.GetStatusRequest.SerializeToString,
                                  deserializer=pb.GetStatusResponse.FromString)
    try:
        started = time.monotonic()
        assert [code_of(c, 15) for c in calls] == [grpc.StatusCode.CANCELLED] * 8
        assert time.monotonic() - started < 10
        assert served_with_token(server.address) < 5
    finally:
        settle(calls, stop, channels)
