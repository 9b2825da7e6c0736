"""Regions are chained by what a crossing costs, bandwidth and latency both, exactly for up to 12 regions."""

from __future__ import annotations

import itertools
import random

from hetlaunch.launcher.planning.chain_candidates import region_path, _shortest_open_path
from hetlaunch.launcher.planning.profile_file import LayerInfo, LinkProfile, ModelIdentity, NodeProfile, Profile


def test_the_shortest_open_path_is_the_best_of_every_order():
    rng = random.Random(0)
    for n in range(1, 8):
        for _ in range(15):
            cost = [[0.0] * n for _ in range(n)]
            for i, j in itertools.combinations(range(n), 2):
                cost[i][j] = cost[j][i] = rng.uniform(0.001, 0.2)
            path = _shortest_open_path(cost)

            def total(order):
                return sum(cost[a][b] for a, b in zip(order, order[1:]))

            assert sorted(path) == list(range(n))
            assert abs(total(path) - min(total(p) for p in itertools.permutations(range(n)))) < 1e-12


def test_ten_regions_use_the_near_pair_that_bandwidth_alone_ranks_last():
    # Every pair 1 GB/s but 100 ms apart; us-a and us-b are 11 ms apart on 0.14 GB/s (1.12 Gbps).
    regions = [f"r{i}" for i in range(8)] + ["us-a", "us-b"]
    layers = [LayerInfo(param_bytes=2**20, activation_bytes=2**20, output_bytes=2**20) for _ in range(4)]
    nodes = [NodeProfile(name=f"n-{r}", region=r, device="dev", memory_bytes=2**34, layer_seconds=[0.01] * 4)
             for r in regions]
    links = [LinkProfile(regions=(a, b), bandwidth_bytes_per_s=1.4e8 if {a, b} == {"us-a", "us-b"} else 1e9,
                         latency_s=0.011 if {a, b} == {"us-a", "us-b"} else 0.100)
             for a, b in itertools.combinations(regions, 2)]
    profile = Profile(model=ModelIdentity(description="geo", num_layers=4), micro_batch_size=1, seq_len=1,
                      layers=layers, nodes=nodes, links=links)
    path = region_path(profile, regions)
    assert sorted(path) == sorted(regions)
    assert abs(path.index("us-a") - path.index("us-b")) == 1, path
