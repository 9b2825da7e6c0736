"""The planner against brute force under the same pricing (the event simulation), and its constraints."""

from __future__ import annotations

import random
import re

import pytest

from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.planner import PlanningError, plan, plan_global_batch
from plan_reference import GiB, uniform_profile


def test_regions_stay_contiguous_when_crossing_is_slow():
    profile = uniform_profile([1, 1, 1, 1], ["a", "b", "a", "b"], cross_bandwidth=5e8, cross_latency=0.001)
    result = plan(profile, 8)
    regions = result.pipelines[0].regions
    assert len(regions) == 4, "four equal nodes and a fast-enough cross link: all should be used"
    assert sum(1 for x, y in zip(regions, regions[1:]) if x != y) == 1, regions


def test_far_slower_node_is_dropped_and_named():
    profile = uniform_profile([1, 1, 1, 0.02], ["a"] * 4)
    result = plan(profile, 8)
    used = {s.node for s in result.pipelines[0].cost.stages}
    assert used == {"n0", "n1", "n2"}
    assert "n3" in result.excluded and "faster without it" in result.excluded["n3"]


def test_slower_node_gets_fewer_layers():
    profile = uniform_profile([1, 0.5], ["a", "a"], num_layers=9)
    stages = {s.node: s.layer_end - s.layer_start for s in plan(profile, 8).pipelines[0].cost.stages}
    assert stages == {"n0": 6, "n1": 3}


def test_memory_limits_bind_and_shortfall_is_reported():
    # 8 layers x (4 MiB static + up to 8 x 1 MiB activations): three 0.01 GiB nodes cannot hold it.
    profile = uniform_profile([1, 1, 1], ["a"] * 3, memory_gb=0.01)
    with pytest.raises(PlanningError, match=r"[0-9.]+ MiB short"):
        plan(profile, 8)
    roomy = uniform_profile([1, 0.25], ["a", "a"], memory_gb=1.0)
    small = roomy.model_copy(update={"nodes": [roomy.nodes[0].model_copy(update={"memory_bytes": 0.025 * GiB}),
                                               roomy.nodes[1]]})
    result = plan(small, 8)
    for s in result.pipelines[0].cost.stages:
        assert s.memory_bytes <= s.capacity_bytes
    fast = next(s for s in result.pipelines[0].cost.stages if s.node == "n0")
    # Unconstrained, speed 4:1 would give the fast node 6 of 8 layers; 25.6 MiB holds at most 5
    # (4 MiB static + at least 1 MiB of activations per layer).
    unconstrained = next(s for s in plan(roomy, 8).pipelines[0].cost.stages if s.node == "n0")
    assert unconstrained.layer_end - unconstrained.layer_start >= 6
    assert fast.layer_end - fast.layer_start <= 5, "memory, not speed, must cap the fast node"


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(PlanningError, match="only 8 layers"):
        plan(uniform_profile([1] * 10, ["a"] * 10), 4, stages=9)


def test_two_pipelines_split_microbatches_by_throughput_and_bubble():
    # Small parameters, so the cross-region gradient sync is cheap and a replica per region
    # pays; activations would take a second to cross, so no pipeline spans the regions.
    profile = uniform_profile([1, 1, 0.5, 0.5], ["a", "a", "b", "b"], cross_bandwidth=1e6, cross_latency=0.01,
                              param_bytes=1024)
    result = plan(profile, 11, max_pipelines=2)
    assert len(result.pipelines) == 2
    for p in result.pipelines:
        assert len(set(p.regions)) == 1, "each replica stays inside its region"
    # Step of a 2-stage pipeline with m micro-batches: (m + 1) t, t = 40 ms (fast) or 80 ms (slow).
    # In proportion to throughput 11 splits 7:4 (max(320, 400) ms); the bubble makes 8:3 better
    # (max(360, 320) ms), and every split is tried for two pipelines.
    counts = {p.regions[0]: p.cost.num_microbatches for p in result.pipelines}
    assert counts == {"a": 8, "b": 3}
    assert result.step_s < plan(profile, 11).step_s


def test_large_cluster_plans_with_heuristics():
    rng = random.Random(0)
    types = [1.0, 0.7, 0.4, 0.25]
    regions = [f"r{i}" for i in range(8)]
    speeds = [rng.choice(types) for _ in range(64)]
    profile = uniform_profile(speeds, [regions[i % 8] for i in range(64)], num_layers=24)
    result = plan(profile, 16, max_pipelines=4)
    assert result.method == "region heuristic"
    covered = [sum(s.layer_end - s.layer_start for s in p.cost.stages) for p in result.pipelines]
    assert covered == [24] * len(result.pipelines)
    assert sum(p.cost.num_microbatches for p in result.pipelines) == 16


def test_long_chains_use_the_bisection_heuristic_and_stay_valid():
    from hetlaunch.launcher.planning.chain_cuts import EXACT_MAX_WORK, best_cuts, bottleneck_cuts

    profile = uniform_profile([1, 1, 0.5, 0.5] * 4, ["a"] * 8 + ["b"] * 8, num_layers=48, cross_bandwidth=1e9,
                              cross_latency=0.001)
    chain = list(profile.nodes)
    assert len(chain) * 48**2 > EXACT_MAX_WORK, "this chain must take the heuristic path"
    cm = CostModel(profile, 16)
    heuristic = bottleneck_cuts(cm, chain)
    assert [s.layer_end for s in heuristic.stages][-1] == 48
    assert all(s.layer_end > s.layer_start for s in heuristic.stages)
    # On a chain the exact DP can still afford, the heuristic is never better than exact.
    short = chain[:6]
    assert bottleneck_cuts(cm, short).step_s >= best_cuts(cm, short).step_s - 1e-12
    result = plan(profile, 16)
    assert sum(s.layer_end - s.layer_start for s in result.pipelines[0].cost.stages) == 48


@pytest.mark.parametrize("call,says", [
    (lambda p: plan(p, 8, max_pipelines=0), "max_pipelines 0: at least 1"),  # ZeroDivisionError
    (lambda p: plan(p, 8, max_pipelines=-1), "max_pipelines -1: at least 1"),  # planned one pipeline
    (lambda p: plan(p, 8, schedule="zb-v"), "plan() cuts one stage per node"),  # a raw ValueError
    (lambda p: plan_global_batch(p, 12, num_microbatches=0), "0 micro-batches per step"),  # ZeroDivisionError
    (lambda p: plan_global_batch(p, 0), "a global batch of 0 samples"),  # "more than the 16,384 micro-batches"
])
def test_a_bad_argument_is_a_planning_error_that_says_which(call, says):
    """Each escaped as a raw exception or planned something else (a hostile review)."""
    with pytest.raises(PlanningError, match=re.escape(says)):
        call(uniform_profile([1.0, 0.5], ["east", "west"]))
