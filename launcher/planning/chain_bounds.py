"""Can a chain beat a step at all? Cheap tests that rule a chain out before any of its cuts is
priced (launcher/planning/chain_search.py ChainSearch.price), each exact over every cut that fits
memory, so a chain they rule out could not have won.

* `fills_under`: every closed form (runtime/schedules.py) and every simulation of whole backwards
  is at least M max_j t_j (a stage runs its M micro-batches, its optimizer's share included), so
  a chain can beat `bound` only if some cut keeps every t_j under bound / M. One greedy fill
  decides it with stages allowed to be empty: each stage takes the furthest end that stays under
  and fits its memory. Exact for that relaxation (prefix sums only grow), so it rules out only
  chains that truly cannot. (With every stage kept to at least one layer, the greedy is not
  exact: a fast first stage that takes the most it can may leave a slow later node a layer it
  cannot run under the limit, where a shorter first stage would have fit — it once ruled out
  chains that could win.)
* `floors_under`, where the chain is priced by simulation: a cut's simulation is at least its
  floor (launcher/planning/sim_floor.py), and stage j's floor is at least

      A_j + M l_j    with  A_j = sum_{k<j} (l_k / 3 + g l_k + (1 + h) hop_k)

  where l_k is stage k's layer time per micro-batch (a third forward, two thirds backward),
  hop_k the least a message can take on boundary k (latency, the smallest activation at its
  most compressing codec), and, where every stage after the first ends on a full backward
  (1F1B, GPipe), g = 2/3 and h = 1: its last gradient climbs back through every stage before
  it; else g = h = 0. A dynamic program over (stage, end) keeps the least A per end (a smaller
  A only loosens later stages), so it decides exactly whether some cut keeps every stage's
  term under the bound. Unlike a balanced bound over the fastest node, this keeps each node at
  its own speed and charges the fill and drain that dominate at few micro-batches.

A split backward (ZB) is simulated from the I and W a node measured, which need not add up to
the B these terms charge, so its simulated chains are not ruled out here (ChainSearch.may_beat).
"""

from __future__ import annotations

import bisect
import heapq
import math

from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.profile_file import NodeProfile

SLACK = 1e-9  # only what is clearly at or above the bound is ruled out (rounding stays on the safe side)
# The sweep's key A - c acc[start] and the price A + work / 3 + g work + hop, each rounded (u = 2^-53):
# the key within about 2u (A + c acc[start]) of its value, the price within (5A + 8c work + hop)u of
# A + c work + hop; so a start picked by its key is priced within KEY_ERROR (max A + 2c acc[last] +
# hop) of the least, twice over, with room to spare.
KEY_ERROR = 16 * 2.0**-53
FLOOR_BISECTIONS = 12  # per_microbatch_floor: to 1/4096 of the interval between the shared-work floor and one node's all


def fills_under(cm: CostModel, chain: list[NodeProfile], bound: float) -> bool:
    """False when every cut that fits memory has a stage with M t_j >= bound."""
    return _reaches_the_end(chain, [cm.time_prefix(node) for node in chain],
                            cm.memory_prefixes(len(chain)), bound / cm.M * (1 + SLACK))


def _reaches_the_end(chain: list[NodeProfile], times: list[list[float]], memory: list[list[float]],
                     limit: float) -> bool:
    """Whether stages that may be empty, each under `limit` and its node's memory, hold every layer."""
    start, L = 0, len(times[0]) - 1
    for node, acc, mem in zip(chain, times, memory):
        start = min(bisect.bisect_right(acc, acc[start] + limit) - 1,
                    bisect.bisect_right(mem, mem[start] + node.memory_bytes) - 1)
        if start == L:
            return True
    return False


def floors_under(cm: CostModel, chain: list[NodeProfile], bound: float, hops: list[float],
                 drains: bool) -> bool:
    """False when every cut that fits memory has a stage whose floor term (above) is >= bound.
    `hops[k]`: the least time a message takes on boundary k; `drains`: every stage after the
    first ends on a full backward."""
    S = len(chain)
    g, h = (2 / 3, 1.0) if drains else (0.0, 0.0)
    return floors_program([cm.layer_prefix(node) for node in chain], cm.memory_prefixes(S),
                          [node.memory_bytes for node in chain], cm.optimizer_prefix(chain[0]), list(hops), cm.M,
                          bound * (1 + SLACK), g, h)


def floors_program_python(layers: list[list[float]], memory: list[list[float]], capacities: list[int],
                          optimizer: list[float], hops: list[float], M: int, limit: float, g: float, h: float) -> bool:
    """floors_under's dynamic program over (stage, end) on plain lists: per stage its node's layer
    and memory prefix sums and its node's memory; the first stage's optimizer prefix sums; the
    hops. What launcher/planning/_floors.c computes (the same answers; its searches are faster).

    Each end keeps the least A over the starts that reach it. Visiting every (start, end) pair
    was quadratic in the layers (6 nodes and 1,000 layers planned in 30 s, two thirds of it
    here), so per stage: each start's furthest end by bisection (its term and memory only grow
    with the end: prefix sums of times and bytes that are not negative, a profile's), then one
    sweep over the ends with the starts that reach them in a heap by A - c acc[start], c = 1/3 + g
    (A + work / 3 + g work is that plus c acc[end], the same for every start), and the heap's least
    start priced as before. The key is rounded at the size of acc[start], all the node's layers
    before the stage, and the price at the size of the stage: where a node is slow on layers it
    does not hold, picking by the key chose a start 0.55% above the least (a review; 5 million
    times SLACK, enough to rule out a chain that wins). So the sweep is taken only where the two
    roundings (KEY_ERROR below) cannot add up, over the stages, to a quarter of SLACK of the limit;
    elsewhere the stage visits every pair as before. Either way no chain that can come under the
    bound is ruled out."""
    S, L = len(layers), len(optimizer) - 1
    per_work = 1 / 3 + g
    states = {0: 0.0}  # end of the stages so far -> least A over the cuts reaching it
    for j in range(S):
        acc, mem, capacity = layers[j], memory[j], capacities[j]
        opt = optimizer if j == 0 else None  # stage 0's floor ends with its optimizer (nothing climbs back to it)
        last = L if j == S - 1 else L - (S - 1 - j)
        if last < 1:
            return False  # more stages than layers: no end leaves every later stage one
        hop = (1 + h) * hops[j] if j < S - 1 else 0.0
        reach = {start: _furthest_end(acc, mem, capacity, opt, M, limit, start, a, last) for start, a in states.items()}
        grown: dict[int, float] = {}
        key_error = KEY_ERROR * (max(abs(a) for a in states.values()) + 2 * per_work * acc[last] + abs(hop))
        if j == S - 1 or not key_error <= limit * SLACK / (4 * S):
            # every pair (the last stage has one end, L: each start that reaches it, priced directly)
            for start, a in states.items():
                for end in range(L if j == S - 1 else start + 1, reach[start] + 1):
                    work = acc[end] - acc[start]
                    nxt = a + work / 3 + g * work + hop
                    if nxt < grown.get(end, math.inf):
                        grown[end] = nxt
        else:
            starts, heap, at = sorted(states), [], 0
            for end in range(1, last + 1):
                while at < len(starts) and starts[at] < end:
                    start = starts[at]
                    if reach[start] > start:
                        heapq.heappush(heap, (states[start] - per_work * acc[start], start))
                    at += 1
                while heap and reach[heap[0][1]] < end:
                    heapq.heappop(heap)  # ends only grow: it reaches none of the later ones either
                if heap:
                    start = heap[0][1]
                    work = acc[end] - acc[start]
                    grown[end] = states[start] + work / 3 + g * work + hop
        if not grown:
            return False
        states = grown
    return L in states


def _furthest_end(acc: list[float], mem: list[float], capacity: float, opt: list[float] | None, M: int,
                  limit: float, start: int, a: float, last: int) -> int:
    """The last end in start + 1 .. last whose stage term stays at or under `limit` and whose
    layers fit memory, every end before it doing so too (both only grow with the end); `start`
    where none does."""
    def fits(end: int) -> bool:
        term = a + M * (acc[end] - acc[start]) + (opt[end] - opt[start] if opt else 0.0)
        return not (term > limit or mem[end] - mem[start] > capacity)

    low, high = start, last
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def least_first_stage_end(cm: CostModel, chain: list[NodeProfile], share: int, bound: float) -> int:
    """The fewest layers the chain's first stage holds in any cut that fits memory and keeps every
    later stage's share x t_j under `bound` (fills_under's argument: no step of the chain at
    `share` micro-batches comes under `bound` otherwise). Later stages filled from the last, each
    taking all it can, empty ones allowed: the least start the relaxation reaches (prefix sums
    only grow), so no such cut's first stage is shorter. The pair search's sync floor needs it:
    the two first stages' shared layers are the group whose reduction follows the step."""
    S, end = len(chain), cm.num_layers
    if S == 1 or share < 1:
        return end if S == 1 else 1
    memory, limit = cm.memory_prefixes(S), bound / share * (1 + SLACK)
    for j in range(S - 1, 0, -1):
        acc, mem = cm.layer_prefix(chain[j]), memory[j]
        end = max(bisect.bisect_left(acc, acc[end] - limit, 0, end), bisect.bisect_left(mem, mem[end] - chain[j].memory_bytes, 0, end))
        if end == 0:
            break
    return max(end, 1)


def shared_work_floor(steps: list[list[float]]) -> float:
    """Every layer at its fastest node (each node's layer times as differences of its prefix sums,
    CostModel.layer_steps), shared perfectly among the nodes: no cut's busiest stage is lower,
    whatever the order and memory."""
    # Per layer the least, summed in layer order: the arithmetic of a loop over the layers, in C
    # loops (a generator per layer was 40% of planning 6 nodes and 1,000 layers).
    return sum(map(min, zip(*steps))) / len(steps) * (1 - SLACK)


def per_microbatch_floor(cm: CostModel, chain: list[NodeProfile], least_hop: float) -> float:
    """A floor on max_j t_j over every cut of the chain that fits memory at cm's share, where t_j
    is stage j's layer time per micro-batch (no optimizer, no codec: both only add), and on the
    wire time of the least message (`least_hop`). Every step of the chain at m micro-batches is
    at least m times it (fills_under's argument), and a cut that fits at cm's share fits at any
    share at or below it. math.inf when no cut fits. Bisected on fills_under's relaxation (empty
    stages allowed), whose answer only grows with the limit."""
    S, L = len(chain), cm.num_layers
    if S > L:
        return math.inf
    layers = [cm.layer_prefix(node) for node in chain]
    memory = cm.memory_prefixes(S)
    hi = max(acc[L] for acc in layers) * (1 + SLACK)
    if not _reaches_the_end(chain, layers, memory, hi):
        return math.inf
    lo = shared_work_floor([cm.layer_steps(node) for node in chain])
    for _ in range(FLOOR_BISECTIONS):
        mid = (lo + hi) / 2
        if _reaches_the_end(chain, layers, memory, mid):
            hi = mid
        else:
            lo = mid
    return max(lo, least_hop)


try:
    from hetlaunch.launcher.planning import _floors
except ImportError:  # not built (no C compiler at install): the Python loop, same answers
    _floors = None
COMPILED = _floors is not None
floors_program = _floors.floors_under if COMPILED else floors_program_python
