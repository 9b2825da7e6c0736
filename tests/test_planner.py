"""The planner against brute force under the same pricing (the event simulation), and its constraints."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.planner import PlanningError, plan
from hetlaunch.launcher.planning.profile_file import LayerInfo, LinkProfile, ModelIdentity, NodeProfile, Profile

GiB = 2**30


def random_profile(rng: random.Random, num_nodes: int, num_regions: int, num_layers: int,
                   memory_gb: tuple[float, float] = (1.0, 4.0)) -> Profile:
    regions = [f"r{i}" for i in range(num_regions)]
    layers = [LayerInfo(param_bytes=rng.randint(1, 50) * 2**20, activation_bytes=rng.randint(1, 40) * 2**20,
                        output_bytes=rng.randint(1, 8) * 2**20) for _ in range(num_layers)]
    base = [rng.uniform(0.002, 0.02) for _ in range(num_layers)]
    nodes = []
    for i in range(num_nodes):
        speed = rng.choice([1.0, 1.0, 0.5, 0.25, 2.0])
        nodes.append(NodeProfile(name=f"n{i}", region=regions[i % num_regions] if i < num_regions else rng.choice(regions),
                                 device="dev", memory_bytes=rng.uniform(*memory_gb) * GiB,
                                 layer_seconds=[b / speed for b in base],
                                 optimizer_seconds=[rng.uniform(0, 0.002) for _ in base]))
    links = []
    for a, b in itertools.combinations_with_replacement(regions, 2):
        fast = a == b
        links.append(LinkProfile(regions=(a, b), bandwidth_bytes_per_s=rng.uniform(5e9, 2e10) if fast else rng.uniform(5e7, 1e9),
                                 latency_s=rng.uniform(1e-5, 1e-4) if fast else rng.uniform(0.005, 0.05)))
    return Profile(model=ModelIdentity(description="synthetic", num_layers=num_layers), micro_batch_size=4,
                   seq_len=128, layers=layers, nodes=nodes, links=links)


def brute_force(profile: Profile, M: int, schedule: str) -> float:
    cm = CostModel(profile, M, schedule)
    L = cm.num_layers
    best = math.inf
    for k in range(1, min(len(profile.nodes), L) + 1):
        for chain in itertools.permutations(profile.nodes, k):
            for bounds in itertools.combinations(range(1, L), k - 1):
                edges = (0, *bounds, L)
                cuts = list(zip(edges, edges[1:]))
                cost = cm.deepen(list(chain), cm.evaluate(list(chain), cuts))  # windows as deep as memory allows, when they pay
                if all(s.memory_bytes <= s.capacity_bytes for s in cost.stages):
                    best = min(best, cost.step_s)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_planner_equals_brute_force(seed):
    rng = random.Random(seed)
    num_nodes = rng.randint(2, 5 if seed % 3 else 6)
    profile = random_profile(rng, num_nodes, rng.randint(1, 3), rng.randint(4, 8 if num_nodes == 6 else 10))
    M = rng.choice([1, 2, 4, 8])
    schedule = rng.choice(["1f1b", "gpipe"])
    want = brute_force(profile, M, schedule)
    if math.isinf(want):
        with pytest.raises(PlanningError):
            plan(profile, M, schedule)
        return
    got = plan(profile, M, schedule)
    assert got.step_s == pytest.approx(want, rel=1e-9)
    cost = got.pipelines[0].cost
    assert cost.exact
    for stage in got.pipelines[0].cost.stages:
        assert stage.memory_bytes <= stage.capacity_bytes


def uniform_profile(speeds: list[float], regions: list[str], num_layers: int = 8, memory_gb: float = 8.0,
                    cross_bandwidth: float = 1e7, cross_latency: float = 0.02, param_bytes: int = 2**20) -> Profile:
    layers = [LayerInfo(param_bytes=param_bytes, activation_bytes=2**20, output_bytes=2**20) for _ in range(num_layers)]
    nodes = [NodeProfile(name=f"n{i}", region=r, device="dev", memory_bytes=memory_gb * GiB,
                         layer_seconds=[0.01 / s] * num_layers) for i, (s, r) in enumerate(zip(speeds, regions))]
    links = [LinkProfile(regions=(r, r), bandwidth_bytes_per_s=1e10, latency_s=1e-5) for r in sorted(set(regions))]
    for a, b in itertools.combinations(sorted(set(regions)), 2):
        links.append(LinkProfile(regions=(a, b), bandwidth_bytes_per_s=cross_bandwidth, latency_s=cross_latency))
    return Profile(model=ModelIdentity(description="uniform", num_layers=num_layers), micro_batch_size=4,
                   seq_len=64, layers=layers, nodes=nodes, links=links)


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
