"""Planning pauses Python's cyclic collector and leaves it as it found it (launcher/planning/gc_pause.py)."""

from __future__ import annotations

import gc
import random

import pytest

from hetlaunch.launcher.planning.gc_pause import gc_paused
from hetlaunch.launcher.planning import planner

pytestmark = pytest.mark.quick


@pytest.fixture
def collector():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_while_planning_and_on_again_after_a_plan_and_after_a_failure(collector, monkeypatch):
    from plan_reference import random_profile

    seen = []
    counts = planner.replica_counts

    def recorded(*args):  # called inside plan(), before the search
        seen.append(gc.isenabled())
        return counts(*args)
    monkeypatch.setattr(planner, "replica_counts", recorded)
    gc.enable()
    result = planner.plan(random_profile(random.Random(0), 3, 2, 6), num_microbatches=4)
    assert result.tokens_per_s > 0 and seen == [False] and gc.isenabled()
    with pytest.raises(planner.PlanningError):
        planner.plan(random_profile(random.Random(0), 3, 2, 6), num_microbatches=0)
    assert gc.isenabled()


def test_a_caller_that_paused_the_collector_finds_it_paused_after(collector):
    @gc_paused
    def inner():
        return gc.isenabled()

    @gc_paused
    def outer():
        return inner(), gc.isenabled()  # a plan inside a plan does not turn it back on early

    gc.disable()
    assert inner() is False and not gc.isenabled()
    gc.enable()
    assert outer() == (False, False) and gc.isenabled()


def test_plans_in_two_threads_keep_it_paused_until_the_last_ends(collector):
    """Each plan restored the state it found: a thread that started while another's plan ran found
    the collector off, and the first to end turned it on under the other."""
    import threading

    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    @gc_paused
    def first():
        first_in.set()
        second_in.wait(10)

    @gc_paused
    def second():
        second_in.set()
        first_out.wait(10)
        seen["after the first ended"] = gc.isenabled()

    gc.enable()
    a = threading.Thread(target=first)
    a.start()
    first_in.wait(10)
    b = threading.Thread(target=second)
    b.start()
    a.join(10)
    first_out.set()
    b.join(10)
    assert seen == {"after the first ended": False} and gc.isenabled()

