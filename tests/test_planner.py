"""The planner against brute force under the same cost model, and its constraints."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hetlaunch.launcher.cost_model import CostModel
from hetlaunch.launcher.planner import PlanningError, plan
from hetlaunch.launcher.profile import LayerInfo, LinkProfile, ModelIdentity, NodeProfile, Profile

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
                cost = cm.evaluate(list(chain), cuts)
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
    for stage in got.pipelines[0].cost.stages:
        assert stage.memory_bytes <= stage.capacity_bytes
