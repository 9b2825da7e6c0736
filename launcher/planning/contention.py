"""Nodes that share a host share its cores: the plan priced with that contention.

The profile times each node alone (launcher/cluster_measurement.py). In training every stage
computes at once, and the stages of nodes on one host — several local agents, several GPU agents
on one real host — share its cores. The profile records each node's host, the cores it may run
on, and how many of them its stage keeps busy while computing (`cpu_per_wall`, measured alone:
about 1 for a one-thread CPU stage, less for one that waits on a GPU or sleeps as an emulated
slower device). Priced as processor sharing: over a step, a host's stages ask on average for

    D = sum over its stages of cpu_per_wall x (the stage's compute in a step / the step)

cores; where D exceeds the host's cores, each of their compute takes D / cores as long. The plan
is priced again with those nodes' layer and optimizer times stretched by that factor. One pass:
stretching the compute of a compute-bound step stretches the step alike, so D barely moves.
What this leaves out (a scheduler's preference for threads that slept, memory bandwidth, PCIe)
is what calibration (launcher/calibration.py) measures.
"""

from __future__ import annotations

from typing import Sequence

from hetlaunch.launcher.planning.cost_model import PipelineCost
from hetlaunch.launcher.planning.profile_file import Profile


def host_factors(profile: Profile, pipelines: Sequence[PipelineCost], step_s: float) -> dict[str, float]:
    """host -> how much longer its stages' compute takes than profiled (only hosts where it is > 1)."""
    asked: dict[str, float] = {}
    cores: dict[str, int] = {}
    sharing: dict[str, int] = {}
    for cost in pipelines:
        for stage in cost.stages:
            node = profile.node(stage.node)
            if node.host is None or node.host_cores is None or step_s <= 0:
                continue
            busy = stage.compute_s * cost.num_microbatches / step_s
            asked[node.host] = asked.get(node.host, 0.0) + (node.cpu_per_wall or 1.0) * min(busy, 1.0)
            cores[node.host] = node.host_cores
            sharing[node.host] = sharing.get(node.host, 0) + 1
    return {host: round(asked[host] / cores[host], 4) for host in asked
            if sharing[host] > 1 and asked[host] > cores[host]}


def stretched(profile: Profile, factors: dict[str, float]) -> Profile:
    """The profile with every node of a contended host computing `factor` times as long; its
    nodes forget their host, so pricing the result again does not stretch it twice."""
    nodes = []
    for node in profile.nodes:
        factor = factors.get(node.host, 1.0) if node.host is not None else 1.0
        update = {"host": None}
        if factor != 1.0:
            update.update(layer_seconds=[t * factor for t in node.layer_seconds],
                          optimizer_seconds=None if node.optimizer_seconds is None else
                          [t * factor for t in node.optimizer_seconds])
        nodes.append(node.model_copy(update=update))
    return profile.model_copy(update={"nodes": nodes})
