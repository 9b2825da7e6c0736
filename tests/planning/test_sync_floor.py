"""The pair search's sync floors (launcher/planning/sync_cost.py): what two pipelines' gradient sync
adds at least to the slower one's step, whatever their cuts and shares (first_group_floor), once
the cuts are known (first_group_tail: the group of layer 0; pair_floor: every group). The search
prunes pairs and splits by them before cutting chains or pricing the sync, so none may exceed what
a plan of the pair is priced at, and the plans it returns must be the plans of the search without
them. Up to exact ties: the floors change the order pairs are tried in, and of two pairs priced
at the same step the first tried is kept (a review found 2 such plans in about 680, 0.07% apart
once polished; these clusters have none)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hetlaunch.launcher.planning import replicas as replicas_module
from hetlaunch.launcher.planning.chain_bounds import least_first_stage_end
from hetlaunch.launcher.planning.compression import NONE, CompressionConfig
from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.planner import plan
from hetlaunch.launcher.planning.sync_cost import SyncModel, plan_step_s
from plan_reference import random_profile

POLICIES = {"none": NONE, "auto": CompressionConfig()}


def _random_cut(rng: random.Random, stages: int, layers: int) -> list[tuple[int, int]]:
    ends = sorted(rng.sample(range(1, layers), stages - 1)) + [layers]
    return list(zip([0] + ends[:-1], ends))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", range(4))
def test_the_floor_is_below_the_price_of_any_cut_and_share(seed, policy):
    rng = random.Random(seed)
    profile = random_profile(rng, 6, 3, 12)
    sync, compression = SyncModel(profile), POLICIES[policy]
    M = rng.choice([8, 24, 48])
    nodes = profile.nodes
    tight = close = 0
    for _ in range(300):
        picked = rng.sample(nodes, rng.randint(2, 6))
        split = rng.randint(1, len(picked) - 1)
        a, b = picked[:split], picked[split:]
        m = rng.randint(1, M - 1)
        costs = []
        for chain, share in ((a, m), (b, M - m)):
            cm = CostModel(profile, share, "1f1b", compression)
            costs.append(cm.exact(chain, cm.evaluate(chain, _random_cut(rng, len(chain), 12))))
        step = plan_step_s(costs, sync.costs(costs, compression))
        slower = max(c.step_s for c in costs)
        floor = sync.first_group_floor(a[0], b[0], compression)
        assert step >= slower + floor, (step, slower, floor)
        tight += floor > 0.25 * (step - slower)
        # ... where the first stages hold at least as many layers as they do (least_end) ...
        first_end = min(costs[0].stages[0].layer_end, costs[1].stages[0].layer_end)
        at_least = sync.first_group_floor(a[0], b[0], compression, least_end=rng.randint(1, first_end))
        assert floor <= at_least * (1 + 1e-6) + 1e-12 and step >= slower + at_least, (step, slower, at_least)
        # ... and the two the search asks once the cuts are known: the group of layer 0 alone, every group
        tail = sync.first_group_tail(a[0], b[0], first_end, (m, M - m), compression)
        assert floor <= tail * (1 + 1e-6) + 1e-12 and step >= slower + tail, (step, slower, tail)
        whole = sync.pair_floor(costs, compression)
        assert slower + tail <= whole * (1 + 1e-6) and step >= whole, (step, whole)
        close += whole > step - 0.1 * (step - slower)
    assert tight >= 15  # a floor that is mostly 0 would prune nothing (and pass anyway)
    assert close >= 50  # within a tenth of the sync's share of the step in a sixth of the cases at least


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed,microbatches", list(itertools.product(range(4), (8, 48))))
def test_pruning_by_it_returns_the_plan_of_the_search_without_it(seed, microbatches, policy, monkeypatch):
    profile = random_profile(random.Random(100 + seed), 6, 3, 12)
    kwargs = dict(num_microbatches=microbatches, schedule="1f1b", max_pipelines=6, compression=POLICIES[policy])
    pruned = plan(profile, **kwargs)
    monkeypatch.setattr(replicas_module.Replicas, "sync_floor", lambda self, first, second, least_end=1: 0.0)
    monkeypatch.setattr(replicas_module.Replicas, "sync_tail", lambda self, a, m1, b, m2: 0.0)
    monkeypatch.setattr(SyncModel, "pair_floor", lambda self, pipelines, compression: -math.inf)
    unpruned = plan(profile, **kwargs)
    assert pruned.tokens_per_s == unpruned.tokens_per_s

    def cuts(result):
        return [[(s.node, s.layer_start, s.layer_end, s.window, s.codec) for s in p.cost.stages] for p in result.pipelines]
    assert cuts(pruned) == cuts(unpruned)


@pytest.mark.parametrize("seed", range(3))
def test_the_least_first_stage_end_is_at_most_every_fitting_cuts(seed):
    """chain_bounds.least_first_stage_end, which the pair search's sync floor takes the first group
    from, against every cut: no cut whose later stages each keep share x layer time under the
    bound and fit memory has a shorter first stage (else the floor would prune a pair that wins)."""
    rng = random.Random(seed)
    profile = random_profile(rng, 6, 3, 12)
    exact = informative = 0
    for _ in range(120):
        chain = rng.sample(profile.nodes, rng.randint(2, 4))
        share = rng.choice([1, 4, 24])
        cm = CostModel(profile, share, "1f1b", NONE)
        S, memory = len(chain), cm.memory_prefixes(len(chain))
        total = max(cm.layer_prefix(n)[12] for n in chain)
        bound = share * total * rng.uniform(0.1, 0.6)
        least = least_first_stage_end(cm, chain, share, bound)
        fitting = []
        for cut in _every_cut(S, 12):
            later = list(zip(chain, cut, memory))[1:]
            if all(share * (cm.layer_prefix(n)[e] - cm.layer_prefix(n)[s]) < bound
                   and mem[e] - mem[s] <= n.memory_bytes for n, (s, e), mem in later):
                fitting.append(cut[0][1])
        assert all(end >= least for end in fitting), (least, min(fitting))
        exact += bool(fitting) and min(fitting) == least
        informative += least > 1
    assert informative >= 30 and exact >= 20  # a floor that is always 1 would pass the check above


def _every_cut(stages: int, layers: int):
    for ends in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0,) + ends + (layers,)
        yield list(zip(bounds, bounds[1:]))
