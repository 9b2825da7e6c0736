"""Typed pipeline actions: which stage does what to which micro-batch.

An action is ``Action(stage_index, kind, microbatch)``, in the style of torch pipelining's
``_Action(stage_index, computation_type, microbatch_index)``. The stage index is the stage's
position in its pipeline, not a node or a rank: a node that later holds two stages runs the
actions of two stage indices, and nothing here changes for it.

The kinds split a backward the way zero-bubble schedules need it:

* ``F`` forward: needs the previous stage's activation of that micro-batch;
* ``B`` full backward: the gradient of the stage's input and of its weights at once;
* ``I`` input gradient only: what the previous stage waits for, so it goes first;
* ``W`` weight gradients, deferred: they need only this stage's own ``I``, so a schedule can
  place them in what would otherwise be a bubble.
* ``E`` an evaluation forward of held-out micro-batch ``m`` (its own numbering): forward only,
  nothing kept for a backward, placed in the step's idle time (runtime/bubble_fill.py). It needs
  the previous stage's ``E`` of the same micro-batch and nothing of training.

A ``B`` is an ``I`` and a ``W`` run back to back. Each micro-batch of a stage is forwarded once
and then either backwarded once (``B``) or input-gradient'ed and weight-gradient'ed once each
(``I`` then ``W``), and each held-out micro-batch evaluated at most once; `validate_actions`
refuses anything else.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple


class Kind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    INPUT_GRAD = "I"
    WEIGHT_GRAD = "W"
    EVAL = "E"


F, B, I, W, E = Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD, Kind.EVAL


class Action(NamedTuple):
    """One thing a stage does in a step. A named tuple (as torch's): schedules hash and compare
    thousands of these when they are built and checked."""

    stage_index: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:  # torch's spelling: "1F3" is stage 1's forward of micro-batch 3
        return f"{self.stage_index}{self.kind.value}{self.microbatch}"

    __repr__ = __str__

    @property
    def label(self) -> str:
        """The action without its stage ("F3"), for messages that name the stage in words."""
        return f"{self.kind.value}{self.microbatch}"


def parse_actions(text: str, stage_index: int) -> list[Action]:
    """One stage's actions from ``"F0 F1 B0 I1 W1"``: how tests and people write a schedule by hand."""
    try:
        return [Action(stage_index, Kind(token[0]), int(token[1:])) for token in text.split()]
    except (ValueError, IndexError):
        raise ValueError(f"cannot read actions {text!r}: each is a kind (F, B, I, W, E) and a micro-batch, "
                         f"e.g. F0 B0") from None


_DEVICE_TOKEN = re.compile(r"(\d+)([FBIWE])(\d+)")


def parse_device_actions(text: str) -> list[Action]:
    """A device's actions from ``"0F0 3F0 3I0"``: stage index, kind, micro-batch, as Action prints them
    (a node holding several stages; runtime/device_schedules.py)."""
    actions = []
    for token in text.split():
        match = _DEVICE_TOKEN.fullmatch(token)
        if match is None:
            raise ValueError(f"cannot read action {token[:40]!r}: a stage index, a kind (F, B, I, W, E) and a "
                             f"micro-batch, e.g. 3F0")
        actions.append(Action(int(match[1]), Kind(match[2]), int(match[3])))
    return actions


def validate_actions(actions: list[Action], num_microbatches: int, stage_index: int | None = None,
                     num_eval: int = 0) -> None:
    """Raise ValueError unless each micro-batch is forwarded once and then either backwarded once
    (B) or given its input gradient (I) and then its weight gradients (W) once each, and each of
    `num_eval` held-out micro-batches is evaluated (E) once or never; with `stage_index`, unless
    every action is that stage's."""
    seen: set[Action] = set()
    for pos, a in enumerate(actions):
        s, m = a.stage_index, a.microbatch
        if stage_index is not None and s != stage_index:
            raise ValueError(f"action {a} at position {pos} belongs to stage {s}, not stage {stage_index}")
        if a.kind is E:
            if not 0 <= m < num_eval or a in seen:
                raise ValueError(f"action {a} at position {pos}: an evaluation of a held-out micro-batch outside "
                                 f"[0, {num_eval}) or evaluated twice")
            seen.add(a)
            continue
        if not 0 <= m < num_microbatches:
            raise ValueError(f"action {a} at position {pos}: micro-batch outside [0, {num_microbatches})")
        if a in seen:
            raise ValueError(f"action {a} at position {pos} appears twice")
        if a.kind is not F and Action(s, F, m) not in seen:
            raise ValueError(f"action {a} at position {pos} comes before its forward")
        if a.kind is W and Action(s, I, m) not in seen:
            raise ValueError(f"action {a} at position {pos} comes before its input gradient {Action(s, I, m)}")
        if a.kind is B and (Action(s, I, m) in seen or Action(s, W, m) in seen) or \
                a.kind in (I, W) and Action(s, B, m) in seen:
            raise ValueError(f"action {a} at position {pos}: micro-batch {m} has both a B and an I or W "
                             f"(a B is I and W at once)")
        seen.add(a)
    stages = {a.stage_index for a in actions} or {0 if stage_index is None else stage_index}
    missing = []
    for s in sorted(stages):
        for m in range(num_microbatches):
            missing += [Action(s, F, m)] if Action(s, F, m) not in seen else []
            if Action(s, I, m) in seen:
                missing += [Action(s, W, m)] if Action(s, W, m) not in seen else []
            elif Action(s, B, m) not in seen:
                missing.append(Action(s, B, m))
    if missing:
        raise ValueError(f"schedule is missing actions: {' '.join(map(str, missing))}")


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose activations a stage holds at once: from the forward until the
    weight gradients (B or W). An I frees only part of them (what the input gradient alone
    needed), so a micro-batch between its I and its W counts as held: an upper bound."""
    live = peak = 0
    for a in actions:
        if a.kind is F:
            live += 1
            peak = max(peak, live)
        elif a.kind is B or a.kind is W:  # an I frees part; an E keeps nothing
            live -= 1
    return peak
