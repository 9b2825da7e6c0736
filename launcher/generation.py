"""Follow one generation (a plan, its data-plane group, the checkpoint it started from) to its end.

It ends in one of three ways: every stage finished every step; a node was lost (its agent
or worker died, its heartbeats stopped, or its stage failed for a reason of its own — the
neighbours' "connection closed" errors are consequences, not causes); or a node (re)joined
or a straggler was found and a new plan is predicted to be enough faster, at a committed
checkpoint. A straggler may instead be answered within the generation by a live move of
layers (launcher/live_move.py): the plan changes, the workers and the generation do not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from hetlaunch.launcher.checkpoint_book import CheckpointBook
from hetlaunch.launcher.events import EventLog
from hetlaunch.launcher.live_move import LiveMove
from hetlaunch.launcher.observers import Observers
from hetlaunch.launcher.planning.plan import Plan
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
    plan: Plan | None = None  # the plan running at the end (live moves change it within a generation)


def follow(session: ClusterSession, plan: Plan, record: RunRecord, book: CheckpointBook, events: EventLog,
           progress: TrainingProgress, consider_join: Callable[[str], Plan | None],
           observers: Observers | None = None, boundary_bytes: list[int] | None = None) -> Outcome:
    running = _Running(plan)
    outcome = _follow(session, running, record, book, events, progress, consider_join, observers, boundary_bytes)
    outcome.plan = running.plan
    return outcome


@dataclass
class _Running:
    plan: Plan
    move: LiveMove | None = None
    moves: int = 0


def _follow(session: ClusterSession, running: _Running, record: RunRecord, book: CheckpointBook, events: EventLog,
            progress: TrainingProgress, consider_join: Callable[[str], Plan | None],
            observers: Observers | None, boundary_bytes: list[int] | None) -> Outcome:
    plan = running.plan
    state = session.state
    steps = session.cluster.train.steps
    aggregator = StepAggregator(plan)
    in_plan = {s.node for s in plan.stages}
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
                observers.trace(*received, running.plan)
            step_record = aggregator.add(*received)
            if step_record is not None:
                if first:  # when the generation is really running again (recovery time ends here)
                    events.write("first_step", generation=state.generation, step=step_record.step)
                    first = False
                record.add(step_record)
                progress.update(step_record)
                found = observers.step(step_record, state.generation) if observers is not None else None
                if found is not None:
                    events.write("straggler", **found)
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
        if watch is not None and watch.pending is not None and committed is not None and committed < steps:
            better, slow = watch.take(), watch.found[-1]
            events.write("rebalance", step=committed, why=slow["what"], predicted_tokens_per_s=better.predicted_tokens_per_s)
            return Outcome(grow=better, message=f"{slow['what']}; switching to a plan predicted at "
                                                f"{better.predicted_tokens_per_s:,.0f} tokens/s")
        if joined and committed is not None and committed < steps:
            better = consider_join(joined[-1])
            joined.clear()
            if better is not None:
                return Outcome(grow=better, message=f"node(s) joined; switching to a plan predicted at "
                                                    f"{better.predicted_tokens_per_s:,.0f} tokens/s")
        if len(finished) == len(plan.stages):
            if len(record.records) >= steps:
                return Outcome(finished=True)
            if not state.steps_pending():
                raise JobError(f"stages finished but only {len(record.records)} of {steps} steps reported")
        time.sleep(0)


def _live_move(session: ClusterSession, running: _Running, watch, observers: Observers | None, events: EventLog,
               steps: int, boundary_bytes: list[int] | None) -> str | None:
    """Start a live move the straggler watch asked for, or follow the one under way; a message if it is stuck."""
    if running.move is None:
        if watch is None or watch.pending_live is None:
            return None
        target, slow = watch.take_live(), watch.found[-1]
        running.moves += 1
        running.move = LiveMove(session, running.plan, target, running.moves, steps, boundary_bytes)
        events.write("rebalance", mode="live", step=slow["step"], why=slow["what"],
                     predicted_tokens_per_s=target.predicted_tokens_per_s)
        return None
    status = running.move.poll(session.state.moves())
    if status is None:
        return None
    move, running.move = running.move, None
    if status == "moved":
        running.plan = move.target
        observers.moved(move.target)
        events.write("move", **move.summary())
    elif status == "cancelled":
        if watch is not None:
            watch.move_cancelled()
        events.write("move_cancelled", id=move.id, why=move.why_cancelled)
    else:
        return f"the live move before step {move.at_step} did not finish in time"
    return None
