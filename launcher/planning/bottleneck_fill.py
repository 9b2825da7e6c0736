"""A long chain's cut (launcher/planning/chain_cuts.py bottleneck_cuts): bisect the bottleneck,
each trial filling the stages greedily under it.

`bottleneck_bisect` is launcher/planning/_bottleneck.c's where that extension was built (the same
arithmetic, so the same cuts: tests/planning/test_compiled_cut_loops.py), else the Python loop below.
"""

from __future__ import annotations

from bisect import bisect_right


def bottleneck_bisect_python(stages: list[tuple], outputs: list[int], lo: float, hi: float,
                             bisections: int) -> list[tuple[int, int]] | None:
    """The cuts of the least limit found by `bisections` halvings of [lo, hi] under which every
    stage fits; None when not even `hi` fits. stages: per stage (its node's time prefix sums, its
    memory prefix sums, the node's memory, the last end it may take, its outgoing link's seconds
    per byte: 0 on the last stage); outputs: each layer's output bytes."""
    L = len(outputs)

    def fill(limit: float) -> list[tuple[int, int]] | None:
        """Give each stage as many layers as fit under the limit (time and memory are monotone in
        the range, so the furthest end is found by bisection on prefix sums)."""
        cuts, start = [], 0
        for acc, mem, capacity, last, link in stages:
            end = min(bisect_right(acc, acc[start] + limit) - 1, bisect_right(mem, mem[start] + capacity) - 1, last)
            if end <= start or outputs[end - 1] * link > limit:
                return None
            cuts.append((start, end))
            start = end
        return cuts if start == L else None

    best = fill(hi)
    if best is None:
        return None
    for _ in range(bisections):
        mid = (lo + hi) / 2
        cuts = fill(mid)
        if cuts is None:
            lo = mid
        else:
            hi, best = mid, cuts
    return best


try:
    from hetlaunch.launcher.planning import _bottleneck
except ImportError:  # not built (no C compiler at install): the Python loop, same plans
    _bottleneck = None
COMPILED = _bottleneck is not None
bottleneck_bisect = _bottleneck.bottleneck_bisect if COMPILED else bottleneck_bisect_python
