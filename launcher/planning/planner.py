"""The planner: from a profile to pipelines of nodes with contiguous layer ranges.

It reads a profile only (never the YAML's emulation knobs) and prices every candidate
with launcher/cost_model.py (one pipeline) and launcher/sync_cost.py (gradient sync
between pipelines).

* Cut of a fixed chain (launcher/chain_cuts.py) — exact by a dynamic program over Pareto
  fronts of the step-time terms, memory a hard constraint; long chains use a bisection on
  the bottleneck (documented heuristic). Codecs per boundary: the least lossy that keeps
  the step within CODEC_SLACK of the most effective choice.
* Which nodes, in which order (launcher/chain_search.py) — exhaustive over every ordered
  subset for clusters of up to EXHAUSTIVE_MAX_NODES nodes; larger clusters chain regions
  over their fastest links and try contiguous runs of that order with the k fastest nodes
  for a few k. Nodes not used are reported with the reason.
* Several pipelines (data-parallel replicas) when max_pipelines > 1 (launcher/replicas.py):
  1, 2, 4, ... replicas are tried while more pay off. For each count, sets of disjoint
  chains come from a greedy pick, from splitting the regions among the replicas (replicas
  inside regions, activations off the slow links) and, for two replicas on a small
  cluster, from every pair of chains. Micro-batches are split by throughput (every split
  for two replicas and few micro-batches), each pipeline is cut for its share, and the
  gradient sync between the holders of each layer is priced with its overlap with the
  last backward and its codec (`compression.sync`); the plan's step is the slowest
  pipeline or the last sync, whichever ends later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hetlaunch.launcher.planning.chain_cuts import least_lossy_codecs, most_compressed_codecs
from hetlaunch.launcher.planning.chain_search import EXHAUSTIVE_MAX_NODES
from hetlaunch.launcher.planning.compression import NONE, CompressionConfig
from hetlaunch.launcher.planning.cost_model import CostModel, PipelineCost
from hetlaunch.launcher.planning.profile_file import NodeProfile, Profile
from hetlaunch.launcher.planning.replicas import PipelineSet, Replicas, replica_counts
from hetlaunch.launcher.planning.sync_cost import SyncCost, plan_step_s, sync_costs
from hetlaunch.runtime.registry import STATIC_BYTES_PER_PARAM_BYTE


class PlanningError(Exception):
    """One-line reason no plan exists."""


@dataclass(frozen=True)
class PlannedPipeline:
    cost: PipelineCost  # cost.num_microbatches is this pipeline's share of the step's micro-batches
    regions: tuple[str, ...]


@dataclass
class PlannerResult:
    pipelines: list[PlannedPipeline]
    step_s: float  # the whole plan's step: slowest pipeline or last gradient sync
    tokens_per_s: float
    excluded: dict[str, str] = field(default_factory=dict)
    method: str = ""
    planning_s: float = 0.0
    sync: list[SyncCost] = field(default_factory=list)  # one per sync group; [] for one pipeline


def plan(profile: Profile, num_microbatches: int, schedule: str = "1f1b", max_pipelines: int = 1,
         stages: int | None = None, compression: CompressionConfig = NONE) -> PlannerResult:
    """The best plan the cost model knows for this profile; PlanningError if none fits.

    `stages` fixes the number of stages per pipeline (default: the planner decides);
    `compression` says which codecs each boundary and each gradient sync may use (default:
    none anywhere).
    """
    started = time.perf_counter()
    num_layers = profile.model.num_layers
    if stages is not None and stages > num_layers:
        raise PlanningError(f"{stages} stages requested but the model has only {num_layers} layers")
    if stages is not None and stages > len(profile.nodes):
        raise PlanningError(f"{stages} stages requested but the cluster has only {len(profile.nodes)} nodes")
    method = "exhaustive" if len(profile.nodes) <= EXHAUSTIVE_MAX_NODES else "region heuristic"
    replicas = Replicas(profile, num_microbatches, schedule, compression, stages)
    best: PipelineSet | None = None
    for count in replica_counts(max_pipelines, len(profile.nodes), num_microbatches):
        found = replicas.best_set(count)
        if found is None:
            if count == 1:
                continue
            break  # `count` replicas cannot be formed
        if best is None or found.step_s < best.step_s:
            best = found
        elif count > 1:
            break  # more replicas stopped paying off; fewer is better
    if best is None:
        raise PlanningError(_why_nothing_fits(profile, num_microbatches, schedule))
    used = {s.node for p in best.pipelines for s in p.stages}
    excluded = {n.name: _exclusion_reason(profile, n) for n in profile.nodes if n.name not in used}
    return _result(profile, best.pipelines, best.sync, method, started, excluded)


def plan_fixed_cut(profile: Profile, chain: list[str], cuts: list[tuple[int, int]], num_microbatches: int,
                   schedule: str = "1f1b", compression: CompressionConfig = NONE) -> PlannerResult:
    """Price a cut the user pinned and choose its codecs (the cut itself is not changed)."""
    started = time.perf_counter()
    cost = _pinned_cost(profile, chain, cuts, num_microbatches, schedule, compression)
    return _result(profile, [cost], [], "pinned cut", started)


def price_pipelines(profile: Profile, pipelines: list[tuple[list[str], list[tuple[int, int]], int]],
                    schedule: str = "1f1b", compression: CompressionConfig = NONE) -> PlannerResult:
    """Price pinned pipelines — (node chain, layer ranges, micro-batches) each — with their
    gradient sync; codecs are chosen per boundary and per sync group, nothing else changes."""
    started = time.perf_counter()
    costs = [_pinned_cost(profile, chain, cuts, m, schedule, compression) for chain, cuts, m in pipelines]
    return _result(profile, costs, sync_costs(profile, costs, compression), "pinned cut", started)


def _pinned_cost(profile: Profile, chain: list[str], cuts: list[tuple[int, int]], num_microbatches: int,
                 schedule: str, compression: CompressionConfig) -> PipelineCost:
    cm = CostModel(profile, num_microbatches, schedule, compression)
    nodes = [profile.node(name) for name in chain]
    return least_lossy_codecs(cm, nodes, cm.evaluate(nodes, cuts, most_compressed_codecs(cm, nodes)))


def _result(profile: Profile, costs: list[PipelineCost], sync: list[SyncCost], method: str, started: float,
            excluded: dict[str, str] | None = None) -> PlannerResult:
    step_s = plan_step_s(costs, sync)
    tokens = sum(p.num_microbatches for p in costs) * profile.micro_batch_size * profile.seq_len
    index = {n.name: n for n in profile.nodes}
    return PlannerResult(pipelines=[PlannedPipeline(p, tuple(index[s.node].region for s in p.stages)) for p in costs],
                         step_s=step_s, tokens_per_s=tokens / step_s, excluded=excluded or {}, method=method,
                         planning_s=time.perf_counter() - started, sync=sync)


def _exclusion_reason(profile: Profile, node: NodeProfile) -> str:
    if len(profile.nodes) > profile.model.num_layers:
        return "not used: more nodes than layers, and the plan is faster without it"
    return "left out: the plan is faster without it (too slow, too little memory, or behind a slow link)"


def _why_nothing_fits(profile: Profile, num_microbatches: int, schedule: str) -> str:
    cm = CostModel(profile, num_microbatches, schedule)
    L = cm.num_layers
    need = cm.memory_bytes(0, L, 0, 1)
    have = sum(n.memory_bytes for n in profile.nodes)
    if need > have:
        return (f"the model does not fit the cluster's memory: it needs about {need / 2**30:.2f} GiB "
                f"({schedule}, {num_microbatches} micro-batches) and the nodes have {have / 2**30:.2f} GiB together, "
                f"{(need - have) / 2**30:.2f} GiB short")
    biggest = max(STATIC_BYTES_PER_PARAM_BYTE * layer.param_bytes + layer.activation_bytes for layer in profile.layers)
    return (f"no cut fits in memory: the largest layer alone needs {biggest / 2**30:.3f} GiB and the per-stage "
            f"memory (parameters, gradients, AdamW state, activations in flight) exceeds what some node has")
