"""Every change of plan checked on the steps after it, and undone when it did not pay.

A change (layers moved live, or a switch to another plan at a checkpoint) is made because a
prediction says it pays. Whether it did is measured on the step reports the coordinator
already gets: the last CHECK_STEPS steps the old plan ran before the change against as many
of the new plan's after it. The step a change lands on is left out (it carries the move's
transfers, or the new generation's start-up), and so is every generation's first step (its
warm-up). Medians, so that one slow step decides nothing. The change paid when the new plan's
median tokens/s is at least MIN_GAIN above the old plan's; if not, it is undone (the layers
moved back, or the old plan restored at the next checkpoint) and the same change, from that
plan to that one, is not made again for COOLDOWN_STEPS steps. An undo is not checked itself:
it goes back to a plan that was measured to run better.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, replace

from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.run_record import StepRecord

# Steps measured on each side of a change. Under twice the straggler watch's K (5): most of the
# steps before a change are the ones that prompted it, not the ones before the slowdown.
CHECK_STEPS = 8
MIN_GAIN = 0.01  # a change pays when the median tokens/s after it is at least this much higher
COOLDOWN_STEPS = 50  # an undone change is not made again for this many steps


@dataclass(frozen=True)
class Change:
    """A change of the running plan, and what the straggler watch expects of each plan's nodes."""

    mode: str  # "live": layers move in the running stages; "restart": the target runs from a checkpoint
    previous: Plan
    target: Plan
    why: str
    step: int  # the step it was decided at
    target_factors: dict[str, float] | None = None  # measured ÷ predicted compute of the target's nodes (None: not watched)
    previous_factors: dict[str, float] | None = None  # ... of the previous plan's, when it was watched
    undo: bool = False  # this change takes back one that did not pay

    def undone(self, why: str, step: int) -> Change:
        """The change back to the previous plan."""
        return replace(self, previous=self.target, target=self.previous, why=why, step=step,
                       target_factors=self.previous_factors, previous_factors=self.target_factors, undo=True)


@dataclass(frozen=True)
class Verdict:
    paid: bool
    before_tokens_per_s: float  # medians
    after_tokens_per_s: float
    before_steps: tuple[int, ...]
    after_steps: tuple[int, ...]

    @property
    def gain(self) -> float:
        return self.after_tokens_per_s / self.before_tokens_per_s - 1 if self.before_tokens_per_s > 0 else float("inf")

    def figures(self) -> dict:
        """For events.jsonl."""
        return {"before_tokens_per_s": round(self.before_tokens_per_s, 3),
                "after_tokens_per_s": round(self.after_tokens_per_s, 3), "gain": round(self.gain, 5),
                "before_steps": list(self.before_steps), "after_steps": list(self.after_steps)}


def judge(before: list[StepRecord], after: list[StepRecord], min_gain: float = MIN_GAIN) -> Verdict:
    """Did the steps `after` a change run at least `min_gain` more tokens/s than those `before` it (medians)?"""
    was = statistics.median(r.tokens_per_s for r in before)
    now = statistics.median(r.tokens_per_s for r in after)
    return Verdict(paid=now >= (1 + min_gain) * was, before_tokens_per_s=was, after_tokens_per_s=now,
                   before_steps=tuple(r.step for r in before), after_steps=tuple(r.step for r in after))


def shape(plan: Plan) -> tuple:
    """What makes two plans the same change: nodes, places, cuts, codecs, windows and shares."""
    return (tuple((s.node, s.pipeline, s.layer_start, s.layer_end, s.forward_codec, s.window) for s in plan.stages),
            plan.pipeline_microbatches, plan.micro_batch_size)


class Review:
    """The change under check: fed every step report, it answers a verdict once enough steps ran."""

    def __init__(self, steps: int = CHECK_STEPS, min_gain: float = MIN_GAIN, cooldown: int = COOLDOWN_STEPS):
        self.steps, self.min_gain, self.cooldown = steps, min_gain, cooldown
        self.change: Change | None = None  # the change being checked
        self._recent: deque[StepRecord] = deque(maxlen=2 * steps + 2)  # the last steps, a landing's on both sides
        self._first_step: int | None = None  # the running generation's first step (warm-up)
        self._at_step = 0  # the step the change landed on
        self._before: list[StepRecord] = []
        self._after: list[StepRecord] = []
        self._refused: dict[tuple, int] = {}  # (from, to) shapes -> the first step it may be made again

    @property
    def checking(self) -> bool:
        return self.change is not None

    def new_generation(self, first_step: int) -> None:
        """A generation is launched at `first_step`: the steps before it that were run again do not
        count, nor does its first (warm-up)."""
        self._first_step = first_step
        self._recent = deque((r for r in self._recent if r.step < first_step), maxlen=self._recent.maxlen)

    def landed(self, change: Change, at_step: int) -> None:
        """`change` runs from `at_step` on; check it against the steps before (an undo is not checked)."""
        if change.undo:
            self.cancel()
            return
        before = [r for r in self._recent if r.step < at_step][-self.steps:]
        if not before:
            return  # nothing measured to compare with
        # A live move lands in the running generation: its steps reported before the landing was
        # are already the target's. A restart's new generation has reported none yet.
        self._after = [r for r in self._recent if r.step > at_step] if change.mode == "live" else []
        self.change, self._at_step, self._before = change, at_step, before

    def cancel(self) -> None:
        """The plan changed for another reason (a lost node): nothing to check any more."""
        self.change, self._before, self._after = None, [], []

    def add(self, record: StepRecord) -> tuple[Change, Verdict] | None:
        """Count a step; the change under check and its verdict, once as many steps ran after it as before."""
        if record.step == self._first_step:
            return None
        self._recent.append(record)
        if self.change is None or record.step <= self._at_step:
            return None
        self._after.append(record)
        if len(self._after) < len(self._before):
            return None
        change, verdict = self.change, judge(self._before, self._after[:len(self._before)], self.min_gain)
        self.cancel()
        return change, verdict

    def refuse(self, change: Change, step: int) -> int:
        """`change` did not pay: it is not made again before the step returned."""
        until = step + self.cooldown
        self._refused[(shape(change.previous), shape(change.target))] = until
        return until

    def refused(self, current: Plan, target: Plan, step: int) -> bool:
        """Was the change from `current` to `target` undone less than the cool-down ago?"""
        return step < self._refused.get((shape(current), shape(target)), -1)
