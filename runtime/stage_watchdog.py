"""An agent's watch on its stage's progress, not only on its worker being alive.

A worker can be alive and never move again: frozen (SIGSTOP, a debugger, a host paging to death),
hung in a collective, stuck in a data loader, waiting on a link that was cut. Its agent keeps
heartbeating, so the coordinator saw "training" forever. Here the agent counts the worker's
events (a step, a checkpoint part, a live-move report: each is progress); when none comes within
the bound the coordinator set from the plan (TrainSpec.watchdog_s; first_step_watchdog_s before
the first, which includes the rendezvous and the restore), the worker is killed and the stall
reported as the stage's failure:

* a worker the kernel shows as stopped (or dead, or in uninterruptible sleep) is frozen itself,
  and one that kept a core busy the whole time is stuck in its own compute: either way the stage
  failed on this node, which is blamed and recovered like a lost node;
* otherwise it was waiting — on a peer, a link, the file system. It is left WAITING_GRACE bounds:
  a frozen peer is found first, and the coordinator stops this worker with a snapshot (a replica
  of the frozen node's layers). If no stage is frozen (a cut link), it is killed then and reported
  as a peer's timeout, and the coordinator runs the generation again as after a network hiccup.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psutil

FROZEN_STATES = {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_DISK_SLEEP,
                 psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD}
POLL_S = 0.5
BUSY_FRACTION = 0.5  # a worker that used this much of a core without progress is stuck in its own compute
# A waiting worker is killed only this many bounds in: by then a frozen peer's agent has reported
# it, and the coordinator has asked this one for a snapshot (a replica stands in, no step lost).
WAITING_GRACE = 1.5


class StageWatchdog:
    def __init__(self, pid: int, bound_s: float, first_bound_s: float):
        """Watch the worker `pid` (killed with SIGKILL on a stall). Bounds in seconds (0: no watch)."""
        self.pid = pid
        self.bound_s, self.first_bound_s = bound_s, first_bound_s or bound_s
        self.stalled: str | None = None  # why the worker was killed, once it was
        self.frozen = False  # the worker itself was frozen (not waiting on someone else)
        self._last = time.monotonic()
        self._steps = 0
        self._step = -1
        self._done = threading.Event()
        self._held = 0  # waits of the agent's own on the coordinator under way (held())
        self._cpu_at_progress = _cpu_s(pid) if bound_s > 0 else 0.0
        if bound_s > 0:
            threading.Thread(target=self._watch, name="stage-watchdog", daemon=True).start()

    def progressed(self, step: int | None = None) -> None:
        """The worker did something (a step when `step` is given)."""
        self._last = time.monotonic()
        if step is not None:
            self._steps, self._step = self._steps + 1, step

    @contextlib.contextmanager
    def held(self):
        """The agent itself is waiting on the coordinator (a full step-report queue, a report sent
        while `up` is stopped): the worker, blocked on its pipe meanwhile, is not stalled. Without
        this a Ctrl-Z of `up` longer than the bound killed every healthy worker."""
        self._held += 1  # only the relay thread holds: no lock needed for the count
        try:
            yield
        finally:
            self._held -= 1
            self._last = time.monotonic()

    def stop(self) -> None:
        """No more watching: the task ended, or an abort or a shutdown is stopping it."""
        self._done.set()

    def _watch(self) -> None:
        seen = self._last
        while not self._done.wait(POLL_S):
            if self._held:
                self._last = time.monotonic()
            if self._last != seen:  # progress since the last look: CPU time is counted from here
                seen, self._cpu_at_progress = self._last, _cpu_s(self.pid)
            bound = self.bound_s if self._steps else self.first_bound_s
            silent = time.monotonic() - self._last
            if silent <= bound:
                continue
            state = _state(self.pid)
            busy = (_cpu_s(self.pid) - self._cpu_at_progress) / max(silent, 1e-9)
            self.frozen = state in FROZEN_STATES or busy > BUSY_FRACTION
            if not self.frozen and silent <= WAITING_GRACE * bound:
                continue  # waiting on someone: give the one that froze the time to be found first
            after = f"after step {self._step}" if self._steps else "before its first step"
            if self.frozen:
                how = f"frozen (process state {state})" if state in FROZEN_STATES else f"busy in itself ({busy:.0%} of a core)"
                self.stalled = (f"stalled {after}: its worker was {how} with no progress "
                                f"for {silent:.0f}s (train.watchdog_s bound {bound:.0f}s); killed")
            else:
                # Worded as a peer's timeout: a consequence unless no stage was frozen (generation.py).
                self.stalled = (f"stalled {after}: no progress for {silent:.0f}s (train.watchdog_s bound {bound:.0f}s) "
                                f"while its worker waited (process state {state}): timed out; killed")
            try:
                os.kill(self.pid, signal.SIGKILL)  # not WorkerProcess.kill: that would count as an abort
            except ProcessLookupError:
                pass
            return


def _cpu_s(pid: int) -> float:
    try:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    except psutil.Error:
        return 0.0


def _state(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return psutil.STATUS_DEAD
    except psutil.Error:
        return "unknown"
