"""The bounded search (launcher/planning/chain_bounds.py, sim_floor.py, the one-pass simulation) plans
what the unbounded one did: on small clusters its step is within 1% of the step the planner
found before the bounds (commit 8c35182, recorded below; the same steps to the last digit on
these instances when recorded)."""

from __future__ import annotations

import random

import pytest

from hetlaunch.launcher.planning.compression import NONE, CompressionConfig
from hetlaunch.launcher.planning.planner import plan
from plan_reference import random_profile

# (seed of a 6-node, 3-region, 12-layer random_profile, policy, M, max pipelines) -> step before the bounds
BEFORE = {
    (2, "none", 8, 1): 0.269561,
    (3, "auto", 8, 1): 0.669031,
    (0, "none", 64, 1): 1.723611,
    (1, "none", 8, 6): 0.383509,
}


@pytest.mark.parametrize("case", sorted(BEFORE))
def test_bounded_search_is_within_one_percent_of_the_unbounded_one(case):
    seed, policy, M, pipelines = case
    profile = random_profile(random.Random(seed), 6, 3, 12)
    result = plan(profile, M, "1f1b", max_pipelines=pipelines,
                  compression=CompressionConfig() if policy == "auto" else NONE)
    assert result.step_s <= BEFORE[case] * 1.01
