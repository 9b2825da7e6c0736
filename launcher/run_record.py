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

from hetlaunch.launcher.job_errors import BadInputError, JobError
from hetlaunch.runtime import host_clock
from hetlaunch.runtime.files import UnreadableFile, read_regular_file, write_whole


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
    """Create the run directory (and its parents); a one-line error naming the path and why not:
    BadInputError (exit 2, as a bad YAML) where the path itself is the fault (a file in its place
    or above it, a place not writable), JobError for the machine's (a full disk, a stale mount)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise BadInputError(f"cannot create run directory {path}: it exists and is not a directory") from None
    except OSError as err:
        named = err.errno in (errno.ENOTDIR, errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG,
                              errno.ELOOP, errno.EINVAL, errno.EMLINK)  # EINVAL: a name the file system refuses
        # (run:1 on vfat); anything else (a stale mount, a full disk) is the machine's
        raise (BadInputError if named else JobError)(f"cannot create run directory {path}: {_reason(err)}") from None


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
    time: float = field(default_factory=host_clock.now)  # when the coordinator had every stage's report (Unix s; runtime/host_clock.py)
    missing: list[str] | None = None  # nodes whose report never came (lost right after the step)
    lr: float | None = None  # the learning rate the step used
    grad_norm: float | None = None  # the whole model's gradient norm before clipping (when clipping)
    eval_loss: float | None = None  # the held-out loss after this step (when an evaluation was due)
    # Not in the file: its held-out loss was to come in a later report (measured in the next step's
    # bubbles) that has not come; launcher/step_aggregator.py.
    eval_awaited: bool = False
    # With islands: each island's loss, and the step's outer exchanges (fragments launched and
    # applied, the longest wait for one, bytes all stages sent, before and after the codec).
    islands: dict | None = None

    def to_json(self) -> str:
        extra = {"missing": self.missing} if self.missing else {}
        if self.islands is not None:
            extra["islands"] = self.islands
        recipe = {k: v for k, v in (("lr", self.lr), ("grad_norm", self.grad_norm), ("eval_loss", self.eval_loss))
                  if v is not None}
        return strict_json({"step": self.step, "loss": self.loss, **recipe, "tokens_per_s": self.tokens_per_s,
                            "step_s": self.step_s, "time": round(self.time, 3), **extra, "stages": self.stages})


class JsonLines:
    """An append-only file of JSON lines, each written whole: one write to an O_APPEND descriptor,
    cut off again if the disk takes only part of it. `keep` lines (already in the file, e.g. of a
    resumed run) are rewritten whole first; otherwise the file starts empty."""

    def __init__(self, path: Path, keep: list[str] | None = None):
        self.path = path
        self._close_error: str | None = None
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            if keep is None:
                flags |= os.O_TRUNC
            else:
                write_whole(path, "".join(line + "\n" for line in keep))
            # O_NONBLOCK: a FIFO left in the way fails here instead of blocking (no effect on a regular file).
            self._fd: int | None = os.open(path, flags, 0o666)
            self._length = os.fstat(self._fd).st_size  # bytes of whole lines in the file
        except OSError as err:
            raise JobError(f"cannot write {path}: {_reason(err)}") from None

    def append(self, line: str) -> None:
        """Append one line whole, or fail with JobError and leave the file as it was."""
        if self._fd is None:
            raise JobError(f"cannot write {self.path}: it is closed")
        data = (line + "\n").encode()
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
            raise JobError(f"cannot write {self.path}: {_reason(err)}") from None
        self._length += len(data)

    def close(self) -> str | None:
        """Flush to disk and close; never raises (it runs in `finally` blocks), returns the error instead."""
        if self._fd is None:
            return self._close_error
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        except OSError as err:
            self._close_error = f"cannot write {self.path}: {_reason(err)}"
        finally:
            try:
                os.close(fd)
            except OSError as err:
                self._close_error = self._close_error or f"cannot write {self.path}: {_reason(err)}"
        return self._close_error


MAX_RESUMED_METRICS_BYTES = 2 * 2**30


def read_metrics(path: Path, before_step: int) -> list[StepRecord]:
    """The step records of an earlier run of this run directory, for steps before `before_step`
    (the steps after the checkpoint a resume starts from are run, and logged, again). A line cut
    off by a crash is dropped; a file that is not ours is a JobError."""
    try:  # never blocks on a FIFO in its place, never reads past the bound
        lines = read_regular_file(path, MAX_RESUMED_METRICS_BYTES).decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    except UnreadableFile as err:
        raise JobError(f"cannot resume from {path}: {err}") from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            data = json.loads(line)
            record = StepRecord(step=int(data["step"]), loss=_number(data["loss"]),
                                tokens_per_s=float(data["tokens_per_s"]), step_s=float(data["step_s"]),
                                stages=[_stage_row(row) for row in data["stages"]], time=float(data.get("time", 0.0)),
                                missing=data.get("missing"), lr=_optional(data.get("lr")),
                                grad_norm=_optional(data.get("grad_norm")), eval_loss=_optional(data.get("eval_loss")),
                                islands=_islands_row(data.get("islands")))
        # OverflowError: a step of 1e999; RecursionError: a line nested thousands deep (both tracebacks before)
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            if number == len(lines):
                break  # the last line, cut off by the crash that ended the earlier run
            raise JobError(f"cannot resume from {path}: line {number} is not a step record") from None
        if record.step < before_step:
            records.append(record)
    records.sort(key=lambda r: r.step)
    return records


def _stage_row(row) -> dict:
    """A stage's part of a step record as launcher/step_aggregator.py writes it, checked to have what
    the summary reads (a resumed line of `"stages": [1, 2]` was taken, and the run ended in a
    traceback after training, with no summary.json); TypeError if it does not."""
    if not (isinstance(row, dict) and all(type(row.get(k)) is int for k in ("pipeline", "stage"))
            and isinstance(row.get("node"), str) and isinstance(row.get("sent_bytes"), dict)):
        raise TypeError("not a stage row")
    for key in ("step_s", "compute_s", "comm_s", "sync_s"):
        float(row[key])
    for pair in (*row["sent_bytes"].values(), *row.get("transit", {}).values()):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise TypeError("not a pair")
        float(pair[0]), float(pair[1])
    if not {"forward", "backward"} <= set(row["sent_bytes"]):
        raise TypeError("no bytes sent")
    if "peak_bytes" in row:
        int(row["peak_bytes"]["activations"]), int(row["peak_bytes"]["used"])
    return row


def _islands_row(value) -> dict | None:
    """A step's islands part (RunRecord._outer reads it), or None."""
    if value is None:
        return None
    outer = value["outer"]
    int(outer["launched"]), float(outer["blocked_s"]), float(outer["bytes"][0]), float(outer["bytes"][1])
    if not isinstance(value["losses"], (dict, list)):
        raise TypeError("no island losses")
    return value


def _number(value) -> float:
    return float("nan") if value is None else float(value)


def _optional(value) -> float | None:
    return None if value is None else float(value)


@dataclass
class RunRecord:
    """metrics.jsonl and the step records behind the summary. `resume_at`: keep the records of an
    earlier run of this directory before that step (a resumed run), else start empty."""

    run_dir: Path
    resume_at: int | None = None
    records: list[StepRecord] = field(default_factory=list)

    def __post_init__(self):
        make_run_dir(self.run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._close_error: str | None = None
        # Steps of an earlier run of this directory that its checkpoint holds but metrics.jsonl does not
        # (it stopped after the checkpoint was committed, before their reports came): never reported again.
        self.unrecorded: list[int] = []
        # The last step before a restore, whose held-out loss the failed step was to measure: kept
        # out of the file until the next generation's first step measures it (TrainSpec.eval_before_start).
        self.awaiting_eval: StepRecord | None = None
        if self.resume_at is not None:
            self.records = read_metrics(self.metrics_path, self.resume_at)
            self.give_up_before(self.resume_at)
        self._lines = JsonLines(self.metrics_path, [r.to_json() for r in self.records]
                                if self.resume_at is not None else None)

    def add(self, record: StepRecord) -> None:
        """Append the step's line whole, or fail with JobError and leave the file as it was."""
        if self.awaiting_eval is not None:
            held, self.awaiting_eval = self.awaiting_eval, None
            if held.step != record.step:  # its loss did not come first after all: it goes without
                self.add(held)
        self._lines.append(record.to_json())
        self.records.append(record)

    def hold_for_eval(self, record: StepRecord) -> None:
        """Keep `record` back for its held-out loss (the next `add` writes it, with it or without)."""
        self.release_awaiting()
        self.awaiting_eval = record

    def release_awaiting(self) -> None:
        """Write the held record as it is: its held-out loss will not be asked for again."""
        if self.awaiting_eval is not None:
            held, self.awaiting_eval = self.awaiting_eval, None
            self.add(held)

    @property
    def next_step(self) -> int:
        """The step after the last one recorded (or held for its held-out loss)."""
        last = max([r.step for r in self.records[-1:]] + [r.step for r in [self.awaiting_eval] if r is not None],
                   default=-1)
        return last + 1

    def _steps(self) -> set[int]:
        return {r.step for r in self.records} | {r.step for r in [self.awaiting_eval] if r is not None}

    def accounted(self) -> int:
        """Steps recorded (or held for their held-out loss), and steps that cannot be (see `unrecorded`)."""
        return len(self._steps() | set(self.unrecorded))

    def give_up_before(self, step: int, since: int = 0) -> list[int]:
        """The steps in [since, step) with no record, now counted as `unrecorded`: the state they
        led to is the one training goes on from, but no stage's report of them will come."""
        have = self._steps() | set(self.unrecorded)
        missing = [s for s in range(since, step) if s not in have]
        self.unrecorded = sorted(set(self.unrecorded) | set(missing))
        return missing

    def rewind(self, step: int) -> int:
        """Forget the steps from `step` on (they run again after a restore from an older state):
        the file is rewritten whole without them. Returns how many were dropped."""
        kept = [r for r in self.records if r.step < step]
        self.unrecorded = [s for s in self.unrecorded if s < step]  # those steps run again
        if self.awaiting_eval is not None and self.awaiting_eval.step >= step:
            self.awaiting_eval = None  # it runs again, and measures its held-out loss again
        dropped = len(self.records) - len(kept)
        if dropped:
            self._lines.close()
            self.records = kept
            self._lines = JsonLines(self.metrics_path, [r.to_json() for r in kept])
        return dropped

    def close(self) -> None:
        """Flush metrics.jsonl to disk and close it. Never raises (it runs in a `finally`, where it
        would hide the error that got there); a failure is raised by write_summary instead."""
        try:
            self.release_awaiting()
        except JobError as err:
            self._lines.close()
            self._close_error = str(err)
            return
        self._close_error = self._lines.close()

    def write_summary(self, summary: dict) -> None:
        """Write summary.json atomically and durably, so a reader never sees half a file."""
        if self._close_error:
            raise JobError(self._close_error)
        write_run_file(self.run_dir / "summary.json", strict_json(summary, indent=2) + "\n")

    def summarize(self) -> dict:
        """Loss at both ends and mean throughput; the first step is left out of the mean (warm-up)."""
        if not self.records:
            return {"steps": len(set(self.unrecorded)), **({"recorded_steps": 0} if self.unrecorded else {})}
        timed = self.records[1:] or self.records
        tokens = sum(r.tokens_per_s * r.step_s for r in timed)
        seconds = sum(r.step_s for r in timed)
        evals = [r.eval_loss for r in self.records if r.eval_loss is not None]
        # Steps the run took: the records and the steps whose report never came (`unrecorded`, said
        # as they happened), which counted 399 of a 400-step run (a review); the records alone beside.
        taken = len({r.step for r in self.records} | set(self.unrecorded))
        return {"steps": taken, **({"recorded_steps": len(self.records)} if taken != len(self.records) else {}),
                "first_loss": self.records[0].loss,
                "final_loss": self.records[-1].loss, **({"final_eval_loss": evals[-1]} if evals else {}), "mean_tokens_per_s": tokens / seconds if seconds else 0.0,
                "links": self._links(), "gradient_sync": self._sync(), **self._outer()}

    def _outer(self) -> dict:
        """With islands: the outer steps over the run (fragments exchanged, bytes between islands, per
        token), each island's last loss, and the time steps waited for the exchanges."""
        marked = [r for r in self.records if r.islands]
        if not marked:
            return {}
        outer = [r.islands["outer"] for r in marked]
        tokens = sum(r.tokens_per_s * r.step_s for r in self.records)
        wire = sum(o["bytes"][1] for o in outer)
        return {"outer": {"exchanges_launched": sum(o["launched"] for o in outer),
                          "raw_bytes": sum(o["bytes"][0] for o in outer), "wire_bytes": wire,
                          "wire_bytes_per_token": wire / tokens if tokens else 0.0,
                          "blocked_s": sum(o["blocked_s"] for o in outer),
                          # the last step's, or none where the run ended synchronously (a lost node left one
                          # island): the losses of islands long gone sat beside the final loss
                          "final_island_losses": marked[-1].islands["losses"] if marked[-1] is self.records[-1]
                          else []}}

    def _links(self) -> list[dict]:
        """Per stage boundary of each pipeline: bytes before and after compression over the whole
        run, both directions. After a re-plan the boundaries differ: each is listed with its steps."""
        links: dict[tuple, dict] = {}
        for r in self.records:
            for a, b in zip(r.stages, r.stages[1:]):
                if a["pipeline"] != b["pipeline"]:
                    continue
                key = (a["pipeline"], a["stage"], a["node"], b["node"])
                link = links.setdefault(key, {"pipeline": a["pipeline"], "boundary": a["stage"], "from": a["node"],
                                              "to": b["node"], "raw_bytes": 0, "wire_bytes": 0})
                fwd, bwd = a["sent_bytes"]["forward"], b["sent_bytes"]["backward"]
                link["raw_bytes"] += fwd[0] + bwd[0]
                link["wire_bytes"] += fwd[1] + bwd[1]
        for link in links.values():
            link["compression_ratio"] = link["raw_bytes"] / link["wire_bytes"] if link["wire_bytes"] else 1.0
        return list(links.values())

    def _sync(self) -> list[dict]:
        """Per node that synced gradients with other pipelines: bytes over the run, blocked time per step."""
        out: dict[str, dict] = {}
        for r in self.records:
            for stage in r.stages:
                raw, wire = stage["sent_bytes"]["sync"]
                if raw:
                    entry = out.setdefault(stage["node"], {"node": stage["node"], "raw_bytes": 0, "wire_bytes": 0,
                                                           "blocked_s": 0.0, "steps": 0})
                    entry["raw_bytes"] += raw
                    entry["wire_bytes"] += wire
                    entry["blocked_s"] += stage["sync_s"]
                    entry["steps"] += 1
        return [{"node": e["node"], "raw_bytes": e["raw_bytes"], "wire_bytes": e["wire_bytes"],
                 "mean_blocked_s": e["blocked_s"] / e["steps"]} for e in out.values()]
