"""Step metrics to the coordinator off the step's path, coalesced.

A worker writes each step's metrics to its agent's pipe and goes on. Were each one sent as a
ReportStep RPC on the thread that reads that pipe, a slow coordinator or WAN link would hold up
everything else the worker reports (checkpoints, its end) and, once the pipe filled, the worker
itself. So one background thread sends them in order from a bounded queue: a full queue blocks
the relay (backpressure, nothing dropped), and `flush` lets the agent send a task's result only
after its last step.

Coalesced: with an interval, the thread sends at most one RPC per interval, carrying every step
that came in meanwhile (`coalesce_step_reports`). Short steps otherwise cost one RPC each — under
TLS an encryption, a record and a Python call on both ends, on the cores the stages compute on.
A step waits at most one interval to be seen; `flush` sends at once.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Callable

from hetlaunch.protos import control_pb2 as pb

MAX_PENDING = 256  # step reports queued before the relay waits for the sender
STEP_REPORT_INTERVAL_S = 0.5  # an agent's step reports: at most one RPC per this many seconds


def coalesce_step_reports(requests: list[pb.ReportStepRequest]) -> list[pb.ReportStepRequest]:
    """Consecutive reports of one agent and generation as one request: the first step in
    `metrics`, the others in order in `more_metrics`."""
    out: list[pb.ReportStepRequest] = []
    for request in requests:
        last = out[-1] if out else None
        if last is not None and (last.agent_id, last.generation) == (request.agent_id, request.generation):
            last.more_metrics.append(request.metrics)
            last.more_metrics.extend(request.more_metrics)
        else:
            out.append(pb.ReportStepRequest(agent_id=request.agent_id, generation=request.generation,
                                            metrics=request.metrics, more_metrics=request.more_metrics))
    return out


class StepReporter:
    def __init__(self, send: Callable[[object], None],
                 coalesce: Callable[[list], list] | None = None, interval_s: float = 0.0):
        self._send = send
        self._coalesce = coalesce  # None: each report is its own send
        self._interval_s = interval_s
        self._hurry = threading.Event()  # flush: send what is queued now, not at the interval's end
        # never sent: the first report leaves at once (0.0 would not do; monotonic time starts at boot,
        # so on a machine up for less than an interval the first report waited for the rest of it)
        self._last_sent = float("-inf")
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_PENDING)
        threading.Thread(target=self._run, name="step-reporter", daemon=True).start()

    def report(self, request) -> None:
        self._queue.put(request)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued report was sent (or given up by `send`); False if that took over
        timeout_s. No timeout by default: a result, a checkpoint part or a move that went ahead of
        the steps before it (after 60 s of a stopped `up`) ended the run short of those steps."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            self._hurry.set()
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """End the sender thread after what is queued (an agent service makes one per job)."""
        self._queue.put(None)
        self._hurry.set()

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            if self._coalesce is not None:
                wait = self._last_sent + self._interval_s - time.monotonic()
                if batch[0] is not None and wait > 0 and not self._hurry.is_set():
                    self._hurry.wait(wait)
                self._hurry.clear()
                while len(batch) < MAX_PENDING and batch[-1] is not None:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
            closing = batch[-1] is None
            requests = [r for r in batch if r is not None]
            try:
                for request in (self._coalesce(requests) if self._coalesce is not None and requests else requests):
                    self._send_one(request)
            finally:
                self._last_sent = time.monotonic()
                for _ in batch:
                    self._queue.task_done()
            if closing:
                return

    def _send_one(self, request) -> None:
        try:
            self._send(request)
        except Exception as err:  # one report lost, never the sender (the caller logs RPC errors itself)
            print(f"step report not sent: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
