"""The worker: stages and profiling runs, one at a time, in a subprocess its agent supervises.

    python -m hetlaunch.runtime.worker --report-fd N     (started by runtime/supervisor.py)

The agent writes WorkerControl messages on our stdin (a task to run, or a request to
snapshot the running stage and exit); we write WorkerEvents (steps, checkpoint parts, the
profile, done) to the report pipe. A task ends with a `done` event; after one that ended
well the agent may give us the next task (torch stays loaded), after anything else it kills
us. It can kill us at any moment — that is how a generation is aborted while we sit in a
data-plane call to a dead peer — and when the agent itself goes away our stdin ends and we
exit at once: a worker never outlives its agent.
"""

from __future__ import annotations

import argparse
import importlib
import os
import queue
import sys
import threading
import traceback
from typing import Callable

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import worker_pb2 as wpb
from hetlaunch.runtime import host_clock
from hetlaunch.runtime.host_allocator import CHOICE as HOST_MALLOC_ENV
from hetlaunch.runtime.host_allocator import tune_host_allocator
from hetlaunch.runtime.worker_pipe import FrameError, FrameWriter, PipeClosed, read_frame

EXIT_AGENT_GONE = 4
EXIT_SNAPSHOT = 5  # exited after writing a snapshot, as asked


def _log(message: str) -> None:
    print(f"[worker {os.getpid()}] {message}", file=sys.stderr, flush=True)


class WorkerReports:
    """What a stage or a profiling run tells its agent; `on_snapshot` registers how to snapshot."""

    def __init__(self, writer: FrameWriter):
        self._writer = writer
        self._snapshot: Callable[[str], pb.CheckpointPart] | None = None
        self._snapshot_lock = threading.Lock()
        self._move: Callable[[pb.Move], None] | None = None

    def step(self, metrics: pb.StepMetrics) -> None:
        self._writer.write(wpb.WorkerEvent(step=metrics))

    def checkpoint(self, part: pb.CheckpointPart) -> None:
        self._writer.write(wpb.WorkerEvent(checkpoint=part))

    def move(self, report: pb.MoveReport) -> None:
        self._writer.write(wpb.WorkerEvent(move=report))

    def on_move(self, handler: Callable[[pb.Move], None] | None) -> None:
        with self._snapshot_lock:
            self._move = handler

    def move_control(self, move: pb.Move) -> None:
        """A live-move message; without a running stage (it finished) it is answered as failed."""
        with self._snapshot_lock:
            handler = self._move
        if handler is None:
            self.move(pb.MoveReport(id=move.id, phase=move.phase, ok=False, error="no stage is running"))
        else:
            handler(move)

    def on_snapshot(self, handler: Callable[[str], pb.CheckpointPart] | None) -> None:
        with self._snapshot_lock:
            self._snapshot = handler

    def snapshot(self, directory: str) -> None:
        """Write the stage's state (when a stage is running) and exit; runs on the control thread
        while the main thread may be blocked on a dead peer."""
        with self._snapshot_lock:
            handler = self._snapshot
        if handler is not None:
            try:
                self.checkpoint(handler(directory))
            except Exception:  # nothing to stand in with: the coordinator falls back to the last checkpoint
                _log("snapshot failed:\n" + traceback.format_exc())
        os._exit(EXIT_SNAPSHOT)


def _watch_controls(reports: WorkerReports, tasks: queue.Queue) -> None:
    """Follow the agent's control messages; the end of stdin means the agent is gone."""
    while True:
        try:
            control = read_frame(0, wpb.WorkerControl)
        except (PipeClosed, FrameError, OSError):
            os._exit(EXIT_AGENT_GONE)
        if control.snapshot_dir:
            reports.snapshot(control.snapshot_dir)
        elif control.HasField("move"):
            reports.move_control(control.move)
        elif control.HasField("task"):
            tasks.put(control.task)


def run_task(task: wpb.WorkerTask, reports: WorkerReports, writer: FrameWriter) -> None:
    from hetlaunch.runtime.device_stage_command import run_device_stages
    from hetlaunch.runtime.profile_command import run_profile
    from hetlaunch.runtime.stage_command import run_stage

    host_clock.use_anchor(task.clock_anchor)
    if task.HasField("profile"):
        writer.write(wpb.WorkerEvent(profile=run_profile(task.profile, task.store)))
    elif task.run_stage.stage.parts:  # several stages on this node (interleaved 1F1B, ZB-V): one executor for all
        run_device_stages(task.run_stage, reports, task.store)
    else:
        run_stage(task.run_stage, reports, task.store)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetlaunch-worker", description="Run tasks for a hetlaunch agent.")
    parser.add_argument("--report-fd", type=int, required=True)
    args = parser.parse_args(argv)
    # Before any other thread starts and before torch allocates: memory kept from step to step.
    allocator = tune_host_allocator()
    if os.environ.get(HOST_MALLOC_ENV) or "refused" in allocator:
        _log(allocator)  # what was asked for and done, or why not (a refused option, a misspelt choice)
    writer = FrameWriter(args.report_fd)
    reports = WorkerReports(writer)
    tasks: queue.Queue = queue.Queue()
    threading.Thread(target=_watch_controls, args=(reports, tasks), daemon=True).start()
    # Load torch and the model code before the first task comes: the agent starts a worker
    # ahead, so this happens while it is idle, not on a restart's clock.
    for module in ("hetlaunch.runtime.profile_command", "hetlaunch.runtime.stage_command"):
        importlib.import_module(module)
    while True:
        task = tasks.get()
        try:
            run_task(task, reports, writer)
        except PipeClosed:
            return EXIT_AGENT_GONE
        except Exception as exc:  # the agent must hear why the task died, whatever it was
            _log("task failed:\n" + traceback.format_exc())
            try:
                writer.write(wpb.WorkerEvent(done=wpb.WorkerDone(ok=False, error=f"{type(exc).__name__}: {exc}")))
            except PipeClosed:
                pass
            return 1  # a failed task may leave a broken state behind: the agent starts a fresh worker
        reports.on_snapshot(None)
        _release_memory()
        writer.write(wpb.WorkerEvent(done=wpb.WorkerDone(ok=True)))


def _release_memory() -> None:
    """Between tasks: give cached accelerator memory back, so the next task's stage sees all of it."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a c10d group or a CUDA context can hang it; everything is reported.
    os._exit(code)
