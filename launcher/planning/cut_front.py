"""One state of the cut dynamic program under 1F1B (launcher/planning/chain_cuts.py): its points
from a stage's candidate ends, each outgoing codec and each point of the following state's front,
kept where no other point is as good on both (the step's one bottleneck term, the round trip).

`one_bottleneck_front` and `suffix_fronts` (every state of one suffix of stages at once, its rows
built in C too) are launcher/planning/_cutfront.c's where that extension was built (the same
arithmetic and tie-breaking, so the same plans: tests/planning/test_cut_front.py), else the
Python loops below.
"""

from __future__ import annotations

import bisect
import math


def state_points(rows: list[tuple], crossings: list[list]) -> list[tuple]:
    """Every point of a state before the front is taken. rows: [(end, the stage's compute, the
    following state's front, window)], window what the row's window term divides by (0: no window
    term, GPipe); crossings: per codec, a list indexed by end of (link, latency, codec work, codec).
    Points are (compute max, link max, window max, round-trip sum, end, index in the following
    front, codec)."""
    points = []
    for end, t, following, window in rows:
        for per_end in crossings:
            c, lat, work, codec = per_end[end]
            tc = t + work
            for k, (mt, mc, w, s, *_) in enumerate(following):
                total = s + tc + 2 * (lat + c)
                points.append((max(mt, tc), max(mc, c), max(w, total / window) if window else w, total,
                               end, k, codec))
    return points


def one_bottleneck_front_python(rows: list[tuple], crossings: list[list]) -> list[tuple]:
    """The front of state_points under 1F1B (what _cutfront.c computes)."""
    return one_bottleneck_pareto(state_points(rows, crossings))


def one_bottleneck_pareto(points: list[tuple]) -> list[tuple]:
    """Under 1F1B only max(compute, link, window) matters, which makes the front two-dimensional:
    by that max, then the sum; a point is kept where its sum is below every earlier one's."""
    points.sort(key=lambda p: (max(p[0], p[1], p[2]), p[3]))
    kept, best_sum = [], math.inf
    for p in points:
        if p[3] < best_sum:
            kept.append(p)
            best_sum = p[3]
    return kept


def pareto_three_terms(points: list[tuple]) -> list[tuple]:
    """Drop every point another point beats or ties on all of (compute max, link max, sum): where
    the closed form prices compute and link apart (GPipe, ZB-H1, ZB-H2), the front is in three terms.
    Sorted by them (stably), a point is kept unless a kept one, none of which has a higher compute
    max, has a link max and a sum at or below its own. The kept points' (link, sum) pairs that no
    other kept pair beats on both are a staircase, links rising and sums falling; those with a link
    at or below a point's are a prefix of it, whose last has the least sum, so one bisection answers
    for every kept point (asking each kept point in turn was most of planning 6 nodes and 48 layers
    under ZB-H1)."""
    points.sort(key=lambda p: (p[0], p[1], p[3]))
    kept: list[tuple] = []
    links: list[float] = []  # the staircase: links rising ...
    sums: list[float] = []  # ... sums falling
    for p in points:
        at = bisect.bisect_right(links, p[1])  # the first entry whose link is above p's
        if at and sums[at - 1] <= p[3]:
            continue
        kept.append(p)
        past = at
        while past < len(links) and sums[past] >= p[3]:
            past += 1  # entries p beats or ties on both leave
        links[at:past], sums[at:past] = [p[1]], [p[3]]
    return kept


def three_term_fronts_python(starts: list[int], time: list[float], static: list[float], activation: list[float],
                             memory: float, in_flight: int, M: int, crossings: list[list], following: list,
                             last_end: int) -> list[list[tuple]]:
    """Where the closed form prices compute, link and round trip apart, the front of the state at
    each first layer of `starts` (what _cutfront.c's three_term_fronts computes)."""
    return [pareto_three_terms(state_points(suffix_rows(i, time, static, activation, memory, in_flight, M, "none",
                                                        following, last_end), crossings)) for i in starts]


def suffix_rows(i: int, time: list[float], static: list[float], activation: list[float], memory: float,
                in_flight: int, M: int, window_rule: str, following: list, last_end: int) -> list[tuple]:
    """The rows of the state (a stage and the ones after it, first layer i): (end, the stage's
    compute, the following front, window) per end up to last_end whose range fits the stage's
    memory with `in_flight` micro-batches held (memory only grows with the range) and whose
    following front is not empty. `following[end]`: the following state's front at first layer end.
    window_rule: what the row's window term divides by: "none" (0: no window term, GPipe), "own"
    (in_flight) or "deepest", under a deepening schedule (1F1B): the deepest window memory allows
    the range (CostModel.window_cap, inlined), at least in_flight and at most M, the cap up to which
    CostModel.deepen searches the plan's windows.

    A stage may get fewer in the plan: windows never grow down the pipeline
    (launcher/planning/windows.py), so below a stage that holds fewer it holds at most as many. Its
    term is then below that stage's, whose round trip is longer, so the largest term, the one the
    closed form takes, is the same either way. Dividing by the schedule's own window instead priced
    a cut as if its round trip limited it where the deepened windows hide that round trip, so the
    program chose cuts that shorten round trips over cuts that balance compute: on a 4-node chain
    across regions at 38 micro-batches its cut simulated 2.00 s where the best cut did 1.29 s."""
    rows = []
    for end in range(i + 1, last_end + 1):
        per_mb, held = activation[end] - activation[i], static[end] - static[i]
        if held + in_flight * per_mb > memory:
            break
        if following[end] is None:
            raise TypeError("a following front is a list (worked out before this stage's)")
        if not following[end]:
            continue
        window = 0 if window_rule == "none" else in_flight
        if window_rule == "deepest":  # clamped while a float: memory / a few bytes can round to inf
            most = (memory - held) // per_mb if per_mb > 0 else M
            window = max(in_flight, M if most >= M else int(most))
        rows.append((end, time[end] - time[i], following[end], window))
    return rows


def suffix_fronts_python(starts: list[int], time: list[float], static: list[float], activation: list[float],
                         memory: float, in_flight: int, M: int, deepens: bool, crossings: list[list],
                         following: list, last_end: int) -> list[list[tuple]]:
    """Under 1F1B-like schedules, the front of the state at each first layer of `starts` (what
    _cutfront.c's suffix_fronts computes, the rows built there too)."""
    rule = "deepest" if deepens else "own"
    return [one_bottleneck_front_python(suffix_rows(i, time, static, activation, memory, in_flight, M, rule,
                                                    following, last_end), crossings) for i in starts]


try:
    from hetlaunch.launcher.planning import _cutfront
except ImportError:  # not built (no C compiler at install): the Python loop, same plans
    _cutfront = None
COMPILED = _cutfront is not None
one_bottleneck_front = _cutfront.one_bottleneck_front if COMPILED else one_bottleneck_front_python
suffix_fronts = _cutfront.suffix_fronts if COMPILED else suffix_fronts_python
three_term_fronts = _cutfront.three_term_fronts if COMPILED else three_term_fronts_python
