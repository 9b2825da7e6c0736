"""The per-node agent: join a coordinator, stay alive, run what it is given in a worker.

    python -m hetlaunch.runtime.agent --coordinator HOST:PORT --name NODE [--token-file F]

(`hetlaunch agent` is the same.) The agent is the node's long-lived control plane: it
registers with its devices and versions, sends a heartbeat every interval, and follows
the coordinator's command stream. Each stage or profiling run is a worker subprocess
(runtime/worker.py) that the agent starts, relays and can kill, so a failure in one
generation — a dead peer, a crashed stage — ends only that worker, and the agent waits
for the next generation's command. It never outlives its coordinator: if heartbeats keep
failing, the coordinator declares it lost, or the process that started it is gone, it
stops its worker and exits.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path

import grpc

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import control_pb2_grpc
from hetlaunch.protos import worker_pb2 as wpb
from hetlaunch.runtime.auth import TOKEN_METADATA_KEY, read_token
from hetlaunch.runtime.clock_offset import ClockOffset
from hetlaunch.runtime.devices import describe_devices
from hetlaunch.runtime.labels import parse_labels
from hetlaunch.runtime.policy import AgentPolicy, PolicyRefusal
from hetlaunch.runtime.step_reporter import StepReporter
from hetlaunch.runtime.supervisor import WorkerProcess
from hetlaunch.runtime.tls import ClientTls
from hetlaunch.runtime.worker_pipe import FrameError
from hetlaunch.runtime.version import hetlaunch_version, torch_version

EXIT_REFUSED = 1
EXIT_LOST_COORDINATOR = 3
EXIT_DECLARED_LOST = 5  # the coordinator gave our place up (we were silent too long); restart to rejoin


def _log(node: str, message: str) -> None:
    print(f"[agent {node}] {message}", file=sys.stderr, flush=True)


class Agent:
    def __init__(self, coordinator: str, token: str, node_name: str, parent_pid: int | None = None,
                 work_dir: Path | None = None, credentials: ClientTls | None = None,
                 policy: AgentPolicy | None = None, region: str = "", labels: dict[str, str] | None = None):
        self.node = node_name
        self.region, self.labels = region, dict(labels or {})  # what discovery matches (launcher/node_config.py)
        # Checkpoint parts on their way to the coordinator, and copies to restore from.
        self.work_dir = work_dir or default_work_dir(node_name)
        self.policy = policy or AgentPolicy.of((), (), (), self.work_dir)
        self.uploading = False
        self.local_snapshot_dir = ""
        self.uploader = None
        self.spare: WorkerProcess | None = None  # the next task's worker: started ahead, or the last one
        self.parent_pid = parent_pid
        self.tls = credentials is not None
        self.channel = (grpc.secure_channel(coordinator, credentials.credentials()) if credentials is not None
                        else grpc.insecure_channel(coordinator))
        self.coordinator = coordinator
        self.stub = control_pb2_grpc.CoordinatorStub(self.channel)
        self.metadata = ((TOKEN_METADATA_KEY, token),)
        # What a worker needs to reach the rendezvous store on the coordinator (runtime/grpc_store.py).
        tls = credentials or ClientTls(b"")
        self.store_access = wpb.StoreAccess(address=coordinator, token=token, ca_pem=tls.ca_pem,
                                            cert_pem=tls.cert_pem, key_pem=tls.key_pem)
        self.agent_id = ""
        self.training = threading.Event()  # busy with a command (profiling or a stage): peers may wait on us
        self.busy_state = pb.AGENT_STATE_IDLE  # what the heartbeat says we are doing
        self.clock = ClockOffset()  # to the coordinator's clock, from the heartbeats' round trips
        self.step = -1
        self.generation = 0  # of the stage running now; its step reports carry it
        self.commands: queue.Queue = queue.Queue()
        # A service (runtime/agent_service.py) outlives this job: ending it must not end the process.
        self.in_service = False
        self.finished = threading.Event()
        self.exit_code: int | None = None
        self.worker: WorkerProcess | None = None  # the task running now, in its own process
        # Step metrics go out from a thread of their own, so a slow RPC never holds up the relay.
        self.step_reports = StepReporter(lambda request: self._call("ReportStep", request))
        self._worker_lock = threading.Lock()

    def run(self, connect_timeout_s: float) -> int:
        try:
            return self._run(connect_timeout_s)
        finally:
            self.finished.set()
            self.step_reports.close()
            if self.in_service:  # nothing of this job may outlive it: its workers, its channel
                self._stop_worker()
                if self.spare is not None:
                    self.spare.kill()
                    self.spare.wait()
                self.channel.close()

    def end(self, code: int, why: str) -> None:
        """End this job from another thread (a signal, a lost coordinator): stop the worker and
        let the command loop return `code`."""
        _log(self.node, why)
        self.exit_code = code
        self.finished.set()
        self._stop_worker()
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
        self.agent_id = reply.agent_id
        self.spare = WorkerProcess()  # loads torch while the cluster is still joining
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
                _log(self.node, "the coordinator closed the command stream")
                return EXIT_LOST_COORDINATOR
            if command.HasField("shutdown"):
                _log(self.node, f"shutting down: {command.shutdown.reason or 'job finished'}")
                return 0
            refusal = self._refusal(command)
            if refusal is not None:
                _log(self.node, refusal)
                if command.HasField("profile"):
                    self._call("ReportProfile", pb.ReportProfileRequest(agent_id=self.agent_id, ok=False,
                                                                        error=refusal, generation=command.generation))
                elif command.HasField("run_stage"):
                    self._call("ReportResult", pb.ReportResultRequest(agent_id=self.agent_id, ok=False, error=refusal,
                                                                      generation=command.generation))
                continue
            if command.HasField("profile"):
                self._supervise(wpb.WorkerTask(profile=command.profile), command.generation,
                                pb.AGENT_STATE_PROFILING)
            elif command.HasField("run_stage"):
                try:
                    self._local_checkpoints(command.run_stage, command.generation)
                    self.policy.check_paths(command.run_stage)
                except PolicyRefusal as err:
                    _log(self.node, str(err))
                    self._call("ReportResult", pb.ReportResultRequest(agent_id=self.agent_id, ok=False, error=str(err),
                                                                      generation=command.generation))
                    continue
                except (grpc.RpcError, OSError, ValueError) as err:
                    detail = err.details() if isinstance(err, grpc.RpcError) else str(err)
                    self._call("ReportResult", pb.ReportResultRequest(
                        agent_id=self.agent_id, ok=False, generation=command.generation,
                        error=f"cannot fetch the checkpoint to restore from: {detail}"))
                    continue
                self._supervise(wpb.WorkerTask(run_stage=command.run_stage), command.generation,
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

    def _local_checkpoints(self, run: pb.RunStage, generation: int) -> None:
        """A stage whose parts this agent must upload (remote, no shared checkpoint dir) writes them
        into our work dir, and restores from a copy we download first."""
        self.uploading = run.train.upload_parts
        self.local_snapshot_dir = ""
        if not run.train.upload_parts:
            return
        if run.train.checkpoint_dir:
            run.train.checkpoint_dir = str(self.work_dir / "checkpoints")
        if run.train.snapshot_dir:
            run.train.snapshot_dir = self.local_snapshot_dir = str(self.work_dir / "snapshots" / f"g{generation}")
        if run.HasField("restore"):
            from hetlaunch.runtime.part_transfer import download_checkpoint  # loads torch: only when restoring

            local = download_checkpoint(self.stub, self.metadata, self.agent_id, Path(run.restore.checkpoint_dir).name,
                                        run.stage.layer_start, run.stage.layer_end, self.work_dir)
            run.restore.checkpoint_dir = str(local)

    def _report_part(self, part: pb.CheckpointPart, generation: int) -> None:
        self._call("ReportCheckpoint", pb.ReportCheckpointRequest(agent_id=self.agent_id, part=part,
                                                                  generation=generation))

    def _supervise(self, task: wpb.WorkerTask, generation: int, state: int) -> None:
        """Run one task in a worker, relay its events, and report how it ended (unless aborted)."""
        task.store.CopyFrom(self.store_access)
        self.step = -1
        self.busy_state = state
        with self._worker_lock:
            self.generation = generation
            worker = self.worker = self._take_worker().start(task)
        self.training.set()
        done, profile = None, None
        try:
            for event in worker.events():
                kind = event.WhichOneof("kind")
                if kind == "step":
                    self.step = event.step.step
                    self.step_reports.report(pb.ReportStepRequest(agent_id=self.agent_id, metrics=event.step,
                                                                  generation=generation))
                elif kind == "checkpoint":
                    if self.uploading and not event.checkpoint.error:  # reported once it is on the coordinator
                        self._uploader().submit(event.checkpoint, generation)
                    else:
                        self._report_part(event.checkpoint, generation)
                elif kind == "move":
                    self.step_reports.flush()  # the steps before the move are reported before it
                    self._call("ReportMove", pb.ReportMoveRequest(agent_id=self.agent_id, report=event.move,
                                                                  generation=generation))
                elif kind == "profile":
                    profile = event.profile
                elif kind == "done":
                    done = event.done
        except FrameError as err:  # a worker runs user code; garbage on its pipe ends it
            worker.kill()
            done = wpb.WorkerDone(ok=False, error=f"the worker sent garbage: {err}")
        aborted = worker.aborted  # by the coordinator's Abort (killing it below does not count)
        if done is not None and done.ok and not aborted and worker.alive():
            self.spare = worker  # it ended well: it runs the next task too, with torch loaded
        else:
            worker.kill()
            worker.wait()
            self.spare = WorkerProcess()  # fresh, and warm by the time the next generation starts
        self.step_reports.flush()  # every step is reported before the result
        if self.uploading:
            self._uploader().wait_idle()  # the last checkpoint is reported before the result
        self.training.clear()
        with self._worker_lock:
            self.worker = None
        if aborted:
            return  # the coordinator ended this generation; it expects no result
        died = done is None
        if died:
            done = wpb.WorkerDone(ok=False, error=worker.exit_description())
        if not done.ok:
            _log(self.node, f"task failed: {done.error}")
        if task.HasField("profile"):
            report = profile if (done.ok and profile is not None) else pb.ReportProfileRequest(
                ok=False, error=done.error or "the worker reported no profile")
            report.agent_id, report.generation = self.agent_id, generation
            self._call("ReportProfile", report)
        else:
            self._call("ReportResult", pb.ReportResultRequest(agent_id=self.agent_id, ok=done.ok, error=done.error,
                                                              generation=generation, worker_died=died))

    def _take_worker(self) -> WorkerProcess:
        """The warm worker (torch already loaded) if it is alive, else a new one."""
        worker = self.spare if self.spare is not None and self.spare.alive() else WorkerProcess()
        self.spare = None
        return worker

    def _uploader(self):
        if self.uploader is None:
            from hetlaunch.runtime.part_transfer import PartUploader

            self.uploader = PartUploader(self.stub, self.metadata, self.agent_id, self._report_part)
        return self.uploader

    def _call(self, method: str, request) -> None:
        try:
            getattr(self.stub, method)(request, metadata=self.metadata, timeout=30)
        except grpc.RpcError as err:
            _log(self.node, f"{method} failed ({err.code().name}): {err.details()}")

    def _stop_worker(self, snapshot_dir: str = "", generation: int | None = None) -> None:
        """Stop the running worker — only if it belongs to `generation` or an earlier one (when given):
        a late abort must never hit the next generation's worker."""
        with self._worker_lock:
            worker = self.worker
            if worker is None or (generation is not None and self.generation > generation):
                return
        if snapshot_dir:
            worker.snapshot(self.local_snapshot_dir or snapshot_dir)
        else:
            worker.kill()

    def _pass_move(self, move: pb.Move, generation: int) -> None:
        with self._worker_lock:
            worker = self.worker if self.generation == generation else None
        if worker is None or not worker.move(move):
            self._call("ReportMove", pb.ReportMoveRequest(agent_id=self.agent_id, generation=generation, report=pb.MoveReport(
                id=move.id, phase=move.phase, ok=False, error="no stage of this generation is running")))

    def _command_reader(self) -> None:
        request = pb.WatchCommandsRequest(agent_id=self.agent_id)
        try:
            for command in self.stub.WatchCommands(request, metadata=self.metadata):
                if command.HasField("abort"):
                    # Here, not in the command loop: that loop is busy relaying the worker being aborted.
                    _log(self.node, f"aborting the running task: {command.abort.reason}")
                    threading.Thread(target=self._stop_worker,
                                     args=(command.abort.snapshot_dir, command.generation), daemon=True).start()
                    continue
                if command.HasField("move"):  # for the running stage, which the command loop is relaying
                    self._pass_move(command.move, command.generation)
                    continue
                if command.HasField("shutdown") and self.training.is_set():
                    _log(self.node, f"stopping mid-task: {command.shutdown.reason}")
                    self._stop_worker()
                self.commands.put(command)
        except grpc.RpcError as err:
            if self.training.is_set():
                _log(self.node, f"lost the coordinator mid-task: {err.details()}")
                self._stop_worker()
        self.commands.put(None)

    def _heartbeat_loop(self, interval: float) -> None:
        last_ok = time.monotonic()
        lost_after = max(10 * interval, 10.0)
        while not self.finished.wait(interval):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                self._exit(EXIT_LOST_COORDINATOR, "the process that started this agent is gone; exiting")
                return
            state = self.busy_state if self.training.is_set() else pb.AGENT_STATE_IDLE
            clock = self.clock
            try:
                sent = time.time()
                reply = self.stub.Heartbeat(pb.HeartbeatRequest(
                    agent_id=self.agent_id, state=state, step=self.step, has_clock=clock.known,
                    clock_offset_s=clock.offset_s, clock_rtt_s=clock.rtt_s if clock.known else 0.0),
                    metadata=self.metadata, timeout=max(interval * 3, 2.0))
                clock.sample(sent, reply.coordinator_time, time.time())
                last_ok = time.monotonic()
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION:  # declared lost while we were silent
                    self._exit(EXIT_DECLARED_LOST, f"{err.details()}; restart the agent to rejoin")
                    return
                if time.monotonic() - last_ok > lost_after:
                    self._exit(EXIT_LOST_COORDINATOR,
                               f"no heartbeat accepted for {lost_after:.0f}s ({err.code().name}); exiting")
                    return

    def _exit(self, code: int, why: str) -> None:
        if self.in_service:
            self.end(code, why)
            return
        _log(self.node, why)
        self._stop_worker()
        os._exit(code)


def default_work_dir(node_name: str) -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "hetlaunch" / "agent" / node_name


def run_agent(coordinator: str, node_name: str, token: str, connect_timeout_s: float = 60.0,
              parent_pid: int | None = None, work_dir: Path | None = None,
              credentials: ClientTls | None = None, allow_entrypoints: tuple[str, ...] = (),
              data_roots: tuple[str, ...] = (), checkpoint_roots: tuple[str, ...] = (), serve: bool = False,
              region: str = "", labels: dict[str, str] | None = None, stdin_lifeline: bool = False) -> int:
    work_dir = work_dir or default_work_dir(node_name)
    policy = AgentPolicy.of(allow_entrypoints, data_roots, checkpoint_roots, work_dir)
    if serve:
        from hetlaunch.runtime.agent_service import serve as serve_jobs

        return serve_jobs(coordinator, node_name, token, connect_timeout_s, work_dir, credentials, policy,
                          region=region, labels=labels)
    agent = Agent(coordinator, token, node_name, parent_pid, work_dir, credentials, policy, region, labels)
    if stdin_lifeline:
        threading.Thread(target=_exit_when_stdin_closes, args=(agent,), daemon=True).start()
    return agent.run(connect_timeout_s)


def _exit_when_stdin_closes(agent: Agent) -> None:
    """Started over SSH by `up`: the connection is our lifeline. When it closes (up ended, was
    killed, or the network dropped it) stdin ends, and so do we, our worker with us."""
    while sys.stdin.buffer.read(4096):
        pass
    agent._exit(EXIT_LOST_COORDINATOR, "the ssh session that started this agent closed; exiting")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetlaunch-agent", description="Join a hetlaunch coordinator.")
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    parser.add_argument("--name", default=socket.gethostname(), help="this node's name in the cluster YAML")
    parser.add_argument("--token-file", default=None, help="file holding the join token (else $HETLAUNCH_TOKEN)")
    parser.add_argument("--connect-timeout", type=float, default=60.0)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where checkpoint parts wait for upload (default ~/.cache/hetlaunch/agent/NAME)")
    parser.add_argument("--allow-entrypoint", action="append", default=[],
                        help="fnmatch pattern of model entrypoints this agent runs (default: only the built-in GPT)")
    parser.add_argument("--data-root", action="append", default=[], help="data files may only come from under here")
    parser.add_argument("--checkpoint-root", action="append", default=[],
                        help="checkpoints may only be written or read under here (and the work dir)")
    parser.add_argument("--ca", default=None, help="TLS: the CA that signed the coordinator's certificate")
    parser.add_argument("--cert", default=None, help="mutual TLS: this agent's certificate")
    parser.add_argument("--key", default=None, help="mutual TLS: this agent's private key")
    parser.add_argument("--region", default="", help="this node's region, for discovery")
    parser.add_argument("--label", action="append", default=[], help="KEY=VALUE, for discovery (repeat)")
    parser.add_argument("--stdin-lifeline", action="store_true", help="exit when stdin closes (started over SSH)")
    args = parser.parse_args(argv)
    try:
        token = read_token(args.token_file)
        credentials = tls_credentials(args.ca, args.cert, args.key)
        labels = parse_labels(args.label)
    except ValueError as err:
        print(f"hetlaunch agent: {err}", file=sys.stderr)
        return 2
    return run_agent(args.coordinator, args.name, token, args.connect_timeout, args.parent_pid, args.work_dir,
                     credentials, tuple(args.allow_entrypoint), tuple(args.data_root), tuple(args.checkpoint_root),
                     region=args.region, labels=labels, stdin_lifeline=args.stdin_lifeline)


def tls_credentials(ca: str | None, cert: str | None, key: str | None) -> ClientTls | None:
    """None without --ca (clear text); --cert/--key need --ca."""
    if ca is None:
        if cert is not None or key is not None:
            raise ValueError("--cert and --key need --ca (the CA that signed the coordinator's certificate)")
        return None
    return ClientTls.read(ca, cert, key)


if __name__ == "__main__":
    sys.exit(main())
