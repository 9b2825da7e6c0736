"""A client of a real coordinator on 127.0.0.1 for the control-plane tests: the server, a channel
and a stub as fixtures, the token's metadata, and an agent's registration."""

from __future__ import annotations

import grpc
import pytest

from hetlaunch.launcher.coordinator import CoordinatorServer
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import control_pb2_grpc
from hetlaunch.runtime.auth import TOKEN_METADATA_KEY
from hetlaunch.runtime.version import hetlaunch_version, torch_version

TOKEN = "test-token-123"
NODES = ["a", "b"]
RPC_TIMEOUT = 10


@pytest.fixture
def server():
    srv = CoordinatorServer("127.0.0.1", 0, TOKEN, NODES).start()
    try:
        yield srv
    finally:
        srv.stop(0.5)


@pytest.fixture
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        grpc.channel_ready_future(ch).result(timeout=RPC_TIMEOUT)
        yield ch


@pytest.fixture
def stub(channel):
    return control_pb2_grpc.CoordinatorStub(channel)


def auth(token: str = TOKEN):
    return ((TOKEN_METADATA_KEY, token),)


def agent_info(name: str, agent_version: str | None = None) -> pb.AgentInfo:
    return pb.AgentInfo(node_name=name, hostname="test-host", agent_version=agent_version or hetlaunch_version(),
                        torch_version=torch_version(), pid=1,
                        devices=[pb.Device(kind=pb.DEVICE_KIND_CPU, name="cpu", index=0, memory_bytes=1 << 30)])


def register(stub, name: str, metadata=None, agent_version: str | None = None) -> pb.RegisterResponse:
    return stub.Register(pb.RegisterRequest(agent=agent_info(name, agent_version)),
                         metadata=auth() if metadata is None else metadata, timeout=RPC_TIMEOUT)
