"""The agent's side of a worker: start it, read its events, snapshot or kill it, say how it ended.

A worker is a fresh interpreter (`python -m hetlaunch.runtime.worker`), exec'd, never a
fork of the agent (which holds gRPC). It inherits the agent's stderr (so its traceback lands
in the agent's log) and process group (so stopping a local agent's group stops it too).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Iterator

from hetlaunch.protos import worker_pb2 as wpb
from hetlaunch.runtime.worker_pipe import FrameWriter, PipeClosed, read_frame

SNAPSHOT_TIMEOUT_S = 20.0  # a stage's state is written locally; past this the replica is not waited for


class WorkerProcess:
    """One worker. Started before it has a task (it loads torch meanwhile); `start(task)` gives it
    one, `events()` follows that task to its `done`, and a worker whose task ended well may start
    the next one."""

    def __init__(self):
        read_fd, write_fd = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "hetlaunch.runtime.worker", "--report-fd", str(write_fd)],
                stdin=subprocess.PIPE, pass_fds=(write_fd,), close_fds=True)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the worker holds the only write end: its exit ends our reads
        self._events_fd = read_fd
        self._control = FrameWriter(self.process.stdin.fileno())
        self.aborted = False

    def start(self, task: wpb.WorkerTask) -> "WorkerProcess":
        self.aborted = False
        try:
            self._control.write(wpb.WorkerControl(task=task))
        except PipeClosed:
            pass  # it died; events() ends and exit_description() says how
        return self

    def alive(self) -> bool:
        return self.process.poll() is None and self._events_fd >= 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def events(self) -> Iterator[wpb.WorkerEvent]:
        """The running task's events, through its `done`, or until the worker closes its pipe
        (exits or is killed). FrameError on garbage."""
        while True:
            try:
                event = read_frame(self._events_fd, wpb.WorkerEvent)
            except PipeClosed:
                self._close_events()
                return
            yield event
            if event.HasField("done"):
                return

    def _close_events(self) -> None:
        if self._events_fd >= 0:
            os.close(self._events_fd)
            self._events_fd = -1

    def snapshot(self, directory: str, timeout_s: float = SNAPSHOT_TIMEOUT_S) -> None:
        """Ask for a snapshot of the stage's state; kill the worker if it has not exited in time."""
        self.aborted = True
        try:
            self._control.write(wpb.WorkerControl(snapshot_dir=directory))
        except PipeClosed:
            pass
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        self.kill()

    def move(self, move) -> bool:
        """Pass a live-move message to the running stage; False if the worker is gone."""
        try:
            self._control.write(wpb.WorkerControl(move=move))
            return True
        except PipeClosed:
            return False

    def kill(self) -> None:
        """SIGKILL: a worker blocked on a dead peer's data-plane call cannot be unwound politely."""
        self.aborted = True
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float = 30.0) -> int:
        """Wait for the worker to exit (after it was killed, or failed); close our ends."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.wait(timeout=5)
        finally:
            self._close_events()
            # A late control message (an abort's snapshot from another thread) must not reach the
            # next worker, whose pipe may get this descriptor's number once it is closed: it did,
            # and the next task's worker snapshotted itself and exited (code 5).
            self._control.detach()
            try:
                self.process.stdin.close()  # the file object owns the descriptor
            except OSError:
                pass

    def exit_description(self) -> str:
        code = self.process.poll()
        if code is None:
            return "the worker is still running"
        if code == -signal.SIGBUS:  # what a read of a memory-mapped file past its new end gets
            return ("the worker was killed by SIGBUS (a memory-mapped file it read, such as the data file, "
                    "may have been cut short)")  # a file renamed over it stays mapped whole
        if code < 0:
            return f"the worker was killed by {signal.Signals(-code).name}"
        return f"the worker exited with code {code} without reporting"
