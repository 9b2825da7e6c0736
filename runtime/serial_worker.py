"""One background thread that runs calls in the order they were submitted.

Sealed collectives block (each rank seals, sends, receives and opens in turn), so an exchange
meant to overlap compute — a streaming outer step with a delay — runs here while the main thread
trains. One thread, first in first out: every rank runs its exchanges on a group in the same
order, which c10d needs. The cipher (`cryptography`) releases the GIL, so the thread's sealing
does not stall the step's Python.

The thread is a daemon: a stage that fails while an exchange waits on a dead peer must still be
able to exit (a ThreadPoolExecutor's threads are joined at exit and would hang it).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class SerialWorker:
    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run fn(*args) after every call submitted before; its result (or error) in the future."""
        future: Future = Future()
        self._calls.put((fn, args, future))
        return future

    def _run(self) -> None:
        while True:
            fn, args, future = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # the caller's result() raises it
                future.set_exception(err)
