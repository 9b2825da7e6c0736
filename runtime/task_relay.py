"""An agent's tasks, one at a time, each in a worker: start it, relay what it reports, say how it ended.

The agent (runtime/agent_job.py) takes commands from the coordinator; a profiling run or a stage
is a task that runs here, in a worker process (runtime/supervisor.py), so that a crash ends the
worker and not the agent. The worker's events — steps, checkpoint parts, live-move reports, its
profile, its end — go to the coordinator as the RPCs of protos/control.proto. A worker whose
task ended well stays as the spare for the next task (torch already loaded); any other is killed
and a fresh spare started at once, so it is warm when the next generation begins.

Stopping (an abort, a lost coordinator, a shutdown mid-task) comes from other threads than the
one relaying, and names a generation: a late abort never hits the next generation's worker. An
abort is for a stage: it never hits a profiling run, which recovery starts in the same generation
to measure the survivors while the abort sent to their stages may still be on its way. The one
exception says so (`Abort.link_probe`): a link probe whose group a peer broke, stopped in its own
generation only.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import worker_pb2 as wpb
from hetlaunch.runtime import host_clock
from hetlaunch.runtime.part_transfer import PartUploader, download_checkpoint
from hetlaunch.runtime.stage_watchdog import StageWatchdog
from hetlaunch.runtime.step_reporter import StepReporter
from hetlaunch.runtime.supervisor import WorkerProcess
from hetlaunch.runtime.worker_pipe import FrameError


CLOSE_WAIT_S = 5.0  # a killed spare is waited for this long (then SIGKILL again and 5 s more) as the agent ends


def _log(node: str, message: str) -> None:
    print(f"[agent {node}] {message}", file=sys.stderr, flush=True)


class TaskRelay:
    def __init__(self, node: str, call: Callable[[str, object], None], step_reports: StepReporter,
                 store_access: wpb.StoreAccess, stub, metadata, work_dir: Path):
        self.node = node
        self._call = call  # an RPC of the coordinator by name, failures logged (runtime/agent_job.py)
        self.step_reports = step_reports
        self.store_access = store_access  # how a worker reaches the rendezvous store (runtime/grpc_store.py)
        self.stub, self.metadata = stub, metadata  # for checkpoint part transfers (runtime/part_transfer.py)
        self.work_dir = work_dir
        self.agent_id = ""  # set once the agent has registered
        self.uploading = False
        self.local_snapshot_dir = ""
        self.uploader = None
        self.spare: WorkerProcess | None = None  # the next task's worker: started ahead, or the last one
        self.training = threading.Event()  # busy with a task (profiling or a stage): peers may wait on us
        self.busy_state = pb.AGENT_STATE_IDLE  # what the heartbeat says we are doing
        self.step = -1
        self.generation = 0  # of the task running now; its step reports carry it
        self.worker: WorkerProcess | None = None  # the task running now, in its own process
        self.watchdog = StageWatchdog(0, 0.0, 0.0)  # the running stage's progress watch (off until one runs)
        self.probes_aborted_through = -1  # link probes of this generation and earlier are never started
        self.running_probe = False  # the running task is a link probe (the only task abort_probe stops)
        self._worker_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False

    def warm_up(self) -> None:
        """Start the first task's worker now: it loads torch while the cluster is still joining."""
        self.spare = WorkerProcess()

    def state(self) -> int:
        return self.busy_state if self.training.is_set() else pb.AGENT_STATE_IDLE

    def local_checkpoints(self, run: pb.RunStage, generation: int) -> None:
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
            local = download_checkpoint(self.stub, self.metadata, self.agent_id, Path(run.restore.checkpoint_dir).name,
                                        run.stage.layer_start, run.stage.layer_end, self.work_dir)
            run.restore.checkpoint_dir = str(local)

    def run(self, task: wpb.WorkerTask, generation: int, state: int) -> None:
        """Run one task in a worker, relay its events, and report how it ended (unless aborted)."""
        worker = self._start(task, generation, state)
        if worker is None:
            _log(self.node, "the link probe was aborted before it started: a peer broke its group")
            return
        train = task.run_stage.train if task.HasField("run_stage") else None
        with self._worker_lock:
            self.watchdog = StageWatchdog(worker.pid, train.watchdog_s if train else 0.0,
                                          train.first_step_watchdog_s if train else 0.0)
        done, profile = self._relay(worker, generation)
        self.watchdog.stop()
        if self.watchdog.stalled is not None and not worker.aborted:
            _log(self.node, self.watchdog.stalled)
            done = wpb.WorkerDone(ok=False, error=self.watchdog.stalled)
        with self._worker_lock:  # decided under the lock abort_probe kills under: it never kills the spare
            aborted = worker.aborted  # by the coordinator's Abort (killing it below does not count)
            kept = done is not None and done.ok and not aborted and worker.alive()
            if kept:
                self.spare = worker  # it ended well: it runs the next task too, with torch loaded
        if not kept:
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
        self._report_end(task, worker, done, profile, generation, died=None if not self.watchdog.stalled
                         else self.watchdog.frozen)

    def _start(self, task: wpb.WorkerTask, generation: int, state: int) -> WorkerProcess | None:
        """The task's worker, started; None for a link probe aborted already (abort_probe)."""
        task.store.CopyFrom(self.store_access)
        task.store.agent_id = self.agent_id
        task.clock_anchor = host_clock.anchor()  # the worker's stamps on the clock our heartbeats measure
        self.step = -1
        with self._worker_lock:  # checked under the lock abort_probe marks under: none slips between
            if _is_link_probe(task) and generation <= self.probes_aborted_through:
                return None
            self.running_probe = _is_link_probe(task)
            self.busy_state = state
            self.generation = generation
            worker = self.worker = self._take_worker().start(task)
        self.training.set()
        return worker

    def _relay(self, worker: WorkerProcess, generation: int) -> tuple[wpb.WorkerDone | None, object]:
        """Pass the worker's events on until its end: (its done, or None if it died; its profile)."""
        done, profile = None, None
        try:
            for event in worker.events():
                kind = event.WhichOneof("kind")
                took_step = kind == "step" and not event.step.eval_only  # not a late held-out loss
                self.watchdog.progressed(event.step.step if took_step else None)
                if kind == "step":
                    self.step = event.step.step if took_step else self.step
                if kind == "profile":
                    profile = event.profile
                elif kind == "done":
                    done = event.done
                else:
                    # What is sent here waits on the coordinator (a full step-report queue, the reports
                    # before a part or a move, a report while `up` is stopped), not on the worker: the
                    # watchdog is held meanwhile (a Ctrl-Z of `up` past its bound killed healthy workers).
                    with self.watchdog.held():
                        self._pass_on(kind, event, generation)
        except FrameError as err:  # a worker runs user code; garbage on its pipe ends it
            worker.kill()
            done = wpb.WorkerDone(ok=False, error=f"the worker sent garbage: {err}")
        return done, profile

    def _pass_on(self, kind: str, event: wpb.WorkerEvent, generation: int) -> None:
        """A step, checkpoint part or live-move report of the worker's, to the coordinator."""
        if kind == "step":
            self.step_reports.report(pb.ReportStepRequest(agent_id=self.agent_id, metrics=event.step,
                                                          generation=generation))
        elif kind == "checkpoint":
            self.step_reports.flush()  # the steps before it are reported first (a failed write ends the job)
            if self.uploading and not event.checkpoint.error:  # reported once it is on the coordinator
                self._uploader().submit(event.checkpoint, generation)
            else:
                self._report_part(event.checkpoint, generation)
        elif kind == "move":
            self.step_reports.flush()  # the steps before the move are reported before it
            self._call("ReportMove", pb.ReportMoveRequest(agent_id=self.agent_id, report=event.move,
                                                          generation=generation))

    def _report_end(self, task: wpb.WorkerTask, worker: WorkerProcess, done: wpb.WorkerDone | None, profile,
                    generation: int, died: bool | None = None) -> None:
        """`died`: whether the node is to blame as for a dead worker (default: the worker sent no done)."""
        died = done is None if died is None else died
        if done is None:
            done = wpb.WorkerDone(ok=False, error=worker.exit_description())
        if not done.ok:
            _log(self.node, f"task failed: {done.error}")
        if task.HasField("profile"):
            report = profile if (done.ok and profile is not None) else pb.ReportProfileRequest(
                ok=False, error=done.error or "the worker reported no profile", worker_died=died)
            report.agent_id, report.generation = self.agent_id, generation
            self._call("ReportProfile", report)
        else:
            self._call("ReportResult", pb.ReportResultRequest(agent_id=self.agent_id, ok=done.ok, error=done.error,
                                                              generation=generation, worker_died=died))

    def _report_part(self, part: pb.CheckpointPart, generation: int) -> None:
        self._call("ReportCheckpoint", pb.ReportCheckpointRequest(agent_id=self.agent_id, part=part,
                                                                  generation=generation))

    def _take_worker(self) -> WorkerProcess:
        """The warm worker (torch already loaded) if it is alive, else a new one."""
        worker = self.spare if self.spare is not None and self.spare.alive() else WorkerProcess()
        self.spare = None
        return worker

    def _uploader(self):
        if self.uploader is None:
            self.uploader = PartUploader(self.stub, self.metadata, self.agent_id, self._report_part)
        return self.uploader

    def stop(self, snapshot_dir: str = "", generation: int | None = None, stage_only: bool = False) -> None:
        """Stop the running worker — only if it belongs to `generation` or an earlier one (when given):
        a late abort must never hit the next generation's worker; with stage_only (an abort), only
        a stage's worker, never a profiling run."""
        with self._worker_lock:
            worker = self.worker
            if worker is None or (generation is not None and self.generation > generation):
                return
            if not (stage_only and self.busy_state != pb.AGENT_STATE_TRAINING):
                self.watchdog.stop()  # a snapshot takes its time: no stall to find in it
            if stage_only and self.busy_state != pb.AGENT_STATE_TRAINING:
                _log(self.node, "the abort came after its stage ended: the running profiling task goes on")
                return
        if snapshot_dir:
            worker.snapshot(self.local_snapshot_dir or snapshot_dir)
        else:
            worker.kill()

    def abort_probe(self, generation: int) -> str:
        """The link probe of `generation` lost a peer (its worker died, or its node was lost): our
        worker may wait on it in gloo's connect for five times the rendezvous timeout, and no
        result of it is wanted. Kill it if it runs now; never start it if it has not begun (the
        abort can overtake the command, which waits in the queue). Nothing is reported, but by a
        probe that had ended already. Returns what was done, for the log."""
        with self._worker_lock:
            self.probes_aborted_through = max(self.probes_aborted_through, generation)
            worker = self.worker
            if worker is None or self.generation < generation:
                return "none runs now"  # and should its command come later, it will not start
            if self.generation != generation or not self.running_probe:
                return "no probe of that generation runs"
            if worker is self.spare or not worker.alive():
                return "it had ended"  # it reports how, or was kept as the next task's worker
            worker.kill()  # a signal, under the lock run() keeps its spare under; marks it aborted: no report
        return "its worker killed"

    def pass_move(self, move: pb.Move, generation: int) -> None:
        """A live-move message for the running stage of `generation`; answered for it if there is none."""
        with self._worker_lock:
            worker = self.worker if self.generation == generation else None
        if worker is None or not worker.move(move):
            self._call("ReportMove", pb.ReportMoveRequest(agent_id=self.agent_id, generation=generation, report=pb.MoveReport(
                id=move.id, phase=move.phase, ok=False, error="no stage of this generation is running")))

    def close(self) -> None:
        """End every worker of this job: the running one killed, the spare killed and waited for.
        Once, and never raising: the lifeline's or heartbeat's exit (Agent.exit) can call it while
        the main thread leaves Agent.run, and the agent must end either way."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.stop()
        with self._worker_lock:  # _take_worker hands the spare to a task under this lock
            spare, self.spare = self.spare, None
        if spare is not None:
            spare.kill()
            try:
                spare.wait(CLOSE_WAIT_S)
            except (subprocess.TimeoutExpired, OSError) as err:  # stuck in the kernel: left to init
                _log(self.node, f"the spare worker {spare.pid} did not exit after SIGKILL: {err}")


def _is_link_probe(task: wpb.WorkerTask) -> bool:
    return task.HasField("profile") and task.profile.HasField("rendezvous")
