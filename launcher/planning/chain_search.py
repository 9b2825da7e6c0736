"""The search among one pipeline's candidate chains (launcher/planning/chain_candidates.py):
each chain priced for one micro-batch count, remembered by what its cost depends on, and ruled
out unpriced where its bounds cannot beat the best. Each chain is cut by launcher/planning/chain_cuts.py.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from hetlaunch.launcher.planning.chain_bounds import fills_under, floors_under, per_microbatch_floor
from hetlaunch.launcher.planning.chain_candidates import candidate_chains
from hetlaunch.launcher.planning.chain_cuts import bisected, bottleneck_cut, cut_chain, simulated_best_cut
from hetlaunch.launcher.planning.compression import CompressionConfig
from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.pipeline_cost import PipelineCost
from hetlaunch.launcher.planning.profile_file import NodeProfile, Profile

EXACT_FINALISTS = 8  # chains whose every cut is priced by simulation (when they have few)
SIMULATE_EVERY_CHAIN = 256  # stages x micro-batches up to which every chain priced is priced by simulation
EVERY_CHAIN_MAX_CUTS = 128  # ... and cuts x codec choices up to which each of them tries every cut
LARGE_SIMULATION = 1024  # stages x micro-batches above which a search simulates only its best chain
SIMULATION_BUDGET = 30_000  # simulated actions per search for pricing the closed form's chains again
# The closed form is off by up to ~40% (1F1B's window over sub-chains; M < S), so chains
# within this factor of its best stay in the running for the exact ranking.
FINALIST_SLACK = 1.1


def node_classes(profile: Profile) -> tuple[dict[str, int], dict[str, int]]:
    """Per node, two small ints: its signature's (region, memory and timings: nodes alike in all of
    them are interchangeable in a chain unless a link was measured for the node itself) and its
    timings' (what compute depends on). Shareable by every search of one profile (ChainSearch's
    `classes`): a search per micro-batch share worked them out again, hashing every node's layer times."""
    linked = {name for link in profile.links if link.nodes for name in link.nodes}
    # Each distinct signature as a small int: a chain's key is hashed on every lookup, and a
    # key of full signatures (48 layer times each) cost more to hash than most lookups save.
    ids: dict[object, int] = {}
    signature = {n.name: ids.setdefault(
        ("node", n.name) if n.name in linked else
        (n.region, n.memory_bytes, tuple(n.layer_seconds), tuple(n.optimizer_seconds or ()),
         tuple(n.input_grad_seconds or ()), tuple(n.weight_grad_seconds or ()),  # a split backward's parts
         tuple(sorted((n.codec_seconds_per_byte or {}).items())), n.cipher_seconds_per_byte), len(ids))
        for n in profile.nodes}
    timings: dict[tuple, int] = {}
    timing = {n.name: timings.setdefault((tuple(n.layer_seconds), tuple(n.optimizer_seconds or ()),
                                          tuple(n.input_grad_seconds or ()), tuple(n.weight_grad_seconds or ())),
                                         len(timings))
              for n in profile.nodes}  # node -> an id shared by nodes with equal timings
    return signature, timing


class ChainSearch:
    """Prices chains for one micro-batch count, remembering chains it has seen.

    Nodes with the same region, memory and timings are interchangeable unless a link was
    measured for the node itself, so a chain is remembered by those signatures: a large
    cluster of a few device types prices each distinct chain once.
    """

    def __init__(self, profile: Profile, num_microbatches: int, schedule: str, compression: CompressionConfig,
                 paths: dict[tuple[str, ...], list[str]] | None = None,
                 classes: tuple[dict[str, int], dict[str, int]] | None = None):
        self.profile = profile
        self.paths = {} if paths is None else paths  # region orders, shareable between searches
        self.cm = CostModel(profile, num_microbatches, schedule, compression)
        # key -> (cuts, codecs, windows, step, exact): everything the chain's priced plan carries
        self.memo: dict[tuple, tuple[list[tuple[int, int]], list[str], tuple[int, ...], float, bool] | None] = {}
        self.signature, self._timing = classes or node_classes(profile)
        self._work: dict[tuple, tuple[float, float, dict[int, float]]] = {}  # (timing ids, splits) -> _work_terms
        self._times: dict[tuple[bool, bool], tuple[np.ndarray, dict[int, int]]] = {}  # _times_matrix
        self._bounds: dict[tuple, float] = {}  # chain key -> lower_bound
        self._floors: dict[tuple, float] = {}  # chain key -> per_microbatch_floor
        self._beyond: dict[tuple, float] = {}  # chain key -> the loosest bound it was ruled out under
        self._built: dict[tuple[str, ...], tuple[tuple, PipelineCost]] = {}  # node names -> (memo entry, its cost)
        self._hops: dict[tuple, tuple[float, float]] = {}  # per boundary: (least link time, its fill/drain share)
        self._smallest_output = min((layer.output_bytes for layer in profile.layers[:-1]), default=0)

    def key(self, chain: list[NodeProfile]) -> tuple:
        """What the chain's cost depends on: equal keys, equal costs."""
        return tuple(self.signature[n.name] for n in chain)

    def price(self, chain: list[NodeProfile], bound: float) -> PipelineCost | None:
        """The chain's best cut for this micro-batch count; None if no cut fits, or if the chain
        cannot beat `bound` and was not priced before."""
        key = self.key(chain)
        if key in self.memo:
            known = self.memo[key]
            if known is None:
                return None
            # The pair search prices one chain at one share in many pairs: built once per chain (the
            # stages name its nodes) while what is remembered for its key stays the same.
            names = tuple(n.name for n in chain)
            built = self._built.get(names)
            if built is not None and built[0] is known:
                return built[1]
            cuts, codecs, windows, step_s, exact = known
            cost = self.cm.evaluate(chain, cuts, codecs)
            if any(windows):
                cost = self.cm.with_windows(cost, windows)
            # An equal key is an equal simulation: the remembered step is this chain's, windows and all.
            cost = replace(cost, step_s=step_s, exact=exact)
            self._built[names] = (known, cost)
            return cost
        if self._ruled_out(chain, key, bound):
            return None
        cost = cut_chain(self.cm, chain)
        if cost is not None and len(chain) * self.cm.M <= SIMULATE_EVERY_CHAIN:
            # Cheap here: every comparison then uses what plans report, and a chain with few
            # cuts gets the simulation's best one. Under a bound, cuts that cannot come under it
            # are not simulated; a chain none of whose cuts does is ruled out, not remembered.
            cost = simulated_best_cut(self.cm, chain, cost, EVERY_CHAIN_MAX_CUTS, bound)
            if cost is None:
                self._beyond[key] = max(bound, self._beyond.get(key, -math.inf))
                return None
        self.remember(chain, cost)
        return cost

    def _ruled_out(self, chain: list[NodeProfile], key: tuple, bound: float) -> bool:
        """True when the chain cannot beat `bound` (not priced: a later bound may be looser, but a
        bound this tight or tighter needs no second look)."""
        if bound <= self._beyond.get(key, -math.inf):
            return True  # ruled out before under a bound at least as loose
        if self.lower_bound(chain) >= bound or not self.may_beat(chain, bound):
            self._beyond[key] = max(bound, self._beyond.get(key, -math.inf))
            return True
        return False

    def _ranked(self, chain: list[NodeProfile], bound: float) -> tuple[float, PipelineCost | None] | None:
        """(step, cost) as price(chain, bound) gives, for ranking chains: a long chain priced by the
        closed form and cut by bisection gets its step only, its cost None (price() builds it from
        what is remembered, the same cost, for the few chains that go on): building the stages of
        every such chain was a third of planning a global batch of 4,096. A chain remembered
        unsimulated gets its step only too: rebuilding the cost of every such chain ranked again
        (long chains are, at every micro-batch count a global batch tries) was a tenth of it."""
        key, cm = self.key(chain), self.cm
        if key not in self.memo and len(chain) * cm.M > SIMULATE_EVERY_CHAIN and bisected(cm, chain):
            if self._ruled_out(chain, key, bound):
                return None
            found = bottleneck_cut(cm, chain)
            if found is None:
                self.memo[key] = None
                return None
            cuts, codecs = found
            step = cm.closed_form_step(chain, cuts, codecs)
            self.memo[key] = (cuts, codecs, (0,) * len(chain), step, False)  # as remember() keeps evaluate's
            return step, None
        known = self.memo.get(key, ())
        if known and not known[4]:
            return known[3], None  # remembered unsimulated: its step; price() rebuilds the cost if it goes on
        cost = self.price(chain, bound)
        return None if cost is None else (cost.step_s, cost)

    def remember(self, chain: list[NodeProfile], cost: PipelineCost | None) -> None:
        self.memo[self.key(chain)] = None if cost is None else (
            [(s.layer_start, s.layer_end) for s in cost.stages], [s.codec for s in cost.stages[:-1]],
            tuple(s.window for s in cost.stages), cost.step_s, cost.exact)

    def step(self, chain: list[NodeProfile], bound: float) -> float | None:
        """price(chain, bound).step_s without building the cost when it is remembered."""
        known = self.memo.get(self.key(chain), ())
        if known != ():
            return None if known is None else known[3]
        cost = self.price(chain, bound)
        return None if cost is None else cost.step_s

    def may_beat(self, chain: list[NodeProfile], bound: float) -> bool:
        """False when no cut of the chain can price below `bound` (launcher/planning/chain_bounds.py):
        each node at its own speed, and the fill and drain of each stage's floor. Only for chains
        priced by simulation, whose price is final."""
        if bound == math.inf:
            return True
        cm, S = self.cm, len(chain)
        if S * cm.M > SIMULATE_EVERY_CHAIN:
            # Priced by the closed form, which `best` ranks with FINALIST_SLACK and then simulates:
            # a chain above the bound there can still simulate fastest, so none is ruled out.
            return True
        if cm.splits_backward(S):
            return True  # a split backward is simulated from the I and W measured, which need not add up to B
        shapes = cm.stage_shapes(S)
        if not fills_under(cm, chain, bound):
            return False
        drains = all(nb and not ni and sends for _, nb, ni, _, sends in shapes[1:])
        hops = [self._hop(j, a, b)[1] / 2 for j, (a, b) in enumerate(zip(chain, chain[1:]))]
        return floors_under(cm, chain, bound, hops, drains)

    def per_microbatch_floor(self, chain: list[NodeProfile]) -> float:
        """What the chain's step at m micro-batches is at least m times, at any m whose cuts fit
        where this search's do (launcher/planning/chain_bounds.py); 0 for a split backward, whose
        measured I and W need not add up to the B the floor charges."""
        key = self.key(chain)
        if key not in self._floors:
            if self.cm.splits_backward(len(chain)):
                self._floors[key] = 0.0
            else:
                wire = max((self._hop(j, a, b)[0] for j, (a, b) in enumerate(zip(chain, chain[1:]))), default=0.0)
                self._floors[key] = per_microbatch_floor(self.cm, chain, wire)
        return self._floors[key]

    def _hop(self, j: int, a: NodeProfile, b: NodeProfile) -> tuple[float, float]:
        """Boundary j between a and b: (least link time, its fill/drain share 2 (link + latency))."""
        cm = self.cm
        key = (self.signature[a.name], self.signature[b.name], j if cm.compression.boundaries else None)
        hop = self._hops.get(key)
        if hop is None:
            c = self._smallest_output * min(cm.link_seconds_per_byte(a, b, codec) for codec in cm.codec_options(j, a, b))
            hop = self._hops[key] = (c, 2 * (c + cm.link(a, b)[1]))
        return hop

    def lower_bound(self, chain: list[NodeProfile]) -> float:
        """Every layer at its fastest node in the chain, perfectly balanced; every boundary carries
        the smallest activation with its most compressing codec and pays its latency. A bound on
        what `price` returns: on the simulation for chains it simulates, else on the closed form.
        Remembered by the chain's key (equal keys, equal costs): the pair search asks again and again."""
        key = self.key(chain)
        if key not in self._bounds:
            self._bounds[key] = self._lower_bound(chain)
        return self._bounds[key]

    def _lower_bound(self, chain: list[NodeProfile]) -> float:
        cm = self.cm
        # Compute depends on a node's timings only (not its region or memory): few distinct sets.
        distinct = {self._timing[n.name]: n for n in chain}
        types = frozenset(distinct)
        S = len(chain)
        split = cm.splits_backward(S)
        if (types, split) not in self._work:
            self._work[types, split] = self._work_terms(distinct, split)
        work, layers_only, shares = self._work[types, split]  # per micro-batch: with the optimizer's share, and without it
        # No cut's busiest stage computes less than the work without the optimizer over the chain's
        # summed shares (_work_terms; S where every node is as fast as the fastest, less for each
        # slower one), nor less than the work with it over S.
        busiest = max(work / S, layers_only / sum(shares[self._timing[n.name]] for n in chain))
        link_max = link_sum = arrivals = 0.0
        for j, (a, b) in enumerate(zip(chain, chain[1:])):
            hop = self._hop(j, a, b)  # codecs pinned by position make a hop depend on it
            link_max = max(link_max, hop[0])
            link_sum += hop[1]
            arrivals += (S - 1 - j) * hop[1] / 2  # every stage after hop j waits for it before it starts
        if S * cm.M <= SIMULATE_EVERY_CHAIN and cm.rules.closed_form_exact:
            # GPipe's closed form is its simulation without the optimizers; the simulation runs
            # them side by side after the last backwards, below a closed form that adds them all
            # up (it priced 2 stages at 1% above their simulation). Bounded without them.
            return cm.step_s(layers_only / S, link_max, layers_only + link_sum) * (1 - 1e-12)
        if S * cm.M <= SIMULATE_EVERY_CHAIN:
            # Priced by simulation, which can be below the closed form's fill and drain. Stage j
            # starts no sooner than the first activation has crossed the hops before it, computes
            # its M micro-batches, and the step ends no sooner than its last gradient has crossed
            # them back (or its optimizer has run): S steps hold every stage's waits and every
            # micro-batch's work (each layer at its fastest node); a link carries every message.
            return max((cm.M * work + arrivals) / S, (cm.M * layers_only + 2 * arrivals) / S,
                       cm.M * busiest, cm.M * link_max) * (1 - 1e-12)
        # The fill and drain without the optimizer's part: with it (its step over the micro-batches)
        # the term fell with the count faster than the rest grew where optimizer steps dwarf layer
        # times, and the bound with it (3 of 300 such chains); PairSearch.most_microbatches
        # bisects on bounds that only grow with the count.
        return cm.step_s(busiest, link_max, layers_only + link_sum) * (1 - 1e-12)  # rounding stays below

    def _work_terms(self, distinct: dict[int, NodeProfile], split: bool) -> tuple[float, float, dict[int, float]]:
        """For the nodes of these timings: the work of a micro-batch with each layer at its fastest
        node, with the optimizer's share and without, and per timing id the share of the work
        without it that a node of it does at most in the time the fastest does a unit: 1 / (the
        least ratio of its layer times to the fastest's). A cut gives node j layers I_j taking
        t_j >= (the work of I_j at the fastest) x ratio_j, so the busiest stage computes at least
        the work over the sum of the shares. Layer times only: with the optimizer's share (its
        step over the micro-batches) the ratios, and with them the bound, moved with the
        micro-batch count, and fell from 22 to 23 micro-batches on a review's two nodes, where
        PairSearch.most_microbatches bisects on bounds that only grow with it."""
        # Each node's layer times are rows of a matrix read once per search: worked out per chain's
        # node set, the columns' minima over 37 nodes and 100 layers were 280 of 350 s planning 256
        # nodes in 64 regions (a hostile review). The same numbers: a minimum and a quotient are
        # exact, and the sums add the columns' minima left to right, as sum() over lists did.
        with_optimizer, index = self._times_matrix(split, True, distinct)
        without, _ = self._times_matrix(split, False, distinct)
        rows = [index[k] for k in distinct]
        times = without[rows]
        fastest = times.min(axis=0)
        positive = fastest > 0
        if positive.all():
            least = (times / fastest).min(axis=1).tolist()
        elif positive.any():
            least = (times[:, positive] / fastest[positive]).min(axis=1).tolist()
        else:
            least = [1.0] * len(rows)
        shares = {k: 1.0 / low if low > 0 else 1.0 for k, low in zip(distinct, least)}
        return sum(with_optimizer[rows].min(axis=0).tolist()), sum(fastest.tolist()), shares

    def _times_matrix(self, split: bool, optimizer: bool,
                      distinct: dict[int, NodeProfile]) -> tuple[np.ndarray, dict[int, int]]:
        """_layer_times of every node of the profile (and of `distinct`), a row per timing id (nodes
        alike share one), and each timing id's row."""
        key = (split, optimizer)
        if key not in self._times or any(k not in self._times[key][1] for k in distinct):
            rows: list[list[float]] = []
            index: dict[int, int] = {}
            for node in (*self.profile.nodes, *distinct.values()):
                if self._timing[node.name] not in index:
                    index[self._timing[node.name]] = len(rows)
                    rows.append(self._layer_times(node, split, optimizer))
            self._times[key] = (np.array(rows, dtype=np.float64).reshape(len(rows), self.cm.num_layers), index)
        return self._times[key]

    def _layer_times(self, node: NodeProfile, split: bool, optimizer: bool) -> list[float]:
        """Per layer, the least a micro-batch's compute of it takes on the node (the optimizer's
        share of a step with it): the layer's time, or under a schedule that splits the backward,
        its forward third plus the input and weight gradients the node measured where they add up
        to less than the other two thirds (the simulation prices them, not the backward)."""
        cm = self.cm
        if optimizer:  # compute_s(node, i, i + 1) of every layer: the prefix sums' differences
            acc = cm.time_prefix(node)
            times = [b - a for a, b in zip(acc, acc[1:])]
        else:
            times = list(node.layer_seconds[:cm.num_layers])
        if split and node.input_grad_seconds is not None and node.weight_grad_seconds is not None:
            times = [t - max(0.0, 2 * layer / 3 - (i + w)) for t, layer, i, w
                     in zip(times, node.layer_seconds, node.input_grad_seconds, node.weight_grad_seconds)]
        return times

    def best(self, nodes: list[NodeProfile], stages: int | None) -> PipelineCost | None:
        """The best chain and cut: searched with the closed form, the EXACT_FINALISTS best of
        them ranked by the event simulation (CostModel.exact), which is what the plan reports."""
        best_step, best_exact, priced = math.inf, math.inf, []
        chains = list(candidate_chains(self.profile, nodes, self.cm.num_layers, stages, self.paths))
        # Most promising first: an early good bound lets the lower bound skip the rest uncut.
        bounds = [self.lower_bound(chain) for chain in chains]
        for k in sorted(range(len(chains)), key=bounds.__getitem__):
            slack = best_step * FINALIST_SLACK  # a chain priced by the closed form may simulate this much faster
            if best_step < math.inf and bounds[k] >= slack:
                break
            # A chain priced by simulation ends at or below that price (its finalist search only
            # improves on it), and one whose lower bound is at or above it cannot win: no slack
            # against such prices. Nearly all chains of 6 nodes at 48 micro-batches are simulated,
            # and pricing those within the slack of the best was most of their search.
            bound = min(slack, best_exact) if len(chains[k]) * self.cm.M <= SIMULATE_EVERY_CHAIN else slack
            if bounds[k] >= bound:
                continue
            ranked = self._ranked(chains[k], bound)
            if ranked is not None:
                priced.append((*ranked, chains[k]))
                best_step = min(best_step, ranked[0])
                if ranked[1] is not None and ranked[1].exact:
                    best_exact = min(best_exact, ranked[0])
        # Priced by the closed form (long chains), priced again by simulation while the budget
        # lasts; the EXACT_FINALISTS best then try every cut they have.
        simulated, spent = [], 0
        for _, cost, chain in sorted(priced, key=lambda entry: entry[0]):
            if len(simulated) >= EXACT_FINALISTS and spent > SIMULATION_BUDGET:
                break
            if simulated and (cost is None or not cost.exact) and len(chain) * self.cm.M > LARGE_SIMULATION:
                break  # long pipelines of many micro-batches: the closed form's best alone is simulated here
            if cost is None:
                cost = self.price(chain, math.inf)  # remembered by _ranked: its cost built only now
            simulated.append((cost if cost.exact else self.cm.deepen(chain, cost, thorough=False), chain))
            spent += 0 if cost.exact else 2 * len(chain) * self.cm.M
        best = None
        for cost, chain in sorted(simulated, key=lambda pair: pair[0].step_s)[:EXACT_FINALISTS]:
            exact = simulated_best_cut(self.cm, chain, cost)
            self.remember(chain, exact)  # this chain's cut from now on
            if best is None or exact.step_s < best.step_s:
                best = exact
        return best
