"""Nodes that share a host share its cores: the plan priced with that contention.

The profile times each node alone (launcher/cluster_measurement.py). In training every stage
computes at once, and the stages of nodes on one host — several local agents, several GPU agents
on one real host — share its cores. The profile records each node's host, the cores it may run
on, and how many of them its stage keeps busy while computing (`cpu_per_wall`, measured alone:
about 1 for a one-thread CPU stage, less for one that waits on a GPU or sleeps as an emulated
slower device).

Priced as processor sharing over the steady part of a step, where every stage of a pipeline
computes at once. A stage j asks for t_j = max(1, cpu_per_wall_j) cores, at any moment with
probability p_j = min(1, W_j s_j / P) x min(1, cpu_per_wall_j): W_j its compute in a step, s_j
its stretch, P = max_k W_k s_k the steady part's length. Taking the stages as asking
independently, stage i, while it computes, shares the cores with the others that ask at that
moment, and takes

    s_i = E[ max(1, (t_i + sum over the others j of t_j X_j) / cores) ],   X_j ~ Bernoulli(p_j)

times as long as alone. The stretches and P are iterated from nothing stretched until they
settle; each node's layer and optimizer times are stretched by its own s (shared_cores) and the
plan priced again, and the plan says P over the longest unstretched work (host_factors). Where
every stage asks all the time this is the cores asked for over the cores (sum t_j / cores);
below that it prices the moments when more stages compute than there are cores, which a sum of
averages calls free: four emulated agents asking a quarter of a core each on 2 cores computed
with 11-19% of each piece's wall time spent runnable but not running (thread CPU time against
wall time in the executor, 2026-12-05) where the sum priced none and this prices 9%; one or two
agents on the 2 cores waited 0-4%. A stage that mostly waits, beside stages asking whole cores,
is stretched most; with the busiest stage's stretch for all (a first version), the price
depended on the nodes' order, and a node 3% slower priced a step 24% faster.
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


def shared_cores(profile: Profile, pipelines: Sequence[PipelineCost]) -> tuple[dict[str, float], dict[str, float]]:
    """From one solve: (host -> what host_factors says; node -> its own stretch s, which the plan
    is priced with), on the hosts where the steady part is more than 1% longer than unshared."""
    hosts = {host: solved for host, solved in _hosts(profile, pipelines).items() if solved[0] > 1.01}
    return ({host: factor for host, (factor, _) in hosts.items()},
            {node: stretch for _, by_node in hosts.values() for node, stretch in by_node.items()})


def host_factors(profile: Profile, pipelines: Sequence[PipelineCost]) -> dict[str, float]:
    """host -> how much longer its steady part takes than unshared: the longest stretched work of
    its stages over the longest unstretched one (only hosts where it is > 1%); what the plan says."""
    return shared_cores(profile, pipelines)[0]


def _hosts(profile: Profile, pipelines: Sequence[PipelineCost]) -> dict[str, tuple[float, dict[str, float]]]:
    """host -> (its factor, node -> stretch) for hosts with two stages or more.

    The steady part of a step lasts P = max over its stages of W_k x stretch_k; stage j asks for
    its cores a share min(1, W_j x stretch_j / P) of it (times the share of a core it keeps busy),
    and each stretch follows from the others' asks (shared_core_stretch). Iterated from nothing
    stretched until it settles. Every stage's own stretch counts (one that mostly waits, beside
    stages that ask whole cores, is stretched most), so nothing depends on the nodes' order."""
    work: dict[str, list[tuple[str, float, float]]] = {}  # host -> (node, work in a step, cores kept busy)
    cores: dict[str, int] = {}
    for cost in pipelines:
        for stage in cost.stages:
            node = profile.node(stage.node)
            if node.host is None or node.host_cores is None:
                continue
            work.setdefault(node.host, []).append((node.name, stage.compute_s * cost.num_microbatches,
                                                   node.cpu_per_wall or 1.0))
            cores[node.host] = node.host_cores
    out = {}
    for host, stages in work.items():
        top = max(w for _, w, _ in stages)
        if len(stages) < 2 or not top > 0:
            continue
        stretch = _steady_stretches([(w / top, cpu) for _, w, cpu in stages], cores[host])
        period = max(w / top * s for (_, w, _), s in zip(stages, stretch))
        out[host] = (round(period, 4), {name: round(s, 4) for (name, _, _), s in zip(stages, stretch)})
    return out


def _steady_stretches(stages: list[tuple[float, float]], cores: int) -> list[float]:
    """Each stage's stretch at the fixed point of _hosts, for (W, cpu_per_wall) with max W = 1."""
    stretch = [1.0] * len(stages)
    for _ in range(50):
        period = max(w * s for (w, _), s in zip(stages, stretch))
        asks = [(max(1.0, cpu), min(1.0, w * s / period) * min(1.0, cpu)) for (w, cpu), s in zip(stages, stretch)]
        known: dict[tuple, float] = {}
        new = []
        for k, (t, p) in enumerate(asks):
            # stages asking alike (to a 20th of a core and a 100th of the time) share one stretch: a
            # host of 64 stages all different took 2.5 s, where real hosts hold a few alike agents
            key = (round(t * 20), round(p * 100))
            if key not in known:
                known[key] = shared_core_stretch(t, asks[:k] + asks[k + 1:], cores)
            new.append(known[key])
        settled = max(abs(a - b) for a, b in zip(new, stretch)) < 1e-9
        stretch = new
        if settled:
            break
    return stretch


def shared_core_stretch(threads: float, others: list[tuple[float, float]], cores: int) -> float:
    """E[max(1, (threads + sum t X) / cores)] over the others' (t, p), X ~ Bernoulli(p), independent:
    how much longer a stage asking `threads` cores computes beside them under processor sharing.

    The others' total ask is tracked exactly (in steps of a 400th of the cores at most) only
    while it leaves the stage alone on fewer than all the cores: beyond, max(1, x) is x, so
    what the later stages add counts by its mean. That keeps at most ~400 totals, however many
    stages share the host."""
    unit = max(cores, 1) / 400 if cores > 4 else 0.01  # cores per step of the total
    free = max(cores - threads, 0.0) / unit  # totals below this leave the stage its own share
    exact: dict[int, list[float]] = {0: [1.0, 0.0]} if free > 0 else {}  # step -> [probability, its x total]
    beyond_mass = 0.0 if free > 0 else 1.0  # probability the total is already past `free`...
    beyond_sum = 0.0  # ... and the mean of (the total asked by others) x that probability, in cores
    for t, p in others:
        step, p = round(t / unit), min(max(p, 0.0), 1.0)
        beyond_sum += beyond_mass * p * t
        grown: dict[int, list[float]] = {}
        for asked, (q, q_total) in exact.items():
            stay = grown.setdefault(asked, [0.0, 0.0])
            stay[0] += q * (1 - p)
            stay[1] += q_total * (1 - p)
            if asked + step < free:
                more = grown.setdefault(asked + step, [0.0, 0.0])
                more[0] += q * p
                more[1] += (q_total + q * t) * p
            else:
                beyond_mass += q * p
                beyond_sum += (q_total + q * t) * p
        exact = grown
    return (sum(max(q, (q * threads + q_total) / cores) for q, q_total in exact.values())
            + (beyond_mass * threads + beyond_sum) / cores)


def stretched(profile: Profile, factors: dict[str, float]) -> Profile:
    """The profile with each node named in `factors` (shared_cores' second) computing that many
    times as long; its nodes forget their host, so pricing the result again does not stretch it twice."""
    return scaled(profile, factors, forget_hosts=True)
