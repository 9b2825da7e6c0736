"""The bounds that let the search skip work are bounds: a cut's floor (launcher/planning/sim_floor.py)
is never above its simulation, whatever its windows, and a chain the chain bounds
(launcher/planning/chain_bounds.py) rule out has no cut that prices below the bound."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hetlaunch.launcher.planning.chain_bounds import fills_under
from hetlaunch.launcher.planning.chain_candidates import candidate_chains
from hetlaunch.launcher.planning.chain_search import SIMULATE_EVERY_CHAIN, ChainSearch
from hetlaunch.launcher.planning.compression import NONE, CompressionConfig
from hetlaunch.launcher.planning.pair_search import PairSearch, _disjoint_pairs, _pair_floor
from hetlaunch.launcher.planning.profile_file import LayerInfo, LinkProfile, ModelIdentity, NodeProfile, Profile
from hetlaunch.launcher.planning.replicas import Replicas
from hetlaunch.launcher.planning.sim_floor import stage_shapes
from hetlaunch.launcher.planning.windows import EXHAUSTIVE_VECTORS, admissible, admissible_count
from plan_reference import random_profile, uniform_profile


def _cuts(L: int, S: int):
    for bounds in itertools.combinations(range(1, L), S - 1):
        edges = (0, *bounds, L)
        yield list(zip(edges, edges[1:]))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_floor_is_below_every_simulation_of_the_cut(schedule):
    rng = random.Random(7)
    checked = 0
    for _ in range(30):
        profile = random_profile(rng, rng.randint(2, 4), rng.randint(1, 3), rng.randint(3, 6), memory_gb=(2.0, 8.0))
        M = rng.choice([1, 2, 3, 5, 8])
        search = ChainSearch(profile, M, schedule, rng.choice([NONE, CompressionConfig()]))
        cm = search.cm
        chain = rng.sample(profile.nodes, rng.randint(1, len(profile.nodes)))
        S = len(chain)
        for cuts in _cuts(cm.num_layers, S):
            codecs = [rng.choice(cm.codec_options(j, a, b)) for j, (a, b) in enumerate(zip(chain, chain[1:]))]
            cost = cm.evaluate(chain, cuts, codecs)
            floor = cm.floor(cost)
            assert floor <= cm.exact(chain, cost).step_s * (1 + 1e-12)
            if cm.rules.deepens and S > 1:
                own = [cm.rules.in_flight(j, S, M) for j in range(S)]
                for windows in itertools.islice(admissible(own, [M] * S), 20):
                    assert floor <= cm.exact(chain, cm.with_windows(cost, windows)).step_s * (1 + 1e-12)
            checked += 1
    assert checked > 40


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_chain_bounds_never_rule_out_a_chain_that_reaches_the_bound(schedule):
    rng = random.Random(11)
    ruled_out = 0
    for _ in range(25):
        profile = random_profile(rng, rng.randint(2, 4), rng.randint(1, 3), rng.randint(3, 7), memory_gb=(0.5, 4.0))
        M = rng.choice([1, 2, 4, 8])
        search = ChainSearch(profile, M, schedule, rng.choice([NONE, CompressionConfig()]))
        cm = search.cm
        chain = rng.sample(profile.nodes, rng.randint(1, min(len(profile.nodes), cm.num_layers)))
        S = len(chain)
        best = math.inf  # the least any cut that fits prices at, with its own windows or deepened
        for cuts in _cuts(cm.num_layers, S):
            if any(cm.memory_bytes(a, b, j, S) > n.memory_bytes for j, (n, (a, b)) in enumerate(zip(chain, cuts))):
                continue
            for codecs in itertools.product(*[cm.codec_options(j, a, b) for j, (a, b) in enumerate(zip(chain, chain[1:]))]):
                cost = cm.evaluate(chain, cuts, list(codecs))
                best = min(best, cost.step_s, cm.deepen(chain, cost).step_s)
        if best == math.inf:
            continue
        assert search.may_beat(chain, best * (1 + 1e-9))
        ruled_out += not search.may_beat(chain, best * 0.9)
    # The bounds do rule chains out, except under a split backward, which they leave alone (a
    # node's measured I and W need not add up to the B they charge).
    assert ruled_out > 0 if schedule != "zb-h1" else ruled_out == 0


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_per_microbatch_floor_times_m_is_below_every_cut_at_every_share(schedule):
    """The pair search's floor (ChainSearch.per_microbatch_floor, at one micro-batch): every cut
    that fits, with any codecs and windows, at any share m prices at or above m times it; and
    it is not a trivial floor (most chains come within 40% of it at M = 8)."""
    rng = random.Random(5)
    close = checked = 0
    for _ in range(25):
        profile = random_profile(rng, rng.randint(2, 4), rng.randint(1, 3), rng.randint(3, 7), memory_gb=(0.5, 4.0))
        policy = rng.choice([NONE, CompressionConfig()])
        chain = rng.sample(profile.nodes, rng.randint(1, min(len(profile.nodes), profile.model.num_layers)))
        floor = ChainSearch(profile, 1, schedule, policy).per_microbatch_floor(chain)
        if schedule == "zb-h1":
            assert floor == 0.0  # a split backward's measured parts need not add up: no floor
            continue
        for M in (1, 3, 8):
            cm, S, best = ChainSearch(profile, M, schedule, policy).cm, len(chain), math.inf
            for cuts in _cuts(cm.num_layers, S):
                if any(cm.memory_bytes(a, b, j, S) > n.memory_bytes for j, (n, (a, b)) in enumerate(zip(chain, cuts))):
                    continue
                for codecs in itertools.product(*[cm.codec_options(j, a, b) for j, (a, b) in enumerate(zip(chain, chain[1:]))]):
                    cost = cm.evaluate(chain, cuts, list(codecs))
                    best = min(best, cost.step_s, cm.exact(chain, cost).step_s, cm.deepen(chain, cost).step_s)
            assert M * floor <= best * (1 + 1e-12), (M, floor, best)
            checked += best < math.inf
            close += M == 8 and best < math.inf and best <= 1.4 * M * floor
    if schedule != "zb-h1":
        assert checked > 30 and close > 5, (checked, close)


def test_a_chain_without_a_cut_that_fits_has_an_infinite_floor():
    profile = random_profile(random.Random(3), 2, 1, 4, memory_gb=(0.001, 0.002))
    assert ChainSearch(profile, 1, "1f1b", NONE).per_microbatch_floor(profile.nodes) == math.inf


def test_pair_floor_is_the_least_over_splits():
    rng = random.Random(2)
    for _ in range(500):
        total = rng.randint(2, 70)
        first, second = (rng.choice([0.0, math.inf, rng.uniform(0.001, 5.0)]) for _ in range(2))
        want = min(max(m * first, (total - m) * second) for m in range(1, total))
        assert _pair_floor(first, second, total) == want, (first, second, total)
    assert _pair_floor(1.0, 1.0, 1) == math.inf  # one micro-batch cannot feed two pipelines


def test_disjoint_pairs_are_every_pair_without_a_shared_node():
    profile = random_profile(random.Random(4), 5, 2, 6)
    chains = list(candidate_chains(profile, profile.nodes, 6, None))
    names = [{n.name for n in c} for c in chains]
    want = {(i, j) for i, j in itertools.combinations(range(len(chains)), 2) if not names[i] & names[j]}
    got = list(_disjoint_pairs(chains))
    assert len(got) == len(set(got)) and set(got) == want and len(want) > 100


def test_fills_under_keeps_every_chain_with_a_cut_under_the_bound():
    """fills_under on its own, against every cut: it ruled out chains whose fast first node took
    the most layers it could and left a slow second node a layer above the limit, while a
    shorter first stage fit (random_profile seed 5's third draw: n0, n3, n2 at M = 8)."""
    rng = random.Random(5)
    kept_tight = 0
    for _ in range(60):
        profile = random_profile(rng, rng.randint(2, 4), rng.randint(1, 3), rng.randint(3, 7), memory_gb=(0.5, 4.0))
        M = rng.choice([1, 3, 8])
        cm = ChainSearch(profile, M, "1f1b", NONE).cm
        chain = rng.sample(profile.nodes, rng.randint(1, min(len(profile.nodes), cm.num_layers)))
        S = len(chain)
        least = min((max(cm.compute_s(n, a, b) for n, (a, b) in zip(chain, cuts)) for cuts in _cuts(cm.num_layers, S)
                     if all(cm.memory_bytes(a, b, j, S) <= n.memory_bytes for j, (n, (a, b)) in enumerate(zip(chain, cuts)))),
                    default=math.inf)
        if least == math.inf:
            continue
        assert fills_under(cm, chain, M * least * (1 + 1e-9)), [n.name for n in chain]
        kept_tight += not fills_under(cm, chain, M * least * 0.99)
    assert kept_tight > 10


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "zb-h2"])
def test_stage_shapes_from_integer_lists_equal_those_from_actions(schedule):
    """CostModel.stage_shapes takes 1F1B's and GPipe's shapes from what they are (every micro-batch
    once forward and once backward, a backward last) instead of building Actions: the floor must
    read the same shapes either way, with deeper windows too (split-backward schedules take the Actions)."""
    profile = random_profile(random.Random(1), 4, 2, 8)
    for M in (1, 2, 3, 7, 16, 100):
        for S in range(1, 9):
            cm = ChainSearch(profile, M, schedule, NONE).cm
            assert cm.stage_shapes(S) == stage_shapes(tuple(cm._actions(j, S, 0) for j in range(S))), (M, S)
            if cm.rules.deepens:
                windows = [min(M, S - j + 3) for j in range(S)]  # the floor is read for any window vector
                assert cm.stage_shapes(S) == stage_shapes(tuple(cm._actions(j, S, w) for j, w in enumerate(windows)))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "zb-h2"])
def test_a_chains_lower_bound_is_below_its_price(schedule):
    """ChainSearch.lower_bound orders and skips chains: it must never exceed what price() gives,
    whether the chain is priced by simulation (few stages x micro-batches) or the closed form,
    and under a split backward whose measured parts add up to less than the backward (it charged
    the whole backward there; found by a review helper, 2026-12-04)."""
    rng = random.Random(9)
    regimes = set()
    for _ in range(120):
        profile = random_profile(rng, rng.randint(2, 6), rng.randint(1, 3), rng.randint(4, 12), memory_gb=(1.0, 8.0))
        if rng.random() < 0.5:  # measured split backwards, their parts adding up to less or more than 2/3
            profile = profile.model_copy(update={"nodes": [n.model_copy(update={
                "input_grad_seconds": [t * rng.uniform(0.01, 0.35) for t in n.layer_seconds],
                "weight_grad_seconds": [t * rng.uniform(0.01, 0.35) for t in n.layer_seconds]}) for n in profile.nodes]})
        M = rng.choice([1, 4, 16, 64, 128])
        search = ChainSearch(profile, M, schedule, rng.choice([NONE, CompressionConfig()]))
        chain = rng.sample(profile.nodes, rng.randint(1, min(len(profile.nodes), search.cm.num_layers)))
        cost = search.price(chain, math.inf)
        if cost is None:
            continue
        regimes.add(len(chain) * M <= 256)
        assert search.lower_bound(chain) <= cost.step_s * (1 + 1e-12), (M, [n.name for n in chain])
    assert regimes == {True, False}


def test_nodes_that_differ_only_in_their_split_backward_are_priced_apart():
    """ChainSearch remembers chains by their nodes' signatures; a signature without the measured
    input and weight gradients gave a ZB chain of nodes that split cheaply the price of one whose
    nodes do not (found by a review helper, 2026-12-04)."""
    profile = uniform_profile([1.0] * 4, ["a"] * 4, num_layers=8)
    split = [n.model_copy(update={"name": f"x{i}", "input_grad_seconds": [t * 0.05 for t in n.layer_seconds],
                                  "weight_grad_seconds": [t * 0.05 for t in n.layer_seconds]})
             for i, n in enumerate(profile.nodes[:2])]
    plain = [n.model_copy(update={"name": f"y{i}"}) for i, n in enumerate(profile.nodes[2:])]
    profile = profile.model_copy(update={"nodes": split + plain})
    alone = ChainSearch(profile, 8, "zb-h1", NONE).price(plain, math.inf).step_s
    search = ChainSearch(profile, 8, "zb-h1", NONE)
    assert search.price(split, math.inf).step_s < alone * 0.9  # the split is cheap: it must show
    assert search.key(split) != search.key(plain)
    assert search.price(plain, math.inf).step_s == alone


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_the_pair_searchs_rough_floor_is_at_or_below_the_refined_one(schedule):
    """The pair search orders pairs by a rough floor per node set and ends at the first that
    cannot win, so it must stay at or below each chain's refined floor (0 under a split backward,
    where it had charged the whole backward; found by a review helper, 2026-12-04)."""
    rng = random.Random(12)
    for _ in range(20):
        profile = random_profile(rng, rng.randint(2, 5), rng.randint(1, 3), rng.randint(3, 8), memory_gb=(0.5, 4.0))
        replicas = Replicas(profile, 8, schedule, NONE, None)
        chains = list(candidate_chains(profile, profile.nodes, profile.model.num_layers, None))
        one = replicas.search(1)
        for chain, rough in zip(chains, PairSearch(replicas).rough_floors(chains)):
            assert rough <= one.per_microbatch_floor(chain), [n.name for n in chain]
            assert rough > 0 or schedule == "zb-h1"


def test_admissible_count_is_how_many_vectors_admissible_yields_or_says_too_many():
    """The window search prices every vector exhaustively only when admissible_count says there
    are at most EXHAUSTIVE_VECTORS: the count must be exact there, and above it wherever the
    vectors are more (it may stop counting early, at ten times the limit)."""
    rng = random.Random(3)
    for _ in range(3000):
        S, M = rng.randint(1, 7), rng.randint(1, 24)
        own = [min(S - j, M) for j in range(S)]
        caps = [max(o, min(M, o + rng.randint(0, 10))) for o in own]
        count = sum(1 for _ in admissible(own, caps))
        counted = admissible_count(own, caps)
        if counted <= EXHAUSTIVE_VECTORS or count <= EXHAUSTIVE_VECTORS:
            assert counted == count, (own, caps)
        else:
            assert counted > EXHAUSTIVE_VECTORS and count > EXHAUSTIVE_VECTORS, (own, caps)


def test_a_mixed_chains_lower_bound_counts_each_node_at_its_own_speed():
    """The closed form's bound had every node of a chain compute at the fastest one's speed: one
    fast node beside three 4x slower ones made it under half the price, so no mixed chain was
    ever skipped (10 nodes in 10 regions cut 3,814 chains at 200 micro-batches a pipeline; 2,162
    with each node counted at its own speed, the same plan). Still a bound: at or below the price."""
    profile = uniform_profile([4.0, 1.0, 1.0, 1.0], ["r0"] * 4, num_layers=16)
    search = ChainSearch(profile, 100, "1f1b", NONE)  # 4 stages x 100 micro-batches: the closed form
    cost = search.price(profile.nodes, math.inf)
    bound = search.lower_bound(profile.nodes)
    assert bound <= cost.step_s * (1 + 1e-12)
    assert bound >= 0.85 * cost.step_s, (bound, cost.step_s)


def test_a_chains_lower_bound_only_grows_with_its_micro_batches():
    """PairSearch.most_microbatches bisects on a chain's bounds, which must only grow with its
    share, within the shares priced by simulation and within those priced by the closed form.
    Two ways it fell, both where optimizer steps dwarf layer times (a review): shares taken from
    layer times with the optimizer's part (its step over the micro-batches) moved with the count,
    and on these two nodes, each fast where the other is slow, the bound fell from 22
    micro-batches to 23; and the closed form's fill and drain carried that part too, falling
    faster than the rest grew (3 of 300 random chains, before the shares were added)."""
    nodes = [NodeProfile(name="n1", region="r0", device="d", memory_bytes=2**36, layer_seconds=[0.0491, 0.00988],
                         optimizer_seconds=[0.0135, 11.48]),
             NodeProfile(name="n0", region="r0", device="d", memory_bytes=2**36, layer_seconds=[0.00224, 1.397],
                         optimizer_seconds=[9.33, 71.8])]
    link = [LinkProfile(regions=("r0", "r0"), bandwidth_bytes_per_s=1e12, latency_s=0.0)]

    def profile(nodes: list[NodeProfile]) -> Profile:
        L = len(nodes[0].layer_seconds)
        return Profile(model=ModelIdentity(description="m", num_layers=L), micro_batch_size=1, seq_len=1,
                       layers=[LayerInfo(param_bytes=2**20, activation_bytes=2**20, output_bytes=2**20)] * L,
                       nodes=nodes, links=link)

    cases = [(profile(nodes), nodes, "1f1b")]
    rng = random.Random(1)
    for _ in range(300):
        L = rng.randint(2, 5)
        drawn = []
        for i in range(rng.randint(2, 4)):
            times = [10 ** rng.uniform(-3, 1) for _ in range(L)]
            drawn.append(NodeProfile(name=f"n{i}", region="r0", device="d", memory_bytes=2**36, layer_seconds=times,
                                     optimizer_seconds=[10 ** rng.uniform(-3, 1) * rng.choice([1, 10, 100])
                                                        for _ in range(L)]))
        cases.append((profile(drawn), rng.sample(drawn, rng.randint(2, min(len(drawn), L))),
                      rng.choice(["1f1b", "zb-h2", "gpipe"])))
    for prof, chain, schedule in cases:
        simulated = SIMULATE_EVERY_CHAIN // len(chain)  # above: priced by the closed form
        for shares in (range(1, min(simulated, 30) + 1), range(simulated + 1, simulated + 21)):
            bounds = [ChainSearch(prof, m, schedule, NONE).lower_bound(chain) for m in shares]
            assert all(a <= b for a, b in zip(bounds, bounds[1:])), (schedule, [n.name for n in chain], shares, bounds)


def _work_terms_by_lists(search: ChainSearch, chain, split: bool):
    """ChainSearch._work_terms as first written, a list per node and a column at a time: the
    reference its matrix form (one row per node, read once per search) must equal to the bit."""
    distinct = {search._timing[n.name]: n for n in chain}
    with_optimizer = [[search.cm.compute_s(n, i, i + 1) for i in range(search.cm.num_layers)]
                      for n in distinct.values()]
    without = {k: list(n.layer_seconds[:search.cm.num_layers]) for k, n in distinct.items()}
    if split:
        with_optimizer = [search._layer_times(n, True, True) for n in distinct.values()]
        without = {k: search._layer_times(n, True, False) for k, n in distinct.items()}
    fastest = [min(column) for column in zip(*without.values())]
    shares = {}
    for k, times in without.items():
        least = min((t / f for t, f in zip(times, fastest) if f > 0), default=1.0)
        shares[k] = 1.0 / least if least > 0 else 1.0
    return sum(min(column) for column in zip(*with_optimizer)), sum(fastest), shares


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_chains_work_terms_from_the_matrix_equal_those_from_lists(schedule):
    """Worked out per chain's node set from lists, they were 280 of 350 s planning 256 nodes in 64
    regions (a hostile review); read from one matrix per search they must stay the same numbers."""
    rng = random.Random(41)
    for _ in range(200):
        profile = random_profile(rng, rng.randint(1, 7), rng.randint(1, 3), rng.randint(1, 30))
        if rng.random() < 0.3:  # some layers free on some nodes: the quotient skips them
            nodes = [n.model_copy(update={"layer_seconds": [0.0 if rng.random() < 0.3 else t for t in n.layer_seconds]})
                     for n in profile.nodes]
            profile = profile.model_copy(update={"nodes": nodes})
        search = ChainSearch(profile, rng.choice([1, 4, 33]), schedule, NONE)
        chain = rng.sample(profile.nodes, rng.randint(1, len(profile.nodes)))
        split = search.cm.splits_backward(len(chain))
        got = search._work_terms({search._timing[n.name]: n for n in chain}, split)
        want = _work_terms_by_lists(search, chain, split)
        assert got[0].hex() == want[0].hex() and got[1].hex() == want[1].hex(), (got, want)
        assert {k: v.hex() for k, v in got[2].items()} == {k: v.hex() for k, v in want[2].items()}
