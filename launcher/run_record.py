"""The run directory: metrics.jsonl (one line per step) and summary.json (written whole, once).

A file of the run directory is never left half written: a metrics line goes out in one
write to an append-only descriptor and is cut off again if the disk takes only part of it,
and summary.json (like coordinator.json and the token) is a temporary file, fsynced and
renamed into place. A directory or file that cannot be written is a one-line JobError
naming the path and the system's reason (`cannot write runs/x/metrics.jsonl: No space
left on device`), never a traceback.
"""

from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from hetlaunch.launcher.session import JobError
from hetlaunch.runtime.files import write_whole
from hetlaunch.protos import control_pb2 as pb


def _reason(err: OSError) -> str:
    return err.strerror or str(err)


def strict_json(value, indent: int | None = None) -> str:
    """JSON that every reader accepts: a diverged loss (NaN, inf) is written as null, not as NaN."""
    def finite(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(value), indent=indent, allow_nan=False)


def make_run_dir(path: Path) -> None:
    """Create the run directory (and its parents); JobError naming the path and why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise JobError(f"cannot create run directory {path}: it exists and is not a directory") from None
    except OSError as err:
        raise JobError(f"cannot create run directory {path}: {_reason(err)}") from None


def write_run_file(path: Path, text: str, mode: int = 0o666) -> None:
    """write_whole, with a failure as a one-line JobError naming the file."""
    try:
        write_whole(path, text, mode)
    except OSError as err:
        raise JobError(f"cannot write {path}: {_reason(err)}") from None


@dataclass
class StepRecord:
    step: int
    loss: float
    tokens_per_s: float
    step_s: float
    stages: list[dict]

    def to_json(self) -> str:
        return strict_json({"step": self.step, "loss": self.loss, "tokens_per_s": self.tokens_per_s,
                            "step_s": self.step_s, "stages": self.stages})


class StepAggregator:
    """Joins the per-stage reports of one step into one record once every stage has reported.

    With several pipelines the step's loss is the mean over all its micro-batches: each
    pipeline's mean weighted by its share, and its tokens are the pipelines' sum.
    """

    def __init__(self, plan):
        self.position = {}  # node -> (pipeline, stage index)
        for p, stages in enumerate(plan.pipelines()):
            for j, stage in enumerate(stages):
                self.position[stage.node] = (p, j)
        self.shares = plan.pipeline_microbatches
        self.pending: dict[int, dict[tuple[int, int], tuple[str, pb.StepMetrics]]] = {}

    def add(self, node: str, metrics: pb.StepMetrics) -> StepRecord | None:
        reports = self.pending.setdefault(metrics.step, {})
        reports[self.position[node]] = (node, metrics)
        if len(reports) < len(self.position):
            return None
        del self.pending[metrics.step]
        ordered = [(position, *reports[position]) for position in sorted(reports)]
        loss = sum(m.loss * self.shares[p] for (p, _), _, m in ordered if m.has_loss) / sum(self.shares)
        # Stages overlap in a pipeline and pipelines run side by side: the step takes as long as the slowest.
        step_s = max(m.step_s for _, _, m in ordered)
        tokens = sum(m.tokens for (_, j), _, m in ordered if j == 0)
        stages = [{"pipeline": p, "stage": j, "node": node, "step_s": round(m.step_s, 6),
                   "compute_s": round(m.compute_s, 6), "comm_s": round(m.comm_s, 6), "sync_s": round(m.sync_s, 6),
                   "sent_bytes": {"forward": [m.forward_raw_bytes, m.forward_wire_bytes],
                                  "backward": [m.backward_raw_bytes, m.backward_wire_bytes],
                                  "sync": [m.sync_raw_bytes, m.sync_wire_bytes]}}
                  for (p, j), node, m in ordered]
        return StepRecord(step=metrics.step, loss=loss, tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
                          step_s=step_s, stages=stages)


@dataclass
class RunRecord:
    run_dir: Path
    records: list[StepRecord] = field(default_factory=list)

    def __post_init__(self):
        make_run_dir(self.run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._close_error: str | None = None
        self._length = 0  # bytes of whole lines in metrics.jsonl
        try:
            # O_NONBLOCK: a FIFO left in the way fails here instead of blocking (no effect on a regular file).
            self._fd: int | None = os.open(self.metrics_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
                                           | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
        except OSError as err:
            raise JobError(f"cannot write {self.metrics_path}: {_reason(err)}") from None

    def add(self, record: StepRecord) -> None:
        """Append the step's line whole, or fail with JobError and leave the file as it was."""
        if self._fd is None:
            raise JobError(f"cannot write {self.metrics_path}: the run record is closed")
        data = (record.to_json() + "\n").encode()
        try:
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                if written == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                view = view[written:]
        except OSError as err:
            try:
                os.ftruncate(self._fd, self._length)  # a short write left part of a line: take it back
            except OSError:
                pass
            raise JobError(f"cannot write {self.metrics_path}: {_reason(err)}") from None
        self._length += len(data)
        self.records.append(record)

    def close(self) -> None:
        """Flush metrics.jsonl to disk and close it. Never raises (it runs in a `finally`, where it
        would hide the error that got there); a failure is raised by write_summary instead."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        except OSError as err:
            self._close_error = f"cannot write {self.metrics_path}: {_reason(err)}"
        finally:
            try:
                os.close(fd)
            except OSError as err:
                self._close_error = self._close_error or f"cannot write {self.metrics_path}: {_reason(err)}"

    def write_summary(self, summary: dict) -> None:
        """Write summary.json atomically and durably, so a reader never sees half a file."""
        if self._close_error:
            raise JobError(self._close_error)
        write_run_file(self.run_dir / "summary.json", strict_json(summary, indent=2) + "\n")

    def summarize(self) -> dict:
        """Loss at both ends and mean throughput; the first step is left out of the mean (warm-up)."""
        if not self.records:
            return {"steps": 0}
        timed = self.records[1:] or self.records
        tokens = sum(r.tokens_per_s * r.step_s for r in timed)
        seconds = sum(r.step_s for r in timed)
        return {"steps": len(self.records), "first_loss": self.records[0].loss,
                "final_loss": self.records[-1].loss, "mean_tokens_per_s": tokens / seconds if seconds else 0.0,
                "links": self._links(), "gradient_sync": self._sync()}

    def _links(self) -> list[dict]:
        """Per stage boundary of each pipeline: bytes before and after compression over the whole
        run, both directions."""
        stages = self.records[0].stages
        links = []
        for j, (a, b) in enumerate(zip(stages, stages[1:])):
            if a["pipeline"] != b["pipeline"]:
                continue
            raw = wire = 0
            for r in self.records:
                fwd = r.stages[j]["sent_bytes"]["forward"]
                bwd = r.stages[j + 1]["sent_bytes"]["backward"]
                raw += fwd[0] + bwd[0]
                wire += fwd[1] + bwd[1]
            links.append({"pipeline": a["pipeline"], "boundary": a["stage"], "from": a["node"], "to": b["node"],
                          "raw_bytes": raw, "wire_bytes": wire, "compression_ratio": raw / wire if wire else 1.0})
        return links

    def _sync(self) -> list[dict]:
        """Per stage that synced gradients with other pipelines: bytes over the run, blocked time per step."""
        out = []
        for i, stage in enumerate(self.records[0].stages):
            raw = sum(r.stages[i]["sent_bytes"]["sync"][0] for r in self.records)
            wire = sum(r.stages[i]["sent_bytes"]["sync"][1] for r in self.records)
            if raw:
                out.append({"node": stage["node"], "raw_bytes": raw, "wire_bytes": wire,
                            "mean_blocked_s": sum(r.stages[i]["sync_s"] for r in self.records) / len(self.records)})
        return out
