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

from rich.text import Text

from hetlaunch.launcher.checkpoint_book import CheckpointBook
from hetlaunch.launcher.coordinator_state import DEFAULT_DOWN_REASON
from hetlaunch.launcher.events import EventLog
from hetlaunch.launcher.adapt.current_plan import CurrentPlan
from hetlaunch.launcher.adapt.live_moves import LiveMove
from hetlaunch.launcher.adapt.payoff import Change
from hetlaunch.launcher.adapt.replanner import Replanner
from hetlaunch.launcher.observers import Observers
from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.planning.topology import node_workers
from hetlaunch.launcher.progress import TrainingProgress
from hetlaunch.launcher.run_record import RunRecord
from hetlaunch.launcher.step_aggregator import StepAggregator
from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.session import ClusterSession, is_peer_error, lost_message, parse_refusal


CATCH_UP_S = 30.0  # how long a generation ending at a checkpoint waits for the reports of the steps before it


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
    """One loop over what the generation reports, in the order a decision needs it: steps, committed
    checkpoints, `down`, losses, joins, a live move, a switch at a checkpoint, the end."""
    gen = _Reports(session, running.current.plan, record, events)
    steps = session.cluster.train.steps
    watch = observers.stragglers if observers is not None else None
    while True:
        gen.take_step(progress, observers)
        committed = gen.take_checkpoints(book, progress, observers)
        if session.state.down_requested and (committed is not None or not session.cluster.train.checkpoint_every):
            where = f"at the checkpoint of step {committed}" if committed is not None else "(checkpoints are off)"
            if committed is not None:
                gen.catch_up(committed, progress, observers)
            why = session.state.down_requested
            return Outcome(down=True, message=f"stopped by `hetlaunch down` {where}"
                                              + (f": {why}" if why != DEFAULT_DOWN_REASON else ""))
        ended = gen.losses(progress)
        if ended is not None:
            return ended
        gen.take_joins()
        stuck = _live_move(session, running, watch, observers, events, steps, boundary_bytes)
        if stuck is not None:
            return Outcome(message=stuck, aggregator=gen.aggregator)
        if committed is not None and committed < steps:
            switch = _switch(running, watch, gen.joined, committed, events)
            if switch is not None:
                gen.catch_up(committed, progress, observers)
                return switch
        if len(gen.finished) == len(gen.in_plan):
            if record.accounted() >= steps:
                return Outcome(finished=True)
            if not session.state.steps_pending():
                raise JobError(f"stages finished but only {record.accounted()} of {steps} steps reported")
        time.sleep(0)


class _Reports:
    """What one generation's stages have reported so far: steps joined into records, finished and
    failed stages, joins."""

    def __init__(self, session: ClusterSession, plan: Plan, record: RunRecord, events: EventLog):
        self.session, self.state, self.record, self.events = session, session.state, record, events
        self.aggregator = StepAggregator(plan, carried=record.awaiting_eval)
        # Results arrive per node: a finished generation is one result from each of the plan's nodes.
        self.in_plan = node_workers(plan, "following a generation (a stage's result names its node)")
        self.finished: set[str] = set()
        self.died: set[str] = set()  # stages whose worker died without reporting (recoverable, unlike an error)
        self.joined: list[str] = []
        self.first = True

    def take_step(self, progress: TrainingProgress, observers: Observers | None) -> None:
        """One step report (waiting briefly for it); a record once every stage reported its step."""
        received = self.state.next_step(timeout=0.2)
        if received is None:
            return
        if observers is not None and received[1].trace:
            observers.trace(*received)
        step_record = self.aggregator.add(*received)
        if step_record is None:
            return
        if self.first:  # when the generation is really running again (recovery time ends here)
            self.events.write("first_step", generation=self.state.generation, step=step_record.step)
            self.first = False
        self.record.add(step_record)
        progress.update(step_record)
        outer = step_record.islands["outer"] if step_record.islands else None
        if outer is not None and (outer["launched"] or outer["applied"]):
            self.events.write("outer_step", step=step_record.step, launched=outer["launched"], applied=outer["applied"],
                              wire_bytes=outer["bytes"][1], blocked_s=outer["blocked_s"])
        event = observers.step(step_record, self.state.generation) if observers is not None else None
        if event is not None:
            self.events.write(event[0], **event[1])
            if "planner_error" in event[1]:  # said once (the replanner keeps only the first)
                progress.console.print(Text(event[1]["planner_error"]))

    def catch_up(self, step: int, progress: TrainingProgress, observers: Observers | None,
                 timeout_s: float = CATCH_UP_S) -> None:
        """Take step reports until every step before `step` is recorded (or timeout_s passed): a
        checkpoint's parts can arrive before the reports of the steps it follows, which travel on
        their own thread, and a generation that ends at that checkpoint must not leave them out."""
        deadline = time.monotonic() + timeout_s
        while self.record.next_step < step and time.monotonic() < deadline:
            self.take_step(progress, observers)

    def take_checkpoints(self, book: CheckpointBook, progress: TrainingProgress,
                         observers: Observers | None) -> int | None:
        """The step of a checkpoint the parts reported since the last call committed, if any."""
        committed = None
        for node, part in self.state.checkpoints():
            if part.error:
                # A part that could not be written ends the run (CheckpointBook.add): the steps
                # before it are recorded first. Its node sent their reports ahead of the part, but
                # another stage's may still be on their way, and a step is recorded once every stage
                # reported it (under load, a run that failed at step 5's checkpoint recorded fewer).
                self.catch_up(part.step, progress, observers)
            committed = book.add(node, part) or committed
        if committed is not None:
            self.events.write("checkpoint", step=committed, directory=str(book.latest[1]), source="file")
        return committed

    def new_failures(self) -> list[tuple[str, str]]:
        failed = []
        for node, result in self.state.results():
            if result.ok:
                self.finished.add(node)
            else:
                failed.append((node, result.error))
                if result.worker_died:
                    self.died.add(node)
        return failed

    def losses(self, progress: TrainingProgress) -> Outcome | None:
        """How the generation ends if a stage failed or a node of the plan was lost; None: it goes on."""
        failures = dict(self.new_failures())
        lost = self.session.lost_nodes(self.finished)
        for node, why in lost.items():
            if node not in self.in_plan:  # a spare the plan did not use: say so, carry on
                self.session.declare_lost(node, why)
                self.events.write("lost", node=node, why=why, in_plan=False)
                progress.console.print(Text(f"lost node {node}, which the plan does not use ({why}): "
                                            "training goes on without it"))
        lost = {n: why for n, why in lost.items() if n in self.in_plan}
        if failures:
            self._refuse_tampered_links(failures)
            lost, message = self.session.diagnose(failures, "stage", self.finished, self.new_failures)
            blamed = {node for node in lost if node in failures and node not in self.died}
            if any(not is_peer_error(failures[node]) for node in blamed):
                # The stage reported an error of its own (a bad model, a bad range): it would happen again.
                raise JobError(message)
            # Only connection errors and nobody gone: a network hiccup. Run again, on the same nodes.
            return Outcome(lost={n: why for n, why in lost.items() if n not in blamed}, message=message,
                           failed=set(failures), aggregator=self.aggregator)
        if lost:
            return Outcome(lost=lost, message=lost_message(lost), aggregator=self.aggregator)
        return None

    def _refuse_tampered_links(self, failures: dict[str, str]) -> None:
        """A stage that refused a sealed message found the link at fault, not a node: restarting on
        the same link would meet the same tampering, so the job ends naming it (the run's
        checkpoints stand; `up --resume` continues once the path is trusted again)."""
        for node, error in failures.items():
            refusal = parse_refusal(error)
            if refusal is None:
                continue
            sender, receiver = refusal
            line = error.strip().splitlines()[0]  # whole: the reason is at its end
            self.events.write("link_fault", nodes=[sender, receiver], reporter=node, why=line)
            raise JobError(f"the link from node {sender} to node {receiver} is at fault, not restarting on it: {line}")

    def take_joins(self) -> None:
        while not self.state.joins.empty():
            node = self.state.joins.get_nowait()
            self.session.rejoined(node)
            self.events.write("join", node=node, step=len(self.record.records))
            self.joined.append(node)


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
