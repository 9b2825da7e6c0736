"""Planning with Python's cyclic garbage collector paused.

The search allocates millions of small tuples (cut fronts, memo keys) and frees nearly all of them
by reference counting, but every 700 allocations wake the collector, and its passes walk the
objects the process holds (176,000 in a process that imported torch): 10-25% of planning a
six-node cluster or ten one-node regions (bench/planning_time.py's profiles). A plan leaves a few
hundred objects in cycles, collected once the collector runs again.

The collector's switch is the process's: while any plan runs (the coordinator re-plans beside its
gRPC threads), it is paused for every thread. Plans that overlap, in threads or one inside another,
count how many run, and the last to end turns the collector back on if it was on before the first.
"""

from __future__ import annotations

import functools
import gc
import threading

_lock = threading.Lock()
_running = 0  # plans running now
_was_enabled = False  # the collector's state before the first of them


def gc_paused(function):
    """`function` with the cyclic collector paused while it runs (see the module docstring)."""

    @functools.wraps(function)
    def paused(*args, **kwargs):
        global _running, _was_enabled
        with _lock:
            if _running == 0:
                _was_enabled = gc.isenabled()
                gc.disable()
            _running += 1
        try:
            return function(*args, **kwargs)
        finally:
            with _lock:
                _running -= 1
                if _running == 0 and _was_enabled:
                    gc.enable()
    return paused
