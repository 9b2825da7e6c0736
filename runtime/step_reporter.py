"""Step metrics to the coordinator off the step's path.

A worker writes each step's metrics to its agent's pipe and goes on. Were each one sent as a
ReportStep RPC on the thread that reads that pipe, a slow coordinator or WAN link would hold up
everything else the worker reports (checkpoints, its end) and, once the pipe filled, the worker
itself. So one background thread sends them in order from a bounded queue: a full queue blocks
the relay (backpressure, nothing dropped), and `flush` lets the agent send a task's result only
after its last step.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Callable

MAX_PENDING = 256  # step reports queued before the relay waits for the sender


class StepReporter:
    def __init__(self, send: Callable[[object], None]):
        self._send = send
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_PENDING)
        threading.Thread(target=self._run, name="step-reporter", daemon=True).start()

    def report(self, request) -> None:
        self._queue.put(request)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued report was sent (or failed); False if that took over timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """End the sender thread after what is queued (an agent service makes one per job)."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            request = self._queue.get()
            try:
                if request is None:
                    return
                self._send(request)
            except Exception as err:  # one report lost, never the sender (the caller logs RPC errors itself)
                print(f"step report not sent: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            finally:
                self._queue.task_done()
