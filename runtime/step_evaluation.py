"""When a stage evaluates the held-out loss: after the step, or in the next step's bubbles.

`train.eval_every` asks for the held-out loss after every so many steps (and after the last).
Evaluated after the step, the forwards go through the pipeline while training stops. With an
evaluation fill (`StageSpec.eval_fill`: this stage's actions with E's in its idle time, placed by
the coordinator from the plan's simulation; runtime/bubble_fill.py) the evaluation due after step
n runs instead inside step n + 1: its weights are still step n's until that step's optimizer
update, so the loss is the same number. The last stage reports step n at once, marked
`eval_follows`, and sends the loss in a report of its own for step n (`eval_only`) when step
n + 1 has measured it: a failure in step n + 1 then loses at most that held-out loss, never step
n's training loss (it once did: the report was held until the loss came). After a restore whose
first step is n + 1 the coordinator asks for the loss again (`TrainSpec.eval_before_start`), and
the first step measures it in its bubbles as it would have.

Every stage decides the same way from the same inputs (the training spec and the step), so the
stages agree on which steps carry E's. Evaluation still runs after the step where nothing follows
to hide it in: after the last step, before a checkpoint (the report of a checkpointed step is not
held), and before a live move (the layers change).
"""

from __future__ import annotations

from typing import Callable

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.actions import E, Action, parse_actions, validate_actions
from hetlaunch.runtime.data import TokenBatches
from hetlaunch.runtime.executor import StageExecutor


def eval_due(train: pb.TrainSpec, done: int) -> bool:
    """The held-out loss every eval_every steps and after the last."""
    return bool(train.eval_every) and (done % train.eval_every == 0 or done == train.steps)


class StepEvaluation:
    def __init__(self, train: pb.TrainSpec, stage: pb.StageSpec, executor: StageExecutor,
                 eval_batches: TokenBatches | None, actions: list[Action]):
        self.train, self.executor, self.actions = train, executor, actions
        self.held_out = None
        if eval_batches is not None and train.eval_every:  # the same windows every time, so the curve compares
            self.held_out = eval_batches.micro_batches(0, train.micro_batch_size, train.eval_microbatches)
        self.filled = _fill(stage, train, actions) if train.eval_every and stage.eval_fill else None
        # The step whose held-out loss this step's E's measure (None: no E's in this step).
        self.pending: int | None = None
        if train.eval_every and train.eval_before_start and train.start_step > 0:
            self.pending = train.start_step - 1

    def step_actions(self) -> tuple[list[Action], list | None]:
        """This step's actions and the held-out micro-batches its E's evaluate."""
        return (self.filled, self.held_out) if self.pending is not None else (self.actions, None)

    def before_first_step(self, report: Callable[[pb.StepMetrics], None]) -> None:
        """A loss asked for again after a restore, with no fill to measure it in: measured now."""
        if self.pending is not None and self.filled is None:
            self._deliver(self.executor.evaluate(self.held_out, self.train.eval_microbatches), report)

    def before_move(self, report: Callable[[pb.StepMetrics], None]) -> None:
        """A live move comes before this step: what was to run in its bubbles runs now, whole."""
        if self.pending is not None:
            self._deliver(self.executor.evaluate(self.held_out, self.train.eval_microbatches), report)

    def after_step(self, done: int, eval_loss: float | None, metrics: pb.StepMetrics,
                   report: Callable[[pb.StepMetrics], None]) -> None:
        """Report the step's `metrics`, with the held-out loss evaluated after it or held for the
        next step's bubbles; `eval_loss` is what this step's E's measured, for the step before."""
        if self.pending is not None:
            self._deliver(eval_loss, report)
        if not eval_due(self.train, done):
            report(metrics)
        elif self.filled is not None and done < self.train.steps and not self._checkpointed(done):
            self.pending = metrics.step
            metrics.eval_follows = self.executor.is_last
            report(metrics)
        else:
            report(_with_eval(metrics, self.executor.evaluate(self.held_out, self.train.eval_microbatches)))

    def _deliver(self, eval_loss: float | None, report: Callable[[pb.StepMetrics], None]) -> None:
        step, self.pending = self.pending, None
        if self.executor.is_last:
            report(_with_eval(pb.StepMetrics(step=step, eval_only=True), eval_loss))

    def _checkpointed(self, done: int) -> bool:
        return bool(self.train.checkpoint_dir) and self.train.checkpoint_every > 0 and \
            (done % self.train.checkpoint_every == 0 or done == self.train.steps)


def _with_eval(metrics: pb.StepMetrics, eval_loss: float | None) -> pb.StepMetrics:
    metrics.has_eval_loss, metrics.eval_loss = eval_loss is not None, eval_loss or 0.0
    return metrics


def _fill(stage: pb.StageSpec, train: pb.TrainSpec, actions: list[Action]) -> list[Action]:
    """The stage's evaluation fill, checked: the schedule's own actions in their order, plus one E
    per held-out micro-batch in held-out order."""
    try:
        filled = parse_actions(stage.eval_fill, stage.stage_index)
        validate_actions(filled, train.num_microbatches, stage.stage_index, train.eval_microbatches)
    except ValueError as err:
        raise ValueError(f"stage {stage.stage_index}'s evaluation fill is not a schedule: {err}") from None
    training = [a for a in filled if a.kind is not E]
    evals = [a.microbatch for a in filled if a.kind is E]
    if training != actions or evals != list(range(train.eval_microbatches)):
        raise ValueError(f"stage {stage.stage_index}'s evaluation fill does not hold this step's schedule "
                         f"and one evaluation of each of the {train.eval_microbatches} held-out micro-batches "
                         f"in order")
    return filled
