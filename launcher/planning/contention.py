"""Nodes that share a host share its cores: the plan priced with that contention.

The profile times each node alone (launcher/cluster_measurement.py). In training every stage
computes at once, and the stages of nodes on one host — several local agents, several GPU agents
on one real host — share its cores. The profile records each node's host, the cores it may run
on, and how many of them its stage keeps busy while computing (`cpu_per_wall`, measured alone:
about 1 for a one-thread CPU stage, less for one that waits on a GPU or sleeps as an emulated
slower device).

Priced as processor sharing over the steady part of a step, where every stage of a pipeline
computes at once. A stage j asks for t_j = max(1, cpu_per_wall_j) cores, at any moment with
probability p_j = busy_j x min(1, cpu_per_wall_j), where busy_j is its compute in a step over the
busiest stage's (the bottleneck computes throughout the steady part, a lightly loaded stage for
part of it). Taking the stages as asking independently, the host's busiest stage i, while it
computes, shares the cores with the others that ask at that moment, and takes

    E[ max(1, (t_i + sum over the others j of t_j X_j) / cores) ],   X_j ~ Bernoulli(p_j)

times as long as alone. That factor stretches the layer and optimizer times of every node on
the host, and the plan is priced again with them. Where every stage asks all the time, it is the
cores asked for over the cores (sum t_j / cores); below that, it prices the moments when more
stages compute than there are cores, which a sum of averages calls free: four emulated agents
asking a quarter of a core each on 2 cores computed with 11-19% of each piece's wall time spent
runnable but not running (thread CPU time against wall time in the executor, 2026-12-05) where
the sum priced none and this prices 9%; one or two agents on the 2 cores waited 0-4%.
Averaging over the whole step instead, bubbles included, priced four one-thread agents on two
cores 1.08x where their compute measured 1.5-1.9x.
What this leaves out (a scheduler's preference for threads that slept, memory bandwidth, PCIe)
is what calibration (launcher/adapt/calibration.py) measures.
"""

from __future__ import annotations

from typing import Sequence

from hetlaunch.launcher.planning.pipeline_cost import PipelineCost
from hetlaunch.launcher.planning.profile_edits import scaled
from hetlaunch.launcher.planning.profile_file import Profile


def host_factors(profile: Profile, pipelines: Sequence[PipelineCost]) -> dict[str, float]:
    """host -> how much longer its stages' compute takes than profiled (only hosts where it is > 1%)."""
    asking: dict[str, list[tuple[float, float, float]]] = {}  # host -> (busy, threads asked, probability)
    cores: dict[str, int] = {}
    busiest = max((s.compute_s * c.num_microbatches for c in pipelines for s in c.stages), default=0.0)
    for cost in pipelines:
        for stage in cost.stages:
            node = profile.node(stage.node)
            if node.host is None or node.host_cores is None or busiest <= 0:
                continue
            busy = stage.compute_s * cost.num_microbatches / busiest
            cpu = node.cpu_per_wall or 1.0
            asking.setdefault(node.host, []).append((busy, max(1.0, cpu), busy * min(1.0, cpu)))
            cores[node.host] = node.host_cores
    factors = {}
    for host, stages in asking.items():
        if len(stages) < 2:
            continue
        i = max(range(len(stages)), key=lambda k: stages[k][0])
        factor = shared_core_stretch(stages[i][1], [(t, p) for k, (_, t, p) in enumerate(stages) if k != i],
                                     cores[host])
        if factor > 1.01:  # within 1% of alone: none
            factors[host] = round(factor, 4)
    return factors


def shared_core_stretch(threads: float, others: list[tuple[float, float]], cores: int) -> float:
    """E[max(1, (threads + sum t X) / cores)] over the others' (t, p), X ~ Bernoulli(p), independent:
    how much longer a stage asking `threads` cores computes beside them under processor sharing."""
    # the others' total ask, in hundredths of a core, and its probability
    total: dict[int, float] = {0: 1.0}
    for t, p in others:
        step, p = round(t * 100), min(max(p, 0.0), 1.0)
        grown: dict[int, float] = {}
        for asked, q in total.items():
            grown[asked] = grown.get(asked, 0.0) + q * (1 - p)
            grown[asked + step] = grown.get(asked + step, 0.0) + q * p
        total = grown
    return sum(q * max(1.0, (threads + asked / 100) / cores) for asked, q in total.items())


def stretched(profile: Profile, factors: dict[str, float]) -> Profile:
    """The profile with every node of a contended host computing `factor` times as long; its
    nodes forget their host, so pricing the result again does not stretch it twice."""
    by_node = {n.name: factors[n.host] for n in profile.nodes if n.host is not None and n.host in factors}
    return scaled(profile, by_node, forget_hosts=True)
