"""Pricing under a bound skips only work that could not come under it (2026-12-05): a chain priced
under a bound is priced as without it or ruled out, and the pair search's two new tests
(launcher/planning/pair_search.py most_microbatches) never drops a split that could win."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hetlaunch.launcher.planning.chain_cuts import ENUMERATE_MAX_CUTS, _FillAndDrain, cut_chain, simulated_best_cut
from hetlaunch.launcher.planning.chain_candidates import candidate_chains
from hetlaunch.launcher.planning.chain_search import ChainSearch
from hetlaunch.launcher.planning.compression import NONE, CompressionConfig
from hetlaunch.launcher.planning.pair_search import PairSearch
from hetlaunch.launcher.planning.replicas import Replicas
from plan_reference import random_profile


def _shape(cost):
    return [(s.layer_start, s.layer_end, s.codec, s.window) for s in cost.stages]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_a_chain_priced_under_a_bound_is_priced_as_without_it_or_ruled_out(schedule):
    rng = random.Random(5)
    under = over = 0
    for _ in range(12):
        profile = random_profile(rng, rng.randint(2, 4), rng.randint(1, 3), rng.randint(3, 7), memory_gb=(0.5, 4.0))
        M = rng.choice([2, 4, 8, 16])
        compression = rng.choice([NONE, CompressionConfig()])
        chains = list(candidate_chains(profile, profile.nodes, profile.model.num_layers, None))
        for chain in rng.sample(chains, min(6, len(chains))):
            free = ChainSearch(profile, M, schedule, compression)
            found = cut_chain(free.cm, chain)
            if found is None:
                continue
            full = simulated_best_cut(free.cm, chain, found, 128)
            options = [free.cm.codec_options(j, a, b) for j, (a, b) in enumerate(zip(chain, chain[1:]))]
            cuts = math.comb(free.cm.num_layers - 1, len(chain) - 1) * math.prod(len(o) for o in options)
            unbounded = 128 < cuts <= ENUMERATE_MAX_CUTS  # see the test below
            for bound in (full.step_s * 0.9, full.step_s, full.step_s * (1 + 1e-9), full.step_s * 1.3):
                bounded_search = ChainSearch(profile, M, schedule, compression)
                bounded = simulated_best_cut(bounded_search.cm, chain, cut_chain(bounded_search.cm, chain), 128, bound)
                if full.step_s < bound or unbounded:
                    assert bounded is not None and bounded.step_s == full.step_s, (bound, full.step_s)
                    assert _shape(bounded) == _shape(full)
                    under += 1
                else:
                    assert bounded is None
                    over += 1
                # ChainSearch.price: the same, and a chain ruled out is not remembered as priced.
                priced = bounded_search.price(chain, bound)
                if full.step_s < bound:
                    assert priced is not None and priced.step_s == full.step_s
                elif not unbounded:  # else the chain bounds (exact over every cut) may still rule it out
                    assert priced is None
                if priced is None:
                    assert bounded_search.price(chain, math.inf).step_s == full.step_s
    assert under > 20 and over > 20


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_most_microbatches_is_at_least_every_share_where_the_chain_comes_under_the_bound(schedule):
    """A pair is dropped when its chains' most micro-batches add up to less than M, so a chain's
    most must never be below a share at which it prices under the bound."""
    rng = random.Random(9)
    below_top = 0
    for _ in range(8):
        profile = random_profile(rng, rng.randint(3, 4), rng.randint(1, 3), rng.randint(3, 6), memory_gb=(0.5, 4.0))
        M = rng.choice([6, 12, 24])
        replicas = Replicas(profile, M, schedule, rng.choice([NONE, CompressionConfig()]), None)
        pairs = PairSearch(replicas)
        chains = list(candidate_chains(profile, profile.nodes, profile.model.num_layers, None))
        for chain in rng.sample(chains, min(8, len(chains))):
            steps = {m: replicas.search(m).step(chain, math.inf) for m in range(1, M)}
            priced = sorted(s for s in steps.values() if s is not None)
            if not priced:
                continue
            # Tighter and tighter, as in the pair search (a tighter bound bisects below the last answer).
            for bound in sorted({priced[0] * 0.99, priced[len(priced) // 2], priced[-1] * 1.01}, reverse=True):
                most = pairs.most_microbatches(chain, bound)
                under = [m for m, s in steps.items() if s is not None and s < bound]
                assert most >= max(under, default=0), (bound, most, under)
                below_top += most < M - 1
    assert below_top > 10  # it does rule shares out


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_fill_and_drain_prefilter_never_rules_out_a_cut_below_its_floor(schedule):
    """simulated_best_cut skips a cut that _FillAndDrain puts at or above the limit without
    building its costs: that must only ever be a cut whose own floor (sim_floor.py) is there too."""
    rng = random.Random(21)
    skipped = 0
    for _ in range(25):
        profile = random_profile(rng, rng.randint(2, 4), rng.randint(1, 3), rng.randint(3, 7), memory_gb=(0.5, 4.0))
        M = rng.choice([1, 2, 4, 8, 16])
        cm = ChainSearch(profile, M, schedule, rng.choice([NONE, CompressionConfig()])).cm
        chain = rng.sample(profile.nodes, rng.randint(2, len(profile.nodes)))
        if len(chain) > cm.num_layers:
            continue
        for cuts in itertools.islice(_cuts(cm.num_layers, len(chain)), 40):
            codecs = [rng.choice(cm.codec_options(j, a, b)) for j, (a, b) in enumerate(zip(chain, chain[1:]))]
            floor = cm.floor(cm.evaluate(chain, cuts, codecs))
            for limit in (floor * 0.5, floor * (1 - 1e-9), floor, floor * 1.5):
                if _FillAndDrain(cm, chain, limit).reaches(cuts):
                    assert floor >= limit * (1 - 1e-12), (cuts, floor, limit)
                    skipped += 1
            assert not _FillAndDrain(cm, chain, floor * 1.000001).reaches(cuts)
    assert skipped > 50


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_cuts_floor_read_without_its_costs_is_the_floor_of_its_costs(schedule):
    """simulated_best_cut reads each cut's floor with CostModel.cut_floor and builds the costs only
    of the cuts it simulates: the same number, to the bit, as the floor of the evaluated cut, so
    the cuts are ranked, ruled out and tried exactly as before."""
    rng = random.Random(8)
    compared = 0
    for _ in range(60):
        profile = random_profile(rng, rng.randint(1, 5), rng.randint(1, 3), rng.randint(2, 9), memory_gb=(0.5, 4.0))
        # Codec work and sealing add to a stage's compute, split between its forward and backward.
        nodes = [n.model_copy(update={"codec_seconds_per_byte": {"fp16": rng.uniform(0, 1e-9),
                                                                 "int8": rng.uniform(0, 2e-9)},
                                      "cipher_seconds_per_byte": rng.uniform(0, 1e-9)}) for n in profile.nodes]
        profile = profile.model_copy(update={"nodes": nodes,
                                             "data_plane_encrypt": rng.choice([None, "cross_region", "all"])})
        cm = ChainSearch(profile, rng.choice([1, 2, 4, 8, 16]), schedule, rng.choice([NONE, CompressionConfig()])).cm
        chain = rng.sample(profile.nodes, rng.randint(1, len(profile.nodes)))
        if len(chain) > cm.num_layers:
            continue
        for cuts in itertools.islice(_cuts(cm.num_layers, len(chain)), 40):
            codecs = [rng.choice(cm.codec_options(j, a, b)) for j, (a, b) in enumerate(zip(chain, chain[1:]))]
            assert cm.cut_floor(chain, cuts, codecs) == cm.floor(cm.evaluate(chain, cuts, codecs)), (cuts, codecs)
            compared += 1
    assert compared > 200


def _cuts(L: int, S: int):
    for bounds in itertools.combinations(range(1, L), S - 1):
        edges = (0, *bounds, L)
        yield list(zip(edges, edges[1:]))


def test_a_chain_kept_at_its_programs_cut_is_not_ruled_out_by_that_cut_alone():
    """Pricing tries every cut of a chain with up to 128; ChainSearch.best's finalists try up to
    ENUMERATE_MAX_CUTS. A chain between the two is priced at its dynamic program's cut, so a bound
    that rules that one cut out says nothing of the cuts a finalist would try: it is priced as
    without a bound (it had been ruled out, found by a review of this change)."""
    rng = random.Random(2)
    profile = random_profile(rng, 4, 2, 12, memory_gb=(4.0, 8.0))
    chain = profile.nodes[:4]  # 165 cuts of 12 layers into 4 stages, one codec each
    search = ChainSearch(profile, 8, "1f1b", NONE)
    found = cut_chain(search.cm, chain)
    full = simulated_best_cut(search.cm, chain, found, 128)
    bounded = simulated_best_cut(search.cm, chain, found, 128, bound=full.step_s * 0.5)
    assert bounded is not None and bounded.step_s == full.step_s
    # Beyond ENUMERATE_MAX_CUTS no finalist tries more cuts: there the bound applies.
    many = random_profile(rng, 6, 2, 12, memory_gb=(4.0, 8.0))
    six = ChainSearch(many, 8, "1f1b", NONE)
    long_chain = many.nodes[:6]  # 462 cuts
    assert simulated_best_cut(six.cm, long_chain, cut_chain(six.cm, long_chain), 128, bound=1e-9) is None


def test_bounded_pricing_over_a_sweep_of_chains_equals_unbounded_pricing_or_rules_out():
    """A wider sweep (2-5 nodes, 3-10 layers, M up to 40, every schedule, tight memory): a review
    found the bound applied inside the cut search ruling out chains whose winning cut came under
    it only after its full window search (1F1B, M = 16-32; 3 in 4,300 checks here)."""
    rng = random.Random(1)
    checked = 0
    for _ in range(400):
        profile = random_profile(rng, rng.randint(2, 5), rng.randint(1, 3), rng.randint(3, 10),
                                 memory_gb=rng.choice([(0.3, 1.5), (0.5, 4.0), (2.0, 8.0)]))
        M = rng.choice([2, 3, 5, 8, 16, 24, 32, 40])
        schedule = rng.choice(["1f1b", "1f1b", "gpipe", "zb-h1", "zb-h2"])
        compression = rng.choice([NONE, CompressionConfig()])
        chains = list(candidate_chains(profile, profile.nodes, profile.model.num_layers, None))
        for chain in rng.sample(chains, min(4, len(chains))):
            if len(chain) * M > 256:
                continue
            free = ChainSearch(profile, M, schedule, compression)
            found = cut_chain(free.cm, chain)
            if found is None:
                continue
            full = simulated_best_cut(free.cm, chain, found, 128)
            for factor in (0.98, 1.0, 1.05):
                fresh = ChainSearch(profile, M, schedule, compression)
                bounded = simulated_best_cut(fresh.cm, chain, cut_chain(fresh.cm, chain), 128, full.step_s * factor)
                if factor > 1.0:
                    assert bounded is not None and bounded.step_s == full.step_s, ([n.name for n in chain], schedule, M)
                else:  # None, or (a chain a finalist would try every cut of) priced as without the bound
                    assert bounded is None or bounded.step_s == full.step_s
                checked += 1
    assert checked > 4000
