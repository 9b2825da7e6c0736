"""Several data-parallel pipelines: which chains, how many micro-batches each, priced with their sync.

For a replica count c the candidates are sets of c disjoint chains:

* greedy: the best chain of the cluster, then the best of the remaining nodes, and so on;
* by region: the regions are split into c groups (every split while there are at most
  MAX_REGION_SPLITS, else regions dealt by speed to the slowest group so far) and each group
  gets its best chain. This keeps each replica, and so its activations, inside its regions,
  at the price of a gradient sync across them;
* for c = 2 on clusters of up to EXHAUSTIVE_MAX_NODES nodes: every pair of disjoint chains,
  cheapest floor first (each chain's least busiest-stage time per micro-batch over the cuts that
  fit, times its share; launcher/planning/chain_bounds.py per_microbatch_floor), ending at the
  first pair whose floor cannot beat the best, and skipping a split when the larger of the two
  chains' lower bounds cannot. This search alone gives the pairs (the greedy and by-region sets
  are among the pairs it tries; beyond SPLIT_ALL_MAX_MICROBATCHES its winner is then
  rebalanced). With up to SPLIT_ALL_MAX_MICROBATCHES micro-batches it tries only the splits
  that leave each chain at most the micro-batches its bounds allow under the best
  (_most_microbatches); beyond, a pair whose chains cannot both come under the best at half
  (_half_steps) is not priced. Chains are priced under the best (ChainSearch.price's bound),
  which skips the cuts that cannot come under it and rules out a chain none of whose cuts can.

Each set gets micro-batches in proportion to throughput (split_microbatches); for c = 2
with up to SPLIT_ALL_MAX_MICROBATCHES micro-batches every split is tried, otherwise the
winning set moves single micro-batches off its slowest pipeline while that helps. Every
pipeline is cut for its own share (the remembered best cut of that chain at that count),
the gradient sync is priced (launcher/planning/sync_cost.py), and the set with the smallest plan
step wins. On small sets (POLISH_MAX_STAGES) single stage boundaries are then moved while
the plan step drops, since the sync groups follow the cuts.

Exactness: without sync cost (no parameters) the pair search is exact for c = 2 and up to
SPLIT_ALL_MAX_MICROBATCHES micro-batches. With sync, a plan whose best cut of a chain is not
that chain's best cut for its own step can be missed (tests/planning/test_planner_dp.py measures it).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from hetlaunch.launcher.planning.chain_bounds import shared_work_floor
from hetlaunch.launcher.planning.chain_cuts import most_compressed_codecs
from hetlaunch.launcher.planning.chain_search import (EXHAUSTIVE_MAX_NODES, SIMULATE_EVERY_CHAIN, ChainSearch,
                                                      candidate_chains, node_classes, node_speed, region_path)
from hetlaunch.launcher.planning.compression import CompressionConfig
from hetlaunch.launcher.planning.pipeline_cost import PipelineCost
from hetlaunch.launcher.planning.profile_file import NodeProfile, Profile
from hetlaunch.launcher.planning.sync_cost import SyncCost, SyncModel, plan_step_s

SPLIT_ALL_MAX_MICROBATCHES = 32  # two pipelines: every split tried up to this many micro-batches
POLISH_MAX_STAGES = 16  # sets with up to this many stages in all get their cuts polished for the sync
# Every split of the regions among the replicas is tried while there are at most this many
# (2 replicas over 7 regions: 63; 4 over 6: 65); beyond, regions are dealt by speed. Each split
# costs a chain search per new group of regions: all 350 splits of 7 regions into 4 about
# tripled the time to plan 256 nodes.
MAX_REGION_SPLITS = 100


@dataclass
class PipelineSet:
    pipelines: list[PipelineCost]  # each at its own share of the micro-batches
    sync: list[SyncCost]
    step_s: float


def split_microbatches(total: int, throughputs: list[float]) -> list[int]:
    """Micro-batches per pipeline in proportion to throughput, each at least 1, summing to total."""
    if total < len(throughputs):
        raise ValueError(f"{total} micro-batches cannot give each of {len(throughputs)} pipelines one")
    raw = [total * t / sum(throughputs) for t in throughputs]
    counts = [max(1, int(r)) for r in raw]
    while sum(counts) > total:  # taken from those above one: a pipeline never drops to 0 (a slow one
        # whose raw share rounds to 1 while a fast one rounds down once made a 0 there: cost_model's ÷ 0)
        i = max((k for k in range(len(counts)) if counts[k] > 1), key=lambda k: counts[k] - raw[k])
        counts[i] -= 1
    while sum(counts) < total:
        i = max(range(len(counts)), key=lambda k: raw[k] - counts[k])
        counts[i] += 1
    return counts


def replica_counts(max_pipelines: int, num_nodes: int, num_microbatches: int) -> list[int]:
    """1, 2, 4, ... up to the most pipelines possible, and that most itself."""
    limit = min(max_pipelines, num_nodes, num_microbatches)
    counts = [1]
    while counts[-1] * 2 <= limit:
        counts.append(counts[-1] * 2)
    if counts[-1] != limit:
        counts.append(limit)
    return counts


class Replicas:
    """Finds the best set of c pipelines for one profile, job and codec policy."""

    def __init__(self, profile: Profile, num_microbatches: int, schedule: str, compression: CompressionConfig,
                 stages: int | None):
        self.profile, self.M, self.schedule = profile, num_microbatches, schedule
        self.compression, self.stages = compression, stages
        self._searches: dict[int, ChainSearch] = {}
        self._paths: dict[tuple[str, ...], list[str]] = {}  # region orders, shared by every search
        self._classes = node_classes(profile)  # node signatures, shared by every search
        self._sync = SyncModel(profile)
        self._index = {n.name: n for n in profile.nodes}
        self._by_regions: dict[tuple[int, frozenset[str]], list[NodeProfile] | None] = {}
        self._most: dict[tuple, tuple[float, int]] = {}  # chain key -> (bound, _most_microbatches under it)

    def search(self, share: int) -> ChainSearch:
        if share not in self._searches:
            self._searches[share] = ChainSearch(self.profile, share, self.schedule, self.compression, self._paths,
                                                self._classes)
        return self._searches[share]

    def best_set(self, count: int, worth: float = math.inf) -> PipelineSet | None:
        """The best set of at most `count` pipelines found (fewer only if the nodes run out).
        `worth`: a step the caller has no use for a set at or above (it has a better one), so the
        exhaustive pair search prunes against it from the start; the set returned is then the
        best one only when its step is below `worth`."""
        share = max(1, self.M // count)  # a pipeline with fewer micro-batches pays relatively more bubble
        search = self.search(share)
        if count == 1:
            chain = search.best(self.profile.nodes, self.stages)
            return None if chain is None else self.price([self._nodes(chain)], [self.M])
        best, best_chains = None, None
        exhaustive = count == 2 and len(self.profile.nodes) <= EXHAUSTIVE_MAX_NODES
        # The pair search tries every pair there (at every split, or the proportional one): the
        # greedy and by-region sets are among them, and its floor-first order finds a good bound
        # without them (pricing them first cost a third of planning 6 nodes at 64 micro-batches).
        candidates = [] if exhaustive else self._candidate_sets(count, search)
        for chains in candidates:
            found = self._best_split(chains, search)
            if found is not None and (best is None or found.step_s < best.step_s):
                best, best_chains = found, chains
        if best is not None and (count > 2 or self.M > SPLIT_ALL_MAX_MICROBATCHES):
            best = self._rebalance(best_chains, best)  # only the winner: each move re-cuts chains
        if exhaustive:
            best = self._best_pair(best, worth)
            if best is not None and self.M > SPLIT_ALL_MAX_MICROBATCHES:
                best = self._rebalance([self._nodes(p) for p in best.pipelines], best)
        return None if best is None else self._polish(best)

    def price(self, chains: list[list[NodeProfile]], shares: list[int]) -> PipelineSet | None:
        """Each chain cut for its own share, plus the sync between them; None if a cut does not fit."""
        costs = []
        for chain, m in zip(chains, shares):
            cost = self.search(m).price(chain, math.inf)
            if cost is None:
                return None
            costs.append(cost)
        sync = self._sync.costs(costs, self.compression)
        return PipelineSet(costs, sync, plan_step_s(costs, sync))

    def _nodes(self, cost: PipelineCost) -> list[NodeProfile]:
        return [self._index[s.node] for s in cost.stages]

    def _candidate_sets(self, count: int, search: ChainSearch):
        """Greedy sets, then one set per split of the regions into `count` groups."""
        chains: list[list[NodeProfile]] = []
        used: set[str] = set()
        while len(chains) < count:
            extra = search.best([n for n in self.profile.nodes if n.name not in used], self.stages)
            if extra is None:
                break
            chains.append(self._nodes(extra))
            used.update(s.node for s in extra.stages)
        if chains:
            yield chains
        regions = sorted({n.region for n in self.profile.nodes})
        if count >= len(regions) and len(self.profile.nodes) > EXHAUSTIVE_MAX_NODES:
            packed = self._packed(count)
            if packed:
                yield packed
        if count > len(regions):
            return
        for groups in self._region_splits(regions, count):
            chains = [self._best_in(search, group) for group in groups]
            if all(chains):
                yield chains

    def _packed(self, count: int) -> list[list[NodeProfile]]:
        """Every node in one of `count` pipelines, each inside one region: a region gets pipelines
        in proportion to its nodes, and its nodes, fastest first, are dealt to them back and
        forth so each pipeline gets a like mix of fast and slow nodes (the cut then gives the
        slow ones fewer layers). Ordered most memory first, since the first stages keep the most
        micro-batches in flight. Many short pipelines of every node, where the other candidates
        build few long ones from the fastest."""
        by_region: dict[str, list[NodeProfile]] = {}
        for n in self.profile.nodes:
            by_region.setdefault(n.region, []).append(n)
        total, layers = len(self.profile.nodes), self.profile.model.num_layers
        chains: list[list[NodeProfile]] = []
        for members in by_region.values():
            k = max(1, min(len(members), round(count * len(members) / total)))
            groups: list[list[NodeProfile]] = [[] for _ in range(k)]
            for i, n in enumerate(sorted(members, key=node_speed, reverse=True)):
                lap, at = divmod(i, k)
                groups[at if lap % 2 == 0 else k - 1 - at].append(n)
            chains += [sorted(g, key=lambda n: (-n.memory_bytes, -node_speed(n)))[:layers] for g in groups]
        return chains

    def _region_splits(self, regions: list[str], count: int):
        """Every split while there are few; beyond, three that differ in where the links fall:
        regions dealt by speed to the weakest group; runs of the region path (each pipeline's
        regions close together, its activations on near links); and the path dealt round-robin
        (each region's sync partners its neighbours on the path, so the sync crosses near links).
        Each is priced with its sync, and the best set wins."""
        if _stirling2(len(regions), count) <= MAX_REGION_SPLITS:
            yield from _partitions(regions, count)
            return
        power = {r: sum(node_speed(n) for n in self.profile.nodes if n.region == r) for r in regions}
        groups: list[list[str]] = [[] for _ in range(count)]
        totals = [0.0] * count
        for r in sorted(regions, key=lambda r: -power[r]):  # fastest first, to the weakest group
            i = min(range(count), key=lambda k: totals[k])
            groups[i].append(r)
            totals[i] += power[r]
        yield groups
        key = tuple(sorted(regions))
        if key not in self._paths:
            self._paths[key] = region_path(self.profile, list(key))
        path, total = self._paths[key], sum(power.values())
        runs: list[list[str]] = [[]]
        done = 0.0
        for k, r in enumerate(path):
            left = len(path) - k  # every later group still needs a region
            if runs[-1] and len(runs) < count and (done >= total * len(runs) / count or left == count - len(runs)):
                runs.append([])
            runs[-1].append(r)
            done += power[r]
        if len(runs) == count:
            yield runs
        yield [path[i::count] for i in range(count)]

    def _best_in(self, search: ChainSearch, regions: list[str]) -> list[NodeProfile] | None:
        key = (search.cm.M, frozenset(regions))
        if key not in self._by_regions:
            cost = search.best([n for n in self.profile.nodes if n.region in key[1]], self.stages)
            self._by_regions[key] = None if cost is None else self._nodes(cost)
        return self._by_regions[key]

    def _splits(self, steps: list[float], shares: list[int]) -> list[list[int]]:
        """Micro-batch splits to try, from each chain's step at the share it was searched for."""
        first = split_microbatches(self.M, [m / s for m, s in zip(shares, steps)])
        if len(steps) == 2 and self.M <= SPLIT_ALL_MAX_MICROBATCHES:
            return [first] + [[m, self.M - m] for m in range(1, self.M) if m != first[0]]
        return [first]

    def _best_split(self, chains: list[list[NodeProfile]], search: ChainSearch) -> PipelineSet | None:
        if len(chains) > self.M:
            return None
        steps = [search.step(chain, math.inf) for chain in chains]
        if any(s is None for s in steps):
            return None
        best = None
        for shares in self._splits(steps, [search.cm.M] * len(chains)):
            found = self.price(chains, shares)
            if found is not None and (best is None or found.step_s < best.step_s):
                best = found
        return best

    def _rebalance(self, chains: list[list[NodeProfile]], current: PipelineSet) -> PipelineSet:
        """Move one micro-batch at a time off the slowest pipeline to the one it slows least."""
        for _ in range(len(chains)):
            shares = [p.num_microbatches for p in current.pipelines]
            slow = max(range(len(chains)), key=lambda i: current.pipelines[i].step_s)
            if shares[slow] == 1:
                break
            grown = [self.search(m + 1).step(chain, math.inf) for chain, m in zip(chains, shares)]
            targets = [i for i in range(len(chains)) if i != slow and grown[i] is not None]
            if not targets:
                break
            to = min(targets, key=lambda i: grown[i])
            shares[slow] -= 1
            shares[to] += 1
            trial = self.price(chains, shares)
            if trial is None or trial.step_s >= current.step_s:
                break
            current = trial
        return current

    def _best_pair(self, best: PipelineSet | None, worth: float) -> PipelineSet | None:
        """Every pair of disjoint chains, each at every share (or the proportional one when the
        micro-batches are many), most promising first. A pair's floor is the least, over its
        splits, of the larger of its chains' per-micro-batch floors times their shares; the
        search ends at the first pair whose floor cannot win or come under `worth`, and skips a
        split whose floor or whose chains' lower bounds cannot."""
        chains = list(candidate_chains(self.profile, self.profile.nodes, self.profile.model.num_layers, self.stages))
        one = self.search(1)  # its cuts fit wherever a larger share's do
        floors: dict[int, float] = {}
        rough = self._rough_floors(chains)
        # Pairs by a cheap floor first, refined to the chains' own floors when the pair comes up
        # (a refined floor is never lower), so only the chains of promising pairs pay for theirs.
        queue = [(_pair_floor(rough[i], rough[j], self.M), False, i, j) for i, j in _disjoint_pairs(chains)]
        heapq.heapify(queue)
        half = self.search(max(1, self.M // 2))
        seen: set[tuple] = set()
        while queue:
            floor, refined, i, j = heapq.heappop(queue)
            if floor >= min(best.step_s if best else math.inf, worth):
                break
            if not refined:
                for k in (i, j):
                    if k not in floors:
                        floors[k] = one.per_microbatch_floor(chains[k])
                heapq.heappush(queue, (_pair_floor(floors[i], floors[j], self.M), True, i, j))
                continue
            a, b = chains[i], chains[j]
            if self.M <= SPLIT_ALL_MAX_MICROBATCHES:
                bound = min(best.step_s if best else math.inf, worth)
                most_a, most_b = self._most_microbatches(a, bound), self._most_microbatches(b, bound)
                splits = [(m, self.M - m) for m in range(max(1, self.M - most_b), most_a + 1)]
            else:
                steps = self._half_steps(half, a, b, min(best.step_s if best else math.inf, worth))
                if steps is None:
                    continue
                splits = [tuple(split_microbatches(self.M, [1 / s for s in steps]))]
            for m1, m2 in splits:
                bound = min(best.step_s if best else math.inf, worth)
                if max(m1 * floors[i], m2 * floors[j]) >= bound:
                    continue
                key = (self.search(m1).key(a), m1, self.search(m2).key(b), m2)
                if key in seen:
                    continue  # the same node types in the same places: the same cost
                seen.add(key)
                first, second = self.search(m1), self.search(m2)
                if max(first.lower_bound(a), second.lower_bound(b)) >= bound:
                    continue
                step_a = first.step(a, bound)
                if step_a is None or step_a >= bound:
                    continue
                step_b = second.step(b, bound)
                if step_b is None or step_b >= bound:
                    continue
                found = self.price([a, b], [m1, m2])
                if found is not None and found.step_s < bound:
                    best = found
        return best

    def _most_microbatches(self, chain: list[NodeProfile], bound: float) -> int:
        """The most micro-batches, of 1 .. M - 1, at which the chain's bounds (ChainSearch
        lower_bound and may_beat, each over every cut that fits) leave it a chance to come under
        `bound`; 0 at none. A pair can win only at a split that gives each chain at most its
        most, so pairs of two chains that together cannot take M are never priced: at 64
        micro-batches the pair search priced hundreds of chains, each fine at half, for pairs
        whose other chain could not take the rest. Both bounds only grow with the micro-batches,
        so the most is bisected, apart in the two ranges where may_beat simulates and where it
        rules nothing out; and it only shrinks with the bound, so a tighter bound bisects below
        the last answer."""
        if math.isinf(bound):
            return self.M - 1
        key = self.search(1).key(chain)
        known = self._most.get(key)
        if known is not None and known[0] == bound:
            return known[1]
        S, top = len(chain), self.M - 1 if known is None else known[1]

        def may(m: int) -> bool:
            search = self.search(m)
            return search.cm.splits_backward(S) or (search.lower_bound(chain) < bound and search.may_beat(chain, bound))

        simulated = min(top, SIMULATE_EVERY_CHAIN // S)
        most = 0
        for low, high in ((simulated + 1, top), (1, simulated)):
            if low > high or not may(low):
                continue
            while low < high:  # may(low) holds; the last m in [low, high] where it does
                mid = (low + high + 1) // 2
                low, high = (mid, high) if may(mid) else (low, mid - 1)
            most = max(most, low)
        self._most[key] = (bound, most)
        return most

    def _half_steps(self, half: ChainSearch, a: list[NodeProfile], b: list[NodeProfile],
                    bound: float) -> list[float] | None:
        """Both chains' steps at half the micro-batches, which split them in proportion; None when
        a chain has no cut that fits, or when the pair cannot come under `bound` at that split.
        Asked under the bound first, so that a chain the bound rules out is priced in full only
        when the pair may still win (on 6 nodes at 64 micro-batches most chains the pair search
        meets are ruled out, and pricing them was most of its time):
        * neither under the bound at half: one of them takes at least half of any split, and a
          chain's step only grows with its micro-batches;
        * one, x, ruled out at half (its step s_x >= bound): the other, y, then gets at least
          M s_x / (s_x + s_y) >= M bound / (bound + s_y) micro-batches of the proportional
          split (rounded down), and if y's bounds rule it out there, at every share above too."""
        chains = (a, b)
        steps = [half.step(chain, bound) for chain in chains]
        if any(s is None and half.key(chain) in half.memo for s, chain in zip(steps, chains)):
            return None  # no cut of it fits (remembered as None), as the full pricing would find
        if all(s is None or s >= bound for s in steps):
            return None
        for k, chain in enumerate(chains):
            if steps[k] is not None:
                continue
            other, at_other = chains[1 - k], steps[1 - k]
            least = min(self.M - 1, max(1, int(self.M * bound / (bound + at_other) * (1 - 1e-12))))
            search = self.search(least)
            if search.lower_bound(other) >= bound or not search.may_beat(other, bound):
                return None
            steps[k] = half.step(chain, math.inf)
            if steps[k] is None:
                return None
        return steps

    def _rough_floors(self, chains: list[list[NodeProfile]]) -> list[float]:
        """Per chain, a floor at or below its per_microbatch_floor that depends on its node set only:
        each layer at the set's fastest node, the work shared perfectly among them (the layers'
        times alone, which every stage's per-micro-batch time includes)."""
        by_set: dict[frozenset, float] = {}
        out = []
        cm = self.search(1).cm
        for chain in chains:
            if cm.splits_backward(len(chain)):
                out.append(0.0)  # a split backward: per_microbatch_floor has none either
                continue
            names = frozenset(n.name for n in chain)
            if names not in by_set:
                by_set[names] = shared_work_floor([cm.layer_prefix(n) for n in chain])
            out.append(by_set[names])
        return out

    def _polish(self, current: PipelineSet) -> PipelineSet:
        """Each pipeline was cut for its own step; the sync groups follow the cuts, so move single
        stage boundaries by one layer while that lowers the plan step (small sets only)."""
        if sum(len(p.stages) for p in current.pipelines) > POLISH_MAX_STAGES:
            return current
        chains = [self._nodes(p) for p in current.pipelines]
        improved = True
        while improved:
            improved = False
            for i, (chain, pipeline) in enumerate(zip(chains, current.pipelines)):
                for j, delta in itertools.product(range(len(chain) - 1), (-1, 1)):
                    cuts = [[s.layer_start, s.layer_end] for s in current.pipelines[i].stages]
                    cuts[j][1] += delta
                    cuts[j + 1][0] += delta
                    if cuts[j][1] <= cuts[j][0] or cuts[j + 1][1] <= cuts[j + 1][0]:
                        continue
                    better = self._with_cut(current, i, chain, cuts)
                    if better is not None:
                        current, improved = better, True
        return current

    def _with_cut(self, current: PipelineSet, i: int, chain: list[NodeProfile],
                  cuts: list[list[int]]) -> PipelineSet | None:
        """The set with pipeline i cut at `cuts`, if it fits and lowers the plan step; else None."""
        cm = self.search(current.pipelines[i].num_microbatches).cm
        moved = cm.evaluate(chain, [tuple(c) for c in cuts], most_compressed_codecs(cm, chain))
        if any(s.memory_bytes > s.capacity_bytes for s in moved.stages):
            return None
        costs = current.pipelines[:i] + [moved] + current.pipelines[i + 1:]
        sync = self._sync.costs(costs, self.compression)
        step = plan_step_s(costs, sync)
        return PipelineSet(costs, sync, step) if step < current.step_s * (1 - 1e-12) else None


def _disjoint_pairs(chains: list[list[NodeProfile]]):
    """(i, j), i < j, for every two chains without a node in common: by node set, so the pairs
    that share a node are never looked at (six nodes have some 1,900 chains, 1.9 million pairs
    and 4,000 disjoint ones)."""
    bits: dict[str, int] = {}
    by_mask: dict[int, list[int]] = {}
    for i, chain in enumerate(chains):
        mask = 0
        for n in chain:
            mask |= 1 << bits.setdefault(n.name, len(bits))
        by_mask.setdefault(mask, []).append(i)
    masks = sorted(by_mask)
    for x, first in enumerate(masks):
        for second in masks[x + 1:]:
            if first & second:
                continue
            for i in by_mask[first]:
                for j in by_mask[second]:
                    yield (i, j) if i < j else (j, i)


def _pair_floor(first: float, second: float, total: int) -> float:
    """The least, over splits m + (total - m) with each at least 1, of max(m first, (total - m) second)."""
    if total < 2:
        return math.inf
    balanced = total * second / (first + second) if first + second > 0 else 1.0
    if math.isnan(balanced):  # both floors infinite
        return math.inf
    candidates = {1, total - 1}
    if math.isfinite(balanced):
        candidates |= {min(max(int(balanced) + k, 1), total - 1) for k in (0, 1)}
    return min(max(m * first, (total - m) * second) for m in candidates)


def _stirling2(n: int, k: int) -> int:
    """How many ways n items split into k non-empty groups."""
    row = [1] + [0] * k  # S(0, j)
    for i in range(1, n + 1):
        row = [0] + [j * row[j] + row[j - 1] for j in range(1, k + 1)]
    return row[k]


def _partitions(items: list[str], count: int):
    """Every split of items into exactly `count` non-empty groups (order of groups ignored)."""
    def grow(i: int, groups: list[list[str]]):
        if len(groups) + len(items) - i < count:
            return
        if i == len(items):
            yield [list(g) for g in groups]
            return
        for g in groups:
            g.append(items[i])
            yield from grow(i + 1, groups)
            g.pop()
        if len(groups) < count:
            groups.append([items[i]])
            yield from grow(i + 1, groups)
            groups.pop()
    yield from grow(0, [])
