"""events.jsonl: what happened to the job besides its steps, one JSON line per event.

Joins, lost nodes (with how long detection took), generations with their plans, committed
checkpoints, restores (from a file or from a live replica), restarts and resumes. Lines are
written whole (run_record.JsonLines); a resumed run appends to the same file.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from hetlaunch.launcher.run_record import JsonLines, strict_json
from hetlaunch.runtime.files import UnreadableFile, read_regular_file

MAX_EVENTS_BYTES = 256 * 2**20


class EventLog:
    def __init__(self, run_dir: Path, resume: bool = False):
        self.path = run_dir / "events.jsonl"
        self.counts: Counter[str] = Counter()
        earlier = _earlier_lines(self.path) if resume else []
        self.earlier: list[dict] = [record for _, record in earlier]  # what the run wrote before this resume
        self._lines = JsonLines(self.path, [line for line, _ in earlier] if resume else None)

    def write(self, event: str, **fields) -> dict:
        entry = {"time": round(time.time(), 3), "event": event, **fields}
        self._lines.append(strict_json(entry))
        self.counts[event] += 1
        return entry

    def close(self) -> None:
        self._lines.close()


def _earlier_lines(path: Path) -> list[tuple[str, dict]]:
    """The whole lines an earlier run of this directory wrote, each with what it says, read once (a
    line cut off by its crash is dropped)."""
    try:  # a FIFO in its place held a resume forever
        lines = read_regular_file(path, MAX_EVENTS_BYTES).decode("utf-8", errors="replace").splitlines()
    except (OSError, UnreadableFile):
        return []
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: a line nested thousands deep
            continue
        if isinstance(record, dict):
            kept.append((line, record))
    return kept
