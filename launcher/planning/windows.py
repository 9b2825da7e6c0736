"""1F1B windows from the simulator: how many micro-batches each stage keeps in flight.

Stage j of 1F1B keeps own_j = min(S - j, M) micro-batches in flight; a deeper window w_j runs
more warm-up forwards, so more micro-batches are on their way over a slow or distant link
while the first gradient comes back, paid for in activation memory. The vectors the executor
can run without deadlock are exactly those that never grow down the pipeline: stage j + 1
cannot start its first backward before stage j has sent it w_{j+1} forwards, and stage j sends
no more than w_j before that backward comes back, so w_{j+1} <= w_j. The last stage turns
each forward straight into its backward: deeper only waits longer, so it keeps its own.

Which of those vectors is fastest is the simulator's answer, not a shape's: equal windows on
neighbours cost a round trip per micro-batch where windows that decrease by one per stage
keep the link busy. The search prices, exactly:

* every admissible vector when there are at most EXHAUSTIVE_VECTORS (small chains);
* else a few families — as deep as memory allows, the same decreasing by one per stage, and
  "just enough" windows (each stage's round trip to the end and back over the pipeline's
  busiest resource, at a few slacks) — then a descent that moves one stage's window up or
  down while it pays, within a budget of simulations.

A deeper vector is kept only when it buys WINDOW_GAIN of the step: memory is not free.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

EXHAUSTIVE_VECTORS = 64  # admissible window vectors up to which every one is priced
DESCENT_BUDGET = 48  # simulations the descent may spend past the families
WINDOW_GAIN = 0.005  # a deeper vector must shorten the step by at least this share
THOROUGH_MAX_ACTIONS = 256  # stages x micro-batches up to which a search prices windows in full by default
QUICK_FAMILIES = 5  # without `thorough`: own, deepest, decreasing, just enough at the first slack (+1)
SLACKS = (1.0, 1.25, 1.5, 2.0)  # "just enough" windows: round trip x slack / busiest resource


def admissible_count(own: list[int], caps: list[int]) -> int:
    """How many non-increasing vectors with own_j <= w_j <= caps_j (the last stage at its own)."""
    S = len(own)
    ways = {own[-1]: 1}  # window of stage j -> vectors of stages j..S-1 starting with it
    for j in range(S - 2, -1, -1):
        below, counted, upto = sorted(ways), 0, 0  # running sum of the ways of windows <= w
        deeper = {}
        for w in range(own[j], caps[j] + 1):
            while counted < len(below) and below[counted] <= w:
                upto += ways[below[counted]]
                counted += 1
            if upto:
                deeper[w] = upto
        ways = deeper
        if sum(ways.values()) > 10 * EXHAUSTIVE_VECTORS:
            return sum(ways.values())  # enough to know it is too many
    return sum(ways.values())


def admissible(own: list[int], caps: list[int]) -> Iterator[tuple[int, ...]]:
    """Every non-increasing vector with own_j <= w_j <= caps_j, the last stage at its own."""
    S = len(own)

    def grow(j: int, above: int, prefix: tuple[int, ...]):
        if j == S - 1:
            if own[j] <= above:
                yield prefix + (own[j],)
            return
        for w in range(own[j], min(caps[j], above) + 1):
            yield from grow(j + 1, w, prefix + (w,))

    yield from grow(0, caps[0], ())


def _clamped(target: list[float], own: list[int], caps: list[int]) -> tuple[int, ...]:
    """target rounded up into [own_j, caps_j] and made non-increasing (each stage at most the one
    before; own_j never grows down the pipeline, so the floor keeps the order)."""
    # max/min written out as comparisons (the same integers): the search clamps some ten vectors
    # per cut it deepens, and the builtins' calls were most of the time.
    last, out, above = len(target) - 1, [], None
    for j, t in enumerate(target):
        floor = own[j]
        if j == last:
            w = floor
        else:
            w = math.ceil(t - 1e-9)
            if w > caps[j]:
                w = caps[j]
            if w < floor:
                w = floor
        if above is not None:
            if w > above:
                w = above
            if w < floor:
                w = floor
        out.append(w)
        above = w
    return tuple(out)


def families(own: list[int], caps: list[int], round_trip: list[float], busiest: float) -> list[tuple[int, ...]]:
    """The shaped candidates: deepest, deepest decreasing by one per stage, and just-enough windows."""
    S = len(own)
    found = [tuple(own), _clamped([float(c) for c in caps], own, caps),
             _clamped([caps[0] - j for j in range(S)], own, caps)]
    if busiest > 0:
        for slack in SLACKS:
            found.append(_clamped([slack * rt / busiest for rt in round_trip], own, caps))
            found.append(_clamped([slack * rt / busiest + 1 for rt in round_trip], own, caps))
    return list(dict.fromkeys(found))


class _AtFloor(Exception):
    """A vector priced at the floor: no other can be faster, the search stops."""


def best_windows(own: list[int], caps: list[int], round_trip: list[float], busiest: float,
                 price: Callable[[tuple[int, ...]], float], thorough: bool = True,
                 floor: float = 0.0) -> tuple[tuple[int, ...], float]:
    """The fastest admissible vector by `price` (the event simulation) and its step; own windows
    unless a deeper vector buys WINDOW_GAIN. `thorough` adds the exhaustive pass or the descent;
    without it only the families are priced (the search's inner loop, over many cuts). `floor`:
    a step no vector can beat (launcher/planning/sim_floor.py); the search stops at a vector that
    reaches it."""
    seen: dict[tuple[int, ...], float] = {}

    def step(vector: tuple[int, ...]) -> float:
        if vector not in seen:
            seen[vector] = price(vector)
            if seen[vector] <= floor * (1 + 1e-12):
                raise _AtFloor
        return seen[vector]

    base = tuple(own)
    try:
        step(base)
        exhaustive = thorough and admissible_count(own, caps) <= EXHAUSTIVE_VECTORS
        shaped = families(own, caps, round_trip, busiest)
        for vector in admissible(own, caps) if exhaustive else shaped if thorough else shaped[:QUICK_FAMILIES]:
            step(vector)
        if thorough and not exhaustive:
            _descend(own, caps, seen, step, len(seen) + DESCENT_BUDGET)
    except _AtFloor:
        pass
    plain = seen[base]
    best = min(seen, key=lambda v: (seen[v], sum(v)))
    if seen[best] >= plain * (1 - WINDOW_GAIN):
        return base, plain
    return best, seen[best]


def _descend(own: list[int], caps: list[int], seen: dict, step: Callable, budget: int) -> None:
    """From the best vector so far, move one stage's window by ±1 or ±a quarter of its range
    while that shortens the step and keeps the vector admissible."""
    S = len(own)
    current = min(seen, key=lambda v: (seen[v], sum(v)))
    improved = True
    while improved and len(seen) < budget:
        improved = False
        for j in range(S - 1):
            span = max(1, (caps[j] - own[j]) // 4)
            for delta in (1, -1, span, -span):
                w = current[j] + delta
                above = current[j - 1] if j else caps[0]
                below = current[j + 1]
                if not (max(own[j], below) <= w <= min(caps[j], above)):
                    continue
                trial = current[:j] + (w,) + current[j + 1:]
                if trial in seen:
                    continue
                if len(seen) >= budget:
                    return
                if step(trial) < seen[current] * (1 - 1e-12):
                    current, improved = trial, True
                    break
