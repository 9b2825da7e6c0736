"""Checkpoints of a worker's layers, written beside training.

At a step boundary the state is copied to CPU memory while training waits (the only stall), then
written and reported by a background thread, one safetensors part per layer range
(runtime/checkpoint.py `write_part`). One write at a time: a step that needs a new copy while the
last one is still being written waits for it. A stage of one range (stage_command.py) and a node
holding several stages (device_stage_command.py, one part per stage) share this writer; only how
the copied state splits into ranges differs.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Protocol

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.checkpoint import write_part
from hetlaunch.runtime.checkpoint_manifest import checkpoint_dir

# (layer_start, layer_end, state) for each part, copied under the executor's state lock
StateParts = Callable[[], list[tuple[int, int, dict]]]


class CheckpointReports(Protocol):
    def checkpoint(self, part: pb.CheckpointPart) -> None: ...


class CheckpointWriter:
    def __init__(self, state_lock: threading.Lock, copy_parts: StateParts, root: str, reports: CheckpointReports):
        self.state_lock, self.copy_parts = state_lock, copy_parts
        self.root = Path(root)
        self.reports = reports
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def save(self, step: int) -> None:
        start = time.perf_counter()
        self.wait()
        with self.state_lock:
            parts = self.copy_parts()
        stall_s = time.perf_counter() - start
        self._thread = threading.Thread(target=self._write, args=(parts, step, stall_s), daemon=True)
        self._thread.start()

    def _write(self, parts: list[tuple[int, int, dict]], step: int, stall_s: float) -> None:
        directory = checkpoint_dir(self.root, step)
        try:
            for layer_start, layer_end, state in parts:
                start = time.perf_counter()
                try:
                    part = write_part(directory, state, layer_start, layer_end)
                except (OSError, ValueError) as err:  # a full or read-only disk: the coordinator decides
                    reason = err.strerror if isinstance(err, OSError) and err.strerror else err
                    message = pb.CheckpointPart(directory=str(directory), layer_start=layer_start,
                                                layer_end=layer_end, step=step, error=f"{type(err).__name__}: {reason}")
                else:
                    message = part_message(directory, part, step, write_s=time.perf_counter() - start,
                                           stall_s=stall_s)
                self.reports.checkpoint(message)
        except BaseException as err:  # surfaced on the main thread by wait()
            self.error = err

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"writing the checkpoint failed: {error}") from error


def part_message(directory: Path, part, step: int, write_s: float = 0.0, stall_s: float = 0.0,
                 snapshot: bool = False) -> pb.CheckpointPart:
    return pb.CheckpointPart(directory=str(directory), file=part.file, layer_start=part.layer_start,
                             layer_end=part.layer_end, bytes=part.bytes, sha256=part.sha256, step=step,
                             snapshot=snapshot, write_s=write_s, stall_s=stall_s)
