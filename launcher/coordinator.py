"""The coordinator's gRPC service: who joined, who is alive, commands out, metrics in.

The servicer is thin: it checks the request, updates `CoordinatorState` (launcher/coordinator_state.py)
under its lock, and aborts with a precise status code. `hetlaunch up` (launcher/job_driver.py) drives
the job by reading and writing that state; the servicer never decides anything about the job.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import queue
import resource
import threading
import time
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hetlaunch.launcher.call_guard import CallGuard, pool_threads
from hetlaunch.launcher.coordinator_state import DEFAULT_DOWN_REASON, AgentRecord, CoordinatorState, Refused
from hetlaunch.launcher.discovery import Discovery
from hetlaunch.launcher.plain_text import plain
from hetlaunch.launcher.part_store import PartRefused, receive, send, upload_target
from hetlaunch.launcher.rendezvous_store import StoreRefused
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import control_pb2_grpc
from hetlaunch.runtime import host_clock
from hetlaunch.runtime.step_reporter import MAX_PENDING
from hetlaunch.runtime.store_keys import generation_prefix
from hetlaunch.runtime.version import hetlaunch_version, torch_version

SERVICE_NAME = "hetlaunch.v1.Coordinator"
MAX_PART_BYTES = 1 << 40  # a sanity bound on one uploaded checkpoint part (1 TiB)


def _next_command(commands: queue.Queue, still_mine: Callable[[], bool], timeout_s: float) -> pb.Command | None:
    """The next command, taken only while `still_mine()` (checked under the queue's lock, which a
    newer stream takes to replace this one: a command is never taken by a stream already replaced,
    so none is handed back out of order); None after `timeout_s` or once replaced. queue.Queue's
    lock, condition and deque are used as its own get() uses them."""
    deadline = time.monotonic() + timeout_s
    with commands.not_empty:
        while not commands.queue:
            left = deadline - time.monotonic()
            if left <= 0 or not still_mine():
                return None
            commands.not_empty.wait(left)
        if not still_mine():
            return None
        command = commands.queue.popleft()
        commands.not_full.notify()
        return command


class CoordinatorServicer(control_pb2_grpc.CoordinatorServicer):
    def __init__(self, state: CoordinatorState, heartbeat_interval_ms: int = 1000, transfers: int = 16):
        self.state = state
        self.heartbeat_interval_ms = heartbeat_interval_ms
        # Part uploads and downloads under way at once: each holds a thread for as long as its peer
        # likes (a stream that sends nothing, a download never read), and 40 of them from one agent
        # took every thread, so good agents' heartbeats went unanswered (a hostile review). The
        # pool has threads for these beside everything else (call_guard.pool_threads).
        self._transfers = threading.BoundedSemaphore(transfers)
        self._transfer_limit = transfers

    @contextlib.contextmanager
    def _transfer(self, context):
        if not self._transfers.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self._transfer_limit} checkpoint transfers are under way already; try again")
        try:
            yield
        finally:
            self._transfers.release()

    def Register(self, request, context):
        agent = request.agent
        for field in ("node_name", "hostname", "agent_version", "torch_version"):  # shown in refusals and status
            setattr(agent, field, plain(getattr(agent, field), 200))
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
        return pb.HeartbeatResponse(coordinator_time=host_clock.now())

    def WatchCommands(self, request, context):
        record = self._record(request.agent_id, context)
        commands = record.commands
        with commands.mutex:  # an agent that reconnects replaces its stream: more never pile up
            me = record.watcher = object()
            commands.not_empty.notify_all()  # the older stream sees it at once
        while context.is_active() and not record.lost and record.watcher is me:
            command = _next_command(commands, lambda: record.watcher is me, 0.5)
            if command is None:
                continue
            yield command
            if command.HasField("shutdown"):
                return
        if not record.lost and record.watcher is me:
            self.state.stream_broke(record)  # the agent went away without being told to

    def ReportStep(self, request, context):
        record = self._record(request.agent_id, context)
        if len(request.more_metrics) >= MAX_PENDING:  # an agent coalesces at most what its relay queues
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{len(request.more_metrics) + 1} steps in one report: at most {MAX_PENDING}")
        for metrics in (request.metrics, *request.more_metrics):  # coalesced: one RPC, the steps in order
            self.state.report_step(record.node_name, request.generation, metrics)
        return pb.ReportStepResponse()

    def ReportResult(self, request, context):
        record = self._record(request.agent_id, context)
        request.error = plain(request.error)  # printed on the user's terminal: no escape sequences
        self.state.report_result(record.node_name, request.generation, request)
        return pb.ReportResultResponse()

    def ReportProfile(self, request, context):
        record = self._record(request.agent_id, context)
        request.error = plain(request.error)
        self.state.report_profile(record.node_name, request.generation, request)
        return pb.ReportProfileResponse()

    def ReportMove(self, request, context):
        record = self._record(request.agent_id, context)
        request.report.error = plain(request.report.error)
        self.state.report_move(record.node_name, request.generation, request.report)
        return pb.ReportMoveResponse()

    def UploadPart(self, request_iterator, context):
        with self._transfer(context):
            return self._upload(request_iterator, context)

    def _upload(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an empty upload")
        record = self._record(first.agent_id, context)
        root = self.state.checkpoint_root
        if root is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this job takes no checkpoint uploads")
        if first.generation != self.state.generation:  # its report would be dropped as stale: nothing to keep
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"a part of generation {first.generation}, not the current one ({self.state.generation})")
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
        with self._transfer(context):
            try:
                yield from send(root, request)
            except PartRefused as err:
                context.abort(grpc.StatusCode.NOT_FOUND, str(err))

    def StoreOp(self, request, context):
        # Only a registered, live agent's worker, and only in the current generation's keys: a token
        # holder that never registered read every rank's address, and wrote garbage into the next
        # generation's keys (a survivor then died of std::bad_alloc and was blamed).
        self._record(request.agent_id, context)
        prefix = generation_prefix(self.state.generation)
        if any(not key.startswith(prefix) for key in request.keys):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"store: keys must be the current generation's ({prefix}...)")
        remaining = context.time_remaining()
        try:
            return self.state.store.handle(request, min(remaining - 1.0, 600.0) if remaining is not None else 600.0,
                                           context.is_active, caller=request.agent_id)
        except StoreRefused as err:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED if err.full else grpc.StatusCode.INVALID_ARGUMENT,
                          f"store: {err}")
        except (IndexError, ValueError) as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"store: {err}")

    def GetStatus(self, request, context):
        return self.state.status()

    def Down(self, request, context):
        self.state.down_requested = " ".join(request.reason.split())[:200] or DEFAULT_DOWN_REASON
        return pb.DownResponse()

    def ReportCheckpoint(self, request, context):
        record = self._record(request.agent_id, context)
        self.state.report_checkpoint(record.node_name, request.generation, request.part)
        return pb.ReportCheckpointResponse()


def host_port(host: str, port: int) -> str:
    """HOST:PORT as gRPC and `--coordinator` take it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# Connections cost the coordinator a file descriptor each before any token is checked: one that
# has not finished its handshake (TLS, HTTP/2's preface) in this long is closed, and so is one idle
# this long (agents hold a command stream open, which is not idle). Without them gRPC closed
# silent connections only after minutes, and 400 held open from one client used up a 256-file
# limit: the coordinator could not open a file or answer its own health check (hostile review).
HANDSHAKE_TIMEOUT_MS = 10_000
MAX_CONNECTION_IDLE_MS = 120_000
# ... and the file limit is raised to this (or the hard limit, if lower): Linux starts processes at
# a soft 1,024, so a client opening ~100 connections a second held it at the limit through the
# handshake timeout; at 65,536 it takes ~6,500 a second.
OPEN_FILES = 65_536


def raise_open_file_limit(want: int = OPEN_FILES) -> int:
    """Lift this process's soft limit on open files towards `want` (never above its hard limit,
    never lowered); the soft limit it has after. Agents it starts inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a container may refuse: keep what there is
            pass
    return soft


class CoordinatorServer:
    """The gRPC server bound to an explicit address, with grpc.health.v1 served beside it."""

    def __init__(self, host: str, port: int, token: str, expected_nodes: list[str], heartbeat_interval_ms: int = 1000,
                 credentials: grpc.ServerCredentials | None = None, discovery: Discovery | None = None):
        raise_open_file_limit()
        self.state = CoordinatorState(expected_nodes, discovery)
        most = len(expected_nodes) + (0 if discovery is None else discovery.limit or 64)
        transfers = 2 * most  # an upload and a download per node at once; the pool has threads for them
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=pool_threads(most) + transfers),
                                  interceptors=[CallGuard(token, SERVICE_NAME)],
                                  options=[("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
                                           ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS)])
        control_pb2_grpc.add_CoordinatorServicer_to_server(
            CoordinatorServicer(self.state, heartbeat_interval_ms, transfers), self.server)
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
        self.state.clock.stop()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait(grace_s + 1)
