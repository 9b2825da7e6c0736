"""Where a run starts, checked before it trains: a run directory and checkpoint directory of its
own (locked, holding no other run), or a run to resume (a run directory whose coordinator is
gone) and the newest checkpoint of it that can be trusted; the run's checkpoint book.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

import psutil
from google.protobuf import json_format
from rich.console import Console
from rich.text import Text

from hetlaunch.launcher.checkpoint_book import CheckpointBook, Restore
from hetlaunch.launcher.events import EventLog
from hetlaunch.launcher.job_errors import BadInputError, JobError
from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.run_dir_lock import CheckpointDirLock
from hetlaunch.launcher.run_record import read_metrics
from hetlaunch.launcher.session import ClusterSession
from hetlaunch.runtime.checkpoint_manifest import latest_checkpoint, newest_intact_checkpoint, put_away
from hetlaunch.runtime.files import UnreadableFile, read_json
from hetlaunch.runtime.wire import model_spec_to_proto


def checkpoint_lock(session: ClusterSession):
    """The checkpoint directory is locked like the run directory, but where it is the run directory
    (one lock file: two descriptors of one process conflict, and the run refused itself)."""
    if session.checkpoint_root == session.run_dir.resolve():
        return contextlib.nullcontext()
    return CheckpointDirLock(session.checkpoint_root)


def check_fresh(run_dir: Path, checkpoint_root: Path) -> None:
    """A new run never starts over another's records or checkpoints: `up --run-dir` on a finished
    run emptied its metrics.jsonl and wrote over its checkpoints, and a second run sharing a
    checkpoint.dir pruned its own newest checkpoint for the first run's newer steps (and a resume
    then took the first run's state)."""
    try:
        recorded = (run_dir / "metrics.jsonl").stat().st_size > 0
    except OSError:
        recorded = False
    if recorded:
        raise JobError(f"{run_dir} holds a run already (its metrics.jsonl): continue it with `--resume {run_dir}`, "
                       f"or give this run another --run-dir")
    try:
        found = latest_checkpoint(checkpoint_root)
    except OSError:
        found = None  # a root that cannot be listed holds no run's checkpoints; make_run_dir says why
    if found is not None:
        raise JobError(f"{checkpoint_root} holds another run's checkpoint (step {found[1].step}): resume that run "
                       f"with --resume, or give this one a checkpoint directory of its own")


def check_resumable(run_dir: Path) -> None:
    """Before anything starts: a run directory of ours, with readable metrics, that no live
    coordinator is still writing."""
    if not (run_dir / "metrics.jsonl").is_file():
        raise BadInputError(f"cannot resume {run_dir}: not a run directory (no metrics.jsonl)")
    read_metrics(run_dir / "metrics.jsonl", before_step=2**62)  # a JobError naming the bad line
    try:
        contact = read_json(run_dir / "coordinator.json", 4096)
        pid = contact.get("pid") if isinstance(contact, dict) else None
    except (FileNotFoundError, UnreadableFile):
        pid = None
    if isinstance(pid, int) and pid != os.getpid() and psutil.pid_exists(pid):
        try:
            running = "hetlaunch" in " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            running = False
        if running:
            raise JobError(f"cannot resume {run_dir}: its coordinator (pid {pid}) is still running")


def trained_to_the_end(session: ClusterSession, spec, console: Console) -> bool:
    """Whether the run being resumed ended whole (a summary.json of at least its newest
    checkpoint's steps) with an intact checkpoint of this model at train.steps or past it: then
    nothing starts and nothing of the run is written (a resume that trained nothing rewrote
    summary.json with a wall time of 0, no checkpoints and no events; a hostile review). A run
    killed before its summary, a broken last checkpoint or one of another model goes the whole
    way: the resume writes the summary, trains again from the one before, or names the model."""
    root, steps = session.checkpoint_root, session.cluster.train.steps
    newest = latest_checkpoint(root) if root.is_dir() else None  # read, not verified: cheap, and most resumes end here
    if newest is None or newest[1].step < steps:
        return False
    found, _ = newest_intact_checkpoint(root)  # a broken last checkpoint is set aside by the resume, which trains again
    if found is None or found[1].step < steps or found[1].extra.get("model") != spec.describe():
        return False
    try:  # a summary of this end, not of an earlier `down` the resume went on from (a review)
        summary = read_json(session.run_dir / "summary.json", 64 << 20)
    except (FileNotFoundError, UnreadableFile):
        return False
    ended_at = summary.get("steps") if isinstance(summary, dict) else None
    if not isinstance(ended_at, int) or isinstance(ended_at, bool) or ended_at < found[1].step:
        return False
    console.print(f"the checkpoint at step {found[1].step} is this run's last (train.steps: {steps}): nothing left "
                  f"to train; {session.run_dir} is left as it was")
    return True


def checkpoint_book(session: ClusterSession, spec, plan: Plan) -> CheckpointBook:
    """The run's checkpoints, each manifest naming the model and seeds a restore must match."""
    cluster = session.cluster
    book = CheckpointBook(session.checkpoint_root, cluster.checkpoint.keep, plan.num_layers,
                          {"model": spec.describe(), "model_spec": json_format.MessageToDict(model_spec_to_proto(spec)),
                           "train_seed": cluster.train.seed, "data_seed": cluster.data.seed,
                           "rng": "torch.manual_seed(step_rng_seed(train_seed, step)) before every step"})
    session.state.checkpoint_root = book.root  # remote stages upload their parts here
    _remove_stale_snapshots(book.root)
    return book


def _remove_stale_snapshots(root: Path) -> None:
    """Replica snapshots (`replica-g<k>`, launcher/job_driver.py _abort_and_restore) serve only
    the recovery that wrote them, which removes them; an `up` killed during one left a full copy
    of the model per node behind, kept through every later resume."""
    try:
        stale = [p for p in root.iterdir() if re.fullmatch(r"replica-g\d+", p.name)]
    except OSError:
        return
    for path in stale:
        if path.is_symlink():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)


def start_point(book: CheckpointBook, spec, plan: Plan, resume: Path | None, events: EventLog,
                console: Console) -> Restore:
    """Step 0, or with --resume the run's last committed checkpoint."""
    if resume is None:
        return Restore(0, None, "init")
    restore = _resume_point(book, spec, plan, events, console)
    events.write("resume", step=restore.step, directory=str(restore.directory) if restore.directory else None)
    console.print(f"resuming at step {restore.step} from {restore.directory}" if restore.directory else
                  "no committed checkpoint to resume from: starting at step 0")
    return restore


def _resume_point(book: CheckpointBook, spec, plan: Plan, events: EventLog, console: Console) -> Restore:
    """The newest intact checkpoint of the run being resumed (or the start, if none). Newer ones
    that are not intact (a truncated part, a wrong checksum, a broken or misplaced manifest) are
    set aside, each said in one line: the run goes on from the newest it can trust."""
    found, refused = newest_intact_checkpoint(book.root) if book.root.exists() else (None, [])
    committed = [e for e in events.earlier if e.get("event") == "checkpoint"]
    if found is None and committed:
        # None where the run committed one is an error, not step 0: a resume that found none started
        # over and wrote over the run's records (a hostile review: a YAML with another checkpoint.dir).
        last = committed[-1]
        what = (f"{len(refused)} there refused, the newest for: {refused[0][2]}" if refused else
                "is checkpoint.dir the run's?")
        raise JobError(f"cannot resume: the run committed a checkpoint of step {last.get('step')} in "
                       f"{last.get('directory')}, but {book.root} holds no intact one ({what}); start over with "
                       "another --run-dir")
    for step, directory, why in refused:
        done, aside = put_away(directory)
        events.write("checkpoint_refused", step=step, directory=str(directory), why=why,
                     set_aside=str(aside) if aside else None, outcome=done)
        fallback = f"step {found[1].step}" if found is not None else "the start (no intact checkpoint)"
        console.print(Text(f"checkpoint of step {step} is not usable ({why}); {done}, resuming from {fallback}"),
                      soft_wrap=True)
    if found is None:
        book.latest = None
        return Restore(0, None, "init")
    directory, manifest = found
    book.latest = (manifest.step, directory)
    if manifest.extra.get("model") != spec.describe() or manifest.num_layers != plan.num_layers:
        raise JobError(f"cannot resume: {directory} holds model {manifest.extra.get('model')} "
                       f"({manifest.num_layers} layers), the YAML describes {spec.describe()} ({plan.num_layers} layers)")
    return Restore(manifest.step, directory, "file")
