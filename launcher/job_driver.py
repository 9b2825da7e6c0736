"""`hetlaunch up`: a live cluster, a plan, training, the run directory — one job, top to bottom.

A job is a loop over generations. Each generation is a plan, a data-plane group and the
checkpoint it starts from. When a node is lost the generation ends; the coordinator aborts
the survivors' workers (snapshotting their layers where another pipeline may stand in for
the lost one), re-plans on the nodes left with the profile it already has, and starts the
next generation from the newest committed state. `--resume` starts the first generation
from the run directory's last checkpoint after the coordinator itself died.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from hetlaunch.launcher.adapt.current_plan import CurrentPlan
from hetlaunch.launcher.adapt.replanner import Replanner
from hetlaunch.launcher.adapt.straggler import StragglerWatch
from hetlaunch.launcher.checkpoint_book import CheckpointBook, Restore
from hetlaunch.launcher.device_schedule_checks import several_stages_per_node
from hetlaunch.launcher.device_stage_launch import launch_devices
from hetlaunch.launcher.cluster_measurement import measure_for_train
from hetlaunch.launcher.events import EventLog
from hetlaunch.launcher.generation import follow
from hetlaunch.launcher.planning.plan import Plan, pinned_num_layers, static_plan
from hetlaunch.launcher.planning.planning_error import PlanningError
from hetlaunch.launcher.planning.profile_file import save_profile
from hetlaunch.launcher.planning.sync_groups import hierarchy_applies
from hetlaunch.launcher.planning.topology import Topology
from hetlaunch.launcher.memory_summary import memory_summary
from hetlaunch.launcher.progress import TrainingProgress, print_calibration, print_plan, print_summary
from hetlaunch.launcher.run_dir_lock import RunDirLock
from hetlaunch.launcher.run_record import RunRecord, StepRecord, make_run_dir
from hetlaunch.launcher.run_start import (check_fresh, check_resumable, checkpoint_book, checkpoint_lock, start_point,
                                          trained_to_the_end)
from hetlaunch.launcher.step_aggregator import StepAggregator
from hetlaunch.launcher.job_errors import BadInputError
from hetlaunch.launcher.session import ClusterSession, JobError
from hetlaunch.launcher.stage_launch import eval_fill_event, launch
from hetlaunch.launcher.observers import Observers, check_metrics_port
from hetlaunch.launcher.plain_text import escape_controls
from hetlaunch.protos import control_pb2 as pb

__all__ = ["JobError", "UpOptions", "run_up", "make_plan", "new_run_dir"]

LATE_STEPS_WAIT_S = 5.0  # for the reports of steps a checkpoint or the replicas hold, after a loss
SNAPSHOT_WAIT_S = 20.0  # how long survivors get to write their layers after a loss


@dataclass
class UpOptions:
    run_root: Path = Path("runs")
    run_dir: Path | None = None
    token: str | None = None
    reprofile: bool = False
    resume: Path | None = None  # a run directory to continue from its last committed checkpoint
    source: Path | None = None  # the cluster YAML, for the command that resumes the run


def new_run_dir(cluster, options: UpOptions) -> Path:
    run_dir = options.resume or options.run_dir or options.run_root / f"{cluster.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    if escape_controls(str(run_dir)) != str(run_dir):  # printed in many lines: an ESC cleared the screen, a newline split them
        raise BadInputError(f"run directory {escape_controls(str(run_dir))}: a name with control characters (a newline, "
                            "an escape) is refused")
    return run_dir


def make_plan(session: ClusterSession, spec, reprofile: bool, console: Console) -> tuple[Plan, Replanner]:
    """Measure the cluster and plan from the profile. Pinned `layers:` are used as they are, with
    no measuring at all when every codec is pinned too (else the codecs are planned). Returns the
    plan and the replanner that holds the profile it came from (None when nothing was measured)."""
    cluster = session.cluster
    train = cluster.train
    pinned = None
    if cluster.pinned:
        pinned = static_plan(cluster, pinned_num_layers(cluster))
        if not _codec_choice_left(cluster, pinned):
            return pinned, Replanner(cluster, None, lambda: _live_nodes(session))
    replanner = Replanner(cluster, measure_for_train(session, spec, reprofile, console), lambda: _live_nodes(session))
    if pinned is not None:
        return replanner.priced_pins(pinned), replanner
    max_pipelines = len(cluster.nodes) if train.max_pipelines == "auto" else train.max_pipelines
    with console.status(f"planning up to {max_pipelines} pipelines over {len(replanner.measured.nodes)} nodes"):
        try:
            plan, result = replanner.first()
        except PlanningError as err:
            if session.from_cache and not reprofile:  # a cache entry with wrong sizes failed every run alike
                raise PlanningError(f"{err} (the layer timings and sizes of {', '.join(sorted(session.from_cache))} "
                                    f"came from the profile cache: `up --reprofile` measures them again)") from None
            raise
    console.print(f"planned in {result.planning_s:.1f}s ({result.method} search)")
    return plan, replanner


def _codec_choice_left(cluster, plan: Plan) -> bool:
    """Does some boundary of this cut, or the sync between its pipelines, leave its codec (or its
    shape across regions) to `auto`?"""
    policy = cluster.compression
    if len(plan.pipelines()) > 1 and policy.sync == "auto":
        return True
    if policy.sync_topology == "auto" and any(hierarchy_applies([cluster.node(n).region for n in g.nodes])
                                             for g in plan.sync_plans()):
        return True
    return any(len(policy.candidates(j, a.region == b.region)) > 1
               for stages in plan.pipelines() for j, (a, b) in enumerate(zip(stages, stages[1:])))


def run_up(cluster, options: UpOptions, console: Console) -> Path:
    """Run the cluster's job to the end; return the run directory. Raises JobError on failure."""
    spec = cluster.model.to_spec()
    if cluster.pinned:
        static_plan(cluster, pinned_num_layers(cluster))  # bad pinned ranges fail here, before anything starts
    if options.resume is not None:
        check_resumable(options.resume)
    run_dir = new_run_dir(cluster, options)
    session = ClusterSession(cluster, run_dir, options.token or secrets.token_urlsafe(24), console)
    session.agents.preflight()  # a tool this machine lacks fails before the run directory exists
    check_metrics_port(cluster)  # not found only after profiling
    created = not run_dir.exists()
    make_run_dir(run_dir)
    with RunDirLock(run_dir), contextlib.ExitStack() as locks:  # first: a running job's directories are refused
        try:
            locks.enter_context(checkpoint_lock(session))
            if options.resume is None:
                check_fresh(run_dir, session.checkpoint_root)
        except JobError:
            if created:  # refused before anything ran: leave nothing behind
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        if options.resume is not None and trained_to_the_end(session, spec, console):
            return run_dir
        with session:
            while not session.state.joins.empty():  # the first registrations are not joins to act on
                session.state.joins.get_nowait()
            events = EventLog(run_dir, resume=options.resume is not None)
            try:
                _run(session, spec, options, events, console)
            finally:
                events.close()
            return run_dir


def _run(session: ClusterSession, spec, options: UpOptions, events: EventLog, console: Console) -> None:
    """The job as a loop over generations: launch a plan, follow it to its end, then finish, stop
    at `down`, switch plans at a checkpoint, or recover from a lost node and launch again."""
    train = session.cluster.train
    plan, replanner = make_plan(session, spec, options.reprofile, console)
    for node, why in session.lost.items():  # dropped while profiling (launcher/cluster_measurement.py)
        events.write("lost", node=node, why=why, in_plan=False)
    if replanner.measured is not None:  # what the plan was made from: `hetlaunch plan --profile` can replay it
        save_profile(replanner.measured, session.run_dir / "profile.json")
    print_plan(console, plan)
    book = checkpoint_book(session, spec, plan)
    restore = start_point(book, spec, plan, options.resume, events, console)
    record = RunRecord(session.run_dir, resume_at=restore.step if options.resume is not None else None)
    _say_unrecorded(record.unrecorded, "the checkpoint this run resumes from", events, console)
    current = CurrentPlan()
    observers = Observers(session.cluster, session.run_dir, session.state, current)
    observers.stragglers = StragglerWatch(train, replanner, current, offsets=session.state.clock_offsets)
    if observers.metrics_address:
        console.print(f"metrics at http://{observers.metrics_address}/metrics")
    restarts = 0
    start = time.monotonic()
    if restore.step >= train.steps:
        console.print(f"the checkpoint at step {restore.step} is this run's last (train.steps: {train.steps}): "
                      f"nothing left to train")
    try:
        with TrainingProgress(console, train.steps, completed=restore.step) as progress:
            while restore.step < train.steps:
                # `plan` is the plan to launch; from here on the generation's plan is current.plan
                started = restore.step
                observers.new_generation(current.launch(plan), replanner.measured, restore.step)
                boundary_bytes = _boundary_bytes(replanner)
                if record.awaiting_eval is not None and record.awaiting_eval.step != restore.step - 1:
                    record.release_awaiting()
                if several_stages_per_node(plan.schedule):  # evaluation after the step: no eval owed from bubbles
                    book.expect(launch_devices(session, plan, spec, restore, book.root, boundary_bytes))
                else:
                    book.expect(launch(session, plan, spec, restore, book.root, boundary_bytes,
                                       eval_before_start=record.awaiting_eval is not None))
                events.write("generation", generation=session.state.generation, start_step=restore.step,
                             restore_source=restore.source, plan=plan.to_dict())
                if train.eval_every and train.eval_in_bubbles and not several_stages_per_node(plan.schedule):
                    events.write("eval_fill", **eval_fill_event(plan, train.eval_microbatches))
                if restore.directory is not None:
                    events.write("restore", step=restore.step, source=restore.source, directory=str(restore.directory))
                outcome = follow(session, current, replanner, record, book, events, progress, observers, boundary_bytes)
                plan = current.plan  # a live move changes the plan within the generation
                if outcome.finished:
                    break
                if outcome.down:
                    _abort(session, plan, "hetlaunch down", snapshot_root=None)
                    events.write("down", why=session.state.down_requested, step=book.latest[0] if book.latest else 0)
                    resumes = (f"from step {book.latest[0]}" if book.latest else "from step 0: no checkpoint was committed")
                    yaml_path = escape_controls(str(options.source)) if options.source else "CLUSTER.yaml"
                    console.print(f"{outcome.message}; `hetlaunch up {yaml_path} --resume {session.run_dir}` continues "
                                  f"{resumes}")
                    break
                if outcome.grow is not None:  # at a checkpoint: switch to the better plan
                    _abort(session, plan, outcome.message, snapshot_root=None)
                    restore, plan = book.restore_point("file"), outcome.grow
                    events.write("restart", cause=outcome.message, resume_step=restore.step,
                                 lost_steps=record.rewind(restore.step))
                    _say_unrecorded(record.give_up_before(restore.step, since=started),
                                    "the checkpoint the new plan starts from", events, console)
                    progress.rebalancing(outcome.message, restore.step)
                    print_plan(console, plan)
                    continue
                if restarts >= train.max_restarts:
                    _declare_lost(session, outcome, events)
                    raise JobError(f"{outcome.message} (no restart left: train.max_restarts is {train.max_restarts})")
                if not set(_live_nodes(session)) - set(outcome.lost):  # said as the error, not as a recovery
                    _declare_lost(session, outcome, events)
                    raise JobError(f"{outcome.message}: no node is left to train on")
                restarts += 1
                observers.restarted(restarts)
                progress.recovering(outcome.message, record.records[-1].step + 1 if record.records else 0)
                restore, plan, lost_steps = _recover(session, spec, replanner, plan, outcome, started, book, record,
                                                     events, console)
                # `recovering:` is said before it is known whether the nodes left can hold the model
                # (else a one-line error follows it); this says it could, and from where it goes on.
                where = {"replica": "the survivors' replicas", "file": "the last checkpoint"}.get(restore.source,
                                                                                             "the start")
                console.print(f"recovered: resuming at step {restore.step} from {where} on "
                              f"{len({stage.node for stage in plan.stages})} node(s)")
                events.write("restart", restart=restarts, cause=outcome.message, resume_step=restore.step,
                             restore_source=restore.source, lost_steps=lost_steps)
    finally:
        record.close()
        observers.close()
    # No generation ran when the run resumed from its last step: its plan is the one made now.
    _finish(session, current.plan or plan, record, book, observers, events, console,
            {"wall_s": time.monotonic() - start, "restarts": restarts})


def _declare_lost(session: ClusterSession, outcome, events: EventLog) -> None:
    for node, why in outcome.lost.items():
        session.declare_lost(node, why)
        events.write("lost", node=node, why=why, in_plan=True)


def _recover(session: ClusterSession, spec, replanner: Replanner, plan: Plan, outcome, started: int,
             book: CheckpointBook, record: RunRecord, events: EventLog, console: Console) -> tuple[Restore, Plan, int]:
    """After a lost node: stop the survivors, restore from their replicas or the last checkpoint,
    keep the steps taken before it, and plan again on the nodes left: (restore, plan, steps redone).
    `started`: the step the ended generation started at."""
    _declare_lost(session, outcome, events)
    # No step of this generation taken: the survivors' snapshots would hold the step it started
    # from, which the restore point already is, so none is asked for or waited on (a worker killed
    # before the first step held the recovery for the whole snapshot wait, 20 s). A step counts as
    # taken when recorded, pending, queued unread, or named by a node's heartbeat (reports travel
    # in batches, heartbeats carry the last step a worker finished).
    stepped = (bool(record.records and record.records[-1].step >= started)
               or bool(outcome.aggregator is not None and outcome.aggregator.pending)
               or session.state.steps_pending()
               or any(step >= started for _, _, step in session.state.silent_for().values()))
    restore = _abort_and_restore(session, plan, book, events, outcome.failed, snapshots=stepped)
    lost_steps = record.rewind(restore.step)
    _record_late_steps(session, outcome.aggregator, record, started, restore.step)
    _say_unrecorded(record.give_up_before(restore.step, since=started),
                    "the state training goes on from", events, console)
    plan = _replan(session, spec, replanner, console)
    print_plan(console, plan)
    return restore, plan, lost_steps


def _say_unrecorded(steps: list[int], held_by: str, events: EventLog, console: Console) -> None:
    """Steps that `held_by` includes but metrics.jsonl never will: an event and one line."""
    if steps:
        events.write("unrecorded", steps=steps)
        shown = ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")
        console.print(f"no report came of step(s) {shown}: {held_by} includes them; metrics.jsonl has no line for them")


def _finish(session: ClusterSession, plan: Plan, record: RunRecord, book: CheckpointBook,
            observers: Observers, events: EventLog, console: Console, extra: dict) -> None:
    """summary.json, the calibration, the last event and the console's summary."""
    summary = {"run_id": session.run_dir.name, "plan": plan.to_dict(), **record.summarize(), **extra,
               "memory": memory_summary(plan, record.records),
               "checkpoints_committed": book.committed, "events": dict(events.counts)}
    if session.state.dropped_reports:  # past the coordinator's queue (a flood no real agent sends)
        summary["dropped_reports"] = session.state.dropped_reports
    calibration = observers.calibration.finish(record.records)
    if calibration is not None:
        summary["calibration"] = calibration
        print_calibration(console, calibration)
    record.write_summary(summary)
    events.write("done", steps=len(record.records))
    print_summary(console, summary, session.run_dir)


def _record_late_steps(session: ClusterSession, aggregator: StepAggregator, record: RunRecord, started: int,
                       before: int, wait_s: float = LATE_STEPS_WAIT_S) -> None:
    """Record, in order, the steps of the generation that started at `started` that it took before
    `before` but did not record (earlier gaps are already `unrecorded`)."""
    expected = max(record.next_step, started)
    for late in _late_steps(session, aggregator, expected, before, wait_s):
        if late.step == expected:
            if late.eval_awaited and late.step == before - 1:  # the next generation measures it first
                record.hold_for_eval(late)
            else:
                record.add(late)
            expected += 1


def _late_steps(session: ClusterSession, aggregator: StepAggregator, since: int, before: int,
                wait_s: float = LATE_STEPS_WAIT_S) -> list[StepRecord]:
    """The steps in [since, before) that the ended generation took but `follow` did not record:
    those whose reports came in after it returned (the survivors' last ones, while they were
    stopped; waiting up to wait_s for a step nobody's report has reached yet), and those some
    stage never reported (its node died after the step was taken, before its report)."""
    deadline = time.monotonic() + wait_s
    complete: dict[int, StepRecord] = {}
    while True:
        for node, metrics in session.state.steps():
            if (done := aggregator.add(node, metrics)) is not None:
                complete[done.step] = done
        seen = set(complete) | set(aggregator.pending)
        if all(step in seen for step in range(since, before)) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    late = [r for step, r in complete.items() if step < before] + aggregator.incomplete(before=before)
    return sorted(late, key=lambda r: r.step)


def _boundary_bytes(replanner: Replanner) -> list[int] | None:
    """Each layer's output bytes, as profiled (None: nothing was measured)."""
    return None if replanner.measured is None else [layer.output_bytes for layer in replanner.measured.layers]


def _abort(session: ClusterSession, plan: Plan, reason: str, snapshot_root: Path | None) -> list[str]:
    """Stop every live stage's worker (after a snapshot of its layers, into snapshot_root/<node>)."""
    live = [node for node in Topology.of(plan).nodes if node not in session.lost]  # an abort goes to a node
    for node in live:
        snapshot_dir = str(snapshot_root / node) if snapshot_root is not None else ""
        session.state.send(node, pb.Command(abort=pb.Abort(reason=reason, snapshot_dir=snapshot_dir)))
    return live


def _abort_and_restore(session: ClusterSession, plan: Plan, book: CheckpointBook, events: EventLog,
                       failed: set[str], snapshots: bool = True) -> Restore:
    """End the generation on the survivors and choose the state the next one starts from: the
    survivors' snapshots when they hold every layer at a newer step than the last checkpoint
    (another pipeline stood in for the lost node), else the last committed checkpoint.
    `snapshots`: False when they cannot be newer (no step of the generation was reported)."""
    # A device-schedule worker writes no snapshot (runtime/device_stage_command.py): its plan resumes
    # from the last checkpoint, however many pipelines it has.
    several = snapshots and len(plan.pipelines()) > 1 and not several_stages_per_node(plan.schedule)
    snapshot_root = book.root / f"replica-g{session.state.generation}" if several else None
    live = _abort(session, plan, "a node was lost", snapshot_root)
    answered = set(failed)  # a failed stage wrote its snapshot (if any) before it reported its failure
    deadline = time.monotonic() + (SNAPSHOT_WAIT_S if several else 0.5)
    while time.monotonic() < deadline and not (several and set(live) <= answered | set(book.snapshots)):
        for node, part in session.state.checkpoints():
            if (step := book.add(node, part)) is not None:  # a checkpoint finished just before the loss
                events.write("checkpoint", step=step, directory=str(book.latest[1]), source="file")
        answered |= {node for node, result in session.state.results()}
        answered |= set(session.lost_nodes(answered))
        time.sleep(0.05)
    for node, part in book.snapshots.items():
        events.write("snapshot", node=node, step=part.step, layers=[part.layer_start, part.layer_end])
    source = "file"
    islands = ([{s.node for p in members for s in plan.pipelines()[p]} for members in plan.island_members()]
               if plan.islands else None)
    if several and (step := book.commit_snapshots(islands)) is not None:
        events.write("checkpoint", step=step, directory=str(book.latest[1]), source="replica")
        source = "replica"
    if snapshot_root is not None:
        shutil.rmtree(snapshot_root, ignore_errors=True)
    return book.restore_point(source)


def _live_nodes(session: ClusterSession) -> list[str]:
    joined = set(session.state.joined_nodes())
    return [n.name for n in session.cluster.nodes if n.name in joined and n.name not in session.lost]


def _replan(session: ClusterSession, spec, replanner: Replanner, console: Console) -> Plan:
    """A plan for the nodes still in the job, from the profile already measured (the first plan
    was pinned without measuring: the survivors are measured now)."""
    names = _live_nodes(session)
    if names and replanner.measured is None:
        replanner.measured = measure_for_train(session, spec, False, console, names=names)
    with console.status(f"re-planning on {len(names)} node(s)"):
        return replanner.replan()
