"""Planning with Python's cyclic garbage collector paused.

The search allocates millions of small tuples (cut fronts, memo keys) and frees nearly all of them
by reference counting, but every 700 allocations wake the collector, and its passes walk the
objects the process holds (176,000 in a process that imported torch): 10-25% of planning a
six-node cluster or ten one-node regions (bench/planning_time.py's profiles). The planner makes no reference
cycles of its own, so nothing waits on the collector while it is paused; whatever cycles other
threads make meanwhile are collected once it runs again.
"""

from __future__ import annotations

import functools
import gc


def gc_paused(function):
    """`function` with the cyclic collector paused while it runs (left as it was found: a plan inside
    a plan, or a caller that paused it already, does not turn it back on early)."""

    @functools.wraps(function)
    def paused(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()
    return paused
