"""The cut program prices each stage's range with the window its memory allows (1F1B deepens its
windows: CostModel.deepen), not the schedule's own: over own windows it took a chain across
regions to be limited by its round trips, which the deepened windows hide, and chose cuts that
shorten round trips over cuts that balance compute.

The reference is the same search with every cut of every chain simulated (chain_search's and
chain_cuts' limits lifted): on the planning bench's 6-node clusters at 8 micro-batches without
compression the plans before ran 0.9908 and 0.9894 of it (seeds 1 and 2, 2026-12-05).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

import hetlaunch.launcher.planning.chain_cuts as chain_cuts
import hetlaunch.launcher.planning.chain_search as chain_search
from hetlaunch.launcher.planning.chain_search import ChainSearch
from hetlaunch.launcher.planning.compression import NONE
from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.cut_front import suffix_rows
from hetlaunch.launcher.planning.planner import plan
from plan_reference import random_profile


def small_profile(seed: int):
    """bench/planning_time.py's 6-node clusters (its small_profile)."""
    return random_profile(random.Random(seed), 6, 3, 12)


def best_over_every_cut(cm: CostModel, chain) -> float:
    """The least simulated step of the chain over every cut that fits, each with its windows searched."""
    S, L, best = len(chain), cm.num_layers, math.inf
    for inner in itertools.combinations(range(1, L), S - 1):
        edges = (0, *inner, L)
        cuts = list(zip(edges, edges[1:]))
        if any(cm.memory_bytes(a, b, j, S) > node.memory_bytes for j, (node, (a, b)) in enumerate(zip(chain, cuts))):
            continue
        best = min(best, cm.deepen(chain, cm.evaluate(chain, cuts, ["none"] * (S - 1))).step_s)
    return best


def test_a_chain_across_regions_gets_the_cut_that_balances_compute():
    """A 4-node chain over three regions (5-15 ms links) at 38 micro-batches: memory lets its first
    stages hold 11 or more in flight. Before, its priced cut simulated 2.00 s where the best
    cut (each with its windows searched) simulated 1.29 s."""
    profile = small_profile(0)
    chain = [profile.node(name) for name in ("n2", "n0", "n5", "n4")]
    M = 38
    priced = ChainSearch(profile, M, "1f1b", NONE).price(chain, math.inf)
    best = best_over_every_cut(CostModel(profile, M, "1f1b", NONE), chain)
    assert priced.step_s <= best * 1.01, (priced.step_s, best)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [1, 2])
def test_plans_equal_the_plan_of_every_cut_on_the_benchs_clusters(monkeypatch, seed):
    profile = small_profile(seed)
    got = plan(profile, 8, "1f1b", max_pipelines=6, compression=NONE)
    with monkeypatch.context() as patched:
        patched.setattr(chain_search, "EVERY_CHAIN_MAX_CUTS", 10**6)
        patched.setattr(chain_cuts, "ENUMERATE_MAX_CUTS", 10**6)
        want = plan(profile, 8, "1f1b", max_pipelines=6, compression=NONE)
    assert got.tokens_per_s >= want.tokens_per_s * (1 - 1e-9), (got.tokens_per_s, want.tokens_per_s)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_the_programs_windows_are_the_caps_deepen_searches_up_to(schedule):
    """Each range's window in the program (inlined for speed) is CostModel.window_cap, the deepest
    window CostModel.deepen may give it, where the program prices a window term at all (1F1B's
    one-bottleneck closed form; GPipe's and ZB-H1's fronts keep every term apart, without one)."""
    rng = random.Random(7)
    for _ in range(20):
        profile = random_profile(rng, rng.randint(2, 5), rng.randint(1, 3), rng.randint(4, 12),
                                 memory_gb=(0.05, 4.0))  # some ranges fit fewer than their own window
        M = rng.randint(1, 40)
        cm = CostModel(profile, M, schedule, NONE)
        S, L = len(profile.nodes), cm.num_layers
        static, activation = cm.layer_prefixes()
        following = [[(0.0, 0.0, 0.0, 0.0, 0, -1, "none")]] * (L + 1)  # every end can be followed
        for node in profile.nodes:
            for j in range(S - 1):
                for i in range(L):
                    rows = suffix_rows(i, cm.time_prefix(node), static, activation, node.memory_bytes,
                                       cm.rules.in_flight(j, S, M), M, chain_cuts.window_rule(cm), following, L)
                    # every range that fits the stage's memory, up to the first that does not
                    assert [end for end, *_ in rows] == list(range(i + 1, i + 1 + len(rows)))
                    assert len(rows) == L - i or cm.memory_bytes(i, i + 1 + len(rows), j, S) > node.memory_bytes
                    for end, _, _, window in rows:
                        want = cm.window_cap(node, i, end, j, S) if cm.rules.one_bottleneck else 0
                        assert window == want, (schedule, M, node.name, i, end, j, S)


def test_chains_are_ranked_by_the_step_the_program_minimised():
    """Six nodes, one pipeline of 128 micro-batches: chains too long to simulate each (stages x M
    past SIMULATE_EVERY_CHAIN) are ranked by their program's step before the best are simulated.
    Ranked by the own-window closed form instead, the program's cut of n4 n2 n0 n3 n5, which
    simulates 3.77 s, lost its place among the finalists and the plan ran 4.26 s."""
    profile = random_profile(random.Random(358198), 6, 2, 14)
    got = plan(profile, 128, "1f1b", max_pipelines=1, compression=NONE)
    cm = CostModel(profile, 128, "1f1b", NONE)
    chain = [profile.node(name) for name in ("n4", "n2", "n0", "n3", "n5")]
    assert got.step_s <= cm.deepen(chain, chain_cuts.cut_chain(cm, chain)).step_s
