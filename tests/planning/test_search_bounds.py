"""The bounds that let the search skip work are bounds: a cut's floor (launcher/planning/sim_floor.py)
is never above its simulation, whatever its windows, and a chain the chain bounds
(launcher/planning/chain_bounds.py) rule out has no cut that prices below the bound."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hetlaunch.launcher.planning.chain_search import ChainSearch
from hetlaunch.launcher.planning.compression import NONE, CompressionConfig
from hetlaunch.launcher.planning.windows import admissible
from plan_reference import random_profile


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
