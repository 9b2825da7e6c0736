"""The coordinator's gRPC service: who joined, who is alive, commands out, metrics in.

The servicer is thin: it checks the request, updates `CoordinatorState` under one lock,
and aborts with a precise status code. `hetlaunch up` (launcher/job_driver.py) drives the job
by reading and writing that state; the servicer never decides anything about the job.
"""

from __future__ import annotations

import hmac
import math
import queue
import threading
import time
import itertools
import uuid
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hetlaunch.launcher.discovery import Discovery
from hetlaunch.launcher.rendezvous_store import RendezvousStore, StoreRefused
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.launcher.part_store import PartRefused, receive, send, upload_target
from hetlaunch.protos import control_pb2_grpc
from hetlaunch.runtime.auth import TOKEN_METADATA_KEY
from hetlaunch.runtime.version import hetlaunch_version, torch_version

SERVICE_NAME = "hetlaunch.v1.Coordinator"
MAX_PART_BYTES = 1 << 40  # a sanity bound on one uploaded checkpoint part (1 TiB)


@dataclass
class AgentRecord:
    agent_id: str
    node_name: str
    info: pb.AgentInfo
    last_seen: float
    commands: queue.Queue = field(default_factory=queue.Queue)
    state: int = pb.AGENT_STATE_IDLE  # from its last heartbeat
    step: int = -1
    disconnected: bool = False  # its command stream broke before a shutdown was sent
    lost: bool = False  # declared lost: its calls are refused, its name is free to join again
    clock: tuple[float, float] | None = None  # (offset to our clock, round trip), runtime/clock_offset.py


class Refused(Exception):
    """A registration the coordinator turns down; `code` is the gRPC status to abort with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class CoordinatorState:
    """Everything the service knows, behind one lock; shared by the gRPC threads and the job driver.

    Reports (steps, results, profiles) are tagged with the generation of the command that
    caused them. Only the current generation's reports are kept: a late report of a stage
    that an earlier generation started is counted in `stale_reports` and dropped.
    """

    def __init__(self, expected_nodes: list[str], discovery: Discovery | None = None):
        self._lock = threading.Lock()
        self.expected_nodes = list(expected_nodes)
        self.discovery = discovery  # who else may join (launcher/discovery.py); None: only the listed nodes
        self._agents: dict[str, AgentRecord] = {}   # by node name
        self._by_id: dict[str, AgentRecord] = {}
        self._refusals: dict[str, str] = {}         # node name -> why its registration was refused
        self._generation = 0
        self.stale_reports = 0
        self._steps: queue.Queue[tuple[str, pb.StepMetrics]] = queue.Queue()
        self._results: queue.Queue[tuple[str, pb.ReportResultRequest]] = queue.Queue()
        self._profiles: queue.Queue[tuple[str, pb.ReportProfileRequest]] = queue.Queue()
        self._checkpoints: queue.Queue[tuple[str, pb.CheckpointPart]] = queue.Queue()
        self._moves: queue.Queue[tuple[str, pb.MoveReport]] = queue.Queue()  # launcher/live_move.py
        self.joins: queue.Queue[str] = queue.Queue()  # every registration, in order (the first ones and rejoins)
        self.checkpoint_root: Path | None = None  # where uploaded parts go; None: no uploads accepted
        self.down_requested = ""  # why `hetlaunch down` asked the job to end; empty: it did not
        self.store = RendezvousStore()  # the data plane's rendezvous keys, served by StoreOp

    # --- the service's side

    def register(self, info: pb.AgentInfo, versions: tuple[str, str]) -> AgentRecord:
        """Admit an agent, or raise Refused. A node that already joined keeps its place whatever
        the newcomer says, so a second registration under its name can never disturb a job."""
        name = info.node_name
        with self._lock:
            theirs = (info.agent_version, info.torch_version)
            mismatch = theirs != versions and (f"version mismatch for node {name!r}: agent has hetlaunch {theirs[0]}, "
                                               f"torch {theirs[1]}; coordinator has hetlaunch {versions[0]}, "
                                               f"torch {versions[1]}")
            if name not in self.expected_nodes:
                why = self.discovery.admit(info, mismatch) if self.discovery is not None else (
                    f"node {name[:64]!r} is not in the cluster (nodes: {', '.join(self.expected_nodes)})")
                if why is not None:
                    raise Refused(grpc.StatusCode.PERMISSION_DENIED if self.discovery else grpc.StatusCode.NOT_FOUND,
                                  why)
                self.expected_nodes.append(name)
            if name in self._agents:
                raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"node {name!r} has already joined")
            if mismatch:
                self._refusals[name] = mismatch  # a listed node that cannot run ends `up` at once, by name
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
            record = AgentRecord(agent_id=uuid.uuid4().hex[:12], node_name=name, info=info, last_seen=time.monotonic())
            self._agents[name] = record
            self._by_id[record.agent_id] = record
            self._refusals.pop(name, None)
            self.joins.put(name)
            return record

    def touch(self, agent_id: str, state: int | None = None, step: int | None = None) -> AgentRecord | None:
        """The agent with this id, marked alive now (None if unknown)."""
        with self._lock:
            record = self._by_id.get(agent_id)
            if record is not None:
                record.last_seen = time.monotonic()
                if state is not None:
                    record.state, record.step = state, step
            return record

    def stream_broke(self, record: AgentRecord) -> None:
        with self._lock:
            record.disconnected = True

    def report_step(self, node: str, generation: int, metrics: pb.StepMetrics) -> None:
        self._keep_if_current(self._steps, generation, (node, metrics))

    def report_result(self, node: str, generation: int, result: pb.ReportResultRequest) -> None:
        self._keep_if_current(self._results, generation, (node, result))

    def report_profile(self, node: str, generation: int, report: pb.ReportProfileRequest) -> None:
        self._keep_if_current(self._profiles, generation, (node, report))

    def report_checkpoint(self, node: str, generation: int, part: pb.CheckpointPart) -> None:
        self._keep_if_current(self._checkpoints, generation, (node, part))

    def report_move(self, node: str, generation: int, report: pb.MoveReport) -> None:
        self._keep_if_current(self._moves, generation, (node, report))

    def _keep_if_current(self, reports: queue.Queue, generation: int, report: tuple) -> None:
        # Checked and queued under the lock that begin_generation drains under: no stale report
        # can slip in between a check and the drain.
        with self._lock:
            if generation == self._generation:
                reports.put(report)
            else:
                self.stale_reports += 1

    # --- the job driver's side

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    def begin_generation(self) -> int:
        """Start the next generation: reports of earlier ones are dropped from now on."""
        with self._lock:
            self._generation += 1
            for reports in (self._steps, self._results, self._profiles, self._checkpoints, self._moves):
                while not reports.empty():
                    reports.get_nowait()
                    self.stale_reports += 1
            return self._generation

    def send(self, node_name: str, command: pb.Command) -> None:
        """Queue a command for one agent, stamped with the current generation."""
        with self._lock:
            command.generation = self._generation
            self._agents[node_name].commands.put(command)

    def mark_lost(self, node_name: str) -> None:
        """Give a lost node's place up: its agent's calls are refused from now on (it exits when
        it hears so), and an agent may join under its name again."""
        with self._lock:
            record = self._agents.pop(node_name, None)
            if record is not None:
                record.lost = True

    def shutdown_all(self, reason: str) -> None:
        for name in self.joined_nodes():
            self.send(name, pb.Command(shutdown=pb.Shutdown(reason=reason)))

    def joined_nodes(self) -> list[str]:
        with self._lock:
            return list(self._agents)

    def missing_nodes(self) -> list[str]:
        with self._lock:
            return [n for n in self.expected_nodes if n not in self._agents]

    def refusal(self) -> tuple[str, str] | None:
        """A node whose registration was refused and that has not joined since: (name, why)."""
        with self._lock:
            return next(iter(self._refusals.items()), None)

    def agent_id(self, node_name: str) -> str:
        with self._lock:
            return self._agents[node_name].agent_id

    def pending_commands(self, node_name: str) -> int:
        """Commands queued for an agent that its stream has not delivered yet."""
        with self._lock:
            return self._agents[node_name].commands.qsize()

    def disconnected(self, node_name: str) -> bool:
        with self._lock:
            return self._agents[node_name].disconnected

    def clock_offsets(self) -> dict[str, tuple[float, float]]:
        """node -> (seconds to add to its wall clock to read ours, the round trip that bounds it)."""
        with self._lock:
            return {name: record.clock for name, record in self._agents.items() if record.clock is not None}

    def agent_info(self, node_name: str) -> pb.AgentInfo:
        with self._lock:
            return self._agents[node_name].info

    def status(self, now: float) -> pb.GetStatusResponse:
        states = {pb.AGENT_STATE_IDLE: "idle", pb.AGENT_STATE_PROFILING: "profiling",
                  pb.AGENT_STATE_TRAINING: "training"}
        with self._lock:
            nodes = [pb.NodeStatus(node=name, state="lost" if rec.lost else states.get(rec.state, "idle"),
                                   step=rec.step, silent_s=now - rec.last_seen) for name, rec in self._agents.items()]
            return pb.GetStatusResponse(generation=self._generation, nodes=nodes, down_requested=self.down_requested)

    def silent_for(self, now: float) -> dict[str, tuple[float, int, int]]:
        """Per joined node: (seconds since it was last heard from, its last state, its last step)."""
        with self._lock:
            return {name: (now - rec.last_seen, rec.state, rec.step) for name, rec in self._agents.items()}

    def next_step(self, timeout: float) -> tuple[str, pb.StepMetrics] | None:
        try:
            return self._steps.get(timeout=timeout)
        except queue.Empty:
            return None

    def next_profile(self, timeout: float) -> tuple[str, pb.ReportProfileRequest] | None:
        try:
            return self._profiles.get(timeout=timeout)
        except queue.Empty:
            return None

    def results(self) -> list[tuple[str, pb.ReportResultRequest]]:
        """Every stage result reported since the last call."""
        return _drain(self._results)

    def checkpoints(self) -> list[tuple[str, pb.CheckpointPart]]:
        """Every checkpoint part reported since the last call."""
        return _drain(self._checkpoints)

    def moves(self) -> list[tuple[str, pb.MoveReport]]:
        """Every live-move report since the last call."""
        return _drain(self._moves)

    def steps_pending(self) -> bool:
        return not self._steps.empty()


def _drain(reports: queue.Queue) -> list:
    out = []
    while not reports.empty():
        out.append(reports.get_nowait())
    return out


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
        try:
            record = self.state.register(request.agent, (hetlaunch_version(), torch_version()))
        except Refused as refused:
            context.abort(refused.code, str(refused))
        return pb.RegisterResponse(agent_id=record.agent_id, heartbeat_interval_ms=self.heartbeat_interval_ms)

    def _record(self, agent_id: str, context, state: int | None = None, step: int | None = None) -> AgentRecord:
        record = self.state.touch(agent_id, state, step)
        if record is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown agent id {agent_id!r}: register first")
        if record.lost:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"node {record.node_name!r} was declared lost and its place given up")
        return record

    def Heartbeat(self, request, context):
        record = self._record(request.agent_id, context, request.state, request.step)
        if request.has_clock and math.isfinite(request.clock_offset_s) and math.isfinite(request.clock_rtt_s):
            record.clock = (request.clock_offset_s, request.clock_rtt_s)
        return pb.HeartbeatResponse(coordinator_time=time.time())

    def WatchCommands(self, request, context):
        record = self._record(request.agent_id, context)
        while context.is_active() and not record.lost:
            try:
                command = record.commands.get(timeout=0.5)
            except queue.Empty:
                continue
            yield command
            if command.HasField("shutdown"):
                return
        if not record.lost:
            self.state.stream_broke(record)  # the agent went away without being told to

    def ReportStep(self, request, context):
        record = self._record(request.agent_id, context)
        self.state.report_step(record.node_name, request.generation, request.metrics)
        return pb.ReportStepResponse()

    def ReportResult(self, request, context):
        record = self._record(request.agent_id, context)
        self.state.report_result(record.node_name, request.generation, request)
        return pb.ReportResultResponse()

    def ReportProfile(self, request, context):
        record = self._record(request.agent_id, context)
        self.state.report_profile(record.node_name, request.generation, request)
        return pb.ReportProfileResponse()

    def ReportMove(self, request, context):
        record = self._record(request.agent_id, context)
        self.state.report_move(record.node_name, request.generation, request.report)
        return pb.ReportMoveResponse()

    def UploadPart(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an empty upload")
        record = self._record(first.agent_id, context)
        root = self.state.checkpoint_root
        if root is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this job takes no checkpoint uploads")
        try:
            return receive(itertools.chain([first], request_iterator), upload_target(root, record.node_name, first),
                           MAX_PART_BYTES)
        except PartRefused as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except OSError as err:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot store the part: {err.strerror or err}")

    def DownloadPart(self, request, context):
        self._record(request.agent_id, context)
        root = self.state.checkpoint_root
        if root is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this job has no checkpoints to download")
        try:
            yield from send(root, request)
        except PartRefused as err:
            context.abort(grpc.StatusCode.NOT_FOUND, str(err))

    def StoreOp(self, request, context):
        remaining = context.time_remaining()
        try:
            return self.state.store.handle(request, min(remaining - 1.0, 600.0) if remaining is not None else 600.0,
                                           context.is_active)
        except (StoreRefused, IndexError, ValueError) as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"store: {err}")

    def GetStatus(self, request, context):
        return self.state.status(time.monotonic())

    def Down(self, request, context):
        self.state.down_requested = " ".join(request.reason.split())[:200] or "hetlaunch down"
        return pb.DownResponse()

    def ReportCheckpoint(self, request, context):
        record = self._record(request.agent_id, context)
        self.state.report_checkpoint(record.node_name, request.generation, request.part)
        return pb.ReportCheckpointResponse()


def host_port(host: str, port: int) -> str:
    """HOST:PORT as gRPC and `--coordinator` take it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class CoordinatorServer:
    """The gRPC server bound to an explicit address, with grpc.health.v1 served beside it."""

    def __init__(self, host: str, port: int, token: str, expected_nodes: list[str], heartbeat_interval_ms: int = 1000,
                 credentials: grpc.ServerCredentials | None = None, discovery: Discovery | None = None):
        self.state = CoordinatorState(expected_nodes, discovery)
        most = len(expected_nodes) + (0 if discovery is None else discovery.limit or 64)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max(16, 4 * most + 8)),
                                  interceptors=[TokenInterceptor(token)])
        control_pb2_grpc.add_CoordinatorServicer_to_server(
            CoordinatorServicer(self.state, heartbeat_interval_ms), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.host = host
        self.tls = credentials is not None
        self.port = (self.server.add_secure_port(f"{host}:{port}", credentials) if credentials is not None
                     else self.server.add_insecure_port(f"{host}:{port}"))
        if self.port == 0:
            raise OSError(f"could not bind the coordinator to {host}:{port}")

    @property
    def address(self) -> str:
        return host_port(self.host, self.port)

    def start(self) -> "CoordinatorServer":
        self.server.start()
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        self.state.store.close()  # before the server waits for its handlers: release blocked rendezvous calls
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait(grace_s + 1)
