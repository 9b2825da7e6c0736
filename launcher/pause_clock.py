"""A monotonic clock that leaves out the time this process did not run.

The coordinator judges a node lost by how long it has not been heard from. If `up` itself is
stopped (Ctrl-Z, SIGSTOP) or its threads are held off the interpreter for seconds, no heartbeat
is taken meanwhile, and on waking every node looked silent past the timeout: the whole job was
declared lost for a pause of its own (a hostile review: 13 s of SIGSTOP ended a healthy run).
A thread ticks every TICK_S; a gap between ticks longer than GAP_S is time the process did not
run, and this clock does not count it. A caller that reads the clock before the ticker wakes
sees the gap itself, so no silence is judged on the stale side of a pause.
"""

from __future__ import annotations

import threading
import time
import weakref

TICK_S = 0.25
GAP_S = 2.0  # far above a tick's lateness on a busy machine, far below any heartbeat timeout worth having


class PauseClock:
    def __init__(self, tick_s: float = TICK_S, gap_s: float = GAP_S, monotonic=time.monotonic, ticking: bool = True):
        self._monotonic, self._tick_s, self._gap_s = monotonic, tick_s, gap_s
        self._lock = threading.Lock()
        self._last = monotonic()
        self.paused_s = 0.0  # time left out so far
        self._stop = threading.Event()
        if ticking:  # the ticker holds the clock weakly: it ends with the clock, or at stop()
            threading.Thread(target=_tick, args=(weakref.ref(self), self._stop, tick_s), name="pause-clock",
                             daemon=True).start()

    def now(self) -> float:
        """Monotonic seconds, less every pause seen so far."""
        with self._lock:
            t = self._monotonic()
            gap = t - self._last
            if gap > self._gap_s:
                self.paused_s += gap - self._tick_s  # the tick that was due is time that did run
            self._last = t
            return t - self.paused_s

    def stop(self) -> None:
        self._stop.set()


def _tick(clock: weakref.ref, stop: threading.Event, tick_s: float) -> None:
    while not stop.wait(tick_s):
        alive = clock()
        if alive is None:
            return
        alive.now()
        del alive
