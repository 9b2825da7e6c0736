"""Follow one generation (a plan, its data-plane group, the checkpoint it started from) to its end.

It ends in one of three ways: every stage finished every step; a node was lost (its agent
or worker died, its heartbeats stopped, or its stage failed for a reason of its own — the
neighbours' "connection closed" errors are consequences, not causes); or a node (re)joined
or a straggler was found and a new plan is predicted to be enough faster, at a committed
checkpoint. A straggler may instead be answered within the generation by a live move of
layers (launcher/adapt/live_moves.py): the plan changes, the workers and the generation do not.
Either change is checked on the steps after it, and undone the same way when it did not pay
(launcher/adapt/payoff.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hetlaunch.launcher.checkpoint_book import CheckpointBook
from hetlaunch.launcher.events import EventLog
from hetlaunch.launcher.adapt.current_plan import CurrentPlan
from hetlaunch.launcher.adapt.live_moves import LiveMove
from hetlaunch.launcher.adapt.payoff import Change
from hetlaunch.launcher.adapt.replanner import Replanner
from hetlaunch.launcher.observers import Observers
from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.planning.topology import Topology
from hetlaunch.launcher.progress import TrainingProgress
from hetlaunch.launcher.run_record import RunRecord, StepAggregator
from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.session import ClusterSession, is_peer_error


@dataclass
class Outcome:
    finished: bool = False
    lost: dict[str, str] = field(default_factory=dict)  # node -> why it is out
    message: str = ""
    grow: Plan | None = None  # a better plan with joined nodes, to switch to at the last checkpoint
    down: bool = False  # `hetlaunch down`: stop here, at a committed checkpoint where checkpoints are on
    failed: set[str] = field(default_factory=set)  # nodes whose stage reported a failure
    aggregator: StepAggregator | None = None  # holds the steps some stage never reported


def follow(session: ClusterSession, current: CurrentPlan, replanner: Replanner | None, record: RunRecord,
           book: CheckpointBook, events: EventLog, progress: TrainingProgress,
           observers: Observers | None = None, boundary_bytes: list[int] | None = None) -> Outcome:
    """Follow the generation of `current.plan` (which a live move changes) to its end;
    `replanner` (None: joins are not acted on) prices a plan with joined nodes."""
    running = _Running(current, replanner, progress)
    return _follow(session, running, record, book, events, progress, observers, boundary_bytes)


@dataclass
class _Running:
    current: CurrentPlan
    replanner: Replanner | None
    progress: TrainingProgress
    move: LiveMove | None = None
    moves: int = 0


def _follow(session: ClusterSession, running: _Running, record: RunRecord, book: CheckpointBook, events: EventLog,
            progress: TrainingProgress, observers: Observers | None, boundary_bytes: list[int] | None) -> Outcome:
    plan = running.current.plan
    state = session.state
    steps = session.cluster.train.steps
    aggregator = StepAggregator(plan)
    # Results arrive per node: a finished generation is one result from each of the plan's nodes.
    in_plan = Topology.of(plan).by_node("following a generation (a stage's result names its node)")
    finished: set[str] = set()
    joined: list[str] = []
    first = True
    died: set[str] = set()  # stages whose worker died without reporting (recoverable, unlike a stage's error)

    def new_failures() -> list[tuple[str, str]]:
        failed = []
        for node, result in state.results():
            if result.ok:
                finished.add(node)
            else:
                failed.append((node, result.error))
                if result.worker_died:
                    died.add(node)
        return failed

    while True:
        received = state.next_step(timeout=0.2)
        if received is not None:
            if observers is not None and received[1].trace:
                observers.trace(*received)
            step_record = aggregator.add(*received)
            if step_record is not None:
                if first:  # when the generation is really running again (recovery time ends here)
                    events.write("first_step", generation=state.generation, step=step_record.step)
                    first = False
                record.add(step_record)
                progress.update(step_record)
                event = observers.step(step_record, state.generation) if observers is not None else None
                if event is not None:
                    events.write(event[0], **event[1])
        committed = None
        for node, part in state.checkpoints():
            committed = book.add(node, part) or committed
        if committed is not None:
            events.write("checkpoint", step=committed, directory=str(book.latest[1]), source="file")
        if state.down_requested and (committed is not None or not session.cluster.train.checkpoint_every):
            where = f"at the checkpoint of step {committed}" if committed is not None else "(checkpoints are off)"
            return Outcome(down=True, message=f"stopped by `hetlaunch down` {where}: {state.down_requested}")
        failures = dict(new_failures())
        lost = session.lost_nodes(finished)
        for node, why in lost.items():
            if node not in in_plan:  # a spare the plan did not use: note it, carry on
                session.declare_lost(node, why)
                events.write("lost", node=node, why=why, in_plan=False)
        lost = {n: why for n, why in lost.items() if n in in_plan}
        if failures:
            lost, message = session.diagnose(failures, "stage", finished, new_failures)
            blamed = {node for node in lost if node in failures and node not in died}
            if any(not is_peer_error(failures[node]) for node in blamed):
                # The stage reported an error of its own (a bad model, a bad range): it would happen again.
                raise JobError(message)
            # Only connection errors and nobody gone: a network hiccup. Run again, on the same nodes.
            return Outcome(lost={n: why for n, why in lost.items() if n not in blamed}, message=message,
                           failed=set(failures), aggregator=aggregator)
        if lost:
            node, why = next(iter(lost.items()))
            return Outcome(lost=lost, message=f"lost node {node}: {why}", aggregator=aggregator)
        while not state.joins.empty():
            node = state.joins.get_nowait()
            session.rejoined(node)
            events.write("join", node=node, step=len(record.records))
            joined.append(node)
        watch = observers.stragglers if observers is not None else None
        stuck = _live_move(session, running, watch, observers, events, steps, boundary_bytes)
        if stuck is not None:
            return Outcome(message=stuck, aggregator=aggregator)
        if committed is not None and committed < steps:
            switch = _switch(running, watch, joined, committed, events)
            if switch is not None:
                return switch
        if len(finished) == len(in_plan):
            if len(record.records) >= steps:
                return Outcome(finished=True)
            if not state.steps_pending():
                raise JobError(f"stages finished but only {len(record.records)} of {steps} steps reported")
        time.sleep(0)


def _switch(running: _Running, watch, joined: list[str], committed: int, events: EventLog) -> Outcome | None:
    """At a committed checkpoint: the switch to the plan a rebalance asked for, or to one with
    the nodes that joined when it is predicted enough faster; None to train on."""
    if watch is not None and watch.pending is not None and watch.pending.mode == "restart":
        change = watch.take()
        events.write("rebalance", step=committed, why=change.why,
                     predicted_tokens_per_s=change.target.predicted_tokens_per_s, **_undo(change))
        return Outcome(grow=change.target, message=_switching(change))
    if not joined or running.replanner is None:
        return None
    better = running.replanner.join(running.current.plan)
    joined.clear()
    if better is None:
        return None
    if watch is not None:
        watch.joining(better, "node(s) joined", committed)
    return Outcome(grow=better, message=f"node(s) joined; switching to a plan predicted at "
                                        f"{better.predicted_tokens_per_s:,.0f} tokens/s")


def _switching(change: Change) -> str:
    if change.undo:
        return f"{change.why}; switching back to the plan it replaced"
    return f"{change.why}; switching to a plan predicted at {change.target.predicted_tokens_per_s:,.0f} tokens/s"


def _undo(change: Change) -> dict:
    return {"undo": True} if change.undo else {}


def _live_move(session: ClusterSession, running: _Running, watch, observers: Observers | None, events: EventLog,
               steps: int, boundary_bytes: list[int] | None) -> str | None:
    """Start a live move the straggler watch asked for, or follow the one under way; a message if it is stuck."""
    if running.move is None:
        if watch is None or watch.pending is None or watch.pending.mode != "live":
            return None
        change = watch.take()
        running.moves += 1
        running.move = LiveMove(session, running.current.plan, change.target, running.moves, steps, boundary_bytes)
        events.write("rebalance", mode="live", step=change.step, why=change.why,
                     predicted_tokens_per_s=change.target.predicted_tokens_per_s, **_undo(change))
        running.progress.rebalancing(f"{change.why}; moving the layers back" if change.undo else
                                     f"{change.why}; moving layers live to a cut predicted at "
                                     f"{change.target.predicted_tokens_per_s:,.0f} tokens/s")
        return None
    status = running.move.poll(session.state.moves())
    if status is None:
        return None
    move, running.move = running.move, None
    if status == "moved":
        running.current.moved(move.target)
        observers.moved(move.at_step)
        events.write("move", **move.summary())
    elif status == "cancelled":
        if watch is not None:
            watch.move_cancelled()
        events.write("move_cancelled", id=move.id, why=move.why_cancelled)
    else:
        return f"the live move before step {move.at_step} did not finish in time"
    return None
