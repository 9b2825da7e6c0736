"""The per-node agent: join a coordinator, stay alive, run the stage it is given.

    python -m hetlaunch.runtime.agent --coordinator HOST:PORT --name NODE [--token-file F]

(`hetlaunch agent` is the same.) The agent registers with its devices and versions,
sends a heartbeat every interval, and follows the coordinator's command stream. It
never outlives its coordinator: if heartbeats keep failing, or the process that
started it is gone, it exits on its own.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import threading
import time
import traceback

import grpc

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import control_pb2_grpc
from hetlaunch.runtime.auth import TOKEN_METADATA_KEY, read_token
from hetlaunch.runtime.devices import describe_devices
from hetlaunch.runtime.profile_command import run_profile
from hetlaunch.runtime.stage_command import run_stage
from hetlaunch.runtime.version import hetlaunch_version, torch_version

EXIT_REFUSED = 1
EXIT_LOST_COORDINATOR = 3


def _log(node: str, message: str) -> None:
    print(f"[agent {node}] {message}", file=sys.stderr, flush=True)


class Agent:
    def __init__(self, coordinator: str, token: str, node_name: str, parent_pid: int | None = None):
        self.node = node_name
        self.parent_pid = parent_pid
        self.channel = grpc.insecure_channel(coordinator)
        self.coordinator = coordinator
        self.stub = control_pb2_grpc.CoordinatorStub(self.channel)
        self.metadata = ((TOKEN_METADATA_KEY, token),)
        self.agent_id = ""
        self.training = threading.Event()  # busy with a command (profiling or a stage): peers may wait on us
        self.busy_state = pb.AGENT_STATE_IDLE  # what the heartbeat says we are doing
        self.step = -1
        self.generation = 0  # of the stage running now; its step reports carry it
        self.commands: queue.Queue = queue.Queue()

    def run(self, connect_timeout_s: float) -> int:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            _log(self.node, f"could not reach the coordinator at {self.coordinator} within {connect_timeout_s:.0f}s")
            return EXIT_LOST_COORDINATOR
        info = pb.AgentInfo(node_name=self.node, hostname=socket.gethostname(), devices=describe_devices(),
                            agent_version=hetlaunch_version(), torch_version=torch_version(), pid=os.getpid())
        try:
            reply = self.stub.Register(pb.RegisterRequest(agent=info), metadata=self.metadata, timeout=30)
        except grpc.RpcError as err:
            _log(self.node, f"registration refused ({err.code().name}): {err.details()}")
            return EXIT_REFUSED
        self.agent_id = reply.agent_id
        interval = max(reply.heartbeat_interval_ms, 100) / 1000
        threading.Thread(target=self._heartbeat_loop, args=(interval,), daemon=True).start()
        threading.Thread(target=self._command_reader, daemon=True).start()
        _log(self.node, f"registered with {self.coordinator} as {self.agent_id}")
        return self._command_loop()

    def _command_loop(self) -> int:
        while True:
            command = self.commands.get()
            if command is None:
                _log(self.node, "the coordinator closed the command stream")
                return EXIT_LOST_COORDINATOR
            if command.HasField("shutdown"):
                _log(self.node, f"shutting down: {command.shutdown.reason or 'job finished'}")
                return 0
            if command.HasField("profile"):
                self._run_profile(command.profile, command.generation)
            else:
                self._run_stage(command.run_stage, command.generation)

    def _fill_store_host(self, rendezvous: pb.Rendezvous) -> None:
        if not rendezvous.store_host:  # the store lives on the host we dialed to reach the coordinator
            rendezvous.store_host = self.coordinator.rsplit(":", 1)[0].strip("[]")

    def _run_profile(self, command: pb.Profile, generation: int) -> None:
        self.busy_state = pb.AGENT_STATE_PROFILING
        self.training.set()
        if command.HasField("rendezvous"):  # touching an unset sub-message would make it "set", with port 0
            self._fill_store_host(command.rendezvous)
        try:
            report = run_profile(command)
        except Exception as exc:  # the coordinator must hear why profiling died, whatever it was
            _log(self.node, "profiling failed:\n" + traceback.format_exc())
            report = pb.ReportProfileRequest(ok=False, error=f"{type(exc).__name__}: {exc}")
        finally:
            self.training.clear()
        report.agent_id = self.agent_id
        report.generation = generation
        try:
            self.stub.ReportProfile(report, metadata=self.metadata, timeout=30)
        except grpc.RpcError as err:
            _log(self.node, f"could not report the profile: {err.details()}")

    def _run_stage(self, run: pb.RunStage, generation: int) -> None:
        self.generation = generation
        self.step = -1
        self.busy_state = pb.AGENT_STATE_TRAINING
        self.training.set()
        ok, error = True, ""
        self._fill_store_host(run.rendezvous)
        try:
            run_stage(run, self._report_step)
        except Exception as exc:  # the coordinator must hear why the stage died, whatever it was
            ok, error = False, f"{type(exc).__name__}: {exc}"
            _log(self.node, "stage failed:\n" + traceback.format_exc())
        finally:
            self.training.clear()
        try:
            self.stub.ReportResult(pb.ReportResultRequest(agent_id=self.agent_id, ok=ok, error=error,
                                                          generation=generation),
                                   metadata=self.metadata, timeout=30)
        except grpc.RpcError as err:
            _log(self.node, f"could not report the result: {err.details()}")

    def _report_step(self, metrics: pb.StepMetrics) -> None:
        self.step = metrics.step
        # Unary on loopback costs well under a millisecond a step; a queue would only hide failures.
        self.stub.ReportStep(pb.ReportStepRequest(agent_id=self.agent_id, metrics=metrics, generation=self.generation),
                             metadata=self.metadata, timeout=30)

    def _command_reader(self) -> None:
        request = pb.WatchCommandsRequest(agent_id=self.agent_id)
        try:
            for command in self.stub.WatchCommands(request, metadata=self.metadata):
                if command.HasField("shutdown") and self.training.is_set():
                    # Peers may be blocked on the data plane; a clean unwind is not possible.
                    _log(self.node, f"stopping mid-stage: {command.shutdown.reason}")
                    os._exit(0)
                self.commands.put(command)
        except grpc.RpcError as err:
            if self.training.is_set():
                _log(self.node, f"lost the coordinator mid-stage: {err.details()}")
                os._exit(EXIT_LOST_COORDINATOR)
        self.commands.put(None)

    def _heartbeat_loop(self, interval: float) -> None:
        last_ok = time.monotonic()
        lost_after = max(10 * interval, 10.0)
        while True:
            time.sleep(interval)
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                _log(self.node, "the process that started this agent is gone; exiting")
                os._exit(EXIT_LOST_COORDINATOR)
            state = self.busy_state if self.training.is_set() else pb.AGENT_STATE_IDLE
            try:
                self.stub.Heartbeat(pb.HeartbeatRequest(agent_id=self.agent_id, state=state, step=self.step),
                                    metadata=self.metadata, timeout=max(interval * 3, 2.0))
                last_ok = time.monotonic()
            except grpc.RpcError as err:
                if time.monotonic() - last_ok > lost_after:
                    _log(self.node, f"no heartbeat accepted for {lost_after:.0f}s ({err.code().name}); exiting")
                    os._exit(EXIT_LOST_COORDINATOR)


def run_agent(coordinator: str, node_name: str, token: str, connect_timeout_s: float = 60.0,
              parent_pid: int | None = None) -> int:
    return Agent(coordinator, token, node_name, parent_pid).run(connect_timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetlaunch-agent", description="Join a hetlaunch coordinator.")
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    parser.add_argument("--name", default=socket.gethostname(), help="this node's name in the cluster YAML")
    parser.add_argument("--token-file", default=None, help="file holding the join token (else $HETLAUNCH_TOKEN)")
    parser.add_argument("--connect-timeout", type=float, default=60.0)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = parser.parse_args(argv)
    try:
        token = read_token(args.token_file)
    except ValueError as err:
        print(f"hetlaunch agent: {err}", file=sys.stderr)
        return 2
    return run_agent(args.coordinator, args.name, token, args.connect_timeout, args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
