"""A pinned cut with 1F1B windows pinned in the YAML is priced at those windows, not at the deeper
ones the planner would pick: the plan's step is the simulation of what runs.

It once was not: the pinned plan ran at windows 4 while its predicted step came from windows
[8, 8, 8, 1] the planner deepened to over 20 ms links, 1.74 s against 3.5-3.9 s measured
(bench/zero_bubble.py's 1F1B side, measured ÷ predicted 2.3)."""

from __future__ import annotations

from plan_reference import uniform_profile
from hetlaunch.launcher.planning.compression import NONE
from hetlaunch.launcher.planning.planner import plan_fixed_cut, price_pipelines
from hetlaunch.runtime.schedules import schedule_for, simulate

CHAIN, CUTS, M = ["n0", "n1", "n2", "n3"], [(0, 2), (2, 4), (4, 6), (6, 8)], 8


def _simulated(result, windows) -> float:
    stages = result.pipelines[0].cost.stages
    return simulate([schedule_for("1f1b", j, 4, M, w) for j, w in enumerate(windows)],
                    [s.forward_s for s in stages], [s.backward_s for s in stages],
                    [s.link_s for s in stages[:-1]], [s.latency_s for s in stages[:-1]],
                    [s.optimizer_s for s in stages], *(None, None))


def test_pinned_windows_are_what_the_plan_prices_and_reports():
    profile = uniform_profile([1.0] * 4, ["r0", "r1", "r2", "r3"], cross_latency=0.02)
    free = plan_fixed_cut(profile, CHAIN, CUTS, M, "1f1b", NONE)
    deepened = [s.window for s in free.pipelines[0].cost.stages]
    assert any(w > 4 for w in deepened), deepened  # over 20 ms links the planner deepens past 4 ...
    pinned = plan_fixed_cut(profile, CHAIN, CUTS, M, "1f1b", NONE, windows=(4, 4, 4, 4))
    stages = pinned.pipelines[0].cost.stages
    assert [s.window or min(4 - j, M) for j, s in enumerate(stages)] == [4, 4, 4, 4]  # ... pinned, it keeps 4
    assert pinned.step_s == _simulated(pinned, [4, 4, 4, 4]) > free.step_s  # and reports the step of 4
    # the same through price_pipelines (several pipelines' path), windows per pipeline
    both = price_pipelines(profile, [(CHAIN, CUTS, M)], "1f1b", NONE, windows=[(4, 4, 4, 4)])
    assert both.step_s == pinned.step_s
