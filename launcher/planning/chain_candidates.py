"""Which nodes, in which order: the candidate chains for one pipeline (launcher/planning/chain_search.py
prices them).

Every ordered subset for clusters of up to EXHAUSTIVE_MAX_NODES nodes. Larger clusters use
region-level ordering: regions are chained to minimise the time spent crossing between them,
bandwidth and latency both (exactly for up to EXACT_MAX_REGIONS regions, greedy beyond), every
contiguous run of that region order is a candidate, and inside it the k fastest nodes for a few
k (each region's nodes stay together, sorted by memory so the stages that keep most micro-batches
in flight get the most memory).
"""

from __future__ import annotations

import itertools

from hetlaunch.launcher.planning.profile_file import NodeProfile, Profile

EXHAUSTIVE_MAX_NODES = 6
EXACT_MAX_REGIONS = 12  # region orders found exactly (dynamic programming over subsets) up to this many regions


def node_speed(node: NodeProfile) -> float:
    return 1.0 / max(sum(node.layer_seconds), 1e-12)


def region_path(profile: Profile, regions: list[str]) -> list[str]:
    """Order regions so the chain crosses between them as fast as it can: each hop costs one
    typical activation's time on the wire between the regions plus the link's latency (a
    nearby pair with modest bandwidth can beat a distant fat pipe). The shortest open path
    through all regions, exactly by dynamic programming over subsets up to EXACT_MAX_REGIONS
    regions (Held-Karp), nearest-neighbour from every start beyond."""
    if len(regions) <= 1:
        return regions
    reps = {r: next(n for n in profile.nodes if n.region == r) for r in regions}
    outputs = sorted(layer.output_bytes for layer in profile.layers)
    typical = outputs[len(outputs) // 2] if outputs else 0

    def hop_cost(a: str, b: str) -> float:
        link = profile.link(reps[a], reps[b])
        return typical / link.bandwidth_bytes_per_s + link.latency_s

    n = len(regions)
    cost = [[hop_cost(a, b) if a != b else 0.0 for b in regions] for a in regions]
    if n <= EXACT_MAX_REGIONS:
        return [regions[i] for i in _shortest_open_path(cost)]
    best = None
    for start in range(n):
        path, left = [start], set(range(n)) - {start}
        while left:
            nxt = min(left, key=lambda r: cost[path[-1]][r])
            path.append(nxt)
            left.remove(nxt)
        total = sum(cost[a][b] for a, b in zip(path, path[1:]))
        if best is None or total < best[0]:
            best = (total, path)
    return [regions[i] for i in best[1]]


def _shortest_open_path(cost: list[list[float]]) -> list[int]:
    """Held-Karp: the cheapest order visiting every index once, any start, any end."""
    n = len(cost)
    full = (1 << n) - 1
    inf = float("inf")
    best = [[inf] * n for _ in range(1 << n)]
    came = [[-1] * n for _ in range(1 << n)]
    for i in range(n):
        best[1 << i][i] = 0.0
    for mask in range(1, 1 << n):
        row = best[mask]
        for last in range(n):
            here = row[last]
            if here == inf:
                continue
            for nxt in range(n):
                if mask >> nxt & 1:
                    continue
                grown = mask | 1 << nxt
                total = here + cost[last][nxt]
                if total < best[grown][nxt]:
                    best[grown][nxt] = total
                    came[grown][nxt] = last
    last = min(range(n), key=lambda i: best[full][i])
    path, mask = [], full
    while last != -1:
        path.append(last)
        last, mask = came[mask][last], mask & ~(1 << last)
    return path[::-1]


def candidate_chains(profile: Profile, nodes: list[NodeProfile], num_layers: int, stages: int | None,
                     paths: dict[tuple[str, ...], list[str]] | None = None):
    """Ordered node chains to price: every ordered subset when small, region-level heuristics when large.

    `paths` remembers region orders between calls (the same regions come back for every
    micro-batch count and every replica)."""
    if len(nodes) <= EXHAUSTIVE_MAX_NODES:
        for k in range(1, min(len(nodes), num_layers) + 1):
            if stages is None or k == stages:
                yield from (list(p) for p in itertools.permutations(nodes, k))
        return
    regions = tuple(sorted({n.region for n in nodes}))
    paths = {} if paths is None else paths
    if regions not in paths:
        paths[regions] = region_path(profile, list(regions))
    path = paths[regions]
    # Each region's nodes in the order a chain keeps them (most memory first), sorted once: a
    # chain's nodes of a region are then that order filtered (a stable sort of the chosen ones).
    speed = {id(n): node_speed(n) for n in nodes}  # a sum over every layer: worked out once, not per sort
    in_order = {r: sorted((n for n in nodes if n.region == r), key=lambda m: (-m.memory_bytes, -speed[id(m)]))
                for r in path}
    for a in range(len(path)):
        for b in range(a + 1, len(path) + 1):
            run = set(path[a:b])
            members = [n for n in nodes if n.region in run]
            fastest = sorted(members, key=lambda n: speed[id(n)], reverse=True)
            limit = min(len(members), num_layers)
            sizes = sorted({k for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, limit) if k <= limit})
            if stages is not None:
                sizes = [stages] if stages <= limit else []
            # Chain order: each region's nodes together, in region-path order, most memory first.
            # The k fastest are the first k of `fastest`; each one's index in chain order, so that
            # a chain is those k indices sorted (not a pass over every member per size).
            ordered = [n for r in path[a:b] for n in in_order[r]]
            at = {id(n): i for i, n in enumerate(ordered)}
            by_speed = [at[id(n)] for n in fastest]
            for k in sizes:
                yield [ordered[i] for i in sorted(by_speed[:k])]
