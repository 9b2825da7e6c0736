"""The coordinator's gRPC service: who joined, who is alive, commands out, metrics in.

The servicer is thin: it checks the request, updates `CoordinatorState` under one lock,
and aborts with a precise status code. `hetlaunch up` (launcher/job.py) drives the job
by reading and writing that state; the servicer never decides anything about the job.
"""

from __future__ import annotations

import hmac
import queue
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import control_pb2_grpc
from hetlaunch.runtime.auth import TOKEN_METADATA_KEY
from hetlaunch.runtime.version import hetlaunch_version, torch_version

SERVICE_NAME = "hetlaunch.v1.Coordinator"


@dataclass
class AgentRecord:
    agent_id: str
    node_name: str
    info: pb.AgentInfo
    last_seen: float
    commands: queue.Queue = field(default_factory=queue.Queue)
    result: pb.ReportResultRequest | None = None


class CoordinatorState:
    """Everything the service knows; shared by the gRPC threads and the job driver."""

    def __init__(self, expected_nodes: list[str]):
        self.lock = threading.Lock()
        self.expected_nodes = list(expected_nodes)
        self.agents: dict[str, AgentRecord] = {}   # by node name
        self.by_id: dict[str, AgentRecord] = {}
        self.refusals: dict[str, str] = {}         # node name -> why registration was refused
        self.steps: queue.Queue[tuple[str, pb.StepMetrics]] = queue.Queue()
        self.results: queue.Queue[tuple[str, pb.ReportResultRequest]] = queue.Queue()
        self.profiles: queue.Queue[tuple[str, pb.ReportProfileRequest]] = queue.Queue()
        self.joined = threading.Condition(self.lock)

    def missing_nodes(self) -> list[str]:
        with self.lock:
            return [n for n in self.expected_nodes if n not in self.agents]

    def send(self, node_name: str, command: pb.Command) -> None:
        with self.lock:
            self.agents[node_name].commands.put(command)

    def silent_for(self, now: float) -> dict[str, float]:
        with self.lock:
            return {name: now - rec.last_seen for name, rec in self.agents.items()}


class TokenInterceptor(grpc.ServerInterceptor):
    """Every call to our service must carry the job's token; health checks need none."""

    def __init__(self, token: str):
        self._token = token.encode()

    def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_METADATA_KEY, "")
        if hmac.compare_digest(sent.encode(), self._token):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        message = "missing join token" if not sent else "wrong join token"

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class CoordinatorServicer(control_pb2_grpc.CoordinatorServicer):
    def __init__(self, state: CoordinatorState, heartbeat_interval_ms: int = 1000):
        self.state = state
        self.heartbeat_interval_ms = heartbeat_interval_ms

    def Register(self, request, context):
        info = request.agent
        name = info.node_name
        mine = (hetlaunch_version(), torch_version())
        theirs = (info.agent_version, info.torch_version)
        with self.state.lock:
            if name not in self.state.expected_nodes:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"node {name!r} is not in the cluster (nodes: {', '.join(self.state.expected_nodes)})")
            if theirs != mine:
                why = (f"version mismatch for node {name!r}: agent has hetlaunch {theirs[0]}, torch {theirs[1]}; "
                       f"coordinator has hetlaunch {mine[0]}, torch {mine[1]}")
                self.state.refusals[name] = why
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
            if name in self.state.agents:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"node {name!r} has already joined")
            record = AgentRecord(agent_id=uuid.uuid4().hex[:12], node_name=name, info=info, last_seen=time.monotonic())
            self.state.agents[name] = record
            self.state.by_id[record.agent_id] = record
            self.state.refusals.pop(name, None)
            self.state.joined.notify_all()
        return pb.RegisterResponse(agent_id=record.agent_id, heartbeat_interval_ms=self.heartbeat_interval_ms)

    def _record(self, agent_id: str, context) -> AgentRecord:
        with self.state.lock:
            record = self.state.by_id.get(agent_id)
            if record is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"unknown agent id {agent_id!r}: register first")
            record.last_seen = time.monotonic()
            return record

    def Heartbeat(self, request, context):
        self._record(request.agent_id, context)
        return pb.HeartbeatResponse()

    def WatchCommands(self, request, context):
        record = self._record(request.agent_id, context)
        while context.is_active():
            try:
                command = record.commands.get(timeout=0.5)
            except queue.Empty:
                continue
            yield command
            if command.HasField("shutdown"):
                return

    def ReportStep(self, request, context):
        record = self._record(request.agent_id, context)
        self.state.steps.put((record.node_name, request.metrics))
        return pb.ReportStepResponse()

    def ReportResult(self, request, context):
        record = self._record(request.agent_id, context)
        with self.state.lock:
            record.result = request
        self.state.results.put((record.node_name, request))
        return pb.ReportResultResponse()

    def ReportProfile(self, request, context):
        record = self._record(request.agent_id, context)
        self.state.profiles.put((record.node_name, request))
        return pb.ReportProfileResponse()


class CoordinatorServer:
    """The gRPC server bound to an explicit address, with grpc.health.v1 served beside it."""

    def __init__(self, host: str, port: int, token: str, expected_nodes: list[str], heartbeat_interval_ms: int = 1000):
        self.state = CoordinatorState(expected_nodes)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max(16, 4 * len(expected_nodes) + 8)),
                                  interceptors=[TokenInterceptor(token)])
        control_pb2_grpc.add_CoordinatorServicer_to_server(
            CoordinatorServicer(self.state, heartbeat_interval_ms), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.host = host
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not bind the coordinator to {host}:{port}")

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def start(self) -> "CoordinatorServer":
        self.server.start()
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait(grace_s + 1)
