"""The coordinator's gRPC service, called over a real channel on 127.0.0.1: auth, health, registration rules, commands."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator_client import NODES, RPC_TIMEOUT, auth, channel, register, server, stub  # noqa: F401 (fixtures)
from hetlaunch.launcher.coordinator import SERVICE_NAME
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.version import hetlaunch_version


def assert_untouched(server) -> None:
    assert server.state.joined_nodes() == []
    assert server.state.refusal() is None
    assert server.state.missing_nodes() == NODES


BAD_METADATA = {"missing": (), "wrong": auth("not-the-token"), "empty": auth("")}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", list(BAD_METADATA))
def test_calls_without_the_right_token_are_unauthenticated(kind, server, stub):
    metadata = BAD_METADATA[kind]
    with pytest.raises(grpc.RpcError) as err:
        register(stub, "a", metadata=metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "token" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Heartbeat(pb.HeartbeatRequest(agent_id="whatever"), metadata=metadata, timeout=RPC_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        next(iter(stub.WatchCommands(pb.WatchCommandsRequest(agent_id="whatever"), metadata=metadata,
                                     timeout=RPC_TIMEOUT)))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert_untouched(server)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", list(BAD_METADATA))
def test_command_stream_without_the_right_token_is_unauthenticated(kind, server, stub):
    # A real agent id, so that only the token can be the reason for the refusal.
    agent_id = register(stub, "a").agent_id
    stream = stub.WatchCommands(pb.WatchCommandsRequest(agent_id=agent_id), metadata=BAD_METADATA[kind],
                                timeout=RPC_TIMEOUT)
    server.state.send("a", pb.Command(shutdown=pb.Shutdown(reason="must not be delivered")))
    with pytest.raises(grpc.RpcError) as err:
        next(iter(stream))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The queued command is still there for the rightful agent.
    rightful = stub.WatchCommands(pb.WatchCommandsRequest(agent_id=agent_id), metadata=auth(), timeout=RPC_TIMEOUT)
    assert next(iter(rightful)).shutdown.reason == "must not be delivered"


@pytest.mark.timeout(30)
def test_wrong_token_then_right_token(server, stub):
    with pytest.raises(grpc.RpcError):
        register(stub, "a", metadata=auth("nope"))
    assert_untouched(server)
    reply = register(stub, "a")
    assert reply.agent_id
    assert server.state.missing_nodes() == ["b"]


@pytest.mark.timeout(30)
def test_health_needs_no_token(server, channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.timeout(30)
def test_unknown_node_is_not_found_and_names_the_known_nodes(server, stub):
    with pytest.raises(grpc.RpcError) as err:
        register(stub, "zzz")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    details = err.value.details()
    assert "zzz" in details
    assert "a" in details and "b" in details and "nodes: a, b" in details
    assert_untouched(server)


@pytest.mark.timeout(30)
def test_version_mismatch_is_refused_and_recorded(server, stub):
    with pytest.raises(grpc.RpcError) as err:
        register(stub, "a", agent_version="0.0.1")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.value.details()
    assert "0.0.1" in details
    assert hetlaunch_version() in details
    assert "a" not in server.state.joined_nodes()
    node, why = server.state.refusal()
    assert node == "a" and "0.0.1" in why and hetlaunch_version() in why


@pytest.mark.timeout(30)
def test_duplicate_registration_is_already_exists(server, stub):
    first = register(stub, "a")
    with pytest.raises(grpc.RpcError) as err:
        register(stub, "a")
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "'a'" in err.value.details()
    assert server.state.agent_id("a") == first.agent_id
    assert server.state.joined_nodes() == ["a"]


@pytest.mark.timeout(30)
def test_heartbeat_of_unknown_agent_is_not_found(server, stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Heartbeat(pb.HeartbeatRequest(agent_id="nobody"), metadata=auth(), timeout=RPC_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    agent_id = register(stub, "a").agent_id
    stub.Heartbeat(pb.HeartbeatRequest(agent_id=agent_id, state=pb.AGENT_STATE_IDLE), metadata=auth(),
                   timeout=RPC_TIMEOUT)


@pytest.mark.timeout(30)
def test_commands_arrive_on_the_stream_in_order(server, stub):
    reply = register(stub, "a")
    assert reply.heartbeat_interval_ms > 0
    run = pb.RunStage(stage=pb.StageSpec(stage_index=0, num_stages=2, layer_start=0, layer_end=2))
    server.state.send("a", pb.Command(run_stage=run))
    server.state.send("a", pb.Command(shutdown=pb.Shutdown(reason="done")))
    stream = stub.WatchCommands(pb.WatchCommandsRequest(agent_id=reply.agent_id), metadata=auth(),
                                timeout=RPC_TIMEOUT)
    received = list(stream)  # the stream ends after a shutdown
    assert [c.WhichOneof("kind") for c in received] == ["run_stage", "shutdown"]
    assert received[0].run_stage == run
    assert received[1].shutdown.reason == "done"


@pytest.mark.timeout(30)
def test_joined_node_cannot_be_disturbed_by_a_second_registration_with_another_version(server, stub):
    # A token holder registering an already-joined node under another version must neither take its
    # place nor leave a refusal behind: `up` fails the job on a recorded refusal while it waits.
    first = register(stub, "a")
    with pytest.raises(grpc.RpcError) as err:
        register(stub, "a", agent_version="0.0.1")
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert server.state.refusal() is None
    assert server.state.agent_id("a") == first.agent_id


@pytest.mark.timeout(30)
def test_reports_of_an_earlier_generation_are_dropped(server, stub):
    agent_id = register(stub, "a").agent_id
    generation = server.state.begin_generation()
    old = pb.StepMetrics(step=7)
    stub.ReportStep(pb.ReportStepRequest(agent_id=agent_id, metrics=old, generation=generation - 1),
                    metadata=auth(), timeout=RPC_TIMEOUT)
    stub.ReportResult(pb.ReportResultRequest(agent_id=agent_id, ok=False, error="stale", generation=generation - 1),
                      metadata=auth(), timeout=RPC_TIMEOUT)
    assert server.state.next_step(timeout=0.2) is None
    assert server.state.results() == []
    assert server.state.stale_reports == 2
    current = pb.StepMetrics(step=8)
    stub.ReportStep(pb.ReportStepRequest(agent_id=agent_id, metrics=current, generation=generation),
                    metadata=auth(), timeout=RPC_TIMEOUT)
    assert server.state.next_step(timeout=2) == ("a", current)


@pytest.mark.timeout(30)
def test_commands_carry_the_current_generation(server, stub):
    agent_id = register(stub, "a").agent_id
    server.state.send("a", pb.Command(profile=pb.Profile()))
    generation = server.state.begin_generation()
    server.state.send("a", pb.Command(shutdown=pb.Shutdown(reason="done")))
    received = list(stub.WatchCommands(pb.WatchCommandsRequest(agent_id=agent_id), metadata=auth(),
                                       timeout=RPC_TIMEOUT))
    assert [c.generation for c in received] == [generation - 1, generation]


@pytest.mark.timeout(60)
def test_a_connection_that_never_speaks_is_closed_before_it_can_pile_up(server, channel):
    """A hostile review held 400 silent TCP connections to the coordinator (no token needed to
    connect): each kept a file descriptor for minutes, and the coordinator ran out. One that does
    not finish its handshake is now closed after HANDSHAKE_TIMEOUT_MS; the server keeps serving."""
    import socket
    import time

    from hetlaunch.launcher.coordinator import HANDSHAKE_TIMEOUT_MS

    host, port = server.address.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
    started = time.monotonic()
    try:
        for sock in silent:
            sock.settimeout(3 * HANDSHAKE_TIMEOUT_MS / 1000)
            while sock.recv(4096):  # the server's SETTINGS, then the end of the stream
                pass
    finally:
        for sock in silent:
            sock.close()
    assert time.monotonic() - started < 3 * HANDSHAKE_TIMEOUT_MS / 1000
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


_SERVE_WITH_FEW_FILES = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from hetlaunch.launcher.coordinator import CoordinatorServer
server = CoordinatorServer("127.0.0.1", 0, "token", ["a"]).start()
print(server.port, resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(90)
def test_the_coordinator_lifts_a_low_file_limit_so_400_silent_connections_do_not_starve_it():
    """A hostile review held 400 silent connections to a coordinator started under a 256-file limit:
    it could no longer open a file or answer its health check. It now lifts its soft limit (to
    OPEN_FILES, or the hard limit) before it serves, and still answers with 400 connections held."""
    import resource
    import socket
    import subprocess
    import sys

    from hetlaunch.launcher.coordinator import OPEN_FILES

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.fail(f"this machine's hard limit on open files is {hard}: the test needs 1,024")
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_WITH_FEW_FILES], stdout=subprocess.PIPE, text=True)
    silent = []
    try:
        port, soft = map(int, proc.stdout.readline().split())
        assert soft == (OPEN_FILES if hard == resource.RLIM_INFINITY else min(OPEN_FILES, hard))
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(400)]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as health_channel:
            reply = health_pb2_grpc.HealthStub(health_channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for sock in silent:
            sock.close()
        proc.kill()
        proc.wait(timeout=10)
