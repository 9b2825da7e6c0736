"""Nodes that share a host share its cores: the plan priced with that contention.

The profile times each node alone (launcher/cluster_measurement.py). In training every stage
computes at once, and the stages of nodes on one host — several local agents, several GPU agents
on one real host — share its cores. The profile records each node's host, the cores it may run
on, and how many of them its stage keeps busy while computing (`cpu_per_wall`, measured alone:
about 1 for a one-thread CPU stage, less for one that waits on a GPU or sleeps as an emulated
slower device). Priced as processor sharing over the steady part of a step, where every stage of
a pipeline computes at once: a host's stages ask for

    D = sum over its stages of cpu_per_wall x (the stage's compute in a step / the busiest stage's)

cores (a stage as busy as the plan's bottleneck counts whole, a lightly loaded one in part);
where D exceeds the host's cores, each of their compute takes D / cores as long. The plan is
priced again with those nodes' layer and optimizer times stretched by that factor. (Averaging
over the whole step instead, bubbles included, priced four one-thread agents on two cores 1.08x
where their compute measured 1.5-1.9x.)
What this leaves out (a scheduler's preference for threads that slept, memory bandwidth, PCIe)
is what calibration (launcher/adapt/calibration.py) measures.
"""

from __future__ import annotations

from typing import Sequence

from hetlaunch.launcher.planning.pipeline_cost import PipelineCost
from hetlaunch.launcher.planning.profile_edits import scaled
from hetlaunch.launcher.planning.profile_file import Profile


def host_factors(profile: Profile, pipelines: Sequence[PipelineCost]) -> dict[str, float]:
    """host -> how much longer its stages' compute takes than profiled (only hosts where it is > 1)."""
    asked: dict[str, float] = {}
    cores: dict[str, int] = {}
    sharing: dict[str, int] = {}
    busiest = max((s.compute_s * c.num_microbatches for c in pipelines for s in c.stages), default=0.0)
    for cost in pipelines:
        for stage in cost.stages:
            node = profile.node(stage.node)
            if node.host is None or node.host_cores is None or busiest <= 0:
                continue
            busy = stage.compute_s * cost.num_microbatches / busiest
            asked[node.host] = asked.get(node.host, 0.0) + (node.cpu_per_wall or 1.0) * busy
            cores[node.host] = node.host_cores
            sharing[node.host] = sharing.get(node.host, 0) + 1
    return {host: round(asked[host] / cores[host], 4) for host in asked  # within 1% of the cores: none
            if sharing[host] > 1 and asked[host] > 1.01 * cores[host]}


def stretched(profile: Profile, factors: dict[str, float]) -> Profile:
    """The profile with every node of a contended host computing `factor` times as long; its
    nodes forget their host, so pricing the result again does not stretch it twice."""
    by_node = {n.name: factors[n.host] for n in profile.nodes if n.host is not None and n.host in factors}
    return scaled(profile, by_node, forget_hosts=True)
