"""The cut of a fixed chain: which contiguous layers each stage holds, and its boundary codecs.

* Exact for chains with stages x layers² up to EXACT_MAX_WORK: a dynamic program over
  (stage, first layer) keeps, per state, the Pareto front of the step-time formula's terms
  (launcher/planning/cost_model.py); the step time is increasing in all of them, so the optimum is
  on the front. Memory is a hard constraint.
* Longer chains: a bisection on the bottleneck with a greedy fill (documented heuristic;
  exact for the bottleneck when links are uniform).
* Codecs: the least lossy allowed codec per boundary whose step stays within CODEC_SLACK
  of the most effective choice (launcher/planning/compression.py).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from hetlaunch.launcher.planning.bottleneck_fill import bottleneck_bisect
from hetlaunch.launcher.planning.compression import CODEC_SLACK, LOSSINESS
from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.pipeline_cost import PipelineCost
from hetlaunch.launcher.planning.cut_front import suffix_fronts, three_term_fronts
from hetlaunch.launcher.planning.profile_file import NodeProfile

EXACT_MAX_WORK = 20_000  # stages x layers^2 up to which a chain's cut is found by the exact DP
ENUMERATE_MAX_CUTS = 300  # cuts x codec choices up to which a finalist's cut is found by simulating each
THOROUGH_EVERY_CUT = 0  # stages x micro-batches up to which every cut gets the full window search
SEARCHED_AGAIN = 3  # simulated_best_cut: the cuts whose windows are searched in full, beside the program's
BISECTIONS = 20  # long chains: the bottleneck to a millionth of its starting interval (then priced exactly)


def best_cuts(cm: CostModel, chain: list[NodeProfile]) -> PipelineCost | None:
    """The exact best layer ranges (and boundary codecs) for a fixed chain, or None if no cut fits.

    The program runs from the last stage back: a state (suffix, i) means the suffix's stages
    hold layers [i, L). Its points are (compute max, link max, 1F1B window max, suffix sum,
    next start, next point, codec out of the suffix's first stage); the suffix sum is the
    round trip from that stage to the end, which the 1F1B window term needs. The step time is
    increasing in every coordinate and every later term is increasing in them too, so
    keeping only undominated points is exact.

    A state depends on its suffix of nodes and on what its stages keep in flight (their memory
    and window terms), so states are remembered on the cost model by both: the chains an
    exhaustive search prices share most of their suffixes. Under 1F1B a stage's in-flight count
    depends on how many stages follow it only; under ZB-H1 and ZB-H2 on the whole chain's
    length too, and keyed by the nodes alone a 3-node chain cut after a 2-node one on the same
    cost model took the 2-node chain's states (a review: 66 of 600 cuts differed from a fresh
    model's, one with a stage over its memory).
    """
    S, L = len(chain), cm.num_layers
    if S > L:
        return None
    pinned = bool(cm.compression.boundaries)  # codecs pinned by position: a suffix's place matters
    held = cm.own_windows(S)
    keys = [(tuple(n.name for n in chain[j:]), j if pinned else None, held[j:]) for j in range(S)]
    start = _front(cm, chain, 0, S, keys, 0)
    if not start:
        return None
    steps = [cm.step_s(point[0], point[1], point[3], point[2]) for point in start]
    k = min(range(len(start)), key=steps.__getitem__)
    step = steps[k]
    cuts, codecs, i = [], [], 0
    for j in range(S):
        *_, end, next_k, codec = cm.suffix_fronts[keys[j]][i][k]
        cuts.append((i, end))
        codecs.append(codec)
        i, k = end, next_k
    # The step the program minimised (each range's window term over the window memory allows it,
    # cut_front.suffix_rows), not evaluate's over 1F1B's own windows: ChainSearch.best ranks the chains it does
    # not simulate each by it, and ranked by the other formula the program's cut of a 5-node chain
    # that simulates 3.77 s was never a finalist and the plan ran 4.26 s (test_window_cuts.py).
    return replace(cm.evaluate(chain, cuts, codecs[:-1]), step_s=step)


def _front(cm: CostModel, chain: list[NodeProfile], j: int, S: int, keys: list[tuple], i: int) -> list[tuple]:
    """The Pareto front of state (chain[j:], i), from the cost model's memory or worked out
    (with the states it needs) and remembered; [] when no cut of layers [i, L) fits."""
    fronts = cm.suffix_fronts.setdefault(keys[j], {})
    if i not in fronts:
        _work_out(cm, chain, j, S, keys, [i])
    return fronts[i]


def _work_out(cm: CostModel, chain: list[NodeProfile], j: int, S: int, keys: list[tuple], starts: list[int]) -> None:
    """Remembers the fronts of the states (chain[j:], i) for i in `starts`, none of them known.

    Suffix by suffix from the end: the following suffix's states at every first layer these rows
    can reach are worked out first (those not known yet, in one call), then this suffix's states
    in one call, their rows built in C where _cutfront.c was built. One state at a time, a Python
    loop over its ends was half of planning 10 one-node regions (8 s at 400 micro-batches).
    A state depends on its suffix's nodes and what their stages keep in flight (best_cuts' keys),
    so a suffix's states worked out here serve every chain that ends with it alike."""
    fronts = cm.suffix_fronts.setdefault(keys[j], {})
    L, node = cm.num_layers, chain[j]
    if j == S - 1:
        for i in starts:
            fronts[i] = []
            if cm.memory_bytes(i, L, S - 1, S) <= node.memory_bytes:
                t = cm.compute_s(node, i, L)
                fronts[i] = [(t, 0.0, cm.window_term(t, S - 1, S), t, L, -1, "none")]
        return
    last_end = L - (S - j - 1)
    static, activation = cm.layer_prefixes()
    time, held = cm.time_prefix(node), cm.rules.in_flight(j, S, cm.M)
    following = cm.suffix_fronts.setdefault(keys[j + 1], {})
    unknown = [end for end in _reachable_ends(starts, static, activation, node.memory_bytes, held, last_end)
               if end not in following]
    if unknown:
        _work_out(cm, chain, j + 1, S, keys, unknown)
    crossing = list(_crossing(cm, node, chain[j + 1], j).values())
    by_end = [following.get(end) for end in range(L + 1)]
    rule = window_rule(cm)
    if rule != "none":  # 1F1B's step depends on max(compute, link, window) only
        found = suffix_fronts(starts, time, static, activation, node.memory_bytes, held, cm.M, rule == "deepest",
                              crossing, by_end, last_end)
    else:  # GPipe, ZB-H1, ZB-H2: no window term, compute and link maxima priced apart
        found = three_term_fronts(starts, time, static, activation, node.memory_bytes, held, cm.M, crossing, by_end,
                                  last_end)
    fronts.update(zip(starts, found))


def window_rule(cm: CostModel) -> str:
    """What a row's window term divides by in the program (cut_front.suffix_rows): "none" where the
    closed form keeps every term apart (GPipe, ZB-H1), "deepest" under a deepening schedule (1F1B),
    else "own"."""
    if not cm.rules.one_bottleneck:
        return "none"
    return "deepest" if cm.rules.deepens else "own"


def _reachable_ends(starts: list[int], static: list[float], activation: list[float], memory: float,
                    in_flight: int, last_end: int) -> list[int]:
    """Every end a stage starting at one of `starts` (ascending) can take within its memory, up to
    last_end: the following states its rows read, and no others (working out every state of a
    suffix twice as many as it needs doubled the program's work). A range's memory only grows
    with its end and shrinks with its start, to the bit, so the last end that fits never moves
    back from one start to the next: one walk over the ends."""
    ends: list[int] = []
    fits = 0  # the last end that fits the start before (0: none yet)
    for i in starts:
        fits = max(fits, i)
        while fits < last_end and ((static[fits + 1] - static[i]) + in_flight * (activation[fits + 1] - activation[i])
                                   <= memory):
            fits += 1
        ends.extend(range(max(i, ends[-1] if ends else 0) + 1, fits + 1))
    return ends


def _crossing(cm: CostModel, node: NodeProfile, next_node: NodeProfile, j: int) -> dict[str, list]:
    """Per codec and end of a stage: (link, latency, codec work, codec) of its outgoing boundary.
    They depend on the end only, so they are worked out once per pair of nodes (and position,
    when codecs are pinned by position) rather than once per (start, end) pair."""
    key = (node.name, next_node.name, j if cm.compression.boundaries else None)
    if key not in cm.crossings:
        cm.crossings[key] = {codec: [(*cm.boundary_s(node, next_node, end - 1, codec), cm.codec_s(node, end - 1, codec, next_node),
                                      codec) if end > 0 else None for end in range(cm.num_layers + 1)]
                             for codec in cm.codec_options(j, node, next_node)}
    return cm.crossings[key]


def most_compressed_codecs(cm: CostModel, chain: list[NodeProfile]) -> list[str]:
    """Per boundary, the allowed codec with the shortest link time; `least_lossy_codecs` relaxes it."""
    pinned = bool(cm.compression.boundaries)  # codecs pinned by position: the boundary's place matters
    chosen = []
    for j, (a, b) in enumerate(zip(chain, chain[1:])):
        key = (a.name, b.name, j if pinned else None)
        codec = cm.squeezed.get(key)
        if codec is None:  # its boundary_s at layer 0 ranks the codecs as at any layer
            codec = cm.squeezed[key] = min(cm.codec_options(j, a, b), key=lambda c: cm.boundary_s(a, b, 0, c)[0])
        chosen.append(codec)
    return chosen


def bottleneck_cuts(cm: CostModel, chain: list[NodeProfile]) -> PipelineCost | None:
    """Heuristic for long chains: bisect the bottleneck, greedily filling each stage under it."""
    found = bottleneck_cut(cm, chain)
    return None if found is None else cm.evaluate(chain, *found)


def bottleneck_cut(cm: CostModel, chain: list[NodeProfile]) -> tuple[list[tuple[int, int]], list[str]] | None:
    """bottleneck_cuts' (cuts, codecs), not yet evaluated; None if no cut fits."""
    S, L = len(chain), cm.num_layers
    if S > L:
        return None

    squeezed = most_compressed_codecs(cm, chain)
    outputs = cm.layer_outputs()
    # Per stage, what each fill reads: its prefix sums, memory, the last end it may take, and its
    # outgoing link's seconds per byte (0 on the last stage, which sends nothing).
    per_byte = [cm.link_seconds_per_byte(a, b, codec) for a, b, codec in zip(chain, chain[1:], squeezed)]
    memory = cm.memory_prefixes(S)
    stages = [(cm.time_prefix(node), memory[j], node.memory_bytes, L - (S - 1 - j),
               per_byte[j] if j < S - 1 else 0.0) for j, node in enumerate(chain)]
    biggest = max(outputs)  # uncompressed: an upper bound
    slowest_link = max((biggest / cm.link(a, b)[0] for a, b in zip(chain, chain[1:])), default=0.0)
    best = bottleneck_bisect(stages, outputs, 0.0, max(cm.compute_s(n, 0, L) for n in chain) + slowest_link,
                             BISECTIONS)
    return None if best is None else (best, squeezed)


def bisected(cm: CostModel, chain: list[NodeProfile]) -> bool:
    """Whether cut_chain cuts this chain by bisection (too long for the exact program)."""
    return len(chain) * cm.num_layers ** 2 > EXACT_MAX_WORK


def cut_chain(cm: CostModel, chain: list[NodeProfile]) -> PipelineCost | None:
    """The chain's best cut with each boundary's most effective codec; the plan relaxes the
    codecs of the pipelines it keeps (least_lossy_codecs), not every chain the search prices."""
    return bottleneck_cuts(cm, chain) if bisected(cm, chain) else best_cuts(cm, chain)


def least_lossy_codecs(cm: CostModel, chain: list[NodeProfile], cost: PipelineCost) -> PipelineCost:
    """Per boundary, the least lossy allowed codec that keeps the link off the critical path:
    the closed form's step stays within CODEC_SLACK of the given codecs' (the most effective
    choice). `none` wherever the raw link is fast enough; a lossier codec only where it really
    buys time. Each trial changes one boundary, so it is priced from plain per-stage numbers."""
    S = len(chain)
    cuts = [(s.layer_start, s.layer_end) for s in cost.stages]
    codecs = [s.codec for s in cost.stages[:-1]]

    def terms(j: int, codec: str) -> tuple[float, float]:
        node, end = chain[j], cuts[j][1]
        compute = cm.compute_s(node, cuts[j][0], end) + cm.codec_s(node, end - 1, codec, chain[j + 1])
        return compute, cm.boundary_s(node, chain[j + 1], end - 1, codec)[0]

    compute = [cm.compute_s(node, a, b) for node, (a, b) in zip(chain, cuts)]
    link, latency = [0.0] * S, [0.0] * S
    for j in range(S - 1):
        compute[j], link[j] = terms(j, codecs[j])
        latency[j] = cm.link(chain[j], chain[j + 1])[1]
    limit = cm.closed_step(compute, link, latency) * (1 + CODEC_SLACK)
    for j in range(S - 1):
        kept = compute[j], link[j]
        for codec in sorted(cm.codec_options(j, chain[j], chain[j + 1]), key=LOSSINESS.index):
            if codec == codecs[j]:
                break  # the cut's own choice is the least lossy that is good enough
            compute[j], link[j] = terms(j, codec)
            if cm.closed_step(compute, link, latency) <= limit:
                codecs[j] = codec
                break
            compute[j], link[j] = kept
    return cm.evaluate(chain, cuts, codecs)


def simulated_best_cut(cm: CostModel, chain: list[NodeProfile], found: PipelineCost,
                       most: int | None = None, bound: float = math.inf) -> PipelineCost | None:
    """The cut and codecs of this chain that the event simulation prices best, when there are at
    most `most` to try (else `found`, priced exactly): the closed form the DP minimises is
    off by up to ~40%, so its best cut need not be the simulation's. Each cut with the 1F1B
    windows its simulation prices best (CostModel.deepen: shaped families per cut, the full
    window search for the one that wins).

    `bound`: a step the caller has no use for a chain at or above: None when the result would be
    there, else the same result as without it. Only what cannot change the result is skipped: a
    chain every one of whose cuts has its floor (a step no windows can beat) at or above the
    bound is ruled out unsimulated; any other is searched as without the bound, since a cut above
    it can still decide which cut wins before the winner's full window search brings it under
    (a review found the bound applied inside the search ruling out chains that came under it).
    A chain with more than `most` cuts but at most ENUMERATE_MAX_CUTS is priced as without a
    bound: kept at its program's cut here, it may become a finalist of ChainSearch.best, whose
    every cut is tried.

    Where the cuts times the codecs are too many but the cuts alone are not, and the policy allows
    no codec on every boundary, every cut is tried without codecs beside the program's cut with its
    own: a policy that may choose codecs then never plans slower than one that allows none, which
    prices every such cut (plans with `auto` came out up to 6.3% slower than with `none`; a
    hostile review)."""
    S, L = len(chain), cm.num_layers
    most = ENUMERATE_MAX_CUTS if most is None else most  # read at the call: a reference may lift it
    options = [cm.codec_options(j, a, b) for j, (a, b) in enumerate(zip(chain, chain[1:]))]
    cuts_to_try = math.comb(L - 1, S - 1) * math.prod(len(o) for o in options)
    if most < cuts_to_try and math.comb(L - 1, S - 1) <= most and all("none" in o for o in options):
        if cuts_to_try <= ENUMERATE_MAX_CUTS:
            bound = math.inf  # as below: priced as without a bound, a finalist's every cut may be tried
        options, cuts_to_try = [("none",)] * (S - 1), math.comb(L - 1, S - 1)
    if cuts_to_try > most:
        if most < cuts_to_try <= ENUMERATE_MAX_CUTS:
            return cm.deepen(chain, found)
        if cm.floor(found) >= bound:
            return None  # its one cut's price is at least its floor
        best = cm.deepen(chain, found)
        return None if best.step_s >= bound else best  # a NaN step goes on to the caller, as unbounded
    if bound < math.inf and cm.floor(found) >= bound and all(
            floor >= bound for floor, _, _ in _cut_floors(cm, chain, options, bound)):
        return None
    best = cm.deepen(chain, found)
    tried = {_shape(found)}
    candidates = [(floor, k, cuts, codecs) for k, (floor, cuts, codecs)
                  in enumerate(_cut_floors(cm, chain, options, best.step_s)) if _cut_shape(cuts, codecs) not in tried]
    # Most promising floor first: once a floor reaches the best simulated step, no later cut can
    # win (a simulation never beats its floor), so most cuts are never simulated, nor built.
    candidates.sort(key=lambda c: c[:2])
    shaped = []  # (step, order, cost) of the cuts priced with their windows' families only
    for floor, k, cuts, codecs in candidates:
        if floor >= best.step_s:
            break
        # Windows by their families only where there are many cuts of long schedules to try.
        cost = cm.deepen(chain, cm.evaluate(chain, cuts, codecs), thorough=S * cm.M <= THOROUGH_EVERY_CUT)
        shaped.append((cost.step_s, k, cost))
        if cost.step_s < best.step_s * (1 - 1e-12):
            best = cost
    # The best few cuts' windows searched in full: a cut's families can price it well above its
    # best windows, and which cut the program handed in (searched in full above) is the closed
    # form's choice, not the simulation's.
    for _, _, cost in sorted(shaped, key=lambda entry: entry[:2])[:SEARCHED_AGAIN]:
        if cm.floor(cost) < best.step_s:
            best = min(best, cm.deepen(chain, cost), key=lambda c: c.step_s)
    return None if best.step_s >= bound else best


def _cut_floors(cm: CostModel, chain: list[NodeProfile], options: list[list[str]], limit: float):
    """(floor, cuts, codecs) of every cut and codecs of the chain that fits memory, but cuts whose
    floor is surely at or above `limit`: those are never looked at further. The floor is read
    without building the cut's costs where the schedule allows (CostModel.cut_floor)."""
    S, L = len(chain), cm.num_layers
    times = [cm.time_prefix(node) for node in chain]
    # A stage's M micro-batches alone at or above the limit: its floor is too, where a backward is
    # one B (a split one is priced from the I and W measured, which need not add up to it).
    per_microbatch = limit / cm.M if not cm.splits_backward(S) else math.inf
    fill = _FillAndDrain(cm, chain, limit) if cm.rules.forward_backward_only else None
    for bounds in itertools.combinations(range(1, L), S - 1):
        edges = (0, *bounds, L)
        cuts = list(zip(edges, edges[1:]))
        if any(acc[b] - acc[a] >= per_microbatch for acc, (a, b) in zip(times, cuts)):
            continue  # ruled out before its costs are built (most cuts are far from balanced)
        if fill is not None and fill.reaches(cuts):
            continue  # ... and with the pipeline's fill and drain (9 in 10 of the rest on 6 nodes)
        if any(cm.memory_bytes(a, b, j, S) > node.memory_bytes for j, (node, (a, b)) in enumerate(zip(chain, cuts))):
            continue
        for codecs in itertools.product(*options):
            codecs = list(codecs)
            yield (cm.cut_floor(chain, cuts, codecs) if fill is not None
                   else cm.floor(cm.evaluate(chain, cuts, codecs))), cuts, codecs


class _FillAndDrain:
    """A floor on a cut's simulation_floor (launcher/planning/sim_floor.py) from the chain's prefix
    sums alone, for schedules whose stages run M forwards and M whole backwards (1F1B, GPipe), so
    that a cut it puts at or above `limit` is never evaluated: building a cut's costs to read its
    floor was most of pricing a short chain, and most cuts' floors are above the best step.

    Stage j > 0 starts no sooner than the first activation has crossed every stage before it
    (a forward, a third of l_k, and at least the latency lat_k each), runs M micro-batches of
    its layers (l_j each, codec work only adds) and its last gradient then still crosses back
    (at least lat_k and a backward, two thirds of l_k, each): sum_{k<j} (l_k + 2 lat_k) + M l_j.
    Stage 0: M l_0 and its optimizer."""

    def __init__(self, cm: CostModel, chain: list[NodeProfile], limit: float):
        self.layers = [cm.layer_prefix(node) for node in chain]
        self.latency = [cm.link(a, b)[1] for a, b in zip(chain, chain[1:])]
        self.optimizer = cm.optimizer_prefix(chain[0])
        self.M, self.limit = cm.M, limit * (1 + 1e-12)  # rounding keeps a cut at its floor in

    def reaches(self, cuts: list[tuple[int, int]]) -> bool:
        M, limit, before = self.M, self.limit, 0.0
        for j, (acc, (a, b)) in enumerate(zip(self.layers, cuts)):
            layers = acc[b] - acc[a]
            if before + M * layers + (self.optimizer[b] - self.optimizer[a] if j == 0 else 0.0) >= limit:
                return True
            if j < len(self.latency):
                before += layers + 2 * self.latency[j]
        return False


def _shape(cost: PipelineCost) -> tuple:
    """A cut and its codecs, windows aside."""
    return tuple((s.layer_start, s.layer_end, s.codec) for s in cost.stages)


def _cut_shape(cuts: list[tuple[int, int]], codecs: list[str]) -> tuple:
    """_shape of the cost evaluate(chain, cuts, codecs) would build (the last stage sends nothing)."""
    return tuple((a, b, codecs[j] if j < len(codecs) else "none") for j, (a, b) in enumerate(cuts))
