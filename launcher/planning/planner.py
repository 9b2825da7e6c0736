"""The planner: from a profile to pipelines of nodes with contiguous layer ranges.

It reads a profile only (never the YAML's emulation knobs) and prices every candidate
with launcher/planning/cost_model.py (one pipeline) and launcher/planning/sync_cost.py (gradient sync
between pipelines).

* Cut of a fixed chain (launcher/planning/chain_cuts.py) — exact by a dynamic program over Pareto
  fronts of the step-time terms, memory a hard constraint; long chains use a bisection on
  the bottleneck (documented heuristic). Codecs per boundary: the least lossy that keeps
  the step within CODEC_SLACK of the most effective choice.
* Which nodes, in which order (launcher/planning/chain_candidates.py; priced by chain_search.py)
  — exhaustive over every ordered subset for clusters of up to EXHAUSTIVE_MAX_NODES nodes;
  larger clusters chain regions over their fastest links and try contiguous runs of that
  order with the k fastest nodes for a few k. Each node left out is reported with the first reason that holds, with its
  numbers (too little memory, too slow, behind a slow link, no stage to give it; _PlanFacts.reason).
* Several pipelines (data-parallel replicas) when max_pipelines > 1 (launcher/planning/replicas.py):
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

import math
import time
from dataclasses import dataclass, field, replace

from hetlaunch.launcher.planning.batch_sizes import BatchChoice, at_size, candidate_sizes, measured_sizes, per_token_error
from hetlaunch.runtime.registry import MAX_MICROBATCHES
from hetlaunch.launcher.planning.chain_cuts import cut_chain, least_lossy_codecs, most_compressed_codecs
from hetlaunch.launcher.planning.chain_candidates import EXHAUSTIVE_MAX_NODES
from hetlaunch.launcher.planning.compression import CODEC_SLACK, NONE, CompressionConfig
from hetlaunch.launcher.planning.contention import shared_cores, stretched
from hetlaunch.launcher.planning.cost_model import CostModel, in_flight
from hetlaunch.launcher.planning.gc_pause import gc_paused
from hetlaunch.launcher.planning.pipeline_cost import PipelineCost, split_costs
from hetlaunch.launcher.planning.planning_error import PlanningError
from hetlaunch.launcher.planning.profile_file import NodeProfile, Profile
from hetlaunch.launcher.planning.replicas import PipelineSet, Replicas, replica_counts
from hetlaunch.launcher.planning.sync_cost import SyncCost, plan_step_s, sync_costs
from hetlaunch.launcher.planning.topology import Topology
from hetlaunch.runtime.registry import STATIC_BYTES_PER_PARAM_BYTE
from hetlaunch.runtime.schedules import SCHEDULES, schedule_for, schedule_named, simulate, simulate_stages



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
    micro_batch_size: int = 0  # the profile's (or, with a global batch, the one chosen)
    batch: BatchChoice | None = None  # how the micro-batches were chosen for a global batch
    contention: dict[str, float] = field(default_factory=dict)  # host -> compute stretch priced (contention.py)
    sync_pricing: str = ""  # how the step's gradient-sync term was priced ("" for one pipeline)
    schedule: str = ""  # the schedule every pipeline was simulated under
    schedule_choice: str = ""  # with schedule: auto, what each candidate was priced at
    compression: CompressionConfig = field(default_factory=lambda: NONE)  # the codecs it was allowed (and pricing again is)


# What a multi-pipeline plan's step is made of, said wherever the plan is shown: the pipelines'
# steps are simulated; the sync after them is priced by launcher/planning/sync_cost.py's formula.
SYNC_PRICING = ("each pipeline's step by event simulation of its stages and windows; the gradient sync by the "
                "closed form of launcher/planning/sync_cost.py (ring or all-gather time per group, overlapped with "
                "the last backward, links shared in ready order); the plan's step is the later of the two")


EXACT_CONTENDERS_SLACK = 0.15  # sets estimated within this of the best are priced exactly before choosing


# Actions per pipeline up to which check_priced simulates Action lists in Python (apart from the
# compiled sweep the planner prices with); beyond, the compiled sweep over the schedule's lists.
INDEPENDENT_CHECK_ACTIONS = 5_000


class PlanInvariantError(RuntimeError):
    """A plan whose reported step is not the simulation of what it returns: a planner bug."""


@gc_paused
def plan(profile: Profile, num_microbatches: int, schedule: str = "1f1b", max_pipelines: int = 1,
         stages: int | None = None, compression: CompressionConfig = NONE) -> PlannerResult:
    """The best plan the cost model knows for this profile; PlanningError if none fits.

    `stages` fixes the number of stages per pipeline (default: the planner decides);
    `compression` says which codecs each boundary and each gradient sync may use (default:
    none anywhere).
    """
    started = time.perf_counter()
    if not 1 <= num_microbatches <= MAX_MICROBATCHES:
        raise PlanningError(f"{num_microbatches} micro-batches per step: from 1 to {MAX_MICROBATCHES:,}")
    if max_pipelines < 1:  # 0 divided by zero (a hostile review)
        raise PlanningError(f"max_pipelines {max_pipelines}: at least 1")
    if schedule not in SCHEDULES:  # several stages per node are planned by plan_for (launcher/planning/request.py)
        raise PlanningError(f"schedule {schedule!r}: plan() cuts one stage per node under one of {', '.join(SCHEDULES)}")
    num_layers = profile.model.num_layers
    if stages is not None and stages > num_layers:
        raise PlanningError(f"{stages} stages requested but the model has only {num_layers} layers")
    if stages is not None and stages > len(profile.nodes):
        raise PlanningError(f"{stages} stages requested but the cluster has only {len(profile.nodes)} nodes")
    method = "exhaustive" if len(profile.nodes) <= EXHAUSTIVE_MAX_NODES else "region heuristic"
    replicas = Replicas(profile, num_microbatches, schedule, compression, stages)
    best: PipelineSet | None = None
    found_sets: list[PipelineSet] = []
    for count in replica_counts(max_pipelines, len(profile.nodes), num_microbatches):
        # A set is only of use below the best so far, or within the slack of the contenders below.
        found = replicas.best_set(count, best.step_s * (1 + EXACT_CONTENDERS_SLACK) if best else math.inf)
        if found is None:
            if count == 1:
                continue
            break  # `count` replicas cannot be formed
        found_sets.append(found)
        if best is None or found.step_s < best.step_s:
            best = found
        elif count > 1:
            break  # more replicas stopped paying off; fewer is better
    if best is None:
        raise PlanningError(_why_nothing_fits(profile, num_microbatches, schedule))
    # The search ranks sets by their estimated step; what is reported is the exact price (windows
    # deepened, contention), which can reorder close contenders (on the 256-node bench, 8 pipelines
    # estimated 5% faster than 4 priced 8% slower). The two best within EXACT_CONTENDERS_SLACK are
    # priced exactly, and the faster priced one is the plan.
    contenders = [s for s in sorted(found_sets, key=lambda s: s.step_s)[:2]
                  if s.step_s <= best.step_s * (1 + EXACT_CONTENDERS_SLACK)]
    results = [_result(profile, s.pipelines, s.sync, method, started, schedule, compression,
                       _exclusion_reasons(profile, s.pipelines, schedule, stages, method == "exhaustive"))
               for s in contenders]
    return replace(max(results, key=lambda r: r.tokens_per_s), planning_s=time.perf_counter() - started)


@gc_paused
def plan_global_batch(profile: Profile, global_batch: int, schedule: str = "1f1b", max_pipelines: int = 1,
                      stages: int | None = None, compression: CompressionConfig = NONE,
                      num_microbatches: int | None = None) -> PlannerResult:
    """plan() for a global batch of samples: each candidate micro-batch size (or the one a fixed
    `num_microbatches` gives) planned at its count, the most tokens/s kept (launcher/planning/batch_sizes.py)."""
    started = time.perf_counter()
    if global_batch < 1:  # said "0 ... is more than the 16,384 micro-batches" (a hostile review)
        raise PlanningError(f"a global batch of {global_batch} samples: at least 1")
    if num_microbatches is not None and not 1 <= num_microbatches <= MAX_MICROBATCHES:  # 0 divided by zero
        raise PlanningError(f"{num_microbatches} micro-batches per step: from 1 to {MAX_MICROBATCHES:,}")
    if num_microbatches is not None and global_batch % num_microbatches:
        raise PlanningError(f"{num_microbatches} micro-batches do not divide the global batch of {global_batch}")
    sizes = ([global_batch // num_microbatches] if num_microbatches is not None
             else candidate_sizes(global_batch, profile.micro_batch_size))
    if not sizes:
        raise PlanningError(f"a global batch of {global_batch} at micro-batch sizes up to {profile.micro_batch_size} "
                            f"(the profile's) is more than the {MAX_MICROBATCHES:,} micro-batches a step may have")
    best, failure = None, None
    for size in sizes:
        try:
            found = plan(at_size(profile, size), global_batch // size, schedule, max_pipelines, stages, compression)
        except PlanningError as err:  # this size does not fit; a smaller one may
            failure = failure or err
            continue
        if best is None or found.tokens_per_s > best.tokens_per_s:
            best = found
    if best is None:
        raise failure
    choice = BatchChoice(best.micro_batch_size, global_batch // best.micro_batch_size, per_token_error(profile),
                         tuple(measured_sizes(profile)), tuple(sizes))
    return replace(best, batch=choice, planning_s=time.perf_counter() - started)


def plan_fixed_cut(profile: Profile, chain: list[str], cuts: list[tuple[int, int]], num_microbatches: int,
                   schedule: str = "1f1b", compression: CompressionConfig = NONE,
                   windows: tuple[int, ...] | None = None) -> PlannerResult:
    """Price a cut the user pinned and choose its codecs (the cut itself is not changed)."""
    started = time.perf_counter()
    cost = _pinned_cost(profile, chain, cuts, num_microbatches, schedule, compression)
    return _result(profile, [cost], [], "pinned cut", started, schedule, compression, windows=[windows])


def price_pipelines(profile: Profile, pipelines: list[tuple[list[str], list[tuple[int, int]], int]],
                    schedule: str = "1f1b", compression: CompressionConfig = NONE,
                    windows: list[tuple[int, ...] | None] | None = None) -> PlannerResult:
    """Price pinned pipelines — (node chain, layer ranges, micro-batches) each — with their
    gradient sync; codecs are chosen per boundary and per sync group, nothing else changes.
    `windows`, per pipeline, are 1F1B windows the YAML pinned (0: the stage's own): priced as
    pinned, never deepened, since the run keeps them."""
    started = time.perf_counter()
    costs = [_pinned_cost(profile, chain, cuts, m, schedule, compression) for chain, cuts, m in pipelines]
    return _result(profile, costs, sync_costs(profile, costs, compression), "pinned cut", started, schedule,
                   compression, windows=windows)


def recut(profile: Profile, pipelines: list[tuple[list[str], int]], schedule: str = "1f1b",
          compression: CompressionConfig = NONE) -> PlannerResult:
    """The best cut of each pipeline's own node chain — (chain, micro-batches) each — priced with
    their gradient sync: what a live move can reach, since it keeps every node at its place in
    its pipeline and only moves layers (launcher/adapt/live_moves.py)."""
    cut = []
    for chain, num_microbatches in pipelines:
        cost = cut_chain(CostModel(profile, num_microbatches, schedule, compression), [profile.node(n) for n in chain])
        if cost is None:
            raise PlanningError(f"no cut of the chain {' -> '.join(chain)} fits its nodes' memory")
        cut.append((chain, [(s.layer_start, s.layer_end) for s in cost.stages], num_microbatches))
    return price_pipelines(profile, cut, schedule, compression)


def _pinned_cost(profile: Profile, chain: list[str], cuts: list[tuple[int, int]], num_microbatches: int,
                 schedule: str, compression: CompressionConfig) -> PipelineCost:
    cm = CostModel(profile, num_microbatches, schedule, compression)
    nodes = [profile.node(name) for name in chain]
    return least_lossy_codecs(cm, nodes, cm.evaluate(nodes, cuts, most_compressed_codecs(cm, nodes)))


def _result(profile: Profile, costs: list[PipelineCost], sync: list[SyncCost], method: str, started: float,
            schedule: str, compression: CompressionConfig, excluded: dict[str, str] | None = None,
            windows: list[tuple[int, ...] | None] | None = None) -> PlannerResult:
    """The plan as priced by simulation: every pipeline's step from CostModel.exact, with 1F1B
    windows deepened where memory allows and it pays (CostModel.deepen), and the gradient sync
    priced again against those steps; then, where nodes share a host's cores, priced again with
    their compute stretched by that contention (launcher/planning/contention.py)."""
    result = _priced(profile, costs, sync, method, started, schedule, compression, excluded, windows)
    factors, by_node = shared_cores(profile, [p.cost for p in result.pipelines])
    if not factors:
        return result
    shared = stretched(profile, by_node)
    costs = [CostModel(shared, p.cost.num_microbatches, schedule, compression).evaluate(
        [shared.node(s.node) for s in p.cost.stages], [(s.layer_start, s.layer_end) for s in p.cost.stages],
        [s.codec for s in p.cost.stages]) for p in result.pipelines]
    sync = sync_costs(shared, costs, compression) if len(costs) > 1 else []
    contended = _priced(shared, costs, sync, method, started, schedule, compression, excluded, windows)
    return replace(contended, contention=factors)


def _priced(profile: Profile, costs: list[PipelineCost], sync: list[SyncCost], method: str, started: float,
            schedule: str, compression: CompressionConfig, excluded: dict[str, str] | None,
            windows: list[tuple[int, ...] | None] | None = None) -> PlannerResult:
    pinned = windows or [None] * len(costs)
    exact = [_finished(CostModel(profile, c.num_microbatches, schedule, compression),
                       [profile.node(s.node) for s in c.stages], c, w) for c, w in zip(costs, pinned, strict=True)]
    if exact != costs and len(costs) > 1:
        sync = sync_costs(profile, exact, compression)
    costs = exact
    for cost in costs:
        check_priced(schedule, cost)
    step_s = plan_step_s(costs, sync)
    tokens = sum(p.num_microbatches for p in costs) * profile.micro_batch_size * profile.seq_len
    index = {n.name: n for n in profile.nodes}
    return PlannerResult(pipelines=[PlannedPipeline(p, tuple(index[s.node].region for s in p.stages)) for p in costs],
                         step_s=step_s, tokens_per_s=tokens / step_s, excluded=excluded or {}, method=method,
                         planning_s=time.perf_counter() - started, sync=sync, micro_batch_size=profile.micro_batch_size,
                         sync_pricing=SYNC_PRICING if len(costs) > 1 else "", schedule=schedule,
                         compression=compression)


def fits_memory(result: PlannerResult) -> bool:
    """Does every stage of the result fit its node's memory?"""
    return all(s.memory_bytes <= s.capacity_bytes for p in result.pipelines for s in p.cost.stages)


def check_priced(schedule: str, cost: PipelineCost) -> None:
    """PlanInvariantError unless the pipeline's step is the event simulation of exactly its stages,
    windows, codecs and micro-batches, with action lists built afresh from the schedule (what
    the executor walks): a figure the plan cannot reproduce is a bug, caught where plans are made."""
    S, M = len(cost.stages), cost.num_microbatches
    rules = schedule_named(schedule)
    costs = ([s.forward_s for s in cost.stages], [s.backward_s for s in cost.stages],
             [s.link_s for s in cost.stages[:-1]], [s.latency_s for s in cost.stages[:-1]],
             [s.optimizer_s for s in cost.stages])
    if rules.forward_backward_only and 2 * S * M > INDEPENDENT_CHECK_ACTIONS:
        # Long 1F1B and GPipe schedules: their integer lists (tests/stage/test_simulation_core.py
        # holds them to the actions) through the compiled sweep (tests/stage/test_simulation_fast_path.py
        # holds it to `simulate`), which the planner priced with too; Action lists and the Python
        # simulation were a third of planning a global batch of 4,096. Shorter ones (every plan of
        # the suite's clusters) are checked apart from the planner's own pricing, as below.
        want = simulate_stages(tuple(rules.compiled_list(j, S, M, s.window) for j, s in enumerate(cost.stages)),
                               *costs)
    else:
        want = simulate([schedule_for(schedule, j, S, M, s.window) for j, s in enumerate(cost.stages)], *costs,
                        *split_costs(cost.stages))
    if not cost.exact or abs(want - cost.step_s) > 1e-9 * max(want, 1e-12):
        raise PlanInvariantError(f"planner bug: a pipeline over {', '.join(s.node for s in cost.stages)} reports "
                                 f"{cost.step_s:.6g} s per step but its stages simulate to {want:.6g} s")


def _finished(cm: CostModel, chain: list[NodeProfile], cost: PipelineCost,
              windows: tuple[int, ...] | None = None) -> PipelineCost:
    """A kept pipeline with its least lossy good-enough codecs and its deepened windows, priced
    exactly; its most effective codecs instead if relaxing them costs more than CODEC_SLACK once
    simulated (the relaxation is judged by the closed form). With `windows` pinned (any not 0),
    those windows, not deepened: the plan's step is then the step of the windows that run (it
    once reported the deepened windows' step beside pinned ones: 1.74 s against 3.5 s measured)."""
    def windowed(c: PipelineCost) -> PipelineCost:
        if windows is not None and any(windows):
            return cm.exact(chain, cm.with_windows(c, tuple(windows)))
        return cm.deepen(chain, c, thorough=True)
    effective = windowed(cost)
    relaxed = least_lossy_codecs(cm, chain, cost)
    if [s.codec for s in relaxed.stages] == [s.codec for s in cost.stages]:
        return effective
    relaxed = windowed(relaxed)
    return relaxed if relaxed.step_s <= effective.step_s * (1 + CODEC_SLACK) else effective


# A left-out node is called slower or worse connected only when it is at least this much worse
# than the worst node or link the plan uses (measured profiles differ by noise).
WORSE_MARGIN = 1.05
# ... and higher latency counts only when it is also this much higher in absolute terms.
LATENCY_MARGIN_S = 1e-3


def _sig3(value: float) -> str:
    """Three significant digits without an exponent: 0.123, 1.23, 12.3, 123 (and 1234)."""
    v = abs(value)
    decimals = 3 if v < 0.9995 else 2 if v < 9.995 else 1 if v < 99.95 else 0
    return f"{value:.{decimals}f}"


def format_bytes(n: float | None) -> str:
    """Bytes in the unit that fits, three significant digits: 512 B, 12.3 MiB, 4.00 GiB ('-' for None)."""
    if n is None:
        return "-"
    units, v = ("B", "KiB", "MiB", "GiB", "TiB", "PiB"), float(n)
    k = 0
    while abs(v) >= 999.5 and k < len(units) - 1:
        v, k = v / 1024, k + 1
    return f"{v:.0f} B" if k == 0 else f"{_sig3(v)} {units[k]}"


def _rate(bytes_per_s: float) -> str:
    units, v, k = ("B/s", "kB/s", "MB/s", "GB/s", "TB/s"), float(bytes_per_s), 0
    while v >= 999.5 and k < len(units) - 1:
        v, k = v / 1000, k + 1
    return f"{_sig3(v)} {units[k]}"


def _ms(seconds: float) -> str:
    return f"{_sig3(seconds * 1e3)} ms" if seconds * 1e3 < 999.5 else f"{_sig3(seconds)} s"


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio < 2 else f"{ratio:.1f}x"


def _exclusion_reasons(profile: Profile, pipelines: list[PipelineCost], schedule: str, stages: int | None,
                       exhaustive: bool) -> dict[str, str]:
    """node -> why the plan leaves it out, for every node no pipeline uses."""
    used_names = set(Topology.of_pipelines(p.stages for p in pipelines).nodes)
    left_out = [n for n in profile.nodes if n.name not in used_names]
    if not left_out:
        return {}
    facts = _PlanFacts(profile, pipelines, schedule, stages, exhaustive)
    return {n.name: facts.reason(n) for n in left_out}


class _PlanFacts:
    """What a left-out node is measured against: the plan's nodes, links, stages and schedule."""

    def __init__(self, profile: Profile, pipelines: list[PipelineCost], schedule: str, stages: int | None,
                 exhaustive: bool):
        self.profile, self.pipelines, self.stages, self.exhaustive = profile, pipelines, stages, exhaustive
        # The smallest share of micro-batches: the fewest in flight, so the most lenient memory need.
        cm = self.cm = CostModel(profile, min(p.num_microbatches for p in pipelines), schedule)
        L = self.L = cm.num_layers
        index = {n.name: n for n in profile.nodes}
        used_names = set(Topology.of_pipelines(p.stages for p in pipelines).nodes)
        self.used = [n for n in profile.nodes if n.name in used_names]
        # A one-layer stage where it keeps the fewest micro-batches in flight: the last stage under
        # 1F1B; every stage keeps all of them under GPipe.
        self.window = in_flight(schedule, 0, 1, cm.M)
        one_layer = [cm.memory_bytes(i, i + 1, 0, 1) for i in range(L)]
        self.smallest_stage = min(one_layer)
        self.smallest_layer = one_layer.index(self.smallest_stage)
        self.slowest = max(self.used, key=self.per_layer_s)
        self.plan_links = [cm.link(index[a.node], index[b.node])
                           for p in pipelines for a, b in zip(p.stages, p.stages[1:])]
        self.fewest_layers = min(s.layer_end - s.layer_start for p in pipelines for s in p.stages)
        self.smallest_output = min((layer.output_bytes for layer in profile.layers[:-1]), default=0)
        self.by_nodes: dict[frozenset[str], tuple[float, float]] = {}
        self.by_regions: dict[tuple[str, ...], tuple[float, float]] = {}
        for link in profile.links:  # the first entry wins, as in Profile.link
            value = (link.bandwidth_bytes_per_s, link.latency_s)
            if link.nodes is not None:
                self.by_nodes.setdefault(frozenset(link.nodes), value)
            else:
                self.by_regions.setdefault(tuple(sorted(link.regions)), value)

    def per_layer_s(self, node: NodeProfile) -> float:
        """Compute per layer and micro-batch: forward + backward + its share of the optimizer step."""
        return self.cm.compute_s(node, 0, self.L) / self.L

    def link(self, a: NodeProfile, b: NodeProfile) -> tuple[float, float] | None:
        """Profile.link's (bandwidth bytes/s, latency s) by dictionary, or None where none is measured."""
        found = self.by_nodes.get(frozenset((a.name, b.name)))
        return found if found is not None else self.by_regions.get(tuple(sorted((a.region, b.region))))

    def reason(self, node: NodeProfile) -> str:
        """The first of these that holds, with its numbers: too little memory for any one-layer stage;
        slower per layer than the slowest node used; linked to the nodes used more slowly than the
        plan's links are; room for fewer layers than any stage of the plan holds; no stage to give
        it (one layer per stage, the stage count asked for, one micro-batch); else a generic line."""
        cm, L = self.cm, self.L
        faster = "the plan is faster without it"

        if node.memory_bytes < self.smallest_stage:
            return (f"left out, too little memory: it has {format_bytes(node.memory_bytes)} and the smallest stage "
                    f"(layer {self.smallest_layer} alone, {self.window} micro-batch{'es' if self.window > 1 else ''} "
                    f"in flight under {cm.rules.title}) needs "
                    f"{format_bytes(self.smallest_stage)}")

        mine, theirs = self.per_layer_s(node), self.per_layer_s(self.slowest)
        if mine >= WORSE_MARGIN * theirs:
            return (f"left out, too slow: {_times(mine / theirs)} slower per layer than the slowest node used "
                    f"({_ms(mine)} against {_ms(theirs)} on {self.slowest.name}); {faster}")

        links = [(u, *link) for u in self.used if (link := self.link(node, u)) is not None]
        if not links:
            return "left out: the profile has no link between it and any node used"
        if self.plan_links:
            to, bandwidth, _ = max(links, key=lambda x: x[1])
            slowest_bandwidth = min(bw for bw, _ in self.plan_links)
            if bandwidth * WORSE_MARGIN <= slowest_bandwidth:
                return (f"left out, behind a slow link: its fastest link to the nodes used (to {to.name}) carries "
                        f"{_rate(bandwidth)}, the plan's slowest link {_rate(slowest_bandwidth)}; {faster}")
            to, _, latency = min(links, key=lambda x: x[2])
            highest_latency = max(lat for _, lat in self.plan_links)
            if latency >= WORSE_MARGIN * highest_latency + LATENCY_MARGIN_S:
                return (f"left out, behind a slow link: its lowest-latency link to the nodes used (to {to.name}) "
                        f"takes {_ms(latency)}, the plan's links at most {_ms(highest_latency)}; {faster}")
        elif L > 1:
            # Every pipeline is one node holding the whole model: two stages over this link cannot beat
            # that node alone once an activation takes longer to arrive than half its compute (1F1B's
            # window then holds two micro-batches for a round trip longer than the whole compute).
            def arrival(link: tuple) -> float:
                return self.smallest_output / link[1] + link[2]

            to, bandwidth, latency = min(links, key=lambda x: arrival(x) - cm.compute_s(x[0], 0, L) / 2)
            whole, arrives = cm.compute_s(to, 0, L), arrival((to, bandwidth, latency))
            if arrives >= whole / 2:
                return (f"left out, behind a slow link: {_rate(bandwidth)} and {_ms(latency)} latency to {to.name}; "
                        f"an activation would take {_ms(arrives)} to arrive, more than half the {_ms(whole)} "
                        f"{to.name} takes per micro-batch for the whole model; {faster}")

        holds = _most_layers(cm, node.memory_bytes)
        if holds < self.fewest_layers:
            return (f"left out, short of memory: its {format_bytes(node.memory_bytes)} hold at most {holds} "
                    f"layer{'s' if holds > 1 else ''}, and every stage of the plan holds at least "
                    f"{self.fewest_layers}; {faster}")

        if all(len(p.stages) >= L for p in self.pipelines):
            return (f"left out, more nodes than layers: every stage of the plan already holds a single layer "
                    f"({L} layers)")
        if self.stages is not None:
            return (f"left out: the plan has the {self.stages} stage{'s' if self.stages > 1 else ''} per pipeline "
                    f"asked for")
        if all(p.num_microbatches == 1 for p in self.pipelines):
            return (f"left out: with 1 micro-batch per step{' in each pipeline' if len(self.pipelines) > 1 else ''}, "
                    f"stages cannot overlap, so another stage would only add transfer time; {faster}")
        searched = "" if self.exhaustive else "; the region heuristic tries only some sets of nodes"
        return (f"left out: {faster}, though it is not noticeably slower, shorter of memory or worse linked than the "
                f"nodes used (another stage adds more fill, drain and transfer time than its compute saves){searched}")


def _most_layers(cm: CostModel, capacity: float) -> int:
    """The most consecutive layers that fit `capacity` as a stage with the fewest micro-batches in flight."""
    prefix = cm.memory_prefix(0, 1)
    best, start = 0, 0
    for end in range(1, cm.num_layers + 1):
        while start < end and prefix[end] - prefix[start] > capacity:
            start += 1
        best = max(best, end - start)
    return best


def _why_nothing_fits(profile: Profile, num_microbatches: int, schedule: str) -> str:
    cm = CostModel(profile, num_microbatches, schedule)
    L = cm.num_layers
    need = cm.memory_bytes(0, L, 0, 1)
    have = sum(n.memory_bytes for n in profile.nodes)
    if need > have:
        return (f"the model does not fit the cluster's memory: it needs about {format_bytes(need)} "
                f"({schedule}, {num_microbatches} micro-batches) and the nodes have {format_bytes(have)} together, "
                f"{format_bytes(need - have)} short")
    biggest = max(STATIC_BYTES_PER_PARAM_BYTE * layer.param_bytes + layer.activation_bytes for layer in profile.layers)
    return (f"no cut fits in memory: the largest layer alone needs {format_bytes(biggest)} and the per-stage "
            f"memory (parameters, gradients, AdamW state, activations in flight) exceeds what some node has")
