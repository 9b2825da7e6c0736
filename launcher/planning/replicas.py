"""Several data-parallel pipelines: which chains, how many micro-batches each, priced with their sync.

For a replica count c the candidates are sets of c disjoint chains:

* greedy: the best chain of the cluster, then the best of the remaining nodes, and so on;
* by region: the regions are split into c groups (every split while there are at most
  MAX_REGION_SPLITS, else regions dealt by speed to the slowest group so far) and each group
  gets its best chain. This keeps each replica, and so its activations, inside its regions,
  at the price of a gradient sync across them;
* for c = 2 on clusters of up to EXHAUSTIVE_MAX_NODES nodes: every pair of disjoint chains
  (launcher/planning/pair_search.py). This search alone gives the pairs (the greedy and
  by-region sets are among the pairs it tries).

Each set gets micro-batches in proportion to throughput (split_microbatches); for c = 2
with up to SPLIT_ALL_MAX_MICROBATCHES micro-batches every split is tried (on small clusters,
beyond, the pair search's splits either side of where the two steps cross), otherwise the
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

import itertools
import math

from hetlaunch.launcher.planning.chain_cuts import most_compressed_codecs
from hetlaunch.launcher.planning.chain_candidates import EXHAUSTIVE_MAX_NODES, node_speed, region_path
from hetlaunch.launcher.planning.chain_search import ChainSearch, node_classes
from hetlaunch.launcher.planning.compression import CompressionConfig
from hetlaunch.launcher.planning.pair_search import SPLIT_ALL_MAX_MICROBATCHES, PairSearch
from hetlaunch.launcher.planning.pipeline_cost import PipelineCost
from hetlaunch.launcher.planning.pipeline_set import PipelineSet, split_microbatches
from hetlaunch.launcher.planning.profile_file import NodeProfile, Profile
from hetlaunch.launcher.planning.sync_cost import SyncModel, plan_step_s

__all__ = ["PipelineSet", "Replicas", "replica_counts", "split_microbatches"]  # the last two from pipeline_set.py

POLISH_MAX_STAGES = 16  # sets with up to this many stages in all get their cuts polished for the sync
# Every split of the regions among the replicas is tried while there are at most this many
# (2 replicas over 7 regions: 63; 4 over 6: 65); beyond, regions are dealt by speed. Each split
# costs a chain search per new group of regions: all 350 splits of 7 regions into 4 about
# tripled the time to plan 256 nodes.
MAX_REGION_SPLITS = 100


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
        self._sync_floors: dict[tuple[str, str, int], float] = {}
        self._index = {n.name: n for n in profile.nodes}
        self._by_regions: dict[tuple[int, frozenset[str]], list[NodeProfile] | None] = {}

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
        # The pair search tries every pair there (at every split, or those either side of where
        # the two steps cross): the greedy and by-region sets are among them, and its floor-first
        # order finds a good bound without them (pricing them first cost a third of planning 6
        # nodes at 8 micro-batches, and 5-25% at 48 and 64).
        candidates = [] if exhaustive else self._candidate_sets(count, search)
        for chains in candidates:
            found = self._best_split(chains, search)
            if found is not None and (best is None or found.step_s < best.step_s):
                best, best_chains = found, chains
        if best is not None and (count > 2 or self.M > SPLIT_ALL_MAX_MICROBATCHES):
            best = self._rebalance(best_chains, best)  # only the winner: each move re-cuts chains
        if exhaustive:
            best = PairSearch(self).best(best, worth)
        return None if best is None else self._polish(best)

    def price(self, chains: list[list[NodeProfile]], shares: list[int], bound: float = math.inf) -> PipelineSet | None:
        """Each chain cut for its own share, plus the sync between them; None if a cut does not fit,
        or if two chains' sync cannot come under `bound` (SyncModel.pair_floor: not priced)."""
        costs = []
        for chain, m in zip(chains, shares):
            cost = self.search(m).price(chain, math.inf)
            if cost is None:
                return None
            costs.append(cost)
        if bound < math.inf and len(costs) == 2 and self._sync.pair_floor(costs, self.compression) >= bound:
            return None
        sync = self._sync.costs(costs, self.compression)
        return PipelineSet(costs, sync, plan_step_s(costs, sync))

    def sync_floor(self, first: NodeProfile, second: NodeProfile, least_end: int = 1) -> float:
        """What the sync of two pipelines starting on these nodes, each first stage holding at least
        `least_end` layers, adds at least to the slower one's step (SyncModel.first_group_floor),
        remembered per pair and least end."""
        key = (first.name, second.name, least_end)
        if key not in self._sync_floors:
            self._sync_floors[key] = self._sync.first_group_floor(first, second, self.compression, least_end)
        return self._sync_floors[key]

    def sync_tail(self, a: list[NodeProfile], m1: int, b: list[NodeProfile], m2: int) -> float:
        """sync_floor for the cuts the two chains are priced with at these shares (both priced
        already: their cuts remembered), without building their costs or pricing the whole sync."""
        first, second = self.search(m1), self.search(m2)
        end = min(first.memo[first.key(a)][0][0][1], second.memo[second.key(b)][0][0][1])
        return self._sync.first_group_tail(a[0], b[0], end, (m1, m2), self.compression)

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
