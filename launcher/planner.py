"""The planner: from a profile to pipelines of nodes with contiguous layer ranges.

It reads a profile only (never the YAML's emulation knobs) and prices every candidate
with launcher/cost_model.py.

* Cut of a fixed chain — exact. A dynamic program over (stage, last layer) keeps, per
  state, the Pareto front of (max term, sum term) of the step-time formula; the step time
  is increasing in both, so the optimum is on the front. Memory is a hard constraint.
  Chains with stages x layers² above EXACT_MAX_WORK use a bisection on the bottleneck with a
  greedy fill (documented heuristic; exact for the bottleneck when links are uniform).
* Which nodes, in which order — exhaustive over every ordered subset for clusters of up to
  EXHAUSTIVE_MAX_NODES nodes. Larger clusters use region-level ordering: regions are
  chained to minimise the time spent crossing between them (all orders for up to 7
  regions, greedy beyond), every contiguous run of that region order is a candidate, and
  inside it the k fastest nodes for a few k (each region's nodes stay together, sorted by
  memory so the stages that keep most micro-batches in flight get the most memory).
  Nodes not used are reported with the reason.
* Several pipelines (data-parallel replicas) when max_pipelines > 1: after the best
  pipeline, the best one from the remaining nodes is added while it lowers the predicted
  step time; micro-batches are split in proportion to each pipeline's throughput.
  (Gradient synchronisation between replicas is not priced yet.)
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from dataclasses import dataclass, field

from hetlaunch.launcher.compression import LOSSINESS, NONE, CompressionConfig
from hetlaunch.launcher.cost_model import CostModel, PipelineCost
from hetlaunch.launcher.profile import NodeProfile, Profile

EXHAUSTIVE_MAX_NODES = 6
EXACT_MAX_WORK = 20_000  # stages x layers^2 up to which a chain's cut is found by the exact DP


class PlanningError(Exception):
    """One-line reason no plan exists."""


@dataclass(frozen=True)
class PlannedPipeline:
    cost: PipelineCost
    regions: tuple[str, ...]


@dataclass
class PlannerResult:
    pipelines: list[PlannedPipeline]
    step_s: float
    tokens_per_s: float
    excluded: dict[str, str] = field(default_factory=dict)
    method: str = ""
    planning_s: float = 0.0


def best_cuts(cm: CostModel, chain: list[NodeProfile]) -> PipelineCost | None:
    """The exact best layer ranges (and boundary codecs) for a fixed chain, or None if no cut fits.

    The program runs from the last stage back: a state (j, i) means stages j..S-1 hold
    layers [i, L). Its points are (compute max, link max, 1F1B window max, suffix sum,
    next start, next point, codec out of stage j); the suffix sum is the round trip from
    stage j to the end, which the 1F1B window term needs. The step time is increasing in
    every coordinate and every later term is increasing in them too, so keeping only
    undominated points is exact.
    """
    S, L = len(chain), cm.num_layers
    if S > L:
        return None
    one_max = cm.schedule != "gpipe"  # 1F1B's step depends on max(compute, link, window) only
    fronts: list[dict[int, list[tuple]]] = [dict() for _ in range(S)]
    last = chain[-1]
    for i in range(S - 1, L):
        if cm.memory_bytes(i, L, S - 1, S) <= last.memory_bytes:
            t = cm.compute_s(last, i, L)
            fronts[S - 1][i] = [(t, 0.0, cm.window_term(t, S - 1, S), t, L, -1, "none")]
    for j in range(S - 2, -1, -1):
        node, next_node = chain[j], chain[j + 1]
        options = cm.codec_options(j, node, next_node)
        for i in range(j, L - (S - j) + 1):
            candidates = []
            for end, front in fronts[j + 1].items():
                if end <= i or cm.memory_bytes(i, end, j, S) > node.memory_bytes:
                    continue
                t = cm.compute_s(node, i, end)
                for codec in options:
                    c, lat = cm.boundary_s(node, next_node, end - 1, codec)
                    tc = t + cm.codec_s(node, end - 1, codec)
                    for k, (mt, mc, w, s, *_) in enumerate(front):
                        total = s + tc + 2 * (lat + c)
                        candidates.append((max(mt, tc), max(mc, c), max(w, cm.window_term(total, j, S)), total,
                                           end, k, codec))
            if candidates:
                fronts[j][i] = _pareto(candidates, one_max)
    start = fronts[0].get(0)
    if not start:
        return None
    k = min(range(len(start)), key=lambda n: cm.step_s(start[n][0], start[n][1], start[n][3], start[n][2]))
    cuts, codecs, i = [], [], 0
    for j in range(S):
        *_, end, next_k, codec = fronts[j][i][k]
        cuts.append((i, end))
        codecs.append(codec)
        i, k = end, next_k
    return cm.evaluate(chain, cuts, codecs[:-1])


def _pareto(points: list[tuple], one_max: bool) -> list[tuple]:
    """Drop every point another point beats or ties on all of (compute max, link max, window max, sum).

    Under 1F1B only max(compute, link, window) matters, which makes the front
    two-dimensional; GPipe has no window term and prices compute and link apart."""
    if one_max:
        points.sort(key=lambda p: (max(p[0], p[1], p[2]), p[3]))
        kept, best_sum = [], math.inf
        for p in points:
            if p[3] < best_sum:
                kept.append(p)
                best_sum = p[3]
        return kept
    points.sort(key=lambda p: (p[0], p[1], p[3]))
    kept: list[tuple] = []
    for p in points:
        if not any(q[1] <= p[1] and q[3] <= p[3] for q in kept):  # kept ones have q[0] <= p[0]
            kept.append(p)
    return kept


def most_compressed_codecs(cm: CostModel, chain: list[NodeProfile]) -> list[str]:
    """Per boundary, the allowed codec with the shortest link time; `least_lossy_codecs` relaxes it."""
    return [min(cm.codec_options(j, a, b), key=lambda codec: cm.boundary_s(a, b, 0, codec)[0])
            for j, (a, b) in enumerate(zip(chain, chain[1:]))]


def bottleneck_cuts(cm: CostModel, chain: list[NodeProfile]) -> PipelineCost | None:
    """Heuristic for long chains: bisect the bottleneck, greedily filling each stage under it."""
    S, L = len(chain), cm.num_layers
    if S > L:
        return None

    times = [cm.time_prefix(node) for node in chain]
    squeezed = most_compressed_codecs(cm, chain)
    memories = [cm.memory_prefix(j, S) for j in range(S)]

    def fill(limit: float) -> list[tuple[int, int]] | None:
        """Give each stage as many layers as fit under the limit (time and memory are monotone in
        the range, so the furthest end is found by bisection on prefix sums)."""
        cuts, start = [], 0
        for j, node in enumerate(chain):
            last = L if j == S - 1 else L - (S - 1 - j)
            acc, mem = times[j], memories[j]
            end = min(bisect.bisect_right(acc, acc[start] + limit) - 1,
                      bisect.bisect_right(mem, mem[start] + node.memory_bytes) - 1, last)
            if end <= start or (j == S - 1 and end < L):
                return None
            if j < S - 1 and cm.boundary_s(node, chain[j + 1], end - 1, squeezed[j])[0] > limit:
                return None
            cuts.append((start, end))
            start = end
        return cuts

    biggest = max(layer.output_bytes for layer in cm.profile.layers)  # uncompressed: an upper bound
    slowest_link = max((biggest / cm.link(a, b)[0] for a, b in zip(chain, chain[1:])), default=0.0)
    lo, hi = 0.0, max(cm.compute_s(n, 0, L) for n in chain) + slowest_link
    best = fill(hi)
    if best is None:
        return None
    for _ in range(30):  # to a billionth of the starting interval
        mid = (lo + hi) / 2
        cuts = fill(mid)
        if cuts is None:
            lo = mid
        else:
            hi, best = mid, cuts
    return cm.evaluate(chain, best, squeezed)


def cut_chain(cm: CostModel, chain: list[NodeProfile]) -> PipelineCost | None:
    exact = len(chain) * cm.num_layers ** 2 <= EXACT_MAX_WORK
    cost = best_cuts(cm, chain) if exact else bottleneck_cuts(cm, chain)
    return None if cost is None else least_lossy_codecs(cm, chain, cost)


CODEC_SLACK = 0.02  # a less lossy codec is taken if the step gets at most this much slower


def least_lossy_codecs(cm: CostModel, chain: list[NodeProfile], cost: PipelineCost) -> PipelineCost:
    """Per boundary, the least lossy allowed codec that keeps the link off the critical path:
    the predicted step stays within CODEC_SLACK of the best codec choice's. `none` wherever the
    raw link is fast enough; a lossier codec only where it really buys time."""
    cuts = [(s.layer_start, s.layer_end) for s in cost.stages]
    codecs = [s.codec for s in cost.stages[:-1]]
    limit = cost.step_s * (1 + CODEC_SLACK)
    for j, (a, b) in enumerate(zip(chain, chain[1:])):
        for codec in sorted(cm.codec_options(j, a, b), key=LOSSINESS.index):
            if codec == codecs[j]:
                break  # the cut's own choice is the least lossy that is good enough
            trial = cm.evaluate(chain, cuts, codecs[:j] + [codec] + codecs[j + 1:])
            if trial.step_s <= limit:
                codecs[j] = codec
                break
    return cm.evaluate(chain, cuts, codecs)


def _speed(node: NodeProfile) -> float:
    return 1.0 / max(sum(node.layer_seconds), 1e-12)


def _region_path(profile: Profile, regions: list[str]) -> list[str]:
    """Order regions so the chain crosses between them over the fastest links."""
    if len(regions) <= 1:
        return regions
    reps = {r: next(n for n in profile.nodes if n.region == r) for r in regions}

    def hop(a: str, b: str) -> float:
        return 1.0 / profile.link(reps[a], reps[b]).bandwidth_bytes_per_s

    if len(regions) <= 7:
        return list(min(itertools.permutations(regions), key=lambda p: sum(hop(a, b) for a, b in zip(p, p[1:]))))
    best = None
    for start in regions:
        path, left = [start], set(regions) - {start}
        while left:
            nxt = min(left, key=lambda r: hop(path[-1], r))
            path.append(nxt)
            left.remove(nxt)
        cost = sum(hop(a, b) for a, b in zip(path, path[1:]))
        if best is None or cost < best[0]:
            best = (cost, path)
    return best[1]


def _candidate_chains(profile: Profile, nodes: list[NodeProfile], num_layers: int, stages: int | None):
    """Ordered node chains to price: every ordered subset when small, region-level heuristics when large."""
    if len(nodes) <= EXHAUSTIVE_MAX_NODES:
        for k in range(1, min(len(nodes), num_layers) + 1):
            if stages is None or k == stages:
                yield from (list(p) for p in itertools.permutations(nodes, k))
        return
    path = _region_path(profile, sorted({n.region for n in nodes}))
    for a in range(len(path)):
        for b in range(a + 1, len(path) + 1):
            run = set(path[a:b])
            members = [n for n in nodes if n.region in run]
            fastest = sorted(members, key=_speed, reverse=True)
            limit = min(len(members), num_layers)
            sizes = sorted({k for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, limit) if k <= limit})
            if stages is not None:
                sizes = [stages] if stages <= limit else []
            for k in sizes:
                chosen = set(id(n) for n in fastest[:k])
                # Keep each region's nodes together, in region-path order; most memory first.
                yield [n for r in path[a:b] for n in sorted((m for m in members if m.region == r and id(m) in chosen),
                                                            key=lambda m: (-m.memory_bytes, -_speed(m)))]


class _Search:
    """Prices chains for one micro-batch count, remembering chains it has seen.

    Nodes with the same region, memory and timings are interchangeable unless a link was
    measured for the node itself, so a chain is remembered by those signatures: a large
    cluster of a few device types prices each distinct chain once.
    """

    def __init__(self, profile: Profile, num_microbatches: int, schedule: str, compression: CompressionConfig):
        self.profile = profile
        self.cm = CostModel(profile, num_microbatches, schedule, compression)
        linked = {name for link in profile.links if link.nodes for name in link.nodes}
        self.signature = {n.name: n.name if n.name in linked else
                          (n.region, n.memory_bytes, tuple(n.layer_seconds), tuple(n.optimizer_seconds or ()))
                          for n in profile.nodes}
        self.memo: dict[tuple, tuple[list[tuple[int, int]], list[str]] | None] = {}

    def price(self, chain: list[NodeProfile], bound: float) -> PipelineCost | None:
        key = tuple(self.signature[n.name] for n in chain)
        if key in self.memo:
            known = self.memo[key]
            return None if known is None else self.cm.evaluate(chain, *known)
        if self._lower_bound(chain) >= bound:
            return None  # cannot beat the best so far; not remembered, a later bound may be looser
        cost = cut_chain(self.cm, chain)
        self.memo[key] = None if cost is None else ([(s.layer_start, s.layer_end) for s in cost.stages],
                                                    [s.codec for s in cost.stages[:-1]])
        return cost

    def _lower_bound(self, chain: list[NodeProfile]) -> float:
        """Every layer at its fastest node in the chain, perfectly balanced, links free."""
        cm = self.cm
        distinct = {self.signature[n.name]: n for n in chain}.values()
        work = sum(min(cm.compute_s(n, i, i + 1) for n in distinct) for i in range(cm.num_layers))
        return cm.step_s(work / len(chain), 0.0, work)

    def best(self, nodes: list[NodeProfile], stages: int | None) -> PipelineCost | None:
        best = None
        for chain in _candidate_chains(self.profile, nodes, self.cm.num_layers, stages):
            cost = self.price(chain, best.step_s if best else math.inf)
            if cost is not None and (best is None or cost.step_s < best.step_s):
                best = cost
        return best


def split_microbatches(total: int, throughputs: list[float]) -> list[int]:
    """Micro-batches per pipeline in proportion to throughput, each at least 1, summing to total."""
    raw = [total * t / sum(throughputs) for t in throughputs]
    counts = [max(1, int(r)) for r in raw]
    while sum(counts) > total:
        i = max(range(len(counts)), key=lambda k: counts[k] - raw[k])
        counts[i] -= 1
    while sum(counts) < total:
        i = max(range(len(counts)), key=lambda k: raw[k] - counts[k])
        counts[i] += 1
    return counts


def plan(profile: Profile, num_microbatches: int, schedule: str = "1f1b", max_pipelines: int = 1,
         stages: int | None = None, compression: CompressionConfig = NONE) -> PlannerResult:
    """The best plan the cost model knows for this profile; PlanningError if none fits.

    `stages` fixes the number of stages per pipeline (default: the planner decides);
    `compression` says which codecs each boundary may use (default: none anywhere).
    """
    started = time.perf_counter()
    num_layers = profile.model.num_layers
    if stages is not None and stages > num_layers:
        raise PlanningError(f"{stages} stages requested but the model has only {num_layers} layers")
    if stages is not None and stages > len(profile.nodes):
        raise PlanningError(f"{stages} stages requested but the cluster has only {len(profile.nodes)} nodes")
    tokens = num_microbatches * profile.micro_batch_size * profile.seq_len
    method = "exhaustive" if len(profile.nodes) <= EXHAUSTIVE_MAX_NODES else "region heuristic"
    searches: dict[int, _Search] = {}
    best: list[PipelineCost] | None = None
    # Try 1, 2, 4, ... replicas; each replica is searched for its expected share of the
    # micro-batches, since a pipeline that gets fewer of them pays relatively more bubble.
    for count in _replica_counts(max_pipelines, len(profile.nodes), num_microbatches):
        share = max(1, num_microbatches // count)
        search = searches.setdefault(share, _Search(profile, share, schedule, compression))
        pipelines: list[PipelineCost] = []
        while len(pipelines) < count:
            used = {s.node for p in pipelines for s in p.stages}
            extra = search.best([n for n in profile.nodes if n.name not in used], stages)
            if extra is None:
                break
            pipelines.append(extra)
        if not pipelines:
            continue
        priced = _priced(profile, pipelines, num_microbatches, schedule, compression)
        if best is None or max(p.step_s for p in priced) < max(p.step_s for p in best):
            best = priced
        elif len(pipelines) < count or count > 1:
            break  # more replicas stopped paying off (or could not be formed); fewer is better
    if best is None:
        raise PlanningError(_why_nothing_fits(profile, num_microbatches, schedule))
    step_s = max(p.step_s for p in best)
    used = {s.node for p in best for s in p.stages}
    excluded = {n.name: _exclusion_reason(profile, n) for n in profile.nodes if n.name not in used}
    return PlannerResult(
        pipelines=[PlannedPipeline(p, tuple(profile.node(s.node).region for s in p.stages)) for p in best],
        step_s=step_s, tokens_per_s=tokens / step_s, excluded=excluded, method=method,
        planning_s=time.perf_counter() - started)


def plan_fixed_cut(profile: Profile, chain: list[str], cuts: list[tuple[int, int]], num_microbatches: int,
                   schedule: str = "1f1b", compression: CompressionConfig = NONE) -> PlannerResult:
    """Price a cut the user pinned and choose its codecs (the cut itself is not changed)."""
    started = time.perf_counter()
    cm = CostModel(profile, num_microbatches, schedule, compression)
    nodes = [profile.node(name) for name in chain]
    cost = least_lossy_codecs(cm, nodes, cm.evaluate(nodes, cuts, most_compressed_codecs(cm, nodes)))
    tokens = num_microbatches * profile.micro_batch_size * profile.seq_len
    return PlannerResult(pipelines=[PlannedPipeline(cost, tuple(n.region for n in nodes))], step_s=cost.step_s,
                         tokens_per_s=tokens / cost.step_s, method="pinned cut",
                         planning_s=time.perf_counter() - started)


def _replica_counts(max_pipelines: int, num_nodes: int, num_microbatches: int) -> list[int]:
    limit = min(max_pipelines, num_nodes, num_microbatches)
    counts = [1]
    while counts[-1] * 2 <= limit:
        counts.append(counts[-1] * 2)
    if counts[-1] != limit:
        counts.append(limit)
    return counts


def _priced(profile: Profile, pipelines: list[PipelineCost], total: int, schedule: str,
            compression: CompressionConfig) -> list[PipelineCost]:
    """Re-cost each pipeline with its share of the micro-batches (cuts and codecs kept)."""
    shares = [total] if len(pipelines) == 1 else split_microbatches(
        total, [p.num_microbatches / p.step_s for p in pipelines])
    return [CostModel(profile, m, schedule, compression).evaluate(
                [profile.node(s.node) for s in p.stages], [(s.layer_start, s.layer_end) for s in p.stages],
                [s.codec for s in p.stages[:-1]])
            for p, m in zip(pipelines, shares)]


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
    biggest = max(4 * layer.param_bytes + layer.activation_bytes for layer in profile.layers)
    return (f"no cut fits in memory: the largest layer alone needs {biggest / 2**30:.3f} GiB and the per-stage "
            f"memory (parameters, gradients, AdamW state, activations in flight) exceeds what some node has")
