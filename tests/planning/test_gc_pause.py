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
