"""Two pipelines on a small cluster: every pair of disjoint chains, most promising first.

For c = 2 on clusters of up to EXHAUSTIVE_MAX_NODES nodes (launcher/planning/replicas.py) the
pair search tries every pair of disjoint chains, cheapest floor first (each chain's least
busiest-stage time per micro-batch over the cuts that fit, times its share;
launcher/planning/chain_bounds.py per_microbatch_floor), ending at the first pair whose floor
cannot beat the best, and skipping a split when the larger of the two chains' lower bounds
cannot. With up to SPLIT_ALL_MAX_MICROBATCHES micro-batches it tries every split that leaves
each chain at most the micro-batches its bounds allow under the best (most_microbatches);
beyond, the two splits either side of where the chains' steps cross (`crossing`: a chain's
step only grows with its share, so the split that minimises the slower one is searched for
outwards from the split of the two chains' floors, then by bisection). Before a pair's splits
are searched, its sync floor is raised to that of the layers its first stages must share at
least (`first_group_sync`): at 48 micro-batches on the 6-node bench clusters that rules out 64-91%
of the pairs that went on to the crossing search. Chains are priced under the best (ChainSearch.price's bound), which rules out
unsimulated a chain every one of whose cuts has its floor at or above it.

Without sync cost (no parameters) the search is exact for up to SPLIT_ALL_MAX_MICROBATCHES
micro-batches, and beyond wherever a chain's step grows with its share (not always: a chain's
best cut and windows change with its share, and a review found a step that fell with one more
micro-batch in about 8 of 2,500 random pairs under 1F1B, though no plan lost against every
split); with sync, a plan
whose best cut of a chain is not that chain's best cut for its own step, or whose sync favours
a split off the crossing, can be missed (tests/planning/test_planner_dp.py and
tests/planning/test_pair_splits.py measure it). Beyond SPLIT_ALL_MAX_MICROBATCHES the search
had taken the split in proportion to each chain's speed at half the micro-batches: on the
6-node bench clusters at 48 and 64 micro-batches that plan ran up to 7.8% below the plan of
every split; the crossing's equals it there.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

from hetlaunch.launcher.planning.chain_bounds import least_first_stage_end, shared_work_floor
from hetlaunch.launcher.planning.chain_candidates import candidate_chains
from hetlaunch.launcher.planning.chain_search import SIMULATE_EVERY_CHAIN
from hetlaunch.launcher.planning.pipeline_set import PipelineSet
from hetlaunch.launcher.planning.profile_file import NodeProfile

if TYPE_CHECKING:  # replicas.py runs the search and imports this module
    from hetlaunch.launcher.planning.replicas import Replicas

SPLIT_ALL_MAX_MICROBATCHES = 32  # two pipelines: every split tried up to this many micro-batches


class PairSearch:
    """The pair search of one Replicas (its chain searches by share and its pricing with sync)."""

    def __init__(self, replicas: Replicas):
        self.replicas, self.M = replicas, replicas.M
        self._most: dict[tuple, dict[float, int]] = {}  # chain key -> bound -> most_microbatches under it

    def best(self, best: PipelineSet | None, worth: float) -> PipelineSet | None:
        """Every pair of disjoint chains, each at every share (or the two either side of the
        crossing of their steps when the micro-batches are many), most promising first. A pair's floor is the least, over its
        splits, of the larger of its chains' per-micro-batch floors times their shares; the
        search ends at the first pair whose floor cannot win or come under `worth`, and skips a
        split whose floor or whose chains' lower bounds cannot."""
        chains = list(candidate_chains(self.replicas.profile, self.replicas.profile.nodes, self.replicas.profile.model.num_layers, self.replicas.stages))
        one = self.replicas.search(1)  # its cuts fit wherever a larger share's do
        floors: dict[int, float] = {}
        rough = self.rough_floors(chains)
        # Pairs by a cheap floor first, refined to the chains' own floors when the pair comes up
        # (a refined floor is never lower), so only the chains of promising pairs pay for theirs.
        # Each pair's floor carries what its sync adds at least (Replicas.sync_floor): a pair of
        # fast chains whose first nodes sit across a slow link is never cut. Its chains are then
        # priced under the bound less that, which rules out more of them unsimulated.
        sync = {}
        queue = []
        for i, j in _disjoint_pairs(chains):
            sync[i, j] = self.replicas.sync_floor(chains[i][0], chains[j][0])
            queue.append((_pair_floor(rough[i], rough[j], self.M) + sync[i, j], False, i, j))
        heapq.heapify(queue)
        seen: set[tuple] = set()
        while queue:
            floor, refined, i, j = heapq.heappop(queue)
            if floor >= min(best.step_s if best else math.inf, worth):
                break
            if not refined:
                for k in (i, j):
                    if k not in floors:
                        floors[k] = one.per_microbatch_floor(chains[k])
                heapq.heappush(queue, (_pair_floor(floors[i], floors[j], self.M) + sync[i, j], True, i, j))
                continue
            a, b = chains[i], chains[j]
            bound = min(best.step_s if best else math.inf, worth) - sync[i, j]
            most_a, most_b = self.most_microbatches(a, bound), self.most_microbatches(b, bound)
            if most_a < max(1, self.M - most_b):
                continue  # no split leaves both chains a chance
            sync_ij = self.first_group_sync(a, self.M - most_b, b, self.M - most_a, bound)
            if _pair_floor(floors[i], floors[j], self.M) + sync_ij >= bound + sync[i, j]:
                continue  # their first stages must share so many layers that the sync ends too late
            bound += sync[i, j] - sync_ij
            if self.M <= SPLIT_ALL_MAX_MICROBATCHES:
                splits = [(m, self.M - m) for m in range(max(1, self.M - most_b), most_a + 1)]
            else:
                guess = self.M * floors[j] / (floors[i] + floors[j]) if floors[i] + floors[j] > 0 else self.M / 2
                splits = self.crossing(a, b, bound, guess if math.isfinite(guess) else self.M / 2)
            for m1, m2 in splits:
                bound = min(best.step_s if best else math.inf, worth)
                chain_bound = bound - sync_ij  # what each chain's step must come under
                if max(m1 * floors[i], m2 * floors[j]) >= chain_bound:
                    continue
                key = (self.replicas.search(m1).key(a), m1, self.replicas.search(m2).key(b), m2)
                if key in seen:
                    continue  # the same node types in the same places: the same cost
                seen.add(key)
                first, second = self.replicas.search(m1), self.replicas.search(m2)
                if max(first.lower_bound(a), second.lower_bound(b)) >= chain_bound:
                    continue
                step_a = first.step(a, chain_bound)
                if step_a is None or step_a >= chain_bound:
                    continue
                step_b = second.step(b, chain_bound)
                if step_b is None or step_b >= chain_bound:
                    continue
                if max(step_a, step_b) + self.replicas.sync_tail(a, m1, b, m2) >= bound:
                    continue  # their own cuts' first sync group ends too late
                found = self.replicas.price([a, b], [m1, m2], bound)
                if found is not None and found.step_s < bound:
                    best = found
        return best

    def first_group_sync(self, a: list[NodeProfile], least_a: int, b: list[NodeProfile], least_b: int,
                         bound: float) -> float:
        """What the pair's sync adds at least to the slower step, where each chain's step comes
        under `bound` at a share of at least least_a (least_b) micro-batches: their first stages
        then hold at least the layers the later stages cannot take under it
        (chain_bounds.least_first_stage_end), and their shared layers, the group whose reduction
        follows the step, at least the fewer of the two (Replicas.sync_floor with that end). Not
        where a chain splits its backward: its stage times are not bounded by whole backwards."""
        first, second = self.replicas.search(max(1, least_a)), self.replicas.search(max(1, least_b))
        if math.isinf(bound) or first.cm.splits_backward(len(a)) or second.cm.splits_backward(len(b)):
            return self.replicas.sync_floor(a[0], b[0])
        least_end = min(least_first_stage_end(first.cm, a, max(1, least_a), bound),
                        least_first_stage_end(second.cm, b, max(1, least_b), bound))
        return self.replicas.sync_floor(a[0], b[0], least_end)

    def crossing(self, a: list[NodeProfile], b: list[NodeProfile], bound: float,
                 guess: float) -> list[tuple[int, int]]:
        """The splits (m, M - m) either side of where a's step at m meets b's at M - m: the first m
        at which a is no longer the faster, and the one before. A chain's step only grows with its
        share, so the slower of the two is least at one of them. The first is searched for from
        `guess` (a's share by the chains' per-micro-batch floors) outwards, by steps that double,
        then by bisection, within the shares the bounds leave (most_microbatches), each chain
        priced under `bound`: a chain at or above it counts as the slower. Pairs mostly cross near
        their floors' split, so few shares far from it are priced. [] where no split comes under."""
        M = self.M
        low, high = max(1, M - self.most_microbatches(b, bound)), self.most_microbatches(a, bound)
        if low > high:
            return []

        def a_faster(m: int) -> bool | None:
            """Whether a is the faster at split m; None where neither comes under the bound (then no
            split does: a share above m only slows a, one below only slows b)."""
            step_a = self.replicas.search(m).step(a, bound)
            step_b = self.replicas.search(M - m).step(b, bound)
            a_under, b_under = step_a is not None and step_a < bound, step_b is not None and step_b < bound
            if not (a_under or b_under):
                return None
            return a_under and (not b_under or step_a < step_b)

        # The first m in [low, high + 1] where a is not the faster (high + 1: a is faster throughout).
        # From `at`, probes step away by doubling strides (up where a is the faster there, else
        # down) until one answers otherwise or leaves the range; the crossing lies between.
        at = min(max(round(guess), low), high)
        faster = a_faster(at)
        if faster is None:
            return []
        direction, stride = (1 if faster else -1), 1
        while True:
            probe = at + direction * stride
            found = a_faster(probe) if low <= probe <= high else not faster  # past the range: as if it changed
            if found is None:
                return []
            if found != faster:
                break
            at, stride = probe, 2 * stride
        low, high = (at + 1, min(probe, high + 1)) if faster else (max(probe, low - 1) + 1, at)
        while low < high:  # a is faster below `low`, not the faster at `high` (or high is past the range)
            mid = (low + high) // 2
            found = a_faster(mid)
            if found is None:
                return []
            low, high = (mid + 1, high) if found else (low, mid)
        return [(m, M - m) for m in (low - 1, low) if 1 <= m <= M - 1]

    def most_microbatches(self, chain: list[NodeProfile], bound: float) -> int:
        """The most micro-batches, of 1 .. M - 1, at which the chain's bounds (ChainSearch
        lower_bound and may_beat, each over every cut that fits) leave it a chance to come under
        `bound`; 0 at none. A pair can win only at a split that gives each chain at most its
        most, so the splits outside are never priced. Both bounds only grow with the micro-batches,
        so the most is bisected, apart in the two ranges where may_beat simulates and where it
        rules nothing out; and it only shrinks with the bound, so a bound bisects below the
        answer of the tightest looser bound asked before (each pair asks under its own bound)."""
        if math.isinf(bound):
            return self.M - 1
        key = self.replicas.search(1).key(chain)
        known = self._most.setdefault(key, {})
        if bound in known:
            return known[bound]
        # At most a looser bound's answer: pairs ask under their own bounds (less their sync floors).
        S, top = len(chain), min((most for looser, most in known.items() if looser >= bound), default=self.M - 1)

        def may(m: int) -> bool:
            search = self.replicas.search(m)
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
        known[bound] = most
        return most

    def rough_floors(self, chains: list[list[NodeProfile]]) -> list[float]:
        """Per chain, a floor at or below its per_microbatch_floor that depends on its node set only:
        each layer at the set's fastest node, the work shared perfectly among them (the layers'
        times alone, which every stage's per-micro-batch time includes)."""
        by_set: dict[frozenset, float] = {}
        out = []
        cm = self.replicas.search(1).cm
        for chain in chains:
            if cm.splits_backward(len(chain)):
                out.append(0.0)  # a split backward: per_microbatch_floor has none either
                continue
            names = frozenset(n.name for n in chain)
            if names not in by_set:
                by_set[names] = shared_work_floor([cm.layer_steps(n) for n in chain])
            out.append(by_set[names])
        return out

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
