"""An agent's part in one job: join the coordinator, stay alive, follow its command stream.

The agent registers with its devices and versions, sends a heartbeat every interval (which
also measures its clock against the coordinator's), and runs what the command stream asks —
a profiling run or a stage — as a task in a worker (runtime/task_relay.py), so a failure in one
generation (a dead peer, a crashed stage) ends only that worker and the agent waits for the
next generation's command. It never outlives its coordinator: if heartbeats keep failing, the
coordinator declares it lost, or the process that started it is gone, it stops its worker and
exits. A service (runtime/agent_service.py) makes one Agent per job instead, and ending the job
then ends only the Agent.
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import control_pb2_grpc
from hetlaunch.protos import worker_pb2 as wpb
from hetlaunch.runtime import host_clock
from hetlaunch.runtime.auth import TOKEN_METADATA_KEY
from hetlaunch.runtime.clock_offset import ClockOffset
from hetlaunch.runtime.coordinator_probe import RUNNING, STOPPED, CoordinatorProbe
from hetlaunch.runtime.node_devices import describe_devices
from hetlaunch.runtime.policy import AgentPolicy, PolicyRefusal
from hetlaunch.runtime.step_reporter import STEP_REPORT_INTERVAL_S, StepReporter, coalesce_step_reports
from hetlaunch.runtime.task_relay import TaskRelay
from hetlaunch.runtime.tls import ClientTls
from hetlaunch.runtime.version import hetlaunch_version, torch_version

EXIT_REFUSED = 1
EXIT_LOST_COORDINATOR = 3
EXIT_DECLARED_LOST = 5  # the coordinator gave our place up (we were silent too long); restart to rejoin
REPORT_TIMEOUT_S = 30.0  # one attempt of a report RPC
# A report is sent again after these (_send): the coordinator did not answer in time (its `up`
# stopped, a slow link) or could not be reached for a moment.
RESENT_CODES = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
RESEND_PAUSE_S = 1.0
RUNNING_RESENDS = 3  # a report not answered by a coordinator that runs: sent this many more times at most
# A coordinator found stopped (its `up` on another host: runtime/coordinator_probe.py) is waited
# for this long before the agent leaves; one that is gone, 10 s.
SILENT_COORDINATOR_WAIT_S = 600.0


def _log(node: str, message: str) -> None:
    print(f"[agent {node}] {message}", file=sys.stderr, flush=True)


def default_work_dir(node_name: str) -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "hetlaunch" / "agent" / node_name


class Agent:
    def __init__(self, coordinator: str, token: str, node_name: str, parent_pid: int | None = None,
                 work_dir: Path | None = None, credentials: ClientTls | None = None,
                 policy: AgentPolicy | None = None, region: str = "", labels: dict[str, str] | None = None):
        self.node = node_name
        self.region, self.labels = region, dict(labels or {})  # what discovery matches (launcher/node_config.py)
        # Checkpoint parts on their way to the coordinator, and copies to restore from.
        self.work_dir = work_dir or default_work_dir(node_name)
        self.policy = policy or AgentPolicy.of((), (), (), self.work_dir)
        self.parent_pid = parent_pid
        self.tls = credentials is not None
        self.channel = (grpc.secure_channel(coordinator, credentials.credentials()) if credentials is not None
                        else grpc.insecure_channel(coordinator))
        self.coordinator = coordinator
        self.stub = control_pb2_grpc.CoordinatorStub(self.channel)
        self.probe = CoordinatorProbe(coordinator, tls=credentials is not None)  # silent: stopped or gone?
        self.metadata = ((TOKEN_METADATA_KEY, token),)
        # What a worker needs to reach the rendezvous store on the coordinator (runtime/grpc_store.py).
        tls = credentials or ClientTls(b"")
        store_access = wpb.StoreAccess(address=coordinator, token=token, ca_pem=tls.ca_pem,
                                       cert_pem=tls.cert_pem, key_pem=tls.key_pem)
        self.agent_id = ""
        self.clock = ClockOffset()  # to the coordinator's clock, from the heartbeats' round trips
        self.commands: queue.Queue = queue.Queue()
        # A service (runtime/agent_service.py) outlives this job: ending it must not end the process.
        self.in_service = False
        self.finished = threading.Event()
        self.exit_code: int | None = None
        self.stream_failed = False  # the command stream ended in an error, said in the log where it did
        # Step metrics go out from a thread of their own, so a slow RPC never holds up the relay.
        self.step_reports = StepReporter(lambda request: self._call("ReportStep", request),
                                         coalesce_step_reports, STEP_REPORT_INTERVAL_S)
        self.tasks = TaskRelay(node_name, self._call, self.step_reports, store_access, self.stub, self.metadata,
                               self.work_dir)

    def run(self, connect_timeout_s: float) -> int:
        try:
            return self._run(connect_timeout_s)
        finally:
            self.finished.set()
            self.step_reports.close()
            self.probe.close()
            # Nothing of this job may outlive it. The worker that ran the last task idles as the
            # spare: reaped here, not left to exit as an orphan once our pipe closes (its CPU time
            # then never reached whoever waits for us, and `up` ended before it did).
            self.tasks.close()
            if self.in_service:  # a service goes on: this job's channel ends with the job
                self.channel.close()

    def end(self, code: int, why: str) -> None:
        """End this job from another thread (a signal, a lost coordinator): stop the worker and
        let the command loop return `code`."""
        _log(self.node, why)
        self.exit_code = code
        self.finished.set()
        self.tasks.stop()
        self.commands.put(None)

    def _run(self, connect_timeout_s: float) -> int:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            hint = (" over TLS (is --ca the CA that signed the coordinator's certificate, does that certificate name "
                    "this address, and does the coordinator accept --cert?)" if self.tls else "")
            _log(self.node, f"could not reach the coordinator at {self.coordinator} within {connect_timeout_s:.0f}s{hint}")
            return EXIT_LOST_COORDINATOR
        info = pb.AgentInfo(node_name=self.node, hostname=socket.gethostname(), devices=describe_devices(),
                            cpu_count=len(os.sched_getaffinity(0)),
                            agent_version=hetlaunch_version(), torch_version=torch_version(), pid=os.getpid(),
                            region=self.region, labels=self.labels)
        try:
            reply = self.stub.Register(pb.RegisterRequest(agent=info), metadata=self.metadata, timeout=30)
        except grpc.RpcError as err:
            _log(self.node, f"registration refused ({err.code().name}): {err.details()}")
            return EXIT_REFUSED
        self.agent_id = self.tasks.agent_id = reply.agent_id
        self.tasks.warm_up()  # loads torch while the cluster is still joining
        interval = max(reply.heartbeat_interval_ms, 100) / 1000
        threading.Thread(target=self._heartbeat_loop, args=(interval,), daemon=True).start()
        threading.Thread(target=self._command_reader, daemon=True).start()
        _log(self.node, f"registered with {self.coordinator} as {self.agent_id}")
        return self._command_loop()

    def _command_loop(self) -> int:
        while True:
            command = self.commands.get()
            if command is None:
                if self.exit_code is not None:
                    return self.exit_code
                if not self.stream_failed:
                    _log(self.node, "the coordinator closed the command stream")
                return EXIT_LOST_COORDINATOR
            if command.HasField("shutdown"):
                _log(self.node, f"shutting down: {command.shutdown.reason or 'job finished'}")
                return 0
            refusal = self._refusal(command)
            if refusal is not None:
                _log(self.node, refusal)
                self._report_failure(command, refusal)
                continue
            if command.HasField("profile"):
                self.tasks.run(wpb.WorkerTask(profile=command.profile), command.generation, pb.AGENT_STATE_PROFILING)
            elif command.HasField("run_stage") and self._prepare_stage(command):
                self.tasks.run(wpb.WorkerTask(run_stage=command.run_stage), command.generation,
                               pb.AGENT_STATE_TRAINING)

    def _refusal(self, command: pb.Command) -> str | None:
        """Why this agent's policy refuses the command (runtime/policy.py), or None."""
        try:
            if command.HasField("profile") and command.profile.measure_layers:
                self.policy.check_model(command.profile.model)
            elif command.HasField("run_stage"):
                self.policy.check_run_stage(command.run_stage)
        except PolicyRefusal as err:
            return str(err)
        return None

    def _prepare_stage(self, command: pb.Command) -> bool:
        """Local checkpoint paths and the copy to restore from, then the policy's path check;
        False (and the failure reported) if the stage cannot start."""
        try:
            self.tasks.local_checkpoints(command.run_stage, command.generation)
            self.policy.check_paths(command.run_stage)
        except PolicyRefusal as err:
            _log(self.node, str(err))
            self._report_failure(command, str(err))
            return False
        except (grpc.RpcError, OSError, ValueError) as err:
            detail = err.details() if isinstance(err, grpc.RpcError) else str(err)
            self._report_failure(command, f"cannot fetch the checkpoint to restore from: {detail}")
            return False
        return True

    def _report_failure(self, command: pb.Command, error: str) -> None:
        """A profiling run or a stage that never started, reported as failed."""
        if command.HasField("profile"):
            self._call("ReportProfile", pb.ReportProfileRequest(agent_id=self.agent_id, ok=False, error=error,
                                                                generation=command.generation))
        elif command.HasField("run_stage"):
            self._call("ReportResult", pb.ReportResultRequest(agent_id=self.agent_id, ok=False, error=error,
                                                              generation=command.generation))

    def _call(self, method: str, request) -> None:
        """A report RPC (steps on the reporter's thread, the others on the relay's or the command
        loop's), failures logged. Sent again while the coordinator is stopped (the `up` that started
        this agent is, or runtime/coordinator_probe.py finds it so), and RUNNING_RESENDS times more
        while it runs: sent once, a 40 s Ctrl-Z of `up` lost the 19 steps in flight and the run
        ended short of them, and a result whose attempt timed out just after `up` was continued,
        while the coordinator worked through what had piled up, was lost. Safe to send twice: the
        coordinator keeps one report per stage and step (launcher/step_aggregator.py), one part
        per writer (launcher/checkpoint_book.py), results, moves and profiles by node. The relay
        holds the stage watchdog while it waits, and every step report goes before a result, part
        or move (StepReporter.flush waits for them)."""
        def resend(attempt: int) -> bool:
            if self._parent_stopped():
                return True
            state = self.probe.state()
            # Running, it may be working through what piled up while it was stopped; a few more
            # tries then, not forever (the relay thread or the command loop waits on this).
            return state == STOPPED or (state == RUNNING and attempt <= RUNNING_RESENDS)
        self._send(method, request, resend)

    def _send(self, method: str, request, resend) -> None:
        for attempt in itertools.count(1):
            try:
                getattr(self.stub, method)(request, metadata=self.metadata, timeout=REPORT_TIMEOUT_S)
                if attempt > 1:
                    _log(self.node, f"{method} answered at attempt {attempt}")
                return
            except grpc.RpcError as err:
                if err.code() not in RESENT_CODES or self.finished.is_set() or not resend(attempt):
                    _log(self.node, f"{method} failed ({err.code().name}): {err.details()}")
                    return
                if attempt == 1:  # said once: refused connections fail at once, and this repeats each second
                    _log(self.node, f"{method} not answered ({err.code().name}): sending it again until it is")
            if self.finished.wait(RESEND_PAUSE_S):
                _log(self.node, f"{method} not sent: the job ended")
                return

    def _command_reader(self) -> None:
        request = pb.WatchCommandsRequest(agent_id=self.agent_id)
        try:
            for command in self.stub.WatchCommands(request, metadata=self.metadata):
                if command.HasField("abort") and command.abort.link_probe:
                    done = self.tasks.abort_probe(command.generation)  # a kill, no snapshot: it returns at once
                    _log(self.node, f"aborted the link probe ({done}): {command.abort.reason}")
                    continue
                if command.HasField("abort"):
                    # Here, not in the command loop: that loop is busy relaying the worker being aborted.
                    _log(self.node, f"aborting the running task: {command.abort.reason}")
                    threading.Thread(target=self.tasks.stop, args=(command.abort.snapshot_dir, command.generation),
                                     kwargs={"stage_only": True}, daemon=True).start()
                    continue
                if command.HasField("move"):  # for the running stage, which the command loop is relaying
                    self.tasks.pass_move(command.move, command.generation)
                    continue
                if command.HasField("shutdown") and self.tasks.training.is_set():
                    _log(self.node, f"stopping mid-task: {command.shutdown.reason}")
                    self.tasks.stop()
                self.commands.put(command)
        except grpc.RpcError as err:
            if self.tasks.training.is_set():
                _log(self.node, f"lost the coordinator mid-task: {err.details()}")
                self.tasks.stop()
            else:  # between tasks: said so here, not as a stream the coordinator closed (`up` was killed)
                _log(self.node, f"lost the coordinator: {err.details()}")
            self.stream_failed = True
        self.commands.put(None)

    def _heartbeat_loop(self, interval: float) -> None:
        last_ok = time.monotonic()
        there_since = None  # since when the coordinator was found stopped (runtime/coordinator_probe.py)
        lost_after = max(10 * interval, 10.0)
        while not self.finished.wait(interval):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                self.exit(EXIT_LOST_COORDINATOR, "the process that started this agent is gone; exiting")
                return
            state = self.tasks.state()
            clock = self.clock
            try:
                sent = host_clock.now()
                reply = self.stub.Heartbeat(pb.HeartbeatRequest(
                    agent_id=self.agent_id, state=state, step=self.tasks.step, has_clock=clock.known,
                    clock_offset_s=clock.offset_s, clock_rtt_s=clock.rtt_s if clock.known else 0.0),
                    metadata=self.metadata, timeout=max(interval * 3, 2.0))
                clock.sample(sent, reply.coordinator_time, host_clock.now())
                last_ok = time.monotonic()
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION:  # declared lost while we were silent
                    self.exit(EXIT_DECLARED_LOST, f"{err.details()}; restart the agent to rejoin")
                    return
                there = False
                if self._parent_stopped():  # `up` suspended (Ctrl-Z): its silence is no lost coordinator
                    last_ok = time.monotonic()
                elif err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.probe.stopped():
                    there = True  # stopped (its `up` on another host), not gone
                    there_since = there_since or time.monotonic()
                    if time.monotonic() - there_since <= SILENT_COORDINATOR_WAIT_S:
                        last_ok = time.monotonic()
                if time.monotonic() - last_ok > lost_after:
                    why = (f"the coordinator was stopped for over {SILENT_COORDINATOR_WAIT_S:.0f}s"
                           if there else f"no heartbeat accepted for {lost_after:.0f}s")
                    self.exit(EXIT_LOST_COORDINATOR, f"{why} ({err.code().name}); exiting")
                    return
                continue
            self.probe.close()  # answered: no connection held until the next silence
            there_since = None

    def _parent_stopped(self) -> bool:
        """Whether the `up` that started this agent is stopped (Ctrl-Z, SIGSTOP): then its
        coordinator answers nothing until it is continued, and this agent waits for it rather
        than leave after 10 s (a hostile review: a 13 s Ctrl-Z of `up` ended the job)."""
        if self.parent_pid is None:
            return False
        try:
            return psutil.Process(self.parent_pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
        except psutil.Error:
            return False

    def exit(self, code: int, why: str) -> None:
        """Leave the job for good: in a service, end it; else stop the worker and end the process."""
        if self.in_service:
            self.end(code, why)
            return
        _log(self.node, why)
        try:
            self.tasks.close()  # the running worker killed, the spare reaped
        finally:
            os._exit(code)  # whatever closing met, the agent never outlives its job
