"""What the coordinator knows, behind one lock: who joined, who is alive, commands out, reports in.

The gRPC servicer (launcher/coordinator.py) writes it from its threads as agents call; the job
driver (launcher/job_driver.py) reads reports and queues commands. Reports are tagged with the
generation of the command that caused them, so a late report of an earlier generation can never
be taken for one of the current generation.
"""

from __future__ import annotations

import queue
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from hetlaunch.launcher.discovery import Discovery
from hetlaunch.launcher.pause_clock import PauseClock
from hetlaunch.launcher.rendezvous_store import RendezvousStore
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.store_keys import generation_prefix


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
    watcher: object | None = None  # its command stream now: a newer one ends the older (one thread an agent)


DEFAULT_DOWN_REASON = "hetlaunch down"  # what `down` without --reason asks for (said once, not twice)
MAX_QUEUED_STEPS = 1 << 16  # step reports waiting for the job driver (about 200 bytes each)


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
        # Silence is measured on a clock that leaves out the time this process did not run
        # (launcher/pause_clock.py): `up` stopped by Ctrl-Z found every node silent on waking.
        self.clock = PauseClock()
        self.expected_nodes = list(expected_nodes)
        self.discovery = discovery  # who else may join (launcher/discovery.py); None: only the listed nodes
        self._agents: dict[str, AgentRecord] = {}   # by node name
        self._by_id: dict[str, AgentRecord] = {}
        self._refusals: dict[str, str] = {}         # node name -> why its registration was refused
        self._generation = 0
        self.stale_reports = 0
        # Bounded: an agent's reports queued while nothing takes them (before the first generation's
        # driver follows steps) grew the coordinator by 634 MB in 6 s (a hostile review); past the
        # bound a report is dropped and counted (a real job's driver takes them as they come).
        self._steps: queue.Queue[tuple[str, pb.StepMetrics]] = queue.Queue(maxsize=MAX_QUEUED_STEPS)
        self.dropped_reports = 0
        self._results: queue.Queue[tuple[str, pb.ReportResultRequest]] = queue.Queue()
        self._profiles: queue.Queue[tuple[str, pb.ReportProfileRequest]] = queue.Queue()
        self._checkpoints: queue.Queue[tuple[str, pb.CheckpointPart]] = queue.Queue()
        self._moves: queue.Queue[tuple[str, pb.MoveReport]] = queue.Queue()  # launcher/live_move.py
        self.joins: queue.Queue[str] = queue.Queue()  # every registration, in order (the first ones and rejoins)
        self.checkpoint_root: Path | None = None  # where uploaded parts go; None: no uploads accepted
        self.down_requested = ""  # why `hetlaunch down` asked the job to end; empty: it did not
        most = len(self.expected_nodes) + (0 if discovery is None else discovery.limit or 64)
        # The data plane's rendezvous keys, served by StoreOp; a rank blocks on one call at a time.
        self.store = RendezvousStore(max_blocked=2 * most + 8)

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
            record = AgentRecord(agent_id=uuid.uuid4().hex[:12], node_name=name, info=info, last_seen=self.clock.now())
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
                record.last_seen = self.clock.now()
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
            if generation != self._generation:
                self.stale_reports += 1
                return
            try:
                reports.put_nowait(report)
            except queue.Full:
                self.dropped_reports += 1

    # --- the job driver's side

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    def begin_generation(self) -> int:
        """Start the next generation: reports of earlier ones are dropped from now on."""
        with self._lock:
            self._generation += 1
            self.store.keep_only(generation_prefix(self._generation))  # no one may use the older keys again
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

    def status(self) -> pb.GetStatusResponse:
        states = {pb.AGENT_STATE_IDLE: "idle", pb.AGENT_STATE_PROFILING: "profiling",
                  pb.AGENT_STATE_TRAINING: "training"}
        now = self.clock.now()
        with self._lock:
            nodes = [pb.NodeStatus(node=name, state="lost" if rec.lost else states.get(rec.state, "idle"),
                                   step=rec.step, silent_s=now - rec.last_seen) for name, rec in self._agents.items()]
            return pb.GetStatusResponse(generation=self._generation, nodes=nodes, down_requested=self.down_requested)

    def silent_for(self) -> dict[str, tuple[float, int, int]]:
        """Per joined node: (seconds since it was last heard from, not counting time this process
        did not run; its last state, its last step)."""
        now = self.clock.now()
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

    def steps(self) -> list[tuple[str, pb.StepMetrics]]:
        """Every step report of this generation not yet taken by next_step."""
        return _drain(self._steps)

    def steps_pending(self) -> bool:
        return not self._steps.empty()


def _drain(reports: queue.Queue) -> list:
    out = []
    while not reports.empty():
        out.append(reports.get_nowait())
    return out
