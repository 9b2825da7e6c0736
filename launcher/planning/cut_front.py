"""One state of the cut dynamic program under 1F1B (launcher/planning/chain_cuts.py): its points
from a stage's candidate ends, each outgoing codec and each point of the following state's front,
kept where no other point is as good on both (the step's one bottleneck term, the round trip).

`one_bottleneck_front` is launcher/planning/_cutfront.c's where that extension was built (the
same arithmetic and tie-breaking, so the same plans: tests/planning/test_cut_front.py), else the
Python loop below.
"""

from __future__ import annotations

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


try:
    from hetlaunch.launcher.planning import _cutfront
except ImportError:  # not built (no C compiler at install): the Python loop, same plans
    _cutfront = None
COMPILED = _cutfront is not None
one_bottleneck_front = _cutfront.one_bottleneck_front if COMPILED else one_bottleneck_front_python
